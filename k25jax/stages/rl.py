"""Joint RL with the K2.5 policy loss, Toggle inside: text tasks here, image tasks (`task.name="image"`,
the K2.5 model, the image in the prompt, the Python tool) in `k25jax.stages.rl_vision`.

Per iteration i, for P prompts x drawn from the training pool:

    y_1..y_K ~ π_old(·|x)                              (the current policy; log π_old recorded)
    r_j      = reward(x, y_j)                          (verifiable task)
    r_j     ← r_j · 1[acc(x) < λ  or  |y_j| ≤ budget(x)]   in Toggle's phase 0 = (i // m) % 2
    A_j      = r_j − mean_k r_k                        (losses.group_advantages)
    θ       ← θ − η ∇ L_K2.5(θ)  over `minibatches` slices of the P·K rollouts (Eq. 1)

budget(x) is the ρ-percentile of the lengths of correct responses to x, estimated once
from the warm-start policy. Without a checkpoint to start from, the stage first trains
one by SFT on the task's demonstrations (`warm_start`), saved under workdir/warm_start.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import time

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from absl import logging

from k25jax import losses
from k25jax.model import transformer
from k25jax.rl import rollout, sampler, tasks
from k25jax.train import checkpoint, config_utils, loop, optimizer, sft, sharding
from k25jax.train import state as state_lib
from k25jax.train import step as step_lib

LOSSES = ("k25", "ppo", "grpo", "cispo")


# ------------------------------------------------------------------------------- the loss
def policy_loss(loss_config: ml_collections.ConfigDict, group_size: int):
  """(logp, batch) → (loss, metrics) for `loss.name` ∈ LOSSES (K2.5's Eq. 1 by default)."""
  name = loss_config.name
  if name not in LOSSES:
    raise ValueError(f"loss.name={name!r}; choose from {LOSSES}")
  if name == "k25":
    return lambda logp, b: losses.k25_policy_loss(
        logp, b["old_logp"], b["advantages"], b["mask"], alpha=loss_config.alpha, beta=loss_config.beta,
        tau=loss_config.tau, normalize=loss_config.normalize, group_size=group_size)
  if name == "ppo":
    return lambda logp, b: losses.ppo_clip_loss(
        logp, b["old_logp"], b["advantages"], b["mask"], eps=loss_config.eps, normalize=loss_config.normalize,
        group_size=group_size)
  if name == "cispo":
    return lambda logp, b: losses.cispo_loss(
        logp, b["old_logp"], b["advantages"], b["mask"], eps_high=loss_config.eps_high,
        normalize=loss_config.normalize, group_size=group_size)
  return lambda logp, b: losses.grpo_loss(logp, b["old_logp"], b["rewards"][:, 0], b["mask"],
                                          group_size=group_size, eps=loss_config.eps)


def make_loss(config, model: transformer.Transformer):
  """loss_fn(params, batch, rng) for the generic train step: the policy loss on response tokens."""
  score = policy_loss(config.loss, config.rl.num_generations)

  def loss_fn(params, batch, rng):
    del rng
    logits, aux = model.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"])
    logp = rollout.token_logprobs(logits, batch["targets"], config.rl.temperature)
    loss, metrics = score(logp, batch)
    return loss, (metrics, aux)
  return loss_fn


def make_step(config, model: transformer.Transformer, tx):
  """The jitted RL update (state, minibatch) -> (state, metrics); call under `jax.set_mesh`."""
  abstract = state_lib.abstract(transformer.abstract_params(model.cfg), tx)
  return step_lib.make_train_step(make_loss(config, model), tx, abstract,
                                  router_gamma=config.train.router_bias_rate,
                                  first_moe_layer=model.cfg.first_k_dense_replace)


# ---------------------------------------------------------------------------- the task
class AdditionTask:
  """Training pool and held-out prompts of the 2-digit addition task (`k25jax.rl.tasks`)."""

  tokenizer = tasks.AdditionTokenizer()
  stop_tokens = (tasks.EOS_ID,)
  max_new_tokens = tasks.MAX_COMPLETION_LENGTH

  def __init__(self, config: ml_collections.ConfigDict):
    held_out = tasks.addition_prompts(config.eval_prompts, seed=config.seed + 1)
    taken = set(zip(held_out["a"].tolist(), held_out["b"].tolist()))
    pool = tasks.addition_prompts(4 * config.train_prompts, seed=config.seed)
    keep = [i for i, ab in enumerate(zip(pool["a"].tolist(), pool["b"].tolist())) if ab not in taken]
    keep = keep[:config.train_prompts]
    self.train = {k: v[keep] for k, v in pool.items()}
    self.eval = held_out

  def demonstrations(self, n: int, seed: int, p_scratch: float, p_check: float):
    demos = tasks.addition_demonstrations(n, seed, p_scratch=p_scratch, p_check=p_check)
    return demos["tokens"], demos["completion_mask"], demos["length"]

  @staticmethod
  def grade(split: dict, rows: np.ndarray, completions: np.ndarray) -> dict:
    return tasks.grade_addition(completions, split["a"][rows], split["b"][rows])


TASKS = {"addition": AdditionTask}


# ---------------------------------------------------------------------------- rollouts
def sample(model_cfg, params, task, split: dict, rows: np.ndarray, k: int, rng, sampling) -> dict:
  """K samples for each prompt row, graded. Returns the sampler's arrays plus grades."""
  prompts = np.repeat(split["tokens"][rows], k, axis=0)
  lengths = np.full(len(prompts), prompts.shape[1], np.int32)
  out = jax.device_get(sampler.generate(model_cfg, params, prompts, lengths, rng, sampling))
  grades = task.grade(split, np.repeat(rows, k), out["tokens"])
  return {"prompts": prompts, "prompt_lengths": lengths, **out, **grades}


def evaluate(model_cfg, params, task, rng, sampling, k: int) -> dict:
  """Sampled accuracy and length on the held-out prompts (k samples each), and greedy accuracy."""
  rows = np.arange(len(task.eval["tokens"]))
  sampled = sample(model_cfg, params, task, task.eval, rows, k, rng, sampling)
  greedy_cfg = dataclasses.replace(sampling, temperature=0.0)
  greedy = sample(model_cfg, params, task, task.eval, rows, 1, rng, greedy_cfg)
  return {"accuracy": float(sampled["correct"].mean()), "mean_length": float(sampled["length"].mean()),
          "length_correct": float(sampled["length"][sampled["correct"]].mean()) if sampled["correct"].any()
          else float("nan"),
          "greedy_accuracy": float(greedy["correct"].mean()), "unparsable": float(sampled["unparsable"].mean())}


def toggle_budgets(config, model_cfg, params, task, sampling) -> np.ndarray:
  """budget(x) for every training prompt: ρ-percentile of its correct responses' lengths."""
  rows = np.arange(len(task.train["tokens"]))
  k = config.toggle.budget_samples
  samples = sample(model_cfg, params, task, task.train, rows, k, jax.random.PRNGKey(config.rl.seed + 7), sampling)
  return np.asarray(losses.length_budgets(samples["length"], samples["correct"], np.repeat(rows, k),
                                          config.toggle.rho, num_prompts=len(rows)), np.float32)


def fixed_budgets(config, model_cfg, params, task, sampling, workdir: str) -> np.ndarray:
  """Toggle's budgets, estimated once: from the warm start on the first run, read back on a resume."""
  path = os.path.join(workdir, "toggle_budgets.npy")
  if os.path.exists(path):
    return np.load(path)
  budgets = toggle_budgets(config, model_cfg, params, task, sampling)
  if jax.process_index() == 0:
    np.save(path, budgets)
  return budgets


def shape_rewards(config, iteration: int, samples: dict, budgets: np.ndarray, rows: np.ndarray) -> tuple:
  """Toggle's gated reward in phase 0, the plain reward otherwise. Returns (rewards, phase)."""
  reward = samples["reward"]
  if not config.toggle.enabled:
    return reward, -1
  k = config.rl.num_generations
  phase = int(losses.toggle_phase(iteration, config.toggle.m))
  acc = np.asarray(losses.group_accuracy(samples["correct"], k))
  gated = losses.toggle_reward(reward, samples["length"], np.repeat(budgets[rows], k), phase, acc,
                               accuracy_threshold=config.toggle.accuracy_threshold)
  return np.asarray(gated, np.float32), phase


# ------------------------------------------------------------------------------ warm start
def warm_start(config, model, task, mesh, workdir: str):
  """Params to start RL from: a checkpoint's params if configured, else a short SFT."""
  ws = config.warm_start
  if ws.checkpoint:
    boxed = transformer.abstract_params(model.cfg)
    target = checkpoint.abstract_target(nn.meta.unbox(boxed), sharding.logical_to_sharding(boxed, mesh))
    return checkpoint.Checkpoints(ws.checkpoint, keep=1).restore_params(target)
  tokens, weights, lengths = task.demonstrations(ws.demonstrations, ws.seed, ws.p_scratch, ws.p_check)
  params, _ = sft.train(ws, model, tokens, weights, lengths, mesh=mesh, workdir=os.path.join(workdir, "warm_start"))
  return params


def warm_start_key(config) -> str:
  """What the built-in warm start depends on: a hash of the model, task and warm_start sections."""
  sections = json.dumps([config.model.to_dict(), config.task.to_dict(), config.warm_start.to_dict()], sort_keys=True)
  return hashlib.sha1(sections.encode()).hexdigest()[:12]


def shared_warm_start(config, root: str) -> str:
  """A directory for `warm_start.checkpoint`: the SFT warm start of `config`, trained once
  under root/<warm_start_key>/warm_start and reused by every later call with the same
  sections (runs that differ only in their RL settings share it; concurrent callers wait
  on a file lock for the one training it). A configured `warm_start.checkpoint` is
  returned as it is."""
  if config.warm_start.checkpoint:
    return config.warm_start.checkpoint
  workdir = os.path.join(root, warm_start_key(config))
  os.makedirs(workdir, exist_ok=True)
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  with open(os.path.join(workdir, ".lock"), "w") as lock, jax.set_mesh(mesh):
    fcntl.flock(lock, fcntl.LOCK_EX)         # released when the file closes
    warm_start(config, model, TASKS[config.task.name](config.task), mesh, workdir)   # resumes; 0 steps if done
  return os.path.join(workdir, "warm_start")


# ------------------------------------------------------------------------------------- run
IMAGE_TASK = "image"


def check(config) -> None:
  if config.rl.num_generations < 2:
    raise ValueError(f"rl.num_generations={config.rl.num_generations}: group advantages need K >= 2 "
                     "samples per prompt (an empty group has no baseline)")
  if config.task.name not in TASKS and config.task.name != IMAGE_TASK:
    raise ValueError(f"task.name={config.task.name!r}; choose from {sorted(TASKS) + [IMAGE_TASK]}")
  rollouts = config.rl.prompts_per_iteration * config.rl.num_generations
  if rollouts % config.rl.minibatches:
    raise ValueError(f"rl.minibatches={config.rl.minibatches} must divide the {rollouts} rollouts per iteration")


def run(config: ml_collections.ConfigDict, workdir: str):
  """Warm start, then `rl.iterations` iterations; resumes from workdir/checkpoints. Returns history."""
  check(config)
  if config.task.name == IMAGE_TASK:
    from k25jax.stages import rl_vision  # pylint: disable=import-outside-toplevel  (it imports this module)
    return rl_vision.run(config, workdir)
  model_cfg = config_utils.model_config_from(config.model)
  model = transformer.Transformer(model_cfg)
  task = TASKS[config.task.name](config.task)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  rl, k = config.rl, config.rl.num_generations
  sampling = sampler.SamplingConfig(max_new_tokens=min(rl.max_new_tokens, task.max_new_tokens),
                                    temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p,
                                    stop_tokens=task.stop_tokens, pad_id=task.tokenizer.pad_id)
  steps = rl.iterations * rl.minibatches
  tx = optimizer.make_optimizer(config.optimizer, steps)
  abstract = state_lib.abstract(transformer.abstract_params(model_cfg), tx)
  shardings = sharding.logical_to_sharding(abstract, mesh)
  checkpoints = checkpoint.Checkpoints(workdir, keep=2)
  writer = loop.MetricWriter(workdir)
  to_device = lambda rows: sharding.global_batch(rows, sharding.batch_sharding(mesh))
  history = []
  with jax.set_mesh(mesh):
    create = jax.jit(lambda p: state_lib.create(p, tx, jax.random.PRNGKey(rl.seed)), out_shardings=shardings)
    state = checkpoints.restore_latest(checkpoint.abstract_target(nn.meta.unbox(abstract), shardings))
    if state is None:
      state = create(warm_start(config, model, task, mesh, workdir))
    budgets = (fixed_budgets(config, model_cfg, state.params, task, sampling, workdir) if config.toggle.enabled
               else np.zeros(len(task.train["tokens"]), np.float32))
    train_step = make_step(config, model, tx)
    eval_rng = jax.random.PRNGKey(rl.seed + 1)
    first = int(state.step) // rl.minibatches
    if first == 0:
      start_eval = evaluate(model_cfg, state.params, task, eval_rng, sampling, rl.eval_samples)
      logging.info("rl eval at iteration 0: %s", _fmt(start_eval))
      writer.write(0, start_eval, "eval")
      history.append({"iteration": 0, "split": "eval", **start_eval})
    for it in range(first, rl.iterations):
      t0 = time.perf_counter()
      rows = np.random.default_rng([rl.seed, it]).choice(len(task.train["tokens"]), rl.prompts_per_iteration,
                                                         replace=False)
      samples = sample(model_cfg, state.params, task, task.train, rows, k, jax.random.PRNGKey(rl.seed * 7919 + it),
                       sampling)
      t_sample = time.perf_counter() - t0
      rewards, phase = shape_rewards(config, it, samples, budgets, rows)
      advantages = np.asarray(losses.group_advantages(rewards, k), np.float32)
      batch = rollout.pack(samples["prompts"], samples["prompt_lengths"], samples["tokens"], samples["lengths"],
                           samples["logprobs"], task.tokenizer.pad_id)
      seq = batch["mask"].shape[1]
      batch["advantages"] = np.repeat(advantages[:, None], seq, axis=1)
      batch["rewards"] = np.repeat(rewards[:, None], seq, axis=1)
      t1 = time.perf_counter()
      size = len(rewards) // rl.minibatches
      for m in range(rl.minibatches):
        part = {name: v[m * size:(m + 1) * size] for name, v in batch.items()}
        state, metrics = train_step(state, to_device(part))
      metrics = {name: float(v) for name, v in jax.device_get(metrics).items()}
      t_train = time.perf_counter() - t1
      row = {"iteration": it + 1, "split": "train", **metrics, "reward": float(samples["reward"].mean()),
             "shaped_reward": float(rewards.mean()), "accuracy": float(samples["correct"].mean()),
             "mean_length": float(samples["length"].mean()), "unparsable": int(samples["num_unparsable"]),
             "toggle_phase": phase, "sample_tokens_per_s": float(samples["lengths"].sum() / t_sample),
             "train_tokens_per_s": float(batch["segment_ids"].sum() / t_train)}
      history.append(row)
      writer.write(it + 1, {n: v for n, v in row.items() if n not in ("iteration", "split")}, "train")
      if loop.due(it + 1, rl.log_every, rl.iterations):
        logging.info("rl iteration %d/%d  reward %.3f  accuracy %.3f  length %.2f  loss %.4f  masked %.4f  "
                     "sample tok/s %.0f  train tok/s %.0f", it + 1, rl.iterations, row["reward"], row["accuracy"],
                     row["mean_length"], row["loss"], row.get("masked_fraction", 0.0), row["sample_tokens_per_s"],
                     row["train_tokens_per_s"])
      if loop.due(it + 1, rl.eval_every, rl.iterations):
        ev = evaluate(model_cfg, state.params, task, eval_rng, sampling, rl.eval_samples)
        logging.info("rl eval at iteration %d: %s", it + 1, _fmt(ev))
        writer.write(it + 1, ev, "eval")
        history.append({"iteration": it + 1, "split": "eval", **ev})
      if loop.due(it + 1, rl.checkpoint_every, rl.iterations):
        checkpoints.save(it + 1, state)
  checkpoints.close()
  writer.close()
  evals = [h for h in history if h["split"] == "eval"]
  if evals:
    logging.info("rl summary: held-out sampled accuracy %.3f → %.3f, mean length %.2f → %.2f",
                 evals[0]["accuracy"], evals[-1]["accuracy"], evals[0]["mean_length"], evals[-1]["mean_length"])
  return state, history


def _fmt(metrics: dict) -> str:
  return "  ".join(f"{k} {v:.3f}" for k, v in metrics.items())
