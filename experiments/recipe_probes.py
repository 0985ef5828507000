"""The held-out probes of the recipe (experiments/recipe.py): the same measurements of the one
K2.5 model after every stage.

    text_loss      next-token cross-entropy (nats/token) on rows of 128 tokens of the held-out
                   text documents (every 50th document of the pre-training source, never trained on)
    long_text_loss the same on rows of 1,024 tokens of held-out documents of up to 8,000
                   characters (mid-training's rows; past the base model's 512 positions)
    caption_loss   cross-entropy (nats/token) on the answers of held-out caption samples
    count_loss     the same on counting samples (samples of a seed no stage trains on)
    caption_exact  share of those caption samples whose whole answer greedy decoding gives
    count_exact    the same for counting (teacher-forced argmax at every answer token,
                   `multimodal.answer_metrics`)
    arithmetic     greedy accuracy on 2-digit sums in the chat format, operands that no SFT
                   example had (the SFT stage's held-out sums, `sft.held_out_arithmetic`)
    image_tool     greedy accuracy on held-out image tasks, the image in the prompt and the
                   sandboxed Python tool available (the SFT stage's `image_tool` setting)
    description    the hidden rubric (`descriptions.rubric`: true facts of the scene claimed,
                   minus false ones, over its facts) of greedy descriptions of held-out scenes,
                   the image in the prompt, no tool (joint RL's GRM-rewarded ability)
    tool_calls     calls per image_tool episode, and tool_call_success, the share that ran
    arithmetic_tokens, image_tool_tokens   generated tokens per episode of those two probes
                   (what Toggle shortens)
    parl_item_f1   greedy Item-F1 of held-out wide-search tasks (PARL's task mix, its eval seed)
                   played in the chat format by the decoder as orchestrator and sub-agents
    parl_subagents sub-agents created per wide episode there

Text and vision rows come from `k25jax.data.mixture` with the byte tokenizer with media
tokens (the ids of the chat tokenizer below 263); the rollouts use the chat tokenizer.
"""
from __future__ import annotations

import jax
import ml_collections
import numpy as np

from k25jax.agents import tool_rollout
from k25jax.data import descriptions, mixture, sources, tokenizer, tool_formats
from k25jax.model import k25
from k25jax.stages import parl, sft
from k25jax.train import multimodal, objective

PROBES = ("text_loss", "long_text_loss", "caption_loss", "count_loss", "caption_exact", "count_exact", "arithmetic",
          "image_tool", "description", "parl_item_f1")
EXTRAS = ("tool_calls", "arithmetic_tokens", "image_tool_tokens", "parl_subagents")   # in the table, not
                                                                                     # probes a stage must raise
LOSSES = PROBES[:4]     # lower is better
VISION_SEED = 99991        # the held-out vision samples' stream (the stages draw train.seed, +1)
TEXT_SOURCE, TEXT_EVAL_EVERY, TEXT_MAX_CHARS, LONG_MAX_CHARS = "python_stdlib", 50, 1000, 8000


class Probes:
  """The held-out data, made once; `__call__(model_cfg, params, mesh)` measures one model."""

  def __init__(self, sft_config: ml_collections.ConfigDict, parl_config: ml_collections.ConfigDict, *,
               rows: int = 8, seq_len: int = 128,
               text_batches: int = 4, vision_batches: int = 4, max_patches: int = 512, tasks: int = 32,
               long_rows: int = 2, long_seq_len: int = 1024, long_batches: int = 2):
    byte_tok = tokenizer.ByteTokenizer(media=True)
    _, held_out = sources.split(sources.load(TEXT_SOURCE, TEXT_MAX_CHARS), TEXT_EVAL_EVERY)
    kw = dict(tok=byte_tok, batch=rows, seq_len=seq_len, total_steps=1, max_patches=max_patches)
    text = mixture.mixture(docs=held_out, schedule=mixture.VisionSchedule(0.0), tasks=("caption",), seed=0,
                           shuffle=False, **kw)
    _, long_docs = sources.split(sources.load(TEXT_SOURCE, LONG_MAX_CHARS), TEXT_EVAL_EVERY)
    long = mixture.mixture(docs=long_docs, schedule=mixture.VisionSchedule(0.0), tasks=("caption",), seed=0,
                           shuffle=False, **dict(kw, batch=long_rows, seq_len=long_seq_len))
    self.host = {"text": [next(text) for _ in range(text_batches)],
                 "long_text": [next(long) for _ in range(long_batches)]}
    for task in ("caption", "count"):
      stream = mixture.mixture(docs=None, schedule=mixture.VisionSchedule(1.0), tasks=(task,), seed=VISION_SEED,
                               **kw)
      self.host[task] = [next(stream) for _ in range(vision_batches)]
    self.max_patches = max_patches
    self.sft_config = sft_config.copy_and_resolve_references()
    self.format = tool_formats.get(self.sft_config.data.chat_format)
    self.sft_config.eval.update(tasks=tasks, settings="image_tool")
    sums = sft.arithmetic_examples(self.sft_config, self.format)
    self.arithmetic = sft.held_out_arithmetic(self.sft_config,
                                              set(zip(sums["a"].tolist(), sums["b"].tolist())))[:tasks]
    self.descriptions = descriptions.make_tasks(tasks, VISION_SEED)
    self.parl_config = parl_config
    self.parl_tasks = parl.sample_tasks(parl_config, tasks, parl_config.parl.eval_seed)

  def __call__(self, model_cfg, params, mesh: jax.sharding.Mesh) -> dict[str, float]:
    """Every probe of the K2.5 model `model_cfg` with `params` (sharded over `mesh`)."""
    model = k25.K25(model_cfg)
    loss_fn = objective.next_token(model)

    @jax.jit
    def step(p, batch):
      loss, (metrics, _) = loss_fn(p, batch, None)
      return {**metrics, "loss": loss}

    out = {}
    with jax.set_mesh(mesh):
      for name, batches in self.host.items():
        device = [multimodal.to_device(multimodal.device_features(b, model_cfg, self.max_patches), mesh)
                  for b in batches]
        m = multimodal.evaluate(step, params, device)
        out[f"{name}_loss"] = m["cross_entropy"]
        if name in ("caption", "count"):
          out[f"{name}_exact"] = m["answer_exact"]
      with tool_rollout.sandbox_pool(self.sft_config.sandbox) as pool:
        rollouts = sft.evaluate(self.sft_config, model_cfg, params, self.format, pool, self.arithmetic)
        described = sft.play(self.sft_config, model_cfg, params, self.format, pool, self.descriptions, image=True,
                             tool=False, temperature=0.0, seed=self.sft_config.eval.seed)
      decoder = params[k25.LANGUAGE_MODEL]
      swarm, _, _ = parl.play(self.parl_config, model_cfg.text, decoder, decoder, self.parl_tasks, greedy=True)
    swarm = parl.summarize(swarm, 0.0)
    out.update(arithmetic=rollouts["arithmetic"]["accuracy"],
               arithmetic_tokens=rollouts["arithmetic"]["generated_tokens"])
    image = rollouts["image_tool"]
    out.update(image_tool=image["accuracy"], image_tool_tokens=image["generated_tokens"],
               tool_calls=image["calls_per_episode"],
               tool_call_success=image["tool_call_success"], parl_item_f1=swarm["item_f1"],
               description=float(np.mean([t.rubric(e.answer) for e, t in zip(described, self.descriptions)])),
               parl_subagents=swarm.get("wide/num_created", 0.0))
    return out
