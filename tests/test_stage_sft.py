"""The SFT stage: visual batches line up with their images; a short run (with arithmetic) trains,
evaluates on held-out sums and resumes."""
import json
import os

import numpy as np
import pytest
from config_files import load_config

from k25jax.data import image_tasks, tool_formats, zero_vision
from k25jax.model import media
from k25jax.rl import tasks as rl_tasks
from k25jax.stages import sft
from k25jax.train import config_utils


def _small(config):
  config.model.text.update(num_hidden_layers=1, hidden_size=64, q_lora_rank=32, kv_lora_rank=32,
                           intermediate_size=128, num_attention_heads=4, max_position_embeddings=384)
  config.model.vision.num_hidden_layers = 1
  config.data.update(trajectories=48, visual_examples=32)
  config.train.update(steps=12, batch=8, visual_batch=8, log_every=4, checkpoint_every=6)
  config.optimizer.update(lr=3e-3, warmup_steps=2, decay_steps=4)
  config.sandbox.sessions = 4
  config.eval.update(tasks=4, max_turns=2, max_context=320, turn_tokens=16, settings="text_tool")
  config.mesh.devices = 1         # the stage, not its sharding (the trainer's step: test_train_sharding.py)
  return config


def test_visual_rows_carry_their_images_in_placeholder_order():
  config = _small(load_config("configs/sft.py", "tiny,visual"))
  config.train.batch = 2
  fmt = tool_formats.LegacyToolFormat()
  tok = fmt.tokenizer
  model_cfg = config_utils.k25_config_from(config.model, tok)
  data, items = sft.visual_examples(config, fmt)
  learned = [tok.decode(t[m == 1]) for t, m in zip(data["tokens"], data["loss_mask"])]
  assert all(text.endswith("<|end|>") and "<|media_pad|>" not in text for text in learned)
  text = zero_vision.encode([fmt.trajectory(t.question, [], t.answer) for t in image_tasks.make_tasks(8, seed=1)],
                            320, fmt.pad_id)
  batches = sft.Batches(config, model_cfg, text, (data, items))
  batch = batches(3)
  assert batch["inputs"].shape[0] == config.train.batch + config.train.visual_batch
  mask = media.placeholder_mask(batch["inputs"], model_cfg.media_token_ids)
  assert not mask[:config.train.batch].any()
  merged = batch["layout"].merged_items
  assert mask.sum() == (merged > 0).sum() == config.train.visual_batch * batches.per_row * items[0].num_tokens
  assert batch["pixel_values"].shape[0] == batch["layout"].num_patches
  again = batches(3)
  np.testing.assert_array_equal(again["pixel_values"], batch["pixel_values"])   # the step fixes the batch


@pytest.mark.slow
def test_short_run_with_arithmetic_trains_evaluates_held_out_sums_and_resumes(tmp_path):
  config = _small(load_config("configs/sft.py", "tiny,arithmetic"))
  config.data.arithmetic_examples = 32
  state, history = sft.run(config, str(tmp_path))
  assert [h["step"] for h in history if h["split"] == "train"] == [1, 4, 8, 12]
  evals = {h["split"]: h for h in history if h["split"].startswith("eval/")}
  assert sorted(evals) == ["eval/arithmetic", "eval/text_tool"]
  assert 0.0 <= evals["eval/text_tool"]["accuracy"] <= 1.0 and evals["eval/text_tool"]["turns_per_episode"] >= 1
  assert 0.0 <= evals["eval/arithmetic"]["accuracy"] <= 1.0 and "addition/accuracy" in evals["eval/arithmetic"]
  with open(tmp_path / "sft_eval.json") as f:
    assert json.load(f) == {split[len("eval/"):]: {k: v for k, v in h.items() if k not in ("split", "step")}
                            for split, h in evals.items()}
  data_files = [f for f in os.listdir(tmp_path) if f.startswith("sft_data_")]
  assert len(data_files) == 1 and os.path.exists(tmp_path / "sft_eval.json")
  stamp = os.path.getmtime(tmp_path / data_files[0])
  config.train.steps = 14
  resumed, _ = sft.run(config, str(tmp_path))
  assert int(resumed.step) == 14 and os.path.getmtime(tmp_path / data_files[0]) == stamp


def test_arithmetic_examples_are_chat_sums_and_held_out_sums_are_unseen():
  config = _small(load_config("configs/sft.py", "tiny,arithmetic"))
  config.data.arithmetic_examples = 64
  fmt = tool_formats.LegacyToolFormat()
  tok = fmt.tokenizer
  sums = sft.arithmetic_examples(config, fmt)
  assert sums["tokens"].shape == (64, config.data.max_length)
  for tokens, mask, a, b in zip(sums["tokens"], sums["loss_mask"], sums["a"], sums["b"]):
    assert tok.decode(tokens[:10]) == f"<|user|>{a:02d}+{b:02d}=<|end|><|assistant|>"
    answer = tok.decode(tokens[mask == 1])
    assert answer.endswith("<|end|>") and rl_tasks.parse_addition_text(answer[:-len("<|end|>")]) == a + b
  k25 = tool_formats.K25ToolFormat()           # in the K2.5 format: the tool rollouts' prompt, answered directly
  sums = sft.arithmetic_examples(config, k25)
  for tokens, mask, a, b in zip(sums["tokens"][:8], sums["loss_mask"][:8], sums["a"][:8], sums["b"][:8]):
    prompt = k25.prompt(f"{a:02d}+{b:02d}=")
    assert tokens[:len(prompt)].tolist() == prompt and not mask[:len(prompt)].any()
    answer = k25.tokenizer.decode(tokens[mask == 1])
    assert answer.endswith("<|im_end|>") and rl_tasks.parse_addition_text(answer[:-len("<|im_end|>")]) == a + b
  seen = set(zip(sums["a"].tolist(), sums["b"].tolist()))
  held_out = sft.held_out_arithmetic(config, seen)
  assert len(held_out) == config.eval.tasks and not {(t.a, t.b) for t in held_out} & seen


def test_text_replay_rows_are_pre_training_text_with_the_loss_on_every_token():
  from k25jax.data import sources
  config = load_config("configs/sft.py")
  config.data.update(text_replay=40, max_length=64)
  fmt = tool_formats.LegacyToolFormat()
  tok = fmt.tokenizer
  rows = sft.text_replay(config, fmt)
  assert rows["tokens"].shape == rows["loss_mask"].shape == (40, 64)
  train, held_out = sources.split(sources.load(sft.REPLAY_SOURCE, sft.REPLAY_MAX_CHARS), sft.REPLAY_EVAL_EVERY)
  train_text, held_text = "\n".join(train), set(held_out)
  for tokens, mask, n in zip(rows["tokens"], rows["loss_mask"], rows["length"]):
    assert tokens[0] == tok.bos_id and (tokens[n:] == tok.pad_id).all()
    np.testing.assert_array_equal(mask, (np.arange(64) >= 1) & (np.arange(64) < n))
    text = tok.decode(tokens[1:n])
    assert text in train_text and not any(text in d for d in held_text if len(d) > 200 and len(text) > 60)
  again = sft.text_replay(config, fmt)
  np.testing.assert_array_equal(again["tokens"], rows["tokens"])
  config.data.text_replay = 10**7
  with pytest.raises(ValueError, match="data.text_replay=10000000"):
    sft.text_replay(config, fmt)


def test_vision_replay_rows_are_joint_pre_training_samples_with_the_loss_on_the_answer():
  from k25jax.data import visual_synthetic
  config = _small(load_config("configs/sft.py", "tiny,visual"))
  config.data.update(visual_examples=4, vision_replay=12)
  fmt = tool_formats.LegacyToolFormat()
  tok = fmt.tokenizer
  data, items = sft.vision_replay(config, fmt)
  assert data["tokens"].shape == data["loss_mask"].shape and len(items) == 12
  for i, (tokens, mask, n, item) in enumerate(zip(data["tokens"], data["loss_mask"], data["length"], items)):
    ex = visual_synthetic.example(i, config.data.seed, sft.REPLAY_VISION_TASKS)
    assert tok.decode(tokens[mask == 1]) == ex.answer + tok.decode([tok.eos_id])   # the answer and EOS alone
    assert tokens[0] == tok.bos_id and (tokens[n:] == tok.pad_id).all()
    assert (tokens == tok.media.pad).sum() == item.num_tokens
  assert {visual_synthetic.example(i, 0, sft.REPLAY_VISION_TASKS).task for i in range(12)} == set(
      sft.REPLAY_VISION_TASKS)
  both, both_items = sft.image_rows(config, fmt)   # visual SFT examples first, then the replay
  assert len(both["tokens"]) == len(both_items) == 16 and all(
      (a.pixel_values == b.pixel_values).all() for a, b in zip(both_items[4:], items))
  np.testing.assert_array_equal(both["loss_mask"][4:, :data["tokens"].shape[1]], data["loss_mask"])
  config.data.update(visual_sft=False, vision_replay=0)
  assert sft.image_rows(config, tok) is None
