"""Triton decode-time indexer top-k: one query per row, every row at its own position.

`indexer_topk_decode(q_idx [B, H_I, D_I], w [B, H_I], k_idx [B, S, D_I], pos [B], topk)` ->
`[B, topk]` int32 ascending, -1 padded; the same selection as `naive.indexer_topk_decode_naive`
(forced sinks and window, the highest scores, ties between equal scores to the later key).

Why a separate kernel: in decode there are only B rows (8-64) of up to 128K keys. One program per
row (the prefill radix select) leaves most of the GPU idle and is latency bound (measured 0.21 ms
for B = 32 at 32K), and `torch.topk` costs ~0.1-0.2 ms a layer. Here every row is split into chunks
of `CH` keys and each pass runs one program per (chunk, row).

First-level bins between the row's extremes: Triton's `tl.histogram` costs ~NB/32 instructions per
element (measured on the H200: a 2048-bin first level made the score pass 4x slower than 256 bins),
so the first level has only NB = 128 bins, linear in the distance to the row's maximum over the
span max - min. Bins measured as key distances from the maximum (1/8-of-a-factor-of-2 steps, the
former design) put every negative score into one clamped bin: with mixed-sign index-head weights
(a converted model's usual case) most scores are negative, the threshold fell there and the select
went over nearly every key (66 us a layer at 64 x 16K on the H200, against 40 us for the score
pass). A linear bin over the span holds ~1% of a Gaussian-like row near the threshold, whatever the
signs (measured at 64 x 16K: 407 candidates a row on average with mixed-sign weights, 121 with
positive ones; the whole select 0.094 / 0.084 ms); a row whose span is set by one far outlier still
selects exactly, over more candidates.

1. `_score_max`: scores of the chunk (a small tensor-core dot per key block against all index heads,
   ReLU, weighted sum; +inf forced, -inf not visible) to a `[B, S]` fp32 scratch; the row maximum
   and minimum of the finite scores by atomics (on order-preserving integer keys, so that every
   scratch counter starts from one memset).
2. `_hist`: the 128-bin histogram per row (atomics into `[B, NB]`), and the forced count.
3. `_count`: every program finds the bin b* holding the k-th largest finite score (after the forced
   keys) and counts its keys above b* and the candidates in b*.
4. `_gather_cands`: candidates' u and positions, in key order, to a scratch list.
5. `_select` (one program per row, over the candidates only): the exact threshold u and the index cut
   among keys equal to it (the later ones are kept, as in the reference), by one in-register sort of
   the candidates as (u, position) pairs when they are at most `sort` (`_sort_threshold`, opt-in), else
   by four 8-bit radix levels (`_radix_threshold`); per-chunk output counts become offsets.
6. `_write`: each program emits its selected positions in ascending order at its offset; the row's
   last program pads with -1.

Only rows' visible prefixes are read (chunks past `pos` do nothing) and the grid depends on S only,
so the whole select is CUDA-graph capturable with `pos` in device memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops._backend import cuda_index
from sparse_rl.sparse.ops.indexer_topk.decode_steps import (NB, _append, _block, _bstar_of, _emit,  # noqa: F401
                                                           _okey_inv, _pad_rest, _query_of, _radix_level,
                                                           _radix_threshold, _score_tile, _sort_threshold)
from sparse_rl.sparse.ops.indexer_topk.decode_select import (AUTO_LONG, FINE_RESOLVES, IMPLS,  # noqa: F401
                                                             ROW_MAX_KEYS, DecodeSelect)
from sparse_rl.sparse.ops.indexer_topk.decode_bits import _code
from sparse_rl.sparse.ops.indexer_topk.radix_topk import _okey
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision
from sparse_rl.sparse.ops.pdl import pdl_enter

# candidates (keys in the threshold's bin) resolved by one sort rather than four radix passes over them
# (`_sort_threshold`) when there are at most this many: off by default, since on the H200 it bought
# nothing in the step (Qwen3-4B shape, batch 32 at 16K: 9.18 ms with sort=1024 vs 9.17 radix; 299
# candidates a row on average, up to 2,031; benchmarks/results/2026-12-01-h200-rollout-session5.md)
SORT_CANDIDATES = 0
# the choice of select after the score pass (`impl`, `DecodeSelect`): see decode_select.py
@triton.jit
def _span(RNG, b, NB: tl.constexpr):
    """The row's maximum and NB / (max - min) over its finite, unforced visible scores (0 when the
    span is 0 or not finite: every key then lands in bin 0). RNG holds, per row, the uint32 maxima of
    okey(max) and ~okey(min) (`_score_max`), so that one memset of zeros initialises it."""
    r = RNG.to(tl.pointer_type(tl.uint32))
    kmx = tl.load(r + 2 * b)
    kmn = ~tl.load(r + 2 * b + 1)
    mx = tl.where(kmx == 0, float("-inf"), _okey_inv(kmx))
    mn = tl.where(kmn == 0xFFFFFFFF, float("inf"), _okey_inv(kmn))
    span = mx - mn
    ok = (span > 0) & (span < float("inf"))
    return mx, tl.where(ok, NB / tl.where(ok, span, 1.0), 0.0)


@triton.jit
def _bstar(HIST, NF, b, K, NB: tl.constexpr):
    """`_bstar_of` the row's histogram and forced count in HIST `[B, NB]` / NF `[B]`."""
    return _bstar_of(tl.load(HIST + b * NB + tl.arange(0, NB)), tl.load(NF + b), K, NB)


@triton.jit
def _score_max(Q, W, KI, KS, POS, KVS, SC, RNG, sqb, sqh, sqd, swb, swh, skb, sks, skd, ssb,
               S, sink, window, HI, DI, P,
               HB: tl.constexpr, BD: tl.constexpr, CH: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
               FP8: tl.constexpr, PER_CHUNK: tl.constexpr, HAS_START: tl.constexpr = True, BITS: tl.constexpr = False,
               NBB: tl.constexpr = 2048, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    if HAS_START:  # left padding: the row's first valid key (else 0, no `[B]` zeros to fill each call)
        start = tl.load(KVS + b)
    else:
        start = 0
    c0 = p * CH
    if c0 <= pos:
        qt, wv = _query_of(Q, W, b, sqb, sqh, sqd, swb, swh, HI, DI, HB, BD)
        mx = float("-inf")
        mn = float("inf")
        for i in range(0, CH // BN):
            offs_n = c0 + i * BN + tl.arange(0, BN)
            vis = (offs_n <= pos) & (offs_n >= start) & (offs_n < S)
            s = _score_tile(KI, KS, b, skb, sks, skd, ssb, offs_n, vis, qt, wv, DI, BD, PREC, FP8)
            forced = vis & ((offs_n < start + sink) | (offs_n > pos - window))
            s = tl.where(vis, s, float("-inf"))
            if not BITS:
                mx = tl.maximum(mx, tl.max(tl.where(forced, float("-inf"), s), 0))
                mn = tl.minimum(mn, tl.min(tl.where(forced | ~vis, float("inf"), s), 0))
            s = tl.where(forced, float("inf"), s)
            tl.store(SC + b * S + offs_n, s, mask=(offs_n <= pos) & (offs_n < S))
            if BITS:  # RNG is the row's histogram `[B, NBB]` over fixed bins (decode_bits.py): one atomic a key
                tl.atomic_add(RNG + b * NBB + _code(s, NBB), 1, mask=vis, sem="relaxed")
        if BITS:
            pass
        elif PER_CHUNK:  # RNG `[B, P, 2]` fp32: the chunk's own (max, min), for `decode_row` (no atomics)
            tl.store(RNG + (b * P + p) * 2, mx)
            tl.store(RNG + (b * P + p) * 2 + 1, mn)
        else:
            r = RNG.to(tl.pointer_type(tl.uint32))  # see `_span`
            tl.atomic_max(r + 2 * b, _okey(mx))
            tl.atomic_max(r + 2 * b + 1, ~_okey(mn))


@triton.jit
def _hist(SC, POS, RNG, HIST, NF, S, CH: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    if c0 <= pos:
        mx, inv = _span(RNG, b, NB)
        bins = tl.arange(0, NB)
        hist = tl.zeros([NB], tl.int32)
        nf = 0
        for i in range(0, CH // BN):
            offs_n, x, fin, d, u = _block(SC, b, S, pos, c0 + i * BN, mx, inv, BN, NB)
            hist += tl.histogram(tl.where(fin, d, 0), NB) - tl.where(bins == 0, tl.sum((~fin).to(tl.int32), 0), 0)
            nf += tl.sum((x == float("inf")).to(tl.int32), 0)
        tl.atomic_add(HIST + b * NB + bins, hist, mask=hist > 0)
        tl.atomic_add(NF + b, nf)


@triton.jit
def _count(SC, POS, RNG, HIST, NF, CNT, S, K, P, CH: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    n_above = 0
    n_cand = 0
    if c0 <= pos:
        bstar, rem, take_all = _bstar(HIST, NF, b, K, NB)
        mx, inv = _span(RNG, b, NB)
        for i in range(0, CH // BN):
            offs_n, x, fin, d, u = _block(SC, b, S, pos, c0 + i * BN, mx, inv, BN, NB)
            n_above += tl.sum(((x == float("inf")) | (fin & (d < bstar))).to(tl.int32), 0)
            n_cand += tl.sum((fin & (d == bstar)).to(tl.int32), 0)
    tl.store(CNT + (b * P + p) * 2, n_above)
    tl.store(CNT + (b * P + p) * 2 + 1, n_cand)


@triton.jit
def _gather_cands(SC, POS, RNG, HIST, NF, CNT, CU, CI, S, K, P, CH: tl.constexpr, BN: tl.constexpr,
                  NB: tl.constexpr, PMAX: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    if c0 <= pos:
        bstar, rem, take_all = _bstar(HIST, NF, b, K, NB)
        if bstar < NB:
            mx, inv = _span(RNG, b, NB)
            offs_p = tl.arange(0, PMAX)
            off = tl.sum(tl.load(CNT + (b * P + offs_p) * 2 + 1, mask=offs_p < p, other=0), 0)
            for i in range(0, CH // BN):
                offs_n, x, fin, d, u = _block(SC, b, S, pos, c0 + i * BN, mx, inv, BN, NB)
                cand = fin & (d == bstar)
                off = _append(CU, CI, b, S, offs_n, u, cand, off)


@triton.jit
def _select(HIST, NF, CNT, CU, CI, TAU, CUT, OFFS, S, K, P, CH: tl.constexpr, NB: tl.constexpr,
            PMAX: tl.constexpr, BLOCK: tl.constexpr, SORT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    bstar, rem, take_all = _bstar(HIST, NF, b, K, NB)
    offs_p = tl.arange(0, PMAX)
    pm = offs_p < P
    above = tl.load(CNT + (b * P + offs_p) * 2, mask=pm, other=0)
    n_c = tl.sum(tl.load(CNT + (b * P + offs_p) * 2 + 1, mask=pm, other=0), 0)
    emit = above
    tau = tl.zeros([], tl.uint32)  # take_all: every finite u is >= 0 and every cut 0 passes
    cut = 0
    if not take_all:
        if rem <= 0:  # the forced keys fill the budget: no finite key is taken
            tau = tl.full([], 0xFFFFFFFF, tl.uint32)
            cut = 2147483647
        else:
            if SORT > 0 and n_c <= SORT:
                tau, cut, per_chunk = _sort_threshold(CU, CI, b, S, n_c, rem, CH, PMAX, SORT)
            else:
                tau, cut, per_chunk = _radix_threshold(CU, CI, b, S, n_c, rem, CH, PMAX, BLOCK)
            emit = above + per_chunk
    tl.store(TAU + b, tau.to(tl.int32, bitcast=True))
    tl.store(CUT + b, cut)
    tl.store(OFFS + b * P + offs_p, tl.cumsum(emit, 0) - emit, mask=pm)


@triton.jit
def _write(SC, POS, RNG, TAU, CUT, OFFS, OUT, sob, S, K, P, CH: tl.constexpr, BN: tl.constexpr,
           NB: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    tau = tl.load(TAU + b).to(tl.uint32, bitcast=True)
    cut = tl.load(CUT + b)
    off = tl.load(OFFS + b * P + p)
    if c0 <= pos:
        mx, inv = _span(RNG, b, NB)
        for i in range(0, CH // BN):
            offs_n, x, fin, d, u = _block(SC, b, S, pos, c0 + i * BN, mx, inv, BN, NB)
            sel = (x == float("inf")) | (fin & ((u > tau) | ((u == tau) & (offs_n >= cut))))
            off = _emit(OUT, b, sob, offs_n, sel, off)
    if p == P - 1:  # the last chunk's end offset is the row's count: pad the rest with -1
        _pad_rest(OUT, b, sob, off, K, BN)


def _chunk(B: int, S: int, interpret: bool) -> int:
    """Keys per program: ~8 programs per SM (measured on the H200 at B = 32 x 32K and 64 x 16K: 1024-key
    chunks 0.088 / 0.085 ms, 4096 0.106 / 0.103 ms), at least 1024 keys each."""
    if interpret:
        return 32
    ch = 1024
    while ch < 8192 and B * triton.cdiv(S, ch) > 1056:
        ch *= 2
    return ch


def indexer_topk_decode(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, pos: torch.Tensor, topk: int, *,
                        sink: int = 0, window: int = 0, kv_start: torch.Tensor | None = None,
                        chunk: int | None = None, num_warps: int | None = None, candidates: bool = False,
                        k_scale: torch.Tensor | None = None, sort: int | None = None, impl: str | None = None,
                        row_block: int = 4096, row_warps: int = 16, fine_cap: int | None = None,
                        row_max_keys: int = ROW_MAX_KEYS, auto_long: str = AUTO_LONG, score_block: int = 0,
                        fine_resolve: str = "each", fine_block: int = 0, fine_prefetch: bool = False,
                        fine_maxnreg: int = 0, sync_per_sm: int = 0, sync_keep: bool = True,
                        sync_split: int = 0, sync_max_chunks: int = 0, sync_block: int = 0, sync_coop: bool = False,
                        sync_min_batch: int = 0, cuda_cluster: int = 0, pdl: bool = False):
    """See the module docstring. q_idx `[B, H_I, D_I]`, w `[B, H_I]`, k_idx `[B, S, D_I]` (last dim
    contiguous), pos `[B]` -> `[B, topk]` int32. Index dims above 128, more than 64 index heads or
    float64 take the reference. candidates=True also returns each row's number of second-level
    candidates `[B]` (the keys in the threshold's bin, which the one-program-per-row radix reads;
    None on the reference path): what the first-level binning costs, for tests and benchmarks. k_scale
    `[B, S]` fp32: k_idx is float8_e4m3fn with these per-token scales (`naive.quantize_index_keys`);
    the score pass then reads half the bytes. sort: the threshold over at most this many candidates
    by one in-register sort instead of four radix passes (a power of two; 0 = always radix; default
    `SORT_CANDIDATES`); rows with more candidates take the radix passes. impl: "chunked" (the passes
    above over (chunk, row) programs), "row" (the score pass, then one program per row does the rest:
    `decode_row.py`, two launches, `row_block` keys a step in `row_warps` warps), "split" (the score
    pass, then three (chunk, row) launches: `decode_split.py`), "fine" (the score pass, then three (chunk,
    row) launches with a second level of bins: `decode_fine.py`; fine_cap: its most sub-bin keys ranked in
    registers), "cuda" (the score pass, then a CUDA block or a cluster of blocks a row: `decode_cuda.py`; on a CPU its PyTorch
    reference over the interpreted score pass's scores) or "auto" (the default: row for S <= row_max_keys, else
    auto_long; `DecodeSelect` holds these three). score_block: the score pass's keys a step (0: the passes'
    common step). fine_resolve: where the fine select resolves its row's threshold: "each" (every (chunk, row)
    program of its last pass, decode_fine.py), "arrive" (the row's last program of its gather pass) or "pass" (a [B]-program pass; both
    decode_fine_once.py); fine_block: the keys a step of the fine select's (chunk, row) loops (0: the passes'
    common step, 256 on a GPU; capped at the chunk); fine_prefetch: with "arrive" / "pass", the histogram and
    gather passes load their chunk's first scores before the row's tiles; fine_maxnreg: a register cap for the fine
    select's pass that resolves the threshold (0: the compiler's choice). "sync": the scores, the radix levels
    and the write in one launch, the row's programs meeting at in-kernel barriers (`decode_sync.py`; sync_block
    its keys a step, 0 = its own; sync_per_sm its most programs an SM, 0 = as many as fit; sync_keep / sync_split
    its keep / split forms, sync_max_chunks a row's most chunks, 0 = its own; sync_coop a cooperative launch;
    sync_min_batch: batches of at least this many rows take "sync" whatever impl says, 0 = never; cuda_cluster:
    the "cuda" select's blocks a row, 0 = `decode_cuda.auto_cluster`'s). Every impl
    selects the same keys. pdl: the score pass and the fine / split passes launched with programmatic dependent
    launch (`DecodeSelect.pdl`, set by the rollout runner from `ModelRunner.pdl`; the other impls' passes launch
    plainly: any mix is safe, since every PDL kernel waits before its first load)."""
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive

    if sink + window > topk:
        raise ValueError(f"sink ({sink}) + window ({window}) must not exceed topk ({topk})")
    B, HI, DI = q_idx.shape
    S = k_idx.shape[1]
    fp8 = k_scale is not None
    if fp8 and k_idx.dtype != torch.float8_e4m3fn:
        raise ValueError(f"k_scale is given for fp8 index keys, but k_idx is {k_idx.dtype}")
    if (q_idx.dtype not in (torch.float16, torch.bfloat16, torch.float32) or (k_idx.dtype != q_idx.dtype and not fp8)
            or DI > 128 or HI > 64 or B == 0 or S == 0):
        ref = indexer_topk_decode_naive(q_idx, w, k_idx, pos, topk, sink=sink, window=window, kv_start=kv_start,
                                        k_scale=k_scale)
        return (ref, None) if candidates else ref
    dev = q_idx.device
    interpret = not q_idx.is_cuda
    pos = torch.as_tensor(pos, device=dev).to(torch.int32).reshape(B)
    # no kv_start: the score pass starts every row at key 0 (HAS_START=False; pos stands in for the pointer)
    kvs = pos if kv_start is None else torch.as_tensor(kv_start, device=dev).to(torch.int32).reshape(B)
    if k_idx.stride(-1) != 1:
        k_idx = k_idx.contiguous()
    sort = SORT_CANDIDATES if sort is None else sort
    if sort and sort & (sort - 1):
        raise ValueError(f"sort ({sort}) must be 0 or a power of two")
    impl = "auto" if impl is None else impl
    if impl not in IMPLS or auto_long not in IMPLS[1:]:
        raise ValueError(f"impl {impl!r} / auto_long {auto_long!r}: expected one of {', '.join(IMPLS)}")
    if fine_resolve not in FINE_RESOLVES:
        raise ValueError(f"fine_resolve {fine_resolve!r}: expected one of {', '.join(FINE_RESOLVES)}")
    if impl == "auto":
        impl = "row" if S <= row_max_keys else auto_long
    if sync_min_batch and B >= sync_min_batch:  # a batch that fills the GPU with the sync select's programs
        impl = "sync"
    if impl == "sync":  # one launch, the row's programs meeting at in-kernel barriers (decode_sync.py)
        from sparse_rl.sparse.ops.indexer_topk.decode_sync import sync_select

        out = sync_select(q_idx, w, k_idx, k_scale, pos, kvs, topk, sink, window, kv_start is not None,
                          block=sync_block, num_warps=num_warps or 4, per_sm=sync_per_sm, pdl=pdl, chunk=chunk,
                          keep=sync_keep, split=sync_split, max_chunks=sync_max_chunks or None, coop=sync_coop)
        return (out, None) if candidates else out
    if impl == "bsearch":
        from sparse_rl.sparse.ops.indexer_topk.decode_bsearch import BSEARCH_MAX_KEYS

        if triton.next_power_of_2(S) > BSEARCH_MAX_KEYS:  # the row would not fit one program's registers
            impl = "fine"
    if impl == "cuda" and not interpret:
        from sparse_rl.sparse.ops.indexer_topk import decode_cuda

        if not decode_cuda.available(cuda_index(dev)):
            impl = "fine"  # no NVRTC / an older GPU: the Triton select of the same keys (warned once)
    if impl in ("fine", "bits", "bsearch", "cuda"):
        from sparse_rl.sparse.ops.indexer_topk.decode_fine import fine_chunk

        CH = chunk or fine_chunk(B, S, interpret)
    else:
        CH = chunk or _chunk(B, S, interpret)
    BN = min(CH, 16 if interpret else 256)
    P = triton.cdiv(S, CH)
    PMAX = max(16, triton.next_power_of_2(P))
    sc = torch.empty(B, S, device=dev, dtype=torch.float32)
    nw = 1 if interpret else (num_warps or 4)
    grid = (P, B)
    # the score pass's keys a step (score_block; 0: BN): its [BN, D_I] key tile sets its registers (sm_90a,
    # 4 warps: BN 256 172 registers, 2 programs an SM; 128: 136, 3; 64: 80, 6), so how many of the (chunk,
    # row) programs are resident at once
    SBN = min(CH, score_block) if score_block else BN
    if SBN & (SBN - 1) or CH % SBN:
        raise ValueError(f"score_block ({score_block}) must be a power of two dividing the chunk ({CH})")
    score = dict(HB=max(16, triton.next_power_of_2(HI)), BD=max(16, triton.next_power_of_2(DI)), CH=CH, BN=SBN,
                 PREC=dot_precision(q_idx.dtype), FP8=fp8, HAS_START=kv_start is not None, num_warps=nw,
                 PDL=pdl, launch_pdl=bool(pdl))
    score_args = (q_idx, w, k_idx, k_scale if fp8 else sc, pos, kvs, sc)
    strides = (*q_idx.stride(), *w.stride(), *k_idx.stride(), k_scale.stride(0) if fp8 else 0, S, sink, window, HI,
               DI, P)
    if impl != "chunked":
        from sparse_rl.sparse.ops.indexer_topk.decode_row import row_select
        from sparse_rl.sparse.ops.indexer_topk.decode_split import split_select

        if impl == "bits":
            from sparse_rl.sparse.ops.indexer_topk.decode_bits import bits_scratch, bits_select

            scratch = bits_scratch(B, dev)
            _score_max[grid](*score_args, scratch, *strides, PER_CHUNK=False, BITS=True, **score)
            out = bits_select(sc, pos, scratch, topk, CH, BN, num_warps=nw, interpret=interpret)
            return (out, None) if candidates else out
        span = torch.empty(B, P, 2, device=dev, dtype=torch.float32)
        _score_max[grid](*score_args, span, *strides, PER_CHUNK=True, **score)
        if impl == "bsearch":
            from sparse_rl.sparse.ops.indexer_topk.decode_bsearch import bsearch_select

            out, n_c = bsearch_select(sc, pos, topk, interpret=interpret), None
        elif impl == "cuda":  # a CUDA block or cluster a row (decode_cuda.py); its reference on a CPU
            from sparse_rl.sparse.ops.indexer_topk import decode_cuda

            out = (decode_cuda.row_select_naive(sc, pos, topk) if interpret
                   else decode_cuda.row_select(sc, pos, topk, span=span, chunk=CH, pdl=pdl, cluster=cuda_cluster))
            n_c = None
        elif impl == "row":
            out, n_c = row_select(sc, pos, span, topk, CH, sort=sort, block=row_block, num_warps=row_warps,
                                  interpret=interpret)
        elif impl == "fine":
            from sparse_rl.sparse.ops.indexer_topk.decode_fine import CAP, fine_select
            from sparse_rl.sparse.ops.indexer_topk.decode_fine_once import fine_once_select

            cap = CAP if fine_cap is None else fine_cap
            FBN = min(CH, fine_block) if fine_block else BN
            if FBN & (FBN - 1) or CH % FBN:
                raise ValueError(f"fine_block ({fine_block}) must be a power of two")
            if fine_resolve == "each":
                out, n_c = fine_select(sc, pos, span, topk, CH, FBN, num_warps=nw, interpret=interpret, cap=cap,
                                       maxnreg=fine_maxnreg, pdl=pdl)
            else:
                out, n_c = fine_once_select(sc, pos, span, topk, CH, FBN, num_warps=nw, interpret=interpret, cap=cap,
                                            resolve=fine_resolve, prefetch=fine_prefetch, maxnreg=fine_maxnreg, pdl=pdl)
        else:
            out, n_c = split_select(sc, pos, span, topk, CH, BN, sort=sort, num_warps=nw, interpret=interpret,
                                    pdl=pdl)
        return (out, n_c) if candidates else out
    cu = torch.empty(B, S, device=dev, dtype=torch.int32)
    ci = torch.empty(B, S, device=dev, dtype=torch.int32)
    # one memset: histograms, forced counts, each row's (okey(max), ~okey(min)) (see `_span`)
    zeros = torch.zeros(B * (NB + 3), device=dev, dtype=torch.int32)
    hist_b, nf, rng = zeros[:B * NB].view(B, NB), zeros[B * NB:B * (NB + 1)], zeros[B * (NB + 1):]
    cnt = torch.empty(B, P, 2, device=dev, dtype=torch.int32)
    small = torch.empty(2, B, device=dev, dtype=torch.int32)  # tau (bit pattern), cut
    offs = torch.empty(B, P, device=dev, dtype=torch.int32)
    out = torch.empty(B, topk, device=dev, dtype=torch.int32)
    _score_max[grid](*score_args, rng, *strides, PER_CHUNK=False, **score)
    _hist[grid](sc, pos, rng, hist_b, nf, S, CH=CH, BN=BN, NB=NB, num_warps=nw)
    _count[grid](sc, pos, rng, hist_b, nf, cnt, S, topk, P, CH=CH, BN=BN, NB=NB, num_warps=nw)
    _gather_cands[grid](sc, pos, rng, hist_b, nf, cnt, cu, ci, S, topk, P, CH=CH, BN=BN, NB=NB,
                        PMAX=PMAX, num_warps=nw)
    _select[(B,)](hist_b, nf, cnt, cu, ci, small[0], small[1], offs, S, topk, P, CH=CH, NB=NB, PMAX=PMAX,
                  BLOCK=64 if interpret else 1024, SORT=sort, num_warps=1 if interpret else 8)
    _write[grid](sc, pos, rng, small[0], small[1], offs, out, out.stride(0), S, topk, P, CH=CH, BN=BN, NB=NB,
                 num_warps=nw)
    return (out, cnt[:, :, 1].sum(-1)) if candidates else out
