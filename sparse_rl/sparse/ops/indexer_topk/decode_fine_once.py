"""The fine decode select with its threshold resolved ONCE a row (`indexer_topk_decode(impl="fine",
fine_resolve="arrive" | "pass")`): the same two levels of bins, exact-zero handling and ranking of the
threshold's sub-bin as `decode_fine.py`, the same keys, but the row-wide work is done by one program per row
instead of by all of the row's (chunk, row) programs.

Why: in `decode_fine._resolve_write` every one of a row's P programs (16 at 32 x 16K) loads the row's
histogram tiles (`[P, NB]` and `[P, NB2]`), finds b* and b2*, compacts and ranks the sub-bin's keys and sums
the per-chunk counts, before it writes its own chunk: a chain of ~60 dependent block reductions and loads,
repeated 512 times. It took 22.8 us a layer at 32 x 16K on the H200 (session-9 profile), the largest term of
the select after the score pass (36.8 us, against ~16 us of index-key bytes for score and select together).
Here that chain runs once a row and the write pass only loads (tau, cut) and its chunk's output offset:
1. `_hist_tick` (chunk, row): `decode_split._hist_chunk`'s per-chunk first-level histograms, and program 0
   of each row zeroes the row's ticket (no memset launch);
2. `_gather_once` (chunk, row): `decode_fine._sub_gather`'s sub-bin histograms and b* list, except that the
   chunk's exact zeros (a key whose every index head's ReLU is 0) are stored too, from the end of the chunk's
   list region backwards (the region has exactly as many slots as the chunk's keys in b*), so that every slot
   holds a real key;
3. the resolve, `_resolve_row`, either in the row's last program of `_gather_once` (`resolve="arrive"`: each
   program takes a ticket after its stores; the tile-counter pattern of ops/skinny_gemm and decode_bits) or
   in a `[B]`-program pass of its own (`resolve="pass"`: one more launch, no atomics). It finds the row's
   threshold as ONE pair (tau, cut) = (okey, position) of the k-th largest unforced key (ties to the later
   key): when it is an exact zero, cut is read from the zeros' slots; else the sub-bin b2 of the k-th nonzero
   key is ranked in registers (`decode_fine._rank_sub_bin`, <= cap keys) or, with more, the exact radix levels
   run over b*'s whole list (zeros included, as real keys). It stores (tau, cut, the row's count) and each
   chunk's output offset;
4. `_write_once` (chunk, row): selected = forced, or finite with (u, position) >= (tau, cut); ascending at the
   chunk's offset, the row's last program pads with -1 (as `decode._write`).

So four launches after the score pass with "pass", three with "arrive" (as fine).

Status (session 11): exact under the interpreter (tests/sparse/test_decode_fine_once.py), NOT measured on a GPU:
the one device call of the session failed before any timing (a compile error on the H200's Triton 3.6 in the
shared helpers, since fixed; benchmarks/gpu_sel11_session11.py is the script for the next call). Opt-in; the
engine's default stays "each". Registers on sm_90a under Triton 3.6 (compiled on the CPU host,
benchmarks/sm90_regs.py, 32 x 16K's constants): `_gather_once` 64 ("pass") / 156 ("arrive": the resolve
inlined; 3 programs an SM, so 32 x 16K's 512 programs in two waves; `fine_maxnreg=128` caps it with 8-16 B of
spill), `_resolve_rows` 153 (32 programs), `_write_once` 32, `_hist_tick` 32; the old `_resolve_write` 147.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.decode_fine import CAP, CB, NB2, U0, _rank_sub_bin, _sub
from sparse_rl.sparse.ops.indexer_topk.decode_row import _row_span
from sparse_rl.sparse.ops.indexer_topk.decode_split import _tile
from sparse_rl.sparse.ops.indexer_topk.decode_steps import NB, _block, _bstar_of, _emit, _pad_rest, _radix_threshold
from sparse_rl.sparse.ops.indexer_topk.radix_topk import _okey
from sparse_rl.sparse.ops.pdl import pdl_enter

RESOLVES = ("arrive", "pass")


@triton.jit
def _hist_tick(SC, POS, SPAN, HP, NFP, TICK, S, P, CH: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
               PMAX: tl.constexpr, TICKS: tl.constexpr, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    if TICKS:
        if p == 0:  # the row's ticket for `_gather_once` (the next launch, so stream order makes it visible)
            tl.store(TICK + b, 0)
    if c0 <= pos:
        if PREFETCH:  # the chunk's first scores are loaded before the span's loads and reductions
            xn = _scores(SC, b, S, pos, c0, c0 + CH, BN)
        mx, inv = _row_span(SPAN, b, pos, P, CH, NB, PMAX)
        bins = tl.arange(0, NB)
        hist = tl.zeros([NB], tl.int32)
        nf = 0
        for i in range(0, CH // BN):
            if PREFETCH:  # this step's scores, loaded a step ahead; the next step's now
                offs_n, x, fin, d, u = _bins(c0 + i * BN, xn, mx, inv, BN, NB)
                xn = _scores(SC, b, S, pos, c0 + (i + 1) * BN, c0 + CH, BN)
            else:
                offs_n, x, fin, d, u = _block(SC, b, S, pos, c0 + i * BN, mx, inv, BN, NB)
            hist += tl.histogram(tl.where(fin, d, 0), NB) - tl.where(bins == 0, tl.sum((~fin).to(tl.int32), 0), 0)
            nf += tl.sum((x == float("inf")).to(tl.int32), 0)
        tl.store(HP + (b * P + p) * NB + bins, hist)
        tl.store(NFP + b * P + p, nf)


@triton.jit
def _scores(SC, b, S, pos, n0, end, BN: tl.constexpr):
    """Scores `[BN]` of keys n0..n0+BN-1 of row b below `end` (the chunk's end), -inf elsewhere (as `_block`)."""
    offs_n = n0 + tl.arange(0, BN)
    return tl.load(SC + b * S + offs_n, mask=(offs_n <= pos) & (offs_n < S) & (offs_n < end), other=float("-inf"))


@triton.jit
def _bins(n0, x, mx, inv, BN: tl.constexpr, NB: tl.constexpr):
    """`decode_steps._block`'s results for scores x `[BN]` of keys n0..n0+BN-1 already loaded."""
    offs_n = n0 + tl.arange(0, BN)
    fin = (x > float("-inf")) & (x < float("inf"))
    d = tl.minimum(((mx - tl.where(fin, x, mx)) * inv).to(tl.int32), NB - 1)
    return offs_n, x, fin, d, _okey(x)


@triton.jit
def _resolve_row(HP, NFP, H2, ZC, CU, CI, CD, OFFS, TC, NC, b, pos, S, K, P, CH: tl.constexpr, NB: tl.constexpr,
                 NB2: tl.constexpr, PMAX: tl.constexpr, CAPB: tl.constexpr, CB: tl.constexpr, BLOCK: tl.constexpr,
                 CM: tl.constexpr):
    """Row b's threshold pair and output offsets (see the module docstring, step 3). CM: the cache modifier of
    this function's own loads of what this launch's other programs wrote (".cg" in the last-arriving program;
    the list loads of `_rank_sub_bin` / `_radix_threshold` are plain: the ticket's acq_rel atomic and the
    barrier after it order them, the pattern of CUTLASS's split-K semaphore. Passed explicitly: Triton 3.6
    leaves a nested jit call's defaulted constexpr a bare str, which failed to compile on the H200)."""
    offs_p = tl.arange(0, PMAX)
    pm = offs_p <= pos // CH
    hp, nfp = _tile(HP, NFP, b, pos, P, CH, NB, PMAX)
    bins = tl.arange(0, NB)[None, :]
    bstar, rem, take_all = _bstar_of(tl.sum(hp, 0), tl.sum(nfp, 0), K, NB)
    emit = nfp + tl.sum(tl.where(bins < bstar, hp, 0), 1)  # [PMAX] keys each chunk takes outright
    col = tl.sum(tl.where(bins == bstar, hp, 0), 1)  # [PMAX] each chunk's list slots: its keys in b*
    tau = tl.zeros([], tl.uint32)  # take_all: (0, 0) passes every finite key
    cut = 0
    n2 = 0
    if not take_all:
        if rem <= 0:  # the forced keys fill the budget: no finite key is taken
            tau = tl.full([], 0xFFFFFFFF, tl.uint32)
            cut = 2147483647
        else:
            zc = tl.load(ZC + (b * P + offs_p) * 2, mask=pm, other=0, cache_modifier=CM)  # [PMAX] zeros of b*
            za = tl.load(ZC + (b * P + offs_p) * 2 + 1, mask=pm, other=0, cache_modifier=CM)  # nonzero above 0
            z_hi = tl.cumsum(zc, 0)
            n0 = tl.sum(zc, 0)
            a0 = tl.sum(za, 0)
            if (rem > a0) & (rem <= a0 + n0):  # the k-th key is a zero: the one of order z0 among the zeros
                z0 = a0 + n0 - rem
                q = tl.sum((z_hi <= z0).to(tl.int32), 0)  # its chunk
                j = z0 - tl.sum(tl.where(offs_p == q, z_hi - zc, 0), 0)  # its order in the chunk
                end = tl.sum(tl.where(offs_p <= q, col, 0), 0)  # the chunk's region ends here ...
                cut = tl.load(CI + b * S + end - 1 - j, cache_modifier=CM)  # ... its zeros stored backwards
                tau = tl.full([], U0, tl.uint32)
                emit += za + tl.maximum(z_hi - tl.maximum(z_hi - zc, z0), 0)
            else:
                below = rem > a0 + n0  # the k-th key lies below every zero: all zeros are taken
                target = tl.where(below, rem - n0, rem)  # its rank among b*'s nonzero keys (>= 1)
                h2p = tl.load(H2 + (b * P + offs_p[:, None]) * NB2 + tl.arange(0, NB2)[None, :], mask=pm[:, None],
                              other=0, cache_modifier=CM)
                bins2 = tl.arange(0, NB2)[None, :]
                h2 = tl.sum(h2p, 0)
                b2 = tl.sum((tl.cumsum(h2, 0) < target).to(tl.int32), 0)  # < NB2: the sub-bins hold >= target
                rem2 = target - tl.sum(tl.where(tl.arange(0, NB2) < b2, h2, 0), 0)
                h2b = tl.sum(tl.where(bins2 == b2, h2p, 0), 1)  # [PMAX] each chunk's keys in b2
                n2 = tl.sum(h2b, 0)
                if n2 <= CAPB:
                    tau, cut, kept = _rank_sub_bin(CU, CI, CD, b, S, col, zc, h2b, b2, n2, rem2, CH, PMAX, CAPB, CB)
                    emit += tl.sum(tl.where(bins2 < b2, h2p, 0), 1) + kept + tl.where(below, zc, 0)
                else:  # many equal scores: the radix levels over all of b*'s keys, zeros among them
                    tau, cut, kept = _radix_threshold(CU, CI, b, S, tl.sum(col, 0), rem, CH, PMAX, BLOCK)
                    emit += kept
    pl = offs_p < P
    tl.store(OFFS + b * P + offs_p, tl.cumsum(emit, 0) - emit, mask=pl)
    tl.store(TC + b * 3, tau.to(tl.int32, bitcast=True))
    tl.store(TC + b * 3 + 1, cut)
    tl.store(TC + b * 3 + 2, tl.sum(emit, 0))
    tl.store(NC + b, n2)


@triton.jit
def _gather_once(SC, POS, SPAN, HP, NFP, H2, ZC, CU, CI, CD, TICK, OFFS, TC, NC, S, K, P, CH: tl.constexpr,
                 BN: tl.constexpr, NB: tl.constexpr, NB2: tl.constexpr, PMAX: tl.constexpr, CAPB: tl.constexpr,
                 CB: tl.constexpr, BLOCK: tl.constexpr, ARRIVE: tl.constexpr, PREFETCH: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    if c0 <= pos:
        if PREFETCH:  # the chunk's first scores are loaded before the row's tiles and their reductions
            xn = _scores(SC, b, S, pos, c0, c0 + CH, BN)
        hp, nfp = _tile(HP, NFP, b, pos, P, CH, NB, PMAX)
        bstar, rem, take_all = _bstar_of(tl.sum(hp, 0), tl.sum(nfp, 0), K, NB)
        if (bstar < NB) & (rem > 0):
            offs_p = tl.arange(0, PMAX)
            col = tl.sum(tl.where(tl.arange(0, NB)[None, :] == bstar, hp, 0), 1)  # [PMAX] b* keys a chunk
            off = tl.sum(tl.where(offs_p < p, col, 0), 0)  # the chunk's region: [off, end) of the row's list
            end = off + tl.sum(tl.where(offs_p == p, col, 0), 0)
            mx, inv = _row_span(SPAN, b, pos, P, CH, NB, PMAX)
            bins2 = tl.arange(0, NB2)
            hist2 = tl.zeros([NB2], tl.int32)
            zeros = 0
            above = 0
            for i in range(0, CH // BN):
                if PREFETCH:
                    offs_n, x, fin, d, u = _bins(c0 + i * BN, xn, mx, inv, BN, NB)
                    xn = _scores(SC, b, S, pos, c0 + (i + 1) * BN, c0 + CH, BN)
                else:
                    offs_n, x, fin, d, u = _block(SC, b, S, pos, c0 + i * BN, mx, inv, BN, NB)
                inb = fin & (d == bstar)
                zero = inb & (u == U0)
                cand = inb & ~zero
                d2 = tl.where(cand, _sub(x, fin, d, mx, inv, NB, NB2), 0)
                hist2 += tl.histogram(d2, NB2) - tl.where(bins2 == 0, tl.sum((~cand).to(tl.int32), 0), 0)
                above += tl.sum((cand & (u > U0)).to(tl.int32), 0)
                # nonzero keys from the region's start in key order (u, position, sub-bin); zeros from its end
                # backwards (u = U0, position, sub-bin -1: no sub-bin's key)
                slot = tl.where(cand, off + tl.cumsum(cand.to(tl.int32), 0) - 1,
                                end - 1 - zeros - tl.cumsum(zero.to(tl.int32), 0) + 1)
                tl.store(CU + b * S + slot, u.to(tl.int32, bitcast=True), mask=inb)
                tl.store(CI + b * S + slot, offs_n, mask=inb)
                tl.store(CD + b * S + slot, tl.where(cand, d2, -1), mask=inb)
                off += tl.sum(cand.to(tl.int32), 0)
                zeros += tl.sum(zero.to(tl.int32), 0)
            tl.store(H2 + (b * P + p) * NB2 + bins2, hist2)
            tl.store(ZC + (b * P + p) * 2, zeros)
            tl.store(ZC + (b * P + p) * 2 + 1, above)
    if ARRIVE:
        tl.debug_barrier()  # every thread's stores are done before the ticket releases them
        if tl.atomic_add(TICK + b, 1, sem="acq_rel") == P - 1:  # the row's last program resolves it
            _resolve_row(HP, NFP, H2, ZC, CU, CI, CD, OFFS, TC, NC, b, pos, S, K, P, CH, NB, NB2, PMAX, CAPB, CB,
                         BLOCK, ".cg")


@triton.jit
def _resolve_rows(POS, HP, NFP, H2, ZC, CU, CI, CD, OFFS, TC, NC, S, K, P, CH: tl.constexpr, NB: tl.constexpr,
                  NB2: tl.constexpr, PMAX: tl.constexpr, CAPB: tl.constexpr, CB: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    _resolve_row(HP, NFP, H2, ZC, CU, CI, CD, OFFS, TC, NC, b, pos, S, K, P, CH, NB, NB2, PMAX, CAPB, CB, BLOCK, "")


@triton.jit
def _write_once(SC, POS, TC, OFFS, OUT, sob, S, K, P, CH: tl.constexpr, BN: tl.constexpr,
                PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    if c0 <= pos:
        tau = tl.load(TC + b * 3).to(tl.uint32, bitcast=True)
        cut = tl.load(TC + b * 3 + 1)
        off = tl.load(OFFS + b * P + p)
        for i in range(0, CH // BN):
            offs_n = c0 + i * BN + tl.arange(0, BN)
            x = tl.load(SC + b * S + offs_n, mask=(offs_n <= pos) & (offs_n < S), other=float("-inf"))
            u = _okey(x)
            sel = (x == float("inf")) | ((x > float("-inf")) & ((u > tau) | ((u == tau) & (offs_n >= cut))))
            off = _emit(OUT, b, sob, offs_n, sel, off)
    if p == P - 1:  # every chunk's count is in the row's total: pad the rest with -1
        _pad_rest(OUT, b, sob, tl.load(TC + b * 3 + 2), K, BN)


def fine_once_select(sc: torch.Tensor, pos: torch.Tensor, span: torch.Tensor, topk: int, chunk: int, block: int, *,
                     num_warps: int, interpret: bool, resolve: str = "arrive", cap: int = CAP, cb: int | None = None,
                     prefetch: bool = False, maxnreg: int = 0, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_fine.fine_select`'s inputs and results (sc `[B, S]` fp32 scores, pos `[B]` int32, span `[B, P, 2]`
    -> (`[B, topk]` int32 ascending, -1 padded; `[B]` keys ranked in the threshold's sub-bin, 0 where none)), the
    threshold resolved once a row: by the row's last `_gather_once` program ("arrive", three launches) or a
    `[B]`-program pass ("pass", four). prefetch: the histogram and gather passes load their chunk's first scores
    before the row's tiles (and each step's next scores a step ahead). maxnreg: a register cap for the passes
    that hold the resolve (`_gather_once` with "arrive", `_resolve_rows`), 0 = the compiler's choice, not
    applied under the interpreter. pdl: every launch with programmatic dependent launch."""
    if resolve not in RESOLVES:
        raise ValueError(f"fine resolve {resolve!r}: expected one of {', '.join(RESOLVES)}")
    if cap < 1 or cap & (cap - 1):
        raise ValueError(f"cap ({cap}) must be a power of two")
    B, S = sc.shape
    P = span.shape[1]
    PMAX = max(16, triton.next_power_of_2(P))
    dev = sc.device
    arrive = resolve == "arrive"
    hp = torch.empty(B, P, NB, device=dev, dtype=torch.int32)
    nfp = torch.empty(B, P, device=dev, dtype=torch.int32)
    h2 = torch.empty(B, P, NB2, device=dev, dtype=torch.int32)
    zc = torch.empty(B, P, 2, device=dev, dtype=torch.int32)
    cu, ci, cd = (torch.empty(B, S, device=dev, dtype=torch.int32) for _ in range(3))
    small = torch.empty(B * 5, device=dev, dtype=torch.int32)  # (tau, cut, count) a row, n2, ticket
    tc, n2, tick = small[:3 * B], small[3 * B:4 * B], small[4 * B:]
    offs = torch.empty(B, P, device=dev, dtype=torch.int32)
    out = torch.empty(B, topk, device=dev, dtype=torch.int32)
    grid = (P, B)
    # PDL as a wait only (level 2's early trigger is not taken here: untimed with these passes)
    lk = dict(num_warps=num_warps, PDL=bool(pdl), launch_pdl=bool(pdl)) if pdl else dict(num_warps=num_warps)
    res = dict(NB2=NB2, PMAX=PMAX, CAPB=max(2, cap), CB=cb or (16 if interpret else CB),
               BLOCK=64 if interpret else 1024)
    _hist_tick[grid](sc, pos, span, hp, nfp, tick, S, P, CH=chunk, BN=block, NB=NB, PMAX=PMAX, TICKS=arrive,
                     PREFETCH=prefetch, **lk)
    # Triton 3.6 (the H200's) compiles `_gather_once` with the resolve inlined to 156 registers (168 at one
    # 1024-key step; 3 programs an SM, 32 x 16K's 512 programs in two waves), without it to 64 / 123; a cap of
    # 128 spills 8-16 bytes (sm_90a, compiled on the CPU host)
    cap_regs = {"maxnreg": maxnreg} if maxnreg and not interpret else {}
    _gather_once[grid](sc, pos, span, hp, nfp, h2, zc, cu, ci, cd, tick, offs, tc, n2, S, topk, P, CH=chunk, BN=block,
                       NB=NB, ARRIVE=arrive, PREFETCH=prefetch, **res, **lk, **(cap_regs if arrive else {}))
    if not arrive:
        _resolve_rows[(B,)](pos, hp, nfp, h2, zc, cu, ci, cd, offs, tc, n2, S, topk, P, CH=chunk, NB=NB, **res, **lk,
                            **cap_regs)
    _write_once[grid](sc, pos, tc, offs, out, out.stride(0), S, topk, P, CH=chunk, BN=block, **lk)
    return out, n2
