"""Media sharded with their rows: the mixture's per-shard placement, the per-shard device
batch, and a K2.5 step on it equal to the step on the same batch with the media replicated."""
import jax
import numpy as np
import optax
import pytest
from ml_collections import ConfigDict

from configs import common
from k25jax.data import mixture, tokenizer
from k25jax.model import k25, media as media_lib, vision
from k25jax.train import config_utils, multimodal, objective, sharding, trainer as trainer_lib

MICRO_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                  q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
TOK = tokenizer.ByteTokenizer(media=True)
CFG = config_utils.k25_config_from(common.k25_model_section("tiny", **MICRO_TEXT), TOK)
TRAIN = ConfigDict(dict(z_loss=1e-4, balance_loss_alpha=1e-4))


def joint_batches(shards, n=4, ratio=0.3, max_patches=512, batch=8):
  it = mixture.mixture(docs=["def f(x):\n    return x + 1\n" * 20] * 8, tok=TOK, schedule=mixture.VisionSchedule(ratio),
                       tasks=("count", "motion"), batch=batch, seq_len=128, total_steps=n, seed=0,
                       max_patches=max_patches, shards=shards)
  return [next(it) for _ in range(n)]


def shard_items(batch, shards):
  """The media items of each shard, from the placeholders of its rows."""
  mask = media_lib.placeholder_mask(batch["inputs"], CFG.media_token_ids).reshape(shards, -1).sum(1)
  tokens = [vision.num_media_tokens(m.grid_thw) for m in batch["media"]]
  return multimodal.split_items(batch["media"], tokens, mask)


def test_mixture_balances_patches_within_each_shards_budget():
  for batch in joint_batches(shards=4):
    groups = shard_items(batch, 4)
    patches = [sum(m.pixel_values.shape[0] for m in group) for group in groups]
    assert patches == batch["shard_patches"].tolist() and max(patches) <= 512 // 4
    # least-loaded placement: no shard holds more than one sample's patches (≤ 64) over another
    assert max(patches) - min(patches) <= 64, patches
  one = joint_batches(shards=1)
  assert [b["shard_patches"].tolist() for b in one] == [[sum(m.pixel_values.shape[0] for m in b["media"])] for b in one]
  shares = [mixture.vision_share(iter(joint_batches(shards=s, n=8)), 8) for s in (1, 4)]
  assert shares[0] == pytest.approx(0.3, abs=0.05) and shares[1] == pytest.approx(0.3, abs=0.05), shares


def test_patch_imbalance():
  assert mixture.patch_imbalance(np.array([10, 10, 10, 10])) == 1.0
  assert mixture.patch_imbalance(np.array([30, 10, 0, 0])) == pytest.approx(3.0)
  assert mixture.patch_imbalance(np.zeros(4)) == 1.0


def test_bad_shard_counts_and_budgets_are_clear_errors():
  with pytest.raises(ValueError, match="must divide train.batch=8 and data.max_patches=512"):
    joint_batches(shards=3)
  with pytest.raises(ValueError, match=r"more than the budget of 32 \(data.max_patches=256 / 8 media shards\)"):
    joint_batches(shards=8, max_patches=256)          # a 64-patch video in a 32-patch shard
  batch = joint_batches(shards=4)[0]
  with pytest.raises(ValueError, match="media shards must divide"):
    multimodal.device_features(batch, CFG, 512, shards=3)


def test_device_features_per_shard_hold_their_rows_media():
  batch = joint_batches(shards=4)[0]
  out = multimodal.device_features(batch, CFG, 512, shards=4)
  assert out["pixel_values"].shape == (4, 128, 3, 14, 14) and out["layout"].segment_ids.shape == (4, 128)
  for shard, group in enumerate(shard_items(batch, 4)):
    n = sum(m.pixel_values.shape[0] for m in group)
    np.testing.assert_array_equal(out["pixel_values"][shard, :n].reshape(n, -1),
                                  np.concatenate([m.pixel_values for m in group]).reshape(n, -1))
    assert not out["pixel_values"][shard, n:].any() and (out["layout"].segment_ids[shard, n:] == 0).all()
    assert int((out["layout"].merged_items[shard] > 0).sum()) == sum(vision.num_media_tokens(m.grid_thw)
                                                                      for m in group)
  # a shard without media is all padding
  empty = multimodal.padded_media([], CFG, 16)
  assert empty[0].shape == (16, 3, 14, 14) and not empty[1].segment_ids.any()


def step_on(batch, mesh_sizes, devices):
  """One SGD train step on `batch`: (metrics, new params), and the compiled HLO. (SGD, so the new
  params compare the gradients themselves: Adam's first step, lr·g/(|g|+eps), turns a gradient
  near eps into a difference of lr whatever the order of its sums.)"""
  model = k25.K25(CFG)
  tx = optax.sgd(1.0, momentum=0.9)   # a state to shard; the first step is still -g
  mesh = sharding.make_mesh(mesh_sizes, devices=devices)
  with jax.set_mesh(mesh):
    state = trainer_lib.new_state(model, tx, mesh, seed=0)
    step = trainer_lib.train_step(model, tx, objective.for_section(model, TRAIN), router_bias_rate=1e-3,
                                  batch_specs=multimodal.batch_specs(True, sharded_media=multimodal.is_sharded(batch)))
    device_batch = multimodal.to_device(batch, mesh)
    compiled = step.lower(state, device_batch).compile()
    state, metrics = compiled(state, device_batch)
    return jax.device_get(metrics), jax.device_get(state.params), compiled.as_text()


@pytest.mark.slow
def test_sharded_media_step_equals_replicated_and_stays_local():
  host = joint_batches(shards=4, ratio=0.5)[0]
  flat = multimodal.device_features(host, CFG, 512)
  sharded = multimodal.device_features(host, CFG, 512, shards=4)
  ref_metrics, ref_params, _ = step_on(flat, dict(data=1), jax.devices()[:1])
  # 4 media shards over data x fsdp, rows also split along the sequence
  metrics, params, hlo = step_on(sharded, dict(data=2, fsdp=2, sequence=2), jax.devices())
  assert metrics["media_mismatch"] == 0 and metrics["answer_count"] == ref_metrics["answer_count"] > 0
  for name in ("loss", "cross_entropy", "grad_norm"):
    np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=2e-5, err_msg=name)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, ref_params)
  # each device encodes its own shard: the [4, 128, ...] pixels enter as [1, 128, ...] and are never gathered
  assert "f32[1,128,3,14,14]" in hlo and "f32[4,128,3,14,14]" not in hlo and "f32[512,3,14,14]" not in hlo
