"""Benchmark: the swarm runtime's batched decode vs decoding each sub-agent turn alone.

    python experiments/bench_swarm.py [--runs 5 --workdir DIR --out experiments/results/bench_swarm]

The orchestrators are scripted (`widesearch.ScriptedOrchestrator(k)`: the first turn
creates k sub-agents and splits the task over them, no device call), so the number of
sub-agents in flight is fixed by the layout; the sub-agents are a model: the tiny PARL
model of `configs/parl.py`, random-init, or with `--workdir` the frozen sub-agent of a
finished `configs/parl.py` run (its warm start, DIR/warm_start), decoded greedily.
Every sub-agent gets `--entities_per_agent` entities (default 1), so the work per
sub-agent is the same in every layout and W agents do W times the work of one.

Layouts (episodes × sub-agents per episode; the DSL names S1..S8, at most 8 per episode):
1×1, 1×4, 2×8 and 16×1, i.e. 1, 4, 16 and 16 sub-agents in flight.

Per layout, in the same run and interleaved:
* batched:   `swarm.Swarm` plays all the layout's episodes at once; every tick decodes all
             waiting sub-agent turns in sampler calls of at most `Swarm.max_rows` rows (32 on CPU:
             one call for these layouts), rows and length padded to `decode.bucket`s.
* unbatched: `widesearch.run_episode` plays the episodes one after another and every
             sub-agent turn is decoded alone (batch 1, the same length buckets).
Timed as the median of `--runs` runs after one warm-up run (which compiles every shape),
with the load beside each run recorded; nothing is written if a run ran beside other work
(`interleave.py`; `--allow_load` writes it marked).
Reports episodes/s, generated sub-agent tokens/s, sampler calls, and the ratios: wall of
W agents / wall of 1 agent (same driver, and against one agent decoded alone at batch 1,
the cheapest way to run a single agent, since the swarm pads a lone row to 8), next to
the work ratio (generated tokens / those of 1 agent: W when turns are alike; a random-init
model's turns vary in length), and unbatched / batched. Checks (and prints) that both
drivers produced the same transcripts.
Writes `<out>.json`. About 1–2 minutes on 2 free cores with the defaults.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import numpy as np

import interleave  # experiments/interleave.py, beside this script
from k25jax.agents import dsl, swarm, widesearch
from k25jax.model import transformer
from k25jax.rl import decode, sampler
from k25jax.stages import parl
from k25jax.train import config_utils

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
LAYOUTS = ((1, 1), (1, 4), (2, 8), (16, 1))   # (episodes, sub-agents per episode)


def load_config():
  return config_utils.load_config_file(os.path.join(ROOT, "configs", "parl.py"), "tiny")


def subagent_params(config, model_cfg, workdir: str | None):
  """The frozen sub-agent: DIR/warm_start's params (what a configs/parl.py run uses,
  `parl.frozen_subagents`), or random init."""
  if not workdir:
    return transformer.init_params(model_cfg, jax.random.PRNGKey(0)), "random init"
  path = config.parl.subagent_checkpoint or config.init.checkpoint or os.path.join(workdir, "warm_start")
  return jax.device_get(parl.frozen_subagents(config, workdir)), path


class AloneDecoder:
  """A sub-agent whose every turn is one sampler call on one row (the unbatched peer)."""

  def __init__(self, policy: swarm.Policy):
    self.policy = policy
    self.calls = 0
    self.overflows = 0

  def __call__(self, context) -> list[int]:
    p = self.policy
    limit = p.cfg.max_position_embeddings - p.sampling.max_new_tokens
    if len(context) > limit:          # as the swarm does: an empty turn, the env truncates
      self.overflows += 1
      return []
    prompts = np.full((1, min(decode.bucket(len(context), swarm.MIN_WIDTH), limit)), p.sampling.pad_id, np.int32)
    prompts[0, :len(context)] = context
    out = jax.device_get(sampler.generate(p.cfg, p.params, prompts, np.array([len(context)], np.int32),
                                          jax.random.PRNGKey(0), p.sampling))
    self.calls += 1
    return out["tokens"][0, :int(out["lengths"][0])].tolist()


def layout_tasks(num_episodes: int, k: int, entities_per_agent: int, seed: int) -> list[widesearch.Task]:
  return [widesearch.make_task((seed, k, i), kind="wide", n=k * entities_per_agent) for i in range(num_episodes)]


def generated(results) -> int:
  """Tokens the sub-agent model wrote (its turns; observations and prompts excluded)."""
  return int(sum(sum(t.loss_mask) for r in results for t in r.subagents))


def transcripts(results) -> list[list[tuple[int, ...]]]:
  return [[tuple(r.orchestrator.tokens)] + [tuple(t.tokens) for t in r.subagents] for r in results]


def run_batched(policy, tasks, k, budget):
  runtime = swarm.Swarm({"orch": widesearch.ScriptedOrchestrator(k), "sub": policy})
  start = time.perf_counter()
  results = runtime.run([widesearch.Episode(t, budget=budget) for t in tasks])
  wall = time.perf_counter() - start
  return results, wall, {"calls": runtime.device_calls["sub"], "rows": runtime.decoded_rows["sub"],
                         "overflows": runtime.overflows}


def run_unbatched(policy, tasks, k, budget):
  decoder = AloneDecoder(policy)
  start = time.perf_counter()
  results = [widesearch.run_episode(t, widesearch.ScriptedOrchestrator(k), decoder, budget=budget) for t in tasks]
  wall = time.perf_counter() - start
  return results, wall, {"calls": decoder.calls, "rows": decoder.calls, "overflows": decoder.overflows}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default=None, help="a finished configs/parl.py run: use its frozen sub-agent")
  parser.add_argument("--runs", type=int, default=5, help="timed runs per layout and driver (median)")
  parser.add_argument("--entities_per_agent", type=int, default=1)
  parser.add_argument("--budget", type=int, default=4, help="critical steps per episode (shown in the prompt)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "bench_swarm"))
  interleave.add_load_arguments(parser)
  args = parser.parse_args()

  config = load_config()
  model_cfg = config_utils.model_config_from(config.model)
  params, source = subagent_params(config, model_cfg, args.workdir)
  policy = parl.policies(config, model_cfg, params, params, greedy=True)["sub"]
  threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  print(f"sub-agents: {source}; {sum(x.size for x in jax.tree.leaves(params)):,} params; greedy, "
        f"{policy.sampling.max_new_tokens} new tokens max per turn; budget {args.budget}; "
        f"{args.entities_per_agent} entities per sub-agent; {threads} CPU threads, {jax.devices()[0].platform}")

  drivers = {"batched": run_batched, "unbatched": run_unbatched}
  layouts = {f"{e}x{k}": (layout_tasks(e, k, args.entities_per_agent, args.seed), k) for e, k in LAYOUTS}
  walls = {(name, d): [] for name in layouts for d in drivers}
  info = {}
  loads = []
  for rep in range(args.runs + 1):                 # run 0 is the warm-up (compiles every shape)
    with interleave.LoadMeter() as load:
      for name, (tasks, k) in layouts.items():
        for d, drive in drivers.items():
          results, wall, counts = drive(policy, tasks, k, args.budget)
          if rep:
            walls[(name, d)].append(wall)
          info[(name, d)] = (results, counts)
    if rep:
      loads.append(load.other_cores)
    print(f"  run {rep}{' (warm-up)' if rep == 0 else ''} done; other processes used {load.other_cores:.2f} cores")
  loaded = interleave.refuse_if_loaded(loads, args.max_load, args.allow_load)

  rows = []
  for name, (tasks, k) in layouts.items():
    for d in drivers:
      results, counts = info[(name, d)]
      wall = statistics.median(walls[(name, d)])
      tokens = generated(results)
      rows.append({"layout": name, "episodes": len(tasks), "subagents_per_episode": k,
                   "agents_in_flight": len(tasks) * k, "driver": d, "wall_s": wall,
                   "wall_s_all": walls[(name, d)], "episodes_per_s": len(tasks) / wall,
                   "tokens": tokens, "tokens_per_s": tokens / wall, "sampler_calls": counts["calls"],
                   "decoded_turns": counts["rows"], "overflows": counts["overflows"],
                   "item_f1": float(np.mean([r.score.item_f1 for r in results]))})
    same = transcripts(info[(name, "batched")][0]) == transcripts(info[(name, "unbatched")][0])
    for row in rows[-2:]:
      row["same_transcripts"] = same

  by = {(r["layout"], r["driver"]): r for r in rows}
  one = {d: by[("1x1", d)] for d in drivers}
  for r in rows:
    r["work_vs_one_agent"] = r["tokens"] / one[r["driver"]]["tokens"]
    r["wall_vs_one_agent"] = r["wall_s"] / one[r["driver"]]["wall_s"]
    r["wall_vs_one_agent_alone"] = r["wall_s"] / one["unbatched"]["wall_s"]
    r["unbatched_over_batched"] = by[(r["layout"], "unbatched")]["wall_s"] / by[(r["layout"], "batched")]["wall_s"]

  print(f"\n{'layout':>6s} {'agents':>6s} {'driver':>9s} {'wall ms':>8s} {'episodes/s':>10s} {'tokens':>6s} "
        f"{'tokens/s':>8s} {'calls':>5s} {'turns':>5s} {'x work':>6s} {'x wall':>6s} {'x wall vs alone':>15s} "
        f"{'unbatched/batched':>17s} {'same':>4s}")
  for r in rows:
    print(f"{r['layout']:>6s} {r['agents_in_flight']:6d} {r['driver']:>9s} {1e3 * r['wall_s']:8.1f} "
          f"{r['episodes_per_s']:10.2f} {r['tokens']:6d} {r['tokens_per_s']:8.0f} {r['sampler_calls']:5d} "
          f"{r['decoded_turns']:5d} {r['work_vs_one_agent']:6.1f} {r['wall_vs_one_agent']:6.2f} "
          f"{r['wall_vs_one_agent_alone']:15.2f} {r['unbatched_over_batched']:17.2f} "
          f"{'yes' if r['same_transcripts'] else 'NO':>4s}")
  print("x work: generated tokens / the 1x1 layout's (same driver); x wall: wall / the 1x1 layout's (same driver);"
        "\nx wall vs alone: wall / one sub-agent decoded alone (1x1 unbatched, batch 1)")
  for name in ("2x8", "16x1"):
    b, u = by[(name, "batched")], by[(name, "unbatched")]
    print(f"{b['agents_in_flight']} sub-agents ({name}), {b['work_vs_one_agent']:.1f}x the work of one: batched "
          f"{b['wall_vs_one_agent']:.2f}x one batched agent, {b['wall_vs_one_agent_alone']:.2f}x one agent alone; "
          f"unbatched {u['wall_vs_one_agent']:.2f}x; unbatched/batched {b['unbatched_over_batched']:.2f}")

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + ".json", "w") as f:
    json.dump({"rows": rows, "subagents": source, "threads": threads, "platform": platform.platform(),
               "jax": jax.__version__, "budget": args.budget, "entities_per_agent": args.entities_per_agent,
               "runs": args.runs, "other_cores": loads, "loaded": loaded, "max_load": args.max_load,
               "max_new_tokens": policy.sampling.max_new_tokens,
               "vocab": dsl.VOCAB_SIZE, "model": config.model.to_dict()}, f, indent=1)
  print(f"wrote {args.out}.json")


if __name__ == "__main__":
  main()
