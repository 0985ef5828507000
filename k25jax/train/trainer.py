"""The one trainer: mesh, checkpoints, TensorBoard, the train state, the jitted step, the loop.

A supervised stage hands it a model, an optimizer, a loss and its batches:

    with Trainer.for_config(config, workdir, model, tx) as trainer:   # under jax.set_mesh
      state = trainer.start(config.init, data_iterator)
      step = trainer.train_step(loss_fn, router_bias_rate=..., qk_clip_tau=...)
      state, history = trainer.fit(state, step, batch_at, config.train, tokens_per_step=...,
                                   evaluate=..., data_iterator=data_iterator)

The RL driver (`k25jax.rl.driver`) uses the same state, step and checkpoints with its own
iteration loop. Where a run starts, in this order (`start`):
  1. the workdir's own latest readable checkpoint (a resumed run; data order included);
  2. `init.checkpoint`: the latest params of another run of the same model (a text-only
     model takes the language model of a K2.5 run's);
     `init.text_checkpoint` (K2.5): the language model from a text-only run, the rest fresh;
  3. the stage's `default_params()` (the built-in warm starts of rl and parl);
  4. a fresh init: params from key 0 of split(PRNGKey(seed)), created with their shardings.
The state's rng is key 1 of that split. The module's functions build the same pieces
without a workdir (`new_state`, `train_step`, `eval_step`: tests, compiling for a pod).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import flax.linen as nn
import jax
import ml_collections

from k25jax.model import expert_parallel, k25, transformer
from k25jax.train import (checkpoint, hf_init, loop, model_record, optimizer, preemption, sharding, state as state_lib,
                          step as step_lib)

Model = transformer.Transformer | k25.K25


def text_config(model: Model):
  """The K2 decoder's ModelConfig (the K2.5 model's language model's)."""
  return model.cfg.text if isinstance(model, k25.K25) else model.cfg


def lm_key(model: Model) -> str | None:
  """Where the decoder's params sit: params[LANGUAGE_MODEL] for K2.5, the params themselves otherwise."""
  return k25.LANGUAGE_MODEL if isinstance(model, k25.K25) else None


def abstract_params(model: Model):
  """The model's abstract params in their logical-axis boxes (no allocation)."""
  return k25.abstract_params(model.cfg) if isinstance(model, k25.K25) else transformer.abstract_params(model.cfg)


def init_params(model: Model, rng: jax.Array):
  return k25.init_params(model.cfg, rng) if isinstance(model, k25.K25) else transformer.init_params(model.cfg, rng)


def restore_params(model: Model, workdir: str, mesh: jax.sharding.Mesh, part: str | None = None,
                   step: int | None = None):
  """The latest params (or checkpoint `step`'s) of the run in `workdir`, sharded over `mesh`:
  the whole model's, or those of `params[part]` (e.g. `k25.LANGUAGE_MODEL`). A decoder (a
  text-only model, or part = LANGUAGE_MODEL) restores from a text run or from the language
  model of a K2.5 run's."""
  boxed = abstract_params(model)
  target = checkpoint.params_target(boxed if part is None else boxed[part], mesh)
  saved = checkpoint.saved_params_keys(workdir, step)
  decoder = not isinstance(model, k25.K25) or part == k25.LANGUAGE_MODEL
  under = k25.LANGUAGE_MODEL if decoder and k25.LANGUAGE_MODEL in saved else None
  if isinstance(model, k25.K25) and part is None and k25.LANGUAGE_MODEL not in saved:
    raise ValueError(f"{workdir} holds a text-only run (params {', '.join(saved)}): start the K2.5 model's "
                     "language model from it with init.text_checkpoint, not init.checkpoint")
  return checkpoint.restore_params(workdir, target, under=under, step=step)


def params_from(model: Model, init: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, seed: int):
  """The params `init` names (`init.checkpoint`; `init.text_checkpoint`: its decoder, the rest
  `fresh_params(seed)`; `init.hf_checkpoint`: a Hugging Face folder, k25jax/train/hf_init.py),
  or None when it names none."""
  given = [f"init.{name}={init.get(name)!r}" for name in ("checkpoint", "text_checkpoint", "hf_checkpoint")
           if init.get(name)]
  if len(given) > 1:
    raise ValueError(f"{' and '.join(given)}: set one (all params from a run of this model, the language model "
                     "from a text run, or the params of a Hugging Face folder)")
  if init.get("hf_checkpoint"):
    shardings = sharding.logical_to_sharding(abstract_params(model), mesh)
    return hf_init.load_params(model, init.hf_checkpoint, shardings, lambda: fresh_params(model, mesh, seed))
  if init.checkpoint:
    return restore_params(model, init.checkpoint, mesh)
  if init.get("text_checkpoint"):
    text = restore_params(model, init.text_checkpoint, mesh, k25.LANGUAGE_MODEL)
    return {**fresh_params(model, mesh, seed), k25.LANGUAGE_MODEL: text}
  return None


def abstract_state(model: Model, tx) -> state_lib.TrainState:
  """The train state's shapes, every leaf in its logical-axis box (no allocation)."""
  return state_lib.abstract(abstract_params(model), tx)


def fresh_params(model: Model, mesh: jax.sharding.Mesh, seed: int):
  """A random init from key 0 of split(PRNGKey(seed)), created with its shardings."""
  param_rng, _ = jax.random.split(jax.random.PRNGKey(seed))
  shardings = sharding.logical_to_sharding(abstract_params(model), mesh)
  return jax.jit(lambda: init_params(model, param_rng), out_shardings=shardings)()


def state_target(model: Model, tx, mesh: jax.sharding.Mesh):
  """The train state's ShapeDtypeStructs with their shardings: what a checkpoint restores
  into, and what a step compiles for without allocating."""
  abstract = abstract_state(model, tx)
  return checkpoint.abstract_target(nn.meta.unbox(abstract), sharding.logical_to_sharding(abstract, mesh))


def new_state(model: Model, tx, mesh: jax.sharding.Mesh, seed: int, params=None) -> state_lib.TrainState:
  """A state at step 0 with its shardings: `params` (or `fresh_params`), the optimizer's
  initial state, and rng key 1 of split(PRNGKey(seed))."""
  _, state_rng = jax.random.split(jax.random.PRNGKey(seed))
  params = fresh_params(model, mesh, seed) if params is None else params
  shardings = sharding.logical_to_sharding(abstract_state(model, tx), mesh)
  return jax.jit(lambda p: state_lib.create(p, tx, state_rng), out_shardings=shardings)(params)


def train_step(model: Model, tx, loss_fn: step_lib.LossFn, *, router_bias_rate: float,
               qk_clip_tau: float | None = None, batch_specs=None):
  """The jitted update of `loss_fn` (`step.make_train_step`): the router-bias rate γ, QK-Clip's
  τ (None: off), the layout of the batch (`batch_specs`, default [batch, seq] rows). Call it
  under the mesh: a large MoE without expert parallelism is refused here
  (`expert_parallel.check_layout`, against an accelerator's memory)."""
  stats = jax.local_devices()[0].memory_stats()
  expert_parallel.check_layout(text_config(model), stats.get("bytes_limit") if stats else None)
  return step_lib.make_train_step(loss_fn, tx, abstract_state(model, tx), router_gamma=router_bias_rate,
                                  first_moe_layer=text_config(model).first_k_dense_replace,
                                  qk_clip_tau=qk_clip_tau, batch_specs=batch_specs, lm_key=lm_key(model))


def eval_step(model: Model, tx, loss_fn: step_lib.LossFn, batch_specs=None):
  """The jitted `eval_step(state, batch) -> metrics` of `loss_fn` (`step.make_eval_step`)."""
  return step_lib.make_eval_step(loss_fn, abstract_state(model, tx), batch_specs=batch_specs)


def check(config: ml_collections.ConfigDict) -> None:
  """The config check of a supervised stage's length: the optimizer's schedule fits `train.steps`."""
  optimizer.check_schedule(config.optimizer, config.train.steps)


def check_rows(config: ml_collections.ConfigDict, tok, model: Model, mesh: jax.sharding.Mesh) -> None:
  """Config errors that only show once the pieces meet, each naming its field: the tokenizer's
  ids fit the model's vocabulary; `train.batch` rows of `train.seq_len` split over the mesh."""
  vocab = text_config(model).vocab_size
  if tok.vocab_size > vocab:
    field = "model.text.vocab_size" if isinstance(model, k25.K25) else "model.vocab_size"
    raise ValueError(f"data.tokenizer has {tok.vocab_size} ids but {field}={vocab}")
  sharding.check_batch(mesh, config.train.batch, "train.batch")
  if config.train.seq_len % mesh.shape["sequence"]:
    raise ValueError(f"train.seq_len={config.train.seq_len} must divide over mesh.sequence={mesh.shape['sequence']}")


class Trainer:
  """The machinery a stage does not write itself (module docstring). A context manager: it
  sets the mesh and installs the run's signal handlers (`preemption.Stopper`: SIGTERM or
  SIGINT saves at the next step boundary, then `preemption.Preempted`), and on exit waits
  for the checkpoints in flight and closes them and the writer."""

  def __init__(self, workdir: str, model: Model, tx, *, mesh: jax.sharding.Mesh, seed: int, keep_checkpoints: int,
               tokenizer: dict | None = None, checkpoint_minutes: float = 0.0):
    self.workdir, self.model, self.tx, self.mesh, self.seed = workdir, model, tx, mesh, seed
    self.checkpoints = checkpoint.Checkpoints(workdir, keep=keep_checkpoints)
    self.stopper = preemption.Stopper(self.checkpoints.directory, checkpoint_minutes)
    if jax.process_index() == 0:      # what k25jax.export rebuilds from the workdir alone
      model_record.write(workdir, model.cfg, tokenizer)
    self.writer = loop.MetricWriter(workdir)
    self._exit = contextlib.ExitStack()

  @classmethod
  def for_config(cls, config: ml_collections.ConfigDict, workdir: str, model: Model, tx,
                 mesh: jax.sharding.Mesh | None = None, tokenizer: dict | None = None) -> "Trainer":
    """A trainer on `config.mesh` (or `mesh`), seeded by `train.seed`, keeping `train.keep_checkpoints`,
    saving every `train.checkpoint_minutes` too; the workdir's model record names the
    tokenizer: `tokenizer` where given (a stage's own record, e.g. `chat_formats.LEGACY_RECORD`),
    else `data.tokenizer` where the config has one."""
    mesh = mesh if mesh is not None else sharding.make_mesh(config.mesh.to_dict())
    data = config.get("data") or {}
    if tokenizer is None and "tokenizer" in data:
      tokenizer = {"name": data["tokenizer"], "path": data.get("vocab_file", ""), "media": isinstance(model, k25.K25)}
    return cls(workdir, model, tx, mesh=mesh, seed=config.train.seed, keep_checkpoints=config.train.keep_checkpoints,
               tokenizer=tokenizer, checkpoint_minutes=config.train.get("checkpoint_minutes", 0.0))

  def __enter__(self) -> "Trainer":
    self._exit.enter_context(jax.set_mesh(self.mesh))
    self._exit.enter_context(self.stopper)
    return self

  def __exit__(self, *exc) -> None:
    self.checkpoints.close()
    self.writer.close()
    self._exit.close()

  def start(self, init: ml_collections.ConfigDict | None = None, data_iterator=None,
            default_params: Callable[[], object] | None = None) -> state_lib.TrainState:
    """The state a run starts from, in the order of the module docstring; `data_iterator` (a
    grain iterator) is set to the restored checkpoint's position."""
    state = self.checkpoints.restore_latest(state_target(self.model, self.tx, self.mesh), data_iterator)
    if state is not None:
      return state
    params = self.params_from(init) if init is not None else None
    if params is None and default_params is not None:
      params = default_params()
    return new_state(self.model, self.tx, self.mesh, self.seed, params)

  def params_from(self, init: ml_collections.ConfigDict):
    """`params_from` of this trainer's model, mesh and seed."""
    return params_from(self.model, init, self.mesh, self.seed)

  def save(self, step: int, state, data_iterator=None) -> None:
    self.checkpoints.save(step, state, data_iterator)

  def train_step(self, loss_fn: step_lib.LossFn, **kw):
    """`train_step` of this trainer's model and optimizer."""
    return train_step(self.model, self.tx, loss_fn, **kw)

  def eval_step(self, loss_fn: step_lib.LossFn, batch_specs=None):
    """`eval_step` of this trainer's model and optimizer."""
    return eval_step(self.model, self.tx, loss_fn, batch_specs)

  def fit(self, state, train_step, batch_at: Callable[[int], dict], schedule: ml_collections.ConfigDict, *,
          tokens_per_step: int, evaluate: Callable | None = None, data_iterator=None):
    """Trains from `state.step` to `schedule.steps` on `batch_at(step)` (`loop.train`), logging every
    `schedule.log_every`, evaluating every `schedule.eval_every` (when `evaluate` is given),
    saving every `schedule.checkpoint_every` steps and at the last, stopping with
    `loop.Diverged` after `schedule.max_consecutive_skipped` skipped updates in a row.
    Returns (state, history)."""
    return loop.train(state, train_step=train_step, batch_at=batch_at, total_steps=schedule.steps,
                      tokens_per_step=tokens_per_step, log_every=schedule.log_every,
                      eval_every=schedule.eval_every if evaluate is not None else schedule.steps,
                      checkpoint_every=schedule.checkpoint_every, evaluate_fn=evaluate,
                      save_fn=lambda n, s: self.save(n, s, data_iterator), writer=self.writer,
                      guard=self.skip_guard(schedule, state), stopper=self.stopper)

  def skip_guard(self, schedule: ml_collections.ConfigDict, state) -> loop.SkipGuard:
    """Stops the run after `schedule.max_consecutive_skipped` skipped updates in a row."""
    return loop.SkipGuard(schedule.max_consecutive_skipped, int(jax.device_get(state.skipped)),
                          self.checkpoints.directory)
