"""The pod presets run the released model: midtrain:k25 (32K rows, switch 262k) and rl:k25."""
import pytest

from config_files import load_config
from k25jax.data import tokenizer
from k25jax.model import config as model_config
from k25jax.stages import midtrain
from k25jax.train import config_utils, sharding

RELEASED = model_config.preset("k25")
POD = 512   # a v5p 8x8x8
TOKENS_A_CHIP = 8192


def _released_but_ours(cfg: model_config.ModelConfig) -> model_config.ModelConfig:
  """`cfg` with the fields of ours (compute paths, not the checkpoint's) set as in the released preset."""
  return cfg.replace(**{name: getattr(RELEASED, name) for name in model_config.OURS})


def _row_split(mesh: dict, rows: int, width: int) -> tuple[int, int]:
  """(rows of a batch shard, tokens of each that a chip holds) on the pod."""
  data, fsdp, expert, sequence, _ = sharding.mesh_shape(mesh, POD)
  shards = data * fsdp * expert
  assert rows % shards == 0 and width % sequence == 0
  return rows // shards, width // sequence


@pytest.mark.parametrize("arg, seq_len", [("k25", 32768), ("k25,262k", 262144)])
def test_midtrain_k25_is_the_released_model_with_its_yarn(arg, seq_len):
  config = load_config("configs/midtrain.py", arg)
  cfg = midtrain.long_context_model(config, tokenizer.load("bytes", media=True)).text
  assert _released_but_ours(cfg) == RELEASED                      # YaRN factor 64 over 4096: 262,144 positions
  assert cfg.attention_impl == "pallas" and cfg.scan_layers and cfg.remat_policy == "full"
  assert config.train.seq_len == seq_len and config.train.batch * seq_len == 1024 * 4096   # pretrain:k25's tokens
  rows, tokens = _row_split(config.mesh.to_dict(), config.train.batch, seq_len)
  assert rows * tokens == TOKENS_A_CHIP


def test_the_262k_switch_is_for_the_k25_preset():
  with pytest.raises(ValueError, match="262k switch is for the k25 preset"):
    load_config("configs/midtrain.py", "tiny,262k")


def test_rl_k25_updates_the_released_model_on_rows_of_its_longest_responses():
  config = load_config("configs/rl.py", "k25")
  cfg = config_utils.model_config_from(config.model)
  assert _released_but_ours(cfg) == RELEASED and cfg.attention_impl == "pallas"
  rl = config.rl
  rows = rl.prompts_per_iteration * rl.num_generations // rl.minibatches
  assert rows % rl.num_generations == 0                         # an update holds whole groups
  rows, tokens = _row_split(config.mesh.to_dict(), rows, rl.max_new_tokens)
  assert rows * tokens == TOKENS_A_CHIP


def test_pretrain_k25_joint_is_the_released_k25_with_media_sharded_over_the_pod():
  config = load_config("configs/pretrain.py", "k25,joint")
  cfg = config_utils.k25_config_from(config.model, tokenizer.load("bytes", media=True))
  assert _released_but_ours(cfg.text) == RELEASED
  assert cfg.vision.replace(attention_impl="xla") == model_config.k25_preset("k25").vision
  assert cfg.vision.attention_impl == "pallas" and config.data.shard_media and config.data.vision_ratio == 0.1
  assert config.train.batch * config.train.seq_len >= 2 * 1024 * 1024
  data, fsdp, expert, _, _ = sharding.mesh_shape(config.mesh.to_dict(), POD)
  assert config.data.max_patches // (data * fsdp * expert) == 4096           # patches a data shard encodes
  assert config.optimizer.name == "muonclip"
  with pytest.raises(ValueError, match="joint switch is for the k25 preset"):
    load_config("configs/pretrain.py", "tiny,joint")
