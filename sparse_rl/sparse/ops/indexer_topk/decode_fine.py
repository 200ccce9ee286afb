"""The decode select after the score pass with two levels of bins, so that the threshold is resolved
among a handful of keys (`indexer_topk_decode(impl="fine")`): three (chunk, row) launches, no memset,
no atomics, no single-program radix passes in the common case.

Why: in the other forms the exact threshold is found among the ~200-400 keys of the row's first-level
bin (128 linear bins over the row's span) by four 8-bit radix levels, each a 256-bin histogram over
the candidates in ONE program per row (`decode._select`, or repeated by every program in
`decode_split._thresh_write`). At 32 x 16K on the H200 that single program took 17.5 us a layer, the
largest term of the select after the score pass itself (24 us), of 37 us for the passes after it (session-8
profile on a random cache, benchmarks/results/2026-12-02-h200-rollout-session8.md).
Here the bin holding the threshold is split once more into NB2 linear sub-bins (NB x NB2 = 16,384
levels over the span: ~1-3 keys of a 16K row in the threshold's sub-bin for smooth scores), found by
one more (chunk, row) pass, and the last pass ranks those few keys against each other in registers.
Every pass has one program per (chunk, row), as `decode.py` does, so each walks `CH` keys, not a row.

After `decode._score_max` (per-chunk (max, min) of the unforced finite scores, `[B, P, 2]`):
1. `decode_split._hist_chunk`: each chunk's first-level histogram `[B, P, NB]` and forced count.
2. `_sub_gather`: every program sums the row's first-level histograms, finds b* (the bin holding the
   k-th largest finite score after the forced keys) and, for its chunk's keys in b*: counts those
   scoring exactly 0 and the nonzero ones above 0 (`[B, P, 2]`), stores the nonzero ones' sub-bin
   histogram `[B, P, NB2]` and appends them (u = okey(score), position, sub-bin) to the row's list, in
   key order, at the offset the earlier chunks' b* counts give (the chunk's zeros leave empty slots).
3. `_resolve_write`: every program sums its row's counts. Exact zeros (a key whose every index head's
   ReLU is 0: common, ~1/16 of the keys with 4 heads; on the H200 they put up to ~1,300 keys of a
   32 x 16K row into one sub-bin, and the first form of this select, which resolved them like any
   tie, took 58 us a layer) are one tie block in key order: when the threshold falls among them the
   later ones are kept by their order alone; otherwise the rank is shifted by their count and the
   threshold lies among the nonzero keys: b2* (the sub-bin holding the rank left) and its count n2;
   with n2 <= `cap` those keys are compacted from the list into registers and ranked by (u, position)
   (ties to the later key, the reference's rule), giving (tau, cut); with more (equal nonzero scores)
   the radix levels over the list (`decode._radix_threshold`, exact for any count) give it. The
   program then takes its output offset from the earlier chunks' counts and writes its selected
   positions in ascending order; the row's last program pads with -1.

Measured (H200, Qwen3-4B shape, batch 32, random caches): session 8, exact but equal to the default within
noise in the step, `_resolve_write` 31 us a layer, each program walking the row's whole candidate list
(results/2026-12-02-h200-rollout-session8.md). Session 9 (results/2026-12-02-h200-rollout-session9.md): the
compaction reads only the list regions of the chunks that hold the sub-bin's keys (28.4 us a layer; the
walk was not the main term) and steps 32 slots (128 registers on sm_90a instead of 168: 4 programs an SM,
32 x 16K's 512 programs in one wave; 22.8 us a layer). With a 64-key score step it was the rollout engine's
default select at every context from session 9 to 26 (the step 0.17-0.28 ms faster than auto's at 2.3K-16K);
since session 27 the CUDA select (decode_cuda.py) is, and this one runs where that cannot build.

Bins: t = (max - x) * NB / span (`decode._block`), first level d = min(floor(t), NB - 1), fine level
f = min(floor(t * NB2), NB * NB2 - 1), sub-bin d2 = f - d * NB2 (NB2 a power of two, so t * NB2 is
exact and d = f // NB2 for every unclamped key). Both are monotone in the score, so every key of a
lower (bin, sub-bin) scores strictly higher, whatever the signs; equal scores always share both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.decode_row import _row_span
from sparse_rl.sparse.ops.indexer_topk.decode_split import _hist_chunk, _list_start, _tile
from sparse_rl.sparse.ops.indexer_topk.decode_steps import (NB, _append, _block, _bstar_of, _emit, _pad_rest,
                                                           _radix_threshold)
from sparse_rl.sparse.ops.pdl import pdl_enter

NB2 = 128  # sub-bins of the threshold's first-level bin
# list slots a step when the sub-bin's keys are compacted (regions of ~30 slots at 32 x 16K; max ~150). 32:
# `_resolve_write` takes 128 registers on sm_90a (4 programs an SM: the 512 programs at 32 x 16K in one wave)
# against 168 at 64 or 128 (3 an SM: two waves); alone at 32 x 16K on the H200 the fine select took 0.0545
# ms with 32, 0.0636 with 64, 0.0629 with 128 (session 9, call 1). Those register counts are Triton 3.9's (the
# CPU host's); the H200's Triton 3.6 gives 147 / 205 / 168 + 40 B of stack (session 11, benchmarks/sm90_regs.py):
# 3 programs an SM at 32, 2 at 64, so the 512 programs still take two waves there (`fine_select(maxnreg=128)`)
CB = 32
CAP = 32  # at most this many nonzero-score keys in the threshold's sub-bin are ranked in registers (else radix)
U0 = tl.constexpr(0x80000000)  # okey(0.0) (and of -0.0): the score of a key whose every head's ReLU is 0


@triton.jit
def _sub(x, fin, d, mx, inv, NB: tl.constexpr, NB2: tl.constexpr):
    """Sub-bin `[BN]` of each key inside its first-level bin d (see the module docstring); t is the
    same expression as `decode._block`'s, so d and the sub-bin agree in every pass."""
    t = (mx - tl.where(fin, x, mx)) * inv
    f = tl.minimum((t * NB2).to(tl.int32), NB * NB2 - 1)
    return tl.minimum(tl.maximum(f - d * NB2, 0), NB2 - 1)


@triton.jit
def _sub_gather(SC, POS, SPAN, HP, NFP, H2, ZC, CU, CI, CD, S, K, P, CH: tl.constexpr, BN: tl.constexpr,
                NB: tl.constexpr, NB2: tl.constexpr, PMAX: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    if c0 <= pos:
        # this chunk's slot in the row's list: the earlier chunks' b* keys, their zeros included (ZC is
        # written by those chunks' programs in this same launch, so it cannot be read: the list is laid
        # out by the b* counts, zeros' slots left unused)
        bstar, rem, mx, inv, off = _list_start(HP, NFP, SPAN, b, p, pos, K, P, CH, NB, PMAX)
        if (bstar < NB) & (rem > 0):
            bins2 = tl.arange(0, NB2)
            hist2 = tl.zeros([NB2], tl.int32)
            zeros = 0
            above = 0
            for i in range(0, CH // BN):
                offs_n, x, fin, d, u = _block(SC, b, S, pos, c0 + i * BN, mx, inv, BN, NB)
                inb = fin & (d == bstar)
                zero = inb & (u == U0)
                cand = inb & ~zero
                d2 = tl.where(cand, _sub(x, fin, d, mx, inv, NB, NB2), 0)
                hist2 += tl.histogram(d2, NB2) - tl.where(bins2 == 0, tl.sum((~cand).to(tl.int32), 0), 0)
                zeros += tl.sum(zero.to(tl.int32), 0)
                above += tl.sum((cand & (u > U0)).to(tl.int32), 0)
                tl.store(CD + b * S + off + tl.cumsum(cand.to(tl.int32), 0) - 1, d2, mask=cand)
                off = _append(CU, CI, b, S, offs_n, u, cand, off)
            # the chunk's unused slots (as many as its zeros) marked empty: sub-bin -1 (no sub-bin's key),
            # u 0 (below every score: the radix levels never take one), position -1
            for c in range(off, off + zeros, BN):
                o = c + tl.arange(0, BN)
                tl.store(CU + b * S + o, tl.zeros([BN], tl.int32), mask=o < off + zeros)
                tl.store(CI + b * S + o, tl.full([BN], -1, tl.int32), mask=o < off + zeros)
                tl.store(CD + b * S + o, tl.full([BN], -1, tl.int32), mask=o < off + zeros)
            tl.store(H2 + (b * P + p) * NB2 + bins2, hist2)
            tl.store(ZC + (b * P + p) * 2, zeros)
            tl.store(ZC + (b * P + p) * 2 + 1, above)


@triton.jit
def _rank_sub_bin(CU, CI, CD, b, S, col, zc, h2b, b2, n2, rem2, CH: tl.constexpr, PMAX: tl.constexpr,
                  CAPB: tl.constexpr, CB: tl.constexpr):
    """The rem2-th largest (u, position) among the n2 <= CAPB keys of sub-bin b2, and each chunk's count of
    those kept `[PMAX]`. The keys are compacted into registers from the list regions of the chunks that
    hold some (h2b `[PMAX]`: each chunk's keys in b2; col `[PMAX]`: its slots in the row's list, zc of them
    its zeros' empty ones at the region's end), ~3 regions of ~30 slots at 32 x 16K instead of the row's
    whole list (~440 slots, up to ~2,300: the walk that took `_resolve_write` to 31 us a layer on the
    H200, session 8), then each key is ranked by how many beat it."""
    slots = tl.arange(0, CAPB)
    offs = tl.arange(0, CB)
    offs_p = tl.arange(0, PMAX)
    start = tl.cumsum(col, 0) - col  # [PMAX] first slot of each chunk's region
    fu = tl.zeros([CAPB], tl.int32)
    fi = tl.zeros([CAPB], tl.int32)
    seen = 0
    q = -1
    for _ in range(0, tl.sum((h2b > 0).to(tl.int32), 0)):  # the next chunk holding keys of b2
        q = tl.min(tl.where((offs_p > q) & (h2b > 0), offs_p, PMAX), 0)
        st = tl.sum(tl.where(offs_p == q, start, 0), 0)
        end = st + tl.sum(tl.where(offs_p == q, col - zc, 0), 0)
        for c in range(st, end, CB):
            live = c + offs < end
            m = live & (tl.load(CD + b * S + c + offs, mask=live, other=-1) == b2)
            u = tl.load(CU + b * S + c + offs, mask=m, other=0)
            idx = tl.load(CI + b * S + c + offs, mask=m, other=0)
            slot = seen + tl.cumsum(m.to(tl.int32), 0) - 1
            hit = m[None, :] & (slot[None, :] == slots[:, None])  # [CAPB, CB]
            fu += tl.sum(tl.where(hit, u[None, :], 0), 1)
            fi += tl.sum(tl.where(hit, idx[None, :], 0), 1)
            seen += tl.sum(m.to(tl.int32), 0)
    live2 = slots < n2
    uu = fu.to(tl.uint32, bitcast=True)
    beats = live2[None, :] & ((uu[None, :] > uu[:, None]) | ((uu[None, :] == uu[:, None]) & (fi[None, :] > fi[:, None])))
    rank = tl.sum(beats.to(tl.int32), 1)  # [CAPB]: keys ahead of each (pairs are distinct)
    kth = live2 & (rank == rem2 - 1)
    tau = tl.sum(tl.where(kth, fu, 0), 0).to(tl.uint32, bitcast=True)
    cut = tl.sum(tl.where(kth, fi, 0), 0)
    kept = live2 & (rank < rem2)
    per_chunk = tl.sum((((fi[None, :] // CH) == offs_p[:, None]) & kept[None, :]).to(tl.int32), 1)
    return tau, cut, per_chunk


@triton.jit
def _resolve_write(SC, POS, SPAN, HP, NFP, H2, ZC, CU, CI, CD, OUT, NC, sob, S, K, P, CH: tl.constexpr,
                   BN: tl.constexpr, NB: tl.constexpr, NB2: tl.constexpr, PMAX: tl.constexpr,
                   CAPB: tl.constexpr, CB: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    offs_p = tl.arange(0, PMAX)
    hp, nfp = _tile(HP, NFP, b, pos, P, CH, NB, PMAX)
    bins = tl.arange(0, NB)[None, :]
    bstar, rem, take_all = _bstar_of(tl.sum(hp, 0), tl.sum(nfp, 0), K, NB)
    emit = nfp + tl.sum(tl.where(bins < bstar, hp, 0), 1)  # [PMAX] keys each chunk takes outright
    col = tl.sum(tl.where(bins == bstar, hp, 0), 1)  # [PMAX] each chunk's list slots (b*'s keys, zeros included)
    n_c = tl.sum(col, 0)
    # selected: forced, or d < b*, or in b*: a nonzero key with sub-bin < lo2 or (u, position) >=
    # (tau, cut), or a zero of order >= z0 among the row's zeros of b* (counted from z_off in this chunk)
    tau = tl.zeros([], tl.uint32)  # take_all: b* = NB, every finite key has d < b*
    cut = 0
    lo2 = 0
    n2 = 0
    z0 = 2147483647
    z_off = 0
    if not take_all:
        if rem <= 0:  # the forced keys fill the budget: no finite key is taken
            tau = tl.full([], 0xFFFFFFFF, tl.uint32)
            cut = 2147483647
        else:
            pm = offs_p <= pos // CH
            zc = tl.load(ZC + (b * P + offs_p) * 2, mask=pm, other=0)  # [PMAX] zero scores of b* a chunk
            za = tl.load(ZC + (b * P + offs_p) * 2 + 1, mask=pm, other=0)  # [PMAX] nonzero ones above 0
            z_hi = tl.cumsum(zc, 0)
            z_off = tl.sum(tl.where(offs_p < p, zc, 0), 0)
            n0 = tl.sum(zc, 0)
            a0 = tl.sum(za, 0)
            if (rem > a0) & (rem <= a0 + n0):  # the threshold is a zero: keep the later zeros, nonzero above 0
                z0 = a0 + n0 - rem
                tau = tl.full([], U0, tl.uint32)
                cut = 2147483647
                emit += za + tl.maximum(z_hi - tl.maximum(z_hi - zc, z0), 0)
            else:  # among the nonzero keys (after every zero when below them): sub-bins, then rank or radix
                below = rem > a0 + n0
                target = tl.where(below, rem - n0, rem)
                z0 = tl.where(below, 0, 2147483647)
                emit += tl.where(below, zc, 0)
                h2p = tl.load(H2 + (b * P + offs_p[:, None]) * NB2 + tl.arange(0, NB2)[None, :],
                              mask=pm[:, None], other=0)
                b2, rem2, all2 = _bstar_of(tl.sum(h2p, 0), 0, target, NB2)
                bins2 = tl.arange(0, NB2)[None, :]
                h2b = tl.sum(tl.where(bins2 == b2, h2p, 0), 1)  # [PMAX] each chunk's keys in b2
                n2 = tl.sum(h2b, 0)
                if all2:  # every nonzero key of b* is taken (b2 = NB2: every sub-bin is below it)
                    lo2 = NB2
                    tau = tl.full([], 0xFFFFFFFF, tl.uint32)
                    cut = 2147483647
                    emit += tl.sum(h2p, 1)
                elif n2 <= CAPB:
                    tau, cut, kept = _rank_sub_bin(CU, CI, CD, b, S, col, zc, h2b, b2, n2, rem2, CH, PMAX, CAPB, CB)
                    lo2 = b2
                    emit += tl.sum(tl.where(bins2 < b2, h2p, 0), 1) + kept
                else:  # many equal scores in one sub-bin: the exact radix levels over b*'s nonzero keys
                    tau, cut, kept = _radix_threshold(CU, CI, b, S, n_c, target, CH, PMAX, BLOCK)
                    emit += kept
    if p == 0:
        tl.store(NC + b, tl.where(take_all | (rem <= 0), 0, n2))
    off = tl.sum(tl.where(offs_p < p, emit, 0), 0)
    if c0 <= pos:
        mx, inv = _row_span(SPAN, b, pos, P, CH, NB, PMAX)
        for i in range(0, CH // BN):
            offs_n, x, fin, d, u = _block(SC, b, S, pos, c0 + i * BN, mx, inv, BN, NB)
            d2 = _sub(x, fin, d, mx, inv, NB, NB2)
            inb = fin & (d == bstar)
            zero = inb & (u == U0)
            order = z_off + tl.cumsum(zero.to(tl.int32), 0) - 1
            z_off += tl.sum(zero.to(tl.int32), 0)
            keep = (~zero & ((d2 < lo2) | (u > tau) | ((u == tau) & (offs_n >= cut)))) | (zero & (order >= z0))
            sel = (x == float("inf")) | (fin & (d < bstar)) | (inb & keep)
            off = _emit(OUT, b, sob, offs_n, sel, off)
    if p == P - 1:  # every visible chunk's count is in emit: pad the rest with -1
        off = tl.sum(emit, 0)
        _pad_rest(OUT, b, sob, off, K, BN)


def fine_chunk(B: int, S: int, interpret: bool) -> int:
    """Keys per program for the fine select: the smallest power of two from 256 that keeps the grid at
    most ~5 programs per SM of an H200 (B x P <= 640) and a row at most 32 chunks, so short rows still
    spread over many SMs and long ones do not pay for summing many per-chunk histograms (`[P, NB]` per
    program: at P = 64 `_resolve_write` needs 255 registers and spills, at P <= 16 it takes 154). 640, not
    512: at 32 x 16,640 keys the 1,024-key chunk (544 programs) took 0.0564 ms alone against the 2,048-key
    chunk's 0.0686 (H200, session 12, benchmarks/gpu_chunk_session12.py); 16 rows x 16-33K keys are as
    before (the rule's chunk was the fastest there)."""
    if interpret:
        return 32
    ch = 256
    while ch < 8192 and (B * triton.cdiv(S, ch) > 640 or triton.cdiv(S, ch) > 32):
        ch *= 2
    return ch


def fine_select(sc: torch.Tensor, pos: torch.Tensor, span: torch.Tensor, topk: int, chunk: int, block: int, *,
                num_warps: int, interpret: bool, cap: int = CAP, cb: int | None = None,
                maxnreg: int = 0, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_row.row_select`'s inputs and result, in three (chunk, row) launches (block: keys a step of
    each chunk's loop; cap: a power of two, the most sub-bin keys ranked in registers; cb: list slots a
    step of the sub-bin's compaction, default `CB`, 16 under the interpreter; maxnreg: a register cap for
    `_resolve_write`, 0 = the compiler's choice, not applied under the interpreter; pdl: the three launches
    with programmatic dependent launch, each waiting before its first load). The second
    result is each row's count of keys in the threshold's sub-bin `[B]` (0 where none was resolved)."""
    if cap < 1 or cap & (cap - 1):
        raise ValueError(f"cap ({cap}) must be a power of two")
    B, S = sc.shape
    P = span.shape[1]
    PMAX = max(16, triton.next_power_of_2(P))
    dev = sc.device
    hp = torch.empty(B, P, NB, device=dev, dtype=torch.int32)
    nfp = torch.empty(B, P, device=dev, dtype=torch.int32)
    h2 = torch.empty(B, P, NB2, device=dev, dtype=torch.int32)
    zc = torch.empty(B, P, 2, device=dev, dtype=torch.int32)
    cu = torch.empty(B, S, device=dev, dtype=torch.int32)
    ci = torch.empty(B, S, device=dev, dtype=torch.int32)
    cd = torch.empty(B, S, device=dev, dtype=torch.int32)
    out = torch.empty(B, topk, device=dev, dtype=torch.int32)
    n2 = torch.empty(B, device=dev, dtype=torch.int32)
    grid = (P, B)
    kw = dict(CH=chunk, BN=block, NB=NB, PMAX=PMAX, num_warps=num_warps, PDL=pdl, launch_pdl=bool(pdl))
    _hist_chunk[grid](sc, pos, span, hp, nfp, S, P, **kw)
    _sub_gather[grid](sc, pos, span, hp, nfp, h2, zc, cu, ci, cd, S, topk, P, NB2=NB2, **kw)
    # maxnreg: Triton 3.6 (the H200's) compiles `_resolve_write` to 147 registers at CB 32 (3 programs an SM:
    # 32 x 16K's 512 programs in two waves); capped at 128 it spills nothing (sm_90a, compiled on the CPU host)
    cap_regs = {"maxnreg": maxnreg} if maxnreg and not interpret else {}
    _resolve_write[grid](sc, pos, span, hp, nfp, h2, zc, cu, ci, cd, out, n2, out.stride(0), S, topk, P, NB2=NB2,
                         CAPB=max(2, cap), CB=cb or (16 if interpret else CB), BLOCK=64 if interpret else 1024, **kw,
                         **cap_regs)
    return out, n2
