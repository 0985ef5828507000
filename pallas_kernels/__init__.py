"""Pallas kernels for K2.5 training and decode, each beside its XLA reference.

* `pallas_kernels.moe`            noaux_tc routing (+ the expert sort) and the grouped
                                  matmul `gmm` / transposed `tgmm`, differentiable;
* `pallas_kernels.mla_attention`  causal flash attention with d_qk ≠ d_v, packed
                                  segments and per-head max logits, differentiable;
* `pallas_kernels.mla_decode`     decode attention straight from the MLA latent cache.

Compiled on TPU (Mosaic) and GPU (Triton), interpreted elsewhere (`common.target`).
"""
