"""Offline text sources: text that ships with every Python install, or is generated, no download.

`visual_captions` is the text side of the synthetic visual tasks (prompts and answers,
k25jax.data.visual_synthetic, 1000 documents of 8 lines, from a seed of their own), for a language model that
already speaks the captions' language when the ViT stage aligns images to it.

`files` reads the user's JSONL, gzip JSONL and Parquet files (`k25jax/data/files.py`).

`python_stdlib` reads the top-level modules of the running interpreter's standard
library (about 170 files, ~4.7 MB of Python source and docstrings), in sorted
order, and cuts them into documents of whole paragraphs (blank-line separated).
"""
from __future__ import annotations

import glob
import os
import sysconfig

from k25jax.data import files, image_text, visual_synthetic

SOURCES = ("python_stdlib", "visual_captions", "files")


def paragraphs_to_documents(text: str, max_chars: int) -> list[str]:
  """Greedily groups consecutive paragraphs into documents of at most `max_chars`
  (a longer paragraph is cut into `max_chars` pieces)."""
  docs, current = [], ""
  for para in text.split("\n\n"):
    para = para.strip("\n")
    if not para.strip():
      continue
    for start in range(0, len(para), max_chars):
      piece = para[start:start + max_chars]
      if current and len(current) + 2 + len(piece) > max_chars:
        docs.append(current)
        current = ""
      current = f"{current}\n\n{piece}" if current else piece
  if current:
    docs.append(current)
  return docs


def python_stdlib(max_chars: int) -> list[str]:
  """Documents from the standard library's top-level `*.py` files, deterministic order."""
  root = sysconfig.get_paths()["stdlib"]
  files = sorted(glob.glob(os.path.join(root, "*.py")))
  if not files:
    raise FileNotFoundError(f"no Python standard library sources under {root!r}")
  docs = []
  for path in files:
    with open(path, encoding="utf-8", errors="replace") as f:
      docs.extend(paragraphs_to_documents(f.read(), max_chars))
  return docs


def split(docs: list[str], eval_every: int) -> tuple[list[str], list[str]]:
  """(train, eval): every `eval_every`-th document is held out for evaluation."""
  train = [d for i, d in enumerate(docs) if i % eval_every]
  held_out = [d for i, d in enumerate(docs) if not i % eval_every]
  return train, held_out


def check(data) -> None:
  """One-line errors of the data section's source fields (text, and images where the stage
  has them: `image_text.check`), before anything is read."""
  image_text.check(data)
  if data.source not in SOURCES:
    raise ValueError(f"config: data.source={data.source!r}: must be one of {SOURCES}")
  if data.source == "files":
    files.BadRecords(data.get("on_bad_record", "error"))
    files.parse(data.files)
    if data.eval_files:
      files.parse(data.eval_files, "data.eval_files", weights=False)


def text_documents(data) -> tuple[list[str], list[str]]:
  """(training, held-out) documents of the data section's one text source."""
  if data.source == "files":
    return files.single_source(data)
  return split(load(data.source, data.max_doc_chars), data.eval_every)


def load(name: str, max_chars: int) -> list[str]:
  if name == "python_stdlib":
    return python_stdlib(max_chars)
  if name == "visual_captions":
    return [d[:max_chars] for d in visual_synthetic.caption_documents(1000, seed=1234)]
  raise ValueError(f"data.source={name!r}; available: {SOURCES}")
