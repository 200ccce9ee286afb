"""The materialising score kernel of the prefill top-k paths: masked fp32 index scores `[B, Tc, Sc]` of a chunk of
queries (`triton.indexer_topk`'s "auto" / "bin" / "radix" / "materialise" paths, and `cand_topk`'s exact redo of
flagged rows). Its own module so that both import it without a cycle."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.stream import score_tile
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision


@triton.jit
def _score_kernel(Q, W, KI, KVS, OUT,
                  sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, sob, sot, sos,
                  T, S, t0, q_offset, sink, window,
                  HI: tl.constexpr, DI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    """OUT `[B, Tc, Sc]` fp32 for queries t0 + m of this chunk: +inf forced, -inf not visible. The
    tile's scores are `stream.score_tile`, the streaming path's: both paths select from the same values."""
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)  # row in the chunk
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    tq = t0 + offs_m
    mmask = tq < T
    start = tl.load(KVS + b)
    pos = q_offset + tq
    last = q_offset + tl.minimum(t0 + pm * BLOCK_M + BLOCK_M, T) - 1  # last visible key of the tile
    if pn * BLOCK_N <= last:  # tiles wholly in the future need no arithmetic, only -inf
        acc, vis, forced, offs_n = score_tile(Q, W, KI, b, tq, mmask, pos, start, pn * BLOCK_N, S, sink, window,
                                                sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                                                HI, DI, BLOCK_M, BLOCK_N, BLOCK_D, PREC)
        acc = tl.where(vis, acc, float("-inf"))
        acc = tl.where(forced, float("inf"), acc)
    else:
        acc = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    tl.store(OUT + b * sob + offs_m[:, None] * sot + offs_n[None, :] * sos, acc,
             mask=mmask[:, None] & (offs_n[None, :] < S))


def indexer_scores_chunk(q_idx, w, k_idx, kv_start, t0: int, t1: int, S_c: int, q_offset: int,
                         sink: int, window: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Masked scores of queries t0..t1-1 against keys 0..S_c-1: `[B, t1-t0, S_c]` fp32."""
    B, T, HI, DI = q_idx.shape
    if out is None:
        out = torch.empty(B, t1 - t0, S_c, device=q_idx.device, dtype=torch.float32)
    # Decode (one query per row) must not pay for 64 rows of MMA: shrink the query tile.
    BM, BN = (16 if t1 - t0 <= 16 else 64), 128
    BD = max(16, triton.next_power_of_2(DI))
    grid = (triton.cdiv(t1 - t0, BM), triton.cdiv(S_c, BN), B)
    _score_kernel[grid](q_idx, w, k_idx, kv_start, out, *q_idx.stride(), *w.stride(), *k_idx.stride(),
                        *out.stride(), t1, S_c, t0, q_offset, sink, window,
                        HI=HI, DI=DI, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, PREC=dot_precision(q_idx.dtype),
                        num_warps=8 if q_idx.is_cuda else 1, num_stages=2 if q_idx.is_cuda else 1)
    return out
