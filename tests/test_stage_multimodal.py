"""The multimodal stages at micro size: vit (two phases, LM frozen), joint pretrain, midtrain."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from config_files import load_config
from k25jax.data import mixture, tokenizer
from k25jax.model import k25
from k25jax.stages import midtrain, pretrain, vit
from k25jax.train import config_utils, multimodal, sharding, state as state_lib, step as step_lib

MICRO_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                  q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
TOK = tokenizer.ByteTokenizer(media=True)


def micro(path, arg=None, **train):
  config = load_config(path, arg)
  config.model = config_utils.k25_model_section("tiny", **MICRO_TEXT)
  config.train.update({"batch": 8, "log_every": 1, "eval_batches": 1, "keep_checkpoints": 1, **train})
  return config


# ------------------------------------------------------------------------------ vit
def test_vit_optimizer_phases():
  """Tower and projector move in phase 1, only the projector in phase 2, the LM never."""
  config = micro("configs/vit.py", steps=6)
  config.vit.projector_only_from = 3
  config.optimizer.update(warmup_steps=0, decay_steps=1)
  tx = vit.make_optimizer(config)
  params = {name: {"w": jnp.ones((2, 2))} for name in (vit.LM, vit.VIT, vit.PROJECTOR)}
  grads = jax.tree.map(jnp.ones_like, params)
  state = tx.init(params)
  moved = []
  for _ in range(6):
    updates, state = tx.update(grads, state, params)
    moved.append({name: bool(jnp.any(u["w"] != 0)) for name, u in updates.items()})
  assert [m[vit.VIT] for m in moved] == [True] * 3 + [False] * 3
  assert all(m[vit.PROJECTOR] for m in moved) and not any(m[vit.LM] for m in moved)


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory):
  config = micro("configs/vit.py", steps=40, seq_len=64, eval_every=40, checkpoint_every=40)
  config.vit.projector_only_from = 30
  config.optimizer.update(lr=3e-3, warmup_steps=2, decay_steps=5)
  config.data.update(tasks=("count",), max_patches=512)
  state, history = vit.run(config, str(tmp_path_factory.mktemp("vit")))
  return config, jax.device_get(state), history


@pytest.mark.slow
def test_vit_caption_loss_falls_and_the_lm_stays_frozen(vit_run):
  config, state, history = vit_run
  train = [h["loss"] for h in history if h["split"] == "train"]
  assert np.mean(train[-5:]) < np.mean(train[:5]) - 0.3, train
  cfg = config_utils.k25_config_from(config.model, TOK.media)
  initial = k25.init_params(cfg, jax.random.split(jax.random.PRNGKey(config.train.seed))[0])
  jax.tree.map(np.testing.assert_array_equal, state.params[vit.LM], jax.device_get(initial[vit.LM]))


# ------------------------------------------------------------------------------ joint / midtrain
@pytest.mark.slow
def test_joint_pretrain_late_fusion_runs_both_steps(tmp_path):
  config = micro("configs/pretrain.py", "joint", steps=4, seq_len=64, eval_every=4, checkpoint_every=4)
  config.data.update(vision_ratio=0.5, vision_start=0.5, max_patches=512, vision_tasks=("count", "motion"))
  config.optimizer.update(warmup_steps=1, decay_steps=1)
  state, history = pretrain.run(config, str(tmp_path))
  assert int(state.step) == 4
  train = [h for h in history if h["split"] == "train"]
  assert all(np.isfinite(h["loss"]) for h in train) and all(h["media_mismatch"] == 0 for h in train)
  assert [h["answer_count"] > 0 for h in train] == [False, False, True, True]   # vision from step 2 on
  evals = [h for h in history if h["split"] == "eval"][-1]
  assert {"loss", "vision_loss", "vision_answer_exact"} <= set(evals)


@pytest.mark.slow
def test_midtrain_runs_with_yarn_and_rows_sharded_along_sequence(tmp_path):
  config = micro("configs/midtrain.py", steps=2, seq_len=128, batch=2, eval_batches=0, checkpoint_every=2)
  config.long_context.update(original_context=32, yarn_factor=4.0)
  config.data.update(max_doc_chars=2000, max_patches=256, vision_ratio=0.3, vision_eval_batches=0)
  config.optimizer.update(warmup_steps=1, decay_steps=1)
  model_cfg = midtrain.long_context_model(config)
  assert model_cfg.text.rope_scaling["factor"] == 4.0 and model_cfg.text.max_position_embeddings == 128
  _, history = midtrain.run(config, str(tmp_path))           # mesh.sequence = -1: all 8 devices
  # step 1's loss (initial params, first batch, rows split over 8 devices along the sequence)
  # equals the loss of the same batch and params on one device
  batch = multimodal.device_features(next(pretrain.joint_datasets(config, TOK)[0]), model_cfg,
                                     config.data.max_patches)
  assert "pixel_values" in batch
  params = k25.init_params(model_cfg, jax.random.split(jax.random.PRNGKey(config.train.seed))[0])
  mesh = sharding.make_mesh(dict(data=1), devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    abstract = multimodal.abstract_state(model_cfg, optax.identity())
    eval_step = step_lib.make_eval_step(multimodal.make_loss(config, k25.K25(model_cfg)), abstract,
                                        batch_specs=multimodal.batch_specs(True))
    state = state_lib.create(params, optax.identity(), jax.random.PRNGKey(0))
    loss = float(eval_step(state, multimodal.to_device(batch, mesh))["loss"])
  np.testing.assert_allclose(history[0]["loss"], loss, rtol=1e-5)
  config.train.seq_len = 256
  with pytest.raises(ValueError, match="exceeds the YaRN context"):
    midtrain.long_context_model(config)


def test_placeholder_mismatch_is_a_clear_error():
  cfg = config_utils.k25_config_from(config_utils.k25_model_section("tiny", **MICRO_TEXT), TOK.media)
  it = mixture.mixture(docs=None, tok=TOK, schedule=mixture.VisionSchedule(1.0), tasks=("count",), batch=2,
                       seq_len=64, total_steps=1, seed=0, max_patches=64)
  batch = next(it)
  batch["media"] = batch["media"][:-1]                      # one image fewer than its placeholders
  with pytest.raises(ValueError, match="placeholder"):
    multimodal.device_features(batch, cfg, 64)
