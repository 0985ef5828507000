"""A finished swarm episode as readable text: who was spawned, what each agent did, step by step.

    print(trace.render(result))      # result: widesearch.EpisodeResult (e.g. from parl.play)

Every agent context is a sequence of `|`-closed blocks (`dsl`): the prompt, then turns
(tokens the agent generated, loss mask 1) and observations (the environment's). The
rendering walks the episode's stages t = 1..T; stage t is the orchestrator's t-th turn
plus the sub-agents it assigned, which run in parallel, and costs
1 + max_i S_sub,i^t critical steps (`widesearch.StepTrace`):

    wide task: attribute A2 of E1 E5 E7, budget 4
    gold: E1 V3  E5 V9  E7 V0
    stage 1  (1 + max(2, 1) = 3 critical steps)
      main  > create searcher S1 S2 assign A2 S1 E1 E5 S2 E7 |
        S1    < sub searcher A2 E1 E5 |
        S1    > search A2 E1 |
        S1    < obs E1 V3 |
        ...
      main  < obs E1 V3 E5 V9 E7 V0 |
    stage 2  (1 critical step)
      main  > answer E1 V3 E5 V9 E7 V0 |
    answer: E1 V3  E5 V9  E7 V0
    Item-F1 1.00  Row-F1 1.00  success yes  critical steps 4  sub-agents created 2, assigned 2, finished 2

`>` marks a turn the agent wrote, `<` a block the environment wrote.
"""
from __future__ import annotations

import dataclasses

from k25jax.agents import dsl, widesearch


@dataclasses.dataclass(frozen=True)
class Block:
  """One `|`-closed block of a context: `generated` True for the agent's own turn."""

  tokens: tuple[int, ...]
  generated: bool

  @property
  def text(self) -> str:
    return dsl.decode(self.tokens)


def blocks(transcript: widesearch.AgentTranscript) -> list[Block]:
  """Splits a transcript at each `|`. A block is generated when any of its tokens is (a
  truncated turn's closing `|` is the environment's, the rest of the turn the agent's);
  trailing tokens without a `|` form a last block."""
  out, start = [], 0
  for i, token in enumerate(transcript.tokens):
    if token == dsl.EOT_ID:
      out.append(Block(tuple(transcript.tokens[start:i + 1]), any(transcript.loss_mask[start:i + 1])))
      start = i + 1
  if start < len(transcript.tokens):
    out.append(Block(tuple(transcript.tokens[start:]), any(transcript.loss_mask[start:])))
  return out


def _rows(pairs) -> str:
  return "  ".join(f"{dsl.ENTITY.name(e)} {dsl.VALUE.name(v)}" for e, v in pairs) or "(none)"


def _stage_cost(sub_steps: dict[int, int]) -> str:
  if not sub_steps:
    return "1 critical step"
  steps = sorted(sub_steps.values(), reverse=True)
  inner = str(steps[0]) if len(steps) == 1 else f"max({', '.join(map(str, steps))})"
  return f"1 + {inner} = {1 + steps[0]} critical steps"


def render(result: widesearch.EpisodeResult) -> str:
  """The episode as text, stage by stage (module docstring); the header shows the task's budget."""
  task = result.task
  entities = " ".join(dsl.ENTITY.name(e) for e in task.entities)
  what = (f"attribute {dsl.ATTRIBUTE.name(task.attribute)} of {entities}" if task.kind == "wide"
          else f"follow {dsl.ATTRIBUTE.name(task.attribute)} from {entities}")
  lines = [f"{task.kind} task: {what}, budget {task.budget}",
           f"gold: {_rows(task.gold)}"]
  main = blocks(result.orchestrator)
  turns = [i for i, b in enumerate(main) if b.generated]
  width = max([4] + [len(t.agent) for t in result.subagents])
  line = lambda indent, agent, block: f"{indent}{agent:<{width}s}  {'>' if block.generated else '<'} {block.text}"
  for t, sub_steps in enumerate(result.trace.stages):
    lines.append(f"stage {t + 1}  ({_stage_cost(sub_steps)})")
    if t < len(turns):
      lines.append(line("  ", "main", main[turns[t]]))
    for transcript in result.subagents:
      if transcript.stage == t:
        lines += [line("    ", transcript.agent, b) for b in blocks(transcript)]
    following = turns[t + 1] if t + 1 < len(turns) else len(main)
    if t < len(turns):
      lines += [line("  ", "main", b) for b in main[turns[t] + 1:following]]
  errors = {role: dict(counts) for role, counts in result.errors.items() if counts}
  score = result.score
  forced = "  (after `stop`: the budget was spent)" if result.forced else ""
  lines.append(f"answer: {_rows(result.prediction)}{forced}")
  lines.append(f"Item-F1 {score.item_f1:.2f}  Row-F1 {score.row_f1:.2f}  success {'yes' if score.success else 'no'}  "
               f"critical steps {result.critical_steps}  sub-agents created {result.num_created}, assigned "
               f"{result.num_assigned}, finished {result.num_finished}"
               + (f"  tool errors {errors}" if errors else ""))
  return "\n".join(lines)
