"""Optimizers (`optimizer.name`: adamw | muonclip) and the warmup–stable–decay (WSD) schedule.

The router bias (`e_score_correction_bias`) lives in the params but is a buffer the
train step sets (auxiliary-loss-free balancing): the optimizer leaves it untouched,
weight decay included.
"""
from __future__ import annotations

import jax
import optax

from k25jax.optim import muonclip, partition

OPTIMIZERS = ("adamw", "muonclip")


def wsd_schedule(lr: float, total_steps: int, warmup_steps: int, decay_steps: int,
                 final_lr_ratio: float) -> optax.Schedule:
  """Warmup–stable–decay:

      η(t) = lr · t / warmup                                   t < warmup
           = lr                                                warmup ≤ t < T − decay
           = lr · (r + (1 − r) · ½(1 + cos(π (t − T + decay) / decay)))   after,

  T = total_steps, r = final_lr_ratio.
  """
  if warmup_steps + decay_steps > total_steps:
    raise ValueError(f"optimizer: warmup_steps ({warmup_steps}) + decay_steps ({decay_steps}) "
                     f"exceed train.steps ({total_steps})")
  warmup = optax.linear_schedule(0.0, lr, max(warmup_steps, 1))
  stable = optax.constant_schedule(lr)
  decay = optax.cosine_decay_schedule(lr, max(decay_steps, 1), alpha=final_lr_ratio)
  return optax.join_schedules([warmup, stable, decay], [warmup_steps, total_steps - decay_steps])


def check_schedule(opt, total_steps: int, *, section: str = "optimizer", length: str = "train.steps") -> None:
  """The config check of a schedule: warmup and decay fit in the run's `total_steps` updates
  (`length` names where that count comes from). One line naming the fields, else None."""
  if opt.warmup_steps + opt.decay_steps > total_steps:
    raise ValueError(f"config: {section}.warmup_steps={opt.warmup_steps} + {section}.decay_steps={opt.decay_steps} "
                     f"exceed the run's {total_steps} updates ({length}); lower them, "
                     "or leave them to follow the run")


def adamw_labels(params):
  """`partition.FROZEN` for the router biases, "train" for every other leaf (AdamW alone)."""
  return jax.tree.map(lambda label: label if label == partition.FROZEN else "train", partition.labels(params))


def decay_mask(params):
  """Weight decay on matrices (kernels, embeddings, experts), not on norms or vectors
  (per layer: a scanned layer stack's norms are vectors too)."""
  return partition.matrix_mask(params)


def make_optimizer(opt, total_steps: int) -> optax.GradientTransformation:
  """The optimizer named by `opt.name`, with the WSD schedule and global-norm clipping."""
  if opt.name not in OPTIMIZERS:
    raise ValueError(f"optimizer.name={opt.name!r}; available: {OPTIMIZERS}")
  schedule = wsd_schedule(opt.lr, total_steps, opt.warmup_steps, opt.decay_steps, opt.final_lr_ratio)
  if opt.name == "muonclip":
    update = muonclip.muonclip(schedule, weight_decay=opt.weight_decay, momentum=opt.momentum,
                               nesterov=opt.nesterov, ns_steps=opt.ns_steps, rms_scale=opt.rms_scale,
                               adam_b1=opt.b1, adam_b2=opt.b2, adam_eps=opt.eps)
  else:
    adamw = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
                        mask=decay_mask)
    update = optax.multi_transform({"train": adamw, partition.FROZEN: optax.set_to_zero()}, adamw_labels)
  return optax.chain(optax.clip_by_global_norm(opt.grad_clip), update)


def qk_clip_tau(opt) -> float | None:
  """τ of QK-Clip after each step for MuonClip; None (no clipping) for the other optimizers."""
  return opt.qk_clip_tau if opt.name == "muonclip" else None
