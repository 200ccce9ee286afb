"""The decode select after the score pass in three (chunk, row) launches and no memset
(`indexer_topk_decode(impl="split")`): the chunked select's parallelism with fewer passes.

`decode_row.py` does all of it in one program per row, which leaves most SMs idle and walks the row
three times in sequence; here every pass still runs one program per (chunk, row), as in `decode.py`,
but nothing needs atomics or a zeroed scratch, and the count, select and write passes are merged:
1. `_hist_chunk`: each chunk's first-level histogram `[B, P, NB]` and forced count `[B, P]`, stored
   (the row's span from the score pass's per-chunk maxima and minima, `decode_row._row_span`);
2. `_gather_chunk`: every program sums the row's per-chunk histograms (`[P, NB]`, a few KB from L2),
   finds b* (`decode._bstar_of`) and gathers its chunk's candidates (keys in b*) into the row's list
   at the offset the earlier chunks' b* counts give: in key order, no count pass;
3. `_thresh_write`: every program resolves the row's threshold over the candidates itself (the same
   sort / radix helpers as `decode.py`; each of a row's programs repeats this small step instead of
   waiting for one program to do it), takes its output offset from the earlier chunks' counts (keys in
   bins above b*, forced keys, kept candidates) and writes its selected positions in ascending order;
   the row's last program pads with -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.decode_steps import (NB, _append, _block, _bstar_of, _emit, _pad_rest,
                                                           _radix_threshold, _sort_threshold)
from sparse_rl.sparse.ops.indexer_topk.decode_row import _row_span
from sparse_rl.sparse.ops.pdl import pdl_enter


@triton.jit
def _tile(HP, NFP, b, pos, P, CH: tl.constexpr, NB: tl.constexpr, PMAX: tl.constexpr):
    """The row's per-chunk histograms `[PMAX, NB]` and forced counts `[PMAX]` (0 past the visible chunks)."""
    offs_p = tl.arange(0, PMAX)
    pm = offs_p <= pos // CH
    hp = tl.load(HP + (b * P + offs_p[:, None]) * NB + tl.arange(0, NB)[None, :], mask=pm[:, None], other=0)
    return hp, tl.load(NFP + b * P + offs_p, mask=pm, other=0)


@triton.jit
def _list_start(HP, NFP, SPAN, b, p, pos, K, P, CH: tl.constexpr, NB: tl.constexpr, PMAX: tl.constexpr):
    """For chunk p of row b (`_gather_chunk`, `decode_fine._sub_gather`): the row's b* and rank left in it
    (`_bstar_of` over the summed per-chunk histograms), its span (max, NB / span) and the chunk's first slot
    in the row's candidate list (the earlier chunks' keys in b*: the list is in key order, no count pass)."""
    hp, nfp = _tile(HP, NFP, b, pos, P, CH, NB, PMAX)
    bstar, rem, take_all = _bstar_of(tl.sum(hp, 0), tl.sum(nfp, 0), K, NB)
    mx, inv = _row_span(SPAN, b, pos, P, CH, NB, PMAX)
    col = tl.sum(tl.where(tl.arange(0, NB)[None, :] == bstar, hp, 0), 1)  # [PMAX] b* keys a chunk
    return bstar, rem, mx, inv, tl.sum(tl.where(tl.arange(0, PMAX) < p, col, 0), 0)


@triton.jit
def _hist_chunk(SC, POS, SPAN, HP, NFP, S, P, CH: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                PMAX: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    if c0 <= pos:
        mx, inv = _row_span(SPAN, b, pos, P, CH, NB, PMAX)
        bins = tl.arange(0, NB)
        hist = tl.zeros([NB], tl.int32)
        nf = 0
        for i in range(0, CH // BN):
            offs_n, x, fin, d, u = _block(SC, b, S, pos, c0 + i * BN, mx, inv, BN, NB)
            hist += tl.histogram(tl.where(fin, d, 0), NB) - tl.where(bins == 0, tl.sum((~fin).to(tl.int32), 0), 0)
            nf += tl.sum((x == float("inf")).to(tl.int32), 0)
        tl.store(HP + (b * P + p) * NB + bins, hist)
        tl.store(NFP + b * P + p, nf)


@triton.jit
def _gather_chunk(SC, POS, SPAN, HP, NFP, CU, CI, S, K, P, CH: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                  PMAX: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    if c0 <= pos:
        bstar, rem, mx, inv, off = _list_start(HP, NFP, SPAN, b, p, pos, K, P, CH, NB, PMAX)
        if (bstar < NB) & (rem > 0):
            for i in range(0, CH // BN):
                offs_n, x, fin, d, u = _block(SC, b, S, pos, c0 + i * BN, mx, inv, BN, NB)
                cand = fin & (d == bstar)
                off = _append(CU, CI, b, S, offs_n, u, cand, off)


@triton.jit
def _thresh_write(SC, POS, SPAN, HP, NFP, CU, CI, OUT, NC, sob, S, K, P, CH: tl.constexpr, BN: tl.constexpr,
                  NB: tl.constexpr, PMAX: tl.constexpr, BLOCK: tl.constexpr, SORT: tl.constexpr,
                  PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    hp, nfp = _tile(HP, NFP, b, pos, P, CH, NB, PMAX)
    bins = tl.arange(0, NB)[None, :]
    bstar, rem, take_all = _bstar_of(tl.sum(hp, 0), tl.sum(nfp, 0), K, NB)
    emit = nfp + tl.sum(tl.where(bins < bstar, hp, 0), 1)  # [PMAX] keys each chunk takes outright
    n_c = tl.sum(tl.sum(tl.where(bins == bstar, hp, 0), 1), 0)
    tau = tl.zeros([], tl.uint32)  # take_all: every finite u is >= 0 and every cut 0 passes
    cut = 0
    if not take_all:
        if rem <= 0:  # the forced keys fill the budget: no finite key is taken
            tau = tl.full([], 0xFFFFFFFF, tl.uint32)
            cut = 2147483647
        else:
            if SORT > 0 and n_c <= SORT:
                tau, cut, kept = _sort_threshold(CU, CI, b, S, n_c, rem, CH, PMAX, SORT)
            else:
                tau, cut, kept = _radix_threshold(CU, CI, b, S, n_c, rem, CH, PMAX, BLOCK)
            emit += kept
    if p == 0:
        tl.store(NC + b, tl.where(take_all | (rem <= 0), 0, n_c))
    off = tl.sum(tl.where(tl.arange(0, PMAX) < p, emit, 0), 0)
    if c0 <= pos:
        mx, inv = _row_span(SPAN, b, pos, P, CH, NB, PMAX)
        for i in range(0, CH // BN):
            offs_n, x, fin, d, u = _block(SC, b, S, pos, c0 + i * BN, mx, inv, BN, NB)
            sel = (x == float("inf")) | (fin & ((u > tau) | ((u == tau) & (offs_n >= cut))))
            off = _emit(OUT, b, sob, offs_n, sel, off)
    if p == P - 1:  # every visible chunk's count is in off now: pad the rest with -1
        off = tl.sum(emit, 0)
        _pad_rest(OUT, b, sob, off, K, BN)


def split_select(sc: torch.Tensor, pos: torch.Tensor, span: torch.Tensor, topk: int, chunk: int, block: int, *,
                 sort: int, num_warps: int, interpret: bool, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_row.row_select`'s inputs and result (block: the keys a step of each chunk's loop), in
    three (chunk, row) launches (pdl: each with programmatic dependent launch)."""
    B, S = sc.shape
    P = span.shape[1]
    PMAX = max(16, triton.next_power_of_2(P))
    dev = sc.device
    hp = torch.empty(B, P, NB, device=dev, dtype=torch.int32)
    nfp = torch.empty(B, P, device=dev, dtype=torch.int32)
    cu = torch.empty(B, S, device=dev, dtype=torch.int32)
    ci = torch.empty(B, S, device=dev, dtype=torch.int32)
    out = torch.empty(B, topk, device=dev, dtype=torch.int32)
    n_c = torch.empty(B, device=dev, dtype=torch.int32)
    grid = (P, B)
    kw = dict(CH=chunk, BN=block, NB=NB, PMAX=PMAX, num_warps=num_warps, PDL=pdl, launch_pdl=bool(pdl))
    _hist_chunk[grid](sc, pos, span, hp, nfp, S, P, **kw)
    _gather_chunk[grid](sc, pos, span, hp, nfp, cu, ci, S, topk, P, **kw)
    _thresh_write[grid](sc, pos, span, hp, nfp, cu, ci, out, n_c, out.stride(0), S, topk, P,
                        BLOCK=64 if interpret else 1024, SORT=sort, **kw)
    return out, n_c
