"""The pretrain step compiles for a TPU slice on this CPU (experiments/aot_compile.py); needs libtpu."""
import importlib.util
import math
import os
import subprocess
import sys

import jax
import pytest

from k25jax.model import transformer
from k25jax.train import config_utils, optimizer, sharding, trainer as trainer_lib

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed (pip install -e '.[tpu]'): it is the TPU compiler, no TPU needed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Quicker compiles: the test checks what is compiled, not how well it is scheduled.
LOW_EFFORT = {"exec_time_optimization_effort": -1.0, "memory_fitting_effort": -1.0}


def test_small_preset_train_step_compiles_for_v5p_2x2x1(monkeypatch):
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")      # other test processes may hold libtpu's lock
  monkeypatch.syspath_prepend(os.path.join(ROOT, "experiments"))
  import aot_compile
  from jax.experimental import topologies

  config = config_utils.load_config_file(os.path.join(ROOT, "configs", "pretrain.py"), "small")
  config_utils.apply_overrides(config, [
      "model.num_hidden_layers=2", "model.scan_layers=True", "model.moe_impl=ragged_dot",
      "optimizer.name=muonclip", "train.batch=8", "train.seq_len=256"])
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
  model = transformer.Transformer(aot_compile.target_model_config(config.model, "tpu"))
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  inputs = (trainer_lib.state_target(model, tx, mesh), aot_compile.abstract_batch(8, 256, mesh))
  shard_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(inputs))
  assert shard_bytes <= row["argument_bytes"] < 1.1 * shard_bytes, (row["argument_bytes"], shard_bytes)


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


def test_a_layout_that_fails_exits_non_zero_and_writes_nothing():
  committed = os.path.join(ROOT, "experiments", "results", "aot_compile.json")
  before = open(committed).read()
  failed = _script("--mesh=fsdp=3")                                # 3 does not divide the 4 chips
  assert failed.returncode == 1 and "fsdp=3" in failed.stdout and "failed" in failed.stdout, failed.stderr[-3000:]
  assert "nothing written" in failed.stderr and open(committed).read() == before
