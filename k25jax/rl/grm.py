"""A generative reward model (GRM): a frozen judge model reads the task, the response (and
the image) and writes a judgement that ends in a verdict; the verdict is the reward.

    prompt_i  = the judge's chat (`data.judgements.messages`): its image, the task's question,
                the response (and with `reference` the true answer), then the assistant's turn
    y_{i,s}   ~ judge(· | prompt_i)               s = 1..S (`samples`) at `temperature`, all
                                                  n·S rows in ONE batched decode (`rl.decode`)
    v_{i,s}   = k / max_score  where `Score: k/max_score` ends y_{i,s} (the `verdict` pattern),
                0 when it does not parse (counted)
    r_i       = mean_s v_{i,s}                    (aggregate="mean")
              | the most frequent v_{i,s}, ties → their mean          (aggregate="vote")

as GenRM / DeepSeek-GRM judge (a critique, then a score; several judgements averaged or
voted), but in the same JAX program as the policy: the judge's params are placed on the
run's mesh (replicated) and decoded with the policy's sampler.

The judge is any K2.5 model this stack loads (`train.saved_model`: a k25jax workdir, e.g.
configs/grm.py's, or a Hugging Face folder) whose tokenizer speaks Kimi K2.5's chat format;
its prompts carry an empty system turn (no default system prompt to spend positions on).
"""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Sequence

import jax
import ml_collections
import numpy as np

from k25jax.data import chat, chat_formats, judgements, vision as vision_data
from k25jax.model import k25
from k25jax.model.config import K25Config
from k25jax.rl import decode, media_rows, sampler
from k25jax.train import saved_model, sharding

AGGREGATES = ("mean", "vote")
WIDTH_MULTIPLE = 64     # judge prompts are padded to a multiple of this (few sampler shapes)


def check(grm: ml_collections.ConfigDict) -> None:
  """The `grm` section's errors (configs/common.py: `grm_section`), naming the field."""
  if grm.samples < 1:
    raise ValueError(f"config: grm.samples={grm.samples}: judgements per response must be >= 1")
  if grm.aggregate not in AGGREGATES:
    raise ValueError(f"config: grm.aggregate={grm.aggregate!r}: must be one of {AGGREGATES}")
  if grm.max_score < 1 or grm.max_new_tokens < 1 or grm.temperature < 0:
    raise ValueError("config: grm.max_score and grm.max_new_tokens must be >= 1 and grm.temperature >= 0")
  try:
    pattern = re.compile(grm.verdict)
  except re.error as e:
    raise ValueError(f"config: grm.verdict={grm.verdict!r} is not a regular expression ({e})") from None
  if pattern.groups != 1:
    raise ValueError(f"config: grm.verdict={grm.verdict!r} needs exactly one group, the score")


def parse_verdict(text: str | None, pattern: re.Pattern, max_score: int) -> float | None:
  """k / max_score where `pattern` (one group: k) matches the judgement's end; None when it
  does not, or k is not a whole number in [0, max_score]."""
  if text is None:
    return None
  found = pattern.search(text.strip())
  if found is None:
    return None
  try:
    k = int(found.group(1))
  except (TypeError, ValueError):      # a user's pattern whose group caught no whole number
    return None
  return k / max_score if 0 <= k <= max_score else None


def aggregate(verdicts: np.ndarray, how: str) -> np.ndarray:
  """[n, S] verdicts (NaN: unparsable, counted as 0) → [n] rewards (module docstring)."""
  values = np.nan_to_num(verdicts, nan=0.0)
  if how == "mean":
    return values.mean(axis=1)
  out = np.empty(len(values))
  for i, row in enumerate(values):
    kinds, counts = np.unique(row, return_counts=True)
    out[i] = kinds[counts == counts.max()].mean()
  return out


@dataclasses.dataclass(frozen=True)
class Judgements:
  """A batch's judgements: `rewards` [n], `verdicts` [n, samples] (NaN where unparsable),
  the judges' texts (None: not judged), the count of unparsable verdicts, the judge's wall
  time and generated tokens, and the responses too long to judge."""

  rewards: np.ndarray
  verdicts: np.ndarray
  texts: list[list[str | None]]
  unparsable: int
  seconds: float
  tokens: int
  too_long: int = 0


class Judge:
  """A frozen judge model and the `grm` section it judges by."""

  def __init__(self, saved: saved_model.SavedModel, grm: ml_collections.ConfigDict, mesh=None, seed: int = 0):
    check(grm)
    if not isinstance(saved.cfg, K25Config) or saved.tokenizer is None:
      raise ValueError("grm.checkpoint: the judge must be a K2.5 model with a tokenizer (it reads the image)")
    self.format = chat_formats.for_tokenizer(saved.tokenizer)
    if self.format.name != "k2.5":
      raise ValueError(f"grm.checkpoint: the judge speaks the {self.format.name!r} chat format; it must speak "
                       "Kimi K2.5's (configs/grm.py trains one)")
    self.cfg, self.grm = saved.cfg, grm
    self.params = saved.params if mesh is None else jax.device_put(saved.params, sharding.replicated(mesh))
    self.pattern = re.compile(grm.verdict)
    self.sampling = sampler.SamplingConfig(max_new_tokens=grm.max_new_tokens, temperature=grm.temperature,
                                           stop_tokens=self.format.stop_ids)
    self.rng = jax.random.PRNGKey(seed)

  @classmethod
  def load(cls, grm: ml_collections.ConfigDict, mesh=None, seed: int = 0) -> "Judge":
    return cls(saved_model.load(grm.checkpoint), grm, mesh, seed)

  def prompt(self, question: str, response: str, media: vision_data.Media | None,
             reference: str | None = None) -> list[int]:
    messages = judgements.messages(question, response, media.num_tokens if media is not None else None,
                                   reference if self.grm.reference else None)
    return chat.render_ids(self.format.tok, messages, add_generation_prompt=True)[0]

  def judge(self, questions: Sequence[str], responses: Sequence[str | None],
            media: Sequence[vision_data.Media | None], references: Sequence[str | None] | None = None) -> Judgements:
    """Every response judged `samples` times in one decode (module docstring). A response of
    None (the policy wrote no answer) is judged as an empty response; one whose prompt leaves
    the judge fewer than `max_new_tokens` positions is not judged: its verdicts are
    unparsable (a reward of 0, counted in `too_long`)."""
    start = time.perf_counter()
    s = self.grm.samples
    references = references if references is not None else [None] * len(questions)
    prompts = [self.prompt(q, r or "", m, ref) for q, r, m, ref in zip(questions, responses, media, references)]
    room = self.cfg.text.max_position_embeddings - self.grm.max_new_tokens
    judged = [i for i, p in enumerate(prompts) if len(p) <= room]
    rows = [i for i in judged for _ in range(s)]
    texts, tokens = [[None] * s for _ in prompts], 0
    if rows:
      self.rng, key = jax.random.split(self.rng)
      out = decode.decode(self.cfg.text, self.params[k25.LANGUAGE_MODEL], [prompts[i] for i in rows], key,
                          self.sampling, width_multiple=WIDTH_MULTIPLE,
                          media_for=media_rows.rows_media(self.cfg, self.params, [media[i] for i in rows]))
      for k, (i, (ids, _)) in enumerate(zip(rows, decode.turns(out))):
        texts[i][k % s] = self.format.reply(ids).text
      tokens = int(out["lengths"].sum())
    verdicts = np.array([[np.nan if v is None else v for v in (parse_verdict(t, self.pattern, self.grm.max_score)
                                                                for t in row)] for row in texts], np.float64)
    return Judgements(aggregate(verdicts, self.grm.aggregate), verdicts, texts, int(np.isnan(verdicts).sum()),
                      time.perf_counter() - start, tokens, len(prompts) - len(judged))


def spearman(a: np.ndarray, b: np.ndarray) -> float:
  """Spearman's rank correlation (ties take their average rank); 0 when either side is constant."""
  ra, rb = _ranks(np.asarray(a, np.float64)), _ranks(np.asarray(b, np.float64))
  if ra.std() == 0 or rb.std() == 0:
    return 0.0
  return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
  order = np.argsort(x, kind="stable")
  ranks = np.empty(len(x))
  ranks[order] = np.arange(len(x), dtype=np.float64)
  for value in np.unique(x):
    tied = x == value
    ranks[tied] = ranks[tied].mean()
  return ranks


def agreement(judged: Judgements, truth: np.ndarray, max_score: int = 10) -> dict[str, float]:
  """The judge's rewards r against the true quality t (both in [0, 1]): Spearman(r, t); the
  share whose scores round(max_score · r) and round(max_score · t) are equal, and within one;
  mean |r − t|; unparsable judgements per judgement; the judge's seconds and tokens."""
  r, t = np.asarray(judged.rewards, np.float64), np.asarray(truth, np.float64)
  k_judge, k_true = np.floor(max_score * r + 0.5), np.floor(max_score * t + 0.5)
  return {"spearman": spearman(r, t), "score_accuracy": float((k_judge == k_true).mean()),
          "within_one": float((np.abs(k_judge - k_true) <= 1).mean()), "mae": float(np.abs(r - t).mean()),
          "unparsable_rate": judged.unparsable / judged.verdicts.size, "mean_reward": float(r.mean()),
          "mean_truth": float(t.mean()), "judge_seconds": judged.seconds, "judge_tokens": float(judged.tokens)}
