"""The asyncio swarm runtime: many episodes, every agent a coroutine, batched device calls per tick.

Each episode is a coroutine that asks its environment (`widesearch.Episode`) which agents
need a turn — the orchestrator, or the sub-agents of the current stage — and runs one
coroutine per agent turn. An agent's coroutine hands its context to the `Swarm`'s
decoder and awaits the generated turn. When every agent in flight is waiting, the
scheduler flushes: all waiting contexts of one role are decoded together in batched
sampler calls (sub-agents share the frozen params, the orchestrator uses the trainable
ones), so 16 sub-agents cost about as many device calls as one agent.

A role's waiting contexts are sorted by length and decoded in calls of at most `max_rows`
rows: on CPU 32 (a row costs about the same there in a batch of 16 as of 1,024, and short
contexts then share a call instead of padding to the longest of the tick), on an
accelerator, where a batch costs about one row, all in one call. Each call is padded to a
few bucket shapes (`k25jax.rl.decode`: rows and context length each to a power of two of
at least 16) so the sampler compiles once per bucket, not once per tick. A context too
long for the model gets an empty turn (the environment treats it as truncated) and is
counted in `overflows`.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
from typing import Callable, Mapping, Sequence

import jax

from k25jax.agents import widesearch
from k25jax.model.config import ModelConfig
from k25jax.rl import decode, sampler


@dataclasses.dataclass(frozen=True)
class Policy:
  """Who answers a role: a model config, its params and how to sample from it."""

  cfg: ModelConfig
  params: object
  sampling: sampler.SamplingConfig


# Decode batches are padded to few shapes (each a ~2 s sampler compile on 2 CPU cores):
MIN_WIDTH = 16      # contexts to a power of two of at least this many tokens (`decode.decode`)
MIN_ROWS = 16       # rows to a power of two, at least this many while a call is at most 256 positions wide
MIN_TOKENS = 4096   # a wider call: at least this many tokens (4 rows at 1,024), as a padded row costs as a real one
CPU_MAX_ROWS = 32   # the rows of one sampler call on CPU (`Swarm.max_rows`)


class Swarm:
  """Runs batches of episodes with batched decodes per role per tick."""

  def __init__(self, policies: Mapping[str, Policy | Callable[[Sequence[int]], Sequence[int]]], seed: int = 0,
               max_rows: int | None = None):
    """`max_rows`: the rows of one sampler call (default `CPU_MAX_ROWS` on CPU, unlimited elsewhere)."""
    self.policies = dict(policies)
    self.max_rows = max_rows or (CPU_MAX_ROWS if jax.default_backend() == "cpu" else None)
    self.rng = jax.random.PRNGKey(seed)
    self.device_calls = collections.Counter()   # sampler calls per role
    self.decoded_rows = collections.Counter()   # agent turns per role
    self.overflows = 0
    self._pending: list[tuple[widesearch.Request, widesearch.Rendering, asyncio.Future]] = []
    self._in_flight = 0

  # ----------------------------------------------------------------- agent side
  async def _agent_turn(self, episode: widesearch.Episode, request: widesearch.Request) -> None:
    future = asyncio.get_running_loop().create_future()
    self._pending.append((request, episode.rendering, future))
    tokens, logprobs = await future
    self._in_flight -= 1
    episode.submit(request.agent, tokens, logprobs)

  async def _episode(self, episode: widesearch.Episode) -> widesearch.EpisodeResult:
    while not episode.done:
      requests = episode.requests()
      if not requests:
        raise RuntimeError("an unfinished episode has no agent waiting for a turn")
      self._in_flight += len(requests)
      await asyncio.gather(*(self._agent_turn(episode, r) for r in requests))
    return episode.result()

  # ----------------------------------------------------------------- device side
  def _decode(self, role: str, requests: Sequence[widesearch.Request],
              renderings: Sequence[widesearch.Rendering]) -> list[tuple[list[int], list[float]]]:
    """The contexts of all `requests` of `role`, shortest first, in sampler calls of at most
    `max_rows` rows; returns each request's (tokens, logprobs).

    A role may also be played by a plain function DSL context → DSL turn (a scripted
    policy, for tests): it is called per row on the request's `protocol`, its turn is
    rendered as its episode's model would write it, and it costs no device call."""
    policy = self.policies[role]
    if callable(policy):
      turns = [r.turn(list(policy(q.protocol))) for q, r in zip(requests, renderings)]
      return [(t, [0.0] * len(t)) for t in turns]
    limit = policy.cfg.max_position_embeddings - policy.sampling.max_new_tokens
    fits = [len(q.context) <= limit for q in requests]
    contexts = [q.context if ok else q.context[:1] for q, ok in zip(requests, fits)]
    self.overflows += fits.count(False)
    order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
    per_call = self.max_rows or len(order)
    turns = [([], []) for _ in contexts]          # an empty turn where the context does not fit
    for start in range(0, len(order), per_call):
      rows = order[start:start + per_call]
      self.rng, key = jax.random.split(self.rng)
      out = decode.decode(policy.cfg, policy.params, [contexts[i] for i in rows], key, policy.sampling,
                          min_width=MIN_WIDTH, min_rows=MIN_ROWS, min_tokens=MIN_TOKENS)
      for i, turn in zip(rows, decode.turns(out)):
        if fits[i]:
          turns[i] = turn
      self.device_calls[role] += 1
    self.decoded_rows[role] += len(contexts)
    return turns

  def _flush(self) -> None:
    pending, self._pending = self._pending, []
    by_role = collections.defaultdict(list)
    for item in pending:
      by_role[item[0].role].append(item)
    for role, items in by_role.items():
      requests, renderings, futures = zip(*items)
      for future, result in zip(futures, self._decode(role, requests, renderings)):
        future.set_result(result)

  async def _scheduler(self, episodes: list[asyncio.Task]) -> None:
    """Flushes when every agent turn in flight is waiting for its tokens (twice in a row,
    so episodes that are between turns get to register theirs)."""
    stable = 0
    while not all(t.done() for t in episodes):
      await asyncio.sleep(0)
      ready = bool(self._pending) and len(self._pending) == self._in_flight
      stable = stable + 1 if ready else 0
      if stable >= 2:
        self._flush()
        stable = 0

  async def _run(self, episodes: Sequence[widesearch.Episode]) -> list[widesearch.EpisodeResult]:
    tasks = [asyncio.ensure_future(self._episode(e)) for e in episodes]
    await self._scheduler(tasks)
    return [t.result() for t in tasks]

  def run(self, episodes: Sequence[widesearch.Episode]) -> list[widesearch.EpisodeResult]:
    """Plays every episode to the end; returns their results in order. Called where an event
    loop is already running (a Jupyter or Colab kernel), it runs on its own loop in a worker
    thread and blocks until done."""
    coroutine = self._run(list(episodes))
    try:
      asyncio.get_running_loop()
    except RuntimeError:
      return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as worker:
      return worker.submit(asyncio.run, coroutine).result()
