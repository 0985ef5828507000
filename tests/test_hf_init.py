"""`init.hf_checkpoint`: a run starts from a Hugging Face folder (its model section taken from
config.json; bfloat16 as released models, or the released FP8 layout), trains, and its export
loads back in transformers with the run's logits."""
import copy

import jax
import numpy as np
import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from hf_fixtures import fp8_tensors, hf_logits, random_hf_model, save_fp8_folder, tiny_hf_config
from k25jax.train import hf_export as export
from k25jax.model import transformer
from k25jax.rl import sampler
from k25jax.stages import pretrain
from k25jax.train import config_utils, sharding, trainer as trainer_lib
from test_train_step import micro_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """A tiny random DeepseekV3 (YaRN, a dense first layer, 8 experts) with the byte tokenizer's
  512-id vocabulary, saved in bfloat16 (as released models are); in memory, the same weights
  in float32."""
  model = random_hf_model(tiny_hf_config(vocab_size=512))
  with torch.no_grad():                     # what the folder holds (rotary frequencies stay float32: not saved)
    for value in model.state_dict().values():
      value.copy_(value.to(torch.bfloat16))
  path = tmp_path_factory.mktemp("deepseek")
  copy.deepcopy(model).to(torch.bfloat16).save_pretrained(str(path))
  return str(path), model


@pytest.fixture(scope="module")
def fp8_folder(folder, tmp_path_factory):
  """`folder`'s weights in the released FP8 layout (e4m3 layer weights, one 128x128 scale block
  each at these sizes); in memory, transformers' model on the dequantized weights."""
  _, model = folder
  tensors, _, dequantized = fp8_tensors(model)
  path = save_fp8_folder(tensors, model.config, str(tmp_path_factory.mktemp("deepseek_fp8")))
  reference = copy.deepcopy(model)
  reference.load_state_dict(dequantized)
  return path, reference


def config_from(path, steps=20):
  config = micro_config()
  config.init.hf_checkpoint = path
  config.train.update(steps=steps, batch=8, seq_len=32, log_every=10, eval_every=steps, checkpoint_every=steps)
  config.optimizer.update(warmup_steps=2, decay_steps=5)
  config.mesh.update(data=2, fsdp=4)
  return config


@pytest.mark.slow
def test_the_model_section_comes_from_the_folder_and_the_params_too(folder):
  path, model = folder
  config = config_from(path)
  changed = config_utils.model_section_from_hf(config)
  assert {"hidden_size", "num_hidden_layers", "rope_scaling", "n_routed_experts"} <= set(changed)
  assert config_utils.model_section_from_hf(config) == []              # already the folder's
  ours = transformer.Transformer(config_utils.model_config_from(config.model))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  params = trainer_lib.params_from(ours, config.init, mesh, seed=0)
  assert params["layers_1"]["mlp"]["experts"]["gate_proj"].sharding.spec != jax.sharding.PartitionSpec()  # sharded
  tokens = np.random.default_rng(0).integers(3, 512, size=(2, 32))
  logits, _ = ours.apply({"params": params}, jax.numpy.asarray(tokens))
  np.testing.assert_allclose(np.asarray(logits), hf_logits(model, tokens), atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("start", ["bfloat16", "fp8"])
def test_a_run_from_the_folder_exports_back_to_transformers(start, request, tmp_path):
  """init.hf_checkpoint (bfloat16, or FP8 dequantized on load) -> 20 steps of pre-training ->
  k25jax.export -> from_pretrained: the trained model's logits (atol 2e-5, float32), and
  transformers' greedy generation equals the k25jax sampler's token for token over 32 new tokens."""
  path, model = request.getfixturevalue({"bfloat16": "folder", "fp8": "fp8_folder"}[start])
  config = config_from(path)
  config_utils.model_section_from_hf(config)
  config.mesh.update(data=1, fsdp=1, devices=1)     # the load onto a sharded mesh: the test above
  state, history = pretrain.run(config, str(tmp_path / "run"))
  train = [h for h in history if h["split"] == "train"]
  assert train[-1]["loss"] < train[0]["loss"]
  out = export.export(str(tmp_path / "run"), str(tmp_path / "hf"))
  reloaded = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  tokens = np.random.default_rng(1).integers(3, 259, size=(2, 32))
  ours, _ = transformer.Transformer(config_utils.model_config_from(config.model)).apply(
      {"params": jax.device_get(state.params)}, jax.numpy.asarray(tokens))
  # float32 on both sides; the largest difference over a [2, 32, 512] draw is 7e-6 to 1.5e-5
  # (four draws, from a float32 or a bfloat16 start): 2e-5 is that noise, not a looser parity
  np.testing.assert_allclose(hf_logits(reloaded, tokens), np.asarray(ours), atol=2e-5, rtol=0)
  assert np.abs(hf_logits(reloaded, tokens) - hf_logits(model, tokens)).max() > 1e-3    # it trained
  prompt = tokens[:, :8]
  # 32 greedy tokens on both sides, EOS a token like any other: the export's generation_config
  # stops at EOS (2), and min_new_tokens would instead forbid it, where the sampler (no stop tokens) takes it
  reloaded.generation_config.eos_token_id = None
  with torch.no_grad():
    theirs = reloaded.generate(torch.as_tensor(prompt), max_new_tokens=32, do_sample=False,
                               pad_token_id=0)[:, 8:].numpy()
  assert theirs.shape == (2, 32)
  greedy = sampler.SamplingConfig(max_new_tokens=32, temperature=0.0)
  ours = sampler.generate(config_utils.model_config_from(config.model), jax.device_get(state.params), prompt,
                          np.full(len(prompt), 8), jax.random.PRNGKey(0), greedy)["tokens"]
  np.testing.assert_array_equal(np.asarray(ours), theirs)


def test_disagreements_fail_naming_both_values(folder):
  path, _ = folder
  config = config_from(path)
  config.model.hidden_size = 64
  with pytest.raises(ValueError, match=r"--config.model.hidden_size=64 disagrees with .*config.json \(32\)"):
    config_utils.model_section_from_hf(config, given={"hidden_size"})
  model = transformer.Transformer(config_utils.model_config_from(config.model))   # the section left unset
  mesh = sharding.make_mesh(config.mesh.to_dict())
  with pytest.raises(ValueError, match=r"describes another model: hidden_size \(run 64, folder 32\)"):
    trainer_lib.params_from(model, config.init, mesh, seed=0)
  config.init.checkpoint = "/a/run"
  with pytest.raises(ValueError, match="init.checkpoint='/a/run' and init.hf_checkpoint="):
    trainer_lib.params_from(model, config.init, mesh, seed=0)
