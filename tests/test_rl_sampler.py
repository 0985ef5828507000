"""Sampler on the latent cache: greedy = argmax of the full forward; = transformers' generate."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hf_fixtures import random_hf_model, tiny_hf_config
from k25jax.convert import hf
from k25jax.model import attention, config, transformer
from k25jax.rl import sampler

CFG = config.preset("tiny", num_hidden_layers=2, vocab_size=128, hidden_size=64, q_lora_rank=32,
                    kv_lora_rank=16, num_attention_heads=4, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                    intermediate_size=64, initializer_range=0.2)
PROMPTS = np.array([[5, 6, 7, 8, 9, 10, 11], [3, 4, 0, 0, 0, 0, 0], [17, 2, 90, 0, 0, 0, 0]])
LENGTHS = np.array([7, 2, 3])


@pytest.fixture(scope="module")
def params():
  return transformer.init_params(CFG, jax.random.PRNGKey(0))


@pytest.mark.slow
def test_cached_greedy_equals_argmax_of_full_forward(params):
  out = sampler.generate(CFG, params, PROMPTS, LENGTHS, jax.random.PRNGKey(0),
                         sampler.SamplingConfig(max_new_tokens=8, temperature=0))
  model = transformer.Transformer(CFG)
  for row in range(len(PROMPTS)):
    # A causal model: one full forward over prompt + generated gives every step's next-token logits.
    n = LENGTHS[row]
    seq = np.concatenate([PROMPTS[row, :n], np.asarray(out["tokens"][row])])
    logits, _ = model.apply({"params": params}, jnp.asarray(seq[None]))
    step_logits = logits[0, n - 1:n - 1 + 8]
    np.testing.assert_array_equal(out["tokens"][row], jnp.argmax(step_logits, axis=-1))
    logp = jnp.take_along_axis(jax.nn.log_softmax(step_logits), out["tokens"][row][:, None], axis=-1)[:, 0]
    np.testing.assert_allclose(out["logprobs"][row], logp, atol=1e-5)


def test_stop_tokens_end_rows_and_pad(params):
  greedy = sampler.generate(CFG, params, PROMPTS, LENGTHS, jax.random.PRNGKey(0),
                            sampler.SamplingConfig(max_new_tokens=8, temperature=0))
  stop = int(greedy["tokens"][0, 2])          # row 0 emits this token at step 2
  out = sampler.generate(CFG, params, PROMPTS, LENGTHS, jax.random.PRNGKey(0),
                         sampler.SamplingConfig(max_new_tokens=8, temperature=0, stop_tokens=(stop,), pad_id=0))
  first = int(np.argmax(np.asarray(greedy["tokens"][0]) == stop))
  assert int(out["lengths"][0]) == first + 1
  assert np.all(np.asarray(out["tokens"][0, first + 1:]) == 0)
  assert np.all(np.asarray(out["logprobs"][0, first + 1:]) == 0)


def test_top_k_one_is_greedy_and_sampling_is_seeded(params):
  greedy = sampler.generate(CFG, params, PROMPTS, LENGTHS, jax.random.PRNGKey(0),
                            sampler.SamplingConfig(max_new_tokens=6, temperature=0))
  top1 = sampler.generate(CFG, params, PROMPTS, LENGTHS, jax.random.PRNGKey(3),
                          sampler.SamplingConfig(max_new_tokens=6, temperature=1.0, top_k=1))
  np.testing.assert_array_equal(top1["tokens"], greedy["tokens"])
  a = sampler.generate(CFG, params, PROMPTS, LENGTHS, jax.random.PRNGKey(7),
                       sampler.SamplingConfig(max_new_tokens=6, temperature=1.0, top_p=0.9))
  b = sampler.generate(CFG, params, PROMPTS, LENGTHS, jax.random.PRNGKey(7),
                       sampler.SamplingConfig(max_new_tokens=6, temperature=1.0, top_p=0.9))
  np.testing.assert_array_equal(a["tokens"], b["tokens"])


@pytest.mark.slow
def test_greedy_sampled_and_banned_decodes_share_one_program(params):
  """Temperature and bans enter as values (`sampler.Knobs`): three decodes of one shape, one
  compile. Banned ids never come out, and a banned decode's log-prob is log softmax(z / T) of
  the logits with the banned ids at −inf."""
  before = sampler.compiled_programs()
  greedy, sampled, banned = (
      sampler.generate(CFG, params, PROMPTS, LENGTHS, jax.random.PRNGKey(5), sampler.SamplingConfig(
          max_new_tokens=5, temperature=t, banned_tokens=ban))
      for t, ban in ((0.0, ()), (1.0, ()), (0.7, tuple(range(0, CFG.vocab_size, 2)))))
  assert sampler.compiled_programs() == before + 1
  assert np.all(np.asarray(banned["tokens"]) % 2 == 1)
  assert not np.array_equal(greedy["tokens"], sampled["tokens"])
  logits, _ = transformer.Transformer(CFG).apply({"params": params}, jnp.asarray(PROMPTS))
  first = logits[np.arange(len(PROMPTS)), LENGTHS - 1]                     # each row's first step
  z = jnp.where(jnp.arange(CFG.vocab_size) % 2 == 0, -jnp.inf, first) / 0.7
  want = jnp.take_along_axis(jax.nn.log_softmax(z), jnp.asarray(banned["tokens"])[:, :1], axis=-1)[:, 0]
  np.testing.assert_allclose(np.asarray(banned["logprobs"])[:, 0], want, atol=1e-5)
  with pytest.raises(ValueError, match="outside the vocabulary of 128"):
    sampler.generate(CFG, params, PROMPTS, LENGTHS, jax.random.PRNGKey(0),
                     sampler.SamplingConfig(max_new_tokens=5, banned_tokens=(3, 128)))


def test_truncate_logits_top_p():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  kept = np.isfinite(np.asarray(sampler.truncate_logits(logits, 0, 0.75)))
  np.testing.assert_array_equal(kept, [[True, True, False, False]])


def test_prompt_longer_than_context_is_rejected(params):
  with pytest.raises(ValueError, match="exceeds the context"):
    sampler.generate(CFG.replace(max_position_embeddings=10), params, PROMPTS, LENGTHS,
                     jax.random.PRNGKey(0), sampler.SamplingConfig(max_new_tokens=8))


def test_k25_cache_costs_576_numbers_per_token_per_layer():
  cfg = config.preset("k25")
  cache = jax.eval_shape(lambda: attention.init_cache(cfg, 1, 1))
  assert len(cache) == 61
  assert sum(x.size for x in jax.tree_util.tree_leaves(cache[0])) == 576


def test_greedy_matches_transformers_generate(tmp_path):
  hf_cfg = tiny_hf_config(vocab_size=128)
  model = random_hf_model(hf_cfg, seed=5, std=0.3)
  model.save_pretrained(str(tmp_path))
  cfg, params = hf.load(str(tmp_path))
  prompt = np.array([[7, 3, 99, 12, 5]])
  with torch.no_grad():
    ref = model.generate(torch.as_tensor(prompt), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                         pad_token_id=0, eos_token_id=None)[0, 5:].numpy()
  out = sampler.generate(cfg, params, prompt, np.array([5]), jax.random.PRNGKey(0),
                         sampler.SamplingConfig(max_new_tokens=10, temperature=0))
  np.testing.assert_array_equal(np.asarray(out["tokens"][0]), ref)
