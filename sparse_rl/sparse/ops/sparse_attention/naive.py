"""Reference sparse attention: every query attends only to the keys its index row names.

Pure PyTorch, float32 accumulation (float64 inputs stay float64: the test oracle). It works in query
chunks in the forward AND the backward: a custom autograd function saves only q, k, v, the indices,
out and lse, and the backward recomputes each chunk's gathered `[B, Tc, K, H_kv, D]` block, so memory
stays O(chunk x K x D) whatever T is (autograd through a plain gather kept every chunk's gathered K/V
alive until the backward: T x K x H_kv x D x 8 bytes, 11 GB and more on a CPU distillation run,
issue 19). The gather's backward is an `index_add_`: a key selected by many queries accumulates all
their grads. This is the ground truth the Triton kernels are checked against.
"""

from __future__ import annotations

import math

import torch

# Elements of one gathered K (or V) chunk; the forward holds ~3 and the backward ~5 such blocks
# (fp32: 32 MB each), so the reference's working memory stays below ~200 MB at any context length.
GATHER_BUDGET = 1 << 23
# the ways `ops.sparse_decode(merge=)` may merge a split index list's partials: a second launch or the last program
# of each (row, kv head) inside the forward (the reference never splits; the Triton kernel does both)
MERGES = ("kernel", "fused")


def _chunks(B: int, T: int, K: int, H_kv: int, D: int, budget: int):
    step = max(1, budget // max(1, B * K * H_kv * D))
    return [(t0, min(T, t0 + step)) for t0 in range(0, T, step)]


def _gather(x, batch, safe, acc):
    return x[batch, safe].to(acc)  # [B, Tc, K, H_kv, D]


def _chunk_fwd(q, k, v, idx, scale, acc):
    """One query chunk: q `[B, Tc, H, D]`, idx `[B, Tc, K]` -> out `[B, Tc, H, D]` (acc), lse `[B, Tc, H]`."""
    B, Tc, H, D = q.shape
    S, H_kv = k.shape[1], k.shape[2]
    batch = torch.arange(B, device=q.device)[:, None, None]
    idx = idx.long()
    valid = (idx >= 0) & (idx < S)
    safe = torch.where(valid, idx, 0)
    kg, vg = _gather(k, batch, safe, acc), _gather(v, batch, safe, acc)
    qg = q.to(acc).unflatten(2, (H_kv, H // H_kv))  # [B, Tc, H_kv, G, D]
    s = torch.einsum("btcgd,btkcd->btcgk", qg, kg) * scale
    s = s.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, Tc, H_kv, G]
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    o = torch.einsum("btcgk,btkcd->btcgd", p, vg)
    return o.flatten(2, 3), lse.flatten(2, 3)


class _SparseAttentionRef(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale, budget):
        B, T, H, D = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_empty(B, T, H, D)
        lse = torch.empty(B, T, H, dtype=acc, device=q.device)
        for t0, t1 in _chunks(B, T, indices.shape[-1], k.shape[2], D, budget):
            o, ls = _chunk_fwd(q[:, t0:t1], k, v, indices[:, t0:t1], scale, acc)
            out[:, t0:t1] = o.to(q.dtype)
            lse[:, t0:t1] = ls
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.scale, ctx.budget = scale, budget
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, indices, out, lse = ctx.saved_tensors
        scale = ctx.scale
        B, T, H, D = q.shape
        S, H_kv = k.shape[1], k.shape[2]
        G = H // H_kv
        acc = lse.dtype
        dq = torch.zeros(B, T, H, D, dtype=acc, device=q.device)
        dk = torch.zeros(B * S, H_kv, D, dtype=acc, device=q.device)
        dv = torch.zeros_like(dk)
        batch = torch.arange(B, device=q.device)[:, None, None]
        for t0, t1 in _chunks(B, T, indices.shape[-1], H_kv, D, ctx.budget):
            idx = indices[:, t0:t1].long()
            valid = (idx >= 0) & (idx < S)
            safe = torch.where(valid, idx, 0)
            kg, vg = _gather(k, batch, safe, acc), _gather(v, batch, safe, acc)
            qg = q[:, t0:t1].to(acc).unflatten(2, (H_kv, G))
            ls = lse[:, t0:t1].unflatten(2, (H_kv, G))
            ok = torch.isfinite(ls)
            s = torch.einsum("btcgd,btkcd->btcgk", qg, kg) * scale
            p = torch.exp(s - torch.where(ok, ls, torch.zeros_like(ls))[..., None])
            p = p.masked_fill(~(valid[:, :, None, None, :] & ok[..., None]), 0.0)
            do = (torch.zeros_like(qg) if dout is None else dout[:, t0:t1].to(acc).unflatten(2, (H_kv, G)))
            # d lse / d s = P, so an upstream lse grad enters like -delta
            delta = (do * out[:, t0:t1].to(acc).unflatten(2, (H_kv, G))).sum(-1)
            if dlse is not None:
                delta = delta - torch.where(ok, dlse[:, t0:t1].to(acc).unflatten(2, (H_kv, G)), 0.0)
            dp = torch.einsum("btcgd,btkcd->btcgk", do, vg)
            ds = p * (dp - delta[..., None])
            dq[:, t0:t1] = torch.einsum("btcgk,btkcd->btcgd", ds, kg).flatten(2, 3) * scale
            rows = (batch * S + safe).flatten()  # invalid slots add zeros (p = ds = 0) to row 0
            dk.index_add_(0, rows, torch.einsum("btcgk,btcgd->btkcd", ds, qg).flatten(0, 2), alpha=scale)
            dv.index_add_(0, rows, torch.einsum("btcgk,btcgd->btkcd", p, do).flatten(0, 2))
        return (dq.to(q.dtype), dk.view(B, S, H_kv, D).to(k.dtype), dv.view(B, S, H_kv, D).to(v.dtype),
                None, None, None)


def sparse_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float | None = None,
    *,
    budget: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over the selected keys.

    Args:
        q: `[B, T, H, D]` queries.
        k, v: `[B, S, H_kv, D]` keys and values; H_kv divides H (GQA: query head h uses kv head
            h // (H / H_kv)).
        indices: `[B, T, K]` int, positions into S; -1 means "no token" (entries outside [0, S)
            count as -1). Entries of a row must be distinct. Causality is the caller's business
            (the selectors only emit visible keys).
        scale: softmax scale, default 1/sqrt(D).
        budget: elements of one gathered chunk (default GATHER_BUDGET); tests lower it.

    Returns:
        out `[B, T, H, D]` in q's dtype (zeros for a query with no valid index) and
        lse `[B, T, H]` float32 (float64 for float64 inputs), natural-log log-sum-exp of the scaled scores (-inf when empty).
    """
    B, T, H, D = q.shape
    H_kv = k.shape[2]
    if H % H_kv:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {H_kv}")
    if indices.shape[:2] != (B, T):
        raise ValueError(f"indices shape {tuple(indices.shape)} does not match q {tuple(q.shape)}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if indices.shape[-1] == 0 or T == 0:
        return q.new_zeros(B, T, H, D), q.new_full((B, T, H), float("-inf"),
                                                   dtype=torch.promote_types(q.dtype, torch.float32))
    return _SparseAttentionRef.apply(q, k, v, indices, scale, budget or GATHER_BUDGET)


def shared_to_per_query(indices: torch.Tensor, query_group: int, T: int, q_offset: int = 0) -> torch.Tensor:
    """A selection shared by groups of `query_group` consecutive queries, `[B, ceil(T/g), K]`, as the
    per-query selection `[B, T, K]` it means: each query keeps the group's keys it can see
    (key <= q_offset + t), the others become -1."""
    per = indices.repeat_interleave(query_group, 1)[:, :T]
    t = torch.arange(T, device=indices.device)[None, :, None] + q_offset
    return torch.where(per <= t, per, -1).to(torch.int32)


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
