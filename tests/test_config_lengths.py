"""Lengths that follow the run: every config file, at any `train.steps`, passes the checks
`python -m k25jax.main` runs before anything is built (`main.check_fields`, then the stage's
`check`); a length the user sets that the run cannot hold fails them (on the command line: one
line, exit status 2, tests/test_train_faults.py)."""
import pytest
from config_files import load_config

from k25jax import main

CONFIG_FILES = [
    ("configs/pretrain.py", preset) for preset in ("tiny", "small", "joint", "moonlight", "k25", "k25,joint")] + [
    ("configs/vit.py", "tiny"), ("configs/midtrain.py", "tiny"), ("configs/midtrain.py", "k25"),
    ("configs/midtrain.py", "k25,262k"), ("configs/sft.py", "tiny"), ("configs/sft.py", "tiny,visual,arithmetic"),
    ("configs/sft.py", "tiny,files"),
    ("configs/rl.py", "tiny"), ("configs/rl.py", "tiny,compact"), ("configs/rl.py", "k25"),
    ("configs/rl.py", "vision"), ("configs/rl.py", "vision,no_tool"), ("configs/rl.py", "joint,toggle"),
    ("configs/rl.py", "vision,k25_format"), ("configs/sft.py", "tiny,k25_format"),
    ("configs/toggle.py", None), ("configs/parl.py", "tiny"), ("configs/parl.py", "tiny,chat"),
    ("configs/parl.py", "tiny,k25_format"), ("configs/grm.py", None), ("configs/sft.py", "tiny,describe"),
    ("configs/rl.py", "joint,describe")]
STEPS = (1, 7, 60)
# Presets the stage cannot run at any length, and the one line that says why: the pod's RL update
# is compiled by experiments/aot_compile.py; the addition task has no K2 tokenizer.
CANNOT_RUN = {("configs/rl.py", "k25"): "model.vocab_size=163840 but task.rendering='chat' has 268 token ids"}
# Fields a preset leaves to the user (the files are read when the stage runs, not by the check).
USER_FIELDS = {("configs/sft.py", "tiny,files"): {"files": "chats.jsonl"}}


def check(config) -> None:
  main.check_fields(config)
  main.checked_stage(config)


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("path, arg", CONFIG_FILES, ids=[f"{p}:{a}" for p, a in CONFIG_FILES])
def test_every_config_file_passes_the_check_at_any_length(path, arg, steps):
  config = load_config(path, arg)
  config.train.steps = steps
  if (path, arg) in USER_FIELDS:
    config.data.update(USER_FIELDS[path, arg])
  if (path, arg) in CANNOT_RUN:
    with pytest.raises(ValueError, match=CANNOT_RUN[path, arg]):
      check(config)
    return
  check(config)
  if "warm_start" in config:
    config.warm_start.steps = steps
    check(config)


@pytest.mark.parametrize("steps", STEPS)
def test_every_recipe_stage_passes_the_check_at_any_length(steps):
  for i, config in enumerate(load_config("configs/recipe.py").values()):
    config.train.steps = steps
    if i:   # experiments/recipe.py starts each stage from the previous stage's workdir
      config.init.checkpoint = "runs/recipe/previous_stage"
    check(config)


def test_lengths_keep_the_presets_values_while_they_fit_and_scale_when_not():
  config = load_config("configs/pretrain.py")
  assert (config.optimizer.warmup_steps, config.optimizer.decay_steps, config.train.eval_every) == (20, 100, 100)
  config.train.steps = 1000                   # longer: the preset's lengths fit
  assert (config.optimizer.warmup_steps, config.optimizer.decay_steps, config.train.eval_every) == (20, 100, 100)
  config.train.steps = 60                     # shorter: warmup + decay 120 > 60, scaled by 60 / 120
  assert (config.optimizer.warmup_steps, config.optimizer.decay_steps) == (10, 50)
  assert (config.train.eval_every, config.train.checkpoint_every) == (20, 20)   # 100 · 60 / 300
  vit = load_config("configs/vit.py")
  vit.train.steps = 100
  assert vit.vit.projector_only_from == 75    # 150 of 200 steps: the last quarter projector-only
  rl = load_config("configs/rl.py")
  rl.train.steps, rl.rl.minibatches = 1, 2    # 2 updates: warmup 5 + decay 0 scaled to 2
  assert (rl.optimizer.warmup_steps, rl.toggle.m) == (2, 1)
  parl = load_config("configs/parl.py")
  parl.train.steps = 8
  assert parl.parl.anneal_steps == 4


def test_a_length_the_user_sets_is_kept_and_checked():
  config = load_config("configs/pretrain.py")
  config.optimizer.warmup_steps = 5
  config.train.steps = 1000
  assert config.optimizer.warmup_steps == 5
  config.train.steps = 3
  with pytest.raises(ValueError, match=r"optimizer.warmup_steps=5 \+ optimizer.decay_steps=2 exceed the run's 3"):
    check(config)
  vit = load_config("configs/vit.py")
  vit.vit.projector_only_from = 150
  vit.train.steps = 100
  with pytest.raises(ValueError, match=r"vit.projector_only_from=150 must lie in \[0, train.steps=100\]"):
    check(vit)
