"""Multi-turn tool rollouts: the reference policy replays the SFT trajectories exactly, bad turns
become error observations, and the recorded log-probs are the training path's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k25jax.agents import sandbox, tool_rollout
from k25jax.data import image_tasks, tool_formats, zero_vision
from k25jax.data import vision as vision_data
from k25jax.model import config as model_config
from k25jax.model import k25, transformer
from k25jax.rl import media_rows, rollout, sampler, tasks as rl_tasks

FMT = tool_formats.LegacyToolFormat()
TOK = FMT.tokenizer


@pytest.fixture(scope="module")
def pool():
  with sandbox.SandboxPool(4) as p:
    yield p


def scripted(turns_of):
  """A decoder that writes turns_of(episode)[k] as its k-th turn (text after <|end|> is junk to ignore)."""
  def decode(contexts, episodes):
    out = []
    for context, episode in zip(contexts, episodes):
      k = list(context).count(TOK.assistant_id) - 1
      ids = turns_of(episode)[k] + TOK.encode("junk")
      out.append((ids, [-0.25] * len(ids)))
    return out
  return decode


def call(code):
  return [TOK.call_id, *TOK.encode(code), TOK.end_id]


def answer(text):
  return [*TOK.encode(text), TOK.end_id]


def test_reference_policy_replays_the_sft_trajectories(pool):
  tasks = image_tasks.make_tasks(6, seed=2)
  steps = zero_vision.conversations(tasks, pool, p_two_calls=0.5, seed=2)
  turns = [[call(code) for code, _ in s] + [answer(task.answer)] for s, task in zip(steps, tasks)]
  transcripts = tool_rollout.play(scripted(lambda e: turns[e]), FMT, tasks, pool, tool_rollout.RolloutConfig())
  for t, s, task in zip(transcripts, steps, tasks):
    tokens, mask = FMT.trajectory(task.question, s, task.answer)
    assert t.tokens == tokens and t.loss_mask == mask
    assert t.logprobs == [-0.25 if m else 0.0 for m in mask]
  summary = tool_rollout.summarize(transcripts, tasks)
  assert summary["accuracy"] == 1.0 and summary["tool_call_success"] == 1.0
  assert summary["calls_per_episode"] == sum(len(t) - 1 for t in turns) / 6 and summary["finish/answer"] == 1.0


def test_bad_turns_become_error_observations(pool):
  tasks = image_tasks.make_tasks(5, seed=4)
  name = tasks[0].image_name
  scripts = [
      [call("print(undefined_name)"), call(f"print({name}.shape)"), answer("nonsense")],   # error, then ok
      [[TOK.call_id, TOK.end_id], answer(tasks[1].answer)],                                 # empty call
      [TOK.encode("never ends")],                                                           # truncated
      [call("x = 1")] * 5,                                                                  # turn limit
      [call("import os"), answer(tasks[4].answer)],                                         # refused import
  ]
  config = tool_rollout.RolloutConfig(max_turns=3)
  t = tool_rollout.play(scripted(lambda e: scripts[e]), FMT, tasks, pool, config)
  assert [x.finish for x in t] == ["answer", "answer", "truncated", "turn_limit", "answer"]
  assert [x.calls for x in t] == [2, 1, 0, 3, 1] and [x.call_errors for x in t] == [1, 1, 0, 0, 1]
  text = TOK.decode(t[0].tokens)
  assert "<|tool|>Error: NameError: name 'undefined_name' is not defined" in text
  assert "<|tool|>(56, 56, 3)<|end|>" in text
  assert "Error: malformed call (empty)" in TOK.decode(t[1].tokens)
  assert "import of 'os' is not allowed" in TOK.decode(t[4].tokens)
  summary = tool_rollout.summarize(t, tasks)
  assert summary["accuracy"] == 2 / 5 and summary["tool_call_success"] == 4 / 7
  no_tool = tool_rollout.play(scripted(lambda e: scripts[e]), FMT, tasks[:1], pool,
                              tool_rollout.RolloutConfig(tool=False))
  assert no_tool[0].call_errors == 2 and "Error: no tool is available" in TOK.decode(no_tool[0].tokens)


def test_length_limit_stops_before_a_turn_that_cannot_fit(pool):
  tasks = image_tasks.make_tasks(1, seed=4)
  config = tool_rollout.RolloutConfig(max_context=80, turn_tokens=20)
  t = tool_rollout.play(scripted(lambda e: [call("print(1)")] * 9), FMT, tasks, pool, config)[0]
  assert t.finish == "length_limit" and len(t.tokens) + 20 > 80 and t.answer is None


@pytest.mark.slow
@pytest.mark.parametrize("mixed", [False, True])
def test_sampled_logprobs_match_the_k25_training_path_over_several_turns(pool, mixed):
  """mixed: every other episode is a text-only addition task (no image, no media block),
  as in joint RL: the sampler's and the training forward's media must still line up."""
  text = model_config.preset("tiny", vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64,
                             moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, n_routed_experts=4,
                             num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                             qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=128)
  cfg = model_config.K25Config(text=text, vision=model_config.VisionConfig(num_hidden_layers=1),
                               projection_hidden_size=64, image_token_id=TOK.media.pad,
                               video_token_id=TOK.vocab_size, vision_start_token_id=TOK.media.begin,
                               vision_end_token_id=TOK.media.end)
  params = k25.init_params(cfg, jax.random.PRNGKey(0))
  # A random model made to open its turns with <|call|> or <|end|> (logits ~7 and ~6.5 against
  # ~0 for the rest) and to close a call at once: turns are short, calls are empty (malformed),
  # so episodes go on for several turns. The layers and the image still add to the logits.
  lm = params["language_model"]
  e0, e1 = np.eye(32)[0], np.eye(32)[1]
  lm["embed_tokens"]["embedding"] = lm["embed_tokens"]["embedding"].at[TOK.assistant_id].set(10 * e0).at[
      TOK.call_id].set(10 * e1)
  scale = np.sqrt(32)   # RMSNorm(10 e_i) = sqrt(d) e_i
  lm["lm_head"] = lm["lm_head"].at[:, TOK.call_id].set(7 / scale * e0).at[:, TOK.end_id].set((6.5 * e0 + 8 * e1) / scale)
  tasks = image_tasks.make_tasks(8, seed=8, image_size=56)
  if mixed:
    tasks[::2] = rl_tasks.arithmetic_tasks(4, seed=8)
  items = [vision_data.preprocess_image(t.image) if t.images else None for t in tasks]
  per_row = max(m.pixel_values.shape[0] for m in items if m is not None)
  banned = tool_rollout.banned_tokens(TOK)
  sampling = sampler.SamplingConfig(max_new_tokens=8, temperature=0.8, stop_tokens=(TOK.end_id,), banned_tokens=banned)
  decode = tool_rollout.vision_decoder(cfg, params, sampling, lambda e: items[e], seed=3, min_rows=8,
                                       per_row=per_row)
  transcripts = tool_rollout.play(decode, FMT, tasks, pool, tool_rollout.RolloutConfig(
      max_turns=2, max_context=128, turn_tokens=8), media=items)
  assert [TOK.media.pad in t.tokens for t in transcripts] == [m is not None for m in items]
  assert max(t.turns for t in transcripts) == 2 and sum(t.calls for t in transcripts) >= 2
  rows = rollout.loss_rows(transcripts, seq_len=128, pad_id=TOK.pad_id)
  pixels, layout = media_rows.media_batch(items, cfg, len(items), per_row)
  logits, _ = jax.jit(k25.K25(cfg).apply)({"params": params}, jnp.asarray(rows["inputs"]), jnp.asarray(pixels), layout)
  logp = rollout.token_logprobs(rollout.mask_banned(logits, banned), jnp.asarray(rows["targets"]), 0.8)
  np.testing.assert_allclose(np.where(rows["mask"] > 0, logp, 0.0), rows["old_logp"], atol=2e-5)
  assert rows["mask"].sum() == sum(sum(t.loss_mask) for t in transcripts)
  blind, _ = jax.jit(transformer.Transformer(text).apply)({"params": params["language_model"]},
                                                          jnp.asarray(rows["inputs"]))
  assert float(jnp.abs(logits - blind).max()) > 1e-2           # the image features did reach the logits


# ------------------------------------------------------------------------ Kimi K2.5's format
K25 = tool_formats.K25ToolFormat()


def k25_scripted(turns_of):
  """A decoder that writes turns_of(episode)[k] (texts with the format's special tokens) as its
  k-th turn: the k-th generation prompt of the context."""
  opening = K25.tokenizer.special["<|im_assistant|>"]

  def decode(contexts, episodes):
    out = []
    for context, episode in zip(contexts, episodes):
      k = list(context).count(opening) - 1
      ids = encode_k25(turns_of(episode)[k]) + K25.tokenizer.encode("junk")
      out.append((ids, [-0.5] * len(ids)))
    return out
  return decode


def encode_k25(text):
  """Text with K2.5 special tokens written by name → ids."""
  import re
  ids = []
  for piece in re.split(r"(<\|[a-z_]+\|>)", text):
    ids += [K25.tokenizer.special[piece]] if piece in K25.tokenizer.special else K25.tokenizer.encode(piece)
  return ids


def k25_call(*codes, first=0):
  import json
  calls = "".join(f"<|tool_call_begin|>functions.python:{first + j}<|tool_call_argument_begin|>"
                  f"{json.dumps({'code': code})}<|tool_call_end|>" for j, code in enumerate(codes))
  return f"<|tool_calls_section_begin|>{calls}<|tool_calls_section_end|><|im_end|>"


def test_k25_format_replays_its_trajectories_and_answers_bad_calls_with_errors(pool):
  """Replaying the K2.5 trajectories gives them token for token (mask and log-probs on the
  model's turns only); a turn with two calls runs both in order, each result under its id;
  arguments that are not JSON, a tool that is not declared, a call without code and a stray
  special token are error observations; a turn without <|im_end|> is truncated."""
  tasks = image_tasks.make_tasks(4, seed=2)
  steps = zero_vision.conversations(tasks, pool, p_two_calls=0.5, seed=2)
  turns = [[k25_call(code, first=k) for k, (code, _) in enumerate(s)] + [f"{task.answer}<|im_end|>"]
           for s, task in zip(steps, tasks)]
  config = tool_rollout.RolloutConfig(max_context=1024)    # the K2.5 trajectories run to ~580 tokens
  replayed = tool_rollout.play(k25_scripted(lambda e: turns[e]), K25, tasks, pool, config)
  for t, s, task in zip(replayed, steps, tasks):
    tokens, mask = K25.trajectory(task.question, s, task.answer)
    assert t.tokens == tokens and t.loss_mask == mask and t.answer == task.answer
    assert t.logprobs == [-0.5 if m else 0.0 for m in mask]
  assert tool_rollout.summarize(replayed, tasks)["accuracy"] == 1.0

  name = tasks[0].image_name
  bad = [
      [k25_call("x = 2", f"print({name}.shape, x)"), "done<|im_end|>"],                      # two calls, one turn
      ['<|tool_calls_section_begin|><|tool_call_begin|>functions.python:0<|tool_call_argument_begin|>{code: 1}'
       '<|tool_call_end|><|tool_calls_section_end|><|im_end|>', "a<|im_end|>"],               # not JSON
      ['<|tool_calls_section_begin|><|tool_call_begin|>functions.shell:0<|tool_call_argument_begin|>{"code": "1"}'
       '<|tool_call_end|><|tool_calls_section_end|><|im_end|>', "b<|im_end|>"],               # not declared
      ['<|tool_calls_section_begin|><|tool_call_begin|>functions.python:0<|tool_call_argument_begin|>{"cmd": "1"}'
       '<|tool_call_end|><|tool_calls_section_end|><|im_end|>', "4<|im_user|>x<|im_end|>"],  # no code; stray token
  ]
  t = tool_rollout.play(k25_scripted(lambda e: bad[e]), K25, tasks, pool, config)
  text = [K25.tokenizer.decode(x.tokens) for x in t]
  assert [x.calls for x in t] == [2, 1, 1, 1] and [x.call_errors for x in t] == [0, 1, 1, 1]
  assert ("## Return of functions.python:0\n<|im_end|><|im_system|>tool<|im_middle|>## Return of "
          "functions.python:1\n(56, 56, 3) 2<|im_end|>") in text[0]
  assert "Error: malformed call (bad_arguments)" in text[1] and "Error: malformed call (unknown_tool)" in text[2]
  assert "Error: malformed call (no_code)" in text[3]
  assert [x.answer for x in t] == ["done", "a", "b", None] and all(x.finish == "answer" for x in t)
  truncated = tool_rollout.play(k25_scripted(lambda e: ["no end"]), K25, tasks[:1], pool, config)[0]
  assert truncated.finish == "truncated" and truncated.answer is None
