"""PARL (Parallel-Agent RL) reward and latency metric, pure `jax.numpy` (no Flax).

The orchestrator's episode reward (Kimi K2.5, Sec. PARL):

    r = λ1 · r_parallel + λ2 · r_finish + r_perf

r_perf is the task reward (e.g. WideSearch Item-F1); r_parallel rewards instantiating
sub-agents (against serial collapse: an orchestrator that does everything itself),
bounded and near-binary (a cap of one or two agents); r_finish rewards sub-tasks that
were finished, out of every sub-agent the episode set up, so agents created and never
assigned, or assigned and not finished, count against it (against spurious parallelism:
spawning agents that do nothing useful). λ1, λ2 are annealed to 0 over
training (`anneal`), so the final policy optimises r_perf alone.

Latency is counted in critical steps, the length of the longest path through an
episode of stages (each stage: a main-agent step, then its sub-agents in parallel):

    CriticalSteps = Σ_t ( S_main^t + max_i S_sub,i^t )

It is both the budget an episode runs under and the latency metric reported.
All functions accept arrays (any leading batch dims) and are jit-able.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

ANNEAL_KINDS = ("linear", "cosine")


def parl_reward(r_perf, r_parallel, r_finish, lambda1, lambda2):
  """r = λ1 · r_parallel + λ2 · r_finish + r_perf, elementwise (all arguments broadcast). float32."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return f32(lambda1) * f32(r_parallel) + f32(lambda2) * f32(r_finish) + f32(r_perf)


def r_parallel(num_subagents, cap: int):
  """Instantiation reward, capped:  r_parallel = min(n, cap) / cap ∈ [0, 1].

  num_subagents: [...] sub-agents created in the episode (n ≥ 0); cap: the width past
  which more agents earn nothing, an int ≥ 1. A small cap (1: binary, "did it spawn at
  all"; 2: near-binary) breaks serial collapse without paying for width itself: how
  many agents to use is left to r_perf.
  """
  if not isinstance(cap, jax.core.Tracer) and not cap >= 1:
    raise ValueError(f"r_parallel cap={cap} must be >= 1")
  n = jnp.clip(jnp.asarray(num_subagents, jnp.float32), 0.0, None)
  return jnp.minimum(n, cap) / cap


def r_finish(num_finished, num_assigned, num_idle=0):
  """Sub-task completion reward over every sub-agent set up:

      r_finish = min(finished, assigned) / (assigned + idle),   0 if assigned + idle = 0

  num_finished: [...] assignments completed; num_assigned: [...] assignments made;
  num_idle: [...] sub-agents created and never assigned (each counts as an unfinished
  sub-task). An episode that sets up nothing earns no finish reward (it did no parallel
  work to complete; paying 1 there would reward the serial collapse that r_parallel fights).
  """
  finished = jnp.asarray(num_finished, jnp.float32)
  assigned = jnp.asarray(num_assigned, jnp.float32)
  tasks = assigned + jnp.clip(jnp.asarray(num_idle, jnp.float32), 0.0, None)
  frac = jnp.clip(finished, 0.0, assigned) / jnp.maximum(tasks, 1.0)
  return jnp.where(tasks > 0, frac, 0.0)


def anneal(step, start_value, total_steps: int, kind: str = "linear"):
  """The schedule of λ1, λ2: start_value at step 0, 0 at total_steps and after.

      linear:  λ(t) = λ0 · (1 − s)
      cosine:  λ(t) = λ0 · (1 + cos(π s)) / 2,      s = clip(t / total_steps, 0, 1)

  step: int or array (any shape, may be traced); total_steps: an int ≥ 1.
  """
  if kind not in ANNEAL_KINDS:
    raise ValueError(f"anneal kind={kind!r}; choose one of {ANNEAL_KINDS}")
  if not isinstance(total_steps, jax.core.Tracer) and not total_steps >= 1:
    raise ValueError(f"anneal total_steps={total_steps} must be >= 1")
  s = jnp.clip(jnp.asarray(step, jnp.float32) / total_steps, 0.0, 1.0)
  if kind == "linear":
    factor = 1.0 - s
  else:
    factor = 0.5 * (1.0 + jnp.cos(math.pi * s))
  # exactly 0 from total_steps on (cos(π) is -1 only up to rounding)
  return jnp.where(s >= 1.0, 0.0, start_value * factor)


def critical_steps(main_steps, sub_steps):
  """CriticalSteps = Σ_t ( S_main^t + max_i S_sub,i^t ).

  main_steps: [..., stages] steps the main agent takes in stage t; sub_steps:
  [..., stages, max_subagents] steps of sub-agent slot i in stage t, 0 where a slot is
  unused (so a stage without sub-agents adds only S_main^t; max_subagents may be 0).
  Leading batch dims must match. Returns [...] float32.
  """
  main_steps = jnp.asarray(main_steps, jnp.float32)
  sub_steps = jnp.asarray(sub_steps, jnp.float32)
  if sub_steps.ndim < 1 or sub_steps.shape[:-1] != main_steps.shape or main_steps.ndim < 1:
    raise ValueError(f"sub_steps {sub_steps.shape} must be main_steps {main_steps.shape} "
                     "[..., stages] plus a trailing max_subagents axis")
  return jnp.sum(main_steps + jnp.max(sub_steps, axis=-1, initial=0.0), axis=-1)
