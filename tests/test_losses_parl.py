"""k25jax.losses.parl: PARL reward terms, λ annealing and critical steps against hand values."""
import math

import jax
import numpy as np
import pytest

from k25jax.losses import parl


def test_parl_reward_by_hand():
  r = parl.parl_reward(r_perf=0.5, r_parallel=0.8, r_finish=0.5, lambda1=0.1, lambda2=0.2)
  np.testing.assert_allclose(r, 0.1 * 0.8 + 0.2 * 0.5 + 0.5, rtol=1e-6)
  r = parl.parl_reward(np.array([0.0, 1.0]), np.array([1.0, 0.0]), np.array([0.0, 1.0]), 0.3, 0.0)
  np.testing.assert_allclose(r, [0.3, 1.0], rtol=1e-6)


def test_r_parallel_is_linear_up_to_the_cap():
  np.testing.assert_allclose(parl.r_parallel(np.array([0, 1, 3, 4, 7]), cap=4), [0, 0.25, 0.75, 1, 1])


def test_r_parallel_bad_cap_raises():
  with pytest.raises(ValueError, match="cap"):
    parl.r_parallel(3, cap=0)


def test_r_finish_fraction_and_zero_assigned():
  finished = np.array([3, 0, 0, 5, 2])
  assigned = np.array([4, 0, 3, 4, 2])
  np.testing.assert_allclose(parl.r_finish(finished, assigned), [0.75, 0.0, 0.0, 1.0, 1.0])


def test_r_finish_counts_idle_agents_as_unfinished():
  # 3 of 4 assignments finished, 2 agents created and never assigned: 3 / (4 + 2);
  # only idle agents: 0 / 2; nothing set up: 0; all finished, none idle: 1.
  finished, assigned, idle = np.array([3, 0, 0, 2]), np.array([4, 0, 0, 2]), np.array([2, 2, 0, 0])
  np.testing.assert_allclose(parl.r_finish(finished, assigned, idle), [0.5, 0.0, 0.0, 1.0])


@pytest.mark.parametrize("kind, quarter", [("linear", 0.75), ("cosine", (1 + math.cos(math.pi / 4)) / 2)])
def test_anneal_endpoints_and_midpoint(kind, quarter):
  steps = np.array([0, 25, 50, 100, 150])
  out = np.asarray(parl.anneal(steps, 2.0, 100, kind=kind))
  np.testing.assert_allclose(out[:3], [2.0, 2.0 * quarter, 1.0], rtol=1e-6)
  assert np.all(out[3:] == 0.0)


def test_anneal_traced_step_and_bad_input():
  f = jax.jit(lambda t: parl.anneal(t, 0.5, 10, kind="cosine"))
  np.testing.assert_allclose(f(5), 0.25, rtol=1e-6)
  with pytest.raises(ValueError, match="kind"):
    parl.anneal(0, 1.0, 10, kind="exp")
  with pytest.raises(ValueError, match="total_steps"):
    parl.anneal(0, 1.0, 0)


def test_critical_steps_on_hand_built_traces():
  # episode 0: (1 + 3) + (2 + 0) + (1 + 5) = 12;  episode 1: (1 + 1) + (1 + 0) + (1 + 0) = 4
  main = np.array([[1, 2, 1], [1, 1, 1]])
  sub = np.array([[[3, 0, 0], [0, 0, 0], [2, 5, 1]],
                  [[1, 1, 1], [0, 0, 0], [0, 0, 0]]])
  np.testing.assert_allclose(parl.critical_steps(main, sub), [12.0, 4.0])
  np.testing.assert_allclose(parl.critical_steps(main[0], sub[0]), 12.0)


def test_critical_steps_without_subagent_slots():
  np.testing.assert_allclose(parl.critical_steps(np.array([2, 3]), np.zeros((2, 0))), 5.0)


def test_critical_steps_shape_mismatch_raises():
  with pytest.raises(ValueError, match="sub_steps"):
    parl.critical_steps(np.ones(3), np.ones((2, 4)))


def test_public_api_exports():
  from k25jax import losses
  for name in ("parl_reward", "r_parallel", "r_finish", "anneal", "critical_steps"):
    assert getattr(losses, name) is getattr(parl, name)
