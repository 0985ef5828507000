"""k25jax.losses.toggle: phase schedule, budget gate and budget table against hand values."""
import jax
import numpy as np
import pytest

from k25jax.losses import toggle


def test_phase_switches_at_multiples_of_m():
  steps = np.arange(12)
  expected = [0] * 5 + [1] * 5 + [0] * 2
  np.testing.assert_array_equal(toggle.toggle_phase(steps, 5), expected)
  assert toggle.toggle_phase(4, 5) == 0 and toggle.toggle_phase(5, 5) == 1
  assert int(jax.jit(lambda s: toggle.toggle_phase(s, 5))(10)) == 0


def test_phase_length_must_be_positive():
  with pytest.raises(ValueError, match="m=0"):
    toggle.toggle_phase(3, 0)


# samples: (reward, length, group accuracy); budget 10, λ = 0.6
REWARD = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
LENGTH = np.array([5, 12, 12, 12, 10, 11])
ACC = np.array([0.8, 0.8, 0.5, 0.8, 0.8, 0.6])


def test_phase0_gates_only_when_accuracy_reaches_threshold():
  out = toggle.toggle_reward(REWARD, LENGTH, 10, 0, ACC, accuracy_threshold=0.6)
  # fits | too long & acc ≥ λ | too long but acc < λ | wrong | length = budget fits | acc = λ gates
  np.testing.assert_array_equal(out, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0])


def test_phase1_is_the_plain_reward():
  out = toggle.toggle_reward(REWARD, LENGTH, 10, 1, ACC, accuracy_threshold=0.6)
  np.testing.assert_array_equal(out, REWARD)


def test_per_sample_budget_and_phase_under_jit():
  budget = np.array([4, 12, 10, 10, 10, 20])
  phase = np.array([0, 0, 1, 0, 1, 0])
  f = jax.jit(lambda *a: toggle.toggle_reward(*a, accuracy_threshold=0.6))
  np.testing.assert_array_equal(f(REWARD, LENGTH, budget, phase, ACC), [0.0, 1.0, 1.0, 0.0, 1.0, 1.0])


def test_group_accuracy_repeats_each_group_mean():
  out = toggle.group_accuracy(np.array([1, 0, 0, 1, 1, 1, 1, 0]), 4)
  np.testing.assert_allclose(out, [0.5] * 4 + [0.75] * 4)
  with pytest.raises(ValueError):
    toggle.group_accuracy(np.ones(6), 4)


# prompt 0: correct lengths 4, 10, 6 (a wrong one of length 2); prompt 1: correct 10, 20;
# prompt 2: only wrong responses. All correct lengths: 4, 6, 10, 10, 20.
LENGTHS = np.array([4, 10, 6, 2, 10, 20, 30, 3, 5])
CORRECT = np.array([1, 1, 1, 0, 1, 1, 0, 0, 0])
PROMPTS = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2])


def test_budget_is_the_percentile_of_correct_lengths():
  b = toggle.length_budgets(LENGTHS, CORRECT, PROMPTS, 50, fallback=7.0)
  np.testing.assert_allclose(b, [6.0, 15.0, 7.0])
  b = toggle.length_budgets(LENGTHS, CORRECT, PROMPTS, 25, fallback=7.0)
  np.testing.assert_allclose(b[:2], [5.0, 12.5])       # linear interpolation: [4,6,10] at 0.5; [10,20] at 0.25


def test_budget_global_fallback_and_unseen_prompts():
  b = toggle.length_budgets(LENGTHS, CORRECT, PROMPTS, 50, num_prompts=4)
  np.testing.assert_allclose(b, [6.0, 15.0, 10.0, 10.0])   # median of 4, 6, 10, 10, 20


def test_budget_global_fallback_without_any_correct_response_is_infinite():
  b = toggle.length_budgets(LENGTHS, np.zeros_like(CORRECT), PROMPTS, 50)
  assert b.shape == (3,) and np.all(np.isinf(b))


@pytest.mark.parametrize("kwargs", [dict(rho=150), dict(rho=-1), dict(fallback="median"),
                                    dict(num_prompts=2)])
def test_budget_bad_input_raises(kwargs):
  args = dict(lengths=LENGTHS, correct=CORRECT, prompt_ids=PROMPTS, rho=50) | kwargs
  with pytest.raises(ValueError):
    toggle.length_budgets(**args)


def test_budget_shape_mismatch_and_bad_ids_raise():
  with pytest.raises(ValueError):
    toggle.length_budgets(LENGTHS[:-1], CORRECT, PROMPTS, 50)
  with pytest.raises(ValueError):
    toggle.length_budgets(LENGTHS, CORRECT, PROMPTS - 1, 50)


def test_public_api_exports():
  from k25jax import losses
  for name in ("toggle_reward", "toggle_phase", "length_budgets"):
    assert getattr(losses, name) is getattr(toggle, name)
