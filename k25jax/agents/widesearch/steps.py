"""Step accounting (`StepTrace`, `stack_traces`). An episode is a sequence of stages; stage t
is one orchestrator turn (S_main^t = 1) plus the sub-agents it assigned, which run in
parallel; S_sub,i^t counts sub-agent i's tool turns in the stage. So:

    CriticalSteps = Σ_t (S_main^t + max_i S_sub,i^t)
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from k25jax.agents import dsl


@dataclasses.dataclass
class StepTrace:
  """Per stage t (one orchestrator step, S_main^t = 1): the steps of each sub-agent slot
  active in it, {slot: S_sub,i^t}."""

  max_subagents: int = dsl.NUM_AGENTS
  stages: list[dict[int, int]] = dataclasses.field(default_factory=list)

  def add_stage(self, sub_steps: Mapping[int, int] | None = None) -> None:
    sub_steps = dict(sub_steps or {})
    bad = [s for s in sub_steps if not 0 <= s < self.max_subagents]
    if bad:
      raise ValueError(f"sub-agent slots {bad} are outside [0, {self.max_subagents})")
    self.stages.append(sub_steps)

  @property
  def critical_steps(self) -> int:
    """Σ_t (1 + max_i S_sub,i^t), the same number as `losses.critical_steps(*self.arrays())`."""
    return sum(1 + max(stage.values(), default=0) for stage in self.stages)

  def arrays(self, num_stages: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(main_steps int32 [T], sub_steps int32 [T, max_subagents]) in the layout of
    `losses.critical_steps`; T = num_stages (zero-padded; stages of zeros add nothing)."""
    num_stages = len(self.stages) if num_stages is None else num_stages
    if num_stages < len(self.stages):
      raise ValueError(f"the trace has {len(self.stages)} stages, more than num_stages={num_stages}")
    main = np.zeros(num_stages, np.int32)
    sub = np.zeros((num_stages, self.max_subagents), np.int32)
    for t, stage in enumerate(self.stages):
      main[t] = 1
      for slot, steps in stage.items():
        sub[t, slot] = steps
    return main, sub


def stack_traces(traces: Sequence[StepTrace], num_stages: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """A batch of traces as (main_steps [B, T], sub_steps [B, T, max_subagents]), zero-padded."""
  num_stages = max((len(t.stages) for t in traces), default=0) if num_stages is None else num_stages
  arrays = [t.arrays(num_stages) for t in traces]
  width = max((t.max_subagents for t in traces), default=dsl.NUM_AGENTS)
  main = np.zeros((len(traces), num_stages), np.int32)
  sub = np.zeros((len(traces), num_stages, width), np.int32)
  for b, (m, s) in enumerate(arrays):
    main[b], sub[b, :, :s.shape[1]] = m, s
  return main, sub
