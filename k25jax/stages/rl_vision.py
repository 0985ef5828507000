"""Vision RL: the K2.5 policy loss on image tasks, the image in the prompt, with or without the Python tool.

Per iteration i, for P tasks x (an image and a question: counting, locating, comparing,
reading; `k25jax.data.image_tasks`) and K episodes each (`k25jax.rl.driver` does the rest):

    prompt   = BOS <|user|> <|media_begin|>image<|media_content|> N×<|media_pad|> <|media_end|>
               question <|end|> <|assistant|>              (the K2.5 model sees the image)
    episode  = multi-turn rollout under π_old (`k25jax.agents.tool_rollout`): with the tool
               (`rl.tool`), the model's code runs in a sandbox session holding the image;
               without it, a call gets an error observation and the model must answer itself
    r_j      = 1[answer_j = ground truth]
    A_j      = r_j − mean_k r_k,  θ ← θ − η ∇ L_K2.5(θ)  over the generated tokens only (tool
               outputs and the prompt are context), log π_θ from the K2.5 forward with the
               same image, over the tokens the sampler may draw

The start is a K2.5 checkpoint (`init.checkpoint`): the zero-vision SFT's, a text+vision
SFT's, or joint pre-training's (no SFT). Held-out evaluation: sampled accuracy (the
training temperature, `rl.eval_samples` per task) and greedy accuracy, with the tool-call
success rate and calls per episode.
"""
from __future__ import annotations

import dataclasses

import ml_collections
import numpy as np

from k25jax.agents import tool_rollout
from k25jax.data import chat, image_tasks
from k25jax.data import vision as vision_data
from k25jax.model import k25
from k25jax.model.config import K25Config
from k25jax.rl import driver, rollout, sampler
from k25jax.train import config_utils, multimodal, sharding, trainer as trainer_lib

ROW_FEATURES = ("inputs", "targets", "positions", "segment_ids", "mask", "old_logp", "advantages", "rewards")


# ---------------------------------------------------------------------------- the tasks
@dataclasses.dataclass
class TaskSplit:
  """Tasks with their preprocessed images and the prompts' media blocks."""

  tasks: list[image_tasks.ImageTask]
  items: list[vision_data.Media]
  blocks: list[list[int]]

  @classmethod
  def make(cls, n: int, seed: int, config, tok: chat.ChatTokenizer) -> "TaskSplit":
    tasks = image_tasks.make_tasks(n, seed, config.task.image_size,
                                   image_tasks.parse_kinds(config.task.kinds, "task.kinds"))
    items = [vision_data.preprocess_image(t.image) for t in tasks]
    return cls(tasks, items, [vision_data.media_token_ids(m, tok) for m in items])

  def take(self, rows) -> "TaskSplit":
    return TaskSplit([self.tasks[r] for r in rows], [self.items[r] for r in rows], [self.blocks[r] for r in rows])


def play(config, model_cfg: K25Config, params, tok, pool, split: TaskSplit, *, temperature: float, seed: int):
  """One episode per task of `split` (with the tool if `rl.tool`)."""
  r = config.rl
  sampling = sampler.SamplingConfig(max_new_tokens=r.turn_tokens, temperature=temperature, top_k=r.top_k,
                                    top_p=r.top_p, stop_tokens=(tok.end_id,), pad_id=tok.pad_id,
                                    banned_tokens=tool_rollout.banned_tokens(tok))
  decode = tool_rollout.vision_decoder(model_cfg, params, sampling, lambda e: split.items[e], seed,
                                       min_rows=pool.max_sessions)
  rollout_config = tool_rollout.RolloutConfig(max_turns=r.max_turns, max_context=r.max_context,
                                              turn_tokens=r.turn_tokens, tool=r.tool,
                                              output_chars=config.sandbox.output_chars)
  return tool_rollout.play(decode, tok, split.tasks, pool, rollout_config, media=split.blocks)


def collector(config, model_cfg: K25Config, tok, pool, split: TaskSplit):
  """collect(params, i): iteration i's P tasks × K episodes, graded, as loss rows with their images."""
  r, k, seed = config.rl, config.rl.num_generations, config.train.seed

  def collect(params, it: int) -> driver.Rollouts:
    rows = np.random.default_rng([seed, it]).choice(len(split.tasks), r.prompts_per_iteration, replace=False)
    episodes = split.take(np.repeat(rows, k))
    transcripts = play(config, model_cfg, params, tok, pool, episodes, temperature=r.temperature,
                       seed=seed * 7919 + it)
    reward = np.array([image_tasks.grade(t.answer, task.answer) for t, task in zip(transcripts, episodes.tasks)],
                      np.float32)
    return driver.Rollouts(rollout.loss_rows(transcripts, r.max_context, tok.pad_id), reward,
                           {"reward": float(reward.mean()), **tool_rollout.summarize(transcripts, episodes.tasks)},
                           media=episodes.items)
  return collect


def device_minibatch(rows: dict, items, model_cfg: K25Config, mesh) -> dict:
  """Rows over the batch axes; their images (one per row, in row order) padded to one item per
  row and replicated."""
  pixels, layout = tool_rollout.media_batch(items, model_cfg, len(items))
  return multimodal.to_device({**rows, "pixel_values": pixels, "layout": layout}, mesh)


def evaluate(config, model_cfg, params, tok, pool, split: TaskSplit) -> dict[str, float]:
  """Sampled (rl.eval_samples per task, training temperature) and greedy held-out metrics."""
  k = config.rl.eval_samples
  repeated = split.take(np.repeat(np.arange(len(split.tasks)), k))
  sampled = play(config, model_cfg, params, tok, pool, repeated, temperature=config.rl.temperature,
                 seed=config.train.seed + 1)
  greedy = play(config, model_cfg, params, tok, pool, split, temperature=0.0, seed=config.train.seed + 1)
  out = tool_rollout.summarize(sampled, repeated.tasks)
  out["greedy_accuracy"] = tool_rollout.summarize(greedy, split.tasks)["accuracy"]
  return out


# ------------------------------------------------------------------------------------- run
def check(config) -> None:
  if not config.init.checkpoint:
    raise ValueError("the rl_vision stage starts from a K2.5 checkpoint: set init.checkpoint to a workdir of "
                     "configs/sft.py (zero-vision SFT) or of joint pre-training")
  driver.check(config)


def run(config: ml_collections.ConfigDict, workdir: str):
  """Vision RL from `init.checkpoint`; resumes from workdir/checkpoints. Returns (state, history)."""
  multimodal.check_single_process(config.stage)
  check(config)
  tok = chat.ChatTokenizer()
  model = k25.K25(config_utils.k25_config_from(config.model, tok))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  train_split = TaskSplit.make(config.task.train_prompts, config.task.seed, config, tok)
  eval_split = TaskSplit.make(config.task.eval_prompts, config.task.seed + 1, config, tok)
  with tool_rollout.sandbox_pool(config.sandbox) as pool, \
      trainer_lib.Trainer.for_config(config, workdir, model, driver.make_optimizer(config), mesh) as trainer:
    state = trainer.start(config.init)
    return driver.train(
        trainer, state, config, collect=collector(config, model.cfg, tok, pool, train_split),
        evaluate=lambda params: evaluate(config, model.cfg, params, tok, pool, eval_split),
        name="rl_vision", log_keys=("reward", "tool_call_success", "calls_per_episode", "loss", "sample_s", "train_s"),
        eval_keys=("accuracy", "greedy_accuracy", "tool_call_success", "calls_per_episode", "generated_tokens"),
        summary_keys=("accuracy", "greedy_accuracy", "tool_call_success"), banned=tool_rollout.banned_tokens(tok),
        batch_specs=multimodal.batch_specs(True, ROW_FEATURES),
        to_device=lambda rows, rollouts, part: device_minibatch(rows, rollouts.media[part], model.cfg, mesh))
