"""Pallas kernels for K2.5 training and decode, each beside its XLA reference.

* `pallas_kernels.moe`               noaux_tc routing (+ the expert sort) and the grouped
                                     matmul `gmm` / transposed `tgmm`, differentiable;
* `pallas_kernels.flash_attention`   flash attention over packed segments, causal or not,
                                     d_qk ≠ d_v, differentiable; the kernels of
* `pallas_kernels.mla_attention`     causal, with per-head max logits (MLA training), and
* `pallas_kernels.vision_attention`  segments only, over [N, heads, d] (MoonViT-3D);
* `pallas_kernels.mla_decode`        decode attention straight from the MLA latent cache.

Compiled on TPU (Mosaic) and GPU (Triton), interpreted elsewhere (`common.target`).
"""
