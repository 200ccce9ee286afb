"""References for `ops.add_rmsnorm`, `ops.qk_norm_rope_cache` and `ops.silu_mul`: exactly the HF modules'
arithmetic (Llama/Qwen2/Qwen3 RMSNorm, `apply_rotary_pos_emb`'s rotate-half RoPE, the residual add in the
model's dtype, the gated MLP's `act_fn(gate) * up`) for one token per row, plus the cache write."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm_naive(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm over the last dim: fp32 statistics, rounded to x's dtype before the weight."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rmsnorm_naive(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """x `[B, N]` (a sublayer's output), residual `[B, N]` or None -> (RMSNorm(residual + x) `[B, N]`,
    residual + x `[B, N]`: the new residual stream)."""
    h = x if residual is None else residual + x
    return rmsnorm_naive(h, weight, eps), h


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qk_norm_rope_cache_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                             k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                             pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """q `[B, H, D]`, k/v `[B, H_kv, D]` (the projections' outputs), q_weight/k_weight `[D]` (Qwen3's
    q_norm/k_norm; None: no norm), cos/sin `[B, D]` (the model's rotary tables at each row's position),
    pos `[B]`, caches `[B, S_max, H_kv, D]` -> q rotated `[B, H, D]`; writes the rotated k and v into
    the caches at pos."""
    if q_weight is not None:
        q, k = rmsnorm_naive(q, q_weight, eps), rmsnorm_naive(k, k_weight, eps)
    c, s = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
    q = (q * c) + (_rotate_half(q) * s)
    k = (k * c) + (_rotate_half(k) * s)
    ar = torch.arange(q.shape[0], device=q.device)
    k_cache[ar, pos] = k.to(k_cache.dtype)
    v_cache[ar, pos] = v.to(v_cache.dtype)
    return q


def silu_mul_naive(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up `[B, 2N]` (one GEMM's gate and up halves) -> SiLU(gate) * up `[B, N]`, as the Llama/Qwen
    MLP computes `act_fn(gate_proj(x)) * up_proj(x)` (each op rounded to the dtype)."""
    n = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :n]) * gate_up[..., n:]
