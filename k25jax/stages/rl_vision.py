"""Vision RL: the K2.5 policy loss on image tasks, the image in the prompt, with or without the Python tool.

Per iteration i, for P tasks x (an image and a question: counting, locating, comparing,
reading; `k25jax.data.image_tasks`) and K episodes each:

    prompt   = BOS <|user|> <|media_begin|>image<|media_content|> N×<|media_pad|> <|media_end|>
               question <|end|> <|assistant|>              (the K2.5 model sees the image)
    episode  = multi-turn rollout under π_old (`k25jax.agents.tool_rollout`): with the tool
               (`rl.tool`), the model's code runs in a sandbox session holding the image;
               without it, a call gets an error observation and the model must answer itself
    r_j      = 1[answer_j = ground truth]
    A_j      = r_j − mean_k r_k                                        (losses.group_advantages)
    θ       ← θ − η ∇ L_K2.5(θ)  over the generated tokens only (tool outputs and the prompt are
               context), log π_θ from the K2.5 forward with the same image  (`rl.policy_loss`)

The start is a K2.5 checkpoint (`warm_start.checkpoint`): the zero-vision SFT's, a
text+vision SFT's, or joint pre-training's (no SFT). Held-out evaluation: sampled
accuracy (the training temperature, `rl.eval_samples` per task) and greedy accuracy, with
the tool-call success rate and calls per episode.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from k25jax import losses
from k25jax.agents import sandbox, tool_rollout
from k25jax.data import chat, image_tasks
from k25jax.data import vision as vision_data
from k25jax.model import k25
from k25jax.model.config import K25Config
from k25jax.rl import rollout, sampler
from k25jax.stages import rl as rl_stage
from k25jax.stages import sft as sft_stage
from k25jax.train import checkpoint, loop, multimodal, optimizer, sharding, step

LM = "language_model"
ROW_FEATURES = ("inputs", "targets", "positions", "segment_ids", "mask", "old_logp", "advantages", "rewards")


# ------------------------------------------------------------------------------- the loss
def make_loss(config, model: k25.K25):
  """loss_fn(params, batch, rng): the policy loss (`loss.name`) on log π_θ of the generated tokens,
  computed by the K2.5 model with each row's image, over the tokens the sampler may draw."""
  score = rl_stage.policy_loss(config.loss, config.rl.num_generations)
  banned = tool_rollout.banned_tokens(chat.ChatTokenizer())

  def loss_fn(params, batch, rng):
    del rng
    logits, aux = model.apply({"params": params}, batch["inputs"], batch["pixel_values"], batch["layout"],
                              batch["positions"], batch["segment_ids"])
    logp = rollout.token_logprobs(tool_rollout.mask_banned(logits, banned), batch["targets"], config.rl.temperature)
    loss, metrics = score(logp, batch)
    return loss, (metrics, aux)
  return loss_fn


def batch_specs() -> dict:
  specs = {name: P(sharding.BATCH_AXES, "sequence") for name in ROW_FEATURES}
  return {**specs, "pixel_values": P(), "layout": P()}


def make_step(config, model: k25.K25, tx):
  """The jitted update (state, minibatch with media) -> (state, metrics); call under `jax.set_mesh`."""
  return step.make_train_step(make_loss(config, model), tx, multimodal.abstract_state(model.cfg, tx),
                              router_gamma=config.train.router_bias_rate,
                              first_moe_layer=model.cfg.text.first_k_dense_replace, lm_key=LM,
                              batch_specs=batch_specs())


# ---------------------------------------------------------------------------- the tasks
@dataclasses.dataclass
class TaskSplit:
  """Tasks with their preprocessed images and the prompts' media blocks."""

  tasks: list[image_tasks.ImageTask]
  items: list[vision_data.Media]
  blocks: list[list[int]]

  @classmethod
  def make(cls, n: int, seed: int, config, tok: chat.ChatTokenizer) -> "TaskSplit":
    tasks = image_tasks.make_tasks(n, seed, config.task.image_size, sft_stage.kinds(config.task.kinds, "task.kinds"))
    items = [vision_data.preprocess_image(t.image) for t in tasks]
    return cls(tasks, items, [vision_data.media_token_ids(m, tok) for m in items])

  def take(self, rows) -> "TaskSplit":
    return TaskSplit([self.tasks[r] for r in rows], [self.items[r] for r in rows], [self.blocks[r] for r in rows])


def play(config, model_cfg: K25Config, params, tok, pool, split: TaskSplit, *, temperature: float, seed: int):
  """One episode per task of `split` (with the tool if `rl.tool`)."""
  r = config.rl
  sampling = sampler.SamplingConfig(max_new_tokens=r.turn_tokens, temperature=temperature, top_k=r.top_k,
                                    top_p=r.top_p, stop_tokens=(tok.end_id,), pad_id=tok.pad_id,
                                    banned_tokens=tool_rollout.banned_tokens(tok))
  decode = tool_rollout.vision_decoder(model_cfg, params, sampling, lambda e: split.items[e], seed,
                                       min_rows=pool.max_sessions)
  rollout_config = tool_rollout.RolloutConfig(max_turns=r.max_turns, max_context=r.max_context,
                                              turn_tokens=r.turn_tokens, tool=r.tool,
                                              output_chars=config.sandbox.output_chars)
  return tool_rollout.play(decode, tok, split.tasks, pool, rollout_config, media=split.blocks)


def grade(transcripts, tasks) -> dict[str, np.ndarray]:
  correct = np.array([image_tasks.grade(t.answer, task.answer) for t, task in zip(transcripts, tasks)], bool)
  return {"reward": correct.astype(np.float32), "correct": correct,
          "length": np.array([int(sum(t.loss_mask)) for t in transcripts], np.int32)}


def loss_batch(transcripts, advantages: np.ndarray, rewards: np.ndarray, seq: int, pad_id: int) -> dict:
  """Rows [n, seq] (`tool_rollout.loss_rows`; one width per run, one compilation) with
  per-row advantages and rewards."""
  rows = tool_rollout.loss_rows(transcripts, seq, pad_id)
  rows["advantages"] = np.repeat(advantages[:, None], seq, axis=1).astype(np.float32)
  rows["rewards"] = np.repeat(rewards[:, None], seq, axis=1).astype(np.float32)
  return rows


def device_minibatch(rows: dict, items, model_cfg: K25Config, mesh) -> dict:
  """Rows over the batch axes; their images (one per row, in row order) padded to one item per
  row and replicated."""
  pixels, layout = tool_rollout.media_batch(items, model_cfg, len(items))
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  specs = batch_specs()
  out = {name: put(v, specs[name]) for name, v in rows.items()}
  return {**out, "pixel_values": put(pixels, P()), "layout": jax.tree.map(lambda x: put(x, P()), layout)}


def evaluate(config, model_cfg, params, tok, pool, split: TaskSplit) -> dict[str, float]:
  """Sampled (rl.eval_samples per task, training temperature) and greedy held-out metrics."""
  k = config.rl.eval_samples
  repeated = split.take(np.repeat(np.arange(len(split.tasks)), k))
  sampled = play(config, model_cfg, params, tok, pool, repeated, temperature=config.rl.temperature,
                 seed=config.rl.seed + 1)
  greedy = play(config, model_cfg, params, tok, pool, split, temperature=0.0, seed=config.rl.seed + 1)
  out = tool_rollout.summarize(sampled, repeated.tasks)
  out["greedy_accuracy"] = tool_rollout.summarize(greedy, split.tasks)["accuracy"]
  return out


# ------------------------------------------------------------------------------------- run
def check(config) -> None:
  if config.toggle.enabled:
    raise ValueError("toggle.enabled: Toggle is implemented for the text tasks of the RL stage, not task.name='image'")
  if not config.warm_start.checkpoint:
    raise ValueError("task.name='image' starts from a K2.5 checkpoint: set warm_start.checkpoint to a workdir of "
                     "configs/sft.py (zero-vision SFT) or of joint pre-training")
  per_minibatch = config.rl.prompts_per_iteration * config.rl.num_generations // config.rl.minibatches
  if per_minibatch % config.rl.num_generations:
    raise ValueError(f"rl.minibatches={config.rl.minibatches} must keep each prompt's {config.rl.num_generations} "
                     "episodes in one minibatch")


def run(config: ml_collections.ConfigDict, workdir: str):
  """Vision RL from `warm_start.checkpoint`; resumes from workdir/checkpoints. Returns (state, history)."""
  multimodal.check_single_process(config.stage)
  check(config)
  tok = chat.ChatTokenizer()
  model_cfg = sft_stage.model_config(config, tok)
  model = k25.K25(model_cfg)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  r, k = config.rl, config.rl.num_generations
  train_split = TaskSplit.make(config.task.train_prompts, config.task.seed, config, tok)
  eval_split = TaskSplit.make(config.task.eval_prompts, config.task.seed + 1, config, tok)
  tx = optimizer.make_optimizer(config.optimizer, r.iterations * r.minibatches)
  checkpoints = checkpoint.Checkpoints(workdir, keep=2)
  writer = loop.MetricWriter(workdir)
  history = []
  with sandbox.SandboxPool(config.sandbox.sessions, limits=sandbox.Limits(
      cpu_s=config.sandbox.cpu_s, wall_s=config.sandbox.wall_s, memory_mb=config.sandbox.memory_mb)) as pool, \
      jax.set_mesh(mesh):
    create, target = multimodal.init_state(config, model_cfg, tx, mesh)
    state = checkpoints.restore_latest(target)
    if state is None:
      state = create(checkpoint.Checkpoints(config.warm_start.checkpoint, keep=1).restore_params(
          multimodal.params_target(model_cfg, mesh)))
    train_step = make_step(config, model, tx)
    first = int(state.step) // r.minibatches
    if first == 0:
      ev = evaluate(config, model_cfg, state.params, tok, pool, eval_split)
      logging.info("rl (image) eval at iteration 0: %s", _fmt(ev))
      writer.write(0, _finite(ev), "eval")
      history.append({"iteration": 0, "split": "eval", **ev})
    for it in range(first, r.iterations):
      t0 = time.perf_counter()
      rows = np.random.default_rng([r.seed, it]).choice(len(train_split.tasks), r.prompts_per_iteration,
                                                        replace=False)
      episodes = train_split.take(np.repeat(rows, k))
      transcripts = play(config, model_cfg, state.params, tok, pool, episodes, temperature=r.temperature,
                         seed=r.seed * 7919 + it)
      t_sample = time.perf_counter() - t0
      graded = grade(transcripts, episodes.tasks)
      advantages = np.asarray(losses.group_advantages(graded["reward"], k), np.float32)
      batch = loss_batch(transcripts, advantages, graded["reward"], r.max_context, tok.pad_id)
      size = len(transcripts) // r.minibatches
      t1 = time.perf_counter()
      for m in range(r.minibatches):
        part = slice(m * size, (m + 1) * size)
        state, metrics = train_step(state, device_minibatch({name: v[part] for name, v in batch.items()},
                                                            episodes.items[part], model_cfg, mesh))
      metrics = {name: float(v) for name, v in jax.device_get(metrics).items()}
      summary = tool_rollout.summarize(transcripts, episodes.tasks)
      row = {"iteration": it + 1, "split": "train", **metrics, "reward": float(graded["reward"].mean()),
             **summary, "sample_s": t_sample, "train_s": time.perf_counter() - t1}
      history.append(row)
      writer.write(it + 1, _finite({n: v for n, v in row.items() if n not in ("iteration", "split")}), "train")
      if loop.due(it + 1, r.log_every, r.iterations):
        logging.info("rl (image) iteration %d/%d  reward %.3f  tool-call success %.3f  calls/episode %.2f  "
                     "loss %.4f  sample %.1fs  train %.1fs", it + 1, r.iterations, row["reward"],
                     row["tool_call_success"], row["calls_per_episode"], row["loss"], row["sample_s"],
                     row["train_s"])
      if loop.due(it + 1, r.eval_every, r.iterations):
        ev = evaluate(config, model_cfg, state.params, tok, pool, eval_split)
        logging.info("rl (image) eval at iteration %d: %s", it + 1, _fmt(ev))
        writer.write(it + 1, _finite(ev), "eval")
        history.append({"iteration": it + 1, "split": "eval", **ev})
      if loop.due(it + 1, r.checkpoint_every, r.iterations):
        checkpoints.save(it + 1, state)
  checkpoints.close()
  writer.close()
  evals = [h for h in history if h["split"] == "eval"]
  if evals:
    logging.info("rl (image) summary: held-out sampled accuracy %.3f → %.3f, greedy %.3f → %.3f, tool-call success "
                 "%.3f → %.3f", evals[0]["accuracy"], evals[-1]["accuracy"], evals[0]["greedy_accuracy"],
                 evals[-1]["greedy_accuracy"], evals[0]["tool_call_success"], evals[-1]["tool_call_success"])
  return state, history


def _finite(metrics: dict) -> dict:
  return {k: v for k, v in metrics.items() if np.isfinite(v)}


def _fmt(metrics: dict) -> str:
  keys = ("accuracy", "greedy_accuracy", "tool_call_success", "calls_per_episode", "generated_tokens")
  return "  ".join(f"{k} {metrics[k]:.3f}" for k in keys if k in metrics)
