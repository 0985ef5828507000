"""The synthetic wide-search environment of tiny PARL: hidden tables, tasks, scoring, the
budgeted episode, and scripted reference policies that write SFT demonstrations.

An orchestrator answers a table-lookup task over a hidden table, alone or by delegating
lookups to sub-agents that run in parallel; the predicted table is scored with WideSearch
Item-F1 / Row-F1 under a budget of critical steps. One module per concern:

* `tasks`     the hidden table and the wide / deep tasks (`make_task`, `sample_tasks`).
* `scoring`   Item-F1, Row-F1 and success of a predicted table (`score_table`).
* `steps`     stages and CriticalSteps (`StepTrace`, `stack_traces`).
* `episode`   the budgeted episode, its step and budget rules (`Episode`, `Request`,
              `AgentTranscript`, `EpisodeResult`).
* `rendering` what the model reads and writes: the DSL's ids, k25jax's own chat format or
              (`k25_rendering`) Kimi K2.5's (`DSLRendering`, `ChatRendering`, `K25Rendering`, `make`).
* `scripted`  scripted reference policies (`solo_policy`, `ScriptedOrchestrator`, `SerialOrchestrator`),
              `run_episode`, and the SFT `demonstrations`.
"""
from k25jax.agents.widesearch.episode import AgentTranscript, Episode, EpisodeResult, Request
from k25jax.agents.widesearch.rendering import ChatRendering, DSLRendering, K25Rendering, Rendering
from k25jax.agents.widesearch.scoring import TableScore, normalize, score_table, table_rows
from k25jax.agents.widesearch.scripted import (DEMO_BUDGETS, Policy, ScriptedOrchestrator, SerialOrchestrator,
                                               delegation, demonstrations, run_episode, solo_policy)
from k25jax.agents.widesearch.steps import StepTrace, stack_traces
from k25jax.agents.widesearch.tasks import (BUDGET_RANGE, HOPS_RANGE, KIND_SYSTEM_PROMPT, KINDS, MAX_CONTEXT,
                                            N_RANGE, TERMINAL_VALUE, Task, follow_chain, make_task, next_entity, remaining,
                                            sample_tasks)

__all__ = [
    "AgentTranscript", "BUDGET_RANGE", "ChatRendering", "DEMO_BUDGETS", "DSLRendering", "Episode", "EpisodeResult", "HOPS_RANGE", "K25Rendering",
    "KIND_SYSTEM_PROMPT", "KINDS", "MAX_CONTEXT", "N_RANGE", "Policy", "Rendering", "Request", "ScriptedOrchestrator",
    "SerialOrchestrator", "StepTrace", "TERMINAL_VALUE", "TableScore", "Task", "delegation", "demonstrations",
    "follow_chain", "make_task", "next_entity", "normalize", "remaining", "run_episode", "sample_tasks", "score_table",
    "solo_policy", "stack_traces", "table_rows",
]
