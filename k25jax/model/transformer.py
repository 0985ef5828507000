"""The K2 decoder: embeddings, `first_k_dense_replace` dense layers, MoE layers, lm head.

    h_0 = embed(tokens)
    h'  = h + MLA(RMSNorm(h))
    h   = h' + FFN(RMSNorm(h'))          FFN = SwiGLU (dense layers) or MoE
    logits = lm_head(RMSNorm(h_L))

`Transformer.apply({"params": params}, tokens)` returns (logits [b, s, vocab] float32,
aux) with aux = {"max_logits": [layers, heads], "expert_load": [moe_layers, E],
"balance_loss": scalar (mean over MoE layers), "expert_overflow": [moe_layers]
(token-expert pairs an expert-parallel dispatch dropped; 0 elsewhere)}.

Layouts of the params: per layer (`layers_0` … `layers_{L-1}`), or with
`scan_layers` the dense layers per layer and the MoE layers as one `nn.scan`
(`moe_layers`, every leaf with a leading [moe_layers] axis): one compiled layer body
however deep the model. `k25jax.convert.scan` converts between the two. `remat_policy`
wraps each layer in `jax.checkpoint` with that policy (what the backward pass keeps).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from k25jax.model import media as media_lib
from k25jax.model.attention import MLA
from k25jax.model.config import ModelConfig
from k25jax.model.layers import MLP, RMSNorm, dtype_of, normal_init, project
from k25jax.model.moe import MoE

ACTIVATION = ("activation_batch", "activation_length", "activation_embed")
SCANNED = "moe_layers"   # the params of the scanned MoE layers (scan_layers=True)
REMAT = {"full": jax.checkpoint_policies.nothing_saveable,
         "dots": jax.checkpoint_policies.checkpoint_dots,
         "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class DecoderLayer(nn.Module):
  """One pre-norm block. Returns (h, max_logits [heads], moe_aux or None, cache); as the body
  of `nn.scan` (`scanned`) it returns (h, (max_logits, moe_aux)), the carry and the stacked outputs."""

  cfg: ModelConfig
  moe: bool
  scanned: bool = False

  @nn.compact
  def __call__(self, h, positions, segment_ids, token_mask, cache=None):
    cfg = self.cfg
    norm = dict(eps=cfg.rms_norm_eps, dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype))
    attn = MLA(cfg, name="self_attn")
    normed = RMSNorm(cfg.hidden_size, name="input_layernorm", **norm)(h)
    if cache is None:
      attn_out, max_logits = attn(normed, positions, segment_ids)
    else:
      attn_out, max_logits, cache = attn.decode(normed, positions, cache)
    h = nn.with_logical_constraint(h + attn_out, ACTIVATION)
    x = RMSNorm(cfg.hidden_size, name="post_attention_layernorm", **norm)(h)
    if self.moe:
      ffn_out, moe_aux = MoE(cfg, name="mlp")(x, token_mask)
    else:
      ffn_out, moe_aux = MLP(cfg.hidden_size, cfg.intermediate_size, std=cfg.initializer_range,
                             dtype=dtype_of(cfg.dtype), param_dtype=dtype_of(cfg.param_dtype),
                             name="mlp")(x), None
    h = nn.with_logical_constraint(h + ffn_out, ACTIVATION)
    if self.scanned:
      return h, (max_logits, moe_aux)
    return h, max_logits, moe_aux, cache


def layer_class(cfg: ModelConfig, scanned: bool = False):
  """DecoderLayer, wrapped in `nn.remat` with `cfg.remat_policy` unless it is "none"."""
  if cfg.remat_policy == "none":
    return DecoderLayer
  return nn.remat(DecoderLayer, policy=REMAT[cfg.remat_policy], prevent_cse=not scanned)


def scanned_moe_layers(cfg: ModelConfig):
  """The MoE layers as one `nn.scan` over a stacked [moe_layers, ...] copy of DecoderLayer's params
  (logical axis "layers"); the positions, segment ids and token mask are broadcast to every layer."""
  return nn.scan(layer_class(cfg, scanned=True), variable_axes={"params": 0}, split_rngs={"params": True},
                 in_axes=(nn.broadcast, nn.broadcast, nn.broadcast), length=cfg.num_moe_layers,
                 metadata_params={nn.PARTITION_NAME: "layers"})


class Transformer(nn.Module):
  """The K2 text backbone (DeepseekV3ForCausalLM)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, *, cache: list[dict] | None = None,
               return_hidden: bool = False, media: tuple[jax.Array, jax.Array] | None = None):
    """tokens: int32 [batch, seq]; positions default to 0..seq-1; segment_ids: 0 = padding.

    With `cache` (from `attention.init_cache`), runs the latent-cache decode path: the
    tokens are written at slots `positions` and attend to slots ≤ their position;
    aux["cache"] holds the updated cache.

    media = (features [n, hidden], mask bool [batch, seq]): the masked (placeholder) embeddings
    are replaced in row-major order by the feature rows (`media.splice`); placeholder ids
    never reach the embedding table, so they may lie outside the vocabulary.
    """
    cfg = self.cfg
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    batch, seq = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    token_mask = None if segment_ids is None else segment_ids > 0
    embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype_of(cfg.dtype),
                     param_dtype=dtype_of(cfg.param_dtype), name="embed_tokens",
                     embedding_init=nn.with_logical_partitioning(normal_init(cfg.initializer_range),
                                                                 ("vocab", "embed")))
    if media is None:
      h = embed(tokens)
    else:
      h = media_lib.splice(embed(jnp.where(media[1], 0, tokens)), *media)
    h = nn.with_logical_constraint(h, ACTIVATION)
    if cfg.scan_layers and cache is not None:
      raise ValueError("the latent-cache decode path runs layer by layer: decode with scan_layers=False "
                       "(k25jax.convert.scan.unstack_layers converts the params)")
    per_layer = cfg.first_k_dense_replace if cfg.scan_layers else cfg.num_hidden_layers
    layer = DecoderLayer if cache is not None else layer_class(cfg)
    max_logits, loads, balance, overflow, new_cache = [], [], [], [], []
    for i in range(per_layer):
      h, layer_max, moe_aux, layer_cache = layer(cfg, cfg.is_moe_layer(i), name=f"layers_{i}")(
          h, positions, segment_ids, token_mask, None if cache is None else cache[i])
      max_logits.append(layer_max[None])
      new_cache.append(layer_cache)
      if moe_aux is not None:
        loads.append(moe_aux["load"][None])
        balance.append(moe_aux["balance_loss"][None])
        overflow.append(moe_aux["overflow"][None])
    if cfg.scan_layers and cfg.num_moe_layers:
      h, (layer_max, moe_aux) = scanned_moe_layers(cfg)(cfg, True, scanned=True, name=SCANNED)(
          h, positions, segment_ids, token_mask)
      max_logits.append(layer_max)
      loads.append(moe_aux["load"])
      balance.append(moe_aux["balance_loss"])
      overflow.append(moe_aux["overflow"])
    h = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype_of(cfg.dtype),
                param_dtype=dtype_of(cfg.param_dtype), name="norm")(h)
    if cfg.tie_word_embeddings:
      logits = embed.attend(h)
    else:
      kernel = self.param("lm_head", nn.with_logical_partitioning(normal_init(cfg.initializer_range),
                                                                  ("embed", "vocab")),
                          (cfg.hidden_size, cfg.vocab_size), dtype_of(cfg.param_dtype))
      logits = project(h, kernel.astype(h.dtype))
    logits = nn.with_logical_constraint(logits.astype(jnp.float32),
                                        ("activation_batch", "activation_length", "activation_vocab"))
    aux = {
        "max_logits": jnp.concatenate(max_logits),
        "expert_load": jnp.concatenate(loads) if loads else jnp.zeros((0, cfg.n_routed_experts)),
        "balance_loss": jnp.mean(jnp.concatenate(balance)) if balance else jnp.zeros(()),
        "expert_overflow": jnp.concatenate(overflow) if overflow else jnp.zeros((0,), jnp.int32),
    }
    if cache is not None:
      aux["cache"] = new_cache
    if return_hidden:
      aux["hidden"] = h
    return logits, aux


def init_params(cfg: ModelConfig, rng: jax.Array, seq_len: int = 8):
  """Plain (unboxed) parameter pytree of a freshly initialised model (one jitted init: op by
  op, the tiny preset's init takes seconds)."""
  variables = jax.jit(lambda key: Transformer(cfg).init(key, jnp.zeros((1, seq_len), jnp.int32)))(rng)
  return nn.meta.unbox(variables["params"])


def abstract_params(cfg: ModelConfig, seq_len: int = 8):
  """Shapes and logical-axis boxes of the params, without allocating (`jax.eval_shape`)."""
  model = Transformer(cfg)
  return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, seq_len), jnp.int32)))["params"]
