"""Rewards for RL prompts from files (`task.name=file`, k25jax/rl/prompt_files.py).

A verifier is a function `(prompt, completion, record) -> float`: the prompt's text (a
`messages` record: its last user message), the completion's text (what the model wrote
before its stop token) and the whole record as read from the file. `get(name)` returns it:

    exact            1 if completion.strip() == str(record["answer"]).strip(), else 0
    numeric          1 if the completion's last number x satisfies |x - a| <= tol * max(1, |a|),
                     a = record["answer"], tol = record.get("tolerance", 1e-6); else 0
                     (numbers as written: sign, thousands commas, decimals, exponent)
    math             1 if math-verify finds the completion's answer equal to record["answer"]
                     (`math_verify.verify(parse(answer), parse(completion))`: LaTeX, fractions,
                     expressions, sets; the answer read as LaTeX math, `$answer$`, else as text)
    python_tests     the fraction of record["tests"] (Python statements, e.g. asserts) that run
                     without error after the completion's code, in the sandbox
                     (k25jax/agents/code_tests.py)
    module:function  a function of the user's, imported by name, with the same signature

`python_tests` is reached by its module:function name too, as a user's verifier is: the
sandbox lives on the agents floor, above rl/. `required_fields(name)` gives the record
fields a built-in reads, so that a file is checked when it is read, not mid-run.
"""
from __future__ import annotations

import importlib
import math
import re
from typing import Callable

Verifier = Callable[[str, str, dict], float]

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")
PYTHON_TESTS = "k25jax.agents.code_tests:python_tests"


def exact(prompt: str, completion: str, record: dict) -> float:
  del prompt
  return float(completion.strip() == str(record["answer"]).strip())


def number(text: str) -> float | None:
  """The last number written in `text` (thousands commas dropped), or None."""
  found = _NUMBER.findall(text)
  return float(found[-1].replace(",", "")) if found else None


def numeric(prompt: str, completion: str, record: dict) -> float:
  del prompt
  answer, got = float(str(record["answer"]).replace(",", "")), number(completion)
  tolerance = float(record.get("tolerance", 1e-6))
  return float(got is not None and abs(got - answer) <= tolerance * max(1.0, abs(answer)))


def _math_verify():
  try:
    import math_verify  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("the `math` verifier needs the math-verify package: pip install math-verify") from e
  return math_verify


def math_answer(prompt: str, completion: str, record: dict) -> float:
  del prompt
  mv = _math_verify()
  gold = mv.parse(f"${record['answer']}$") or mv.parse(str(record["answer"]))
  return float(bool(gold) and mv.verify(gold, mv.parse(completion)))


BUILTIN: dict[str, Verifier | str] = {"exact": exact, "numeric": numeric, "math": math_answer,
                                       "python_tests": PYTHON_TESTS}
_REQUIRED = {"exact": ("answer",), "numeric": ("answer",), "math": ("answer",), "python_tests": ("tests",)}


def required_fields(name: str) -> tuple[str, ...]:
  """The record fields the built-in `name` reads (none for a user's function)."""
  return _REQUIRED.get(name, ())


def _import(spec: str) -> Verifier:
  module_name, _, function = spec.partition(":")
  if not module_name or not function:
    raise ValueError(f"verifier {spec!r}: name a built-in ({', '.join(BUILTIN)}) or module:function")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f"verifier {spec!r}: cannot import {module_name} ({type(e).__name__}: {e})") from None
  fn = getattr(module, function, None)
  if not callable(fn):
    raise ValueError(f"verifier {spec!r}: {module_name} has no function {function!r}")
  return fn


def get(name: str) -> Verifier:
  """The verifier called `name`: a built-in or module:function (module docstring)."""
  found = BUILTIN.get(name, name)
  return _import(found) if isinstance(found, str) else found


def check_record(name: str, record: dict) -> str | None:
  """What is wrong with `record` for the built-in verifier `name` (None: nothing)."""
  for field in required_fields(name):
    if field not in record:
      return f"no {field!r} field (the {name} verifier reads it)"
  if name in ("exact", "numeric", "math") and not isinstance(record["answer"], (str, int, float)):
    return f"'answer' is {type(record['answer']).__name__}; the {name} verifier takes text or a number"
  if name == "numeric":
    try:
      value = float(str(record["answer"]).replace(",", ""))
    except ValueError:
      return f"'answer' {record['answer']!r} is not a number (the numeric verifier)"
    if not math.isfinite(value):
      return f"'answer' {record['answer']!r} is not a finite number (the numeric verifier)"
    tolerance = record.get("tolerance", 1e-6)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
      return f"'tolerance' {tolerance!r} must be a number >= 0"
  if name == "python_tests":
    tests = record["tests"]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
      return "'tests' must be a non-empty list of Python statements (text)"
  return None
