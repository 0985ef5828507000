"""The `python_tests` verifier of RL prompt files (k25jax/rl/verifiers.py): a completion's code
against the record's tests, in the sandbox (k25jax/agents/sandbox.py).

    reward = (tests that run without error) / len(record["tests"])

The code is the completion's last fenced block (```python ... ``` or ``` ... ```), else the
whole completion. It runs in a fresh session of its own (one worker per completion: nothing
carries over between completions), then each test runs in that session, where the code's
names are defined, one call each under the sandbox's limits (`LIMITS`: 2 CPU-s, 5 wall-s a
call). Code that fails to run scores 0 without running the tests. A test passes when its
call ends ok; the sandbox's reply is written by the worker process the code runs in, so a
completion that forges replies could pass tests it fails (sandbox.py says what the boundary
holds: no escape, no crash or stall of the host).
"""
from __future__ import annotations

import atexit
import re

from k25jax.agents import sandbox

LIMITS = sandbox.Limits(cpu_s=2.0, wall_s=5.0, memory_mb=512)
_FENCED = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
_pool: list[sandbox.SandboxPool] = []


def code_of(completion: str) -> str:
  """The completion's last fenced code block, else the completion itself."""
  blocks = _FENCED.findall(completion)
  return blocks[-1] if blocks else completion


def _sandboxes() -> sandbox.SandboxPool:
  if not _pool:
    _pool.append(sandbox.SandboxPool(1, limits=LIMITS))
    atexit.register(_pool[0].close)
  return _pool[0]


def python_tests(prompt: str, completion: str, record: dict) -> float:
  """The share of record["tests"] that pass after the completion's code (module docstring)."""
  del prompt
  tests = record["tests"]
  with _sandboxes().session() as session:
    if not session.run(code_of(completion)).ok:
      return 0.0
    return sum(session.run(test).ok for test in tests) / len(tests)
