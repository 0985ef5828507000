"""Training the K2.5 multimodal model: media batches on device, the loss, state and metrics.

    host batch  = mixture features [B, S] + media items (k25jax.data.mixture)
    device batch = the features; pixel_values zero-padded to a fixed patch budget P and
                   layout = vision.patch_layout(grids, num_patches=P, num_merged=P / (kh·kw)),
                   so ONE compilation serves every batch (a batch without media takes the
                   text-only path, a second one)
    L = CE(K25(tokens, pixel_values, layout)) + z · mean (log Z)² + α · L_balance

The answers of vision samples are scored whole: a sample is `answer_exact` when the argmax
is right at every answer position given the right prefix, which is exactly when greedy
decoding reproduces the answer.

Single process only: media are replicated, and each process would bring its own.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from k25jax import losses
from k25jax.data import mixture, vision as vision_data
from k25jax.model import k25, media as media_lib, vision
from k25jax.model.config import K25Config
from k25jax.train import checkpoint, sharding, state as state_lib

TEXT_FEATURES = mixture.FEATURES


def check_single_process(stage: str) -> None:
  if jax.process_count() > 1:
    raise NotImplementedError(f"the {stage} stage runs in one process (media are replicated on every "
                              f"device); got {jax.process_count()} processes")


def device_features(features: dict, cfg: K25Config, max_patches: int) -> dict[str, np.ndarray]:
  """Host arrays of one batch for the jitted step (module docstring). Raises ValueError when
  the placeholders do not number exactly the media's tokens, or the media exceed the budget."""
  out = {name: features[name] for name in TEXT_FEATURES}
  items = features["media"]
  if not items:
    placeholders = int(media_lib.placeholder_mask(out["inputs"], cfg.media_token_ids).sum())
    if placeholders:
      raise ValueError(f"the batch has {placeholders} media placeholder tokens but no media")
    return out
  pixels, grids = vision_data.pack_media(items)
  k25.check_media(out["inputs"], grids, cfg)
  if pixels.shape[0] > max_patches:
    raise ValueError(f"the batch's media have {pixels.shape[0]} patches, more than the budget {max_patches}")
  padded = np.zeros((max_patches,) + pixels.shape[1:], np.float32)
  padded[:pixels.shape[0]] = pixels
  out["pixel_values"] = padded
  out["layout"] = vision.patch_layout(grids, cfg.vision, num_patches=max_patches,
                                      num_merged=max_patches // cfg.vision.merge_size)
  return out


def batch_specs(with_media: bool) -> dict:
  """PartitionSpecs of a device batch: text features over the batch axes and `sequence`,
  media replicated."""
  specs = {name: P(sharding.BATCH_AXES, "sequence") for name in TEXT_FEATURES}
  if with_media:
    specs.update(pixel_values=P(), layout=P())
  return specs


def to_device(batch: dict, mesh: jax.sharding.Mesh) -> dict:
  specs = batch_specs("pixel_values" in batch)
  return {name: jax.tree.map(lambda x, s=specs[name]: jax.device_put(x, NamedSharding(mesh, s)), value)
          for name, value in batch.items()}


def answer_metrics(logits: jax.Array, batch: dict) -> dict[str, jax.Array]:
  """answer_exact_count / answer_count over the vision samples of the batch (whole answers)."""
  b, s = batch["targets"].shape
  scored = (batch["loss_mask"] > 0) & (batch["is_vision"] > 0)
  wrong = scored & (jnp.argmax(logits, axis=-1) != batch["targets"])
  ids = (jnp.arange(b)[:, None] * (s + 1) + batch["segment_ids"]).reshape(-1)
  seg_wrong = jax.ops.segment_max(wrong.reshape(-1).astype(jnp.int32), ids, num_segments=b * (s + 1))
  seg_scored = jax.ops.segment_max(scored.reshape(-1).astype(jnp.int32), ids, num_segments=b * (s + 1))
  seg_scored, seg_wrong = jnp.maximum(seg_scored, 0), jnp.maximum(seg_wrong, 0)
  return {"answer_exact_count": jnp.sum(seg_scored * (1 - seg_wrong)).astype(jnp.float32),
          "answer_count": jnp.sum(seg_scored).astype(jnp.float32)}


def make_loss(config, model: k25.K25, frozen: tuple[str, ...] = ()):
  """loss_fn(params, batch, rng) -> (L, (metrics, aux)); `frozen` top-level params get no
  gradient (`stop_gradient`: their weight gradients are never computed)."""

  def loss_fn(params, batch, rng):
    del rng
    params = {name: jax.lax.stop_gradient(p) if name in frozen else p for name, p in params.items()}
    logits, aux = model.apply({"params": params}, batch["inputs"], batch.get("pixel_values"),
                              batch.get("layout"), batch["positions"], batch["segment_ids"])
    loss, metrics = losses.next_token_loss(logits, batch["targets"], batch["loss_mask"], z_loss=config.train.z_loss)
    loss = loss + config.train.balance_loss_alpha * aux["balance_loss"]
    metrics = dict(metrics, balance_loss=aux["balance_loss"], max_attention_logit=jnp.max(aux["max_logits"]),
                   media_mismatch=jnp.asarray(aux.get("media_mismatch", False), jnp.float32),
                   **answer_metrics(logits, batch))
    return loss, (metrics, aux)

  return loss_fn


def abstract_state(model_cfg: K25Config, tx):
  return state_lib.abstract(k25.abstract_params(model_cfg), tx)


def init_state(config, model_cfg: K25Config, tx, mesh):
  """(create, target): `create(params=None)` makes a fresh state with its shardings, from
  `params` or a random init; `target` is its shapes and shardings, to restore into."""
  abstract = abstract_state(model_cfg, tx)
  shardings = sharding.logical_to_sharding(abstract, mesh)
  param_rng, state_rng = jax.random.split(jax.random.PRNGKey(config.train.seed))
  fresh = jax.jit(lambda: state_lib.create(k25.init_params(model_cfg, param_rng), tx, state_rng),
                  out_shardings=shardings)
  given = jax.jit(lambda params: state_lib.create(params, tx, state_rng), out_shardings=shardings)
  create = lambda params=None: fresh() if params is None else given(params)
  return create, checkpoint.abstract_target(jax.eval_shape(fresh), shardings)


def initial_params(config, model_cfg: K25Config, mesh):
  """Params to start a fresh run from, or None (random init): `train.init_from`, a K2.5 stage's
  workdir (all params), else `train.init_lm_from`, a text pretrain workdir (the language
  model; the rest random)."""
  if config.train.init_from:
    return checkpoint.Checkpoints(config.train.init_from, keep=1).restore_params(params_target(model_cfg, mesh))
  if config.train.init_lm_from:
    lm = checkpoint.Checkpoints(config.train.init_lm_from, keep=1).restore_params(
        params_target(model_cfg, mesh, "language_model"))
    fresh = jax.jit(k25.init_params, static_argnums=0)(model_cfg, jax.random.PRNGKey(config.train.seed))
    return {**fresh, "language_model": lm}
  return None


def params_target(model_cfg: K25Config, mesh, part: str | None = None):
  """ShapeDtypeStructs with shardings of the params (or of `params[part]`) to restore into."""
  boxed = k25.abstract_params(model_cfg)
  if part is not None:
    boxed = boxed[part]
  shardings = sharding.logical_to_sharding(boxed, mesh)
  return checkpoint.abstract_target(nn.meta.unbox(boxed), shardings)


def evaluate(eval_step, state, batches: list[dict]) -> dict[str, float]:
  """Token-weighted loss and accuracy, and answer_exact = Σ exact / Σ answers, over `batches`."""
  totals, tokens = {}, 0.0
  for batch in batches:
    m = {k: float(v) for k, v in jax.device_get(eval_step(state, batch)).items()}
    tokens += m["tokens"]
    for name in ("loss", "cross_entropy", "accuracy"):
      totals[name] = totals.get(name, 0.0) + m[name] * m["tokens"]
    for name in ("answer_exact_count", "answer_count"):
      totals[name] = totals.get(name, 0.0) + m[name]
  out = {name: totals[name] / max(tokens, 1.0) for name in ("loss", "cross_entropy", "accuracy")}
  if totals["answer_count"]:
    out["answer_exact"] = totals["answer_exact_count"] / totals["answer_count"]
  out["tokens"] = tokens
  return out
