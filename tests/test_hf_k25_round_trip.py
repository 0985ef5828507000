"""A Kimi K2.5 folder through SFT and back out: a tiny random Kimi_K25ForConditionalGeneration
saved by transformers with its routed experts pack-quantized to INT4 as released →
`init.hf_checkpoint` → 20 steps of SFT on chats with images (`configs/sft.py:tiny,files`) →
`k25jax.export` → `Kimi_K25ForConditionalGeneration.from_pretrained`: the logits with an image
in the prompt equal k25jax's on the trained params, transformers' greedy generation equals the
k25jax sampler's token for token over 32 new tokens, and the exported chat template renders the
prompt k25jax trained on."""
import json
import os

import jax
import numpy as np
import pytest
import torch
from config_files import load_config
from PIL import Image
from safetensors import safe_open
from transformers import AutoTokenizer, Kimi_K25ForConditionalGeneration

from k25jax.convert import hf, int4, safetensors_io
from k25jax.data import chat, tokenizer as tokenizer_lib, vision as vision_data
from k25jax.model import k25
from k25jax.rl import decode, sampler
from k25jax.train import config_utils, hf_export
from test_vision_parity import random_k25_model, tiny_k25_hf_config

TOK = tokenizer_lib.ByteTokenizer(media=True, chat=True)
INT4_GROUP = 16        # the tiny experts' 32 input columns (hidden) hold 2 groups, moe_intermediate's 16 one


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
  config = tiny_k25_hf_config(text={"vocab_size": 288, "max_position_embeddings": 256}, image_token_id=media.pad,
                              video_token_id=TOK.vocab_size, vision_start_token_id=media.begin,
                              vision_end_token_id=media.end)
  model = random_k25_model(seed=5, config=config)
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
  """64 chats asking an image's colour (a red or blue PNG) and 64 sums, as JSONL."""
  for name, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
    pixels = np.zeros((28, 28, 3), np.uint8)
    pixels[:] = colour
    Image.fromarray(pixels).save(os.path.join(folder, f"{name}.png"))
  rng = np.random.default_rng(0)
  path = os.path.join(folder, "chats.jsonl")
  with open(path, "w") as f:
    for i in range(128):
      a, b = (int(x) for x in rng.integers(10, 99, 2))
      colour = ("red", "blue")[i % 4 // 2]
      messages = ([{"role": "user", "content": [{"type": "image", "image": f"{colour}.png"},
                                                {"type": "text", "text": "Which colour?"}]},
                   {"role": "assistant", "content": colour}] if i % 2 else
                  [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}])
      f.write(json.dumps({"messages": messages}) + "\n")
  return path


@pytest.mark.slow
def test_an_int4_k25_folder_fine_tuned_on_chats_with_images_exports_back_to_transformers(int4_folder, tmp_path):
  from k25jax.agents import tool_rollout
  from k25jax.stages import sft
  folder, original = int4_folder
  config = load_config("configs/sft.py", "tiny,files")
  config.init.hf_checkpoint = folder
  config_utils.model_section_from_hf(config)
  config.data.update(files=_chats(str(tmp_path)), eval_every=8, max_length=256)
  config.train.update(steps=20, batch=8, visual_batch=8, log_every=10, eval_every=20, checkpoint_every=20)
  config.optimizer.update(warmup_steps=2, decay_steps=5)
  state, history = sft.run(config, str(tmp_path / "run"))
  with open(tmp_path / "run" / "sft_eval.json") as f:
    result = json.load(f)
  assert result["end"]["loss"] < result["start"]["loss"], result
  out = hf_export.export(str(tmp_path / "run"), str(tmp_path / "hf"))
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

  cfg = k25.K25(config_utils.k25_config_from(config.model, TOK)).cfg
  params = jax.device_get(state.params)
  tokens = np.array([prompt], np.int32)
  ours, aux = k25.K25(cfg).apply({"params": params}, tokens, image.pixel_values, (image.grid_thw,))
  assert not bool(aux["media_mismatch"])
  hf_inputs = dict(pixel_values=torch.from_numpy(image.pixel_values), image_grid_thw=torch.tensor([image.grid_thw]))
  with torch.no_grad():
    theirs = reloaded(torch.from_numpy(tokens.astype(np.int64)), **hf_inputs).logits.numpy()
    before = original(torch.from_numpy(tokens.astype(np.int64)), **hf_inputs).logits.numpy()
  np.testing.assert_allclose(theirs, np.asarray(ours), atol=1e-5, rtol=0)
  assert np.abs(theirs - before).max() > 1e-3                      # it trained
  loaded_cfg, loaded = hf.load(folder)                             # ... from the INT4 folder's weights
  start, _ = k25.K25(loaded_cfg).apply({"params": loaded}, tokens, image.pixel_values, (image.grid_thw,))
  np.testing.assert_allclose(before, np.asarray(start), atol=1e-4, rtol=0)

  # 32 greedy tokens on both sides, EOS and <|im_end|> tokens like any other
  reloaded.generation_config.eos_token_id = None
  with torch.no_grad():
    generated = reloaded.generate(torch.from_numpy(tokens.astype(np.int64)), **hf_inputs, max_new_tokens=32,
                                  do_sample=False, pad_token_id=0)[:, len(prompt):].numpy()
  assert generated.shape == (1, 32)
  greedy = sampler.SamplingConfig(max_new_tokens=32, temperature=0.0, pad_id=tokenizer_lib.PAD_ID)
  sampled = decode.decode(cfg.text, params[k25.LANGUAGE_MODEL], [prompt], jax.random.PRNGKey(0), greedy,
                          bucket_rows=False, media_for=tool_rollout.rows_media(cfg, params, [image]))
  np.testing.assert_array_equal(sampled["tokens"], generated)
