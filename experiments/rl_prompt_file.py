"""Experiment: RL on a prompt file graded by the `math` verifier (task.name=file), tiny, on CPU.

    python experiments/rl_prompt_file.py [--iterations 100 --max_operand 49 --p_worked 0.5 --eval_every 10 --seed 0
                                          --out experiments/results/rl_prompt_file --workdir DIR]

Writes two JSONL files as a user would bring them: `--train_prompts` training and `--held_out` held-out questions
"What is a + b?" (a, b drawn from [0, --max_operand], the held-out pairs not among the training ones)
whose records carry the answer as text and `"verifier": "math"` (math-verify compares the
completion's last number with it); a `--p_worked` share of the training records carry as
their `completion` (the warm start's demonstration) the sum worked digit by digit, units
first with the carry ("7+8=15 2+4+1=7 so 75"), the others the bare answer. Then `configs/rl.py:tiny` with `task.name=file` over them:
the built-in warm start fine-tunes on the records' answers, then `--iterations` RL
iterations with the K2.5 loss, the held-out prompts evaluated every `--eval_every`
(sampled accuracy at T = 1, `rl.eval_samples` a prompt, and greedy accuracy). Writes
`<out>.json`: the evaluations, the training rewards, the config and the wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from k25jax.stages import rl
from k25jax.train import config_utils

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def worked(a: int, b: int) -> str:
  """The sum worked digit by digit, units first, carry included: 27 + 48 → "7+8=15 2+4+1=7 so 75"."""
  units = a % 10 + b % 10
  carry = f"+{units // 10}" if units >= 10 else ""
  return f"{a % 10}+{b % 10}={units} {a // 10}+{b // 10}{carry}={a // 10 + b // 10 + units // 10} so {a + b}"


def write_prompts(folder: str, n_train: int, n_held_out: int, seed: int, top: int, p_worked: float
                  ) -> tuple[str, str]:
  """The two prompt files (module docstring), operands in [0, top); returns their paths."""
  rng = np.random.default_rng(seed)
  pairs = list(dict.fromkeys(map(tuple, rng.integers(0, top, (4 * (n_train + n_held_out), 2)).tolist())))
  if len(pairs) < n_train + n_held_out:
    raise ValueError(f"only {len(pairs)} distinct pairs below {top}: fewer --train_prompts or --held_out")
  paths = []
  for name, chosen in (("train", pairs[:n_train]), ("held_out", pairs[n_train:n_train + n_held_out])):
    path = os.path.join(folder, f"{name}.jsonl")
    with open(path, "w") as f:
      for a, b in chosen:
        record = {"prompt": f"What is {a} + {b}?", "answer": str(a + b), "verifier": "math"}
        if name == "train":
          record["completion"] = worked(a, b) if rng.random() < p_worked else str(a + b)
        f.write(json.dumps(record) + "\n")
    paths.append(path)
  return paths[0], paths[1]


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--iterations", type=int, default=100)
  parser.add_argument("--eval_every", type=int, default=10)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--train_prompts", type=int, default=1024)
  parser.add_argument("--held_out", type=int, default=128)
  parser.add_argument("--max_operand", type=int, default=49)
  parser.add_argument("--p_worked", type=float, default=0.5,
                      help="the share of training records whose demonstration is the worked sum")
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "rl_prompt_file"))
  parser.add_argument("--workdir", default="", help="the run and its prompt files (default: a new temporary folder)")
  parser.add_argument("--set", action="append", default=[], help="section.field=value, repeatable")
  args = parser.parse_args()
  workdir = args.workdir or tempfile.mkdtemp(prefix="rl_prompt_file_")
  os.makedirs(workdir, exist_ok=True)
  train, held_out = write_prompts(workdir, args.train_prompts, args.held_out, args.seed, args.max_operand + 1,
                                  args.p_worked)
  config = config_utils.load_config_file(os.path.join(ROOT, "configs", "rl.py"), "tiny")
  config.task.update(name="file", files=train, eval_files=held_out, verifier="math", seed=args.seed)
  config.train.update(steps=args.iterations, eval_every=args.eval_every, seed=args.seed)
  config.rl.max_new_tokens = 24          # the longest worked sum, 22 characters, and the stop token
  config.warm_start.seed = args.seed
  config_utils.apply_overrides(config, args.set)
  start = time.time()
  _, history = rl.run(config, workdir)
  evals = [{k: h[k] for k in ("iteration", "accuracy", "greedy_accuracy", "mean_length")}
           for h in history if h["split"] == "eval"]
  train_rows = [{"iteration": h["iteration"], "reward": h["reward"]} for h in history if h["split"] == "train"]
  result = {"evaluations": evals, "train": train_rows, "wall_s": round(time.time() - start, 1),
            "config": config.to_dict()}
  with open(args.out + ".json", "w") as f:
    json.dump(result, f, indent=1, default=str)
  print("held-out sampled accuracy (greedy):")
  for row in evals:
    print(f"  iteration {row['iteration']:4d}: {row['accuracy']:.3f} ({row['greedy_accuracy']:.3f})")
  print(f"{result['wall_s']:.0f} s; wrote {args.out}.json")


if __name__ == "__main__":
  main()
