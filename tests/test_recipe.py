"""The recipe's chain (configs/recipe.py, experiments/recipe.py): one model through every stage,
and any stage starts from a checkpoint of any earlier stage of it. The chain runs in Kimi K2.5's
chat format (`k25_format`, where the recipe is headed: its judge from mid-training, its chat
stages in the format Kimi serves); the legacy format's configs are checked beside it."""
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from config_files import load_config
from cpu_env import subprocess_env

from configs import recipe as recipe_config
from k25jax.data import legacy_chat as chat, tokenizer
from k25jax.model import k25, transformer
from k25jax.train import checkpoint, config_utils, sharding, trainer as trainer_lib

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(CHECKOUT, "experiments"))
import recipe  # noqa: E402
import recipe_probes  # noqa: E402
import recipe_seeds  # noqa: E402

LM = k25.LANGUAGE_MODEL
K25_FORMAT = True     # the chain's format (the fixture's)


def _text_rl_config():
  """configs/rl.py's text RL stage (addition in the chain's chat format) on the recipe's decoder:
  a text stage after the chain."""
  config = load_config("configs/rl.py", "tiny,k25_format" if K25_FORMAT else "tiny")
  config.model = recipe_config.model_section(False, "test", K25_FORMAT)
  return config


def _model(config):
  if "vision" in config.model:
    k25_vocab = config.model.text.vocab_size == tokenizer.ByteTokenizer(media=True, chat=True).vocab_size
    tok = tokenizer.ByteTokenizer(media=True, chat=True) if k25_vocab else chat.ChatTokenizer()
    return k25.K25(config_utils.k25_config_from(config.model, tok))
  return transformer.Transformer(config_utils.model_config_from(config.model))


def _assert_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)


def _save(path, params) -> str:
  saver = checkpoint.Checkpoints(str(path), keep=1)
  saver.save(0, {"params": params})
  saver.close()
  return str(path)


def _flat(tree, under: str | None = None) -> dict[str, np.ndarray]:
  """The leaves of `tree` (of `tree[under]`) by their key path."""
  tree = tree if under is None else tree[under]
  return {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _part(flat: dict[str, np.ndarray], under: str) -> dict[str, np.ndarray]:
  """The entries of `_flat(tree)` under `tree[under]`, keyed as `_flat(tree, under)` keys them."""
  prefix = f"['{under}']"
  return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}


def _run_chain(root: str, k25_format: bool) -> None:
  """Every stage of the test preset in order, each from the previous one's workdir, under
  `root` (joint RL's judge trained before it, in root/judge); each stage's final params (the
  trained state's, not a restore) in root/NAME.npz."""
  configs, previous, judge = recipe.stage_configs("test", k25_format=k25_format), None, None
  for name in recipe.STAGES:
    config, workdir = configs[name], os.path.join(root, name)
    if recipe.judged(config):
      judge = recipe.run_judge("test", root, k25_format=k25_format)
    recipe.start_from(config, previous, judge)
    state, _ = recipe.run_stage(name, config, workdir)
    np.savez(os.path.join(root, f"{name}.npz"), **_flat(jax.device_get(state.params)))
    previous = workdir


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
  """The chain (`_run_chain`) run in a one-device process compiling at LLVM's quickest level
  (cpu_env.COMPILE_BOUND_FLAGS; 92 CPU-s against 164 in an 8-device test process, in the legacy
  format): its workdirs and each stage's final params by key path."""
  root = tmp_path_factory.mktemp("recipe")
  out = subprocess.run([sys.executable, __file__, str(root), "k2.5" if K25_FORMAT else "legacy"],
                       env=subprocess_env(compile_bound=True, PYTHONPATH=CHECKOUT),
                       capture_output=True, text=True, timeout=1200)
  assert out.returncode == 0, out.stderr[-3000:]
  return ({name: str(root / name) for name in recipe.STAGES},
          {name: dict(np.load(root / f"{name}.npz")) for name in recipe.STAGES})


@pytest.mark.slow
def test_a_text_model_starts_from_a_k25_runs_language_model(tmp_path):
  configs = recipe.stage_configs("test")
  k25_model, text_model = _model(configs["sft"]), _model(configs["text_pretrain"])
  k25_params = jax.device_get(k25.init_params(k25_model.cfg, jax.random.PRNGKey(3)))
  text_params = jax.device_get(transformer.init_params(text_model.cfg, jax.random.PRNGKey(4)))
  k25_dir, text_dir = _save(tmp_path / "k25", k25_params), _save(tmp_path / "text", text_params)
  assert checkpoint.saved_params_keys(k25_dir) == tuple(sorted(k25_params))
  mesh = sharding.make_mesh({"data": -1})
  with jax.set_mesh(mesh):
    restored = trainer_lib.restore_params(text_model, k25_dir, mesh)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), k25_params[LM])
    lm = trainer_lib.restore_params(k25_model, text_dir, mesh, LM)   # init.text_checkpoint: a text run
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(lm), text_params)
    lm = trainer_lib.restore_params(k25_model, k25_dir, mesh, LM)    # ... or a K2.5 run's decoder
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(lm), k25_params[LM])
    with pytest.raises(ValueError, match="init.text_checkpoint"):
      trainer_lib.restore_params(k25_model, text_dir, mesh)


def test_init_from_names_the_field_the_pair_needs(tmp_path):
  configs = recipe.stage_configs("test")
  text_dir = _save(tmp_path / "text", jax.device_get(
      transformer.init_params(_model(configs["text_pretrain"]).cfg, jax.random.PRNGKey(0))))
  k25_dir = _save(tmp_path / "k25", jax.device_get(k25.init_params(_model(configs["sft"]).cfg, jax.random.PRNGKey(0))))
  vit = configs["vit"]
  recipe.init_from(vit, text_dir)
  assert (vit.init.checkpoint, vit.init.text_checkpoint) == ("", text_dir)
  recipe.init_from(vit, k25_dir)
  assert (vit.init.checkpoint, vit.init.text_checkpoint) == (k25_dir, "")
  text = _text_rl_config()
  recipe.init_from(text, k25_dir)
  assert text.init.checkpoint == k25_dir


@pytest.mark.parametrize("k25_format", [False, True], ids=["legacy", "k2.5"])
def test_the_recipe_is_one_model(k25_format):
  """Every stage's model section is the recipe's, and the tokenizers of every stage fit its
  vocabulary: the chat stages' (legacy or Kimi K2.5's chat tokens) with the pre-training
  stages' bytes and media ids a prefix of it."""
  for preset in ("tiny", "test"):
    configs = recipe.stage_configs(preset, k25_format=k25_format)
    text = configs["text_pretrain"].model.to_dict()
    text.pop("preset")
    for name in recipe.STAGES[1:]:
      k25_stage = name in recipe_config.K25_STAGES
      fields = (configs[name].model.text if k25_stage else configs[name].model).to_dict()
      fields.pop("preset", None)
      changed = {k for k in fields if fields[k] != text[k]}
      after_midtrain = recipe.STAGES.index(name) > recipe.STAGES.index("midtrain")
      expected = {"rope_scaling", "max_position_embeddings"} if after_midtrain else set()
      assert changed == expected, (name, changed)
      assert not k25_stage or configs[name].model.vision == configs["vit"].model.vision
    chat_tok = recipe.chat_tokenizer(configs)
    assert tokenizer.ByteTokenizer(media=True).vocab_size <= chat_tok.vocab_size == text["vocab_size"]
    assert chat_tok.media == tokenizer.ByteTokenizer(media=True).media
    chat_stages = ("sft", "joint_rl")
    assert {configs[name].data.chat_format if name == "sft" else configs[name].task.chat_format
            for name in chat_stages} == {"k2.5" if k25_format else "legacy"}
    assert configs["parl"].parl.rendering == ("k2.5" if k25_format else "chat")


def test_the_k25_format_judge_is_the_chains_model_from_midtraining(monkeypatch, tmp_path):
  """In Kimi K2.5's format the judge is the chain's K2.5 model (its vocabulary, mid-training's
  rope) and trains from mid-training's run; in the legacy format its own model from a fresh
  init. A second chain sharing the judge reuses it."""
  runs = []
  monkeypatch.setattr(recipe.sft, "run", lambda config, workdir: (os.makedirs(workdir), runs.append((config, workdir))))
  for k25_format in (False, True):
    root = tmp_path / ("k2.5" if k25_format else "legacy")
    assert recipe.run_judge("test", str(root), k25_format=k25_format) == str(root / recipe_config.JUDGE)
    config, workdir = runs[-1]
    configs = recipe.stage_configs("test", k25_format=k25_format)
    if k25_format:
      assert config.init.checkpoint == str(root / recipe_config.JUDGE_STARTS_FROM)
      assert config.model.to_dict() == configs["joint_rl"].model.to_dict()     # the rope carried on, as joint RL's
    else:
      assert config.init.checkpoint == ""
      assert config.model.text.vocab_size == 275 != configs["sft"].model.text.vocab_size   # a model of its own
  again = recipe.run_judge("test", str(tmp_path / "k2.5"), k25_format=True)
  assert len(runs) == 2 and again == workdir


@pytest.mark.slow
def test_every_stage_starts_from_every_earlier_stage(chain, tmp_path):
  """Each stage of the chain, and text RL after it, restores the decoder of every earlier stage's
  run exactly (and the vision tower and projector of every earlier K2.5 run)."""
  workdirs, finals = chain
  configs = recipe.stage_configs("test", k25_format=K25_FORMAT)
  later = [(name, configs[name]) for name in recipe.STAGES] + [("text_rl", _text_rl_config())]
  pairs = 0
  for i, (name, config) in enumerate(later):
    model, mesh = _model(config), sharding.make_mesh(config.mesh.to_dict())
    for earlier in recipe.STAGES[:i]:
      recipe.init_from(config, workdirs[earlier])
      with trainer_lib.Trainer(str(tmp_path / f"{name}_from_{earlier}"), model, None, mesh=mesh, seed=0,
                               keep_checkpoints=1) as trainer:
        params = jax.device_get(trainer.params_from(config.init))
      source = finals[earlier]
      k25_source = any(k.startswith(f"['{LM}']") for k in source)
      got = _flat(params, LM if LM in params else None)
      _assert_equal(got, _part(source, LM) if k25_source else source)
      if isinstance(model, k25.K25) and k25_source:
        for part in (k25.VISION_TOWER, k25.PROJECTOR):
          _assert_equal(_flat(params, part), _part(source, part))
      pairs += 1
  assert pairs == sum(range(len(recipe.STAGES) + 1))


@pytest.mark.slow
def test_the_probes_measure_a_chained_model(chain):
  workdirs, _ = chain
  configs = recipe.stage_configs("test", k25_format=K25_FORMAT)
  probes = recipe_probes.Probes(configs["sft"], configs["parl"], rows=8, seq_len=96, text_batches=1, vision_batches=1,
                                max_patches=256, tasks=2, long_rows=8, long_seq_len=384, long_batches=1)
  mesh = sharding.make_mesh({"data": -1, "devices": 1})     # as the chain ran them: numerics, not sharding
  cfg = recipe.k25_model_config("joint_rl", configs)
  out = probes(cfg, recipe.k25_params(cfg, workdirs["joint_rl"], mesh), mesh)
  assert set(recipe_probes.PROBES + recipe_probes.EXTRAS) <= set(out)
  assert all(0.0 <= out[p] <= 1.0 for p in recipe_probes.PROBES if p not in recipe_probes.LOSSES)
  assert all(0 < out[p] < np.log(cfg.text.vocab_size) + 1 for p in recipe_probes.LOSSES)
  record, agreement = recipe.judge_report(os.path.dirname(workdirs["joint_rl"]))   # joint RL's judge
  assert record["stage_s"] > 0 and set(agreement) == {"greedy", "samples_1"}
  assert record["init"]["checkpoint"] == (workdirs[recipe_config.JUDGE_STARTS_FROM] if K25_FORMAT else "")


def test_the_report_says_what_each_stage_gained_kept_at_its_ceiling_or_forgot():
  fresh = {p: 5.0 if p in recipe_probes.LOSSES else 0.0 for p in recipe_probes.PROBES}
  rows = {"init": fresh, "sft": {**fresh, "text_loss": 2.0, "arithmetic": 1.0, "image_tool": 0.3, "description": 0.4},
          "joint_rl": {**fresh, "text_loss": 3.0, "arithmetic": 1.0, "image_tool": 0.2, "description": 0.5}}
  trained, forgetting = recipe.changes(rows)
  verdicts = {(c["stage"], c["probe"]): (c["improved"], c["at_ceiling"]) for c in trained}
  assert verdicts == {("sft", "arithmetic"): (True, False), ("sft", "image_tool"): (True, False),
                      ("joint_rl", "arithmetic"): (False, True),
                      ("joint_rl", "image_tool"): (False, False), ("joint_rl", "description"): (True, False)}
  assert [(f["stage"], f["probe"]) for f in forgetting] == [("joint_rl", "text_loss")]


def test_the_table_over_seeds_gives_mean_error_and_whether_a_gain_exceeds_the_noise():
  fresh = {p: 5.0 if p in recipe_probes.LOSSES else 0.0 for p in recipe_probes.PROBES + recipe_probes.EXTRAS}
  # per seed: sft's image_tool 0.3 / 0.5 / 0.4 (gain over init 0.4 ± 0.1/√3: improved), its
  # arithmetic 0.1 / −0.1 / 0.0 over an init of 0.0 (0.0 ± 0.058: not distinguishable)
  runs = [{"seed": s, "rows": {"init": fresh, "sft": {**fresh, "image_tool": image, "arithmetic": sums}}}
          for s, (image, sums) in enumerate(((0.3, 0.1), (0.5, -0.1), (0.4, 0.0)))]
  result = recipe_seeds.aggregate(runs)
  assert result["seeds"] == [0, 1, 2]
  mean, error = result["rows"]["sft"]["image_tool"]
  assert mean == pytest.approx(0.4) and error == pytest.approx(0.1 / np.sqrt(3))
  verdicts = {t["probe"]: t["verdict"] for t in result["trained"]}
  assert verdicts == {"image_tool": "improved", "arithmetic": "not distinguishable"}
  assert "| sft | 5.000 ± 0.000 |" in recipe_seeds.markdown(result)
  assert result["forgetting"] == []
  # joint RL after it: text loss 2.0 / 2.1 / 1.9 after SFT (learnt from 5.0), then 3.0 / 3.2 / 2.9
  # (a drop of 1.0 / 1.1 / 1.0: forgotten beyond the noise); caption loss 2.0 → 2.1 / 1.9 / 2.0 (inside it)
  for run, (sft_text, rl_text, rl_caption) in zip(runs, ((2.0, 3.0, 2.1), (2.1, 3.2, 1.9), (1.9, 2.9, 2.0))):
    run["rows"]["sft"].update(text_loss=sft_text, caption_loss=2.0)
    run["rows"]["joint_rl"] = {**run["rows"]["sft"], "text_loss": rl_text, "caption_loss": rl_caption}
  forgotten = recipe_seeds.aggregate(runs)["forgetting"]
  assert [(f["stage"], f["probe"]) for f in forgotten] == [("joint_rl", "text_loss")]
  assert list(recipe_seeds.aggregate(runs, last="sft")["rows"]) == ["init", "sft"]    # up to a stage
  assert forgotten[0]["gain"] == pytest.approx((-31 / 30, 1 / 30))
  with pytest.raises(ValueError, match="stages differ"):
    recipe_seeds.aggregate([runs[0], {"rows": {"init": fresh}}])


if __name__ == "__main__":     # `ROOT`: the chain, for the fixture
  jax.config.update("jax_default_matmul_precision", "highest")
  _run_chain(sys.argv[1], k25_format=sys.argv[2] == "k2.5")
