"""Reference DSA lightning-indexer scores and causal top-k selection.

Score of query t against key s:  I(t, s) = sum_j w[t, j] * ReLU(q[t, j] . k[s])   (DeepSeek-V3.2).
Query t sits at key position `q_offset + t` and sees keys `kv_start <= s <= q_offset + t`
(`kv_start` per batch row skips left padding). The first `sink` visible keys and the last `window`
ones (the query's own position included) are always kept; the rest of the `topk` budget goes to
the highest scores. Queries are processed in chunks so only a `[B, Tc, S]` block of scores ever
exists (never `[B, T, H_I, S]` at full length).
"""

from __future__ import annotations

import torch

# Budget (elements) for one `[B, Tc, H_I, S]` score block of the reference.
_SCORE_BUDGET = 1 << 26


def _positions(B: int, T: int, S: int, q_offset: int, kv_start, device, t0: int = 0):
    """Visibility helpers for queries t0..t0+T-1: returns (pos [1,T,1], s [1,1,S], start [B,1,1])."""
    pos = torch.arange(t0, t0 + T, device=device).view(1, T, 1) + q_offset
    s = torch.arange(S, device=device).view(1, 1, S)
    if kv_start is None:
        start = torch.zeros(B, 1, 1, dtype=torch.long, device=device)
    else:
        start = torch.as_tensor(kv_start, device=device).long().view(B, 1, 1)
    return pos, s, start


def visible_mask(B: int, T: int, S: int, q_offset: int = 0, kv_start=None, device=None, t0: int = 0):
    """`[B, T, S]` bool: key s is visible to query t (causal, past the row's left padding)."""
    pos, s, start = _positions(B, T, S, q_offset, kv_start, device, t0)
    return (s <= pos) & (s >= start)


def indexer_scores_naive(q_idx, w, k_idx, *, q_offset: int = 0, kv_start=None, t0: int = 0) -> torch.Tensor:
    """Differentiable indexer scores.

    Args:
        q_idx: `[B, T, H_I, D_I]`; w: `[B, T, H_I]`; k_idx: `[B, S, D_I]`.
    Returns:
        `[B, T, S]` float32 (float64 for float64 inputs) scores, -inf where the key is not visible.
    """
    B, T = q_idx.shape[:2]
    S = k_idx.shape[1]
    acc = torch.promote_types(q_idx.dtype, torch.float32)
    dots = torch.einsum("bthd,bsd->bths", q_idx.to(acc), k_idx.to(acc)).relu()
    scores = torch.einsum("bths,bth->bts", dots, w.to(acc))
    vis = visible_mask(B, T, S, q_offset, kv_start, q_idx.device, t0)
    return scores.masked_fill(~vis, float("-inf"))


def _visible_forced(pos, s, start, sink: int, window: int):
    """Broadcast masks over keys s for queries at pos (rows starting at start): (visible, forced), forced
    = the first `sink` and the last `window` visible keys."""
    vis = (s <= pos) & (s >= start)
    return vis, vis & ((s < start + sink) | (s > pos - window))


def select_topk(scores: torch.Tensor, visible: torch.Tensor, forced: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k of `scores [B, T, S]` among `visible`, `forced` keys first, ties to the later key;
    `[B, T, topk]` int32 sorted ascending with -1 padding at the end."""
    B, T, S = scores.shape
    s = scores.float().masked_fill(forced, float("inf")).masked_fill(~visible, float("-inf"))
    kk = min(topk, S)
    # Ties are common (ReLU scores are often exactly 0): among equal scores the most recent key wins,
    # which keeps the choice independent of left padding and of how the sequence was batched.
    # Kernels must follow the same rule.
    vals, order = torch.sort(s.flip(-1), dim=-1, descending=True, stable=True)
    vals, idx = vals[..., :kk], (S - 1) - order[..., :kk]
    big = torch.iinfo(torch.int32).max
    idx = torch.where(vals == float("-inf"), torch.full_like(idx, big), idx)
    idx = torch.sort(idx, dim=-1).values
    idx = torch.where(idx == big, torch.full_like(idx, -1), idx).to(torch.int32)
    if kk < topk:
        idx = torch.cat([idx, idx.new_full((B, T, topk - kk), -1)], dim=-1)
    return idx


def indexer_topk_naive(q_idx, w, k_idx, topk: int, *, q_offset: int = 0, sink: int = 0, window: int = 0,
                       kv_start=None) -> torch.Tensor:
    """Causal top-k key selection from indexer scores (see module docstring).

    Args:
        q_idx: `[B, T, H_I, D_I]` index queries; w: `[B, T, H_I]` head weights;
        k_idx: `[B, S, D_I]` index keys; topk: slots per query (sinks and window included);
        kv_start: optional `[B]` first valid key per row (left padding), default 0.
    Returns:
        `[B, T, topk]` int32 key positions, ascending, -1 padded.
    """
    if sink + window > topk:
        raise ValueError(f"sink ({sink}) + window ({window}) must not exceed topk ({topk})")
    B, T, H_I, _ = q_idx.shape
    S = k_idx.shape[1]
    chunk = max(1, _SCORE_BUDGET // max(1, B * H_I * S))
    out = []
    with torch.no_grad():
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            scores = indexer_scores_naive(q_idx[:, t0:t1], w[:, t0:t1], k_idx, q_offset=q_offset,
                                          kv_start=kv_start, t0=t0)
            pos, s, start = _positions(B, t1 - t0, S, q_offset, kv_start, q_idx.device, t0)
            out.append(select_topk(scores, *_visible_forced(pos, s, start, sink, window), topk))
    return torch.cat(out, 1) if out else torch.empty(B, 0, topk, dtype=torch.int32, device=q_idx.device)


def indexer_topk_decode_naive(q_idx, w, k_idx, pos, topk: int, *, sink: int = 0, window: int = 0,
                              kv_start=None) -> torch.Tensor:
    """Decode-time selection, one query per row at its own position.

    Args:
        q_idx: `[B, H_I, D_I]`; w: `[B, H_I]`; k_idx: `[B, S, D_I]` (the index-key cache, rows past a
        sequence's position are ignored); pos: `[B]` int position of each row's query (it sees keys
        `kv_start[b] <= s <= pos[b]`); kv_start: optional `[B]`.
    Returns:
        `[B, topk]` int32 key positions, ascending, -1 padded; same rule as `indexer_topk_naive`
        (forced sinks/window, ties to the later key).
    """
    if sink + window > topk:
        raise ValueError(f"sink ({sink}) + window ({window}) must not exceed topk ({topk})")
    B, S = k_idx.shape[:2]
    with torch.no_grad():
        # a query at position S - 1 sees every key: the per-row masks are applied by select_topk
        scores = indexer_scores_naive(q_idx[:, None], w[:, None], k_idx, q_offset=S - 1)  # [B, 1, S]
        _, s, start = _positions(B, 1, S, 0, kv_start, k_idx.device)
        p = torch.as_tensor(pos, device=k_idx.device).long().view(B, 1, 1)
        return select_topk(scores, *_visible_forced(p, s, start, sink, window), topk)[:, 0]
