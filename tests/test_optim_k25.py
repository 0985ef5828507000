"""MuonClip on the K2.5 model: the partition of the whole multimodal tree, a joint pre-training
run with `optimizer.name='muonclip'`, and QK-Clip on the decoder nested under `language_model/`."""
import math

import jax
import numpy as np
import pytest

from config_files import load_config
from configs import common
from k25jax.data import tokenizer
from k25jax.model import k25
from k25jax.optim import partition
from k25jax.optim.partition import ADAMW, FROZEN, MUON
from k25jax.stages import pretrain
from k25jax.train import config_utils

MICRO_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                  q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
TOK = tokenizer.ByteTokenizer(media=True)

LM, VT, MM = k25.LANGUAGE_MODEL, k25.VISION_TOWER, k25.PROJECTOR
BLOCK = f"{VT}/encoder/blocks_1"
# path -> (label, (batch, rows, cols) axes of a Muon leaf)
EXPECTED = {
    f"{LM}/embed_tokens/embedding": (ADAMW, None),
    f"{LM}/lm_head": (ADAMW, None),
    f"{LM}/norm/weight": (ADAMW, None),
    f"{LM}/layers_0/mlp/down_proj/kernel": (MUON, ((), (0,), (1,))),
    f"{LM}/layers_1/input_layernorm/weight": (ADAMW, None),
    f"{LM}/layers_1/self_attn/q_b_proj/kernel": (MUON, ((), (0,), (1, 2))),
    f"{LM}/layers_1/self_attn/kv_b_proj/kernel": (MUON, ((), (0,), (1, 2))),
    f"{LM}/layers_1/self_attn/o_proj/kernel": (MUON, ((), (0, 1), (2,))),
    f"{LM}/layers_1/self_attn/kv_a_layernorm/weight": (ADAMW, None),
    f"{LM}/layers_1/mlp/gate/kernel": (ADAMW, None),
    f"{LM}/layers_1/mlp/gate/e_score_correction_bias": (FROZEN, None),
    f"{LM}/layers_1/mlp/experts/gate_proj": (MUON, ((0,), (1,), (2,))),
    f"{LM}/layers_1/mlp/shared_experts/down_proj/kernel": (MUON, ((), (0,), (1,))),
    f"{VT}/patch_embed/proj/kernel": (ADAMW, None),
    f"{VT}/patch_embed/proj/bias": (ADAMW, None),
    f"{VT}/patch_embed/pos_emb/weight": (ADAMW, None),
    f"{BLOCK}/wqkv/kernel": (MUON, ((), (0,), (1, 2, 3))),
    f"{BLOCK}/wqkv/bias": (ADAMW, None),
    f"{BLOCK}/wo/kernel": (MUON, ((), (0, 1), (2,))),
    f"{BLOCK}/wo/bias": (ADAMW, None),
    f"{BLOCK}/mlp/fc0/kernel": (MUON, ((), (0,), (1,))),
    f"{BLOCK}/mlp/fc1/bias": (ADAMW, None),
    f"{BLOCK}/norm0/weight": (ADAMW, None),
    f"{VT}/encoder/final_layernorm/bias": (ADAMW, None),
    f"{MM}/pre_norm/weight": (ADAMW, None),
    f"{MM}/proj_0/kernel": (MUON, ((), (0,), (1,))),
    f"{MM}/proj_2/kernel": (MUON, ((), (0,), (1,))),
    f"{MM}/proj_2/bias": (ADAMW, None),
}


def k25_leaves():
  cfg = config_utils.k25_config_from(load_config("configs/pretrain.py", "joint").model, TOK)
  leaves = jax.tree_util.tree_flatten_with_path(k25.abstract_params(cfg))[0]
  return {"/".join(partition.names(path)): (path, x) for path, x in leaves}


def test_partition_of_the_tiny_k25_model_leaf_by_leaf():
  """Every leaf gets a label (no layout raises), the representative paths the expected one, and
  what stays off Muon is the embeddings, head, router, position table, biases and vectors."""
  leaves = k25_leaves()
  got = {}
  for name, (path, x) in leaves.items():
    label = partition.label(path, x)
    got[name] = (label, tuple(partition.matrix_axes(path, x.shape)) if label == MUON else None)
  assert {name: got[name] for name in EXPECTED} == EXPECTED
  for name, (label, _) in got.items():
    x = leaves[name][1]
    if label == ADAMW and x.ndim >= 2:
      assert name.endswith(("embed_tokens/embedding", "lm_head", "gate/kernel", "/bias")) or "patch_embed" in name, name


def test_muon_matrix_axes_cover_every_axis_once():
  for name, (path, x) in k25_leaves().items():
    if partition.label(path, x) == MUON:
      axes = partition.matrix_axes(path, x.shape)
      assert sorted(axes.batch + axes.rows + axes.cols) == list(range(x.ndim)), name
      assert axes.rows and axes.cols, name
      assert math.prod(x.shape[a] for a in axes.rows) > 1 and math.prod(x.shape[a] for a in axes.cols) > 1, name


def joint_muonclip(steps, **optimizer):
  config = load_config("configs/pretrain.py", "joint")
  config.model = common.k25_model_section("tiny", **MICRO_TEXT)
  config.optimizer.update({"name": "muonclip", "lr": 3e-3, "warmup_steps": 2, "decay_steps": 2, **optimizer})
  config.data.update(vision_ratio=0.3, vision_tasks=("count",), max_patches=64, vision_eval_batches=0)
  config.train.update(steps=steps, batch=8, seq_len=64, log_every=1, eval_batches=0, checkpoint_every=steps,
                      keep_checkpoints=1)
  config.mesh.devices = 1         # Muon on sharded params: test_optim_sharding.py
  return config


@pytest.fixture(scope="module")
def history(tmp_path_factory):
  _, history = pretrain.run(joint_muonclip(16), str(tmp_path_factory.mktemp("joint_muonclip")))
  return [h for h in history if h["split"] == "train"]


@pytest.mark.slow
def test_joint_pretraining_with_muonclip_learns(history):
  loss = [h["loss"] for h in history]
  assert all(h["finite"] == 1.0 for h in history)
  assert np.mean(loss[-4:]) < loss[0] - 1.0, loss
  assert any(h["answer_count"] > 0 for h in history)          # the vision tower was in the steps


@pytest.mark.slow
def test_qk_clip_clips_the_nested_decoder_and_logs_it(history, tmp_path):
  """The stage logs QK-Clip's counts; with τ below every logit every decoder head is clipped."""
  assert {"qk_clip/clipped_heads", "qk_clip/max_logit"} <= set(history[0])
  tau = 1e-3
  _, tiny_tau = pretrain.run(joint_muonclip(2, qk_clip_tau=tau, warmup_steps=0, decay_steps=1), str(tmp_path))
  first, second = [h for h in tiny_tau if h["split"] == "train"]
  heads = MICRO_TEXT["num_hidden_layers"] * MICRO_TEXT["num_attention_heads"]
  assert first["qk_clip/clipped_heads"] == heads and first["qk_clip/max_logit"] > 10 * tau
  assert second["qk_clip/max_logit"] < 2 * tau
