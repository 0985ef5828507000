"""Benchmark: an RL iteration of k25jax against TRL's GRPOTrainer, the same problem from the same weights.

    python experiments/bench_rl.py [--iterations 8 --processes 3 --out experiments/results/bench_rl.json]

The problem is `configs/rl.py:tiny` (2-digit addition in the chat rendering, the tiny chat
decoder) with AdamW: 32 prompts × K = 8 samples of at most 20 new tokens at T = 1 an
iteration, lr 2e-4 (5 warmup updates, then constant), β2 0.95, no weight decay, gradients
clipped to norm 1, the iteration's 256 rollouts in 2 updates of 128. Both stacks start from
the stage's built-in warm start (trained once, then exported to a Hugging Face folder with
`hf.save`: TRL loads DeepseekV3ForCausalLM and the tokenizer from it) and draw their prompts
from the same 1024-prompt pool (TRL gets them as text; each must tokenize back to k25jax's ids).

    k25jax  `rl.run` as `python -m k25jax.main --config=configs/rl.py` runs it, with
            `optimizer.name=adamw` and `train.router_bias_rate=0` (TRL has no bias update):
            the K2.5 loss (Eq. 1), group advantages r − mean; π_old is the sampler's log-prob
    TRL     GRPOTrainer: `loss_type="dapo"` (PPO-clip per token, ε 0.2 / 0.28, the token sum
            over the generation batch's token count: of TRL's losses the nearest to Eq. 1, which
            sums tokens over each prompt's K responses and masks a log-ratio band instead of
            clipping), `scale_rewards="none"` (A = r − mean, as Eq. 1), `beta=0` (no reference
            model), `steps_per_generation=2` (a generation batch, two updates), `top_k=0`

Per iteration each side reports its wall time and its split: rollout (sampling the 256
responses; on k25jax's side also laying them out as loss rows, TRL does that in its update),
scoring (the reward), old log-probs (a forward pass TRL runs because the batch serves two
updates; k25jax records π_old while sampling) and update (the rest: the losses, backward
passes, optimizer steps and each loop's bookkeeping: an iteration's wall time runs from one
rollout's start to the next on both sides), and rollout tokens/s (generated tokens, the stop token
included, over the rollout time). The first iteration (compilation on k25jax's side) is left
out of the medians, and so is k25jax's last (no next rollout ends it). After `--iterations` iterations both final policies are evaluated by the
same code, k25jax's `rl.evaluate` (TRL's saved folder loaded with `hf.load`): held-out sampled
accuracy (2 samples a prompt at T = 1) and greedy accuracy on the 256 held-out prompts.

The processes alternate k25jax, TRL, k25jax, ... (`--processes` each), each recording the CPU
other processes used beside it (interleave.LoadMeter); the JSON is written only when none ran
beside other work (`--allow_load` writes it marked). Figures: the median over a side's processes
of each process's median iteration, and the range across processes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import interleave  # noqa: E402

SIDES = ("k25jax", "trl")
PARTS = ("rollout_s", "scoring_s", "old_logprobs_s", "update_s")


def rl_config(iterations: int):
  """configs/rl.py:tiny with AdamW and no router-bias update, `iterations` iterations, evaluated at 0 and the end."""
  from k25jax.train import config_utils
  config = config_utils.load_config_file(os.path.join(ROOT, "configs", "rl.py"))
  config.optimizer.name = "adamw"
  config.train.update(steps=iterations, eval_every=iterations, log_every=1, checkpoint_every=iterations,
                      router_bias_rate=0.0)
  return config


def prepare(workdir: str) -> tuple[str, str]:
  """The built-in warm start (trained once under workdir) and its Hugging Face folder: (start, folder)."""
  import jax
  from k25jax.convert import hf, hf_tokenizer
  from k25jax.data import chat_formats
  from k25jax.model import transformer
  from k25jax.stages import rl
  from k25jax.train import config_utils, sharding, trainer as trainer_lib
  config = rl_config(1)
  start = rl.shared_warm_start(config, workdir)
  folder = os.path.join(workdir, "hf_start")
  if not os.path.exists(os.path.join(folder, "config.json")):
    model = transformer.Transformer(config_utils.model_config_from(config.model))
    params = jax.device_get(trainer_lib.restore_params(model, start, sharding.make_mesh(config.mesh.to_dict())))
    hf.save(model.cfg, params, folder)
    task = rl.make_task(config, model.cfg.max_position_embeddings)
    hf_tokenizer.write(chat_formats.record_of(task.tokenizer), folder)
  return start, folder


def held_out(config, params) -> dict:
  """k25jax's held-out evaluation of `params` (the stage's `evaluate`, its key and samples)."""
  import jax
  from k25jax.stages import rl
  from k25jax.train import config_utils
  cfg = config_utils.model_config_from(config.model)
  task = rl.make_task(config, cfg.max_position_embeddings)
  return rl.evaluate(cfg, params, task, jax.random.PRNGKey(config.train.seed + 1),
                     rl.sampling_config(config, task), config.rl.eval_samples)


# ------------------------------------------------------------------------------------------- k25jax
def run_k25jax(iterations: int, start: str) -> dict:
  """`rl.run` from the warm start. Iteration i's wall time runs from its rollout's start to the
  next one's (the last iteration, which also holds the final evaluation, has none); its
  rollout is the driver's `sample_s` less the grading (timed apart), its update the rest."""
  from k25jax.stages import rl
  config = rl_config(iterations)
  config.init.checkpoint = start
  grading, tokens, starts = [], [], []
  grade, collector = rl.AdditionTask.grade, rl.collector

  def timed_grade(self, split, rows, completions):
    t = time.perf_counter()
    out = grade(self, split, rows, completions)
    grading.append(time.perf_counter() - t)
    tokens.append(float(out["length"].sum()))      # generated tokens, the stop token included
    return out

  def timed_collector(*args, **kwargs):
    collect = collector(*args, **kwargs)

    def timed_collect(params, it):
      starts.append(time.perf_counter())
      return collect(params, it)
    return timed_collect

  rl.AdditionTask.grade, rl.collector = timed_grade, timed_collector
  with tempfile.TemporaryDirectory() as workdir, interleave.LoadMeter() as load:
    _, history = rl.run(config, workdir)
  train = [h for h in history if h["split"] == "train"]
  evals = [h for h in history if h["split"] == "eval"]
  # grading calls: 2 per evaluation (sampled, greedy), then one per iteration
  iteration_calls = slice(2, 2 + iterations)
  rows = [{"wall_s": wall, "rollout_s": h["sample_s"] - g, "scoring_s": g, "old_logprobs_s": 0.0,
           "update_s": wall - h["sample_s"], "generated_tokens": n}
          for wall, h, g, n in zip(np.diff(starts), train, grading[iteration_calls], tokens[iteration_calls])]
  return {"iterations": rows, "start": _eval_row(evals[0]), "end": _eval_row(evals[-1]), "other_cores": load.other_cores}


def _eval_row(h: dict) -> dict:
  return {"accuracy": h["accuracy"], "greedy_accuracy": h["greedy_accuracy"]}


# ---------------------------------------------------------------------------------------------- TRL
def run_trl(iterations: int, folder: str) -> dict:
  """GRPOTrainer from the warm start's folder; per iteration (two optimizer steps) its wall time and split."""
  import datasets
  import torch
  import transformers
  import trl
  from k25jax.convert import hf
  from k25jax.stages import rl
  from k25jax.train import config_utils
  config = rl_config(iterations)
  cfg = config_utils.model_config_from(config.model)
  task = rl.make_task(config, cfg.max_position_embeddings)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  texts = []
  for ids, n in zip(task.train["tokens"], task.train["prompt_length"]):
    text = tokenizer.decode(ids[:n].tolist())
    if tokenizer(text, add_special_tokens=False)["input_ids"] != ids[:n].tolist():
      raise ValueError(f"the exported tokenizer does not give back k25jax's prompt ids for {text!r}")
    texts.append(text)
  dataset = datasets.Dataset.from_dict({"prompt": texts, "a": task.train["a"].tolist(), "b": task.train["b"].tolist()})
  rl_section, opt = config.rl, config.optimizer
  timings = {"rollout_s": [], "scoring_s": [], "old_logprobs_s": [], "generated_tokens": []}

  def reward(prompts, completions, completion_ids, a, b, **_):
    width = max(len(c) for c in completion_ids)
    padded = np.full((len(completion_ids), width), task.render.pad_id, np.int32)
    for i, c in enumerate(completion_ids):
      padded[i, :len(c)] = c
    grades = task.grade({"a": np.asarray(a), "b": np.asarray(b)}, np.arange(len(a)), padded)
    timings["generated_tokens"].append(float(sum(len(c) for c in completion_ids)))
    return grades["reward"].tolist()

  class TimedGRPOTrainer(trl.GRPOTrainer):
    def _generate(self, prompts):
      t = time.perf_counter()
      out = super()._generate(prompts)
      timings["rollout_s"].append(time.perf_counter() - t)
      return out

    def _calculate_rewards(self, *args, **kwargs):
      t = time.perf_counter()
      out = super()._calculate_rewards(*args, **kwargs)
      timings["scoring_s"].append(time.perf_counter() - t)
      return out

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
      t = time.perf_counter()
      out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
      if not torch.is_grad_enabled():
        timings["old_logprobs_s"].append(time.perf_counter() - t)
      return out

  step_ends = []

  class StepClock(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
      step_ends.append(time.perf_counter())

  k = rl_section.num_generations
  rollouts = rl_section.prompts_per_iteration * k
  with tempfile.TemporaryDirectory() as out:
    args = trl.GRPOConfig(
        output_dir=out, per_device_train_batch_size=rollouts // rl_section.minibatches,
        steps_per_generation=rl_section.minibatches, gradient_accumulation_steps=1, num_generations=k,
        max_completion_length=rl_section.max_new_tokens, temperature=rl_section.temperature, top_k=0, top_p=1.0,
        learning_rate=opt.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=opt.warmup_steps,
        adam_beta1=0.9, adam_beta2=opt.b2, adam_epsilon=1e-8, weight_decay=opt.weight_decay,
        max_grad_norm=opt.grad_clip, beta=0.0, loss_type="dapo", scale_rewards="none", num_iterations=1,
        max_steps=iterations * rl_section.minibatches, logging_steps=rl_section.minibatches, save_strategy="no",
        report_to=[], use_cpu=True, seed=config.train.seed, disable_tqdm=True, bf16=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = task.render.stop_id
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(task.render.pad_id)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(task.render.stop_id)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[StepClock()])
    with interleave.LoadMeter() as load:
      begin = time.perf_counter()
      trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    _, params = hf.load(os.path.join(out, "final"))
  ends = step_ends[rl_section.minibatches - 1::rl_section.minibatches]
  walls = np.diff([begin] + ends)
  rows = []
  for i, wall in enumerate(walls):
    split = {name: timings[name][i] for name in ("rollout_s", "scoring_s", "old_logprobs_s")}
    rows.append({"wall_s": float(wall), **split, "update_s": float(wall) - sum(split.values()),
                 "generated_tokens": timings["generated_tokens"][i]})
  start_eval = held_out(config, hf.load(folder)[1])
  return {"iterations": rows, "start": _eval_row(start_eval), "end": _eval_row(held_out(config, params)),
          "other_cores": load.other_cores}


# ---------------------------------------------------------------------------------------- the table
def side_summary(runs: list[dict]) -> dict:
  """Per figure, the median over processes of each process's median over iterations 2.., and the range."""
  def per_process(run, key):
    rows = run["iterations"][1:]
    if key == "tokens_per_s":
      return statistics.median(r["generated_tokens"] / r["rollout_s"] for r in rows)
    return statistics.median(r[key] for r in rows)

  out = {}
  for key in ("wall_s", *PARTS, "tokens_per_s"):
    values = [per_process(r, key) for r in runs]
    out[key] = {"median": statistics.median(values), "processes": values}
  for when in ("start", "end"):
    for metric in ("accuracy", "greedy_accuracy"):
      values = [r[when][metric] for r in runs]
      out[f"{when}_{metric}"] = {"median": statistics.median(values), "processes": values}
  return out


def print_table(summary: dict) -> None:
  print(f"\n{'':24s}" + "".join(f"{side:>26s}" for side in SIDES))
  labels = {"wall_s": "iteration wall s", "rollout_s": "  rollout s", "scoring_s": "  scoring s",
            "old_logprobs_s": "  old log-probs s", "update_s": "  update s", "tokens_per_s": "rollout tokens/s",
            "start_accuracy": "held-out acc. (start)", "end_accuracy": "held-out acc. (end)",
            "start_greedy_accuracy": "greedy acc. (start)", "end_greedy_accuracy": "greedy acc. (end)"}
  for key, label in labels.items():
    cells = []
    for side in SIDES:
      v = summary[side][key]
      cells.append(f"{v['median']:.4g} [{min(v['processes']):.4g}, {max(v['processes']):.4g}]")
    print(f"{label:24s}" + "".join(f"{c:>26s}" for c in cells))
  speed = summary["speedup"]
  print(f"\nk25jax over TRL: wall time per iteration {speed['wall']:.2f}x, rollout tokens/s {speed['tokens_per_s']:.2f}x")


def child(args) -> None:
  result = (run_k25jax(args.iterations, args.start) if args.side == "k25jax" else
            run_trl(args.iterations, args.folder))
  with open(args.one, "w") as f:
    json.dump(result, f)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--iterations", type=int, default=8)
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "bench_rl.json"))
  parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "k25jax_bench_rl"),
                      help="where the warm start and its HF folder are kept between runs")
  parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
  parser.add_argument("--start", help=argparse.SUPPRESS)
  parser.add_argument("--folder", help=argparse.SUPPRESS)
  interleave.add_process_arguments(parser)
  args = parser.parse_args()
  if args.one:
    return child(args)
  if args.iterations < 3:
    parser.error("--iterations must be at least 3 (the first is left out of the medians, and k25jax's last has "
                 "no next rollout to end its wall time)")
  start, folder = prepare(args.workdir)
  runs = {side: [] for side in SIDES}
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(args.processes):
      for side in SIDES:
        path = os.path.join(tmp, f"{side}_{i}.json")
        subprocess.run([sys.executable, __file__, f"--one={path}", f"--side={side}", f"--start={start}",
                        f"--folder={folder}", f"--iterations={args.iterations}"], check=True)
        with open(path) as f:
          runs[side].append(json.load(f))
        print(f"{side} process {i + 1}: {json.dumps(runs[side][-1]['end'])}, other cores "
              f"{runs[side][-1]['other_cores']:.2f}", flush=True)
  summary = {side: side_summary(runs[side]) for side in SIDES}
  summary["speedup"] = {"wall": summary["trl"]["wall_s"]["median"] / summary["k25jax"]["wall_s"]["median"],
                        "tokens_per_s": summary["k25jax"]["tokens_per_s"]["median"]
                        / summary["trl"]["tokens_per_s"]["median"]}
  print_table(summary)
  other = [r["other_cores"] for side in SIDES for r in runs[side]]
  result = {"iterations": args.iterations, "processes": args.processes, "summary": summary, "runs": runs,
            "other_cores": other, "max_load": args.max_load}
  import torch
  import transformers
  import trl
  result["versions"] = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                        "torch_threads": torch.get_num_threads()}
  interleave.write_unless_loaded(args.out, result, args.allow_load)


if __name__ == "__main__":
  main()
