"""Export a run's params as a Hugging Face folder that transformers loads.

    python -m k25jax.export --workdir=RUN --out=DIR [--dtype=float32|bfloat16]

What the folder holds: k25jax/train/hf_export.py.
"""
from __future__ import annotations

from absl import app, flags

from k25jax.train import hf_export

_WORKDIR = flags.DEFINE_string("workdir", None, "The run to export (a k25jax workdir).")
_OUT = flags.DEFINE_string("out", None, "The folder to write.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "The dtype of the exported weights.")


def main(argv):
  del argv
  if not _WORKDIR.value or not _OUT.value:
    raise app.UsageError("--workdir and --out are required")
  print(f"exported {_WORKDIR.value} to {hf_export.export(_WORKDIR.value, _OUT.value, _DTYPE.value)}")


if __name__ == "__main__":
  app.run(main)
