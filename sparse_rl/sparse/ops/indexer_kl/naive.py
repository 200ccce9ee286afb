"""The indexer's training losses (the PyTorch reference of `ops.warmup_kl`, and `selected_kl`,
`dense_lse`), computed in query chunks so no `[T, S, H]` tensor ever exists. The fused Triton
warm-up KL is `triton.py` beside this file.

Warm-up (DeepSeek-V3.2, dense stage): for every query t the target is the layer's dense attention
distribution summed over heads and L1-normalised over the causal keys,
    p_t(s) = (1/H) sum_h softmax_s(scale * q_h(t) . k_h(s)),
and the loss is KL(p_t || softmax_s I(t, s)) with I the lightning-indexer scores.

Sparse stage: the same, restricted to the selected set Sel(t): the target is the dense attention
renormalised over Sel(t), which the sparse attention's log-sum-exp gives directly,
    p_t(s) = (1/H) sum_h exp(scale * q_h(t) . k_h(s) - lse_h(t)),  s in Sel(t),
against softmax over Sel(t) of the indexer scores.

attn_recall of a query: the share of its dense attention mass inside the selected set, averaged
over heads: (1/H) sum_h exp(lse_sel_h - lse_dense_h) = sum_{s in Sel} p_t(s).

Queries are processed in chunks of Tc; a chunk only sees the keys up to its last query, so the
largest live block is `[B, H, Tc, S]`, linear in S at a fixed Tc. When gradients are wanted the
indexer outputs are cut into leaf tensors, every chunk is back-propagated at once into them, and
one final backward carries the accumulated gradients through the indexer: memory stays at one
chunk's graph instead of the whole sequence's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_rl.sparse.ops.indexer_topk.naive import indexer_scores_naive as indexer_scores, visible_mask

# Elements of the largest fp32 block per chunk (`[B, H, Tc, S]`): 256 MiB on the CPU, 1 GiB on CUDA.
CPU_BUDGET, CUDA_BUDGET = 1 << 26, 1 << 28


@dataclass
class KLStats:
    """Sums over the queries of one call (divide by `n` for means). Detached float64 scalars."""

    kl: torch.Tensor
    recall: torch.Tensor | None
    n: int
    oracle: torch.Tensor | None = None  # recall of the best possible K keys (top-K of the target itself)


def auto_chunk(B: int, width: int, S: int, device: torch.device, budget: int | None = None) -> int:
    """Queries per chunk so that one `[B, width, Tc, S]` fp32 block stays under the budget."""
    if budget is None:
        budget = CUDA_BUDGET if device.type == "cuda" else CPU_BUDGET
    return max(1, budget // max(1, B * width * S))


def _gqa_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[B, H, Tc, D]`, k `[B, H_kv, S, D]` -> fp32 logits `[B, H, Tc, S]` (GQA: head h reads kv h // G)."""
    B, H, Tc, D = q.shape
    Hkv = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(B, Hkv, H // Hkv, Tc, D).to(acc) * scale  # scale the small operand, not the block
    logits = torch.matmul(qg, k.to(acc).unsqueeze(2).transpose(-1, -2))  # [B, Hkv, G, Tc, S]
    return logits.view(B, H, Tc, -1)


def _masked_logits(q, k, scale, t0, t1, q_offset, kv_start) -> torch.Tensor:
    """Logits `[B, H, Tc, S']` of queries t0..t1-1 with invisible keys at -inf, S' = keys up to the
    chunk's last query. Without left padding only the keys from the chunk's first position on can be
    invisible, so only that strip is masked (in place: the block is the memory and time hot spot)."""
    B, H, T, _ = q.shape
    Sc = min(k.shape[2], q_offset + t1)
    logits = _gqa_logits(q[:, :, t0:t1], k[:, :, :Sc], scale)
    if kv_start is None:
        lo = min(Sc, q_offset + t0)
        pos = torch.arange(t0, t1, device=q.device)[:, None] + q_offset
        hide = torch.arange(lo, Sc, device=q.device)[None, :] > pos  # [Tc, Sc - lo]
        logits[..., lo:].masked_fill_(hide, float("-inf"))
    else:
        vis = visible_mask(B, t1 - t0, Sc, q_offset, kv_start, q.device, t0)
        logits.masked_fill_(~vis[:, None], float("-inf"))
    return logits


def dense_target(q: torch.Tensor, k: torch.Tensor, scale: float, t0: int = 0, t1: int | None = None,
                 q_offset: int = 0, kv_start: torch.Tensor | None = None) -> torch.Tensor:
    """Head-summed, L1-normalised dense attention of queries t0..t1-1.

    Args:
        q: `[B, H, T, D]` queries after RoPE (the layout HF passes to attention functions).
        k: `[B, H_kv, S, D]` keys after RoPE; H_kv divides H.
        scale: the softmax scale (the attention module's `scaling`).
        q_offset: key position of query 0 (S - T with a KV cache); kv_start: `[B]` first valid key.
    Returns:
        `[B, t1 - t0, S']` float32 (float64 for float64 inputs), S' = min(S, q_offset + t1): keys past
        the chunk's last query are invisible and left out. Rows sum to 1 (0 for a query with no key).
    """
    H = q.shape[1]
    t1 = q.shape[2] if t1 is None else t1
    p = torch.softmax(_masked_logits(q, k, scale, t0, t1, q_offset, kv_start), -1)
    if kv_start is not None:
        p.nan_to_num_(0.0)  # a query with no visible key (all padding) gives a zero row
    return p.sum(1).div_(H)


def dense_lse(q: torch.Tensor, k: torch.Tensor, scale: float, q_offset: int = 0,
              kv_start: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """Dense causal log-sum-exp per query and head. q `[B, H, T, D]`, k `[B, H_kv, S, D]` ->
    `[B, T, H]` float32 (-inf for a query with no visible key). No gradient."""
    B, H, T, _ = q.shape
    chunk = chunk or auto_chunk(B, H, k.shape[2], q.device)
    out = []
    with torch.no_grad():
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            logits = _masked_logits(q, k, scale, t0, t1, q_offset, kv_start)
            out.append(torch.logsumexp(logits, -1).transpose(1, 2))
    return torch.cat(out, 1)


def _kl_rows(p: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """KL(p || softmax(scores)) per row over the `valid` entries. p, scores, valid `[B, Tc, N]` -> `[B, Tc]`."""
    has = valid.any(-1, keepdim=True)
    # rows without a valid entry get finite dummy scores, so log_softmax's backward stays NaN-free
    scores = torch.where(has, scores.masked_fill(~valid, float("-inf")), torch.zeros_like(scores))
    logq = torch.log_softmax(scores.float() if scores.dtype != torch.float64 else scores, -1)
    logq = torch.where(valid, logq, torch.zeros_like(logq))
    return (torch.xlogy(p, p) - p * logq).sum(-1)


class _Leaves:
    """Indexer outputs cut into leaf tensors for chunk-by-chunk backward (see module docstring)."""

    def __init__(self, tensors, grad: bool):
        self.src = tensors
        self.grad = grad and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        self.leaves = [t.detach().requires_grad_(self.grad) for t in tensors]

    def backward_chunk(self, loss: torch.Tensor) -> None:
        if self.grad:
            loss.backward()

    def finish(self) -> None:
        if not self.grad:
            return
        pairs = [(s, x.grad) for s, x in zip(self.src, self.leaves) if x.grad is not None and s.requires_grad]
        if pairs:
            torch.autograd.backward([s for s, _ in pairs], [g for _, g in pairs])


def warmup_kl(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, *,
              scale: float, indices: torch.Tensor | None = None, q_offset: int = 0,
              kv_start: torch.Tensor | None = None, chunk: int | None = None,
              grad_scale: float | None = None, oracle: bool = False) -> KLStats:
    """Dense warm-up loss of one layer: sum over queries of KL(dense target || softmax(indexer)).

    Args:
        q: `[B, H, T, D]`, k: `[B, H_kv, S, D]` the layer's queries and keys after RoPE (detached).
        q_idx: `[B, T, H_I, D_I]`, w: `[B, T, H_I]`, k_idx: `[B, S, D_I]` the indexer outputs.
        indices: optional `[B, T, K]` int selected keys (-1 = none): adds the attn_recall sum.
        chunk: queries per chunk (default: from a memory budget, see `auto_chunk`).
        grad_scale: if set (and the indexer outputs require grad), back-propagate
            `grad_scale * KL-sum` into the indexer chunk by chunk, before returning.
        oracle: with `indices`, also sum the recall of the K keys of highest target mass (the
            ceiling for any selection of K keys).
    Returns:
        KLStats with the KL sum, the recall sum (or None) and the number of queries with a key.
    """
    B, H, T, _ = q.shape
    chunk = chunk or auto_chunk(B, H, k.shape[2], q.device)
    lv = _Leaves((q_idx, w, k_idx), grad_scale is not None)
    qi, wi, ki = lv.leaves
    kl_sum = torch.zeros((), dtype=torch.float64, device=q.device)
    rec_sum = torch.zeros((), dtype=torch.float64, device=q.device) if indices is not None else None
    orc_sum = torch.zeros((), dtype=torch.float64, device=q.device) if indices is not None and oracle else None
    n = torch.zeros((), dtype=torch.long, device=q.device)  # on the device: no host sync per chunk
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        Sc = min(k.shape[2], q_offset + t1)
        with torch.no_grad():
            p = dense_target(q.detach(), k.detach(), scale, t0, t1, q_offset, kv_start)
            vis = visible_mask(B, t1 - t0, Sc, q_offset, kv_start, q.device, t0)
            has = vis.any(-1)
            n += has.sum()
            if indices is not None:
                idx = indices[:, t0:t1].long()
                got = p.gather(-1, idx.clamp(0, Sc - 1)) * (idx >= 0)
                rec_sum += (got.sum(-1) * has).sum().double()
                if orc_sum is not None:
                    orc_sum += p.topk(min(indices.shape[-1], Sc), -1).values.sum().double()
        scores = indexer_scores(qi[:, t0:t1], wi[:, t0:t1], ki[:, :Sc], q_offset=q_offset, kv_start=kv_start, t0=t0)
        kl = _kl_rows(p, scores, vis).sum()
        kl_sum += kl.detach().double()
        lv.backward_chunk(kl * grad_scale if grad_scale is not None else kl)
    lv.finish()
    return KLStats(kl_sum, rec_sum, int(n), orc_sum)


def selected_kl(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor,
                indices: torch.Tensor, lse: torch.Tensor, *, scale: float, lse_dense: torch.Tensor | None = None,
                chunk: int | None = None, grad_scale: float | None = None) -> KLStats:
    """Sparse-stage loss of one layer: KL over each query's selected set only.

    Args:
        q: `[B, H, T, D]`, k: `[B, H_kv, S, D]` queries and keys after RoPE (detached).
        q_idx: `[B, T, H_I, D_I]`, w: `[B, T, H_I]`, k_idx: `[B, S, D_I]` the indexer outputs.
        indices: `[B, T, K]` int the selected keys (-1 = none); lse: `[B, T, H]` the sparse attention's
            log-sum-exp over them (it normalises the target without another pass).
        lse_dense: optional `[B, T, H]` dense log-sum-exp (`dense_lse`): adds the attn_recall sum.
        chunk / grad_scale: as in `warmup_kl`.
    Returns:
        KLStats (KL sum, recall sum or None, number of queries with at least one selected key).
    """
    B, H, T, D = q.shape
    Hkv, K = k.shape[1], indices.shape[-1]
    G = H // Hkv
    chunk = chunk or auto_chunk(B, max(H, Hkv * D), K, q.device)
    lv = _Leaves((q_idx, w, k_idx), grad_scale is not None)
    qi, wi, ki = lv.leaves
    acc = torch.promote_types(q.dtype, torch.float32)
    kt = k.detach().transpose(1, 2)  # [B, S, H_kv, D]
    bidx = torch.arange(B, device=q.device)[:, None, None]
    kl_sum = torch.zeros((), dtype=torch.float64, device=q.device)
    rec_sum = torch.zeros((), dtype=torch.float64, device=q.device) if lse_dense is not None else None
    n = torch.zeros((), dtype=torch.long, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        idx = indices[:, t0:t1].long()
        valid = idx >= 0
        safe = idx.clamp(min=0)
        has = valid.any(-1)
        n += has.sum()
        with torch.no_grad():
            ks = kt[bidx, safe].to(acc)  # [B, Tc, K, H_kv, D]
            qc = q.detach()[:, :, t0:t1].transpose(1, 2).reshape(B, t1 - t0, Hkv, G, D).to(acc)
            logits = torch.einsum("bthgd,btkhd->bthgk", qc, ks) * scale
            lse_c = lse[:, t0:t1].reshape(B, t1 - t0, Hkv, G, 1).to(acc)
            p = torch.exp(logits - lse_c).masked_fill(~valid[:, :, None, None], 0.0).sum((2, 3)) / H
            p = p * has[..., None]
            if lse_dense is not None:
                share = torch.exp(lse[:, t0:t1].to(acc) - lse_dense[:, t0:t1].to(acc)).mean(-1)
                rec_sum += (share.nan_to_num(0.0) * has).sum().double()
        kis = ki[bidx, safe]  # [B, Tc, K, D_I]
        dots = torch.einsum("bthd,btkd->bthk", qi[:, t0:t1].to(acc), kis.to(acc)).relu()
        scores = torch.einsum("bthk,bth->btk", dots, wi[:, t0:t1].to(acc))
        kl = _kl_rows(p, scores, valid).sum()
        kl_sum += kl.detach().double()
        lv.backward_chunk(kl * grad_scale if grad_scale is not None else kl)
    lv.finish()
    return KLStats(kl_sum, rec_sum, int(n))
