"""Reference for `ops.indexer_decode`: exactly `LightningIndexer.forward`'s arithmetic after its three
projections (the module's own helpers), for one token per row, plus the index-key cache write."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def indexer_decode_naive(zq: torch.Tensor, zk: torch.Tensor, zw: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None,
                         eps: float, rope_dim: int, pos: torch.Tensor, k_cache: torch.Tensor,
                         k_scale: torch.Tensor | None = None):
    """zq `[B, H_I * d_I]`, zk `[B, d_I]`, zw `[B, H_I]` (the projections' outputs), cos/sin `[B, D_h]`
    (the model's rotary tables at each row's position, layout cat(f, f)), pos `[B]`, k_cache
    `[B, S_max, d_I]` -> q_I `[B, H_I, d_I]`, w `[B, H_I]`; writes k_I into k_cache[b, pos[b]]. A
    float8_e4m3fn k_cache takes the quantized key and k_scale `[B, S_max]` its scale (`quantize_index_keys`)."""
    from sparse_rl.sparse.indexer import apply_rope, rope_slice
    from sparse_rl.sparse.ops.indexer_topk.naive import quantize_index_keys

    B, DI = zk.shape
    HI = zw.shape[1]
    c, s = rope_slice(cos[:, None], sin[:, None], rope_dim)  # [B, 1, rope_dim]
    q = zq.view(B, 1, HI, DI) * DI ** -0.5
    q = apply_rope(q, c.to(q.dtype), s.to(q.dtype), rope_dim)
    k = F.layer_norm(zk[:, None], (DI,), ln_weight, ln_bias, eps)
    k = apply_rope(k, c.to(k.dtype), s.to(k.dtype), rope_dim)
    ar = torch.arange(B, device=zk.device)
    if k_scale is not None:
        k8, sc = quantize_index_keys(k[:, 0])
        k_cache[ar, pos], k_scale[ar, pos] = k8, sc
    else:
        k_cache[ar, pos] = k[:, 0].to(k_cache.dtype)
    return q[:, 0], zw * (1.0 / math.sqrt(HI))
