"""Joint RL of the K2.5 model: the K2.5 policy loss on text and image tasks grouped by ability,
with or without the Python tool.

Per iteration i, for P tasks x of `task.kinds` (image tasks: counting, locating, comparing,
reading, `k25jax.data.image_tasks`; open descriptions of scenes, `k25jax.data.descriptions`;
text tasks: 2-digit addition, `tasks.ArithmeticTask`), or
of the user's prompt files (`task.files`: a prompt, an optional image, a verifier)
and K episodes each (`k25jax.rl.driver` does the rest):

    prompt   = BOS <|user|> [<|media_begin|>image<|media_content|> N×<|media_pad|> <|media_end|>]
               question <|end|> <|assistant|>              (an image task: the model sees the image)
    episode  = multi-turn rollout under π_old (`k25jax.agents.tool_rollout`): with the tool
               (`rl.tool`), the model's code runs in a sandbox session holding the task's
               images; without it, a call gets an error observation and the model must answer itself
    r_j      = task.reward(answer_j)                       (1[correct]: exact answer; addition: any correct
               form; a record of the user's files, `task.files`: its verifier's score, k25jax/rl/prompt_files.py;
               a description: the GRM's verdict on it, `k25jax.rl.grm`, or with rl.describe_reward=rubric
               its hidden rubric; all of an iteration's descriptions judged in one batch)
    r_j     ← r_j · 1[acc(x) < λ  or  |y_j| ≤ budget(x)]   with Toggle (`toggle.enabled`), in phase 0
               (`k25jax.rl.toggle`; |y_j| the episode's generated tokens, budgets from the start)
    A_j      = r_j − mean_k r_k,  θ ← θ − η ∇ L_K2.5(θ)  over the generated tokens only (tool
               outputs and the prompt are context), log π_θ from the K2.5 forward with the
               same images (a minibatch without any: the text-only forward), over the tokens
               the sampler may draw

The tasks are grouped by ability, not modality (`tasks.ABILITIES`: arithmetic,
visual_counting, visual_reading, visual_spatial, visual_description); accuracy and generated
length are logged per ability, in training and in the held-out evaluation (descriptions: the
hidden rubric too, and in training the judge's reward beside it, `describe_rewards`). The start is a K2.5 checkpoint
(`init.checkpoint`): the zero-vision SFT's, a text+vision SFT's, or joint pre-training's
(no SFT). Held-out evaluation: sampled accuracy (the training temperature,
`rl.eval_samples` per task) and greedy accuracy, with the tool-call success rate and calls
per episode.
"""
from __future__ import annotations

import dataclasses
import os

import ml_collections
import numpy as np

from k25jax.agents import tool_rollout
from k25jax.data import chat_formats, descriptions, image_tasks, tool_formats
from k25jax.data import vision as vision_data
from k25jax.model import k25
from k25jax.model.config import K25Config
from k25jax.rl import driver, grm, media_rows, prompt_files, rollout, sampler, tasks, toggle
from k25jax.train import config_utils, model_record, multimodal, sharding, trainer as trainer_lib

ROW_FEATURES = ("inputs", "targets", "positions", "segment_ids", "mask", "old_logp", "advantages", "rewards")


# ---------------------------------------------------------------------------- the tasks
TASK_KINDS = ("addition",) + image_tasks.KINDS + (descriptions.KIND,)   # addition: text only; describe: open


def parse_kinds(text: str) -> tuple[str, ...]:
  """The task kinds of `task.kinds` (comma-separated, a subset of TASK_KINDS)."""
  names = tuple(k.strip() for k in text.split(",") if k.strip())
  if not names or set(names) - set(TASK_KINDS):
    raise ValueError(f"task.kinds={text!r}; a comma-separated subset of {TASK_KINDS}")
  return names


def make_tasks(n: int, seed: int, kinds: tuple[str, ...], image_size: int, exclude: frozenset = frozenset()) -> list:
  """n tasks, kinds in turn (task i has kind kinds[i % len(kinds)]); the image tasks are
  `image_tasks.make_tasks` of the image kinds, the addition tasks `tasks.arithmetic_tasks`
  (none with operands in `exclude`), the descriptions `descriptions.make_tasks` (56×56 scenes)."""
  picks = [kinds[i % len(kinds)] for i in range(n)]
  image_kinds = tuple(k for k in kinds if k in image_tasks.KINDS)
  images = iter(image_tasks.make_tasks(sum(k in image_kinds for k in picks), seed, image_size, image_kinds)
                if image_kinds else [])
  made = {"addition": iter(tasks.arithmetic_tasks(picks.count("addition"), seed, exclude)),
          descriptions.KIND: iter(descriptions.make_tasks(picks.count(descriptions.KIND), seed))}
  return [next(made[kind]) if kind in made else next(images) for kind in picks]


@dataclasses.dataclass
class TaskSplit:
  """Tasks with their preprocessed images (None for a text-only task)."""

  tasks: list
  items: list[vision_data.Media | None]

  @classmethod
  def of(cls, made: list, max_patches: int = vision_data.IMAGE_MAX_PATCHES) -> "TaskSplit":
    """`made` with their images preprocessed (at most `max_patches` patches each)."""
    return cls(made, [vision_data.preprocess_image(t.image, max_patches=max_patches) if t.images else None
                      for t in made])

  @classmethod
  def make(cls, n: int, seed: int, config, held_out_from: "TaskSplit | None" = None) -> "TaskSplit":
    """`held_out_from`: the training split, whose sums this split must not repeat."""
    seen = frozenset((t.a, t.b) for t in held_out_from.tasks if t.kind == "addition") if held_out_from else frozenset()
    return cls.of(make_tasks(n, seed, parse_kinds(config.task.kinds), config.task.image_size, seen))

  @classmethod
  def from_config(cls, config) -> tuple["TaskSplit", "TaskSplit"]:
    """(training split, held-out split): the generated tasks of `task.kinds`, or with `task.files`
    the records of the user's files (`prompt_files.vision_tasks`), their images scaled to at most
    the patches of a `task.image_size` square."""
    task = config.task
    if task.files:
      train, held_out = prompt_files.vision_tasks(task)
      budget = max(1, task.image_size // vision_data.PATCH_SIZE) ** 2
      return cls.of(train, budget), cls.of(held_out, budget)
    train = cls.make(task.train_prompts, task.seed, config)
    return train, cls.make(task.eval_prompts, task.seed + 1, config, held_out_from=train)

  def take(self, rows) -> "TaskSplit":
    return TaskSplit([self.tasks[r] for r in rows], [self.items[r] for r in rows])

  @property
  def patches_per_row(self) -> int:
    """The largest image's patches (every row's media budget), 1 when no task has an image."""
    return max([m.pixel_values.shape[0] for m in self.items if m is not None], default=1)


def ability_metrics(transcripts, split_tasks) -> dict[str, float]:
  """Accuracy and generated tokens per ability (`tasks.ABILITIES`) of the episodes, and for
  descriptions the mean hidden rubric (`descriptions.rubric`)."""
  out = {}
  for ability in dict.fromkeys(tasks.ABILITIES[t.kind] for t in split_tasks):
    chosen = [(e, t) for e, t in zip(transcripts, split_tasks) if tasks.ABILITIES[t.kind] == ability]
    out[f"{ability}/accuracy"] = float(np.mean([t.grade(e.answer) for e, t in chosen]))
    out[f"{ability}/length"] = float(np.mean([sum(e.loss_mask) for e, _ in chosen]))
    if all(t.kind == descriptions.KIND for _, t in chosen):
      out[f"{ability}/rubric"] = float(np.mean([t.rubric(e.answer) for e, t in chosen]))
  return out


def describe_rewards(config, judge: grm.Judge | None, episodes: TaskSplit, transcripts,
                     reward: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
  """The description episodes' rewards: the judge's verdicts (`rl.describe_reward=grm`, all of
  the iteration's descriptions in one batched judgement) or the hidden rubric (`=rubric`, the
  upper bound; `reward` holds it). With a judge, both are logged, with their gap (judge minus
  rubric: reward hacking shows as a gap that grows), unparsable verdicts and the judge's time."""
  rows = [i for i, t in enumerate(episodes.tasks) if t.kind == descriptions.KIND]
  if not rows or judge is None:
    return reward, {}
  picked = [episodes.tasks[i] for i in rows]
  judged = judge.judge([t.question for t in picked], [transcripts[i].answer for i in rows],
                       [episodes.items[i] for i in rows], [t.answer for t in picked])
  rubric = reward[rows]
  metrics = {"visual_description/grm_reward": float(judged.rewards.mean()),
             "visual_description/gap": float((judged.rewards - rubric).mean()),
             "grm_unparsable": judged.unparsable / judged.verdicts.size, "grm_too_long": judged.too_long / len(rows),
             "grm_s": judged.seconds,
             "grm_tokens": float(judged.tokens)}
  if config.rl.describe_reward == "grm":
    reward = reward.copy()
    reward[rows] = judged.rewards
  return reward, metrics


def play(config, model_cfg: K25Config, params, fmt, pool, split: TaskSplit, *, temperature: float, seed: int,
         per_row: int):
  """One episode per task of `split` (with the tool if `rl.tool`)."""
  r = config.rl
  sampling = sampler.SamplingConfig(max_new_tokens=r.turn_tokens, temperature=temperature, top_k=r.top_k,
                                    top_p=r.top_p, stop_tokens=(fmt.stop_id,), pad_id=fmt.pad_id,
                                    banned_tokens=tool_rollout.banned_tokens(fmt.tokenizer))
  decode = tool_rollout.vision_decoder(model_cfg, params, sampling, lambda e: split.items[e], seed,
                                       min_rows=pool.max_sessions, per_row=per_row)
  rollout_config = tool_rollout.RolloutConfig(max_turns=r.max_turns, max_context=r.max_context,
                                              turn_tokens=r.turn_tokens, tool=r.tool,
                                              output_chars=config.sandbox.output_chars)
  return tool_rollout.play(decode, fmt, split.tasks, pool, rollout_config, media=split.items)


def toggle_budgets(config, model_cfg: K25Config, params, fmt, pool, split: TaskSplit, per_row: int) -> np.ndarray:
  """budget(x) for every training task: the ρ-percentile of the generated tokens of the
  starting policy's correct episodes (toggle.budget_samples a task, at rl.temperature)."""
  rows = np.arange(len(split.tasks))
  k = config.toggle.budget_samples
  episodes = split.take(np.repeat(rows, k))
  transcripts = play(config, model_cfg, params, fmt, pool, episodes, temperature=config.rl.temperature,
                     seed=config.train.seed + 7, per_row=per_row)
  correct = [task.grade(t.answer) for t, task in zip(transcripts, episodes.tasks)]
  return toggle.budgets(config.toggle, [sum(t.loss_mask) for t in transcripts], correct, np.repeat(rows, k), len(rows))


def collector(config, model_cfg: K25Config, fmt, pool, split: TaskSplit, per_row: int, budgets: np.ndarray,
              judge: grm.Judge | None = None):
  """collect(params, i): iteration i's P tasks × K episodes, graded (descriptions by the judge,
  `describe_rewards`), Toggle-shaped, as loss rows with their images."""
  r, k, seed = config.rl, config.rl.num_generations, config.train.seed

  def collect(params, it: int) -> driver.Rollouts:
    rows = np.random.default_rng([seed, it]).choice(len(split.tasks), r.prompts_per_iteration, replace=False)
    episodes = split.take(np.repeat(rows, k))
    transcripts = play(config, model_cfg, params, fmt, pool, episodes, temperature=r.temperature,
                       seed=seed * 7919 + it, per_row=per_row)
    reward = np.array([task.reward(t.answer) for t, task in zip(transcripts, episodes.tasks)], np.float32)
    reward, judged = describe_rewards(config, judge, episodes, transcripts, reward)
    correct = np.array([task.grade(t.answer) for t, task in zip(transcripts, episodes.tasks)], bool)
    lengths = np.array([sum(t.loss_mask) for t in transcripts], np.float32)
    shaped, phase = toggle.shape_rewards(config.toggle, k, it, reward, correct, lengths,
                                         np.repeat(budgets[rows], k))
    return driver.Rollouts(rollout.loss_rows(transcripts, r.max_context, fmt.pad_id), shaped,
                           {"reward": float(reward.mean()), "shaped_reward": float(shaped.mean()),
                            "toggle_phase": phase, **tool_rollout.summarize(transcripts, episodes.tasks),
                            **ability_metrics(transcripts, episodes.tasks), **judged},
                           media=episodes.items)
  return collect


def device_minibatch(rows: dict, items, model_cfg: K25Config, mesh, per_row: int) -> dict:
  """Rows over the batch axes; their images (one per row at most, in row order) padded to
  `per_row` patches a row and replicated; a minibatch without images, the rows alone."""
  media = media_rows.media_batch(items, model_cfg, len(items), per_row)
  return multimodal.to_device(rows if media is None else {**rows, "pixel_values": media[0], "layout": media[1]},
                              mesh)


def evaluate(config, model_cfg, params, fmt, pool, split: TaskSplit, per_row: int) -> dict[str, float]:
  """Sampled (rl.eval_samples per task, training temperature) and greedy held-out metrics,
  overall and per ability."""
  k = config.rl.eval_samples
  repeated = split.take(np.repeat(np.arange(len(split.tasks)), k))
  sampled = play(config, model_cfg, params, fmt, pool, repeated, temperature=config.rl.temperature,
                 seed=config.train.seed + 1, per_row=per_row)
  greedy = play(config, model_cfg, params, fmt, pool, split, temperature=0.0, seed=config.train.seed + 1,
                per_row=per_row)
  out = {**tool_rollout.summarize(sampled, repeated.tasks), **ability_metrics(sampled, repeated.tasks)}
  out["greedy_accuracy"] = tool_rollout.summarize(greedy, split.tasks)["accuracy"]
  out.update({f"greedy_{name}": v for name, v in ability_metrics(greedy, split.tasks).items()
              if name.endswith(("/accuracy", "/rubric"))})
  return out


# ------------------------------------------------------------------------------------- run
def check(config) -> None:
  """The stage's config check: prompt files' fields, the start, the chat format (the one the
  init checkpoint's SFT trained in, where its workdir records one), the driver's fields."""
  if config.task.files:
    prompt_files.check(config.task)
  if not config.init.checkpoint:
    raise ValueError("the rl_vision stage starts from a K2.5 checkpoint: set init.checkpoint to a workdir of "
                     "configs/sft.py (zero-vision SFT) or of joint pre-training")
  if config.task.chat_format not in tool_formats.NAMES:
    raise ValueError(f"config: task.chat_format={config.task.chat_format!r}: must be one of {tool_formats.NAMES}")
  if os.path.isfile(os.path.join(config.init.checkpoint, model_record.FILE)):
    trained = (model_record.read(config.init.checkpoint)[1] or {}).get("chat")
    if trained is not None and trained != config.task.chat_format:
      raise ValueError(f"config: task.chat_format={config.task.chat_format!r}, but init.checkpoint="
                       f"{config.init.checkpoint!r} was trained in the {trained!r} chat format"
                       + (" (configs/rl.py:vision,k25_format)" if trained == "k2.5" else ""))
  check_describe(config)
  driver.check(config)


DESCRIBE_REWARDS = ("grm", "rubric")


def describes(config) -> bool:
  """Whether the run's tasks include descriptions (generated ones: `task.kinds`)."""
  return not config.task.files and descriptions.KIND in parse_kinds(config.task.kinds)


def check_describe(config) -> None:
  """The description task's reward: a judge to load (`grm.checkpoint`, its section's fields) or
  the hidden rubric."""
  if config.rl.describe_reward not in DESCRIBE_REWARDS:
    raise ValueError(f"config: rl.describe_reward={config.rl.describe_reward!r}: must be one of {DESCRIBE_REWARDS}")
  if describes(config) and config.rl.describe_reward == "grm" and not config.grm.checkpoint:
    raise ValueError("config: task.kinds has describe, rewarded by the GRM (rl.describe_reward='grm'): set "
                     "grm.checkpoint to a judge (a workdir of configs/grm.py), or rl.describe_reward='rubric'")
  if config.grm.checkpoint:
    grm.check(config.grm)


def run(config: ml_collections.ConfigDict, workdir: str):
  """Vision RL from `init.checkpoint`; resumes from workdir/checkpoints. Returns (state, history)."""
  check(config)
  fmt = tool_formats.get(config.task.chat_format)
  tok = fmt.tokenizer
  model = k25.K25(config_utils.k25_config_from(config.model, tok))
  mesh = sharding.make_mesh(config.mesh.to_dict())
  train_split, eval_split = TaskSplit.from_config(config)
  per_row = max(train_split.patches_per_row, eval_split.patches_per_row)
  by_ability = [f"{ability}/accuracy" for ability in dict.fromkeys(tasks.ABILITIES[t.kind] for t in eval_split.tasks)]
  by_ability += ["visual_description/rubric"] if describes(config) else []
  # the frozen judge of the descriptions, loaded (one device) before the run's mesh is set, then replicated on it
  judge = grm.Judge.load(config.grm, mesh, seed=config.train.seed + 11) if describes(config) and \
      config.grm.checkpoint else None
  with tool_rollout.sandbox_pool(config.sandbox) as pool, \
      trainer_lib.Trainer.for_config(config, workdir, model, driver.make_optimizer(config), mesh,
                                     tokenizer=chat_formats.record_of(tok)) as trainer:
    state = trainer.start(config.init)
    budgets = (toggle.fixed_budgets(workdir, lambda: toggle_budgets(config, model.cfg, state.params, fmt, pool,
                                                                    train_split, per_row))
               if config.toggle.enabled else np.zeros(len(train_split.tasks), np.float32))
    return driver.train(
        trainer, state, config, collect=collector(config, model.cfg, fmt, pool, train_split, per_row, budgets, judge),
        evaluate=lambda params: evaluate(config, model.cfg, params, fmt, pool, eval_split, per_row),
        name="rl_vision", log_keys=("reward", "tool_call_success", "calls_per_episode", "visual_description/grm_reward",
                                    "visual_description/rubric", "loss", "sample_s", "grm_s", "train_s"),
        eval_keys=("accuracy", "greedy_accuracy", "tool_call_success", "calls_per_episode", "generated_tokens",
                   *by_ability),
        summary_keys=("accuracy", "greedy_accuracy", "tool_call_success", *by_ability),
        banned=tool_rollout.banned_tokens(tok),
        batch_specs=multimodal.batch_specs(True, ROW_FEATURES),
        to_device=lambda rows, rollouts, part: device_minibatch(rows, rollouts.media[part], model.cfg, mesh, per_row))
