"""PARL: a trainable orchestrator learns, by RL, to split wide tasks over frozen sub-agents.

Per iteration t, for P tasks x (wide and deep wide-search tasks) and K episodes each:

    episode  = the orchestrator π_θ (sampled) + sub-agents π_frozen (greedy), run by the
               asyncio swarm under a CriticalSteps budget B:  Σ_s (S_main^s + max_i S_sub,i^s) ≤ B
    r        = λ1(t) · r_parallel + λ2(t) · r_finish + r_perf          (losses.parl_reward)
               r_perf = Item-F1 of the answer table, r_parallel = min(#created, cap)/cap,
               r_finish = #finished / #assigned, λ1, λ2 annealed to 0 over `anneal_steps`
    A        = r − mean over the K episodes of x                        (losses.group_advantages)
    θ       ← θ − η ∇ L_K2.5(θ) over the ORCHESTRATOR's generated tokens only; sub-agent
               tokens are observations to it and never enter the loss.

The iterations, advantages and updates are `k25jax.rl.driver`'s. Sub-agents are frozen
copies of a fixed checkpoint (`parl.subagent_checkpoint`); the orchestrator starts from
`init.checkpoint`. Without them (the tiny default) the stage first trains one model by
SFT on scripted demonstrations of both roles run through the real budgeted environment
(the built-in warm start, under workdir/warm_start), and uses it for both. The summary
compares the trained swarm with the single agent (the warm-start model with
`create`/`assign` removed from its vocabulary) on held-out tasks.
"""
from __future__ import annotations

import json
import os
import time

import ml_collections
import numpy as np
from absl import logging

from k25jax import losses
from k25jax.agents import dsl, swarm, widesearch
from k25jax.model import transformer
from k25jax.rl import driver, rollout, sampler
from k25jax.train import config_utils, sharding, trainer as trainer_lib, warm_start as warm_start_lib

SOLO_BANNED = (dsl.token_id("create"), dsl.token_id("assign"))


# ------------------------------------------------------------------------------ policies
def policies(config, model_cfg, orch_params, sub_params, *, greedy: bool, solo: bool = False) -> dict:
  """The swarm's two roles: the orchestrator (sampled while training) and frozen sub-agents (greedy)."""
  p = config.parl
  turn = lambda n, temperature, banned=(): sampler.SamplingConfig(
      max_new_tokens=n, temperature=temperature, stop_tokens=(dsl.EOT_ID,), pad_id=dsl.PAD_ID,
      banned_tokens=banned)
  return {"orch": swarm.Policy(model_cfg, orch_params, turn(p.orchestrator_turn_tokens,
                                                            0.0 if greedy else config.rl.temperature,
                                                            SOLO_BANNED if solo else ())),
          "sub": swarm.Policy(model_cfg, sub_params, turn(p.subagent_turn_tokens, 0.0))}


def play(config, model_cfg, orch_params, sub_params, tasks, *, greedy: bool, solo: bool = False, seed: int = 0):
  """Plays one episode per task (the orchestrator sampled, or greedy); returns (results, runtime, wall s)."""
  runtime = swarm.Swarm(policies(config, model_cfg, orch_params, sub_params, greedy=greedy, solo=solo), seed)
  start = time.perf_counter()
  results = runtime.run([widesearch.Episode(t, budget=config.parl.budget) for t in tasks])
  return results, runtime, time.perf_counter() - start


# ------------------------------------------------------------------------------- rewards
def rewards(config, iteration: int, results) -> tuple[np.ndarray, dict]:
  """r = λ1(t) r_parallel + λ2(t) r_finish + r_perf per episode, and its parts."""
  p = config.parl
  perf = np.array([r.score.item_f1 for r in results], np.float32)
  parallel = np.asarray(losses.r_parallel(np.array([r.num_created for r in results]), p.parallel_cap), np.float32)
  finish = np.asarray(losses.r_finish(np.array([r.num_finished for r in results]),
                                      np.array([r.num_assigned for r in results])), np.float32)
  lambda1 = float(losses.anneal(iteration, p.lambda1, p.anneal_steps, p.anneal_kind))
  lambda2 = float(losses.anneal(iteration, p.lambda2, p.anneal_steps, p.anneal_kind))
  total = np.asarray(losses.parl_reward(perf, parallel, finish, lambda1, lambda2), np.float32)
  return total, {"r_perf": float(perf.mean()), "r_parallel": float(parallel.mean()),
                 "r_finish": float(finish.mean()), "lambda1": lambda1, "lambda2": lambda2}


def summarize(results, wall: float) -> dict[str, float]:
  """Mean episode metrics (Item-F1, success, sub-agents, critical steps...) per task kind and overall."""
  out = {"wall_s": wall}
  for kind in ("all", *widesearch.KINDS):
    chosen = [r for r in results if kind == "all" or r.task.kind == kind]
    if not chosen:
      continue
    metrics = [r.metrics() for r in chosen]
    prefix = "" if kind == "all" else f"{kind}/"
    for name in ("item_f1", "row_f1", "success", "num_created", "num_assigned", "num_finished", "critical_steps",
                 "forced", "errors_orch", "errors_sub"):
      out[prefix + name] = float(np.mean([m[name] for m in metrics]))
  return out


def collector(config, model_cfg, sub_params):
  """collect(params, i): iteration i's P tasks × K episodes of the swarm, as the orchestrator's
  loss rows (its turns carry the loss; its prompt and observations, sub-agent outputs
  included, carry none) with their PARL rewards."""
  rl, p, seed = config.rl, config.parl, config.train.seed

  def collect(params, it: int) -> driver.Rollouts:
    tasks = widesearch.sample_tasks(rl.prompts_per_iteration, seed * 100_003 + it, deep_fraction=p.deep_fraction)
    episodes = [t for t in tasks for _ in range(rl.num_generations)]
    results, runtime, wall = play(config, model_cfg, params, sub_params, episodes, greedy=False, seed=it)
    reward, parts = rewards(config, it, results)
    rows = rollout.loss_rows([r.orchestrator for r in results], model_cfg.max_position_embeddings, dsl.PAD_ID)
    return driver.Rollouts(rows, reward, {**parts, **summarize(results, wall), "reward": float(reward.mean()),
                                          "device_calls": float(sum(runtime.device_calls.values()))})
  return collect


# ------------------------------------------------------------------------------ warm start
def builtin_warm_start(config, model, mesh, workdir: str):
  """The params of the built-in warm start: one model fine-tuned on scripted demonstrations
  of both roles (`warm_start`), trained (or resumed) under workdir/warm_start."""
  ws, p = config.warm_start, config.parl
  demos = widesearch.demonstrations(ws.demonstrations, ws.seed, budget=p.budget, deep_fraction=p.deep_fraction,
                                    max_length=min(widesearch.MAX_CONTEXT, model.cfg.max_position_embeddings))
  logging.info("parl warm start: %d demonstration contexts from %d scripted episodes (mean Item-F1 %.2f)",
               len(demos["tokens"]), ws.demonstrations, demos["item_f1"].mean())
  params, _ = warm_start_lib.train(ws, model, demos["tokens"], demos["loss_mask"], demos["length"], mesh=mesh,
                                   workdir=os.path.join(workdir, "warm_start"))
  return params


def frozen_subagents(config, workdir: str):
  """The params of a run's frozen sub-agents, restored: `parl.subagent_checkpoint`, else the
  run's start (`init.checkpoint`, or the warm start it trained under workdir/warm_start)."""
  path = config.parl.subagent_checkpoint or config.init.checkpoint or os.path.join(workdir, "warm_start")
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  return trainer_lib.restore_params(model, path, sharding.make_mesh(config.mesh.to_dict()))


# ------------------------------------------------------------------------------------- run
def check(config) -> None:
  if config.parl.budget < 2:
    raise ValueError(f"parl.budget={config.parl.budget}: an episode needs at least 2 critical steps")
  driver.check(config)


def evaluate_all(config, model_cfg, orch, sub, warm, tasks) -> dict[str, dict]:
  """Held-out metrics of the trained swarm and of the warm-start model, as a swarm and as a
  single agent; each sampled as in training (temperature `rl.temperature`) and greedy."""
  rows = {}
  for name, params, solo in (("swarm (trained)", orch, False), ("swarm (warm start)", warm, False),
                             ("single agent (warm start)", warm, True)):
    for greedy in (False, True):
      play(config, model_cfg, params, sub, tasks, greedy=greedy, solo=solo)   # compile: time the second run
      results, runtime, wall = play(config, model_cfg, params, sub, tasks, greedy=greedy, solo=solo)
      label = f"{name}, {'greedy' if greedy else 'sampled'}"
      rows[label] = {**summarize(results, wall), "device_calls": float(sum(runtime.device_calls.values()))}
  return rows


def run(config: ml_collections.ConfigDict, workdir: str):
  """Start (init.checkpoint or the built-in warm start), then `train.steps` PARL iterations;
  prints the summary. Returns (state, history)."""
  check(config)
  p = config.parl
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  eval_tasks = widesearch.sample_tasks(p.eval_tasks, p.eval_seed, deep_fraction=p.deep_fraction)
  with trainer_lib.Trainer.for_config(config, workdir, model, driver.make_optimizer(config), mesh) as trainer:
    warm = trainer.params_from(config.init)
    if warm is None:
      warm = builtin_warm_start(config, model, mesh, workdir)
    sub = trainer_lib.restore_params(model, p.subagent_checkpoint, mesh) if p.subagent_checkpoint else warm
    state = trainer.start(default_params=lambda: warm)

    def evaluate(params):
      results, _, wall = play(config, model.cfg, params, sub, eval_tasks, greedy=False, seed=p.eval_seed)
      return summarize(results, wall)

    state, history = driver.train(
        trainer, state, config, collect=collector(config, model.cfg, sub), evaluate=evaluate, name="parl",
        log_keys=("reward", "item_f1", "num_created", "critical_steps", "lambda1", "loss", "sample_s"),
        eval_keys=("item_f1", "wide/item_f1", "deep/item_f1", "num_created", "wide/num_created", "deep/num_created",
                   "critical_steps"))
    final = evaluate_all(config, model.cfg, state.params, sub, warm, eval_tasks)
  history.append({"iteration": config.train.steps, "split": "final", "rows": final})
  with open(os.path.join(workdir, "parl_curves.json"), "w") as f:
    json.dump(history, f, indent=1)
  print_summary(final, p.budget, len(eval_tasks))
  return state, history


def print_summary(rows: dict[str, dict], budget: int, n_tasks: int) -> None:
  print(f"\nPARL summary: {n_tasks} held-out tasks, budget {budget} critical steps")
  header = (f"{'policy':38s} {'Item-F1':>8s} {'wide F1':>8s} {'deep F1':>8s} {'success':>8s} "
            f"{'sub-agents':>10s} {'(wide)':>7s} {'(deep)':>7s} {'crit. steps':>11s} {'wall s':>7s}")
  print(header)
  for name, r in rows.items():
    print(f"{name:38s} {r['item_f1']:8.3f} {r.get('wide/item_f1', float('nan')):8.3f} "
          f"{r.get('deep/item_f1', float('nan')):8.3f} {r['success']:8.3f} {r['num_created']:10.2f} "
          f"{r.get('wide/num_created', float('nan')):7.2f} {r.get('deep/num_created', float('nan')):7.2f} "
          f"{r['critical_steps']:11.2f} {r['wall_s']:7.1f}")
