"""The rl_vision stage: image prompts, tool rollouts, the K2.5 loss with media."""
import jax
import numpy as np
import pytest
from config_files import load_config

from k25jax.data import legacy_chat as chat
from k25jax.model import k25
from k25jax.stages import rl_vision
from k25jax.train import checkpoint, config_utils


def _small(config):
  config.model.text.update(num_hidden_layers=1, hidden_size=64, q_lora_rank=32, kv_lora_rank=32,
                           intermediate_size=128, num_attention_heads=4, max_position_embeddings=256)
  config.model.vision.num_hidden_layers = 1
  config.task.update(train_prompts=16, eval_prompts=4)
  config.rl.update(prompts_per_iteration=2, num_generations=4, minibatches=1, max_turns=1, max_context=192,
                   turn_tokens=16, eval_samples=1)
  config.train.update(steps=2, eval_every=2, log_every=1, checkpoint_every=1)
  config.optimizer.update(warmup_steps=1)
  config.sandbox.sessions = 8
  config.mesh.devices = 1         # what these check is the stage; it runs sharded in test_stage_multiprocess.py
  return config


def _start(config, tmp_path) -> str:
  """A K2.5 workdir of random params of the config's model."""
  start = tmp_path / "start"
  saver = checkpoint.Checkpoints(str(start), keep=1)
  cfg = config_utils.k25_config_from(config.model, chat.ChatTokenizer())
  saver.save(0, {"params": k25.init_params(cfg, jax.random.PRNGKey(0))})
  saver.close()
  return str(start)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["generated", "files"])
def test_vision_rl_trains_on_image_prompts(tmp_path, source):
  """On the generated image tasks, and on the same kind of tasks from files (PNGs and a JSONL
  of prompts, image paths, answers and the exact verifier: `task.files`)."""
  config = _small(load_config("configs/rl.py", "vision"))
  config.init.checkpoint = _start(config, tmp_path)
  if source == "files":
    from k25jax.data import image_tasks
    from test_rl_prompt_files import write_image_records
    made = image_tasks.make_tasks(20, seed=0, image_size=config.task.image_size, kinds=image_tasks.KINDS)
    config.task.update(files=write_image_records(tmp_path, made), eval_prompts=4)
  state, history = rl_vision.run(config, str(tmp_path / "run"))
  train = [h for h in history if h["split"] == "train"]
  assert [h["iteration"] for h in train] == [1, 2] and int(state.step) == 2
  assert all(np.isfinite(h["loss"]) and h["generated_tokens"] > 0 for h in train)
  assert [h["iteration"] for h in history if h["split"] == "eval"] == [0, 2]
  evals = [h for h in history if h["split"] == "eval"]
  assert all(0.0 <= h["accuracy"] <= 1.0 and 0.0 <= h["greedy_accuracy"] <= 1.0 for h in evals)
  if source == "files":
    assert all("from_files/accuracy" in h for h in evals)


@pytest.mark.slow
def test_vision_rl_with_muonclip_clips_the_decoder_heads(tmp_path):
  """An RL update of the K2.5 model with MuonClip: with τ below every logit, QK-Clip clips
  every head of the decoder nested under language_model/."""
  config = _small(load_config("configs/rl.py", "vision"))
  config.optimizer.update(name="muonclip", qk_clip_tau=1e-3)
  config.train.update(steps=1, eval_every=1)
  config.init.checkpoint = _start(config, tmp_path)
  _, history = rl_vision.run(config, str(tmp_path / "run"))
  train, = [h for h in history if h["split"] == "train"]
  text = config.model.text
  assert train["qk_clip/clipped_heads"] == text.num_hidden_layers * text.num_attention_heads
  assert np.isfinite(train["loss"]) and train["finite"] == 1.0


def test_vision_rl_needs_a_start():
  config = load_config("configs/rl.py", "vision")
  config.init.checkpoint = ""
  with pytest.raises(ValueError, match="init.checkpoint"):
    rl_vision.check(config)
  assert not config.toggle.enabled and load_config("configs/rl.py", "joint,toggle").toggle.enabled


def test_the_chat_format_must_be_the_one_the_start_was_trained_in(tmp_path):
  """configs/rl.py:vision,k25_format plays its episodes in Kimi K2.5's format; an init
  checkpoint whose workdir records the other format is one line naming both."""
  from k25jax.data import chat_formats
  from k25jax.model.config import K25Config
  from k25jax.train import model_record
  k25_format = load_config("configs/rl.py", "vision,k25_format")
  assert (k25_format.task.chat_format, k25_format.model.text.vocab_size) == ("k2.5", 275)
  legacy_start = tmp_path / "legacy_sft"
  model_record.write(str(legacy_start), K25Config(), chat_formats.LEGACY_RECORD)
  k25_format.init.checkpoint = str(legacy_start)
  with pytest.raises(ValueError, match="task.chat_format='k2.5', but init.checkpoint=.* the 'legacy' chat format"):
    rl_vision.check(k25_format)
  plain = load_config("configs/rl.py", "vision")
  plain.init.checkpoint = str(legacy_start)
  rl_vision.check(plain)
  plain.task.chat_format = "kimi"
  with pytest.raises(ValueError, match="task.chat_format='kimi'"):
    rl_vision.check(plain)


def test_joint_tasks_interleave_kinds_and_keep_text_tasks_imageless():
  config = load_config("configs/rl.py", "joint")
  assert rl_vision.parse_kinds(config.task.kinds)[0] == "addition"
  split = rl_vision.TaskSplit.make(6, 0, config)
  kinds = [t.kind for t in split.tasks]
  assert kinds == [rl_vision.parse_kinds(config.task.kinds)[i % 5] for i in range(6)]
  for task, item in zip(split.tasks, split.items):
    assert (item is None) == (task.kind == "addition")
  assert split.patches_per_row == max(m.pixel_values.shape[0] for m in split.items if m is not None)
  with pytest.raises(ValueError, match="task.kinds"):
    rl_vision.parse_kinds("addition,juggle")


@pytest.mark.slow
def test_joint_rl_with_toggle_mixes_text_and_image_tasks_alternates_phases_and_logs_abilities(tmp_path):
  """One run over addition (text only) and counting (an image), Toggle on: minibatches of one
  group each, so some updates are text-only and some carry an image; accuracy and length per
  ability; the budgets fixed from the start, the phases alternating every iteration."""
  config = _small(load_config("configs/rl.py", "joint,toggle"))
  config.task.kinds = "addition,count"
  config.rl.update(minibatches=2, num_generations=8)    # 8 rows a minibatch: one per host device
  config.toggle.update(m=1, budget_samples=2)
  seed, n = config.train.seed, config.task.train_prompts
  drawn = [np.random.default_rng([seed, it]).choice(n, config.rl.prompts_per_iteration, replace=False)
           for it in range(config.train.steps)]
  kinds = {"addition" if row % 2 == 0 else "count" for rows in drawn for row in rows}
  assert kinds == {"addition", "count"}        # the drawn groups include both (even rows: addition)
  config.init.checkpoint = _start(config, tmp_path)
  state, history = rl_vision.run(config, str(tmp_path / "run"))
  assert int(state.step) == config.train.steps * 2
  train = [h for h in history if h["split"] == "train"]
  assert all(np.isfinite(h["loss"]) for h in train)
  assert [h["toggle_phase"] for h in train] == [0, 1]
  assert all(h["shaped_reward"] <= h["reward"] for h in train)
  budgets = np.load(tmp_path / "run" / "toggle_budgets.npy")
  assert budgets.shape == (config.task.train_prompts,)
  evals = [h for h in history if h["split"] == "eval"]
  for h in evals:
    for ability in ("arithmetic", "visual_counting"):
      assert 0.0 <= h[f"{ability}/accuracy"] <= 1.0 and h[f"{ability}/length"] > 0
      assert 0.0 <= h[f"greedy_{ability}/accuracy"] <= 1.0


def test_held_out_sums_are_not_training_sums():
  config = load_config("configs/rl.py", "joint")
  config.task.kinds = "addition"
  train = rl_vision.TaskSplit.make(400, 0, config)
  held_out = rl_vision.TaskSplit.make(100, 1, config, held_out_from=train)
  assert len(held_out.tasks) == 100
  assert not {(t.a, t.b) for t in train.tasks} & {(t.a, t.b) for t in held_out.tasks}
