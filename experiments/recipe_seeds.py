"""The recipe's table over seeds: `experiments/recipe.py` runs, one a seed, as mean ± standard error.

    python experiments/recipe.py --seed 0 --root runs/recipe_s0 --out experiments/results/recipe_seed0   # and 1, 2
    python experiments/recipe_seeds.py experiments/results/recipe_seed{0,1,2}.json \
        --out experiments/results/recipe_seeds [--last STAGE]

Per stage and probe, the mean over the seeds' runs and its standard error (s / √n); per probe a
stage trains, the stage's gain over the row before it (losses: the drop), mean ± s.e. of the
per-seed gains, and whether it exceeds the noise (mean > 2 s.e.: improved; < −2 s.e.: worse;
else not distinguishable); and the forgetting beyond the noise: a stage's drop on a probe it
does not train, of those the stages before it had raised (both beyond 2 s.e.). Over the stages
up to and with `--last` (default every stage; all runs must have them: a run stopped earlier
with `recipe.py --last` limits it). Writes `<out>.json` and `<out>.md`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import recipe_probes  # noqa: E402
import seed_stats  # noqa: E402
from recipe import TRAINS, gain  # noqa: E402


def beyond_noise(values: list[float]) -> tuple[tuple[float, float], str]:
  """((mean, s.e.) of paired per-seed changes, "improved" | "worse" | "not distinguishable" at 2 s.e.)."""
  mean, error = seed_stats.mean_and_error(values)
  return (mean, error), "improved" if mean > 2 * error else "worse" if mean < -2 * error else "not distinguishable"


def aggregate(runs: list[dict], last: str | None = None) -> dict:
  """{"seeds", "rows": {stage: {probe: (mean, s.e.)}}, "trained": [{stage, probe, gain: (mean,
  s.e.), verdict}], "forgetting": [...]} of recipe.py results (one seed each, the same stages up
  to and with `last`, default the last)."""
  runs = [dict(r, rows=dict(list(r["rows"].items())[:list(r["rows"]).index(last) + 1] if last else r["rows"]))
          for r in runs]
  stages = list(runs[0]["rows"])
  if any(list(r["rows"]) != stages for r in runs):
    raise ValueError("the runs' stages differ: " + "; ".join(",".join(r["rows"]) for r in runs))
  probes = recipe_probes.PROBES + recipe_probes.EXTRAS
  rows = {s: {p: seed_stats.mean_and_error([r["rows"][s][p] for r in runs]) for p in probes} for s in stages}
  trained, forgetting = [], []
  change = lambda probe, a, b: [gain(probe, r["rows"][a][probe], r["rows"][b][probe]) for r in runs]
  for before, stage in zip(stages, stages[1:]):
    for probe in TRAINS[stage]:
      stats, verdict = beyond_noise(change(probe, before, stage))
      trained.append(dict(stage=stage, probe=probe, gain=stats, verdict=verdict))
    for probe in recipe_probes.PROBES:
      if probe in TRAINS[stage] or beyond_noise(change(probe, stages[0], before))[1] != "improved":
        continue
      stats, verdict = beyond_noise(change(probe, before, stage))
      if verdict == "worse":
        forgetting.append(dict(stage=stage, probe=probe, gain=stats, before=rows[before][probe],
                               after=rows[stage][probe]))
  return {"seeds": [r.get("seed", 0) for r in runs], "rows": rows, "trained": trained, "forgetting": forgetting}


def markdown(result: dict) -> str:
  probes = recipe_probes.PROBES + recipe_probes.EXTRAS
  lines = [f"{len(result['seeds'])} seeds {result['seeds']}: mean ± standard error", "",
           "| after | " + " | ".join(probes) + " |", "|---" * (len(probes) + 1) + "|"]
  lines += [f"| {stage} | " + " | ".join(f"{m:.3f} ± {e:.3f}" for m, e in (row[p] for p in probes)) + " |"
            for stage, row in result["rows"].items()]
  lines += ["", "Each stage's gain on the probes it trains (losses: the drop), over the row before it:", ""]
  lines += [f"* {t['stage']}: {t['probe']} {t['gain'][0]:+.3f} ± {t['gain'][1]:.3f} ({t['verdict']})"
            for t in result["trained"]]
  lines += ["", "Forgetting beyond the noise (a stage lowers a probe it does not train, which the stages "
            "before it had raised):", ""]
  lines += [f"* {f['stage']}: {f['probe']} {f['before'][0]:.3f} → {f['after'][0]:.3f} "
            f"({f['gain'][0]:+.3f} ± {f['gain'][1]:.3f})" for f in result["forgetting"]] or ["* none"]
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("results", nargs="+", help="recipe.py's <out>.json, one a seed")
  parser.add_argument("--out", default="experiments/results/recipe_seeds")
  parser.add_argument("--last", default=None, help="aggregate the stages up to and with this one")
  args = parser.parse_args()
  if len(args.results) < 2:
    raise SystemExit("recipe_seeds.py: give two or more runs' JSON (one a seed)")
  runs = []
  for path in args.results:
    with open(path) as f:
      runs.append(json.load(f))
  result = aggregate(runs, args.last)
  result["results"] = args.results
  with open(args.out + ".json", "w") as f:
    json.dump(result, f, indent=1)
  text = markdown(result)
  with open(args.out + ".md", "w") as f:
    f.write(text)
  print(text)
  print(f"wrote {args.out}.json and .md")


if __name__ == "__main__":
  main()
