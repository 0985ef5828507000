"""A checkpoint that disagrees with its config, or is malformed, fails naming the file and
the tensor; nothing is cast but float → float."""
import json
import os
import shutil
import struct
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import linen as nn

from hf_fixtures import random_hf_model, tiny_hf_config
from k25jax.convert import hf, int4, safetensors_io
from k25jax.model import k25, transformer
from k25jax.model.config import K25Config, ModelConfig, VisionConfig


@pytest.fixture(scope="module")
def state():
  hf_cfg = tiny_hf_config()
  model = random_hf_model(hf_cfg)
  tensors = {}
  for name, value in model.state_dict().items():
    tensors[name] = value.float().numpy()
  return hf_cfg.to_dict(), tensors


def _write(path, config, tensors):
  safetensors_io.write(str(path / "model.safetensors"), tensors)
  (path / "config.json").write_text(json.dumps(config))


def test_wrong_shape_names_tensor(tmp_path, state):
  config, tensors = dict(state[0]), dict(state[1])
  tensors["model.layers.0.self_attn.kv_b_proj.weight"] = np.zeros((3, 8), np.float32)
  _write(tmp_path, config, tensors)
  with pytest.raises(hf.CheckpointError, match=r"model\.layers\.0\.self_attn\.kv_b_proj\.weight"):
    hf.load(str(tmp_path))


def test_config_disagreeing_with_weights_names_tensor(tmp_path, state):
  config, tensors = dict(state[0]), state[1]
  config["hidden_size"] = 40
  _write(tmp_path, config, tensors)
  with pytest.raises(hf.CheckpointError, match=r"tensor '(lm_head|model\.[\w.]+)\.weight' has shape"):
    hf.load(str(tmp_path))


def test_missing_tensor_is_named(tmp_path, state):
  config, tensors = state[0], dict(state[1])
  del tensors["model.layers.2.post_attention_layernorm.weight"]
  _write(tmp_path, config, tensors)
  with pytest.raises(hf.CheckpointError, match=r"model\.layers\.2\.post_attention_layernorm\.weight"):
    hf.load(str(tmp_path))


def test_unknown_tensor_is_named(tmp_path, state):
  config, tensors = state[0], dict(state[1])
  tensors["model.layers.1.mlp.mystery.weight"] = np.zeros((2, 2), np.float32)
  _write(tmp_path, config, tensors)
  with pytest.raises(hf.CheckpointError, match=r"model\.layers\.1\.mlp\.mystery\.weight"):
    hf.load(str(tmp_path))


def test_truncated_file_is_named(tmp_path, state):
  config, tensors = state
  _write(tmp_path, config, tensors)
  path = tmp_path / "model.safetensors"
  path.write_bytes(path.read_bytes()[:-64])
  with pytest.raises(ValueError, match="truncated: tensor .* ends at byte"):
    hf.load(str(tmp_path))


# ---------------------------------------------------------------------------------------
# Bad input (issue 16): a checkpoint written by `hf.save`, then damaged. Every error is a
# CheckpointError naming the file (and the tensor); nothing is cast but float → float.

Q_A = "model.layers.0.self_attn.q_a_proj.weight"
EMBED = "model.embed_tokens.weight"
GROUP = 16   # the INT4 group size: the tiny experts' input dims are 32 and 16


def _random_params(abstract, seed=0):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda b: rng.normal(size=b.shape).astype(np.float32), nn.meta.unbox(abstract))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A tiny K2 checkpoint written by hf.save: (folder, cfg, params)."""
  cfg = ModelConfig.from_hf_dict(tiny_hf_config().to_dict())
  params = _random_params(transformer.abstract_params(cfg))
  path = tmp_path_factory.mktemp("saved")
  hf.save(cfg, params, str(path))
  return path, cfg, params


@pytest.fixture
def ckpt(tmp_path, saved):
  """A fresh copy of the saved checkpoint, to damage."""
  shutil.copytree(saved[0], tmp_path / "ckpt")
  return tmp_path / "ckpt"


def _tensors(file):
  f = safetensors_io.SafetensorsFile(str(file))
  return {name: np.array(f.get(name)) for name in f.keys()}


def _edit(folder, edit, file="model.safetensors"):
  """Rewrites one safetensors file of `folder` with edit(tensors) applied (a well-formed file)."""
  path = folder / file
  tensors = _tensors(path)
  edit(tensors)
  safetensors_io.write(str(path), tensors, {"format": "pt"})
  return path


def _edit_header(folder, edit, file="model.safetensors"):
  """Rewrites the JSON header of one file with edit(header dict) applied, the data as it was."""
  path = folder / file
  raw = path.read_bytes()
  (size,) = struct.unpack("<Q", raw[:8])
  header = json.loads(raw[8:8 + size])
  edit(header)
  blob = json.dumps(header).encode()
  path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + size:])
  return path


def _load_fails(folder, *needles, error=hf.CheckpointError, **kwargs):
  """hf.load(folder) raises `error` whose message holds every needle; returns the message."""
  with pytest.raises(error) as info:
    hf.load(str(folder), **kwargs)
  message = str(info.value)
  for needle in needles:
    assert str(needle) in message, message
  return message


@pytest.mark.parametrize("name", [Q_A, "model.layers.1.mlp.experts.3.up_proj.weight",
                                  "model.layers.2.mlp.gate.e_score_correction_bias", "model.norm.weight"])
def test_float_bits_stored_as_int32_are_refused(ckpt, name):
  """The same bytes with an integer dtype: refused, not cast."""
  path = _edit(ckpt, lambda t: t.update({name: t[name].view(np.int32)}))
  _load_fails(ckpt, path, repr(name), "stored as I32", "float parameter")


def test_bool_embedding_is_refused(ckpt):
  path = _edit(ckpt, lambda t: t.update({EMBED: t[EMBED] > 0}))
  _load_fails(ckpt, path, repr(EMBED), "stored as BOOL")


@pytest.mark.parametrize("dtype, stored", [(np.int16, "I16"), (np.uint8, "U8"), (np.int64, "I64"),
                                           (ml_dtypes.float8_e4m3fn, "F8_E4M3")])
def test_other_dtypes_that_cannot_hold_a_float_parameter_are_refused(ckpt, dtype, stored):
  path = _edit(ckpt, lambda t: t.update({Q_A: t[Q_A].astype(dtype)}))
  message = _load_fails(ckpt, path, repr(Q_A), f"stored as {stored}")
  if stored.startswith("F8"):
    assert "FP8" in message


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_float_dtypes_load_rounded(ckpt, saved, dtype):
  _edit(ckpt, lambda t: t.update({Q_A: t[Q_A].astype(dtype)}))
  _, params = hf.load(str(ckpt))
  want = saved[2]["layers_0"]["self_attn"]["q_a_proj"]["kernel"].astype(dtype).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(params["layers_0"]["self_attn"]["q_a_proj"]["kernel"]), want)


def test_skipped_tensors_are_not_checked(ckpt):
  """A multi-token-prediction layer (not loaded) may be in any dtype, F8 as released."""
  _edit(ckpt, lambda t: t.update({"model.layers.3.mlp.gate.weight": np.zeros((8, 32), ml_dtypes.float8_e4m3fn)}))
  hf.load(str(ckpt))


def test_garbage_header_names_the_file(ckpt):
  path = ckpt / "model.safetensors"
  raw = path.read_bytes()
  (size,) = struct.unpack("<Q", raw[:8])
  path.write_bytes(raw[:8] + b"\x89this is no JSON".ljust(size, b"!") + raw[8 + size:])
  _load_fails(ckpt, path, "header is not valid JSON")


def test_header_size_bigger_than_the_file_is_refused_before_reading(ckpt):
  path = ckpt / "model.safetensors"
  raw = path.read_bytes()
  path.write_bytes(struct.pack("<Q", 8 << 30) + raw[8:])
  tracemalloc.start()
  try:
    with pytest.raises(hf.CheckpointError, match="header size field says 8589934592 bytes"):
      safetensors_io.SafetensorsFile(str(path))
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert peak < 16 << 20, peak   # the 8 GiB were never asked for
  _load_fails(ckpt, path, "8589934592", f"the file has {len(raw) - 8} after it")


def test_file_shorter_than_the_header_size_is_named(ckpt):
  path = ckpt / "model.safetensors"
  path.write_bytes(b"\x01\x02")
  _load_fails(ckpt, path, "fewer than the 8")


@pytest.mark.parametrize("edit, needle", [
    (lambda h: h.__setitem__(Q_A, {**h[Q_A], "data_offsets": [(1 << 40) + o for o in h[Q_A]["data_offsets"]]}),
     "truncated: tensor"),
    (lambda h: h.__setitem__(Q_A, {**h[Q_A], "shape": [16, 31]}), "bytes, its shape [16, 31]"),
    (lambda h: h.__setitem__(Q_A, {**h[Q_A], "shape": [-16, -32]}), "not a list of non-negative integers"),
    (lambda h: h.__setitem__(Q_A, {**h[Q_A], "data_offsets": [8, 4]}), "not [begin, end]"),
    (lambda h: h.__setitem__(Q_A, {**h[Q_A], "dtype": 7}), "is not a string"),
    (lambda h: h.__setitem__(Q_A, [1, 2]), "header entry needs"),
    (lambda h: h.__setitem__(Q_A, {**h[Q_A], "dtype": "U16"}), "stored as U16"),
])
def test_malformed_header_entry_names_file_and_tensor(ckpt, edit, needle):
  path = _edit_header(ckpt, edit)
  _load_fails(ckpt, path, repr(Q_A), needle)


def test_header_not_an_object_names_the_file(ckpt):
  path = ckpt / "model.safetensors"
  raw = path.read_bytes()
  (size,) = struct.unpack("<Q", raw[:8])
  path.write_bytes(raw[:8] + b"[1, 2]".ljust(size) + raw[8 + size:])
  _load_fails(ckpt, path, "JSON list")


def test_corrupt_config_json_names_the_file(ckpt):
  (ckpt / "config.json").write_text('{"hidden_size": 32,')
  _load_fails(ckpt, ckpt / "config.json", "not valid JSON")
  (ckpt / "config.json").write_text("[]")
  _load_fails(ckpt, ckpt / "config.json", "JSON list")
  with pytest.raises(hf.CheckpointError, match="config.json"):
    hf.load_config(str(ckpt))


@pytest.mark.parametrize("field, value", [("num_attention_heads", 0), ("hidden_size", "32"),
                                          ("rope_parameters", [1])])
def test_config_json_with_a_bad_field_names_the_file(ckpt, field, value):
  config = json.loads((ckpt / "config.json").read_text())
  config[field] = value
  (ckpt / "config.json").write_text(json.dumps(config))
  _load_fails(ckpt, ckpt / "config.json", "does not make a valid config")


def test_transposed_q_a_proj_shows_the_stored_and_expected_shapes(ckpt, saved):
  cfg = saved[1]
  path = _edit(ckpt, lambda t: t.update({Q_A: np.ascontiguousarray(t[Q_A].T)}))
  stored, want = (cfg.hidden_size, cfg.q_lora_rank), (cfg.q_lora_rank, cfg.hidden_size)
  assert stored != want
  _load_fails(ckpt, path, repr(Q_A), f"has shape {stored}, this config expects {want}")


@pytest.mark.parametrize("name, bad, want", [
    ("model.layers.0.self_attn.q_b_proj.weight", (48, 15), (48, 16)),       # a per-head projection
    ("model.layers.0.self_attn.o_proj.weight", (2, 4, 8), (32, 32)),        # 3-D where 2-D is stored
    ("model.layers.1.mlp.experts.2.down_proj.weight", (16, 32), (32, 16)),  # an expert, transposed
    ("model.embed_tokens.weight", (96, 31), (96, 32)),
])
def test_wrong_shapes_show_the_checkpoint_layout(ckpt, name, bad, want):
  path = _edit(ckpt, lambda t: t.update({name: np.zeros(bad, np.float32)}))
  _load_fails(ckpt, path, repr(name), f"has shape {bad}, this config expects {want}")


def test_name_without_a_leaf_has_no_place(ckpt):
  path = _edit(ckpt, lambda t: t.update({"model.layers.0.self_attn": np.zeros(2, np.float32)}))
  _load_fails(ckpt, path, "'model.layers.0.self_attn'", "has no place")


def test_duplicates_name_both_files(ckpt):
  name = "model.layers.1.mlp.experts.5.gate_proj.weight"
  tensors = _tensors(ckpt / "model.safetensors")
  safetensors_io.write(str(ckpt / "more.safetensors"), {name: tensors[name], Q_A: tensors[Q_A]})
  message = _load_fails(ckpt, ckpt / "model.safetensors", ckpt / "more.safetensors", "duplicates")
  assert repr(name) in message or repr(Q_A) in message


def test_missing_tensor_names_the_folder(ckpt):
  _edit(ckpt, lambda t: t.pop("model.norm.weight"))
  _load_fails(ckpt, f"{ckpt}: missing tensor", "model.norm.weight")


def test_sharded_index_errors_name_the_index(tmp_path, saved):
  _, cfg, params = saved
  folder = tmp_path / "sharded"
  hf.save(cfg, params, str(folder), max_shard_bytes=64 << 10)
  index = folder / "model.safetensors.index.json"
  good = json.loads(index.read_text())
  assert len(set(good["weight_map"].values())) > 1
  shard = sorted(set(good["weight_map"].values()))[-1]
  os.rename(folder / shard, tmp_path / shard)
  _load_fails(folder, index, repr(shard), "missing", error=FileNotFoundError)
  os.rename(tmp_path / shard, folder / shard)
  index.write_text(json.dumps({"weight_map": {Q_A: "../" + shard}}))
  _load_fails(folder, index, "outside")
  index.write_text("{weight_map")
  _load_fails(folder, index, "not a safetensors index")
  index.write_text(json.dumps({"weight_map": [1]}))
  _load_fails(folder, index, "weight_map")


# ------------------------------------------------------------ INT4 pack-quantized experts
def _quantize(tensors, cfg, zero_points=None):
  """Routed experts → the released INT4 form (group GROUP); returns their dequantized weights."""
  dequantized = {}
  for name in [n for n in tensors if ".mlp.experts." in n]:
    w = tensors.pop(name)
    packed, scale = int4.quantize(w, GROUP)
    module = name[:-len(".weight")]
    tensors.update({module + ".weight_packed": packed, module + ".weight_scale": scale.astype(ml_dtypes.bfloat16),
                    module + ".weight_shape": np.array(w.shape, np.int64)})
    zp = None
    if zero_points is not None:
      zp = zero_points(module, w.shape)
      tensors[module + ".weight_zero_point"] = zp
    dequantized[name] = int4.dequantize(packed, scale.astype(ml_dtypes.bfloat16), w.shape, zp, GROUP)
  return dequantized


def _quant_config(folder, symmetric=True):
  config = json.loads((folder / "config.json").read_text())
  config["quantization_config"] = {
      "format": "pack-quantized", "quant_method": "compressed-tensors",
      "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": GROUP, "symmetric": symmetric}}}}
  (folder / "config.json").write_text(json.dumps(config))


def _expert(params, name):
  parts = name.split(".")
  return np.asarray(params[f"layers_{parts[2]}"]["mlp"]["experts"][parts[6]][int(parts[5])])


def test_int4_checkpoint_loads(ckpt, saved):
  """The released form (weight_packed I32, weight_scale BF16, weight_shape I64) still loads."""
  dequantized = {}
  _edit(ckpt, lambda t: dequantized.update(_quantize(t, saved[1])))
  _quant_config(ckpt)
  _, params = hf.load(str(ckpt))
  for name, w in dequantized.items():
    np.testing.assert_array_equal(_expert(params, name), w.T, err_msg=name)


def test_int4_packed_zero_points_load(ckpt, saved):
  """Asymmetric: zero points as compressed-tensors packs them (int32, 8 rows a word)."""
  ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
  torch = pytest.importorskip("torch")
  rng = np.random.default_rng(5)

  def zero_points(module, shape):
    zp = rng.integers(-2, 3, size=(shape[0], shape[1] // GROUP)).astype(np.int8)
    return ct.pack_to_int32(torch.from_numpy(zp), 4, packed_dim=0).numpy()

  dequantized = {}
  _edit(ckpt, lambda t: dequantized.update(_quantize(t, saved[1], zero_points)))
  _quant_config(ckpt, symmetric=False)
  _, params = hf.load(str(ckpt))
  name = "model.layers.1.mlp.experts.0.gate_proj.weight"
  unpacked = int4.unpack(np.ascontiguousarray(
      _tensors(ckpt / "model.safetensors")[name[:-7] + ".weight_zero_point"].T), 16).T
  assert unpacked.any()
  for name, w in dequantized.items():
    np.testing.assert_array_equal(_expert(params, name), w.T, err_msg=name)


MODULE = "model.layers.1.mlp.experts.2.gate_proj"


@pytest.mark.parametrize("part, change, needles", [
    ("weight_packed", lambda x: x.view(np.float32), ["stored as F32", "weight_packed"]),
    ("weight_packed", lambda x: x.view(np.uint8), ["stored as U8"]),
    ("weight_scale", lambda x: x.view(np.int16), ["stored as I16", "weight_scale"]),
    ("weight_shape", lambda x: x.astype(np.float32), ["stored as F32", "weight_shape"]),
    ("weight_shape", lambda x: x[::-1].copy(), ["INT4-quantized", "packed shape"]),
    ("weight_shape", lambda x: np.array([16, 32, 1]), ["INT4-quantized", "weight_shape"]),
    ("weight_scale", lambda x: x[:, :1].copy(), ["INT4-quantized", "scale shape"]),
    ("weight_packed", lambda x: x[:, :2].copy(), ["INT4-quantized", "packed shape"]),
    ("weight_scale", None, ["incomplete", "weight_packed", "weight_shape"]),
])
def test_damaged_int4_parts_name_file_and_module(ckpt, saved, part, change, needles):
  name = f"{MODULE}.{part}"

  def damage(tensors):
    _quantize(tensors, saved[1])
    if change is None:
      del tensors[name]
    else:
      tensors[name] = change(tensors[name])

  path = _edit(ckpt, damage)
  _quant_config(ckpt)
  message = _load_fails(ckpt, path, *needles)
  assert MODULE in message, message


def test_int4_weight_of_the_wrong_shape_shows_it(ckpt, saved):
  def damage(tensors):
    _quantize(tensors, saved[1])
    packed, scale = int4.quantize(np.ones((16, 48), np.float32), GROUP)
    tensors.update({f"{MODULE}.weight_packed": packed, f"{MODULE}.weight_scale": scale,
                    f"{MODULE}.weight_shape": np.array([16, 48])})

  path = _edit(ckpt, damage)
  _quant_config(ckpt)
  _load_fails(ckpt, path, f"{MODULE}.weight_*", "has shape (16, 48), this config expects (16, 32)")


# -------------------------------------------------------------- the K2.5 vision tower
@pytest.fixture(scope="module")
def saved_k25(tmp_path_factory):
  text = ModelConfig.from_hf_dict(tiny_hf_config(num_hidden_layers=2).to_dict())
  vision = VisionConfig(patch_size=14, pos_emb_height=8, pos_emb_width=8, num_attention_heads=2,
                        num_hidden_layers=1, hidden_size=32, intermediate_size=48)
  cfg = K25Config(text=text, vision=vision, projection_hidden_size=32, image_token_id=90,
                  video_token_id=91, vision_start_token_id=88, vision_end_token_id=89)
  path = tmp_path_factory.mktemp("k25")
  hf.save(cfg, _random_params(k25.abstract_params(cfg)), str(path))
  return path


@pytest.fixture
def k25_ckpt(tmp_path, saved_k25):
  shutil.copytree(saved_k25, tmp_path / "k25")
  return tmp_path / "k25"


def test_k25_checkpoint_loads(k25_ckpt):
  cfg, params = hf.load(str(k25_ckpt))
  assert isinstance(cfg, K25Config) and set(params) == {hf.hf_vision.TEXT, hf.hf_vision.VISION,
                                                        hf.hf_vision.PROJECTOR}


@pytest.mark.parametrize("name, change, needles", [
    ("vision_tower.encoder.blocks.0.wqkv.weight", lambda x: x.view(np.int32), ["stored as I32"]),
    ("mm_projector.pre_norm.weight", lambda x: x > 0, ["stored as BOOL"]),
    ("mm_projector.proj.2.weight", lambda x: np.ascontiguousarray(x.T),
     ["has shape (128, 32), this config expects (32, 128)"]),
    ("vision_tower.patch_embed.proj.weight", lambda x: x.reshape(32, 3, -1),
     ["has shape (32, 3, 196), this config expects (32, 3, 14, 14)"]),
    ("vision_tower.encoder.blocks.0.wo.weight", lambda x: x[:, :16].copy(),
     ["has shape (32, 16), this config expects (32, 32)"]),
])
def test_damaged_vision_tensors_name_file_and_tensor(k25_ckpt, name, change, needles):
  path = _edit(k25_ckpt, lambda t: t.update({name: change(t[name])}))
  _load_fails(k25_ckpt, path, repr(name), *needles)


def test_missing_vision_tensor_names_the_folder(k25_ckpt):
  _edit(k25_ckpt, lambda t: t.pop("mm_projector.proj.0.bias"))
  _load_fails(k25_ckpt, f"{k25_ckpt}: missing tensor", "mm_projector.proj.0.bias")


def test_native_qkv_part_of_the_wrong_shape_is_named(k25_ckpt):
  def native(tensors):
    for leaf in ("weight", "bias"):
      fused = tensors.pop(f"vision_tower.encoder.blocks.0.wqkv.{leaf}")
      for which, rows in zip("qkv", np.split(fused, 3)):
        tensors[f"model.vision_tower.layers.0.attn.{which}_proj.{leaf}"] = rows
    tensors["model.vision_tower.layers.0.attn.k_proj.weight"] = np.zeros((32, 30), np.float32)

  path = _edit(k25_ckpt, native)
  _load_fails(k25_ckpt, path, "'model.vision_tower.layers.0.attn.k_proj.weight'",
              "has shape (32, 30), this config expects (32, 32)")
