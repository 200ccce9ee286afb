"""Triton lightning-indexer scores + causal top-k.

`I(t, s) = sum_j w[t, j] * ReLU(q[t, j] . k[s])`, masked to the keys `kv_start <= s <= q_offset + t`,
with the first `sink` and the last `window` visible keys forced (+inf). Same semantics and output as
`naive.indexer_topk_naive`.

Design (why):
- A fused score kernel streams keys: one program scores a `[BLOCK_M queries, BLOCK_N keys]` tile
  for all index heads (one small dot per head, ReLU, weighted sum in registers) and writes the
  masked fp32 tile. The `[T, H_I, S]` per-head products never reach memory.
- Queries are processed in chunks so the score buffer is `[B, Tc, Sc]` with
  `B*Tc*Sc*4 <= budget` bytes (default 1 GiB on CUDA), never `[T, S]` at long context; a chunk
  only covers keys up to its last query's position (`Sc = q_offset + t1`), which halves the causal work.
- `topk_impl="auto"` on CUDA: for rows of more than 32K keys "cand" (below); otherwise the materialising path
  with the one-histogram select of `bin_topk.py`
  (benchmarks/NOTES.md item 16, H200, trained indexer, B = 1, k = 2048, scores + top-k: 0.73 / 2.35 /
  7.97 / 132.1 ms at 8K / 16K / 32K / 128K against radix 0.96 / 3.52 / 13.08 and the stream select
  3.27 / 5.34 / 16.57 / 162.9; rows equal to radix's at every length). Under the CPU interpreter:
  torch.topk.
- `topk_impl="cand"`: `cand_topk.py` (sessions 10-11), never materialising: a per-row threshold from the quantile
  of a strided key sample, a compacting gather sweep (session 11: 32-key words and popcounts, no scan over the
  tile), a binary-search buffer select, flagged rows redone. H200, session 11 call 1 (rows equal to bin's):
  32K 5.51 ms trained / 5.00 random against bin's 7.93 / 7.12; 128K random 44.5 against 111.6 (session 10's
  cand 72.5), trained 54.1. So `auto` on CUDA takes it for rows of at least `CAND_MIN_KEYS` keys and bin below
  (cand not timed below 32K).
- `topk_impl="stream"`: the streaming select of `stream.py`, which never materialises the scores (per
  query tile: sampled statistics, a threshold, a candidate buffer, an exact select among the
  candidates; see its docstring). NOTES items 10 and 13: 9.25 / 83 ms at 32K / 128K on random input,
  14.6-18.4 / 159 ms on the trained one (its sampled threshold is input dependent), 1.83 ms at 8K.
- `topk_impl="binned"`: the binned streaming select of `stream_binned.py` (one byte code per score
  written densely by the sweep instead of a candidate buffer, a per-row byte histogram, the boundary
  bin's scores recomputed; see its docstring). Exact, but not faster on the H200 (9.24 / 118.5 ms at
  32K / 128K against 9.06 / 79.0 for "stream"), so "auto" does not take it.
- Top-k per chunk ("materialise", "radix", "torch"): `torch.topk(sorted=False)` + a sort of the k
  indices, or the radix select (`radix_topk.py`, output already ascending). On an H200 (bf16 inputs,
  k = 2048) the radix kernel was faster for rows up to 32K keys (8K prefill: 0.84 vs 1.60 ms; 32K:
  11.5 vs 12.2 ms; decode at 32K: 0.21 ms for scores + top-k) and slower beyond (64K: 46 vs 40 ms;
  128K: 186 vs 143 ms; benchmarks/NOTES.md), so "materialise" takes radix for rows of <= 32K keys
  and torch.topk otherwise ("radix" and "torch" force one).
- Ties: the bin, radix and decode selects keep the reference's rule (among equal scores the later
  key wins), so a padded row and the same row unpadded select the same keys; `torch.topk` (rows over
  32K keys, or `topk_impl="torch"`) breaks exact ties its own way.
- One query per row (T = 1, decode through the HF path) goes to the chunked decode select (decode.py).
"""

from __future__ import annotations

import torch

from sparse_rl.sparse.ops.indexer_topk.bin_topk import bin_topk
from sparse_rl.sparse.ops.indexer_topk.cand_topk import indexer_topk_cand
from sparse_rl.sparse.ops.indexer_topk.decode import indexer_topk_decode
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_naive
from sparse_rl.sparse.ops.indexer_topk.radix_topk import radix_topk
from sparse_rl.sparse.ops.indexer_topk.scores import indexer_scores_chunk
from sparse_rl.sparse.ops.indexer_topk.stream import indexer_topk_stream
from sparse_rl.sparse.ops.indexer_topk.stream_binned import indexer_topk_binned

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCORE_BUDGET_BYTES = 1 << 30
TOPK_IMPLS = ("auto", "cand", "stream", "binned", "materialise", "radix", "bin", "torch")
RADIX_MAX_KEYS = 32768  # rows longer than this take torch.topk on CUDA (measured, see module docstring)
CAND_MIN_KEYS = 32768  # `auto` on CUDA: rows of this many keys or more take "cand" (1.4x bin at 32K, 2.5x at 128K)


def topk_from_scores(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """`[B, Tc, Sc]` masked scores -> `[B, Tc, topk]` int32 ascending positions, -1 padded."""
    B, Tc, Sc = scores.shape
    kk = min(topk, Sc)
    vals, idx = torch.topk(scores, kk, dim=-1, sorted=False)
    big = torch.iinfo(torch.int32).max
    idx = torch.where(vals == float("-inf"), big, idx.to(torch.int32))
    idx = torch.sort(idx, dim=-1).values
    idx = torch.where(idx == big, -1, idx)
    if kk < topk:
        idx = torch.cat([idx, idx.new_full((B, Tc, topk - kk), -1)], dim=-1)
    return idx


def indexer_topk(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, topk: int, *, q_offset: int = 0,
                 sink: int = 0, window: int = 0, kv_start: torch.Tensor | None = None,
                 budget_bytes: int | None = None, topk_impl: str = "auto") -> torch.Tensor:
    """Indexer top-k, Triton scores. q_idx `[B, T, H_I, D_I]`, w `[B, T, H_I]`, k_idx `[B, S, D_I]`
    -> `[B, T, topk]` int32 ascending, -1 padded. Index dims above 128, more than 64 index heads
    or float64 take the reference. `topk_impl`: "auto" | "cand" | "stream" | "binned" | "materialise" | "radix" |
    "bin" | "torch" (see module docstring)."""
    if topk_impl not in TOPK_IMPLS:
        raise ValueError(f"topk_impl {topk_impl!r}: expected one of {', '.join(TOPK_IMPLS)}")
    if sink + window > topk:
        raise ValueError(f"sink ({sink}) + window ({window}) must not exceed topk ({topk})")
    B, T, HI, DI = q_idx.shape
    S = k_idx.shape[1]
    if (q_idx.dtype not in _DTYPES or k_idx.dtype != q_idx.dtype or DI > 128 or HI > 64 or T == 0 or S == 0):
        return indexer_topk_naive(q_idx, w, k_idx, topk, q_offset=q_offset, sink=sink, window=window,
                                  kv_start=kv_start)
    dev = q_idx.device
    if T == 1 and topk_impl == "auto" and q_idx.is_cuda:
        # one query per row: the chunked decode select keeps the whole GPU busy (decode.py)
        pos = torch.full((B,), q_offset, dtype=torch.int32, device=dev)
        return indexer_topk_decode(q_idx[:, 0], w[:, 0], k_idx, pos, topk, sink=sink, window=window,
                                   kv_start=kv_start)[:, None]
    if topk_impl == "binned":
        return indexer_topk_binned(q_idx, w, k_idx, topk, q_offset=q_offset, sink=sink, window=window,
                                   kv_start=kv_start)
    if topk_impl == "cand" or (topk_impl == "auto" and q_idx.is_cuda and min(S, q_offset + T) >= CAND_MIN_KEYS):
        return indexer_topk_cand(q_idx, w, k_idx, topk, q_offset=q_offset, sink=sink, window=window,
                                 kv_start=kv_start)
    if topk_impl == "stream":
        return indexer_topk_stream(q_idx, w, k_idx, topk, q_offset=q_offset, sink=sink, window=window,
                                   kv_start=kv_start)
    kvs = (torch.zeros(B, dtype=torch.int32, device=dev) if kv_start is None
           else torch.as_tensor(kv_start, device=dev).to(torch.int32).reshape(B))
    budget = budget_bytes or (SCORE_BUDGET_BYTES if q_idx.is_cuda else 1 << 24)
    # Chunks are sized for the widest key range (the last chunk); earlier chunks cover fewer keys.
    S_max = max(1, min(S, q_offset + T))
    chunk = max(1, min(T, budget // (4 * B * S_max)))
    out = torch.empty(B, T, topk, dtype=torch.int32, device=dev)
    use_bin = topk_impl == "bin" or (topk_impl == "auto" and q_idx.is_cuda)
    radix = topk_impl == "radix" or (topk_impl == "materialise" and q_idx.is_cuda
                                     and min(S, q_offset + T) <= RADIX_MAX_KEYS)
    with torch.no_grad():
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            S_c = max(1, min(S, q_offset + t1))  # keys past the chunk's last query are never visible
            scores = indexer_scores_chunk(q_idx, w, k_idx, kvs, t0, t1, S_c, q_offset, sink, window)
            if use_bin:
                bin_topk(scores, topk, q_lim=q_offset + t0, out=out[:, t0:t1])
            elif radix:
                radix_topk(scores, topk, q_lim=q_offset + t0, out=out[:, t0:t1])
            else:
                out[:, t0:t1] = topk_from_scores(scores, topk)
    return out
