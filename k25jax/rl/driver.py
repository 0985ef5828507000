"""The one RL driver: iterations of rollouts → group advantages → loss rows → minibatch updates.

Per iteration i < train.steps, for P prompts (tasks) × K samples (episodes), with the
stage's `collect` and `evaluate`:

    rollouts = collect(θ, i)           P·K rollouts, each prompt's K consecutive: loss rows
                                       (rollout.loss_rows), rewards r_j, the stage's metrics
    A_j      = r_j − mean_k r_k        (losses.group_advantages: no std, no value model)
    θ       ← θ − η ∇L(θ)              the policy loss of `loss.name` (k25jax.rl.policy_loss) over
                                       `rl.minibatches` slices in order, each holding whole groups
    evaluate(θ) at iteration 0 and every train.eval_every; logs every train.log_every; a
    checkpoint every train.checkpoint_every (each also at the last iteration, `loop.due`) and
    when the trainer's stopper says one is due (train.checkpoint_minutes) or a signal asked the
    run to stop (then `preemption.Preempted`, after the iteration in flight and its save);
    `loop.Diverged` after train.max_consecutive_skipped skipped (non-finite) updates in a row

The train state counts optimizer updates: a resumed run continues at iteration
state.step // rl.minibatches. Several processes (jax.distributed): every process collects
the same rollouts (one sampler over all devices, `k25jax.rl.sampler`), so each holds every
loss row and puts its devices' slices of them (`sharding.from_host`). A stage's `run` is: task, model and start → `Trainer` →
`train(trainer, state, config, collect=..., evaluate=...)`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import ml_collections
import numpy as np
from absl import logging

from k25jax import losses
from k25jax.rl import policy_loss
from k25jax.train import loop, multimodal, optimizer, sharding, trainer as trainer_lib, warm_start


@dataclasses.dataclass
class Rollouts:
  """One iteration's rollouts: `rows` [n, seq] (rollout.loss_rows), `rewards` [n] (what the
  advantages come from), `metrics` logged with the iteration, and per-row `media` items
  when the rows carry images (the stage's `to_device` places them)."""

  rows: dict[str, np.ndarray]
  rewards: np.ndarray
  metrics: dict[str, float]
  media: list | None = None


def check(config: ml_collections.ConfigDict) -> None:
  """Errors of the rl section that the driver would otherwise meet mid-run, naming the field."""
  rl = config.rl
  if config.loss.name not in policy_loss.LOSSES:
    raise ValueError(f"config: loss.name={config.loss.name!r}: must be one of {policy_loss.LOSSES}")
  if rl.num_generations < 2:
    raise ValueError(f"rl.num_generations={rl.num_generations}: group advantages need K >= 2 samples per prompt "
                     "(an empty group has no baseline)")
  rollouts = rl.prompts_per_iteration * rl.num_generations
  if rollouts % rl.minibatches or (rollouts // rl.minibatches) % rl.num_generations:
    raise ValueError(f"rl.minibatches={rl.minibatches} must split the {rollouts} rollouts per iteration into "
                     f"minibatches of whole groups of rl.num_generations={rl.num_generations}")
  optimizer.check_schedule(config.optimizer, config.train.steps * rl.minibatches,
                           length=f"train.steps={config.train.steps} × rl.minibatches={rl.minibatches}")
  if "warm_start" in config:
    warm_start.check(config.warm_start)


def make_optimizer(config: ml_collections.ConfigDict):
  """The `optimizer` section over train.steps × rl.minibatches updates."""
  return optimizer.make_optimizer(config.optimizer, config.train.steps * config.rl.minibatches)


def update_step(config: ml_collections.ConfigDict, model, tx, *, banned: Sequence[int] = (), batch_specs=None):
  """The jitted update (state, rows) -> (state, metrics) on a minibatch of loss rows: the policy
  loss of `loss.name` over groups of rl.num_generations at rl.temperature, `banned` ids outside
  log π; call under `jax.set_mesh`."""
  loss_fn = policy_loss.make_loss(model, config.loss, group_size=config.rl.num_generations,
                                  temperature=config.rl.temperature, banned=banned)
  return trainer_lib.train_step(model, tx, loss_fn, router_bias_rate=config.train.router_bias_rate,
                                qk_clip_tau=optimizer.qk_clip_tau(config.optimizer), batch_specs=batch_specs)


def _fmt(metrics: dict, keys: Sequence[str] | None) -> str:
  keys = metrics if keys is None else [k for k in keys if k in metrics]
  return "  ".join(f"{k} {metrics[k]:.3f}" for k in keys)


def train(trainer, state, config: ml_collections.ConfigDict, *, collect: Callable[[object, int], Rollouts],
          evaluate: Callable[[object], dict] | None, name: str, log_keys: Sequence[str],
          eval_keys: Sequence[str] | None = None, summary_keys: Sequence[str] = (), banned: Sequence[int] = (),
          batch_specs=None, to_device: Callable[[dict, Rollouts, slice], dict] | None = None):
  """Runs iterations from the state's to `train.steps` (module docstring). `banned` ids are
  outside the sampler's distribution (and so outside log π); `batch_specs` / `to_device`
  lay out minibatches with media. Returns (state, history): a row per iteration
  ({"iteration", "split": "train", update and stage metrics}) and per evaluation. With media
  in `batch_specs`, a minibatch without `pixel_values` takes a text-only update (its own
  compilation). The stage
  has `check`ed the config before its setup."""
  rl, schedule = config.rl, config.train
  train_step = update_step(config, trainer.model, trainer.tx, banned=banned, batch_specs=batch_specs)
  if batch_specs is not None and set(multimodal.MEDIA) & set(batch_specs):   # text-only minibatches too
    text_specs = {name: spec for name, spec in batch_specs.items() if name not in multimodal.MEDIA}
    train_step = multimodal.media_step(
        train_step, update_step(config, trainer.model, trainer.tx, banned=banned, batch_specs=text_specs))
  if to_device is None:
    rows_sharding = sharding.batch_sharding(trainer.mesh)
    to_device = lambda rows, rollouts, part: sharding.from_host(rows, rows_sharding)
  history = []

  def run_evaluation(iteration: int, params) -> None:
    metrics = evaluate(params)
    logging.info("%s eval at iteration %d: %s", name, iteration, _fmt(metrics, eval_keys))
    trainer.writer.write(iteration, metrics, "eval")
    history.append({"iteration": iteration, "split": "eval", **metrics})

  guard = trainer.skip_guard(schedule, state)
  first = int(state.step) // rl.minibatches
  if first == 0 and evaluate is not None:
    run_evaluation(0, state.params)
  for it in range(first, schedule.steps):
    start = time.perf_counter()
    rollouts = collect(state.params, it)
    sample_s = time.perf_counter() - start
    advantages = np.asarray(losses.group_advantages(rollouts.rewards, rl.num_generations), np.float32)
    seq = rollouts.rows["mask"].shape[1]
    rows = {**rollouts.rows, "advantages": np.repeat(advantages[:, None], seq, axis=1),
            "rewards": np.repeat(np.asarray(rollouts.rewards, np.float32)[:, None], seq, axis=1)}
    size = len(advantages) // rl.minibatches
    start = time.perf_counter()
    skip_counts = []
    for m in range(rl.minibatches):
      part = slice(m * size, (m + 1) * size)
      state, metrics = train_step(state, to_device({k: v[part] for k, v in rows.items()}, rollouts, part))
      skip_counts.append(metrics["skipped_steps"])
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    train_s = time.perf_counter() - start
    for m, skipped in enumerate(skip_counts):
      guard.observe(it * rl.minibatches + m + 1, skipped)
    row = {"iteration": it + 1, "split": "train", **metrics, **rollouts.metrics, "sample_s": sample_s,
           "train_s": train_s, "train_tokens_per_s": float(rows["segment_ids"].sum() / train_s)}
    history.append(row)
    trainer.writer.write(it + 1, {k: v for k, v in row.items() if k not in ("iteration", "split")}, "train")
    if loop.due(it + 1, schedule.log_every, schedule.steps):
      logging.info("%s iteration %d/%d  %s", name, it + 1, schedule.steps, _fmt(row, log_keys))
    if evaluate is not None and loop.due(it + 1, schedule.eval_every, schedule.steps):
      run_evaluation(it + 1, state.params)
    if trainer.stopper.checkpoint(it + 1, loop.due(it + 1, schedule.checkpoint_every, schedule.steps),
                                  lambda: trainer.save(it + 1, state)):
      guard.saved(it + 1)
  evals = [h for h in history if h["split"] == "eval"]
  if evals and summary_keys:
    logging.info("%s summary: %s", name, ", ".join(f"{k} {evals[0][k]:.3f} → {evals[-1][k]:.3f}"
                                                  for k in summary_keys if k in evals[0]))
  return state, history
