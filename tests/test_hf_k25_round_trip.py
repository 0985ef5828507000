"""A Kimi K2.5 folder through SFT on the user's chats and back out: a tiny random
Kimi_K25ForConditionalGeneration saved by transformers with its routed experts pack-quantized to
INT4 as released → `python -m k25jax.main --config=configs/sft.py:tiny,files
--config.init.hf_checkpoint=FOLDER --config.data.files=CHATS` (40 steps on chats with tool calls,
with images, and plain ones: the held-out loss on the assistant's tokens falls by more than half)
→ `k25jax.export` → `Kimi_K25ForConditionalGeneration.from_pretrained`: the logits with an image in
the prompt equal k25jax's on the trained params, transformers' greedy generation equals the
k25jax sampler's token for token over 32 new tokens, and the exported chat template renders the
prompt k25jax trained on. (One run shows both the stage on chat files end to end and the round
trip; tests/test_sft_chat_files.py checks the records, the rows and a bad file's exit.)"""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from config_files import load_config
from configs import common
from cpu_env import subprocess_env
from safetensors import safe_open
from transformers import AutoTokenizer, Kimi_K25ForConditionalGeneration

from k25jax.convert import hf, int4, safetensors_io
from k25jax.data import chat, tokenizer as tokenizer_lib, vision as vision_data
from k25jax.model import k25
from k25jax.rl import decode, media_rows, sampler
from k25jax.train import config_utils, hf_export, sharding, trainer as trainer_lib
from test_sft_chat_files import CHECKOUT, _image, _image_chat, _tool_chat, _write_jsonl
from test_vision_parity import tiny_k25_hf_config

TOK = tokenizer_lib.ByteTokenizer(media=True, chat=True)
INT4_GROUP = 16        # the experts' 128 input columns (hidden, moe_intermediate) hold 8 groups each
# The decoder of configs/sft.py:tiny,files (common.TINY_CHAT_TEXT), so that the folder learns as that preset does.
CHAT_TEXT = {k: v for k, v in common.TINY_CHAT_TEXT.items() if k != "vocab_size"}


def _int4_experts(model, text_cfg) -> dict:
  """The released layout of the routed experts (`language_model.model.layers.{i}.mlp.experts.{e}.
  {gate,up,down}_proj.weight_packed / weight_scale / weight_shape`); writes the dequantized
  weights back into `model`, which then is the model the folder holds."""
  f = text_cfg.moe_intermediate_size
  projections = {"gate_proj": ("gate_up_proj", slice(0, f)), "up_proj": ("gate_up_proj", slice(f, 2 * f)),
                 "down_proj": ("down_proj", slice(None))}
  tensors = {}
  for i in range(text_cfg.first_k_dense_replace, text_cfg.num_hidden_layers):
    experts = model.model.language_model.layers[i].mlp.experts
    for proj, (fused, rows) in projections.items():
      weight = getattr(experts, fused)
      for e in range(text_cfg.n_routed_experts):
        w = weight[e, rows].detach().float().numpy()
        packed, scale = int4.quantize(w, group=INT4_GROUP)
        key = f"language_model.model.layers.{i}.mlp.experts.{e}.{proj}"
        tensors.update({key + ".weight_packed": packed, key + ".weight_scale": scale,
                        key + ".weight_shape": np.array(w.shape, np.int64)})
        with torch.no_grad():
          weight[e, rows] = torch.from_numpy(int4.dequantize(packed, scale, w.shape, group=INT4_GROUP))
  return tensors


@pytest.fixture(scope="module")
def int4_folder(tmp_path_factory):
  """A Kimi K2.5 folder at the byte tokenizer's K2.5 vocabulary (288 ids ≥ its 275) with its
  media ids, experts in INT4 (`quantization_config` as released); in memory, transformers' model
  on the dequantized weights."""
  media = TOK.media
  config = tiny_k25_hf_config(text={**CHAT_TEXT, "vocab_size": 288}, image_token_id=media.pad,
                              video_token_id=TOK.vocab_size, vision_start_token_id=media.begin,
                              vision_end_token_id=media.end)
  torch.manual_seed(5)
  model = Kimi_K25ForConditionalGeneration(config).eval()     # transformers' own initialisation: a model SFT can train
  with torch.no_grad():                                     # ... and a router bias for the correction to carry
    for layer in model.model.language_model.layers[config.text_config.first_k_dense_replace:]:
      layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
  saved = str(tmp_path_factory.mktemp("k25_saved"))
  model.save_pretrained(saved)
  tensors = _int4_experts(model, config.text_config)
  with safe_open(os.path.join(saved, "model.safetensors"), "np") as f:
    for name in f.keys():
      released = name.replace("language_model.model.blocks.", "language_model.model.layers.")
      if ".mlp.experts." not in released:
        tensors[released] = f.get_tensor(name)
  folder = str(tmp_path_factory.mktemp("k25_int4"))
  safetensors_io.write(os.path.join(folder, "model.safetensors"), tensors)
  with open(os.path.join(saved, "config.json")) as f:
    hf_config = json.load(f)
  hf_config["text_config"]["quantization_config"] = int4.quantization_config(INT4_GROUP)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(hf_config, f)
  return folder, model


def _chats(folder: str) -> str:
  """240 chats as JSONL: a quarter call the declared python tool twice and answer, a quarter ask a
  red or blue PNG's colour, the rest are sums."""
  red, blue = _image(os.path.join(folder, "red.png"), (255, 0, 0)), _image(os.path.join(folder, "blue.png"), (0, 0, 255))
  rng = np.random.default_rng(0)
  records = []
  for i in range(240):
    a, b = (int(x) for x in rng.integers(10, 99, 2))
    if i % 4 == 0:
      records.append(_tool_chat(a, b))
    elif i % 4 == 1:
      records.append(_image_chat(red, "red") if i % 8 == 1 else _image_chat(blue, "blue"))
    else:
      records.append({"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]})
  return _write_jsonl(os.path.join(folder, "chats.jsonl"), records)


@pytest.mark.slow
def test_an_int4_k25_folder_fine_tuned_on_chats_with_images_exports_back_to_transformers(int4_folder, tmp_path):
  from k25jax.data import chat_formats
  from k25jax.train import model_record
  folder, original = int4_folder
  run = tmp_path / "run"
  # LLVM at the tests' level 1, not the compile-bound 0: most of this run is its 40 steps of 512-token
  # rows (103 CPU-s at level 1 against 126 at level 0, the command alone)
  command = subprocess.run([sys.executable, "-m", "k25jax.main", "--config=configs/sft.py:tiny,files",
                            f"--config.init.hf_checkpoint={folder}", f"--config.data.files={_chats(str(tmp_path))}",
                            "--config.data.eval_every=8", "--config.train.steps=40", "--config.train.batch=8",
                            "--config.train.visual_batch=8", "--config.train.log_every=10", f"--workdir={run}"],
                           cwd=CHECKOUT, env=subprocess_env(), capture_output=True, text=True,
                           timeout=900)
  assert command.returncode == 0, command.stderr[-3000:]
  with open(run / "sft_eval.json") as f:
    result = json.load(f)
  assert result["chats"] == 210 and result["held_out_chats"] == 30
  assert result["end"]["loss"] < 0.5 * result["start"]["loss"], result
  assert result["end"]["accuracy"] > result["start"]["accuracy"] + 0.3, result
  assert model_record.read(str(run))[1] == chat_formats.K25_RECORD
  config = load_config("configs/sft.py", "tiny,files")
  config.init.hf_checkpoint = folder
  config_utils.model_section_from_hf(config)
  model = k25.K25(config_utils.k25_config_from(config.model, TOK))
  cfg = model.cfg
  params = jax.device_get(trainer_lib.restore_params(model, str(run), sharding.make_mesh(config.mesh.to_dict())))
  out = hf_export.export(str(run), str(tmp_path / "hf"))
  reloaded = Kimi_K25ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()

  # a prompt in the format SFT trained on, with an image: the exported template renders it too
  image = vision_data.preprocess_image(os.path.join(tmp_path, "red.png"), max_patches=16)
  messages = [{"role": "user", "content": [{"type": "image", "tokens": image.num_tokens},
                                           {"type": "text", "text": "Which colour?"}]}]
  prompt, _ = chat.render_ids(TOK, messages, add_generation_prompt=True)
  text_prompt, _ = chat.render_ids(TOK, [{"role": "user", "content": "12+34="}], add_generation_prompt=True)
  template = AutoTokenizer.from_pretrained(out).apply_chat_template([{"role": "user", "content": "12+34="}],
                                                                   add_generation_prompt=True, tokenize=True)
  assert list(template if isinstance(template, list) else template["input_ids"]) == text_prompt

  tokens = np.array([prompt], np.int32)
  forward = jax.jit(lambda p: model.apply({"params": p}, tokens, image.pixel_values, (image.grid_thw,)))
  ours, aux = forward(params)
  assert not bool(aux["media_mismatch"])
  hf_inputs = dict(pixel_values=torch.from_numpy(image.pixel_values), image_grid_thw=torch.tensor([image.grid_thw]))
  with torch.no_grad():
    theirs = reloaded(torch.from_numpy(tokens.astype(np.int64)), **hf_inputs).logits.numpy()
    before = original(torch.from_numpy(tokens.astype(np.int64)), **hf_inputs).logits.numpy()
  np.testing.assert_allclose(theirs, np.asarray(ours), atol=1e-5, rtol=0)
  assert np.abs(theirs - before).max() > 1e-3                      # it trained
  loaded_cfg, loaded = hf.load(folder)                             # ... from the INT4 folder's weights
  assert loaded_cfg == cfg                                         # the folder's model is the run's
  start, _ = forward(loaded)
  np.testing.assert_allclose(before, np.asarray(start), atol=1e-4, rtol=0)

  # 32 greedy tokens on both sides, EOS and <|im_end|> tokens like any other
  reloaded.generation_config.eos_token_id = None
  with torch.no_grad():
    generated = reloaded.generate(torch.from_numpy(tokens.astype(np.int64)), **hf_inputs, max_new_tokens=32,
                                  do_sample=False, pad_token_id=0)[:, len(prompt):].numpy()
  assert generated.shape == (1, 32)
  greedy = sampler.SamplingConfig(max_new_tokens=32, temperature=0.0, pad_id=tokenizer_lib.PAD_ID)
  sampled = decode.decode(cfg.text, params[k25.LANGUAGE_MODEL], [prompt], jax.random.PRNGKey(0), greedy,
                          bucket_rows=False, media_for=media_rows.rows_media(cfg, params, [image]))
  np.testing.assert_array_equal(sampled["tokens"], generated)
