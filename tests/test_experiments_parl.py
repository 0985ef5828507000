"""experiments/parl_ablation.py's labels and verdict, experiments/swarm_latency.py's target and
speedup tables (on the scripted policies: no model, no training), experiments/profile_parl.py's
phases."""
import argparse
import json
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))

import parl_ablation  # noqa: E402
import parl_spawn_payoff  # noqa: E402
import profile_parl  # noqa: E402
import swarm_latency  # noqa: E402

from k25jax.agents import widesearch  # noqa: E402
from k25jax.stages import parl  # noqa: E402


# ------------------------------------------------------------------------------ parl_ablation
def final(f1=0.8, wide8_subagents=3.0, deep_subagents=0.0, unfinished=0.5):
  """A final point with the metrics the verdict reads (the rest of `point`'s keys do not matter)."""
  return {"item_f1": f1, "wide8_f1": f1, "wide8_subagents": wide8_subagents, "deep_subagents": deep_subagents,
          "unfinished": unfinished, "critical_steps": 5.0}


def runs_of(**by_variant):
  """Run dicts: by_variant[v] = one final point per seed (the same for greedy and sampled)."""
  return [{"variant": v, "seed": s, "final": f, "final_greedy": f}
          for v, finals in by_variant.items() for s, f in enumerate(finals)]


def verdict(runs, mode="greedy"):
  return parl_ablation.analyze(runs)[mode]["verdict"]


def test_ablation_verdict_all_three_effects():
  runs = runs_of(
      annealed=[final(0.80, 3.0, 0.0, 0.4), final(0.82, 4.0, 0.0, 0.5), final(0.84, 3.5, 0.0, 0.6)],
      zero=[final(0.70, 0.5), final(0.72, 1.0), final(0.74, 3.0)],     # ≤ 1 in seeds 0 and 1: 2 of 3
      parallel_only=[final(0.75, 5.0, 1.0, 1.4), final(0.77, 5.0, 1.0, 1.5), final(0.79, 5.0, 1.0, 1.6)])
  v = verdict(runs)
  serial, spurious, best = (v["serial_collapse_without_r_parallel"], v["spurious_parallelism_without_r_finish"],
                            v["annealed_best_final_f1"])
  assert (serial["appeared"], serial["seeds_collapsed"], serial["needed"]) == (True, 2, 2)
  # unfinished: 1.5 − 0.5 = 1.0; standard errors 0.1/√3 each, 2·√2·0.1/√3 = 0.163 < 0.25, so the margin 0.25
  assert spurious["appeared"] is True
  assert spurious["unfinished"]["difference"] == pytest.approx(1.0)
  assert spurious["unfinished"]["threshold"] == pytest.approx(0.25)
  assert spurious["deep_subagents"]["more"] is True            # 1.0 vs 0.0, no spread
  assert best["appeared"] is True and best["margin"] == pytest.approx(0.82 - 0.77)


def test_ablation_verdict_reports_absent_effects():
  runs = runs_of(
      annealed=[final(0.80, 3.0, 0.0, 0.5)] * 3,
      zero=[final(0.81, 0.5), final(0.81, 1.5), final(0.81, 2.0)],     # ≤ 1 in one seed only
      # unfinished 1.5 on average (+1.0) but spread 0.5..2.5: 2 × SE = 2 × 1/√3 = 1.155 > 1.0; deep +0.2 < 0.25
      parallel_only=[final(0.79, 5.0, 0.2, 0.5), final(0.79, 5.0, 0.2, 1.5), final(0.79, 5.0, 0.2, 2.5)])
  v = verdict(runs)
  assert v["serial_collapse_without_r_parallel"]["appeared"] is False
  assert v["serial_collapse_without_r_parallel"]["seeds_collapsed"] == 1
  spurious = v["spurious_parallelism_without_r_finish"]
  assert spurious["appeared"] is False
  assert spurious["unfinished"]["threshold"] == pytest.approx(2 / math.sqrt(3))
  assert spurious["deep_subagents"]["difference"] == pytest.approx(0.2)
  best = v["annealed_best_final_f1"]
  assert best["appeared"] is False and best["margin"] == pytest.approx(-0.01)
  assert "zero 0.810" in best["statement"]


def test_ablation_verdict_without_a_variant_says_so():
  v = verdict(runs_of(annealed=[final()], zero=[final(wide8_subagents=0.0)]))
  assert v["serial_collapse_without_r_parallel"]["appeared"] is True       # 1 of 1 seed
  assert v["spurious_parallelism_without_r_finish"]["appeared"] is None


def test_ablation_classify_against_the_annealed_mean():
  runs = runs_of(annealed=[final(unfinished=0.2), final(unfinished=0.4)],
                 parallel_only=[final(wide8_subagents=1.0, deep_subagents=0.75, unfinished=1.3)])
  labels = parl_ablation.analyze(runs)["sampled"]["classification"]
  c = labels["parallel_only_s0"]
  assert c["serial_collapse"] is True                                     # 1.0 ≤ 1: the bound is inclusive
  assert c["unfinished_minus_annealed"] == pytest.approx(1.0)             # 1.3 − mean(0.2, 0.4)
  assert c["deep_subagents_minus_annealed"] == pytest.approx(0.75)
  assert labels["annealed_s0"]["serial_collapse"] is False


def test_ablation_point_counts_unfinished_from_the_stage_summary():
  """8 scripted sub-agents at B = 2 are created and never assigned (8 unfinished each); at B = 3
  they each take one entity of a W = 8 task and finish it (0 unfinished)."""
  tasks = swarm_latency.wide_tasks(7, 8, 2)
  results = [widesearch.run_episode(t.with_budget(b), widesearch.ScriptedOrchestrator(8))
             for t in tasks for b in (2, 3)]
  p = parl_ablation.point(parl.summarize(results, 0.0))
  assert p["unfinished"] == pytest.approx(4.0)           # (0 + 8) / 2 episodes per task
  assert p["wide8_subagents"] == pytest.approx(8.0)
  assert p["finish_rate"] == pytest.approx(0.5)          # 16 finished of 16 assigned + 16 idle
  assert math.isnan(p["deep_f1"])


def test_ablation_variants_set_the_lambdas():
  args = argparse.Namespace(set=[], anneal_fraction=None, iterations=40, eval_every=None, log_every=10,
                            eval_tasks=0)
  configs = {v: parl_ablation.make_config(v, 1, "/tmp/unused", args).parl for v in parl_ablation.VARIANTS}
  base = parl_ablation.base_config(args)
  assert configs["annealed"].anneal_steps == round(base.parl.anneal_steps / base.train.steps * 40)
  assert (configs["annealed"].lambda1, configs["annealed"].lambda2) == (base.parl.lambda1, base.parl.lambda2)
  assert (configs["zero"].lambda1, configs["zero"].lambda2) == (0.0, 0.0)
  assert (configs["parallel_only"].lambda1, configs["parallel_only"].lambda2) == (base.parl.lambda1, 0.0)
  assert configs["parallel_only"].anneal_steps == 10**9


# ------------------------------------------------------------------------------ swarm_latency
def scripted_table(widths, targets, tasks=2):
  measure = lambda name, ts: swarm_latency.measure_scripted(ts, swarm_latency.SCRIPTED[name])
  curves = swarm_latency.sweep(measure, list(swarm_latency.SCRIPTED), widths, list(range(2, 17)),
                               lambda w: swarm_latency.wide_tasks(swarm_latency.DEFAULT_SEED, w, tasks),
                               {name: None for name in swarm_latency.SCRIPTED}, log=lambda *_: None)
  table = swarm_latency.target_table(curves, targets, widths)
  return {(r["target"], r["width"]): r for r in table}


def test_latency_scripted_speedups_by_hand():
  """Alone, budget B buys B − 1 lookups in B steps; the scripted swarm's 8 sub-agents get B − 2
  steps each, so 8·(B − 2) lookups (all n once B − 2 ≥ ceil(n/8)) in min(ceil(n/8), B − 2) + 2
  steps. Item-F1 = 2r/(1 + r) (precision 1), ≥ 0.5 iff recall r ≥ 1/3, ≥ 0.7 iff r ≥ 7/13,
  ≥ 0.9 iff r ≥ 9/11.
  W = 8:  single: ceil(8/3) = 3 lookups, 4 steps (B4); swarm: B3, 3 steps, r = 1. Speedup 4/3.
          F1 ≥ 0.9: single 7 lookups, 8 steps; swarm 3. Speedup 8/3.
  W = 24: F1 ≥ 0.5: single ceil(24/3) + 1 = 9 steps; swarm B3: 8 of 24, r = 1/3, F1 = 0.5 exactly,
          3 steps. Speedup 3.  F1 ≥ 0.7: single ceil(24·7/13) = 13 lookups, 14 steps; swarm B4:
          16 of 24 (F1 0.8), 4 steps. Speedup 3.5.  F1 ≥ 0.9: single 20 lookups > B16's 15: not
          reached, speedup NaN; swarm B5 (all 24), 5 steps."""
  rows = scripted_table([8, 24], [0.5, 0.7, 0.9])
  pair = "single (scripted) / swarm (scripted)"
  expected = {(0.5, 8): (3, 4), (0.9, 8): (3, 8), (0.5, 24): (3, 9), (0.7, 24): (4, 14), (0.9, 24): (5, None)}
  for key, (swarm_steps, single_steps) in expected.items():
    reach = rows[key]["reach"]
    assert reach["swarm (scripted)"]["critical_steps"] == swarm_steps, key
    assert reach["swarm (scripted)"]["budget"] == swarm_steps, key          # steps used = the budget here
    if single_steps is None:
      assert reach["single (scripted)"] == {"reached": False}
      assert math.isnan(rows[key]["speedup"][pair]["steps"])
    else:
      assert reach["single (scripted)"]["critical_steps"] == single_steps, key
      assert rows[key]["speedup"][pair]["steps"] == pytest.approx(single_steps / swarm_steps), key
    assert math.isnan(rows[key]["speedup"][pair]["wall"])                   # scripted: no wall time


def test_latency_reach_takes_the_cheapest_point_by_steps_and_by_wall():
  p = lambda f1, steps, wall, budget: {"item_f1": f1, "critical_steps": steps, "wall_s": wall, "budget": budget,
                                       "outside_training_budgets": budget > 10}
  points = [p(0.4, 2.0, 0.1, 2), p(0.6, 3.0, 0.9, 3), p(0.7, 3.5, 0.5, 4), p(0.9, 6.0, 0.3, 12)]
  r = swarm_latency.reach(points, 0.6)
  assert (r["critical_steps"], r["budget"], r["wall_s"], r["budget_by_wall"]) == (3.0, 3, 0.3, 12)
  r = swarm_latency.reach(points, 0.8)
  assert r["outside_training_budgets"] is True and r["budget"] == 12
  assert swarm_latency.reach(points, 0.95) == {"reached": False}


def test_latency_marks_budgets_outside_the_training_range():
  curves = swarm_latency.sweep(lambda name, ts: {"item_f1": 1.0, "success": 1.0, "num_created": 0.0,
                                                 "critical_steps": float(ts[0].budget), "wall_s": 0.0},
                               ["swarm", "single (scripted)"], [4], [2, 3, 10, 11],
                               lambda w: swarm_latency.wide_tasks(0, w, 1),
                               {"swarm": (3, 10), "single (scripted)": None}, log=lambda *_: None)
  assert [p["outside_training_budgets"] for p in curves["swarm"]] == [True, False, False, True]
  assert not any(p["outside_training_budgets"] for p in curves["single (scripted)"])
  assert [p["critical_steps"] for p in curves["swarm"]] == [2.0, 3.0, 10.0, 11.0]   # the budget reached the tasks


def test_latency_tasks_have_exactly_w_entities_and_do_not_depend_on_the_budget():
  a = swarm_latency.wide_tasks(5, 12, 3)
  assert [len(t.entities) for t in a] == [12, 12, 12] and {t.kind for t in a} == {"wide"}
  b = [t.with_budget(4) for t in a]
  assert [t.entities for t in a] == [t.entities for t in b] and b[0].budget == 4


def test_latency_scripted_main_writes_json_and_png(tmp_path):
  out = str(tmp_path / "latency")
  swarm_latency.main(["--scripted", "--widths", "8,24", "--budgets", "2,3,4,9", "--tasks", "1",
                      "--targets", "0.5", "--out", out])
  result = json.loads(open(out + ".json").read())
  assert result["workdir"] is None and result["policies"] == list(swarm_latency.SCRIPTED)
  row = next(r for r in result["targets"] if r["width"] == 24)
  assert row["speedup"]["single (scripted) / swarm (scripted)"]["steps"] == pytest.approx(3.0)
  assert os.path.getsize(out + ".png") > 0


def test_latency_seed_summary_puts_the_sweeps_side_by_side(tmp_path):
  paths = []
  for i, budgets in enumerate(("2,3,4,9", "3,9")):         # the single agent reaches F1 0.5 at W=8 at B4 / B9
    out = str(tmp_path / f"latency{i}")
    swarm_latency.main(["--scripted", "--widths", "8,24", "--budgets", budgets, "--tasks", "1", "--targets", "0.5",
                        "--out", out])
    paths.append(out + ".json")
  pair = "single (scripted) / swarm (scripted)"
  summary = swarm_latency.main(["--summarize", ",".join(paths), "--pair", pair, "--out", str(tmp_path / "seeds")])
  assert json.loads((tmp_path / "seeds.json").read_text())["rows"] == summary["rows"]
  sweeps = [json.loads(open(p).read()) for p in paths]
  for i, row in enumerate(summary["rows"]):
    values = [s["targets"][i]["speedup"][pair]["steps"] for s in sweeps]
    assert row["speedups"] == values and row["mean"] == pytest.approx(sum(values) / 2)
  assert [r["speedups"] for r in summary["rows"] if r["width"] == 8] == [[4 / 3, 3.0]]   # single: B4 vs B9
  assert summary["max_other_cores"] == 0.0             # scripted plays time nothing


def test_ablation_from_json_resummarizes_and_plots(tmp_path, capsys):
  """A saved result whose runs' raw final rows are scripted summaries: --from_json recomputes the
  final points and the verdict (the scripted swarm spawns on every task, the serial one never)."""
  tasks = widesearch.sample_tasks(12, 3, deep_fraction=0.25, budget_range=(3, 10))
  rows = {k: parl.summarize([widesearch.run_episode(t, widesearch.ScriptedOrchestrator(k)) for t in tasks], 1.0)
          for k in (0, 8)}
  final_rows = lambda k: {f"{name}, {mode}": rows[k] for mode in ("sampled", "greedy")
                          for name in ("swarm (trained)", "swarm (warm start)", "single agent (warm start)")}
  strategy = {"annealed": 8, "zero": 0, "parallel_only": 8}
  runs = [{"variant": v, "seed": s, "lambda1": 0.3, "lambda2": 0.3, "anneal_steps": 10, "elapsed_s": 1.0,
           "eval": [{"iteration": 0, **parl_ablation.point(rows[0])}],
           "train": [{"iteration": i, **parl_ablation.point(rows[k])} for i in (1, 2)],
           "final": {}, "final_greedy": {}, "final_rows": final_rows(k)}
          for s in (0, 1) for v, k in strategy.items()]
  path = tmp_path / "ablation.json"
  path.write_text(json.dumps({"source_workdir": "/x", "iterations": 2, "budget_range": [3, 10], "eval_tasks": 12,
                              "warm_start": {m: parl_ablation.point(rows[0]) for m in ("greedy", "sampled")},
                              "single_agent": {m: parl_ablation.point(rows[0]) for m in ("greedy", "sampled")},
                              "runs": runs, "elapsed_s": 2.0}))
  parl_ablation.main(["--from_json", str(path)])
  v = json.loads(path.read_text())["analysis"]["greedy"]["verdict"]
  assert v["serial_collapse_without_r_parallel"]["appeared"] is True          # zero: 0 sub-agents, 2 of 2 seeds
  spurious = v["spurious_parallelism_without_r_finish"]
  assert spurious["appeared"] is False and spurious["deep_subagents"]["difference"] == 0.0   # same policy
  assert v["annealed_best_final_f1"]["appeared"] is False                    # tied with parallel_only
  assert "verdict (greedy)" in capsys.readouterr().out
  assert (tmp_path / "ablation.png").stat().st_size > 0


def test_spawn_payoff_by_hand():
  # two tasks × 3 samples: task 0 splits once (F1 0.9 vs 0.3, 0.6 alone), task 1 never splits
  split = np.array([True, False, False, False, False, False])
  f1 = np.array([0.9, 0.3, 0.6, 0.5, 0.5, 0.5])
  out = parl_spawn_payoff.payoff(split, f1, samples=3)
  assert out["share_split"] == pytest.approx(1 / 6) and out["tasks_with_both"] == 1
  assert out["f1_split"] == pytest.approx(0.9) and out["f1_solo"] == pytest.approx(0.48)
  assert out["payoff"] == pytest.approx(0.9 - 0.45)
  assert math.isnan(parl_spawn_payoff.payoff(np.zeros(4, bool), np.ones(4), samples=2)["payoff"])


# ------------------------------------------------------------------------------ profile_parl
def test_profile_phases_split_the_wall_time_by_hand():
  log = profile_parl.Recorder()
  log.lines = [(100.0, "process 0 of 1"), (112.0, "warm start: 6184 rows"), (212.0, "parl eval at iteration 0: ..."),
               (260.0, "parl eval at iteration 2: ...")]
  curves = [{"iteration": 0, "split": "eval"},
            {"iteration": 0, "split": "train", "sample_s": 20.0, "train_s": 5.0},
            {"iteration": 1, "split": "train", "sample_s": 15.0, "train_s": 4.0},
            {"iteration": 2, "split": "eval"}, {"iteration": 2, "split": "final", "rows": {}}]
  got = profile_parl.phases(90.0, 275.0, log, curves)
  assert got == {"start-up + demonstrations": 22.0, "warm start + eval 0": 100.0, "rollouts (sample_s)": 35.0,
                 "updates (train_s)": 9.0, "evaluations, bookkeeping": 4.0, "final table": 15.0, "total": 185.0}
  assert sum(v for k, v in got.items() if k != "total") == got["total"]
