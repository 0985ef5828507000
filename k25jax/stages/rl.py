"""RL with the K2.5 policy loss on a verifiable text task in the chat format, Toggle inside:
2-digit addition, or the user's prompts from files with their verifiers (`task.name=file`,
k25jax/rl/prompt_files.py and k25jax/rl/verifiers.py).

Per iteration i, for P prompts x drawn from the training pool (`k25jax.rl.driver` does the rest):

    y_1..y_K ~ π_old(·|x)                              (the current policy; log π_old recorded)
    r_j      = reward(x, y_j)                          (verifiable task)
    r_j     ← r_j · 1[acc(x) < λ  or  |y_j| ≤ budget(x)]   in Toggle's phase 0 = (i // m) % 2
    A_j      = r_j − mean_k r_k,  θ ← θ − η ∇ L_K2.5(θ)   (the driver)

budget(x) is the ρ-percentile of the lengths of correct responses to x, estimated once
from the starting policy and kept in the workdir (`k25jax.rl.toggle`). The run starts from `init.checkpoint`,
else from a built-in warm start: SFT on the task's demonstrations (`warm_start`), saved
under workdir/warm_start. Held-out evaluation: sampled accuracy and length
(`rl.eval_samples` per prompt) and greedy accuracy.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import time

import jax
import ml_collections
import numpy as np

from k25jax.data import chat_formats
from k25jax.model import transformer
from k25jax.rl import decode, driver, prompt_files, rollout, sampler, tasks, toggle
from k25jax.train import config_utils, sharding, trainer as trainer_lib, warm_start as warm_start_lib


# ---------------------------------------------------------------------------- the task
class AdditionTask:
  """Training pool and held-out prompts of the 2-digit addition task (`k25jax.rl.tasks`) in
  the rendering `task.rendering` (chat: k25jax's own chat format, data/legacy_chat.py; compact: 17 tokens)."""

  max_new_tokens = tasks.MAX_COMPLETION_LENGTH

  def __init__(self, config: ml_collections.ConfigDict):
    self.render = tasks.rendering(config.rendering)
    self.tokenizer = self.render.tokenizer
    self.stop_tokens = (self.render.stop_id,)
    held_out = tasks.addition_prompts(config.eval_prompts, seed=config.seed + 1, render=self.render)
    taken = set(zip(held_out["a"].tolist(), held_out["b"].tolist()))
    pool = tasks.addition_prompts(4 * config.train_prompts, seed=config.seed, render=self.render)
    keep = [i for i, ab in enumerate(zip(pool["a"].tolist(), pool["b"].tolist())) if ab not in taken]
    keep = keep[:config.train_prompts]
    self.train = {k: v[keep] for k, v in pool.items()}
    self.eval = held_out

  def demonstrations(self, n: int, seed: int, p_scratch: float, p_check: float):
    demos = tasks.addition_demonstrations(n, seed, p_scratch=p_scratch, p_check=p_check, render=self.render)
    return demos["tokens"], demos["completion_mask"], demos["length"]

  def grade(self, split: dict, rows: np.ndarray, completions: np.ndarray) -> dict:
    return tasks.grade_addition(completions, split["a"][rows], split["b"][rows], self.render)


TASKS = ("addition", "file")


def make_task(config, max_positions: int):
  """The task of `task.name`: 2-digit addition, or prompts from the user's files graded by
  their verifiers (`k25jax.rl.prompt_files`; prompt + answer within `max_positions`)."""
  if config.task.name == "file":
    return prompt_files.FileTask(config.task, max_positions)
  return AdditionTask(config.task)


def sampling_config(config, task) -> sampler.SamplingConfig:
  """How rollouts are sampled: `rl.temperature` / `top_k` / `top_p`, up to `rl.max_new_tokens`
  (at most the task's longest answer), stopping at the task's stop token."""
  rl = config.rl
  return sampler.SamplingConfig(max_new_tokens=min(rl.max_new_tokens, task.max_new_tokens), temperature=rl.temperature,
                                top_k=rl.top_k, top_p=rl.top_p, stop_tokens=task.stop_tokens,
                                pad_id=task.render.pad_id)


# ---------------------------------------------------------------------------- rollouts
def sample(model_cfg, params, task, split: dict, rows: np.ndarray, k: int, rng, sampling) -> dict:
  """K samples for each prompt row (one sampler call), graded. Returns the sampler's arrays
  with the prompts (right-padded) and their lengths, plus grades."""
  prompts = np.repeat(split["tokens"][rows], k, axis=0)
  prompt_lengths = np.repeat(split["prompt_length"][rows], k)
  out = decode.decode(model_cfg, params, [p[:n] for p, n in zip(prompts, prompt_lengths)], rng, sampling,
                      bucket_rows=False)
  grades = task.grade(split, np.repeat(rows, k), out["tokens"])
  return {"prompts": prompts, "prompt_lengths": prompt_lengths, **out, **grades}


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
  samples = sample(model_cfg, params, task, task.train, rows, k, jax.random.PRNGKey(config.train.seed + 7), sampling)
  return toggle.budgets(config.toggle, samples["length"], samples["correct"], np.repeat(rows, k), len(rows))


def collector(config, model_cfg, task, sampling, budgets: np.ndarray):
  """collect(params, i): iteration i's P prompts × K samples, graded, Toggle-shaped, as loss rows."""
  rl, seed = config.rl, config.train.seed

  def collect(params, it: int) -> driver.Rollouts:
    rows = np.random.default_rng([seed, it]).choice(len(task.train["tokens"]), rl.prompts_per_iteration,
                                                    replace=False)
    start = time.perf_counter()
    samples = sample(model_cfg, params, task, task.train, rows, rl.num_generations,
                     jax.random.PRNGKey(seed * 7919 + it), sampling)
    sample_s = time.perf_counter() - start
    k = rl.num_generations
    rewards, phase = toggle.shape_rewards(config.toggle, k, it, samples["reward"], samples["correct"],
                                          samples["length"], np.repeat(budgets[rows], k))
    responses = rollout.responses(samples["prompts"], samples["prompt_lengths"], samples["tokens"],
                                  samples["lengths"], samples["logprobs"])
    seq_len = samples["prompts"].shape[1] + samples["tokens"].shape[1] - 1
    return driver.Rollouts(
        rollout.loss_rows(responses, seq_len, task.render.pad_id), rewards,
        {"reward": float(samples["reward"].mean()), "shaped_reward": float(rewards.mean()),
         "accuracy": float(samples["correct"].mean()), "mean_length": float(samples["length"].mean()),
         "unparsable": int(samples["num_unparsable"]), "toggle_phase": phase,
         "sample_tokens_per_s": float(samples["lengths"].sum() / sample_s)})
  return collect


# ------------------------------------------------------------------------------ warm start
def builtin_warm_start(config, model, task, mesh, workdir: str):
  """The params of the built-in warm start: SFT on the task's demonstrations (`warm_start`),
  trained (or resumed) under workdir/warm_start."""
  ws = config.warm_start
  tokens, weights, lengths = task.demonstrations(ws.demonstrations, ws.seed, ws.p_scratch, ws.p_check)
  params, _ = warm_start_lib.train(ws, model, tokens, weights, lengths, mesh=mesh,
                                   workdir=os.path.join(workdir, "warm_start"))
  return params


def warm_start_key(config) -> str:
  """What the built-in warm start depends on: a hash of the model, task and warm_start sections
  (and of a file task's files, `prompt_files.files_digest`)."""
  data = [config.model.to_dict(), config.task.to_dict(), config.warm_start.to_dict()]
  if config.task.name == "file":
    data.append(prompt_files.files_digest(config.task))
  return hashlib.sha1(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def shared_warm_start(config, root: str) -> str:
  """A directory for `init.checkpoint`: the built-in warm start of `config`, trained once
  under root/<warm_start_key>/warm_start and reused by every later call with the same
  sections (runs that differ only in their RL settings share it; concurrent callers wait
  on a file lock for the one training it). A configured `init.checkpoint` is returned as it is."""
  if config.init.checkpoint:
    return config.init.checkpoint
  workdir = os.path.join(root, warm_start_key(config))
  os.makedirs(workdir, exist_ok=True)
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  with open(os.path.join(workdir, ".lock"), "w") as lock, jax.set_mesh(mesh):
    fcntl.flock(lock, fcntl.LOCK_EX)         # released when the file closes
    task = make_task(config, model.cfg.max_position_embeddings)
    builtin_warm_start(config, model, task, mesh, workdir)   # 0 steps if done
  return os.path.join(workdir, "warm_start")


# ------------------------------------------------------------------------------------- run
def check(config) -> None:
  if config.task.name not in TASKS:
    raise ValueError(f"task.name={config.task.name!r}; choose from {TASKS} (image tasks: configs/rl.py:vision, "
                     "the rl_vision stage)")
  if config.task.name == "file":
    if config.task.rendering not in prompt_files.ROLES or not config.task.files:
      raise ValueError(f"task.name='file' needs task.files (GLOB,...) and task.rendering in {tuple(prompt_files.ROLES)}"
                       f", got files={config.task.files!r}, rendering={config.task.rendering!r}")
    prompt_files.check(config.task)
  vocab = tasks.rendering(config.task.rendering).tokenizer.vocab_size
  if config.model.vocab_size != vocab:
    raise ValueError(f"model.vocab_size={config.model.vocab_size} but task.rendering={config.task.rendering!r} "
                     f"has {vocab} token ids: the model's vocabulary is the rendering's")
  driver.check(config)


def run(config: ml_collections.ConfigDict, workdir: str):
  """Start (init.checkpoint or the built-in warm start), then `train.steps` RL iterations;
  resumes from workdir/checkpoints. Returns (state, history)."""
  check(config)
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  task = make_task(config, model.cfg.max_position_embeddings)
  sampling = sampling_config(config, task)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  with trainer_lib.Trainer.for_config(config, workdir, model, driver.make_optimizer(config), mesh,
                                     tokenizer=chat_formats.record_of(task.tokenizer)) as trainer:
    state = trainer.start(config.init, default_params=lambda: builtin_warm_start(config, model, task, mesh, workdir))
    budgets = (toggle.fixed_budgets(workdir, lambda: toggle_budgets(config, model.cfg, state.params, task, sampling))
               if config.toggle.enabled else np.zeros(len(task.train["tokens"]), np.float32))
    eval_rng = jax.random.PRNGKey(config.train.seed + 1)
    return driver.train(
        trainer, state, config, collect=collector(config, model.cfg, task, sampling, budgets),
        evaluate=lambda params: evaluate(model.cfg, params, task, eval_rng, sampling, config.rl.eval_samples),
        name="rl", log_keys=("reward", "accuracy", "mean_length", "loss", "masked_fraction", "sample_tokens_per_s",
                             "train_tokens_per_s"),
        summary_keys=("accuracy", "mean_length"))
