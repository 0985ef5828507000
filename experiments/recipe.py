"""Experiment: the K2.5 recipe on ONE tiny model, every stage from the previous stage's checkpoint.

    python experiments/recipe.py [--preset tiny|test --root runs/recipe --out experiments/results/recipe
                                  --seed N --last STAGE --judge_only --k25_format]

Runs the stages of `configs/recipe.py` in order — text pre-training → ViT → joint pre-training
(10:90) → mid-training (YaRN) → zero-vision SFT → joint RL with Toggle and the GRM → PARL — each in
`<root>/<stage>`, its `init` the previous stage's workdir (`init_from`: `init.checkpoint`, or
`init.text_checkpoint` where a K2.5 stage follows the text-only one). Mid-training's YaRN rope
is carried on to the stages after it. Joint RL's judge (`configs/recipe.py: judge_config`) is
trained in `<root>/judge` before joint RL, from a fresh init (with `--k25_format`: the chain in
Kimi K2.5's chat format, the judge the chain's model from mid-training's run). Before the first
stage (a fresh K2.5 model) and after every stage the same held-out probes measure the model
(`recipe_probes.PROBES`); after PARL, which trains the decoder alone, the K2.5 model is joint
RL's with PARL's decoder. A stage that finished (`<root>/<stage>/recipe_stage.json`) is not run
again, so the command resumes (and a root whose first stages link to another root's runs an
ablation of the later ones: `--set sft.optimizer.name=adamw`).

`--set judge.section.field=value` overrides a field of the judge's config; `--seed N` sets
every stage's training seeds (`seed_overrides`; `experiments/recipe_seeds.py` tables the seeds).
`--last STAGE` stops after a stage (a later run resumes), `--judge_only` trains the judge alone.

Writes `<out>.json` (the stage × probe table, the time of every stage and its probes, which
probes each stage trains, the judge's agreement with the hidden rubric), `<out>.md` (the
table, each stage's change on the probes it trains, and where a later stage lowers an
earlier stage's probe) and `<out>.png`.
"""
from __future__ import annotations

import argparse
import fcntl
import importlib
import json
import os
import sys
import time

import jax
import matplotlib
import ml_collections

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import recipe_probes  # noqa: E402
from configs import common, recipe as recipe_config  # noqa: E402
from k25jax.data import legacy_chat as chat, tokenizer  # noqa: E402
from k25jax.model import k25  # noqa: E402
from k25jax.stages import midtrain, sft  # noqa: E402
from k25jax.train import checkpoint, config_utils, sharding, trainer as trainer_lib  # noqa: E402

STAGES = recipe_config.STAGES
STAGE_MODULES = {"text_pretrain": "pretrain", "vit": "vit", "joint_pretrain": "pretrain", "midtrain": "midtrain",
                 "sft": "sft", "joint_rl": "rl_vision", "parl": "parl"}
# The probes each stage trains (the ones it must improve over the checkpoint it started from).
TRAINS = {"text_pretrain": ("text_loss",), "vit": ("caption_loss", "count_loss"),
          "joint_pretrain": ("text_loss", "caption_loss", "count_loss"), "midtrain": ("long_text_loss",),
          "sft": ("image_tool", "arithmetic"), "joint_rl": ("arithmetic", "image_tool", "description"),
          "parl": ("parl_item_f1",)}
LOWER_IS_BETTER = recipe_probes.LOSSES


# ------------------------------------------------------------------------------- chain
def init_fields(k25_model: bool, workdir: str) -> dict[str, str]:
  """The `init` fields that start a model from the run in `workdir`: a K2.5 model after a
  text-only run takes its decoder (`text_checkpoint`), every other pair all the params it
  shares (`checkpoint`)."""
  if not k25_model:
    return {"checkpoint": workdir}
  if k25.LANGUAGE_MODEL not in checkpoint.saved_params_keys(workdir):
    return {"checkpoint": "", "text_checkpoint": workdir}
  return {"checkpoint": workdir, "text_checkpoint": ""}


def init_from(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Points `config.init` at the run in `workdir` (`init_fields`)."""
  config.init.update(init_fields("vision" in config.model, workdir))


def judged(config: ml_collections.ConfigDict) -> bool:
  """Whether a judge rewards the stage (its `grm.checkpoint` is set)."""
  return "grm" in config and bool(config.grm.checkpoint)


def start_from(config: ml_collections.ConfigDict, previous: str | None, judge: str | None) -> None:
  """Points `config` at the runs it starts from: the previous stage's (`init_from`), and where a
  judge rewards it (`judged`), the recipe's judge (`judge`'s workdir)."""
  if previous is not None:
    init_from(config, previous)
  if judged(config):
    config.grm.checkpoint = judge


def judge_config(preset: str, overrides: tuple[str, ...] = (), k25_format: bool = False) -> ml_collections.ConfigDict:
  """configs/recipe.py's judge with the `--set judge.…` items of `overrides` applied; in the
  K2.5 format with mid-training's rope, as the chain's stages after it."""
  config = recipe_config.judge_config(preset, k25_format)
  config_utils.apply_overrides(config, [item.partition(".")[2] for item in overrides
                                        if item.partition(".")[0] == recipe_config.JUDGE])
  if k25_format:
    carry_long_context(stage_configs(preset, overrides, k25_format), (config,))
  return config


def run_judge(preset: str, root: str, overrides: tuple[str, ...] = (), k25_format: bool = False) -> str:
  """The judge's workdir, <root>/judge, trained there unless finished (its recipe_stage.json:
  the training's time and `init`); in the K2.5 format from <root>/<JUDGE_STARTS_FROM>'s run. Chains of
  several seeds run at once share one judge (their roots' `judge` links to one workdir): a lock
  beside the judge's real directory lets one of them train it while the others wait, then read it."""
  workdir = os.path.join(root, recipe_config.JUDGE)
  record = os.path.join(workdir, "recipe_stage.json")
  lock_path = os.path.realpath(workdir) + ".lock"
  os.makedirs(os.path.dirname(lock_path), exist_ok=True)
  with open(lock_path, "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not os.path.exists(record):
      start, config = time.time(), judge_config(preset, overrides, k25_format)
      if k25_format:
        config.init.update(checkpoint=os.path.join(root, recipe_config.JUDGE_STARTS_FROM), text_checkpoint="")
      sft.run(config, workdir)
      with open(record, "w") as f:
        json.dump({"stage_s": time.time() - start, "init": config.init.to_dict()}, f)
  return workdir


def judge_report(root: str) -> tuple[dict, dict] | None:
  """({"stage_s"}, the judge's agreement with the hidden rubric by setting: sft_eval.json's
  "judge") of <root>/judge, or None where no judge was trained."""
  workdir = os.path.join(root, recipe_config.JUDGE)
  if not os.path.exists(os.path.join(workdir, "recipe_stage.json")):
    return None
  with open(os.path.join(workdir, "recipe_stage.json")) as f, open(os.path.join(workdir, "sft_eval.json")) as g:
    return json.load(f), json.load(g)["judge"]


def carry_long_context(configs: dict[str, ml_collections.ConfigDict],
                       after: tuple[ml_collections.ConfigDict, ...] | None = None) -> None:
  """The stages after mid-training (or the configs `after`) keep its rope: YaRN, max positions =
  factor · original context."""
  lc = configs["midtrain"].long_context
  for config in after if after is not None else [configs[name] for name in STAGES[STAGES.index("midtrain") + 1:]]:
    text = config.model.text if "vision" in config.model else config.model
    text.update(rope_scaling=midtrain.yarn_scaling(lc),
                max_position_embeddings=int(round(lc.yarn_factor * lc.original_context)))


def stage_configs(preset: str, overrides: tuple[str, ...] = (), k25_format: bool = False
                  ) -> dict[str, ml_collections.ConfigDict]:
  """configs/recipe.py's stage configs (`k25_format`: SFT, joint RL and PARL in Kimi K2.5's chat
  format), `overrides` ("stage.section.field=value") applied, with mid-training's rope carried on."""
  configs = recipe_config.stage_configs(preset, k25_format)
  for item in overrides:
    stage, _, field = item.partition(".")
    if stage == recipe_config.JUDGE:
      continue     # `judge_config`'s
    if stage not in configs:
      raise ValueError(f"--set {item!r}: no stage {stage!r}; the stages are {STAGES} (and {recipe_config.JUDGE!r})")
    config_utils.apply_overrides(configs[stage], [field])
  carry_long_context(configs)
  return configs


def speaks_k25(configs: dict[str, ml_collections.ConfigDict]) -> bool:
  """Whether the chain's chat stages speak Kimi K2.5's format (configs/recipe.py's `k25_format`)."""
  return configs["sft"].data.chat_format == "k2.5"


def chat_tokenizer(configs: dict[str, ml_collections.ConfigDict]):
  """The tokenizer of the chain's vocabulary: the legacy chat tokenizer, or the byte tokenizer
  with Kimi K2.5's chat tokens. Its size places the video id past the vocabulary
  (`config_utils.k25_config_from`), so it must be the chain's, not the pre-training stages'."""
  return tokenizer.ByteTokenizer(media=True, chat=True) if speaks_k25(configs) else chat.ChatTokenizer()


def k25_model_config(name: str, configs: dict[str, ml_collections.ConfigDict]):
  """The K2.5 model of stage `name` (the text stage's: the K2.5 model the ViT stage builds on it;
  PARL's: joint RL's)."""
  tok = chat_tokenizer(configs)
  if name == "midtrain":
    return midtrain.long_context_model(configs[name], tok)
  k25_stage = {"text_pretrain": "vit", "parl": "joint_rl"}.get(name, name)
  return config_utils.k25_config_from(configs[k25_stage].model, tok)


def k25_params(model_cfg, workdir: str | None, mesh, rest_from: str | None = None):
  """The K2.5 params of the run in `workdir`, or a fresh init when `workdir` is None. A
  text-only run gives the decoder; the rest is K2.5 run `rest_from`'s (PARL after joint RL),
  else a fresh init of key 0 (text pre-training, as the ViT stage starts)."""
  model = k25.K25(model_cfg)
  with jax.set_mesh(mesh):
    if workdir is None:
      return trainer_lib.fresh_params(model, mesh, seed=0)
    text_only = k25.LANGUAGE_MODEL not in checkpoint.saved_params_keys(workdir)
    if text_only and rest_from is not None:
      params = trainer_lib.restore_params(model, rest_from, mesh)
      return {**params, k25.LANGUAGE_MODEL: trainer_lib.restore_params(model, workdir, mesh, k25.LANGUAGE_MODEL)}
    return trainer_lib.params_from(model, ml_collections.ConfigDict(init_fields(True, workdir)), mesh, seed=0)


def run_stage(name: str, config: ml_collections.ConfigDict, workdir: str):
  """The stage's `run(config, workdir)`."""
  return importlib.import_module(f"k25jax.stages.{STAGE_MODULES[name]}").run(config, workdir)


def run_chain(preset: str, root: str, probes: recipe_probes.Probes | None = None,
              overrides: tuple[str, ...] = (), last: str = STAGES[-1], k25_format: bool = False) -> dict:
  """Every stage in order, up to and with `last`, from the previous stage's workdir (joint RL's
  judge trained before it, `run_judge`), the probes before the first stage and after each (when
  given). Returns {"rows": {"init" | stage: probes}, "time_s": {stage | "judge": {...}},
  "judge": the judge's agreement with the hidden rubric, None without a judge}."""
  configs = stage_configs(preset, overrides, k25_format)
  mesh = sharding.make_mesh(common.mesh_section().to_dict())

  def probe(name: str, workdir: str | None) -> dict:
    """{"probes", "probe_s"} of stage `name`'s model with the params of `workdir` (None: fresh)."""
    start, cfg = time.time(), k25_model_config(name, configs)
    rest_from = os.path.join(root, "joint_rl") if name == "parl" else None
    return {"probes": probes(cfg, k25_params(cfg, workdir, mesh, rest_from), mesh), "probe_s": time.time() - start}

  rows, times, previous, judge = {}, {}, None, None
  if probes is not None:
    first = probe(STAGES[0], None)
    rows["init"], times["init"] = first["probes"], {"probe_s": first["probe_s"]}
  for name in STAGES[:STAGES.index(last) + 1]:
    workdir = os.path.join(root, name)
    record = os.path.join(workdir, "recipe_stage.json")
    finished = os.path.exists(record)
    if finished:
      with open(record) as f:
        done = json.load(f)
      measured = set(done.get("probes", {}))
      stale = probes is not None and set(recipe_probes.PROBES + recipe_probes.EXTRAS) - measured   # added since
    else:
      config = configs[name]
      if judged(config) and judge is None:
        judge = run_judge(preset, root, overrides, k25_format)
      start_from(config, previous, judge)
      start = time.time()
      run_stage(name, config, workdir)
      done, stale = {"stage_s": time.time() - start, "init": config.init.to_dict()}, probes is not None
    if stale:
      done.update(probe(name, workdir))
    if stale or not finished:
      with open(record, "w") as f:
        json.dump(done, f, indent=1)
    if "probes" in done:
      rows[name] = done["probes"]
    times[name] = {k: done[k] for k in ("stage_s", "probe_s") if k in done}
    previous = workdir
  report = judge_report(root)
  if report is not None:
    times[recipe_config.JUDGE] = report[0]
  return {"rows": rows, "time_s": times, "judge": report[1] if report else None}


def seed_overrides(seed: int) -> tuple[str, ...]:
  """--set items giving every stage training seed `seed`: `train.seed`, the SFT's data
  (`data.seed`: its trajectories and examples), PARL's warm start. The held-out sets of the
  stages and the probes keep their own seeds, so every seed is measured on the same tasks, and
  the judge is the same reward model for every seed (a root whose `judge` links to a finished
  one reuses it)."""
  return tuple([f"{name}.train.seed={seed}" for name in STAGES] + [f"sft.data.seed={seed}",
                                                                   f"parl.warm_start.seed={seed}"])


# ------------------------------------------------------------------------------- report
def gain(probe: str, before: float, after: float) -> float:
  """How much better `after` is than `before` on `probe` (losses: lower is better)."""
  return before - after if probe in LOWER_IS_BETTER else after - before


def at_ceiling(probe: str, before: float, after: float) -> bool:
  """An accuracy probe that was already 1 and stayed 1: nothing left to improve."""
  return probe not in LOWER_IS_BETTER and before >= 1.0 and after >= 1.0


def changes(rows: dict[str, dict]) -> tuple[list[dict], list[dict]]:
  """(each stage's change on the probes it trains, over the row before it: improved, or kept at
  its ceiling; forgetting: every drop, by a stage that does not train it, of a probe earlier
  stages had raised above the first row)."""
  names = list(rows)
  trained, forgetting = [], []
  for i, name in enumerate(names[1:], start=1):
    first, before, after = rows[names[0]], rows[names[i - 1]], rows[name]
    for probe in TRAINS[name]:
      trained.append(dict(stage=name, probe=probe, before=before[probe], after=after[probe],
                          improved=gain(probe, before[probe], after[probe]) > 0,
                          at_ceiling=at_ceiling(probe, before[probe], after[probe])))
    for probe in recipe_probes.PROBES:
      learnt = gain(probe, first[probe], before[probe]) > 0
      if probe not in TRAINS[name] and learnt and gain(probe, before[probe], after[probe]) < 0:
        forgetting.append(dict(stage=name, probe=probe, before=before[probe], after=after[probe]))
  return trained, forgetting


def markdown(result: dict) -> str:
  rows, times = result["rows"], result["time_s"]
  columns = recipe_probes.PROBES + recipe_probes.EXTRAS
  lines = ["| after | " + " | ".join(columns) + " | stage min | probe min |",
           "|---" * (len(columns) + 3) + "|"]
  for name, r in rows.items():
    t = times.get(name, {})
    cells = [f"{r[c]:.3f}" for c in columns]
    lines.append(f"| {name} | " + " | ".join(cells) + f" | {t.get('stage_s', 0) / 60:.1f} | "
                 f"{t.get('probe_s', 0) / 60:.1f} |")
  trained, forgetting = changes(rows)
  lines += ["", "Each stage on the probes it trains (against the row before it):", ""]
  verdict = lambda c: "better" if c["improved"] else "kept at its ceiling" if c["at_ceiling"] else "NOT better"
  lines += [f"* {c['stage']}: {c['probe']} {c['before']:.3f} → {c['after']:.3f} ({verdict(c)})" for c in trained]
  lines += ["", "Forgetting (a stage lowers a probe that earlier stages had raised, and it does not train):", ""]
  lines += [f"* {f['stage']}: {f['probe']} {f['before']:.3f} → {f['after']:.3f}" for f in forgetting] or ["* none"]
  if result.get("judge"):
    lines += ["", "Joint RL's judge (configs/grm.py, trained beside the chain) against the hidden rubric on "
              "held-out descriptions:", ""]
    lines += [f"* {name}: Spearman {r['spearman']:.3f}, exact score {r['score_accuracy']:.3f}, unparsable "
              f"{r['unparsable_rate']:.3f}" for name, r in result["judge"].items()]
  total = sum(t.get("stage_s", 0) + t.get("probe_s", 0) for t in times.values())
  lines += ["", f"Total: {total / 60:.1f} min (stages and probes)."]
  return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
  rows = result["rows"]
  names = list(rows)
  columns = (len(recipe_probes.PROBES) + 2) // 2   # a panel a probe, and one for the episode lengths
  fig, axes = plt.subplots(2, columns, figsize=(4 * columns, 7))
  for ax, probe in zip(axes.flat, recipe_probes.PROBES):
    ax.plot(range(len(names)), [rows[n][probe] for n in names], marker="o")
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
    ax.set_title(probe + (" (lower is better)" if probe in LOWER_IS_BETTER else ""), fontsize=9)
    ax.grid(alpha=0.3)
  ax = axes.flat[len(recipe_probes.PROBES)]   # the spare panel: episode lengths
  for extra in ("arithmetic_tokens", "image_tool_tokens"):
    ax.plot(range(len(names)), [rows[n][extra] for n in names], marker="o", label=extra)
  ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
  ax.set_title("generated tokens an episode (what Toggle shortens)", fontsize=9)
  ax.legend(fontsize=7)
  ax.grid(alpha=0.3)
  fig.suptitle("one tiny K2.5 model through the recipe: held-out probes after each stage")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", default="tiny", choices=("tiny", "test"))
  parser.add_argument("--root", default="runs/recipe")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "recipe"))
  parser.add_argument("--probe_tasks", type=int, default=32, help="held-out rollout tasks per probe")
  parser.add_argument("--seed", type=int, default=0, help="every stage's training seeds (`seed_overrides`)")
  parser.add_argument("--last", default=STAGES[-1], choices=STAGES,
                      help="stop after this stage (a later run with the same --root resumes from it)")
  parser.add_argument("--k25_format", action="store_true",
                      help="SFT, joint RL and PARL in Kimi K2.5's chat format (configs/recipe.py's switch)")
  parser.add_argument("--judge_only", action="store_true",
                      help="train the judge in <root>/judge (unless finished) and stop")
  parser.add_argument("--set", action="append", default=[], metavar="STAGE.SECTION.FIELD=VALUE",
                      help="override a stage's config field, e.g. --set sft.optimizer.name=adamw (repeatable)")
  args = parser.parse_args()
  overrides = seed_overrides(args.seed) + tuple(args.set)
  if args.judge_only:
    print(f"judge: {run_judge(args.preset, args.root, overrides, args.k25_format)}")
    return
  configs = stage_configs(args.preset, overrides, args.k25_format)
  probes = recipe_probes.Probes(configs["sft"], configs["parl"], tasks=args.probe_tasks)
  start = time.time()
  result = run_chain(args.preset, args.root, probes, overrides, last=args.last, k25_format=args.k25_format)
  result.update(preset=args.preset, k25_format=args.k25_format, seed=args.seed, overrides=args.set, trains=TRAINS,
                wall_s=time.time() - start,
                devices=jax.device_count())
  result["trained"], result["forgetting"] = changes(result["rows"])
  with open(args.out + ".json", "w") as f:
    json.dump(result, f, indent=1)
  table = markdown(result)
  with open(args.out + ".md", "w") as f:
    f.write(table)
  plot(result, args.out + ".png")
  print(table)
  print(f"wrote {args.out}.json, .md and .png")


if __name__ == "__main__":
  main()
