"""Every field of a stage config checked before anything is built, compiled or trained.

A rule applies to every field of that name in any section (or to one dotted path where a
name means different things in different sections). A field that breaks its rule fails
with one line naming it and what it may be:

    config: train.checkpoint_every=0: must be a positive integer

The model section is checked by building its `ModelConfig` (and `VisionConfig`). The checks
of fields that belong to what uses them sit there, each the same one line: the stage's
`check(config)` (its lengths against `train.steps`: `trainer.check`, `optimizer.check_schedule`;
the RL driver's loss names and minibatches: `rl.driver.check`), which `k25jax.main` runs right
after these; what needs the devices or the data (batch over the mesh, vocabulary against the
tokenizer) is checked by the stage, still before the first compile.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

import ml_collections

from k25jax.model import config as model_config
from k25jax.train import optimizer, sharding


def _int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _real(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _rule(test: Callable, text: str) -> tuple[Callable, str]:
  return test, text


POSITIVE_INT = _rule(lambda v: _int(v) and v > 0, "a positive integer")
NON_NEGATIVE_INT = _rule(lambda v: _int(v) and v >= 0, "an integer >= 0")
POSITIVE = _rule(lambda v: _real(v) and v > 0, "a finite number > 0")
NON_NEGATIVE = _rule(lambda v: _real(v) and v >= 0, "a finite number >= 0")
FRACTION = _rule(lambda v: _real(v) and 0 <= v <= 1, "a number in [0, 1]")
BELOW_ONE = _rule(lambda v: _real(v) and 0 <= v < 1, "a number in [0, 1)")


def choice(*names: str):
  return _rule(lambda v: v in names, f"one of {names}")


# by field name; "section.name" entries take precedence over the bare name
RULES = {
    **{name: POSITIVE_INT for name in (
        "steps", "batch", "seq_len", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
        "max_consecutive_skipped", "prompts_per_iteration", "minibatches", "demonstrations", "trajectories",
        "visual_examples", "sessions", "train_prompts", "eval_prompts", "max_new_tokens", "turn_tokens", "max_turns",
        "max_context", "eval_samples", "budget_samples", "max_patches", "image_size", "max_doc_chars", "max_length",
        "orchestrator_turn_tokens", "subagent_turn_tokens", "eval_tasks", "parallel_cap", "output_chars",
        "memory_mb", "ns_steps", "original_context", "eval.tasks", "toggle.m", "anneal_steps",
        "subagent_step_cost")},
    **{name: NON_NEGATIVE_INT for name in (
        "eval_batches", "vision_eval_batches", "warmup_steps", "decay_steps", "seed", "eval_seed", "visual_batch",
        "projector_only_from", "top_k", "subagent_rows", "text_replay", "vision_replay")},
    **{name: POSITIVE for name in (
        "lr", "grad_clip", "rms_scale", "qk_clip_tau", "cpu_s", "wall_s", "beta_fast", "beta_slow", "optimizer.eps",
        "loss.eps", "eps_high", "tau")},
    **{name: NON_NEGATIVE for name in (
        "weight_decay", "z_loss", "balance_loss_alpha", "router_bias_rate", "lambda1", "lambda2", "temperature",
        "checkpoint_minutes")},
    **{name: FRACTION for name in (
        "final_lr_ratio", "accuracy_threshold", "vision_ratio", "deep_fraction", "p_scratch", "p_check",
        "p_two_calls", "delegation_share", "capability_share", "subagent_failure")},
    **{name: BELOW_ONE for name in ("b1", "b2", "momentum", "vision_start")},
    "top_p": _rule(lambda v: _real(v) and 0 < v <= 1, "a number in (0, 1]"),
    "rho": _rule(lambda v: _real(v) and 0 < v <= 100, "a percentile in (0, 100]"),
    "yarn_factor": _rule(lambda v: _real(v) and v >= 1, "a number >= 1"),
    "num_generations": _rule(lambda v: _int(v) and v >= 2, "an integer >= 2 (a group needs a baseline)"),
    "loss.alpha": _rule(lambda v: _real(v) and v <= 0, "a number <= 0 (the band's lower end on the log ratio)"),
    "loss.beta": _rule(lambda v: _real(v) and v >= 0, "a number >= 0 (the band's upper end on the log ratio)"),
    "optimizer.name": choice(*optimizer.OPTIMIZERS),
    "loss.normalize": choice("batch", "group"),
    "data.tokenizer": choice("bytes", "tiktoken", "tokenizers", "auto"),
    "vision_schedule": choice("constant", "ramp"),
    "anneal_kind": choice("linear", "cosine"),
    "parl.rendering": choice("dsl", "chat", "k2.5"),     # k25jax.agents.widesearch.rendering.NAMES
    "after_init": _rule(lambda v: isinstance(v, bool), "True or False"),
}


def _fields(section: ml_collections.ConfigDict, prefix: str = ""):
  for name, value in section.items():
    path = f"{prefix}{name}"
    if isinstance(value, ml_collections.ConfigDict):
      if name != "model":
        yield from _fields(value, path + ".")
    else:
      yield path, value


def validate(config: ml_collections.ConfigDict, rules: Mapping[str, tuple[Callable, str]] | None = None) -> None:
  """Raises ValueError (one line, `config: <field>=<value>: must be ...`) on the first field
  that breaks its rule, the mesh or the model section. `rules` adds (or overrides) rules of
  fields whose values only a higher floor knows (the stage names: `k25jax.main`)."""
  rules = {**RULES, **(rules or {})}
  for path, value in _fields(config):
    parts = path.split(".")
    rule = rules.get(".".join(parts[-2:])) or rules.get(parts[-1])
    if rule is not None and not rule[0](value):
      raise ValueError(f"config: {path}={value!r}: must be {rule[1]}")
  if "mesh" in config:
    sizes = config.mesh.to_dict()
    bad = [f"mesh.{axis}={n!r}" for axis, n in sizes.items() if not (_int(n) and (n >= 1 or n == -1))]
    axes = [n for axis, n in sizes.items() if axis != sharding.DEVICES]
    if bad or axes.count(-1) > 1:
      raise ValueError(f"config: {', '.join(bad) or config.mesh.to_dict()}: each mesh axis (and mesh.devices) must "
                       "be an integer >= 1, or -1 (the devices left over) on one axis at most (mesh.devices: all)")
  if "model" in config:
    try:
      _model_config(config.model)
    except (TypeError, ValueError) as e:
      raise ValueError(f"config: model: {e}") from None


def _model_config(section: ml_collections.ConfigDict) -> None:
  """Builds the section's configs (their own checks run); K2.5's media ids come from the tokenizer later."""
  fields = {k: v for k, v in section.to_dict().items() if k != "preset"}
  if "vision" in section:
    model_config.ModelConfig(**fields["text"])
    model_config.VisionConfig(**fields["vision"])
  else:
    model_config.ModelConfig(**fields)


def unknown_field(config: ml_collections.ConfigDict, dotted: str) -> str | None:
  """Why `dotted` (section.field) names no field of `config`, or None when it does."""
  node, walked = config, []
  for name in dotted.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or name not in node:
      where = ".".join(walked) or "the config"
      known = ", ".join(sorted(node.keys())) if isinstance(node, ml_collections.ConfigDict) else ""
      return f"{where} has no field {name!r}" + (f" (it has: {known})" if known else "")
    node = node[name]
    walked.append(name)
  return None
