"""The decode select after the score pass in ONE program per row (`indexer_topk_decode(impl="row")`).

The chunked select (`decode.py`) runs its passes as five launches over (chunk, row) programs plus a
memset: hist, count, gather, select, write. At decode sizes each of them reads only the row's fp32
scores (64 KB a row at 16K, from L2) and is held by launch and dependency latency, not bytes: on the
H200 at 32 x 16K they took ~40 us a layer together against a ~16 us score pass (the index keys,
benchmarks/results/2026-12-01-h200-rollout-qwen3-4b.md). vLLM / SGLang / TensorRT-LLM do the DSA
decode top-k the same way for this reason: a logits kernel, then one CTA per row that histograms,
finds the threshold bin, resolves it and writes the row (TRT-LLM splits rows only past ~200K keys).

Here: `decode._score_max` (the (chunk, row) score pass, every SM busy) writes each chunk's maximum
and minimum to `[B, P, 2]` instead of atomics (so nothing needs a memset), then `_row_select`, one
program per row over large blocks of the row's scores (`block` keys, ~8 a thread):
1. the first-level histogram (NB linear bins over the row's span, `decode._block`), and the forced count;
2. b*, the bin holding the k-th largest finite score (`decode._bstar_of`);
3. the candidates (keys in b*) to a scratch list, in key order;
4. the exact threshold among them: one in-register sort when there are at most `sort` of them, else
   the four radix levels (`decode._sort_threshold` / `decode._radix_threshold`);
5. the selected positions in ascending order (a running cumsum gives each its slot), -1 padding.
Two launches a layer in all, no memset; the same keys as the reference (ties to the later key).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.decode_steps import (NB, _append, _bstar_of, _block, _emit, _pad_rest,
                                                           _radix_threshold, _sort_threshold)


@triton.jit
def _row_span(SPAN, b, pos, P, CH: tl.constexpr, NB: tl.constexpr, PMAX: tl.constexpr):
    """`decode._span` from per-chunk spans: SPAN `[B, P, 2]` fp32 holds each chunk's (max, min) of its
    unforced finite scores; only chunks starting at or before pos were written."""
    offs_p = tl.arange(0, PMAX)
    pm = offs_p <= pos // CH
    mx = tl.max(tl.load(SPAN + (b * P + offs_p) * 2, mask=pm, other=float("-inf")), 0)
    mn = tl.min(tl.load(SPAN + (b * P + offs_p) * 2 + 1, mask=pm, other=float("inf")), 0)
    span = mx - mn
    ok = (span > 0) & (span < float("inf"))
    return mx, tl.where(ok, NB / tl.where(ok, span, 1.0), 0.0)


@triton.jit
def _row_select(SC, POS, SPAN, CU, CI, OUT, NC, sob, S, K, P, CH: tl.constexpr, NB: tl.constexpr,
                PMAX: tl.constexpr, RBN: tl.constexpr, BLOCK: tl.constexpr, SORT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    mx, inv = _row_span(SPAN, b, pos, P, CH, NB, PMAX)
    bins = tl.arange(0, NB)
    hist = tl.zeros([NB], tl.int32)
    nf = 0
    for n0 in range(0, pos + 1, RBN):
        offs_n, x, fin, d, u = _block(SC, b, S, pos, n0, mx, inv, RBN, NB)
        hist += tl.histogram(tl.where(fin, d, 0), NB) - tl.where(bins == 0, tl.sum((~fin).to(tl.int32), 0), 0)
        nf += tl.sum((x == float("inf")).to(tl.int32), 0)
    bstar, rem, take_all = _bstar_of(hist, nf, K, NB)
    tau = tl.zeros([], tl.uint32)  # take_all: every finite u is >= 0 and every cut 0 passes
    cut = 0
    n_c = 0
    if not take_all:
        if rem <= 0:  # the forced keys fill the budget: no finite key is taken
            tau = tl.full([], 0xFFFFFFFF, tl.uint32)
            cut = 2147483647
        else:
            for n0 in range(0, pos + 1, RBN):
                offs_n, x, fin, d, u = _block(SC, b, S, pos, n0, mx, inv, RBN, NB)
                cand = fin & (d == bstar)
                n_c = _append(CU, CI, b, S, offs_n, u, cand, n_c)
            if SORT > 0 and n_c <= SORT:
                tau, cut, _ = _sort_threshold(CU, CI, b, S, n_c, rem, CH, PMAX, SORT)
            else:
                tau, cut, _ = _radix_threshold(CU, CI, b, S, n_c, rem, CH, PMAX, BLOCK)
    tl.store(NC + b, n_c)
    off = 0
    for n0 in range(0, pos + 1, RBN):
        offs_n, x, fin, d, u = _block(SC, b, S, pos, n0, mx, inv, RBN, NB)
        sel = (x == float("inf")) | (fin & ((u > tau) | ((u == tau) & (offs_n >= cut))))
        off = _emit(OUT, b, sob, offs_n, sel, off)
    _pad_rest(OUT, b, sob, off, K, RBN)


def row_select(sc: torch.Tensor, pos: torch.Tensor, span: torch.Tensor, topk: int, chunk: int, *, sort: int,
               block: int, num_warps: int, interpret: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """sc `[B, S]` fp32 scores of the score pass (+inf forced, -inf invisible; only columns <= pos
    written), pos `[B]` int32, span `[B, P, 2]` each chunk's (max, min) of its unforced finite scores ->
    (`[B, topk]` int32 ascending, -1 padded; `[B]` int32 candidates each row resolved)."""
    B, S = sc.shape
    P = span.shape[1]
    cu = torch.empty(B, S, device=sc.device, dtype=torch.int32)
    ci = torch.empty(B, S, device=sc.device, dtype=torch.int32)
    out = torch.empty(B, topk, device=sc.device, dtype=torch.int32)
    n_c = torch.empty(B, device=sc.device, dtype=torch.int32)
    _row_select[(B,)](sc, pos, span, cu, ci, out, n_c, out.stride(0), S, topk, P, CH=chunk, NB=NB,
                      PMAX=max(16, triton.next_power_of_2(P)), RBN=16 if interpret else block,
                      BLOCK=64 if interpret else 1024, SORT=sort, num_warps=1 if interpret else num_warps)
    return out, n_c
