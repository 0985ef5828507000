"""Offline text sources: text that ships with every Python install, no download.

`python_stdlib` reads the top-level modules of the running interpreter's standard
library (about 170 files, ~4.7 MB of Python source and docstrings), in sorted
order, and cuts them into documents of whole paragraphs (blank-line separated).
"""
from __future__ import annotations

import glob
import os
import sysconfig

SOURCES = ("python_stdlib",)


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


def load(name: str, max_chars: int) -> list[str]:
  if name == "python_stdlib":
    return python_stdlib(max_chars)
  raise ValueError(f"data.source={name!r}; available: {SOURCES}")
