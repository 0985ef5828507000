"""k25jax.losses RL losses (Eq. 1 and the ablation baselines) against hand-computed values."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest


from k25jax.losses import rl

BAND = dict(alpha=-0.5, beta=0.5)


def grad_wrt_logp(loss_fn, logp, *args, **kwargs):
  return np.asarray(jax.grad(lambda x: loss_fn(x, *args, **kwargs)[0])(jnp.asarray(logp)))


# --- k25_policy_loss -----------------------------------------------------------------


@pytest.mark.parametrize("advantage", [1.5, -1.5])
def test_outside_band_only_tau_gradient(advantage):
  # log ρ = [0.1 (in band), 0.9 (above β), -0.8 (below α)]; N = 3.
  logp = np.array([[0.1, 0.9, -0.8]], np.float32)
  old = np.zeros_like(logp)
  g = grad_wrt_logp(rl.k25_policy_loss, logp, old, np.array([advantage]), np.ones_like(logp),
                    tau=0.1, **BAND)
  np.testing.assert_allclose(g[0, 1:], [2 * 0.1 * 0.9 / 3, 2 * 0.1 * -0.8 / 3], rtol=1e-6)
  # the in-band token carries the policy gradient -ρA/N on top of the τ term
  np.testing.assert_allclose(g[0, 0], -math.exp(0.1) * advantage / 3 + 2 * 0.1 * 0.1 / 3, rtol=1e-6)


@pytest.mark.parametrize("advantage", [2.0, -2.0])
def test_outside_band_exactly_zero_without_tau(advantage):
  logp = np.array([[0.6, -0.7, 30.0]], np.float32)     # all out of band, one with an overflowing ρ
  g = grad_wrt_logp(rl.k25_policy_loss, logp, np.zeros_like(logp), np.array([advantage]),
                    np.ones_like(logp), tau=0.0, **BAND)
  assert np.all(g == 0.0)


def test_gradient_at_old_policy_is_advantage_over_n():
  old = np.array([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]], np.float32)
  mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)      # N = 3
  g = grad_wrt_logp(rl.k25_policy_loss, old, old, np.array([1.0, -2.0]), mask, tau=0.3, **BAND)
  # ∂L/∂logp = −A·mask/N (the objective −L ascends along +A·mask/N)
  np.testing.assert_allclose(g, [[-1 / 3, -1 / 3, 0], [2 / 3, 0, 0]], rtol=1e-6)


def test_tau_term_gradient_matches_formula_and_finite_differences():
  old = np.array([[-1.0, -2.0, -0.5]], np.float32)
  log_ratio = np.array([[0.2, -0.3, 0.4]], np.float32)
  logp = old + log_ratio
  args = (old, np.zeros(1, np.float32), np.ones_like(old))
  kwargs = dict(tau=0.05, **BAND)
  g = grad_wrt_logp(rl.k25_policy_loss, logp, *args, **kwargs)
  np.testing.assert_allclose(g, 2 * 0.05 * log_ratio / 3, rtol=1e-5)
  loss = lambda x: float(rl.k25_policy_loss(x, *args, **kwargs)[0])
  h = 1e-2
  for i in range(3):
    e = np.zeros_like(logp)
    e[0, i] = h
    fd = (loss(logp + e) - loss(logp - e)) / (2 * h)      # exact for a quadratic
    np.testing.assert_allclose(fd, g[0, i], rtol=1e-3)


def test_loss_value_by_hand():
  log_ratio = np.array([[0.1, 0.0], [-0.2, 0.7]], np.float32)   # 0.7 is above β
  old = np.full_like(log_ratio, -1.0)
  loss, m = rl.k25_policy_loss(old + log_ratio, old, np.array([1.0, -1.0]), np.ones_like(old),
                                   tau=0.1, **BAND)
  terms = [math.exp(0.1) - 0.1 * 0.01, 1.0, -math.exp(-0.2) - 0.1 * 0.04, -0.1 * 0.49]
  np.testing.assert_allclose(loss, -sum(terms) / 4, rtol=1e-6)
  np.testing.assert_allclose(m["tau_loss"], 0.1 * (0.01 + 0.04 + 0.49) / 4, rtol=1e-5)
  np.testing.assert_allclose(m["policy_loss"] + m["tau_loss"], loss, rtol=1e-6)


def test_band_edges_are_inside():
  logp = np.array([[-0.5, 0.5]], np.float32)
  _, m = rl.k25_policy_loss(logp, np.zeros_like(logp), np.ones(1), np.ones_like(logp),
                                tau=0.0, **BAND)
  assert float(m["masked_fraction"]) == 0.0


def test_metrics_count_only_valid_tokens():
  logp = np.array([[0.1, 0.9, -0.8, 0.0, 5.0]], np.float32)    # last token is padding
  mask = np.array([[1, 1, 1, 1, 0]], np.float32)
  _, m = rl.k25_policy_loss(logp, np.zeros_like(logp), np.ones(1), mask, tau=0.0, **BAND)
  np.testing.assert_allclose(m["masked_above"], 0.25)
  np.testing.assert_allclose(m["masked_below"], 0.25)
  np.testing.assert_allclose(m["masked_fraction"], 0.5)
  np.testing.assert_allclose(m["log_ratio_mean"], (0.1 + 0.9 - 0.8) / 4, rtol=1e-6)
  np.testing.assert_allclose(m["log_ratio_sq_mean"], (0.01 + 0.81 + 0.64) / 4, rtol=1e-6)
  np.testing.assert_allclose(m["ratio_max"], math.exp(0.9), rtol=1e-6)
  assert float(m["tokens"]) == 4.0


def test_garbage_in_padding_changes_nothing():
  rng = np.random.default_rng(0)
  old = rng.normal(size=(2, 4)).astype(np.float32) - 2
  logp = old + 0.1 * rng.normal(size=(2, 4)).astype(np.float32)
  mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
  dirty_logp, dirty_old = logp.copy(), old.copy()
  dirty_logp[mask == 0] = np.nan
  dirty_old[mask == 0] = -np.inf
  adv = np.array([[1.0] * 4, [-1.0, -1.0, np.nan, np.nan]], np.float32)
  kw = dict(tau=0.1, **BAND)
  clean, _ = rl.k25_policy_loss(logp, old, adv, mask, **kw)
  dirty, _ = rl.k25_policy_loss(dirty_logp, dirty_old, adv, mask, **kw)
  np.testing.assert_allclose(dirty, clean, rtol=1e-6)
  g = grad_wrt_logp(rl.k25_policy_loss, dirty_logp, dirty_old, adv, mask, **kw)
  assert np.all(np.isfinite(g)) and np.all(g[mask == 0] == 0)


def test_per_token_advantages_equal_broadcast():
  rng = np.random.default_rng(1)
  old = rng.normal(size=(3, 5)).astype(np.float32)
  logp = old + 0.3 * rng.normal(size=(3, 5)).astype(np.float32)
  mask = (rng.random((3, 5)) > 0.3).astype(np.float32)
  adv = np.array([0.5, -1.0, 2.0], np.float32)
  a, _ = rl.k25_policy_loss(logp, old, adv, mask, tau=0.01, **BAND)
  b, _ = rl.k25_policy_loss(logp, old, np.repeat(adv[:, None], 5, 1), mask, tau=0.01, **BAND)
  np.testing.assert_allclose(a, b, rtol=1e-6)


# Rows with ℓ_ji = A_j (ρ = 1, τ = 0): A = [1, 2, 3, 4], valid lengths n = [3, 1, 1, 1],
# then an empty group of two rows. Groups of 2: N_0 = 4, N_1 = 2.
NORM_ADV = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], np.float32)
NORM_MASK = np.array([[1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]], np.float32)


@pytest.mark.parametrize("normalize, expected", [
    ("batch", -(3 * 1 + 2 + 3 + 4) / 6),                  # -2
    ("group", -((3 * 1 + 2) / 4 + (3 + 4) / 2) / 2),       # -2.375
    ("sequence", -(1 + 2 + 3 + 4) / 4),                    # -2.5
])
def test_normalization_on_unequal_lengths(normalize, expected):
  logp = np.zeros((6, 3), np.float32)
  loss, _ = rl.k25_policy_loss(logp, logp, NORM_ADV, NORM_MASK, tau=0.0, normalize=normalize,
                                   group_size=2, **BAND)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)


def test_group_normalization_is_eq1_per_prompt_by_hand():
  """Eq. 1 with N the tokens of ONE prompt's K responses, the prompts averaged: two prompts
  (K = 2) whose responses total 5 and 2 tokens, log ρ in and out of the band, τ > 0."""
  log_ratio = np.array([[0.1, -0.2, 0.7, 0.0], [0.3, 0.05, 0.0, 0.0],       # prompt 0: 3 + 2 tokens
                        [-0.9, 0.0, 0.0, 0.0], [0.2, 0.0, 0.0, 0.0]], np.float32)   # prompt 1: 1 + 1
  mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]], np.float32)
  old = np.full_like(log_ratio, -1.0)
  adv, tau = np.array([0.5, -0.5, 1.0, -1.0], np.float32), 0.1
  per_prompt = []
  for rows in ([0, 1], [2, 3]):
    total, n = 0.0, 0.0
    for j in rows:
      for i in range(4):
        if mask[j, i]:
          lr = float(log_ratio[j, i])
          in_band = -0.5 <= lr <= 0.5
          total += (math.exp(lr) * adv[j] if in_band else 0.0) - tau * lr ** 2
          n += 1
    per_prompt.append(-total / n)
  loss, _ = rl.k25_policy_loss(old + log_ratio, old, adv, mask, tau=tau, normalize="group", group_size=2, **BAND)
  np.testing.assert_allclose(loss, np.mean(per_prompt), rtol=1e-5)
  batch, _ = rl.k25_policy_loss(old + log_ratio, old, adv, mask, tau=tau, normalize="batch", **BAND)
  assert abs(float(batch) - np.mean(per_prompt)) > 0.05       # the minibatch token mean is another loss


def test_group_normalization_gradient_weights():
  logp = np.zeros((6, 3), np.float32)
  g = grad_wrt_logp(rl.k25_policy_loss, logp, logp, NORM_ADV, NORM_MASK, tau=0.0,
                    normalize="group", group_size=2, **BAND)
  # row j of group g: −A_j / N_g / G⁺ with G⁺ = 2 non-empty groups
  np.testing.assert_allclose(g[:, 0], [-1 / 8, -2 / 8, -3 / 4, -4 / 4, 0, 0], rtol=1e-6)


def test_jit_with_traced_hyper_parameters():
  logp = np.array([[0.2, -0.1]], np.float32)
  f = jax.jit(lambda lp, tau: rl.k25_policy_loss(lp, jnp.zeros_like(lp), jnp.ones(1),
                                                     jnp.ones_like(lp), tau=tau, **BAND)[0])
  eager, _ = rl.k25_policy_loss(logp, np.zeros_like(logp), np.ones(1), np.ones_like(logp),
                                    tau=0.3, **BAND)
  np.testing.assert_allclose(f(logp, 0.3), eager, rtol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(alpha=0.0, beta=0.5, tau=0.1), "alpha < 0 < beta"),
    (dict(alpha=-0.5, beta=-0.1, tau=0.1), "alpha < 0 < beta"),
    (dict(alpha=-0.5, beta=0.5, tau=-0.1), "tau >= 0"),
    (dict(alpha=-0.5, beta=0.5, tau=0.1, normalize="token"), "normalize"),
    (dict(alpha=-0.5, beta=0.5, tau=0.1, normalize="group"), "group_size"),
    (dict(alpha=-0.5, beta=0.5, tau=0.1, normalize="group", group_size=3), "group_size"),
])
def test_bad_hyper_parameters_raise(kwargs, match):
  x = np.zeros((4, 2), np.float32)
  with pytest.raises(ValueError, match=match):
    rl.k25_policy_loss(x, x, np.ones(4), np.ones_like(x), **kwargs)


@pytest.mark.parametrize("old_shape, adv_shape", [((4, 3), (4,)), ((2, 4), (4,)), ((4, 2), (3,)),
                                                  ((4, 2), (4, 3))])
def test_bad_shapes_raise(old_shape, adv_shape):
  logp = np.zeros((4, 2), np.float32)
  with pytest.raises(ValueError):
    rl.k25_policy_loss(logp, np.zeros(old_shape), np.ones(adv_shape), np.ones_like(logp),
                           tau=0.0, **BAND)


# --- group advantages --------------------------------------------------------------


def test_group_advantages_by_hand():
  rewards = np.array([1, 0, 0, 1, 1, 1, 1, 0], np.float32)
  expected = [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]
  np.testing.assert_allclose(rl.group_advantages(rewards, 4), expected)
  out = rl.group_advantages(rewards.reshape(2, 4), 4)
  assert out.shape == (2, 4)
  np.testing.assert_allclose(out.reshape(-1), expected)


@pytest.mark.parametrize("shape, group_size", [((8,), 1), ((8,), 3), ((2, 4), 2), ((2, 2, 2), 2),
                                               ((8,), 2.0)])
def test_group_advantages_bad_input_raises(shape, group_size):
  with pytest.raises(ValueError):
    rl.group_advantages(np.zeros(shape), group_size)


def test_grpo_advantages_divide_by_group_std():
  out = rl.grpo_advantages(np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0]), 2)
  np.testing.assert_allclose(out, [1, -1, -1, 1, 0, 0], atol=1e-5)


# --- ablation baselines ----------------------------------------------------------------


PPO_LOG_RATIO = np.log(np.array([[1.5, 1.5, 0.5, 0.5]], np.float32))
PPO_ADV = np.array([[1.0, -1.0, -1.0, 1.0]], np.float32)


def test_ppo_clip_by_hand():
  old = np.full_like(PPO_LOG_RATIO, -2.0)
  logp = old + PPO_LOG_RATIO
  loss, m = rl.ppo_clip_loss(logp, old, PPO_ADV, np.ones_like(old), eps=0.2)
  # min(ρA, clip(ρ)A): [min(1.5,1.2), min(-1.5,-1.2), min(-0.5,-0.8), min(0.5,0.8)]
  np.testing.assert_allclose(loss, -(1.2 - 1.5 - 0.8 + 0.5) / 4, rtol=1e-5)
  np.testing.assert_allclose(m["clip_fraction"], 0.5)
  g = grad_wrt_logp(rl.ppo_clip_loss, logp, old, PPO_ADV, np.ones_like(old), eps=0.2)
  np.testing.assert_allclose(g, [[0.0, 1.5 / 4, 0.0, -0.5 / 4]], rtol=1e-5, atol=1e-7)


def test_ppo_clip_higher():
  old = np.zeros((1, 1), np.float32)
  logp = np.log(np.full((1, 1), 1.5, np.float32))
  loss, m = rl.ppo_clip_loss(logp, old, np.ones((1, 1)), np.ones((1, 1)), eps=0.2, eps_high=0.6)
  np.testing.assert_allclose(loss, -1.5, rtol=1e-6)      # 1.5 < 1 + 0.6: not clipped
  assert float(m["clip_fraction"]) == 0.0


def test_grpo_by_hand_with_kl():
  # two responses of one prompt, rewards [1, 0] -> Â ≈ [1, -1]; lengths [2, 1]; ρ = 1
  logp = np.full((2, 2), -1.0, np.float32)
  mask = np.array([[1, 1], [1, 0]], np.float32)
  ref = logp + np.log(2.0)                                 # π_ref/π_θ = 2 on every token
  d = 2.0 - math.log(2.0) - 1.0
  kw = dict(group_size=2, kl_coef=0.1, ref_logp=ref)
  loss, m = rl.grpo_loss(logp, logp, np.array([1.0, 0.0]), mask, **kw)
  np.testing.assert_allclose(loss, 0.0 + 0.1 * d, rtol=1e-4)          # sequence mean: (1 + -1)/2 = 0
  np.testing.assert_allclose(m["kl_ref"], d, rtol=1e-5)
  loss, _ = rl.grpo_loss(logp, logp, np.array([1.0, 0.0]), mask, normalize="batch", **kw)
  np.testing.assert_allclose(loss, -(2 - 1) / 3 + 0.1 * d, rtol=1e-4)


def test_grpo_kl_gradient_vanishes_at_reference():
  logp = np.array([[-1.0, -2.0]], np.float32).repeat(2, 0)
  g = grad_wrt_logp(rl.grpo_loss, logp, logp, np.array([1.0, 1.0]), np.ones_like(logp),
                    group_size=2, kl_coef=1.0, ref_logp=logp)
  np.testing.assert_allclose(g, 0.0, atol=1e-7)           # equal rewards: Â = 0; at π_ref: ∂D = 0


def test_grpo_kl_without_reference_raises():
  x = np.zeros((2, 2), np.float32)
  with pytest.raises(ValueError, match="ref_logp"):
    rl.grpo_loss(x, x, np.ones(2), np.ones_like(x), group_size=2, kl_coef=0.1)


@pytest.mark.parametrize("eps_low, expected_second", [(None, 0.5), (0.2, 0.8)])
def test_cispo_gradient_is_clipped_weight_times_advantage(eps_low, expected_second):
  old = np.zeros((1, 2), np.float32)
  logp = np.log(np.array([[3.0, 0.5]], np.float32))
  args = (old, np.ones(1), np.ones_like(old))
  g = grad_wrt_logp(rl.cispo_loss, logp, *args, eps_high=1.0, eps_low=eps_low)
  # r̂ = clip(ρ, 1 − ε_low, 1 + ε_high): [min(3, 2), ...]; ∂L/∂logp = −r̂·A/N
  np.testing.assert_allclose(g, [[-2.0 / 2, -expected_second / 2]], rtol=1e-5)
  _, m = rl.cispo_loss(logp, *args, eps_high=1.0, eps_low=eps_low)
  np.testing.assert_allclose(m["clip_fraction"], 0.5 if eps_low is None else 1.0)


def test_public_api_exports():
  from k25jax import losses
  for name in ("k25_policy_loss", "group_advantages", "ppo_clip_loss", "grpo_loss", "cispo_loss"):
    assert getattr(losses, name) is getattr(rl, name)
