"""PARL: a trainable orchestrator learns, by RL, to split wide tasks over frozen sub-agents.

Per iteration t, for P tasks x (wide tasks of 2..24 entities and deep chains) and K episodes each:

    episode  = the orchestrator π_θ (sampled) + sub-agents π_frozen (greedy), run by the
               asyncio swarm under the task's CriticalSteps budget B (drawn per task, shown
               in the prompt):  Σ_s (S_main^s + max_i S_sub,i^s) ≤ B
    r        = λ1(t) · r_parallel + λ2(t) · r_finish + r_perf          (losses.parl_reward)
               r_perf = Item-F1 of the answer table, r_parallel = min(#created, cap)/cap
               (cap 2: near-binary), r_finish = #finished / (#assigned + #created never
               assigned), λ1, λ2 annealed to 0 over `anneal_steps`
    A        = r − mean over the K episodes of x                        (losses.group_advantages)
    θ       ← θ − η ∇ L_K2.5(θ) over the ORCHESTRATOR's generated tokens only; sub-agent
               tokens are observations to it and never enter the loss.

The iterations, advantages and updates are `k25jax.rl.driver`'s. Every agent reads and
writes the episode in `parl.rendering` (`widesearch.rendering`: the DSL's 91 ids,
k25jax's own chat format, data/legacy_chat.py, over the chat tokenizer, or Kimi K2.5's,
widesearch/k25_rendering.py, over the byte tokenizer with the K2.5 chat tokens). Sub-agents are frozen copies of a fixed
checkpoint (`parl.subagent_checkpoint`); the orchestrator starts from `init.checkpoint`.
Without them (the tiny default) the stage first trains one model by SFT on scripted
demonstrations of both roles run through the real budgeted environment (the built-in
warm start, under workdir/warm_start), and uses it for both; `warm_start.after_init`
trains that warm start from `init.checkpoint` instead of a fresh init (a model that has
not seen the protocol, e.g. the recipe's after joint RL). Its
orchestrator starts in serial collapse: the demonstrations solve tasks alone, with
create/assign shown with a random split in a small share (`widesearch.demonstrations`), so
the preference for parallelism the trained swarm shows comes from RL. The summary
compares, by task width, the trained swarm, the warm start as a swarm and the single
agent (the warm-start model with `create`/`assign` removed from its vocabulary; the DSL
rendering only, where each is one id) on held-out tasks.
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
from k25jax.data import chat_formats
from k25jax.model import transformer
from k25jax.rl import driver, rollout, sampler
from k25jax.train import config_utils, sharding, trainer as trainer_lib, warm_start as warm_start_lib

SOLO_BANNED = (dsl.token_id("create"), dsl.token_id("assign"))   # the single agent's ban (DSL rendering)
ROW_MULTIPLE = 64   # the update's rows are as wide as the longest orchestrator context, rounded up to this


def rendering(config) -> widesearch.Rendering:
  """The rendering the model reads and writes (`parl.rendering`: dsl | chat | k2.5)."""
  return widesearch.rendering.make(config.parl.rendering)


# ------------------------------------------------------------------------------ policies
def policies(config, model_cfg, orch_params, sub_params, *, greedy: bool, solo: bool = False) -> dict:
  """The swarm's two roles: the orchestrator (sampled while training) and frozen sub-agents (greedy)."""
  p, r = config.parl, rendering(config)
  if solo and r.name != "dsl":
    raise ValueError(f"the single agent bans `create`/`assign` tokens, which only the DSL rendering has (not {r.name})")
  turn = lambda n, temperature, banned=(): sampler.SamplingConfig(
      max_new_tokens=n, temperature=temperature, stop_tokens=(r.stop_id,), pad_id=r.pad_id,
      banned_tokens=banned)
  return {"orch": swarm.Policy(model_cfg, orch_params, turn(p.orchestrator_turn_tokens,
                                                            0.0 if greedy else config.rl.temperature,
                                                            SOLO_BANNED if solo else ())),
          "sub": swarm.Policy(model_cfg, sub_params, turn(p.subagent_turn_tokens, 0.0))}


def play(config, model_cfg, orch_params, sub_params, tasks, *, greedy: bool, solo: bool = False, seed: int = 0):
  """Plays one episode per task (the orchestrator sampled, or greedy); returns (results, runtime, wall s)."""
  runtime = swarm.Swarm(policies(config, model_cfg, orch_params, sub_params, greedy=greedy, solo=solo), seed)
  start = time.perf_counter()
  p = config.parl
  episodes = [widesearch.Episode(t, rendering=rendering(config), subagent_failure=p.subagent_failure,
                                 subagent_step_cost=p.subagent_step_cost, rng=np.random.default_rng([seed, i]))
              for i, t in enumerate(tasks)]
  results = runtime.run(episodes)
  return results, runtime, time.perf_counter() - start


# ------------------------------------------------------------------------------- rewards
def rewards(config, iteration: int, results) -> tuple[np.ndarray, dict]:
  """r = λ1(t) r_parallel + λ2(t) r_finish + r_perf per episode, and its parts."""
  p = config.parl
  perf = np.array([r.score.item_f1 for r in results], np.float32)
  parallel = np.asarray(losses.r_parallel(np.array([r.num_created for r in results]), p.parallel_cap), np.float32)
  finish = np.asarray(losses.r_finish(np.array([r.num_finished for r in results]),
                                      np.array([r.num_assigned for r in results]),
                                      np.array([r.num_idle for r in results])), np.float32)
  lambda1 = float(losses.anneal(iteration, p.lambda1, p.anneal_steps, p.anneal_kind))
  lambda2 = float(losses.anneal(iteration, p.lambda2, p.anneal_steps, p.anneal_kind))
  total = np.asarray(losses.parl_reward(perf, parallel, finish, lambda1, lambda2), np.float32)
  return total, {"r_perf": float(perf.mean()), "r_parallel": float(parallel.mean()),
                 "r_finish": float(finish.mean()), "lambda1": lambda1, "lambda2": lambda2}


WIDTH_BUCKETS = ((2, 7), (8, 15), (16, 24))   # wide tasks by entities asked; "wide8plus" joins the last two
SUMMARY_METRICS = ("item_f1", "row_f1", "success", "num_created", "num_assigned", "num_finished", "num_idle",
                   "num_lost", "critical_steps", "forced", "errors_orch", "errors_sub")


def task_groups(task) -> tuple[str, ...]:
  """The summary groups a task falls in: all, its kind, its width bucket (wide) and wide8plus."""
  if task.kind == "deep":
    return ("all", "deep")
  n = len(task.entities)
  buckets = tuple(f"wide{lo}-{hi}" for lo, hi in WIDTH_BUCKETS if lo <= n <= hi)
  return ("all", "wide", *buckets, *(("wide8plus",) if n >= 8 else ()))


def summarize(results, wall: float) -> dict[str, float]:
  """Mean episode metrics (Item-F1, success, sub-agents, critical steps...) overall ("item_f1")
  and per group ("wide/item_f1", "deep/...", "wide8-15/...", "wide8plus/..."; `task_groups`)."""
  out = {"wall_s": wall}
  groups: dict[str, list] = {}
  for r in results:
    for group in task_groups(r.task):
      groups.setdefault(group, []).append(r.metrics())
  for group, metrics in groups.items():
    prefix = "" if group == "all" else f"{group}/"
    for name in SUMMARY_METRICS:
      out[prefix + name] = float(np.mean([m[name] for m in metrics]))
  return out


def sample_tasks(config, num: int, seed: int):
  """`num` tasks as the parl section draws them (kinds, widths, chain lengths, budgets)."""
  p = config.parl
  return widesearch.sample_tasks(num, seed, deep_fraction=p.deep_fraction, n_range=tuple(p.n_range),
                                 hops_range=tuple(p.hops_range), budget_range=tuple(p.budget_range))


def collector(config, model_cfg, sub_params):
  """collect(params, i): iteration i's P tasks × K episodes of the swarm, as the orchestrator's
  loss rows (its turns carry the loss; its prompt and observations, sub-agent outputs
  included, carry none) with their PARL rewards."""
  rl, seed = config.rl, config.train.seed

  def collect(params, it: int) -> driver.Rollouts:
    tasks = sample_tasks(config, rl.prompts_per_iteration, seed * 100_003 + it)
    episodes = [t for t in tasks for _ in range(rl.num_generations)]
    results, runtime, wall = play(config, model_cfg, params, sub_params, episodes, greedy=False, seed=it)
    reward, parts = rewards(config, it, results)
    transcripts = [r.orchestrator for r in results]
    width = rollout.bucketed_width(transcripts, ROW_MULTIPLE, model_cfg.max_position_embeddings)
    rows = rollout.loss_rows(transcripts, width, rendering(config).pad_id)
    return driver.Rollouts(rows, reward, {**parts, **summarize(results, wall), "reward": float(reward.mean()),
                                          "device_calls": float(sum(runtime.device_calls.values()))})
  return collect


# ------------------------------------------------------------------------------ warm start
def builtin_warm_start(config, model, mesh, workdir: str, init_params=None):
  """The params of the built-in warm start: one model fine-tuned on scripted demonstrations
  of both roles (`warm_start`), from `init_params` (default a fresh init), trained (or
  resumed) under workdir/warm_start."""
  ws, p, r = config.warm_start, config.parl, rendering(config)
  max_length = min(r.max_context, model.cfg.max_position_embeddings)
  demos = widesearch.demonstrations(ws.demonstrations, ws.seed, deep_fraction=p.deep_fraction,
                                    delegation_share=ws.delegation_share, subagent_rows=ws.subagent_rows,
                                    capability_share=ws.capability_share, budget_range=tuple(ws.budget_range),
                                    n_range=tuple(p.n_range), hops_range=tuple(p.hops_range),
                                    max_length=max_length, rendering=r)
  wide = demos["kind"] == 0
  logging.info("parl warm start: %d demonstration contexts from %d scripted episodes (orchestrator: mean Item-F1 "
               "%.2f, sub-agents per episode %.2f wide, %.2f deep)", len(demos["tokens"]), ws.demonstrations,
               demos["item_f1"].mean(), demos["num_subagents"][wide].mean(), demos["num_subagents"][~wide].mean())
  params, _ = warm_start_lib.train(ws, model, demos["tokens"], demos["loss_mask"], demos["length"], mesh=mesh,
                                   workdir=os.path.join(workdir, "warm_start"), init_params=init_params)
  return params


def frozen_subagents(config, workdir: str):
  """The params of a run's frozen sub-agents, restored: `parl.subagent_checkpoint`, else the
  run's start (`init.checkpoint`, or the warm start it trained under workdir/warm_start)."""
  start = "" if config.warm_start.after_init else config.init.checkpoint
  path = config.parl.subagent_checkpoint or start or os.path.join(workdir, "warm_start")
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  return trainer_lib.restore_params(model, path, sharding.make_mesh(config.mesh.to_dict()))


# ------------------------------------------------------------------------------------- run
def _check_range(name: str, value, low: int, high: int) -> None:
  if len(value) != 2 or not low <= value[0] <= value[1] <= high:
    raise ValueError(f"{name}={tuple(value)} must be (lo, hi) with {low} <= lo <= hi <= {high}")


def check(config) -> None:
  p = config.parl
  _check_range("parl.budget_range", p.budget_range, dsl.MIN_BUDGET, dsl.MAX_BUDGET)
  _check_range("warm_start.budget_range", config.warm_start.budget_range, dsl.MIN_BUDGET, dsl.MAX_BUDGET)
  _check_range("parl.n_range", p.n_range, 1, dsl.NUM_ENTITIES)
  _check_range("parl.hops_range", p.hops_range, 1, dsl.NUM_VALUES - 1)
  r = rendering(config)
  if config.model.vocab_size != r.vocab_size:
    raise ValueError(f"model.vocab_size={config.model.vocab_size}, but parl.rendering={r.name!r} has "
                     f"{r.vocab_size} ids")
  if config.warm_start.after_init and not config.init.checkpoint:
    raise ValueError("warm_start.after_init=True fine-tunes init.checkpoint on the demonstrations; set init.checkpoint")
  if config.parl.subagent_checkpoint and config.warm_start.after_init:
    raise ValueError("warm_start.after_init=True makes the warm start the sub-agents too; "
                     f"parl.subagent_checkpoint={config.parl.subagent_checkpoint!r} would replace them")
  driver.check(config)


def evaluate_all(config, model_cfg, orch, sub, warm, tasks) -> dict[str, dict]:
  """Held-out metrics of the trained swarm and of the warm-start model, as a swarm and (DSL
  rendering: `create`/`assign` banned) as a single agent; each sampled as in training
  (temperature `rl.temperature`) and greedy. A play that compiled a decode program is played
  again (the same episodes: greedy, or sampled from the same key) so its wall time is the
  decoding's alone."""
  rows = {}
  contenders = [("swarm (trained)", orch, False), ("swarm (warm start)", warm, False)]
  if rendering(config).name == "dsl":
    contenders.append(("single agent (warm start)", warm, True))
  for name, params, solo in contenders:
    for greedy in (False, True):
      compiled = sampler.compiled_programs()
      results, runtime, wall = play(config, model_cfg, params, sub, tasks, greedy=greedy, solo=solo)
      if sampler.compiled_programs() > compiled:   # its wall time held compiling: time a second run
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
  eval_tasks = sample_tasks(config, p.eval_tasks, p.eval_seed)
  tokenizer = None if p.rendering == "dsl" else chat_formats.record_of(rendering(config).tok)
  with trainer_lib.Trainer.for_config(config, workdir, model, driver.make_optimizer(config), mesh,
                                     tokenizer=tokenizer) as trainer:
    warm = trainer.params_from(config.init)
    if warm is None or config.warm_start.after_init:
      warm = builtin_warm_start(config, model, mesh, workdir, init_params=warm)
    sub = trainer_lib.restore_params(model, p.subagent_checkpoint, mesh) if p.subagent_checkpoint else warm
    state = trainer.start(default_params=lambda: warm)

    def evaluate(params):
      results, _, wall = play(config, model.cfg, params, sub, eval_tasks, greedy=False, seed=p.eval_seed)
      return summarize(results, wall)

    state, history = driver.train(
        trainer, state, config, collect=collector(config, model.cfg, sub), evaluate=evaluate, name="parl",
        log_keys=("reward", "item_f1", "num_created", "critical_steps", "lambda1", "loss", "sample_s"),
        eval_keys=("item_f1", "wide/item_f1", "wide8plus/item_f1", "deep/item_f1", "wide/num_created",
                   "wide8plus/num_created", "deep/num_created", "critical_steps"))
    final = evaluate_all(config, model.cfg, state.params, sub, warm, eval_tasks)
  history.append({"iteration": config.train.steps, "split": "final", "rows": final})
  with open(os.path.join(workdir, "parl_curves.json"), "w") as f:
    json.dump(history, f, indent=1)
  print_summary(final, tuple(p.budget_range), len(eval_tasks))
  return state, history


def print_summary(rows: dict[str, dict], budget_range: tuple[int, int], n_tasks: int) -> None:
  """The final table: per policy, Item-F1 / sub-agents per episode / critical steps by task group."""
  groups = ["all", *(f"wide{lo}-{hi}" for lo, hi in WIDTH_BUCKETS), "deep"]
  print(f"\nPARL summary: {n_tasks} held-out tasks, budgets {budget_range[0]}-{budget_range[1]} critical steps "
        "(drawn per task); each cell: Item-F1 / sub-agents per episode / critical steps")
  print(f"{'policy':36s}" + "".join(f"{g:>19s}" for g in groups) + f"{'wall s':>8s}")
  for name, r in rows.items():
    cells = []
    for g in groups:
      prefix = "" if g == "all" else f"{g}/"
      cells.append(f"{r[prefix + 'item_f1']:.2f} / {r[prefix + 'num_created']:.2f} / {r[prefix + 'critical_steps']:.1f}"
                   if prefix + "item_f1" in r else "-")
    print(f"{name:36s}" + "".join(f"{c:>19s}" for c in cells) + f"{r['wall_s']:8.1f}")
