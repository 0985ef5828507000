"""Does the data loader keep up? Tokenizing once (`k25jax.data.prepare`) and reading prepared
shards (grain random access, shuffled, chunked and packed: what `data.source=files` runs), in
tokens/s on one core, against what one TPU v5p host of the k25 pod layout consumes.

The corpus: reasoning-gym's `codeio.jsonl.gz` (3,002 code samples the package ships, not
written by this project; its `codeio-hq.jsonl.gz` is one JSON array, not JSON lines, and the
reader refuses it in one line), byte tokenizer. The k25 layout
(`configs/pretrain.py:k25`, `experiments/results/aot_compile.json`): 512 v5p chips, 4 a host,
global batch 1024 × 4096 tokens, 8.9e17 analytic flops a step, i.e. 1,741 TFLOP a chip. At
the chip's peak (459 bf16 TFLOP/s, the fastest any step can be) a step takes 3.8 s and a host
reads 32,768 tokens a step; the table gives that rate and the loader's margin over it.

    python experiments/bench_data.py [--batches 200] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import ml_collections

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from k25jax.data import files, prepare, tokenizer  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bench_data.json")
V5P_PEAK_BF16 = 459e12          # flop/s a chip
K25_FLOPS_PER_CHIP = 1.741e15   # analytic, a step (experiments/results/aot_compile.json: 8.913e17 / 512)
K25_HOST_TOKENS = 1024 * 4096 // 128   # a step's tokens a host reads (512 chips, 4 a host)
SEQ_LEN, BATCH = 4096, 16


def corpus() -> str:
  import reasoning_gym  # pylint: disable=import-outside-toplevel
  data = os.path.join(os.path.dirname(reasoning_gym.__file__), "data")
  return f"{data}/codeio.jsonl.gz"


def read_rate(folder: str, batches: int) -> float:
  """Targets a second of the training mixture over `folder` ([BATCH, SEQ_LEN] packed rows)."""
  tok = tokenizer.ByteTokenizer()
  data = ml_collections.ConfigDict(dict(files=folder, eval_files="", text_field="code_sample", eval_every=50))
  mixed, _ = files.load(data, tok)
  it = iter(files.mixture(mixed, tok, seq_len=SEQ_LEN, batch=BATCH, seed=0, max_doc_tokens=2))
  next(it)
  start, targets = time.perf_counter(), 0
  for _ in range(batches):
    targets += int(next(it)["loss_mask"].sum())
  return targets / (time.perf_counter() - start)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batches", type=int, default=200)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  prepare_rates, read_rates = [], []
  for _ in range(args.repeats):
    with tempfile.TemporaryDirectory() as out:
      start = time.perf_counter()
      manifest = prepare.prepare(corpus(), out, "bytes", "code_sample", progress=False)
      prepare_rates.append(manifest["tokens"] / (time.perf_counter() - start))
      read_rates.append(read_rate(out, args.batches))
  step_s = K25_FLOPS_PER_CHIP / V5P_PEAK_BF16
  need = K25_HOST_TOKENS / step_s
  result = {"corpus": "reasoning-gym codeio.jsonl.gz (code_sample)",
            "documents": manifest["documents"], "tokens": manifest["tokens"], "tokenizer": "bytes",
            "prepare_tokens_per_s": statistics.median(prepare_rates), "read_tokens_per_s": statistics.median(read_rates),
            "raw": {"prepare": prepare_rates, "read": read_rates}, "batch": [BATCH, SEQ_LEN],
            "k25_step_s_at_peak": step_s, "k25_host_tokens_per_s_at_peak": need,
            "read_margin_over_host_need": statistics.median(read_rates) / need}
  print(f"corpus: {result['corpus']}: {result['documents']:,} documents, {result['tokens']:,} byte tokens")
  print(f"{'what':46s} {'tokens/s (median of ' + str(args.repeats) + ')':>26s} {'min':>12s} {'max':>12s}")
  for name, rates in (("prepare (tokenize + write shards), one core", prepare_rates),
                      (f"read + shuffle + pack [{BATCH} x {SEQ_LEN}], one core", read_rates)):
    print(f"{name:46s} {statistics.median(rates):>26,.0f} {min(rates):>12,.0f} {max(rates):>12,.0f}")
  print(f"{'a v5p host of the k25 layout at peak (' + f'{step_s:.1f} s a step)':46s} {need:>26,.0f}")
  print(f"margin of reading over that need: {result['read_margin_over_host_need']:.0f}x")
  os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
  with open(RESULTS, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {RESULTS}")


if __name__ == "__main__":
  main()
