"""Zero-vision SFT: text-only trajectories that solve image tasks with a sandboxed Python tool.

    data   = zero_vision.dataset(...)     question → tool calls (code run in the sandbox) → tool
                                          outputs → answer; loss mask 1 on the assistant's tokens
           (+ data.visual_sft: image + question → direct answer, the text+vision comparison)
    θ_0    = warm_start.checkpoint's K2.5 params (e.g. the joint pre-training's), or a fresh init
    θ      ← SFT:  L = Σ_t w_t CE(x_{t+1}) / Σ_t w_t   over packed rows (k25jax.train.sft.pack)
    eval   = multi-turn rollouts with the real sandbox on held-out tasks (k25jax.agents.tool_rollout):
             text only with the tool (the zero-vision setting), and with the image in the
             prompt, with and without the tool: tool-call success rate and answer accuracy

The model is the K2.5 model; without visual data only the language model gets gradients.
Trajectories are generated once and kept in the workdir (`sft_data_<fingerprint>.npz`),
so a resumed run trains on the same data in the same order.
"""
from __future__ import annotations

import hashlib
import json
import os

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from k25jax import losses
from k25jax.agents import sandbox, tool_rollout
from k25jax.data import chat, image_tasks, zero_vision
from k25jax.data import vision as vision_data
from k25jax.model import k25
from k25jax.model.config import K25Config
from k25jax.rl import sampler
from k25jax.train import checkpoint, config_utils, loop, multimodal, optimizer, sft, sharding, step

LM = "language_model"
# The text backbone of the tiny chat model (configs/sft.py, configs/rl.py:vision): ~0.5M params
# over the chat vocabulary, long enough for the trajectories and a few tool turns.
TINY_TEXT = dict(vocab_size=chat.ChatTokenizer().vocab_size, hidden_size=128, intermediate_size=256,
                 moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, n_routed_experts=4,
                 num_experts_per_tok=2, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16,
                 v_head_dim=32, max_position_embeddings=512)
FEATURES = ("inputs", "targets", "loss_mask", "positions", "segment_ids")


# ----------------------------------------------------------------------------------- model
def model_config(config, tok: chat.ChatTokenizer) -> K25Config:
  """The K2.5 config of `config.model`, media ids from the chat vocabulary; the (unused) video
  placeholder id is put past the vocabulary so that no chat token is taken for one."""
  return config_utils.k25_config_from(config.model, tok.media).replace(video_token_id=tok.vocab_size)


def make_loss(config, model: k25.K25):
  """loss_fn(params, batch, rng): masked next-token CE (+ z-loss and the MoE balance loss)."""
  def loss_fn(params, batch, rng):
    del rng
    logits, aux = model.apply({"params": params}, batch["inputs"], batch.get("pixel_values"), batch.get("layout"),
                              batch["positions"], batch["segment_ids"])
    loss, metrics = losses.next_token_loss(logits, batch["targets"], batch["loss_mask"], z_loss=config.train.z_loss)
    return loss + config.train.balance_loss_alpha * aux["balance_loss"], (metrics, aux)
  return loss_fn


def batch_specs(with_media: bool) -> dict:
  """Rows over the batch axes and `sequence`; media (pixel_values, layout) replicated."""
  specs = {name: P(sharding.BATCH_AXES, "sequence") for name in FEATURES}
  return {**specs, "pixel_values": P(), "layout": P()} if with_media else specs


def to_device(batch: dict, mesh) -> dict:
  specs = batch_specs("pixel_values" in batch)
  return {name: jax.tree.map(lambda x, s=specs[name]: jax.device_put(x, NamedSharding(mesh, s)), value)
          for name, value in batch.items()}


def make_step(config, model: k25.K25, tx, with_media: bool = False):
  """The jitted SFT update (state, batch) -> (state, metrics); batches with media (visual SFT)
  carry pixel_values and a PatchLayout padded to a fixed budget."""
  abstract = multimodal.abstract_state(model.cfg, tx)
  return step.make_train_step(make_loss(config, model), tx, abstract, router_gamma=config.train.router_bias_rate,
                              first_moe_layer=model.cfg.text.first_k_dense_replace, lm_key=LM,
                              batch_specs=batch_specs(with_media))


# ------------------------------------------------------------------------------------ data
def kinds(text: str, field: str = "data.kinds") -> tuple[str, ...]:
  """The task kinds of a comma-separated config field (`field` names it in the error)."""
  names = tuple(k.strip() for k in text.split(",") if k.strip())
  if not names or set(names) - set(image_tasks.KINDS):
    raise ValueError(f"{field}={text!r}; a comma-separated subset of {image_tasks.KINDS}")
  return names


def make_pool(config) -> sandbox.SandboxPool:
  s = config.sandbox
  return sandbox.SandboxPool(s.sessions, limits=sandbox.Limits(cpu_s=s.cpu_s, wall_s=s.wall_s, memory_mb=s.memory_mb))


def trajectories(config, tok: chat.ChatTokenizer, pool, workdir: str) -> dict[str, np.ndarray]:
  """The zero-vision trajectories: read from the workdir, or generated (tool outputs from the sandbox) and saved."""
  d = config.data
  key = {k: d[k] for k in ("trajectories", "seed", "image_size", "kinds", "p_two_calls", "max_length")}
  fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
  path = os.path.join(workdir, f"sft_data_{fingerprint}.npz")
  if os.path.exists(path):
    with np.load(path) as f:
      return dict(f)
  data = zero_vision.dataset(d.trajectories, d.seed, pool, tok, image_size=d.image_size, kinds=kinds(d.kinds),
                             p_two_calls=d.p_two_calls, max_length=d.max_length)
  if jax.process_index() == 0:
    np.savez(path, **data)
  return data


def visual_examples(config, tok: chat.ChatTokenizer) -> tuple[dict[str, np.ndarray], list[vision_data.Media]]:
  """data.visual_examples image + question → direct answer conversations (tasks of another
  seed than the trajectories'), right-padded to the longest, and their images."""
  d = config.data
  tasks = image_tasks.make_tasks(d.visual_examples, d.seed + 7919, d.image_size, kinds(d.kinds))
  items = [vision_data.preprocess_image(t.image) for t in tasks]
  convs = [[chat.Message("user", t.question, prefix=tuple(vision_data.media_token_ids(m, tok))),
            chat.Message("assistant", t.answer)] for t, m in zip(tasks, items)]
  width = max(len(chat.render(tok, c)[0]) for c in convs)
  return zero_vision.encode(tok, convs, width), items


class Batches:
  """Per step, `train.batch` packed trajectory rows and (visual SFT) `train.visual_batch` rows
  of `per_row` visual conversations each, drawn without replacement by a generator seeded
  by (seed, step): a resumed run sees the same batches."""

  def __init__(self, config, model_cfg: K25Config, text: dict, visual=None):
    self.config, self.model_cfg = config, model_cfg
    self.text = sft.pack(text["tokens"], text["loss_mask"], text["length"], share_rows=True)
    self.width = self.text["inputs"].shape[1]
    if config.train.batch > len(self.text["inputs"]):
      raise ValueError(f"train.batch={config.train.batch} exceeds the {len(self.text['inputs'])} packed rows")
    self.visual = None
    if visual is not None:
      data, items = visual
      self.per_row = self.width // (data["tokens"].shape[1] - 1)
      rows = len(items) // self.per_row
      if rows < config.train.visual_batch:
        raise ValueError(f"data.visual_examples={len(items)} fill {rows} rows of {self.per_row}, fewer than "
                         f"train.visual_batch={config.train.visual_batch}")
      self.visual = self._pack_visual(data, rows)
      self.items = items
      self.max_patches = config.train.visual_batch * self.per_row * max(m.pixel_values.shape[0] for m in items)

  def _pack_visual(self, data: dict, rows: int) -> dict[str, np.ndarray]:
    """Conversation j goes to row j // per_row, segment j % per_row + 1, in order."""
    k, n = self.per_row, data["tokens"].shape[1] - 1
    out = {name: np.zeros((rows, self.width), dtype) for name, dtype in (
        ("inputs", np.int32), ("targets", np.int32), ("loss_mask", np.float32), ("positions", np.int32),
        ("segment_ids", np.int32))}
    for j in range(rows * k):
      r, at, length = j // k, (j % k) * n, int(data["length"][j]) - 1
      out["inputs"][r, at:at + length] = data["tokens"][j, :length]
      out["targets"][r, at:at + length] = data["tokens"][j, 1:length + 1]
      out["loss_mask"][r, at:at + length] = data["loss_mask"][j, 1:length + 1]
      out["positions"][r, at:at + length] = np.arange(length)
      out["segment_ids"][r, at:at + length] = j % k + 1
    return out

  def __call__(self, step: int) -> dict:
    rng = np.random.default_rng([self.config.train.seed, step])
    rows = np.sort(rng.choice(len(self.text["inputs"]), self.config.train.batch, replace=False))
    batch = {name: v[rows] for name, v in self.text.items()}
    if self.visual is None:
      return batch
    vis = np.sort(rng.choice(len(self.visual["inputs"]), self.config.train.visual_batch, replace=False))
    batch = {name: np.concatenate([batch[name], self.visual[name][vis]]) for name in batch}
    items = [self.items[r * self.per_row + s] for r in vis for s in range(self.per_row)]
    pixels, layout = tool_rollout.media_batch(items, self.model_cfg, self.config.train.visual_batch * self.per_row)
    return {**batch, "pixel_values": pixels, "layout": layout}


# ---------------------------------------------------------------------------------- eval
SETTINGS = {"text_tool": (False, True), "image_tool": (True, True), "image_no_tool": (True, False)}


def rollout_config(config, tool: bool = True) -> tool_rollout.RolloutConfig:
  e = config.eval
  return tool_rollout.RolloutConfig(max_turns=e.max_turns, max_context=e.max_context, turn_tokens=e.turn_tokens,
                                    tool=tool, output_chars=config.sandbox.output_chars)


def play(config, model_cfg: K25Config, params, tok, pool, tasks, *, image: bool, tool: bool, temperature: float,
         seed: int) -> list[tool_rollout.Transcript]:
  """One episode per task: the question alone (text) or after its image block, tool on or off."""
  sampling = sampler.SamplingConfig(max_new_tokens=config.eval.turn_tokens, temperature=temperature,
                                    stop_tokens=(tok.end_id,), pad_id=tok.pad_id,
                                    banned_tokens=tool_rollout.banned_tokens(tok))
  if not image:
    decode = tool_rollout.text_decoder(model_cfg.text, params[LM], sampling, seed, min_rows=pool.max_sessions)
    return tool_rollout.play(decode, tok, tasks, pool, rollout_config(config, tool))
  items = [vision_data.preprocess_image(t.image) for t in tasks]
  decode = tool_rollout.vision_decoder(model_cfg, params, sampling, lambda e: items[e], seed,
                                       min_rows=pool.max_sessions)
  return tool_rollout.play(decode, tok, tasks, pool, rollout_config(config, tool),
                           media=[vision_data.media_token_ids(m, tok) for m in items])


def evaluate(config, model_cfg: K25Config, params, tok, pool) -> dict[str, dict]:
  """Greedy rollouts on `eval.tasks` held-out tasks in each of SETTINGS (`eval.settings`)."""
  e = config.eval
  tasks = image_tasks.make_tasks(e.tasks, e.seed, config.data.image_size, kinds(config.data.kinds))
  out = {}
  for name in e.settings.split(","):
    name = name.strip()
    if name not in SETTINGS:
      raise ValueError(f"eval.settings names {name!r}; choose from {tuple(SETTINGS)}")
    image, tool = SETTINGS[name]
    transcripts = play(config, model_cfg, params, tok, pool, tasks, image=image, tool=tool, temperature=0.0,
                       seed=e.seed)
    out[name] = tool_rollout.summarize(transcripts, tasks)
  return out


def print_summary(results: dict[str, dict], n_tasks: int) -> None:
  print(f"\nSFT summary: {n_tasks} held-out image tasks, greedy rollouts with the sandboxed Python tool")
  print(f"{'setting':16s} {'accuracy':>9s} {'tool-call success':>18s} {'calls/episode':>14s} "
        + " ".join(f"{k:>8s}" for k in image_tasks.KINDS))
  for name, r in results.items():
    print(f"{name:16s} {r['accuracy']:9.3f} {r['tool_call_success']:18.3f} {r['calls_per_episode']:14.2f} "
          + " ".join(f"{r.get(f'{k}/accuracy', float('nan')):8.3f}" for k in image_tasks.KINDS))


# ------------------------------------------------------------------------------------- run
def check(config, model_cfg: K25Config, tok: chat.ChatTokenizer, mesh) -> None:
  text = model_cfg.text
  shards = int(np.prod([mesh.shape[axis] for axis in sharding.BATCH_AXES]))
  for name in ("batch", "visual_batch"):
    if config.train[name] % shards:
      raise ValueError(f"train.{name}={config.train[name]} must be a multiple of the {shards} batch shards "
                       "of the mesh (data × fsdp × expert)")
  if text.vocab_size < tok.vocab_size:
    raise ValueError(f"model.text.vocab_size={text.vocab_size} is below the chat vocabulary's {tok.vocab_size} "
                     "tokens (bytes, media, role tokens)")
  if config.eval.max_context > text.max_position_embeddings:
    raise ValueError(f"eval.max_context={config.eval.max_context} exceeds model.text.max_position_embeddings="
                     f"{text.max_position_embeddings}")
  if config.data.max_length > text.max_position_embeddings + 1:
    raise ValueError(f"data.max_length={config.data.max_length} exceeds model.text.max_position_embeddings + 1")


def run(config: ml_collections.ConfigDict, workdir: str):
  """Data, SFT (resumable), then held-out rollouts; writes workdir/sft_eval.json. Returns (state, results)."""
  multimodal.check_single_process(config.stage)
  tok = chat.ChatTokenizer()
  model_cfg = model_config(config, tok)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  check(config, model_cfg, tok, mesh)
  model = k25.K25(model_cfg)
  checkpoints = checkpoint.Checkpoints(workdir, keep=2)
  writer = loop.MetricWriter(workdir)
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  with make_pool(config) as pool:
    text = trajectories(config, tok, pool, workdir)
    visual = visual_examples(config, tok) if config.data.visual_sft else None
    batches = Batches(config, model_cfg, text, visual)
    logging.info("sft: %d zero-vision trajectories (%.0f tokens each, %.0f under the loss) in %d packed rows%s",
                 len(text["tokens"]), text["length"].mean(), text["loss_mask"].sum(1).mean(),
                 len(batches.text["inputs"]),
                 f"; {len(visual[1])} visual examples" if visual is not None else "")
    with jax.set_mesh(mesh):
      create, target = multimodal.init_state(config, model_cfg, tx, mesh)
      state = checkpoints.restore_latest(target)
      if state is None:
        warm = config.warm_start.checkpoint
        state = create(checkpoint.Checkpoints(warm, keep=1).restore_params(multimodal.params_target(model_cfg, mesh))
                       if warm else None)
      train_step = make_step(config, model, tx, with_media=visual is not None)
      counter = [int(state.step)]

      def next_batch():
        batch = batches(counter[0])
        counter[0] += 1
        return to_device(batch, mesh)

      state, _ = loop.train(
          state, train_step=train_step, next_batch=next_batch, total_steps=config.train.steps,
          tokens_per_step=(config.train.batch + (config.train.visual_batch if visual else 0)) * batches.width,
          log_every=config.train.log_every, eval_every=config.train.steps,
          checkpoint_every=config.train.checkpoint_every, evaluate_fn=None,
          save_fn=lambda n, s: checkpoints.save(n, s), writer=writer)
      results = evaluate(config, model_cfg, state.params, tok, pool)
  checkpoints.close()
  for name, r in results.items():   # (tool_call_success is nan without calls)
    writer.write(config.train.steps, {k: v for k, v in r.items() if np.isfinite(v)}, f"eval/{name}")
  writer.close()
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "sft_eval.json"), "w") as f:
      json.dump(results, f, indent=1)
  print_summary(results, config.eval.tasks)
  return state, results
