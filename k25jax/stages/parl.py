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

Sub-agents are frozen copies of a fixed checkpoint (`parl.subagent_checkpoint`); the
orchestrator starts from a checkpoint too (`warm_start.checkpoint`). Without them (the
tiny default) the stage first trains one model by SFT on scripted demonstrations of both
roles run through the real budgeted environment, saves it under workdir/warm_start, and
uses it for both. The summary compares the trained swarm with the single agent (the
warm-start model with `create`/`assign` removed from its vocabulary) on held-out tasks.
"""
from __future__ import annotations

import json
import os
import time

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from absl import logging

from k25jax import losses
from k25jax.agents import dsl, swarm, widesearch
from k25jax.model import transformer
from k25jax.rl import sampler
from k25jax.stages import rl as rl_stage
from k25jax.train import checkpoint, config_utils, loop, optimizer, sft, sharding
from k25jax.train import state as state_lib

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


def orchestrator_batch(results, advantages: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
  """The orchestrators' contexts as loss rows: its generated turn tokens carry the loss
  (mask 1), its prompt and observations — sub-agent outputs included — carry none."""
  n = len(results)
  tokens = np.full((n, seq_len + 1), dsl.PAD_ID, np.int32)
  mask = np.zeros((n, seq_len + 1), np.float32)
  old = np.zeros((n, seq_len + 1), np.float32)
  lengths = np.zeros(n, np.int32)
  for i, r in enumerate(results):
    t = r.orchestrator
    m = min(len(t.tokens), seq_len + 1)
    tokens[i, :m], mask[i, :m], old[i, :m] = t.tokens[:m], t.loss_mask[:m], t.logprobs[:m]
    lengths[i] = m
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (n, seq_len))
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask[:, 1:], "old_logp": old[:, 1:],
          "positions": positions, "segment_ids": (positions < lengths[:, None]).astype(np.int32),
          "advantages": np.repeat(advantages[:, None], seq_len, axis=1),
          "rewards": np.zeros((n, seq_len), np.float32)}


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


# ------------------------------------------------------------------------------ warm start
def warm_start(config, model, mesh, workdir: str):
  """(orchestrator params, sub-agent params): from checkpoints if configured, else one SFT model."""
  ws, p = config.warm_start, config.parl
  boxed = transformer.abstract_params(model.cfg)
  target = checkpoint.abstract_target(nn.meta.unbox(boxed), sharding.logical_to_sharding(boxed, mesh))
  restore = lambda path: checkpoint.Checkpoints(path, keep=1).restore_params(target)
  if ws.checkpoint:
    orch = restore(ws.checkpoint)
  else:
    demos = widesearch.demonstrations(ws.demonstrations, ws.seed, budget=p.budget, deep_fraction=p.deep_fraction,
                                      max_length=min(widesearch.MAX_CONTEXT, model.cfg.max_position_embeddings))
    logging.info("parl warm start: %d demonstration contexts from %d scripted episodes (mean Item-F1 %.2f)",
                 len(demos["tokens"]), ws.demonstrations, demos["item_f1"].mean())
    orch, _ = sft.train(ws, model, demos["tokens"], demos["loss_mask"], demos["length"], mesh=mesh,
                        workdir=os.path.join(workdir, "warm_start"))
  sub = restore(p.subagent_checkpoint) if p.subagent_checkpoint else orch
  return orch, sub


def frozen_subagents(config, workdir: str):
  """The params of a run's frozen sub-agents, restored: `parl.subagent_checkpoint`, else the
  run's warm start (`warm_start.checkpoint`, or the SFT model it trained under workdir/warm_start)."""
  path = config.parl.subagent_checkpoint or config.warm_start.checkpoint or os.path.join(workdir, "warm_start")
  boxed = transformer.abstract_params(config_utils.model_config_from(config.model))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  target = checkpoint.abstract_target(nn.meta.unbox(boxed), sharding.logical_to_sharding(boxed, mesh))
  return checkpoint.Checkpoints(path, keep=1).restore_params(target)


# ------------------------------------------------------------------------------------- run
def check(config) -> None:
  rl = config.rl
  if rl.num_generations < 2:
    raise ValueError(f"rl.num_generations={rl.num_generations}: group advantages need K >= 2 episodes per task")
  if (rl.prompts_per_iteration * rl.num_generations) % rl.minibatches:
    raise ValueError(f"rl.minibatches={rl.minibatches} must divide the "
                     f"{rl.prompts_per_iteration * rl.num_generations} episodes per iteration")
  if config.parl.budget < 2:
    raise ValueError(f"parl.budget={config.parl.budget}: an episode needs at least 2 critical steps")


def make_step(config, model: transformer.Transformer, tx):
  """The jitted orchestrator update: the RL stage's step with the K2.5 loss."""
  return rl_stage.make_step(config, model, tx)


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
  """Warm start, then `rl.iterations` PARL iterations; prints the summary. Returns (state, history)."""
  check(config)
  rl, p = config.rl, config.parl
  model_cfg = config_utils.model_config_from(config.model)
  model = transformer.Transformer(model_cfg)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  tx = optimizer.make_optimizer(config.optimizer, rl.iterations * rl.minibatches)
  abstract = state_lib.abstract(transformer.abstract_params(model_cfg), tx)
  shardings = sharding.logical_to_sharding(abstract, mesh)
  checkpoints = checkpoint.Checkpoints(workdir, keep=2)
  writer = loop.MetricWriter(workdir)
  to_device = lambda rows: sharding.global_batch(rows, sharding.batch_sharding(mesh))
  eval_tasks = widesearch.sample_tasks(p.eval_tasks, p.eval_seed, deep_fraction=p.deep_fraction)
  history = []
  with jax.set_mesh(mesh):
    warm, sub = warm_start(config, model, mesh, workdir)
    create = jax.jit(lambda x: state_lib.create(x, tx, jax.random.PRNGKey(rl.seed)), out_shardings=shardings)
    state = checkpoints.restore_latest(checkpoint.abstract_target(nn.meta.unbox(abstract), shardings))
    if state is None:
      state = create(warm)
    train_step = make_step(config, model, tx)
    first = int(state.step) // rl.minibatches
    for it in range(first, rl.iterations):
      if it % rl.eval_every == 0:
        results, _, wall = play(config, model_cfg, state.params, sub, eval_tasks, greedy=False, seed=p.eval_seed)
        ev = summarize(results, wall)
        logging.info("parl eval at iteration %d: Item-F1 %.3f (wide %.3f, deep %.3f)  sub-agents %.2f "
                     "(wide %.2f, deep %.2f)  critical steps %.2f", it, ev["item_f1"], ev.get("wide/item_f1", 0),
                     ev.get("deep/item_f1", 0), ev["num_created"], ev.get("wide/num_created", 0),
                     ev.get("deep/num_created", 0), ev["critical_steps"])
        writer.write(it, ev, "eval")
        history.append({"iteration": it, "split": "eval", **ev})
      t0 = time.perf_counter()
      tasks = widesearch.sample_tasks(rl.prompts_per_iteration, rl.seed * 100_003 + it, deep_fraction=p.deep_fraction)
      episodes = [t for t in tasks for _ in range(rl.num_generations)]
      results, runtime, t_play = play(config, model_cfg, state.params, sub, episodes, greedy=False, seed=it)
      reward, parts = rewards(config, it, results)
      advantages = np.asarray(losses.group_advantages(reward, rl.num_generations), np.float32)
      seq_len = model_cfg.max_position_embeddings
      batch = orchestrator_batch(results, advantages, seq_len)
      size = len(results) // rl.minibatches
      for m in range(rl.minibatches):
        state, metrics = train_step(state, to_device({k: v[m * size:(m + 1) * size] for k, v in batch.items()}))
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
      row = {"iteration": it + 1, "split": "train", **metrics, **parts, **summarize(results, t_play),
             "reward": float(reward.mean()), "device_calls": float(sum(runtime.device_calls.values())),
             "iteration_s": time.perf_counter() - t0}
      history.append(row)
      writer.write(it + 1, {k: v for k, v in row.items() if k not in ("iteration", "split")}, "train")
      if (it + 1) % rl.log_every == 0:
        logging.info("parl iteration %d/%d  reward %.3f  Item-F1 %.3f  sub-agents %.2f  critical steps %.2f  "
                     "λ1 %.3f  loss %.4f  %.1fs/iteration", it + 1, rl.iterations, row["reward"], row["item_f1"],
                     row["num_created"], row["critical_steps"], row["lambda1"], row["loss"], row["iteration_s"])
      if loop.due(it + 1, rl.checkpoint_every, rl.iterations):
        checkpoints.save(it + 1, state)
    final = evaluate_all(config, model_cfg, state.params, sub, warm, eval_tasks)
  checkpoints.close()
  writer.close()
  history.append({"iteration": rl.iterations, "split": "final", "rows": final})
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
