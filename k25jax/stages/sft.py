"""Zero-vision SFT: text-only trajectories that solve image tasks with a sandboxed Python tool.

    data   = zero_vision.dataset(...)     question → tool calls (code run in the sandbox) → tool
                                          outputs → answer; loss mask 1 on the assistant's tokens
           (+ data.visual_sft: image + question → direct answer, the text+vision comparison)
           (+ data.arithmetic_examples: 2-digit addition conversations, the text ability of joint RL)
           (+ data.text_replay: rows of the pre-training text, the loss on every token, and
            data.vision_replay: the joint pre-training's image samples, the loss on their
            answers: replay against forgetting what pre-training taught; no SFT data with images)
    θ_0    = init.checkpoint's K2.5 params (e.g. the joint pre-training's), or a fresh init
    θ      ← SFT:  L = Σ_t w_t CE(x_{t+1}) / Σ_t w_t   over packed rows (k25jax.data.packing)
    eval   = multi-turn rollouts with the real sandbox on held-out tasks (k25jax.agents.tool_rollout):
             text only with the tool (the zero-vision setting), and with the image in the
             prompt, with and without the tool: tool-call success rate and answer accuracy;
             with arithmetic examples, greedy accuracy on held-out sums (operands no example had)

Everything is written in `data.chat_format` (`k25jax.data.tool_formats`: k25jax's legacy chat
format, or Kimi K2.5's with the Python tool a declared `python(code)` function), the data and
the rollouts alike. The model is the K2.5 model; without rows with an image only the language
model gets gradients.
Trajectories are generated once and kept in the workdir (`sft_data_<fingerprint>.npz`),
so a resumed run trains on the same data in the same order.

`data.source=files` trains on the user's chats instead (`run_files`):

    data   = chat_files.load(...)         JSONL / Parquet chats rendered in the K2.5 chat format
                                          by the run's tokenizer, loss on the assistant's tokens
    θ      ← the same SFT loss over packed rows (k25jax.train.chat_rows; rows with images
             carry their media)
    eval   = held-out loss and token accuracy on the assistant's tokens of the held-out chats,
             before training and every train.eval_every steps
"""
from __future__ import annotations

import hashlib
import json
import os

import jax
import ml_collections
import numpy as np
from absl import logging

from k25jax.agents import tool_rollout
from k25jax.data import chat_files, chat_formats, descriptions, files as files_lib, image_tasks, judgements
from k25jax.data import packing, sources
from k25jax.data import tokenizer as tokenizer_lib, tool_formats, visual_synthetic, zero_vision
from k25jax.data import vision as vision_data
from k25jax.model import k25
from k25jax.model.config import K25Config
from k25jax.rl import grm, media_rows, sampler, tasks as rl_tasks
from k25jax.train import chat_rows, checkpoint, config_utils, loop, multimodal, objective, optimizer, saved_model
from k25jax.train import sharding
from k25jax.train import trainer as trainer_lib

FEATURES = tuple(name for name, _ in packing.FEATURES)


# ------------------------------------------------------------------------------------ data
def kinds(config) -> tuple[str, ...]:
  return image_tasks.parse_kinds(config.data.kinds, "data.kinds")


def trajectories(config, fmt, pool, workdir: str) -> dict[str, np.ndarray]:
  """The zero-vision trajectories in the tool format `fmt`: read from the workdir, or generated
  (tool outputs from the sandbox) and saved."""
  d = config.data
  key = {k: d[k] for k in ("trajectories", "seed", "image_size", "kinds", "p_two_calls", "max_length")}
  if fmt.name != "legacy":
    key["chat_format"] = fmt.name
  fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
  path = os.path.join(workdir, f"sft_data_{fingerprint}.npz")
  if os.path.exists(path):
    with np.load(path) as f:
      return dict(f)
  data = zero_vision.dataset(d.trajectories, d.seed, pool, fmt, image_size=d.image_size, kinds=kinds(config),
                             p_two_calls=d.p_two_calls, max_length=d.max_length)
  if jax.process_index() == 0:
    checkpoint.write_atomically(path, lambda f: np.savez(f, **data))
  return data


def visual_examples(config, fmt) -> tuple[dict[str, np.ndarray], list[vision_data.Media]]:
  """data.visual_examples image + question → direct answer conversations (tasks of another
  seed than the trajectories'), right-padded to the longest, and their images."""
  d = config.data
  return answered_directly(image_tasks.make_tasks(d.visual_examples, d.seed + 7919, d.image_size, kinds(config)),
                           fmt)


def describe_examples(config, fmt) -> tuple[dict[str, np.ndarray], list[vision_data.Media]]:
  """data.describe_examples image + "Describe …" → the true description conversations (scenes
  of seed data.seed + DESCRIBE_SEED_OFFSET, `descriptions`), right-padded to the longest, and
  their images: the description ability that joint RL with a GRM starts from."""
  d = config.data
  return answered_directly(descriptions.make_tasks(d.describe_examples, d.seed + DESCRIBE_SEED_OFFSET), fmt)


def answered_directly(tasks, fmt) -> tuple[dict[str, np.ndarray], list[vision_data.Media]]:
  """Each task's image + question → its answer, no tool call, in the tool format `fmt`,
  right-padded to the longest; and the images."""
  items = [vision_data.preprocess_image(t.image) for t in tasks]
  rendered = [fmt.trajectory(t.question, [], t.answer, media=m) for t, m in zip(tasks, items)]
  return packing.right_padded(rendered, max(len(ids) for ids, _ in rendered), fmt.pad_id), items


ARITHMETIC_SEED_OFFSET = 104729   # the addition demonstrations' seed: data.seed + this
DESCRIBE_SEED_OFFSET = 130363     # the description examples' seed: data.seed + this


class ToolPrompts:
  """A question as the tool rollouts prompt it (`fmt.prompt`: in the K2.5 format the python
  tool declared), answered directly: the addition demonstrations' rendering
  (`rl_tasks.addition_demonstrations`' `render`)."""

  def __init__(self, fmt):
    self.fmt, self.pad_id = fmt, fmt.pad_id

  def prompt(self, question: str) -> list[int]:
    return self.fmt.prompt(question)

  def completion(self, text: str) -> list[int]:
    return self.fmt.tokenizer.encode(text) + [self.fmt.stop_id]


def arithmetic_examples(config, fmt) -> dict[str, np.ndarray]:
  """data.arithmetic_examples 2-digit addition conversations in the tool format (the user asks
  `57+68=`, the assistant answers in one of the task's four correct forms; `k25jax.rl.tasks`),
  right-padded to data.max_length like the trajectories."""
  d = config.data
  demos = rl_tasks.addition_demonstrations(d.arithmetic_examples, d.seed + ARITHMETIC_SEED_OFFSET,
                                           render=ToolPrompts(fmt))
  width = demos["tokens"].shape[1]
  pad = lambda x, value: np.pad(x, ((0, 0), (0, d.max_length - width)), constant_values=value)
  return {"tokens": pad(demos["tokens"], fmt.pad_id), "loss_mask": pad(demos["completion_mask"], 0.0),
          "length": demos["length"], "a": demos["a"], "b": demos["b"]}


REPLAY_SOURCE, REPLAY_MAX_CHARS, REPLAY_EVAL_EVERY = "python_stdlib", 1000, 50   # configs/pretrain.py:tiny's text


def text_replay(config, fmt) -> dict[str, np.ndarray]:
  """data.text_replay rows of pre-training text: the training documents of the text
  pre-training stage (every 50th held out, as there and in the recipe's probes), shuffled
  by data.seed, cut into pieces of data.max_length − 1 bytes, each `BOS piece` with the
  loss on every token after BOS, right-padded to data.max_length. Raises ValueError when
  the documents give fewer pieces than asked."""
  d, tok = config.data, fmt.tokenizer
  docs, _ = sources.split(sources.load(REPLAY_SOURCE, REPLAY_MAX_CHARS), REPLAY_EVAL_EVERY)
  order = np.random.default_rng(d.seed).permutation(len(docs))
  piece = d.max_length - 1
  rows = [ids[i:i + piece] for j in order for ids in [tok.encode(docs[j])] for i in range(0, len(ids), piece)]
  if len(rows) < d.text_replay:
    raise ValueError(f"data.text_replay={d.text_replay}: the pre-training text gives {len(rows)} rows")
  tokens = np.full((d.text_replay, d.max_length), fmt.pad_id, np.int32)
  loss_mask = np.zeros((d.text_replay, d.max_length), np.float32)
  lengths = np.zeros(d.text_replay, np.int32)
  for r, ids in enumerate(rows[:d.text_replay]):
    tokens[r, :len(ids) + 1] = [tok.bos_id, *ids]
    loss_mask[r, 1:len(ids) + 1] = 1.0
    lengths[r] = len(ids) + 1
  return {"tokens": tokens, "loss_mask": loss_mask, "length": lengths}


# The joint pre-training's vision tasks of one image each (`visual_synthetic`; its video task
# `motion` is left out: a replayed conversation carries one media item).
REPLAY_VISION_TASKS = ("caption", "count", "read", "chart")


def vision_replay(config, fmt) -> tuple[dict[str, np.ndarray], list[vision_data.Media]]:
  """data.vision_replay samples of the joint pre-training's synthetic vision tasks, drawn as its
  stream is (`visual_synthetic.sample`, seed data.seed) over REPLAY_VISION_TASKS (the recipe's
  probes draw another seed): `BOS media block prompt answer EOS`, the loss on the answer and
  EOS as in pre-training, right-padded to the longest; and their images. Not SFT data:
  pre-training rows, replayed against forgetting."""
  samples = [visual_synthetic.sample(i, config.data.seed, fmt.tokenizer, REPLAY_VISION_TASKS)
             for i in range(config.data.vision_replay)]
  width = max(len(s) for s in samples)
  tokens = np.full((len(samples), width), fmt.pad_id, np.int32)
  loss_mask = np.zeros((len(samples), width), np.float32)
  for r, s in enumerate(samples):
    tokens[r, :len(s)] = s.tokens
    loss_mask[r, s.answer_start:len(s)] = 1.0
  data = {"tokens": tokens, "loss_mask": loss_mask, "length": np.array([len(s) for s in samples], np.int32)}
  return data, [s.media[0] for s in samples]


def image_rows(config, fmt) -> tuple[dict[str, np.ndarray], list[vision_data.Media]] | None:
  """The conversations with an image (visual SFT examples, description examples, then vision
  replay samples), right-padded to the longest of them, and their images; None when there are
  none."""
  parts = ([visual_examples(config, fmt)] if config.data.visual_sft else []) + (
      [describe_examples(config, fmt)] if config.data.describe_examples else []) + (
      [vision_replay(config, fmt)] if config.data.vision_replay else [])
  if not parts:
    return None
  width = max(data["tokens"].shape[1] for data, _ in parts)
  pad = lambda x, value: np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=value)
  data = {"tokens": np.concatenate([pad(d["tokens"], fmt.pad_id) for d, _ in parts]),
          "loss_mask": np.concatenate([pad(d["loss_mask"], 0.0) for d, _ in parts]),
          "length": np.concatenate([d["length"] for d, _ in parts])}
  return data, [m for _, items in parts for m in items]


def held_out_arithmetic(config, seen: set) -> list[rl_tasks.ArithmeticTask]:
  """eval.tasks addition tasks whose operands no demonstration had."""
  return rl_tasks.arithmetic_tasks(config.eval.tasks, config.eval.seed, frozenset(seen))


class Batches:
  """Per step, `train.batch` packed trajectory rows and (visual SFT, vision replay) `train.visual_batch`
  rows of `per_row` conversations with an image each, drawn without replacement by a generator seeded
  by (seed, step): a resumed run sees the same batches."""

  def __init__(self, config, model_cfg: K25Config, text: dict, visual=None):
    self.config, self.model_cfg = config, model_cfg
    self.text = packing.pack(text["tokens"], text["loss_mask"], text["length"], share_rows=True)
    self.width = self.text["inputs"].shape[1]
    if config.train.batch > len(self.text["inputs"]):
      raise ValueError(f"train.batch={config.train.batch} exceeds the {len(self.text['inputs'])} packed rows")
    self.visual = None
    if visual is not None:
      data, items = visual
      self.per_row = self.width // (data["tokens"].shape[1] - 1)
      rows = len(items) // self.per_row
      if rows < config.train.visual_batch:
        raise ValueError(f"the {len(items)} conversations with an image (data.visual_examples, data.vision_replay) "
                         f"fill {rows} rows of {self.per_row}, fewer than train.visual_batch={config.train.visual_batch}")
      self.visual = self._pack_visual(data, rows)
      self.items = items

  def _pack_visual(self, data: dict, rows: int) -> dict[str, np.ndarray]:
    """Conversation j goes to row j // per_row, segment j % per_row + 1, in order."""
    k, n = self.per_row, data["tokens"].shape[1] - 1
    out = {name: np.zeros((rows, self.width), dtype) for name, dtype in packing.FEATURES}
    for j in range(rows * k):
      packing.put_segment(out, j // k, (j % k) * n, j % k + 1, data["tokens"][j], data["loss_mask"][j],
                          int(data["length"][j]))
    return out

  def __call__(self, step: int) -> dict:
    rng = packing.step_rng(self.config.train.seed, step)
    rows = packing.draw_rows(rng, len(self.text["inputs"]), self.config.train.batch)
    batch = {name: v[rows] for name, v in self.text.items()}
    if self.visual is None:
      return batch
    vis = packing.draw_rows(rng, len(self.visual["inputs"]), self.config.train.visual_batch)
    batch = {name: np.concatenate([batch[name], self.visual[name][vis]]) for name in batch}
    items = [self.items[r * self.per_row + s] for r in vis for s in range(self.per_row)]
    pixels, layout = media_rows.media_batch(items, self.model_cfg, self.config.train.visual_batch * self.per_row)
    return {**batch, "pixel_values": pixels, "layout": layout}


# ---------------------------------------------------------------------------------- eval
SETTINGS = {"text_tool": (False, True), "image_tool": (True, True), "image_no_tool": (True, False)}


def rollout_config(config, tool: bool = True) -> tool_rollout.RolloutConfig:
  e = config.eval
  return tool_rollout.RolloutConfig(max_turns=e.max_turns, max_context=e.max_context, turn_tokens=e.turn_tokens,
                                    tool=tool, output_chars=config.sandbox.output_chars)


def play(config, model_cfg: K25Config, params, fmt, pool, tasks, *, image: bool, tool: bool, temperature: float,
         seed: int) -> list[tool_rollout.ToolEpisode]:
  """One episode per task: the question alone (text) or after its image block, tool on or off."""
  sampling = sampler.SamplingConfig(max_new_tokens=config.eval.turn_tokens, temperature=temperature,
                                    stop_tokens=(fmt.stop_id,), pad_id=fmt.pad_id,
                                    banned_tokens=tool_rollout.banned_tokens(fmt.tokenizer))
  if not image:
    decode = tool_rollout.text_decoder(model_cfg.text, params[k25.LANGUAGE_MODEL], sampling, seed,
                                       min_rows=pool.max_sessions)
    return tool_rollout.play(decode, fmt, tasks, pool, rollout_config(config, tool))
  items = [vision_data.preprocess_image(t.image) for t in tasks]
  decode = tool_rollout.vision_decoder(model_cfg, params, sampling, lambda e: items[e], seed,
                                       min_rows=pool.max_sessions)
  return tool_rollout.play(decode, fmt, tasks, pool, rollout_config(config, tool), media=items)


def evaluate(config, model_cfg: K25Config, params, fmt, pool, arithmetic: list | None = None) -> dict[str, dict]:
  """Greedy rollouts on `eval.tasks` held-out image tasks in each of SETTINGS (`eval.settings`),
  and on the held-out `arithmetic` tasks (text, tool on) when given."""
  e = config.eval
  image_set = image_tasks.make_tasks(e.tasks, e.seed, config.data.image_size, kinds(config))
  out = {}
  for name in e.settings.split(","):
    name = name.strip()
    if name not in SETTINGS:
      raise ValueError(f"eval.settings names {name!r}; choose from {tuple(SETTINGS)}")
    image, tool = SETTINGS[name]
    transcripts = play(config, model_cfg, params, fmt, pool, image_set, image=image, tool=tool, temperature=0.0,
                       seed=e.seed)
    out[name] = tool_rollout.summarize(transcripts, image_set)
  if arithmetic:
    transcripts = play(config, model_cfg, params, fmt, pool, arithmetic, image=False, tool=True, temperature=0.0,
                       seed=e.seed)
    out["arithmetic"] = tool_rollout.summarize(transcripts, arithmetic)
  return out


def print_summary(results: dict[str, dict], n_tasks: int) -> None:
  print(f"\nSFT summary: {n_tasks} held-out tasks a setting, greedy rollouts with the sandboxed Python tool")
  kinds_shown = image_tasks.KINDS + (("addition",) if "arithmetic" in results else ())
  print(f"{'setting':16s} {'accuracy':>9s} {'tool-call success':>18s} {'calls/episode':>14s} "
        + " ".join(f"{k:>8s}" for k in kinds_shown))
  for name, r in results.items():
    print(f"{name:16s} {r['accuracy']:9.3f} {r['tool_call_success']:18.3f} {r['calls_per_episode']:14.2f} "
          + " ".join(f"{r.get(f'{k}/accuracy', float('nan')):8.3f}" for k in kinds_shown))


# ------------------------------------------------------------------------------------- run
SOURCES = ("zero_vision", "files", "judgements")
ZERO_VISION_ONLY = ("visual_sft", "arithmetic_examples", "describe_examples", "text_replay", "vision_replay")


def check(config) -> None:
  """The stage's config check (before anything is built): the schedule fits the run; the
  trajectories (or chats) and the rollouts' contexts fit the model's positions; the data
  source's fields agree with it."""
  trainer_lib.check(config)
  positions = config.model.text.max_position_embeddings
  if config.data.source == "zero_vision" and config.eval.max_context > positions:
    raise ValueError(f"config: eval.max_context={config.eval.max_context} exceeds model.text.max_position_embeddings="
                     f"{positions}")
  if config.data.max_length > positions + 1:
    raise ValueError(f"config: data.max_length={config.data.max_length} exceeds model.text.max_position_embeddings + 1")
  d = config.data
  if d.source not in SOURCES:
    raise ValueError(f"config: data.source={d.source!r}: must be one of {SOURCES}")
  if d.chat_format not in tool_formats.NAMES:
    raise ValueError(f"config: data.chat_format={d.chat_format!r}: must be one of {tool_formats.NAMES}")
  if d.source == "zero_vision":
    for name in ("files", "eval_files", "vocab_file"):
      if d[name]:
        raise ValueError(f"config: data.{name} is read with data.source='files' (configs/sft.py:tiny,files)")
    if d.tokenizer != "bytes":
      raise ValueError("config: data.tokenizer: the zero-vision trajectories are rendered by k25jax's legacy chat "
                       "tokenizer; other tokenizers go with data.source='files'")
    return
  if d.chat_format != "k2.5":
    raise ValueError(f"config: data.source={d.source!r} renders chats in the K2.5 chat format: data.chat_format must "
                     "be 'k2.5' (configs/sft.py:tiny,files, configs/grm.py)")
  for name in ZERO_VISION_ONLY:
    if d[name]:
      raise ValueError(f"config: data.{name}={d[name]!r} belongs to data.source='zero_vision'; data.source="
                       f"{d.source!r} trains on its chats alone")
  if d.source == "judgements":
    judge_check(config)
    return
  if not d.files:
    raise ValueError("config: data.source='files' needs data.files (GLOB,...: .jsonl, .jsonl.gz or .parquet chats)")
  files_lib.BadRecords(d.on_bad_record)   # a policy it does not know is its one-line config error
  if d.tokenizer != "bytes" and not (d.vocab_file or config.init.hf_checkpoint):
    raise ValueError(f"config: data.tokenizer={d.tokenizer!r} needs data.vocab_file or init.hf_checkpoint (a folder "
                     "with the tokenizer)")


def check_built(config, model_cfg: K25Config, tok, mesh) -> None:
  """What shows once the pieces meet: the batches split over the mesh; the chat ids fit the model."""
  for name in ("batch", "visual_batch"):
    sharding.check_batch(mesh, config.train[name], f"train.{name}")
  if model_cfg.text.vocab_size < tok.vocab_size:
    raise ValueError(f"model.text.vocab_size={model_cfg.text.vocab_size} is below the chat vocabulary's "
                     f"{tok.vocab_size} tokens (bytes, media, role tokens)")


def run(config: ml_collections.ConfigDict, workdir: str):
  """Data, SFT (resumable), then held-out rollouts; writes workdir/sft_eval.json (results by
  setting). Returns (state, history): the logged train records, then one `eval/<setting>`
  record a setting. `data.source=files`: `run_files`."""
  check(config)
  if config.data.source in ("files", "judgements"):
    return run_files(config, workdir)
  fmt = tool_formats.get(config.data.chat_format)
  tok = fmt.tokenizer
  model = k25.K25(config_utils.k25_config_from(config.model, tok))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  check_built(config, model.cfg, tok, mesh)
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  with tool_rollout.sandbox_pool(config.sandbox) as pool, \
      trainer_lib.Trainer.for_config(config, workdir, model, tx, mesh,
                                     tokenizer=chat_formats.record_of(tok)) as trainer:
    text = trajectories(config, fmt, pool, workdir)
    arithmetic = None
    if config.data.arithmetic_examples:
      sums = arithmetic_examples(config, fmt)
      text = {name: np.concatenate([text[name], sums[name]]) for name in ("tokens", "loss_mask", "length")}
      arithmetic = held_out_arithmetic(config, set(zip(sums["a"].tolist(), sums["b"].tolist())))
    if config.data.text_replay:
      replay = text_replay(config, fmt)
      text = {name: np.concatenate([text[name], replay[name]]) for name in ("tokens", "loss_mask", "length")}
    visual = image_rows(config, fmt)
    batches = Batches(config, model.cfg, text, visual)
    logging.info("sft: %d conversations (%.0f tokens each, %.0f under the loss) in %d packed rows%s",
                 len(text["tokens"]), text["length"].mean(), text["loss_mask"].sum(1).mean(),
                 len(batches.text["inputs"]), f"; {len(visual[1])} with an image" if visual is not None else "")
    state = trainer.start(config.init)
    loss_fn = objective.for_section(model, config.train)
    step = trainer.train_step(loss_fn, router_bias_rate=config.train.router_bias_rate,
                              qk_clip_tau=optimizer.qk_clip_tau(config.optimizer),
                              batch_specs=multimodal.batch_specs(visual is not None, FEATURES))
    rows = config.train.batch + (config.train.visual_batch if visual is not None else 0)
    state, history = trainer.fit(state, step, lambda n: multimodal.to_device(batches(n), mesh), config.train,
                                 tokens_per_step=rows * batches.width)
    results = evaluate(config, model.cfg, state.params, fmt, pool, arithmetic)
    for name, r in results.items():
      trainer.writer.write(config.train.steps, r, f"eval/{name}")
      history.append({"split": f"eval/{name}", "step": config.train.steps, **r})
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "sft_eval.json"), "w") as f:
      json.dump(results, f, indent=1)
  print_summary(results, config.eval.tasks)
  return state, history


# ------------------------------------------------------------------------- your own chats
def chat_tokenizer(config):
  """data.source=files's tokenizer: the byte tokenizer with media and the K2.5 chat tokens, or
  `data.tokenizer` from data.vocab_file (else init.hf_checkpoint's folder)."""
  d = config.data
  if d.tokenizer == "bytes":
    return tokenizer_lib.ByteTokenizer(media=True, chat=True)
  return tokenizer_lib.load(d.tokenizer, d.vocab_file or config.init.hf_checkpoint, media=True)


START_EVAL = "sft_start_eval.json"   # the held-out metrics before training, kept for a resumed run


def run_files(config: ml_collections.ConfigDict, workdir: str):
  """SFT on the chats of data.files (module docstring); writes workdir/sft_eval.json (the
  held-out metrics before and after). Returns (state, history)."""
  d = config.data
  tok = chat_tokenizer(config)
  model = k25.K25(config_utils.k25_config_from(config.model, tok))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  check_built(config, model.cfg, tok, mesh)
  patches = max(1, d.image_size // vision_data.PATCH_SIZE) ** 2
  if d.source == "judgements":
    chats, held_out = judge_chats(d, tok, patches)
  else:
    chats, held_out = chat_files.load(d, chat_files.Rendering(tok, d.thinking, d.max_length, patches))
  rows = chat_rows.ChatRows(chats, held_out, length=d.max_length, batch=config.train.batch,
                            visual_batch=config.train.visual_batch, pad_id=tokenizer_lib.PAD_ID, cfg=model.cfg,
                            seed=config.train.seed)
  logging.info("sft: %d chats (%d with images) in %d packed rows; %d held out", len(chats),
               sum(bool(c.images) for c in chats), sum(len(p) for p in rows.train.values()), len(held_out))
  record = chat_formats.record_of(tok) or {"name": d.tokenizer, "path": d.vocab_file or config.init.hf_checkpoint,
                                           "media": True}
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  with trainer_lib.Trainer.for_config(config, workdir, model, tx, mesh, tokenizer=record) as trainer:
    state = trainer.start(config.init)
    loss_fn = objective.for_section(model, config.train)
    specs = multimodal.batch_specs(rows.with_media, FEATURES)
    step = trainer.train_step(loss_fn, router_bias_rate=config.train.router_bias_rate,
                              qk_clip_tau=optimizer.qk_clip_tau(config.optimizer), batch_specs=specs)
    eval_step = trainer.eval_step(loss_fn, specs)
    held = [multimodal.to_device(b, mesh) for b in rows.held_out()]
    evaluate = lambda s: loop.evaluate(eval_step, s, held)
    start_path = os.path.join(workdir, START_EVAL)
    if int(jax.device_get(state.step)) == 0:
      start = evaluate(state)
      trainer.writer.write(0, start, "eval")
      if jax.process_index() == 0:
        checkpoint.write_atomically(start_path, lambda f: f.write(json.dumps(start).encode()))
    else:
      with open(start_path) as f:
        start = json.load(f)
    state, history = trainer.fit(state, step, lambda n: multimodal.to_device(rows(n), mesh), config.train,
                                 tokens_per_step=rows.rows_per_step * rows.width, evaluate=evaluate)
    evaluations = [h for h in history if h["split"] == "eval"]
    end = evaluations[-1] if evaluations else evaluate(state)   # a resumed run already at train.steps
    results = {"chats": len(chats), "held_out_chats": len(held_out),
               "start": {k: start[k] for k in ("loss", "accuracy", "tokens")},
               "end": {k: end[k] for k in ("loss", "accuracy", "tokens")}}
    if d.source == "judgements":
      results["judge"] = judge_agreement(config, model.cfg, state.params, tok, mesh, patches)
      for name, r in results["judge"].items():
        trainer.writer.write(config.train.steps, r, f"eval/judge_{name}")
        history.append({"split": f"eval/judge_{name}", "step": config.train.steps, **r})
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "sft_eval.json"), "w") as f:
      json.dump(results, f, indent=1)
  if "judge" in results:
    print_judge(results["judge"])
  print(f"\nSFT on {len(chats)} chats from data.{d.source}; {len(held_out)} held out ({results['end']['tokens']:.0f} "
        f"assistant tokens):\n  held-out loss {results['start']['loss']:.4f} -> {results['end']['loss']:.4f}, "
        f"token accuracy {results['start']['accuracy']:.3f} -> {results['end']['accuracy']:.3f}")
  return state, history


# -------------------------------------------------------------- a judge for the GRM reward
def judge_check(config) -> None:
  """data.source=judgements: no files; the judge's evaluation fields."""
  d = config.data
  for name in ("files", "eval_files"):
    if d[name]:
      raise ValueError(f"config: data.{name} is read with data.source='files'; data.source='judgements' makes its "
                       "chats (configs/grm.py)")
  if d.tokenizer != "bytes":
    raise ValueError("config: data.source='judgements' renders over the byte tokenizer (data.tokenizer='bytes')")
  if min(d.judgements, d.eval_judgements) < 1:
    raise ValueError("config: data.judgements and data.eval_judgements must be >= 1")
  grm.check(config.grm)
  for name in config.eval.judge_samples.split(","):
    if not name.strip().isdigit() or int(name) < 1:
      raise ValueError(f"config: eval.judge_samples={config.eval.judge_samples!r}: comma-separated counts >= 1")


def judge_chats(d, tok, patches: int) -> tuple[list[chat_files.Chat], list[chat_files.Chat]]:
  """(training, held-out) judge chats of fresh scenes (`data.judgements`): d.judgements of
  seed d.seed, d.eval_judgements of seed d.seed + 1."""
  def made(n, seed):
    out = []
    for i, (ids, mask, media) in enumerate(judgements.chats(n, seed, tok, patches)):
      if len(ids) > d.max_length:
        raise ValueError(f"data.max_length={d.max_length}: a judge chat renders to {len(ids)} tokens")
      out.append(chat_files.Chat(f"judgement {i}", np.asarray(ids, np.int32), np.asarray(mask, np.float32), (media,)))
    return out
  return made(d.judgements, d.seed), made(d.eval_judgements, d.seed + 1)


def judge_agreement(config, model_cfg: K25Config, params, tok, mesh, patches: int) -> dict[str, dict]:
  """The trained judge against the hidden rubric on eval.judge_tasks held-out (image,
  description) pairs (`grm.agreement`), their images at most `patches` patches: greedy, and
  `samples` judgements at grm.temperature for each count of eval.judge_samples."""
  e = config.eval
  tasks = descriptions.make_tasks(e.judge_tasks, e.seed)
  rng = np.random.default_rng([e.seed, 7177])
  responses = [judgements.description_to_judge(rng, t) for t in tasks]
  truth = np.array([t.rubric(r) for t, r in zip(tasks, responses)])
  media = [vision_data.preprocess_image(t.image, max_patches=patches) for t in tasks]
  replicated = jax.device_put(params, sharding.replicated(mesh))
  saved = saved_model.SavedModel(model_cfg, replicated, tok, "workdir")   # placed once for every setting
  out = {}
  settings = [("greedy", dict(samples=1, temperature=0.0))] + [
      (f"samples_{n}", dict(samples=int(n))) for n in e.judge_samples.split(",")]
  for name, overrides in settings:
    section = ml_collections.ConfigDict(config.grm.to_dict())
    section.update(overrides)
    judged = grm.Judge(saved, section, seed=config.train.seed).judge([t.question for t in tasks], responses, media)
    out[name] = grm.agreement(judged, truth, section.max_score)
  return out


def print_judge(results: dict[str, dict]) -> None:
  print("\nThe judge against the hidden rubric (held-out descriptions):")
  print(f"  {'setting':<12}{'spearman':>9}{'exact':>7}{'within 1':>9}{'mae':>7}{'unparsable':>11}")
  for name, r in results.items():
    print(f"  {name:<12}{r['spearman']:9.3f}{r['score_accuracy']:7.3f}{r['within_one']:9.3f}{r['mae']:7.3f}"
          f"{r['unparsable_rate']:11.3f}")

