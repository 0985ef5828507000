"""Export a run's params as a Hugging Face folder that transformers loads.

    python -m k25jax.export --workdir=RUN --out=DIR [--step=N] [--dtype=float32|bfloat16] [--int4]

What the folder holds: k25jax/train/hf_export.py.
"""
from __future__ import annotations

from absl import app, flags

from k25jax.train import hf_export

_WORKDIR = flags.DEFINE_string("workdir", None, "The run to export (a k25jax workdir).")
_OUT = flags.DEFINE_string("out", None, "The folder to write.")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint to export (default: the newest).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "The dtype of the exported weights.")
_INT4 = flags.DEFINE_bool("int4", False, "The routed experts as compressed-tensors pack-quantized INT4, groups of 32 "
                          "(as Kimi K2.5 is released).")


def main(argv):
  del argv
  if not _WORKDIR.value or not _OUT.value:
    raise app.UsageError("--workdir and --out are required")
  out = hf_export.export(_WORKDIR.value, _OUT.value, _DTYPE.value, _STEP.value, 32 if _INT4.value else None)
  print(f"exported {_WORKDIR.value} to {out}")


if __name__ == "__main__":
  app.run(main)
