"""The pretrain (text and joint), midtrain and RL steps and the sampler's decode step compile for a TPU slice on this CPU
(experiments/aot_compile.py, aot_decode.py); needs libtpu."""
import importlib.util
import math
import os
import subprocess
import sys

import jax
import pytest

from config_files import load_config
from k25jax.model import transformer
from k25jax.train import config_utils, optimizer, sharding, trainer as trainer_lib

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (pip install -e '.[tpu]'): it is the TPU compiler, no TPU needed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Quicker compiles: the test checks what is compiled, not how well it is scheduled.
LOW_EFFORT = {"exec_time_optimization_effort": -1.0, "memory_fitting_effort": -1.0}


@pytest.mark.slow
def test_small_preset_train_step_compiles_for_v5p_2x2x1(monkeypatch):
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")      # other test processes may hold libtpu's lock
  monkeypatch.syspath_prepend(os.path.join(ROOT, "experiments"))
  import aot_compile
  from jax.experimental import topologies

  config = config_utils.load_config_file(os.path.join(ROOT, "configs", "pretrain.py"), "small")
  config_utils.apply_overrides(config, [
      "model.num_hidden_layers=2", "model.scan_layers=True", "model.moe_impl=ragged_dot",
      "train.batch=4", "train.seq_len=128"])     # the same collectives as 8 x 256, 28% less compiling
  devices = topologies.get_topology_desc("v5p:2x2x1", "tpu").devices
  assert len(devices) == 4 and devices[0].platform == "tpu"
  # conftest makes "highest" the default matmul precision (fp32 parity on the CPU); Mosaic rejects an
  # fp32-contract matmul of bf16 operands in the TPU attention kernel, so compile at the TPU default.
  with jax.default_matmul_precision("default"):
    row = aot_compile.compile_step(config, devices, {"fsdp": 2, "expert": 2}, "full", LOW_EFFORT)

  assert row["model"]["ep_dispatch"] == "ragged_all_to_all"
  assert row["collectives"]["ragged-all-to-all"] >= 4         # dispatch + return, forward + backward
  assert row["fits"] and row["temp_bytes"] > 0 and row["flops_per_chip"] > 0
  # The arguments are one chip's shards of the state and the batch (TPU tiling pads a little).
  mesh = sharding.make_mesh({"fsdp": 2, "expert": 2}, devices)
  model = transformer.Transformer(aot_compile.target_model_config(config_utils.model_config_from(config.model), "tpu"))
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  inputs = (trainer_lib.state_target(model, tx, mesh), aot_compile.abstract_batch(4, 128, mesh))
  shard_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(inputs))
  assert shard_bytes <= row["argument_bytes"] < 1.1 * shard_bytes, (row["argument_bytes"], shard_bytes)


def _tiny_compile(monkeypatch, path, preset, overrides, compile_fn):
  """`compile_fn(aot module, config, v5p 2x2x1 devices)` at the TPU default precision (as above)."""
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  monkeypatch.syspath_prepend(os.path.join(ROOT, "experiments"))
  import aot_decode
  from jax.experimental import topologies
  config = config_utils.load_config_file(os.path.join(ROOT, "configs", path), preset)
  config_utils.apply_overrides(config, overrides)
  devices = topologies.get_topology_desc("v5p:2x2x1", "tpu").devices
  with jax.default_matmul_precision("default"):
    return compile_fn(aot_decode, config, devices)


POD_PATH = ("scan_layers=True", "moe_impl=ragged_dot", "attention_impl=pallas")


@pytest.mark.slow
def test_midtrain_step_compiles_with_the_flash_kernel_on_rows_split_along_sequence(monkeypatch):
  overrides = [f"model.text.{o}" for o in POD_PATH + ("num_hidden_layers=2",)] + [
      "train.batch=2", "train.seq_len=512", "long_context.original_context=128"]
  row = _tiny_compile(monkeypatch, "midtrain.py", "tiny", overrides, lambda aot, config, devices:
                      aot.aot_compile.compile_step(config, devices, {"expert": 2, "sequence": 2}, "full", LOW_EFFORT))
  assert row["fits"] and row["model"]["rope_scaling"]["factor"] == 4.0
  assert row["pallas_calls"] >= 3          # Mosaic calls: ragged_dot's and the flash kernel's (the mesh is a TPU's)
  assert row["collectives"]["all-to-all"] > 0 and row["collectives"]["ragged-all-to-all"] >= 4


@pytest.mark.slow
def test_joint_step_compiles_with_media_sharded_over_the_data_shards(monkeypatch):
  """The tiny K2.5 joint step with 4 media shards, one a chip, and the vision flash kernel:
  nothing is gathered over `data` (each chip encodes its own pixels); the gradients are
  all-reduced; the kernel compiles with Mosaic (the mesh is a TPU's, the host a CPU), its
  forward and two backward passes in each of the tower's 2 blocks."""
  overrides = ["data.shard_media=True", "model.vision.attention_impl=pallas"]
  row = _tiny_compile(monkeypatch, "pretrain.py", "joint", overrides, lambda aot, config, devices:
                      aot.aot_compile.compile_step(config, devices, {"data": 4}, "none", LOW_EFFORT))
  assert row["fits"] and row["collectives"]["all-gather"] == 0 and row["collectives"]["all-reduce"] > 0
  assert row["pallas_calls"] == 6


@pytest.mark.slow
def test_rl_update_step_compiles_for_the_driver(monkeypatch):
  overrides = [f"model.{o}" for o in POD_PATH] + ["rl.max_new_tokens=256", "rl.prompts_per_iteration=2",
                                                  "rl.minibatches=2"]
  row = _tiny_compile(monkeypatch, "rl.py", "tiny", overrides, lambda aot, config, devices:
                      aot.aot_compile.compile_step(config, devices, {"expert": 2, "sequence": 2}, "full", LOW_EFFORT))
  assert row["fits"] and row["pallas_calls"] >= 3 and row["collectives"]["ragged-all-to-all"] >= 4


@pytest.mark.slow
def test_pallas_moe_kernels_compile_with_mosaic_on_each_chips_tokens(monkeypatch):
  """moe_impl=pallas without expert parallelism (fsdp 2 × sequence 2): the routing kernel and the
  expert layer's sort and grouped matmuls run in their shard_maps on each chip's tokens, so
  Mosaic compiles them (unwrapped, it refuses to be partitioned)."""
  overrides = ["model.scan_layers=True", "model.moe_impl=pallas", "rl.max_new_tokens=256",
               "rl.prompts_per_iteration=2", "rl.minibatches=2"]
  row = _tiny_compile(monkeypatch, "rl.py", "tiny", overrides, lambda aot, config, devices:
                      aot.aot_compile.compile_step(config, devices, {"fsdp": 2, "sequence": 2}, "full", LOW_EFFORT))
  assert row["fits"] and row["model"]["moe_impl"] == "pallas" and row["pallas_calls"] >= 5


def test_decode_step_compiles_with_the_cache_split_by_rows(monkeypatch):
  row = _tiny_compile(monkeypatch, "rl.py", "tiny", [], lambda aot, config, devices:
                      aot.compile_decode(config, devices, {"data": 2, "expert": 2}, rows=8, context=64,
                                         compiler_options=LOW_EFFORT))
  cfg = config_utils.model_config_from(load_config("configs/rl.py").model)
  assert row["cache_bytes_per_token"] == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_hidden_layers * 4
  assert row["rows_per_chip"] == 2 and row["cache_bytes_per_chip"] == 2 * 64 * row["cache_bytes_per_token"]
  assert row["fits"] and row["alias_bytes"] >= row["cache_bytes_per_chip"]      # the cache is donated
  assert row["collectives"]["ragged-all-to-all"] >= 2                          # experts split over `expert`
  assert row["roofline"][0]["tokens_per_s_per_chip"] > 0


def test_decode_step_compiles_the_decode_kernel_with_mosaic_on_each_chips_rows(monkeypatch):
  """`--attention=pallas`: the latent-cache kernel in its shard_map, one Mosaic call a layer, and
  the cache never gathered (each chip reads its own 2 rows)."""
  xla = _tiny_compile(monkeypatch, "rl.py", "tiny", [], lambda aot, config, devices:
                      aot.compile_decode(config, devices, {"data": 2, "expert": 2}, rows=8, context=64,
                                         compiler_options=LOW_EFFORT))
  row = _tiny_compile(monkeypatch, "rl.py", "tiny", [], lambda aot, config, devices:
                      aot.compile_decode(config, devices, {"data": 2, "expert": 2}, rows=8, context=64,
                                         compiler_options=LOW_EFFORT, attention_impl="pallas"))
  layers = config_utils.model_config_from(load_config("configs/rl.py").model).num_hidden_layers
  assert row["model"]["attention_impl"] == "pallas" and row["fits"]
  assert row["pallas_calls"] == xla["pallas_calls"] + layers
  assert row["collectives"]["all-gather"] == xla["collectives"]["all-gather"]


def test_k25_latent_cache_is_576_numbers_a_token_and_layer(monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(ROOT, "experiments"))
  import aot_decode
  cfg = aot_decode.decode_model_config(load_config("configs/rl.py", "k25").model, "tpu")
  assert not cfg.scan_layers and cfg.attention_impl == "xla"
  assert aot_decode.cache_bytes_per_token(cfg) == 576 * 61 * 2                   # bf16


def test_mesh_axes_that_split_a_physical_axis_are_allowed(monkeypatch):
  """On a 4x4x4 torus, 32 = 4·4·2 splits a physical axis: allowed, with a warning."""
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  devices = topologies.get_topology_desc("v5p:4x4x4", "tpu").devices
  whole = sharding.make_mesh({"fsdp": 4, "expert": 16}, devices)
  split = sharding.make_mesh({"fsdp": 2, "expert": 32}, devices)
  assert (whole.shape["fsdp"], whole.shape["expert"]) == (4, 16)
  assert (split.shape["fsdp"], split.shape["expert"]) == (2, 32)
  assert sorted(d.id for d in split.devices.flat) == sorted(d.id for d in devices)


def _script(*args):
  env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu", XLA_FLAGS="")
  return subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "aot_compile.py"), "--topology=v5p:2x2x1",
                         "--config=configs/pretrain.py:small", *SMALL_OVERRIDES, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=900)


SMALL_OVERRIDES = [f"--set={o}" for o in ("model.num_hidden_layers=2", "model.scan_layers=True",
                                           "model.moe_impl=ragged_dot", "train.batch=8", "train.seq_len=256")]


def test_without_mesh_flags_the_script_compiles_the_configs_own_layout(monkeypatch):
  monkeypatch.syspath_prepend(os.path.join(ROOT, "experiments"))
  import aot_compile
  config = config_utils.load_config_file(os.path.join(ROOT, "configs", "pretrain.py"), "k25")
  assert aot_compile.requested_layouts(None, config) == [config.mesh.to_dict()]
  assert config.mesh.expert == 64 and config.mesh.fsdp == -1
  assert aot_compile.requested_layouts(["fsdp=8,expert=64"], config) == [{"fsdp": 8, "expert": 64}]


def test_vision_flops_count_the_tower_per_patch_and_the_projector_per_merged_token(monkeypatch):
  """The tiny K2.5 (2 blocks of width 64, MLP 128, 4 heads of 16; 14x14 patches; a 2x2 merge
  into a 256-wide projector) over 256 patches, counted by hand."""
  monkeypatch.syspath_prepend(os.path.join(ROOT, "experiments"))
  import aot_compile
  from k25jax.data import tokenizer
  config = config_utils.load_config_file(os.path.join(ROOT, "configs", "pretrain.py"), "joint")
  cfg = config_utils.k25_config_from(config.model, tokenizer.load("bytes", "", media=True))
  block = 64 * 128 + 128 * 64 + 4 * 16 * 64 + 64 * 3 * 4 * 16
  tower = 2 * block + 3 * 14 * 14 * 64
  projector = 2 * 256 * 256
  assert aot_compile.analytic_vision_flops(cfg, 256) == 6 * (tower * 256 + projector * 64)


def test_a_layout_that_fails_exits_non_zero_and_writes_nothing():
  committed = os.path.join(ROOT, "experiments", "results", "aot_compile.json")
  before = open(committed).read()
  failed = _script("--mesh=fsdp=3")                                # 3 does not divide the 4 chips
  assert failed.returncode == 1 and "fsdp=3" in failed.stdout and "failed" in failed.stdout, failed.stderr[-3000:]
  assert "nothing written" in failed.stderr and open(committed).read() == before
