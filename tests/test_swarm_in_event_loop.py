"""Swarm.run inside a running event loop (a Jupyter/Colab kernel runs one) plays like outside it."""
import asyncio

from k25jax.agents import swarm, widesearch


def _play():
  policies = {"orch": widesearch.ScriptedOrchestrator(2), "sub": widesearch.solo_policy}
  tasks = widesearch.sample_tasks(5, seed=4, deep_fraction=0.4)
  results = swarm.Swarm(policies).run([widesearch.Episode(t, budget=4) for t in tasks])
  return [(r.orchestrator.text, [t.text for t in r.subagents], r.score) for r in results]


def test_run_from_inside_a_running_loop_matches_a_plain_run():
  async def inside_a_kernel():
    asyncio.get_running_loop()          # what ipykernel's cells see
    return _play()

  assert asyncio.run(inside_a_kernel()) == _play()
