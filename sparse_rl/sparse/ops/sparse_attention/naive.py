"""Reference sparse attention: every query attends only to the keys its index row names.

Pure PyTorch, float32 accumulation, differentiable in q, k and v through autograd (the gather's
backward scatters into dk/dv, so a key selected by many queries accumulates all their grads).
This is the ground truth the Triton kernels are checked against; it is chunked over queries so
the gathered `[B, Tc, K, H_kv, D]` block stays bounded.
"""

from __future__ import annotations

import math

import torch

# Budget (elements) for one gathered K (or V) block; bounds reference memory at long context.
_GATHER_BUDGET = 1 << 25


def sparse_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over the selected keys.

    Args:
        q: `[B, T, H, D]` queries.
        k, v: `[B, S, H_kv, D]` keys and values; H_kv divides H (GQA: query head h uses kv head
            h // (H / H_kv)).
        indices: `[B, T, K]` int, positions into S; -1 means "no token". Entries of a row must be
            distinct. Causality is the caller's business (the selectors only emit visible keys).
        scale: softmax scale, default 1/sqrt(D).

    Returns:
        out `[B, T, H, D]` in q's dtype (zeros for a query with no valid index) and
        lse `[B, T, H]` float32 (float64 for float64 inputs), natural-log log-sum-exp of the scaled scores (-inf when empty).
    """
    B, T, H, D = q.shape
    S, H_kv = k.shape[1], k.shape[2]
    if H % H_kv:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {H_kv}")
    if indices.shape[:2] != (B, T):
        raise ValueError(f"indices shape {tuple(indices.shape)} does not match q {tuple(q.shape)}")
    G = H // H_kv
    K = indices.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if K == 0 or T == 0:
        return q.new_zeros(B, T, H, D), q.new_full((B, T, H), float("-inf"),
                                                   dtype=torch.promote_types(q.dtype, torch.float32))

    acc = torch.promote_types(q.dtype, torch.float32)  # float64 inputs stay float64 (test oracle)
    chunk = max(1, _GATHER_BUDGET // max(1, B * K * H_kv * D))
    batch = torch.arange(B, device=q.device)[:, None, None]
    outs, lses = [], []
    for t0 in range(0, T, chunk):
        idx = indices[:, t0:t0 + chunk].long()
        valid = idx >= 0
        safe = idx.clamp(min=0, max=S - 1)
        kg = k[batch, safe].to(acc)  # [B, Tc, K, H_kv, D]
        vg = v[batch, safe].to(acc)
        qg = q[:, t0:t0 + chunk].to(acc).unflatten(2, (H_kv, G))  # [B, Tc, H_kv, G, D]
        s = torch.einsum("btcgd,btkcd->btcgk", qg, kg) * scale
        s = s.masked_fill(~valid[:, :, None, None, :], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [B, Tc, H_kv, G]
        p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
        o = torch.einsum("btcgk,btkcd->btcgd", p, vg)
        outs.append(o.flatten(2, 3))
        lses.append(lse.flatten(2, 3))
    out = torch.cat(outs, 1).to(q.dtype)
    return out, torch.cat(lses, 1)


def dense_attention_naive(q, k, v, mask: torch.Tensor | None = None, scale: float | None = None):
    """Brute-force masked dense attention, the oracle for tests.

    q `[B, T, H, D]`, k/v `[B, S, H_kv, D]`, mask `[B, T, S]` bool (True = attend).
    Returns out `[B, T, H, D]` and lse `[B, T, H]` in float32 (float64 for float64 inputs).
    """
    B, T, H, D = q.shape
    H_kv = k.shape[2]
    G = H // H_kv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    kk = k.to(acc).repeat_interleave(G, dim=2)
    vv = v.to(acc).repeat_interleave(G, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q.to(acc), kk) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("bhts,bshd->bthd", p, vv)
    return out, lse.transpose(1, 2)
