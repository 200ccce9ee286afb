"""Reference DSA lightning-indexer scores and causal top-k selection.

Score of query t against key s:  I(t, s) = sum_j w[t, j] * ReLU(q[t, j] . k[s])   (DeepSeek-V3.2).
Query t sits at key position `q_offset + t` and sees keys `kv_start <= s <= q_offset + t`
(`kv_start` per batch row skips left padding). The first `sink` visible keys and the last `window`
ones (the query's own position included) are always kept; the rest of the `topk` budget goes to
the highest scores. Queries are processed in chunks so only a `[B, Tc, S]` block of scores ever
exists (never `[B, T, H_I, S]` at full length).
"""

from __future__ import annotations

from typing import NamedTuple

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


FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_index_keys(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 index keys (`SparseConfig.index_dtype = "fp8"`): k `[..., d_I]` -> (float8_e4m3fn `[..., d_I]`,
    fp32 scale `[...]`), one scale per token = max |k| / 448, so k ~ k8 * scale (e4m3: 3 mantissa bits,
    rounded to nearest even). A token's scores are then scale * sum_h w_h relu(q_h . k8) (scale > 0)."""
    kf = k.float()
    scale = kf.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    return (kf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def indexer_topk_decode_naive(q_idx, w, k_idx, pos, topk: int, *, sink: int = 0, window: int = 0,
                              kv_start=None, k_scale=None) -> torch.Tensor:
    """Decode-time selection, one query per row at its own position.

    Args:
        q_idx: `[B, H_I, D_I]`; w: `[B, H_I]`; k_idx: `[B, S, D_I]` (the index-key cache, rows past a
        sequence's position are ignored); pos: `[B]` int position of each row's query (it sees keys
        `kv_start[b] <= s <= pos[b]`); kv_start: optional `[B]`; k_scale: `[B, S]` fp32 per-token
        scales of fp8 keys (`quantize_index_keys`), None for keys in a float dtype.
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
        if k_scale is not None:  # relu(scale * x) = scale * relu(x): the scale applies after the head sum
            scores = scores * k_scale[:, None, :S].to(scores.dtype)
        _, s, start = _positions(B, 1, S, 0, kv_start, k_idx.device)
        p = torch.as_tensor(pos, device=k_idx.device).long().view(B, 1, 1)
        return select_topk(scores, *_visible_forced(p, s, start, sink, window), topk)[:, 0]


# ---------------------------------------------------------------------------------------------
# granular selection (key blocks, query groups): the reference of docs/DESIGN.md "Selection granularity"


def group_start(pos: torch.Tensor, start: torch.Tensor, query_group: int) -> torch.Tensor:
    """The representative (first) position of each query's group: groups of `query_group` positions
    counted from the row's first valid key `start` (so left padding does not move them)."""
    rel = (pos - start).clamp(min=0)
    return torch.where(pos >= start, start + rel // query_group * query_group, pos)


def mask_to_rows(mask: torch.Tensor, width: int) -> torch.Tensor:
    """`[..., S]` bool -> `[..., width]` int32 positions of the set entries, ascending, -1 padded
    (at most `width` entries may be set)."""
    S = mask.shape[-1]
    big = torch.iinfo(torch.int32).max
    s = torch.arange(S, device=mask.device, dtype=torch.int32)
    idx = torch.where(mask, s, torch.full_like(s, big)).sort(-1).values[..., :width]
    idx = torch.where(idx == big, torch.full_like(idx, -1), idx)
    if idx.shape[-1] < width:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], width - idx.shape[-1]), -1)], -1)
    return idx


def pool_blocks(scores: torch.Tensor, visible: torch.Tensor, bid: torch.Tensor, n_blocks: int,
                block_score: str) -> torch.Tensor:
    """Block scores `[B, T, NB]` from token scores `[B, T, S]` over each block's `visible` tokens
    (max or mean); bid `[B, 1, S]` the block of every key (-1 = before the row's start); -inf for a
    block with no visible token."""
    B, T, S = scores.shape
    b = bid.clamp(min=0).expand(B, T, S)
    keep = visible & (bid >= 0)
    s = scores if scores.dtype == torch.float64 else scores.float()
    if block_score == "max":
        out = s.new_full((B, T, n_blocks), float("-inf"))
        return out.scatter_reduce(-1, b, s.masked_fill(~keep, float("-inf")), "amax", include_self=True)
    tot = s.new_zeros(B, T, n_blocks).scatter_add(-1, b, s.masked_fill(~keep, 0.0))
    cnt = s.new_zeros(B, T, n_blocks).scatter_add(-1, b, keep.to(s.dtype))
    return torch.where(cnt > 0, tot / cnt.clamp(min=1), torch.full_like(tot, float("-inf")))


def granular_select_core(scores: torch.Tensor, pos: torch.Tensor, rep: torch.Tensor, start: torch.Tensor, topk: int,
                         *, sink: int, window: int, key_block: int, query_group: int,
                         block_score: str) -> torch.Tensor:
    """The granular rule, given the representative queries' scores.

    scores `[B, T, S]`: indexer scores of each query's representative (group start) `rep [B, T]` over
    all keys; pos `[B, T]` the queries' positions; start `[B, 1]` the rows' first valid key.
    A group whose last member sees <= topk keys keeps every visible key. Otherwise the representative
    keeps its `sink` first and `window` last visible keys plus the best `(topk - G + 1 - sink - window)
    // key_block` whole key blocks (aligned from `start`, scored by max/mean over the block's tokens it
    sees; ties to the later block) among blocks with a token it sees and does not force; every member
    then adds the group's keys after the representative up to itself. -> `[B, T, topk]` int32.
    """
    B, T, S = scores.shape
    G, kb = query_group, key_block
    s = torch.arange(S, device=scores.device).view(1, 1, S)
    p, r, st = pos[..., None], rep[..., None], start.view(B, 1, 1)
    vis_r = (s <= r) & (s >= st)
    forced = vis_r & ((s < st + sink) | (s > r - window))
    budget = topk - (G - 1)
    if kb == 1:
        top = select_topk(scores, vis_r, forced, budget).long()
        sel = torch.zeros(B, T, S + 1, dtype=torch.bool, device=scores.device)
        sel.scatter_(-1, torch.where(top >= 0, top, S), True)
        sel = sel[..., :S]
    else:
        n_blocks = (S + kb - 1) // kb
        bid = torch.where(s >= st, (s - st) // kb, -1)
        cand = torch.zeros(B, T, n_blocks + 1, dtype=torch.bool, device=scores.device)
        cand.scatter_(-1, torch.where((vis_r & ~forced) & (bid >= 0), bid, n_blocks).expand(B, T, S), True)
        pooled = pool_blocks(scores, vis_r, bid, n_blocks, block_score)
        nb = max(0, (budget - sink - window) // kb)
        chosen = select_topk(pooled, cand[..., :n_blocks], torch.zeros_like(cand[..., :n_blocks]), nb).long()
        blk = torch.zeros(B, T, n_blocks + 1, dtype=torch.bool, device=scores.device)
        blk.scatter_(-1, torch.where(chosen >= 0, chosen, n_blocks), True)
        sel = forced | (blk.gather(-1, bid.clamp(min=0).expand(B, T, S)) & vis_r & (bid >= 0))
    short = (r + G - 1 - st + 1) <= topk
    sel = torch.where(short, vis_r, sel) | (s > r)
    return mask_to_rows(sel & (s <= p) & (s >= st), topk)


def _raw_scores(q_idx, w, k_idx) -> torch.Tensor:
    """Indexer scores without masks: q_idx `[B, T, H_I, D_I]`, w `[B, T, H_I]`, k_idx `[B, S, D_I]` -> `[B, T, S]`."""
    acc = torch.promote_types(q_idx.dtype, torch.float32)
    dots = torch.einsum("bthd,bsd->bths", q_idx.to(acc), k_idx.to(acc)).relu()
    return torch.einsum("bths,bth->bts", dots, w.to(acc))


def shared_rows_ok(kv_start, q_offset: int, query_group: int) -> bool:
    """Whether the selection can be returned as one row per group of `query_group` consecutive queries
    (the rows `ops.sparse_attention(..., query_group=)` takes): groups must start at query 0 of every
    row, so no left padding and q_offset a multiple of the group."""
    return query_group > 1 and kv_start is None and q_offset % query_group == 0


def group_rows(B: int, T: int, q_offset: int, kv_start, query_group: int, device):
    """Where the granular rule is evaluated for queries at q_offset..q_offset+T-1.

    Returns start `[B, 1]` (first valid key per row), pos `[B, T]` (the queries' positions) and the
    evaluation rows ev_pos / ev_rep `[B, N]` (a row's position and its group representative), with
    inv `[T]` the evaluation row of each query, or None when every query is its own row (N = T).
    A member's row is its group's last member's row cut at its own position, so without left padding
    (groups line up across the batch) the rule runs once per group: G x fewer rows."""
    start = (torch.zeros(B, 1, dtype=torch.long, device=device) if kv_start is None
             else torch.as_tensor(kv_start, device=device).long().view(B, 1))
    pos = (torch.arange(T, device=device) + q_offset).view(1, T).expand(B, T)
    G = query_group
    if kv_start is None and G > 1:
        g0 = q_offset // G
        groups = torch.arange(g0, (q_offset + T - 1) // G + 1 if T else g0, device=device)
        ev_rep = (groups * G).view(1, -1).expand(B, -1)
        ev_pos = (ev_rep + G - 1).clamp(max=q_offset + T - 1)
        return start, pos, ev_pos, ev_rep, pos[0] // G - g0
    return start, pos, pos, group_start(pos, start, G), None


class GroupPlan(NamedTuple):
    """Where a granular selection is evaluated (`group_plan`): start `[B, 1]`, pos `[B, T]`, the
    evaluation rows ev_pos / ev_rep `[B, N]` and inv (`group_rows`), the index queries and weights the
    representatives are read from (q_all, w_all: history prepended when given) and each row's
    representative's row in them, j `[B, N]`."""

    start: torch.Tensor
    pos: torch.Tensor
    ev_pos: torch.Tensor
    ev_rep: torch.Tensor
    inv: torch.Tensor | None
    q_all: torch.Tensor
    w_all: torch.Tensor
    j: torch.Tensor


def group_plan(q_idx, w, q_offset: int, kv_start, query_group: int, history) -> GroupPlan:
    """The `GroupPlan` of queries q_idx `[B, T, H_I, D_I]`, w `[B, T, H_I]` at q_offset..; a ValueError
    when a representative lies before q_offset and no history is given."""
    B, T = q_idx.shape[:2]
    start, pos, ev_pos, ev_rep, inv = group_rows(B, T, q_offset, kv_start, query_group, q_idx.device)
    if history is not None:
        q_all, w_all, first = torch.cat([history[0], q_idx], 1), torch.cat([history[1], w], 1), 0
    else:
        q_all, w_all, first = q_idx, w, q_offset
    if bool((ev_rep < first).any()):
        raise ValueError(f"query_group {query_group}: a group starts before q_offset {q_offset}; pass history")
    return GroupPlan(start, pos, ev_pos, ev_rep, inv, q_all, w_all, (ev_rep - first).clamp(min=0))


def rep_queries(q_all, w_all, j):
    """The representatives' index queries `[B, N, H_I, D_I]` and weights `[B, N, H_I]` at rows j `[B, N]`."""
    H_I = q_all.shape[2]
    return (q_all.gather(1, j[..., None, None].expand(-1, -1, H_I, q_all.shape[-1])),
            w_all.gather(1, j[..., None].expand(-1, -1, H_I)))


def per_query_rows(rows: torch.Tensor, pos: torch.Tensor, inv) -> torch.Tensor:
    """Evaluation rows `[B, N, K]` -> each query's row `[B, T, K]` (its row cut at its position pos `[B, T]`)."""
    if inv is None:
        return rows
    rows = rows[:, inv]
    return torch.where(rows <= pos[..., None], rows, torch.full_like(rows, -1))


def granular_topk_naive(q_idx, w, k_idx, topk: int, *, q_offset: int = 0, sink: int = 0, window: int = 0,
                        kv_start=None, key_block: int = 1, query_group: int = 1, block_score: str = "max",
                        history=None, shared: bool = False) -> torch.Tensor:
    """Granular causal selection (see `granular_select_core`) of queries at q_offset...

    Args:
        q_idx: `[B, T, H_I, D_I]`, w: `[B, T, H_I]` the queries' index queries and weights; k_idx: `[B, S, D_I]`.
        history: (q_I `[B, q_offset, H_I, D_I]`, w `[B, q_offset, H_I]`) of the earlier positions, needed
            when a group started before q_offset (incremental decoding with query_group > 1).
        shared: return one row per query group instead (`shared_rows_ok` must hold): the last member's.
    Returns:
        `[B, T, topk]` int32 key positions, ascending, -1 padded (shared: `[B, ceil(T / G), topk]`).
        With key_block = query_group = 1 it equals `indexer_topk_naive`.
    """
    B, T, H_I, _ = q_idx.shape
    S = k_idx.shape[1]
    dev = q_idx.device
    start, pos, ev_pos, ev_rep, inv, q_all, w_all, j = group_plan(q_idx, w, q_offset, kv_start, query_group, history)
    N = ev_pos.shape[1]
    chunk = max(1, _SCORE_BUDGET // max(1, B * H_I * S))
    out = []
    with torch.no_grad():
        for t0 in range(0, N, chunk):
            t1 = min(N, t0 + chunk)
            qr, wr = rep_queries(q_all, w_all, j[:, t0:t1])
            out.append(granular_select_core(_raw_scores(qr, wr, k_idx), ev_pos[:, t0:t1], ev_rep[:, t0:t1], start,
                                            topk, sink=sink, window=window, key_block=key_block,
                                            query_group=query_group, block_score=block_score))
    if not out:
        return torch.empty(B, 0, topk, dtype=torch.int32, device=dev)
    rows = torch.cat(out, 1)
    return rows if shared else per_query_rows(rows, pos, inv)


def granular_topk_decode_naive(q_rep, w_rep, k_idx, pos, topk: int, *, sink: int = 0, window: int = 0,
                               kv_start=None, key_block: int = 1, query_group: int = 1,
                               block_score: str = "max") -> torch.Tensor:
    """Decode form: one query per row at `pos [B]`; q_rep `[B, H_I, D_I]`, w_rep `[B, H_I]` the index
    query and weights of each row's group representative (`group_start(pos)`; the query itself when
    query_group = 1); k_idx `[B, S, D_I]` the index-key cache -> `[B, topk]` int32, the row a full
    forward gives that query."""
    B = k_idx.shape[0]
    dev = k_idx.device
    start = (torch.zeros(B, 1, dtype=torch.long, device=dev) if kv_start is None
             else torch.as_tensor(kv_start, device=dev).long().view(B, 1))
    p = torch.as_tensor(pos, device=dev).long().view(B, 1)
    with torch.no_grad():
        scores = _raw_scores(q_rep[:, None], w_rep[:, None], k_idx)
        return granular_select_core(scores, p, group_start(p, start, query_group), start, topk, sink=sink,
                                    window=window, key_block=key_block, query_group=query_group,
                                    block_score=block_score)[:, 0]
