"""The multimodal stages at micro size: vit (two phases, LM frozen), joint pretrain, midtrain."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from config_files import load_config
from configs import common
from k25jax.data import mixture, tokenizer
from k25jax.model import k25
from k25jax.stages import midtrain, pretrain, vit
from k25jax.train import config_utils, joint, multimodal, objective, sharding, state as state_lib
from k25jax.train import trainer as trainer_lib

MICRO_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                  q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
TOK = tokenizer.ByteTokenizer(media=True)


def micro(path, arg=None, **train):
  config = load_config(path, arg)
  config.model = common.k25_model_section("tiny", **MICRO_TEXT)
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
  """A micro language model pretrained on the captions' text (no images), then the ViT stage on it,
  both on one of the 8 devices (`mesh.devices`: what they check is learning, not sharding; the
  ViT stage's media-sharded step runs across processes in test_stage_multiprocess.py)."""
  lm_dir = str(tmp_path_factory.mktemp("caption_lm"))
  text = load_config("configs/pretrain.py")
  text.model = common.model_section("tiny", **MICRO_TEXT)
  text.mesh.devices = 1
  text.data.update(source="visual_captions", eval_every=1000)
  text.train.update(steps=80, batch=8, seq_len=64, log_every=80, eval_every=80, eval_batches=1, checkpoint_every=80)
  text.optimizer.update(lr=3e-3, warmup_steps=5, decay_steps=20)
  pretrain.run(text, lm_dir)
  config = micro("configs/vit.py", steps=40, seq_len=96, eval_every=40, checkpoint_every=40)
  config.init.text_checkpoint = lm_dir
  config.mesh.devices = 1
  config.vit.projector_only_from = 30
  config.optimizer.update(lr=3e-3, warmup_steps=2, decay_steps=5)
  config.data.update(tasks=("caption", "count"), max_patches=512)
  state, history = vit.run(config, str(tmp_path_factory.mktemp("vit")))
  return config, lm_dir, jax.device_get(state), history


@pytest.mark.slow
def test_vit_caption_loss_falls_and_the_lm_stays_frozen(vit_run):
  config, lm_dir, state, history = vit_run
  train = [h["loss"] for h in history if h["split"] == "train"]
  assert np.mean(train[-10:]) < train[0] - 0.08, train     # the projector learns to speak to the frozen LM
  cfg = config_utils.k25_config_from(config.model, TOK)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  with jax.set_mesh(mesh):
    lm = trainer_lib.restore_params(k25.K25(cfg), lm_dir, mesh, vit.LM)
  jax.tree.map(np.testing.assert_array_equal, state.params[vit.LM], jax.device_get(lm))


# ------------------------------------------------------------------------------ joint / midtrain
def test_joint_preset_is_the_k25_model_with_a_vision_schedule():
  config = load_config("configs/pretrain.py", "joint")
  assert "vision" in config.model and config.data.vision_ratio == 0.1 and config.data.vision_start == 0.0
  assert joint.schedule(config).overall_share == pytest.approx(0.1)
  assert "vision" not in load_config("configs/pretrain.py").model     # the text-only default is unchanged


@pytest.mark.slow
def test_midtrain_late_fusion_with_yarn_and_rows_sharded_along_sequence(tmp_path):
  """Joint rows (text-only before vision starts at step 2), YaRN, 8 devices along `sequence`."""
  config = micro("configs/midtrain.py", steps=2, seq_len=128, batch=2, eval_batches=0, checkpoint_every=2)
  config.long_context.update(original_context=32, yarn_factor=4.0)
  config.data.update(max_doc_chars=2000, max_patches=256, vision_ratio=0.4, vision_start=0.5, vision_eval_batches=0,
                     vision_tasks=("count", "motion"))
  config.optimizer.update(warmup_steps=1, decay_steps=1)
  model_cfg = midtrain.long_context_model(config, TOK)
  assert model_cfg.text.rope_scaling["factor"] == 4.0 and model_cfg.text.max_position_embeddings == 128
  _, history = midtrain.run(config, str(tmp_path))           # mesh.sequence = -1: all 8 devices
  train = [h for h in history if h["split"] == "train"]
  assert [h["answer_count"] > 0 for h in train] == [False, True] and all(h["media_mismatch"] == 0 for h in train)
  # step 1's loss (initial params, first batch, rows split over 8 devices along the sequence)
  # equals the loss of the same batch and params on one device
  batch = multimodal.device_features(next(joint.datasets(config, TOK)[0]), model_cfg,
                                     config.data.max_patches)
  params = k25.init_params(model_cfg, jax.random.split(jax.random.PRNGKey(config.train.seed))[0])
  mesh = sharding.make_mesh(dict(data=1), devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    model = k25.K25(model_cfg)
    loss_fn = objective.for_section(model, config.train)
    eval_step = trainer_lib.eval_step(model, optax.identity(), loss_fn, multimodal.batch_specs(False))
    state = state_lib.create(params, optax.identity(), jax.random.PRNGKey(0))
    loss = float(eval_step(state, multimodal.to_device(batch, mesh))["loss"])
  np.testing.assert_allclose(train[0]["loss"], loss, rtol=1e-5)
  config.train.seq_len = 256
  with pytest.raises(ValueError, match="exceeds the YaRN context"):
    midtrain.check(config)


def test_placeholder_mismatch_is_a_clear_error():
  cfg = config_utils.k25_config_from(common.k25_model_section("tiny", **MICRO_TEXT), TOK)
  it = mixture.mixture(docs=None, tok=TOK, schedule=mixture.VisionSchedule(1.0), tasks=("count",), batch=2,
                       seq_len=64, total_steps=1, seed=0, max_patches=64)
  batch = next(it)
  batch["media"] = batch["media"][:-1]                      # one image fewer than its placeholders
  with pytest.raises(ValueError, match="placeholder"):
    multimodal.device_features(batch, cfg, 64)
