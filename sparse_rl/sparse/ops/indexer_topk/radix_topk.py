"""Row-wise top-k of masked fp32 scores by radix select, in Triton.

`torch.topk` on `[rows, 32K-128K]` fp32 with k = 2048 ran at ~0.2 TB/s effective on an H200
(12 ms for the 32K prefill, 142 ms for 128K: benchmarks/NOTES.md), far below bandwidth. Here one
program owns one row and reads it five times (measured: 2x faster than torch.topk on 8K-key rows,
equal at 32K, slower beyond, which is why `indexer_topk`'s "materialise" only takes it for rows of
<= 32K keys; its four 256-bin histograms are most of its cost (NOTES item 16), so `bin_topk.py`, one
histogram pass, is the prefill default since session 9): four 8-bit histogram passes
(`tl.histogram`, 256 bins, on the order-preserving uint32 image of the float) pin down the exact
k-th largest key, and a final pass writes the selected column indices in ascending order (a running
`cumsum` gives each selected element its output slot), so no sort follows (one prefix sum a step
when every key tied with the k-th is kept, the usual case, two otherwise: H200 1.62 -> 1.26 ms for
the pass at 32K). Among keys equal to the threshold the later ones are taken, the reference's rule
(torch.topk breaks exact ties arbitrarily).
-inf entries are never selected; rows with fewer than k finite entries take all of them and pad
with -1. Each row only reads its first `n_row` columns (the causal prefix of the query).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _okey(x):
    """Order-preserving uint32 image of fp32 x (larger float -> larger key). -0.0 maps to +0.0's key:
    they are equal scores (a negative head weight times a ReLU zero gives -0.0), and the reference's
    sort ties them (the later key wins) where their bit patterns would order them."""
    u = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    neg = (u >> 31) == 1
    return tl.where(neg, ~u, u | 0x80000000)


@triton.jit
def _pick_digit(hist, kk, prefix, shift: tl.constexpr):
    """One radix level from its 256-bin histogram `hist` of the keys that match `prefix` above bit
    shift + 8: the digit d* holding the kk-th largest key goes into the prefix; returns (prefix, the
    rank left to place inside d*, the number of keys with digit d*)."""
    bins = tl.arange(0, 256)
    total = tl.sum(hist, 0)
    suf = total - tl.cumsum(hist, 0) + hist  # entries in bins >= b
    dstar = tl.sum((suf >= kk).to(tl.int32), 0) - 1
    kk = kk - tl.sum(tl.where(bins > dstar, hist, 0), 0)
    n_eq = tl.sum(tl.where(bins == dstar, hist, 0), 0)
    return prefix | (dstar.to(tl.uint32) << shift), kk, n_eq


@triton.jit
def select_threshold(x, live, K):
    """The threshold of the K largest of one register-resident row x `[CB]` fp32 (+inf allowed) among
    live `[CB]` (at least one live entry): (tau, need, n_eq) with tau an order-preserving key, keep
    key > tau and the last `need` of the n_eq live keys == tau. With <= K live entries every one is
    kept: tau is their smallest key and need = n_eq."""
    bins = tl.arange(0, 256)
    key = _okey(x)
    n = tl.sum(live.to(tl.int32), 0)
    tau = tl.min(tl.where(live, key, 0xFFFFFFFF), 0)
    n_eq = tl.sum((live & (key == tau)).to(tl.int32), 0)
    need = n_eq
    if n > K:
        kk = K
        prefix = tl.zeros([], tl.uint32)
        for level in tl.static_range(4):
            shift = 24 - 8 * level
            if level == 0:
                m = live
            else:
                m = live & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            d = tl.where(m, (key >> shift) & 0xFF, 0).to(tl.int32)
            hist = tl.histogram(d, 256) - tl.where(bins == 0, tl.sum((~m).to(tl.int32), 0), 0)
            prefix, kk, n_eq = _pick_digit(hist, kk, prefix, shift)
        tau = prefix
        need = kk
    return tau, need, n_eq


@triton.jit
def select_mask(x, live, K):
    """The K largest of one register-resident row x `[CB]` fp32 (+inf allowed) among live `[CB]`, as
    a mask `[CB]`: among equal values the later entries, the reference's rule (all live if fewer)."""
    key = _okey(x)
    tau, need, n_eq = select_threshold(x, live, K)
    eq = live & (key == tau)
    eq_rank = tl.cumsum(eq.to(tl.int32), 0) - 1
    return live & ((key > tau) | (eq & (eq_rank >= n_eq - need)))


@triton.jit
def select_row(x, idx, live, K, OUT_ROW, KB: tl.constexpr):
    """Exact top-K of one register-resident row: x `[CB]` fp32 (+inf allowed), idx `[CB]` int32
    positions in ascending order, live `[CB]` bool. Writes the positions of the K largest (ties to the
    later entries, the reference's rule) in ascending order to OUT_ROW[0:K], then -1 up to K."""
    sel = select_mask(x, live, K)
    slot = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(OUT_ROW + slot, idx, mask=sel)
    cnt = tl.sum(sel.to(tl.int32), 0)
    for c in range(cnt, K, KB):
        offs = c + tl.arange(0, KB)
        tl.store(OUT_ROW + offs, tl.full([KB], -1, tl.int32), mask=offs < K)


@triton.jit
def radix_row(base, obase, n, K, BLOCK: tl.constexpr):
    """Exact top-K of the row base[0:n] fp32 (-inf = not selectable) by five passes over memory; writes
    the selected columns ascending to obase[0:K], -1 padded (ties to the later column)."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    # pass 1: top byte histogram and the count of finite entries
    hist = tl.zeros([256], tl.int32)
    nvalid = 0
    for c in range(0, n, BLOCK):
        x = tl.load(base + c + offs, mask=c + offs < n, other=float("-inf"))
        valid = x > float("-inf")
        d = tl.where(valid, _okey(x) >> 24, 0).to(tl.int32)
        hist += tl.histogram(d, 256) - tl.where(bins == 0, tl.sum((~valid).to(tl.int32), 0), 0)
        nvalid += tl.sum(valid.to(tl.int32), 0)
    tau = tl.zeros([], tl.uint32)  # select key > tau, plus the last `need` of the n_eq keys == tau
    need = 0
    n_eq = 0
    if nvalid > K:
        kk = K
        prefix = tl.zeros([], tl.uint32)
        for level in tl.static_range(4):
            shift = 24 - 8 * level
            if level > 0:
                hist = tl.zeros([256], tl.int32)
                for c in range(0, n, BLOCK):
                    x = tl.load(base + c + offs, mask=c + offs < n, other=float("-inf"))
                    key = _okey(x)
                    m = (x > float("-inf")) & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
                    d = tl.where(m, (key >> shift) & 0xFF, 0).to(tl.int32)
                    hist += tl.histogram(d, 256) - tl.where(bins == 0, tl.sum((~m).to(tl.int32), 0), 0)
            prefix, kk, n_eq = _pick_digit(hist, kk, prefix, shift)
        tau = prefix
        need = kk
    collect_row(base, obase, n, K, tau, need, n_eq, BLOCK)


@triton.jit
def collect_row(base, obase, n, K, tau, need, n_eq, BLOCK: tl.constexpr):
    """Writes the columns of base[0:n] (fp32, -inf = not selectable) whose key is > tau, and the last
    `need` of the n_eq keys == tau, in ascending order to obase (output slot = running count of
    selected entries), then -1 up to K. tau = 0, need = 0 keeps every finite entry."""
    offs = tl.arange(0, BLOCK)
    cnt = 0
    if need == n_eq:  # every key equal to tau is kept (the usual case): one prefix sum a step, not two
        for c in range(0, n, BLOCK):
            x = tl.load(base + c + offs, mask=c + offs < n, other=float("-inf"))
            sel = (x > float("-inf")) & (_okey(x) >= tau)
            pos = cnt + tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.store(obase + pos, (c + offs).to(tl.int32), mask=sel)
            cnt += tl.sum(sel.to(tl.int32), 0)
    else:
        eq_seen = 0
        for c in range(0, n, BLOCK):
            x = tl.load(base + c + offs, mask=c + offs < n, other=float("-inf"))
            valid = x > float("-inf")
            key = _okey(x)
            eq = valid & (key == tau)
            eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), 0) - 1
            # among keys equal to the threshold the later ones win, as in the reference (`select_topk`)
            sel = valid & ((key > tau) | (eq & (eq_rank >= n_eq - need)))
            pos = cnt + tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.store(obase + pos, (c + offs).to(tl.int32), mask=sel)
            cnt += tl.sum(sel.to(tl.int32), 0)
            eq_seen += tl.sum(eq.to(tl.int32), 0)
    for c in range(cnt, K, BLOCK):
        tl.store(obase + c + offs, tl.full([BLOCK], -1, tl.int32), mask=c + offs < K)


@triton.jit
def row_bases(SC, OUT, Tc, S_c, q_lim, srb, srt, sob, sot, LONG_FIRST: tl.constexpr = False):
    """This program's row of a `[B, Tc, S_c]` score chunk: (row, its scores, its output row, the
    columns it reads: those up to the query's position, q_lim + t, and below S_c). LONG_FIRST: program
    i takes the row Tc - 1 - i of its batch row, so the longest causal rows start first and the short
    ones fill the last wave (the tail of a launch of few long rows otherwise runs the longest alone)."""
    row = tl.program_id(0)
    b = row // Tc
    t = row % Tc
    if LONG_FIRST:
        t = Tc - 1 - t
        row = b * Tc + t
    base = SC + b.to(tl.int64) * srb + t.to(tl.int64) * srt
    obase = OUT + b.to(tl.int64) * sob + t.to(tl.int64) * sot
    n = tl.minimum(S_c, q_lim + t + 1)  # columns past the query's position are -inf: skip them
    return row, base, obase, n


@triton.jit
def _radix_topk_kernel(SC, OUT, Tc, S_c, q_lim, srb, srt, sob, sot, K,
                       BLOCK: tl.constexpr):
    _, base, obase, n = row_bases(SC, OUT, Tc, S_c, q_lim, srb, srt, sob, sot)
    radix_row(base, obase, n, K, BLOCK)


def row_topk_args(scores: torch.Tensor, topk: int, out: torch.Tensor | None):
    """The row top-k wrappers' shared host prologue: scores `[B, Tc, Sc]` with a contiguous last dim, and
    the `[B, Tc, topk]` int32 output (allocated unless given)."""
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    if out is None:
        B, Tc, _ = scores.shape
        out = torch.empty(B, Tc, topk, device=scores.device, dtype=torch.int32)
    return scores, out


def radix_topk(scores: torch.Tensor, topk: int, q_lim: int | None = None, out: torch.Tensor | None = None,
               launch: tuple[int, int] | None = None):
    """scores `[B, Tc, Sc]` fp32 (last dim contiguous, -inf = not visible) -> `[B, Tc, topk]` int32
    column indices, ascending, -1 padded. Row t only reads columns `< q_lim + t + 1` (default: all).
    launch: (BLOCK, num_warps), default (2048, 8) on CUDA."""
    scores, out = row_topk_args(scores, topk, out)
    B, Tc, Sc = scores.shape
    q_lim = Sc if q_lim is None else q_lim
    block, warps = launch or ((2048, 8) if scores.is_cuda else (64, 1))
    _radix_topk_kernel[(B * Tc,)](scores, out, Tc, Sc, q_lim, scores.stride(0), scores.stride(1),
                                  out.stride(0), out.stride(1), topk, BLOCK=block, num_warps=warps)
    return out


@triton.jit
def _search_span(key, live):
    """Where a k-th key search over the live `[CB]` uint32 keys starts: smear, the bits at or below the highest
    bit in which the live min and max differ (the only bits to search), and tau, the bits above it (common to
    every live key, hence to the answer)."""
    lo = tl.min(tl.where(live, key, 0xFFFFFFFF), 0)
    hi = tl.max(tl.where(live, key, 0), 0)
    diff = lo ^ hi
    smear = diff | (diff >> 1)
    smear = smear | (smear >> 2)
    smear = smear | (smear >> 4)
    smear = smear | (smear >> 8)
    smear = smear | (smear >> 16)  # every bit at or below diff's highest set bit
    tau = lo & ~smear
    return smear, tau


@triton.jit
def kth_key(key, live, K, NBITS: tl.constexpr = 32):
    """The K-th largest of the live `[CB]` uint32 keys (K >= 1, at least K live): the largest tau with
    #(live & key >= tau) >= K, by a binary search over the bits where the live min and max differ (the bits
    above are common to every live key, hence to tau). NBITS < 32: only the top NBITS bits are searched (the
    rest left 0), so tau <= the K-th largest and #(key >= tau) >= K: a threshold, not the exact key."""
    smear, tau = _search_span(key, live)
    bit = tl.full([], 0x80000000, tl.uint32)
    for _ in range(NBITS):
        if (smear & bit) != 0:
            cand = tau | bit
            c = tl.sum((live & (key >= cand)).to(tl.int32), 0)
            if c >= K:
                tau = cand
        bit = bit >> 1
    return tau


@triton.jit
def _minmax(a_lo, a_hi, b_lo, b_hi):
    return tl.minimum(a_lo, b_lo), tl.maximum(a_hi, b_hi)


@triton.jit
def kth_key_counts(key, live, n, K, scr, CM: tl.constexpr, CJ: tl.constexpr):
    """`kth_key`'s exact K-th largest of the n live `[CB]` keys, with the live keys above it and equal to it:
    (tau, n_gt, n_eq). The bit search stops once at most CM live keys share the bits decided so far (those
    between the keys above, fewer than K, and the rest): they are compacted to scr[0:CM] (int32 scratch this
    program owns: a global round trip, L1/L2-hot) and ranked all-pairs in [CM, CJ] tiles (later lanes rank above
    equal keys, the reference's ties), which gives tau and both counts without another reduction over the lanes.
    Why: each bit of the search is a block reduction over every lane, ~28 a search; after ~6-10 bits only a few
    dozen keys still matter. A mass of more than CM keys equal at the K-th ends the search at its last bit.
    Live keys must be > 0 (`_okey` of a score, never a NaN's): a dead lane's key is made 0."""
    lo, hi = tl.reduce((tl.where(live, key, 0xFFFFFFFF), tl.where(live, key, 0)), 0, _minmax)
    diff = lo ^ hi
    smear = diff | (diff >> 1)
    smear = smear | (smear >> 2)
    smear = smear | (smear >> 4)
    smear = smear | (smear >> 8)
    smear = smear | (smear >> 16)  # the bits at or below the highest one where the live keys differ
    tau = lo & ~smear
    key = tl.where(live, key, 0)  # dead lanes never counted: every candidate tau | bit is > 0
    c_lo = n  # live keys >= tau (>= K throughout)
    c_up = n * 0  # live keys >= the top of the interval still open, [tau, tau | low] (< K throughout)
    low = smear
    bit = tl.full([], 0x80000000, tl.uint32)
    for _ in range(32):
        if ((smear & bit) != 0) & (c_lo - c_up > CM):
            cand = tau | bit
            c = tl.sum((key >= cand).to(tl.int32), 0)
            if c >= K:
                tau = cand
                c_lo = c
            else:
                c_up = c
            low = bit - 1
        bit = bit >> 1
    m = c_lo - c_up
    n_gt = c_up  # the search ran to its last bit: the open keys all equal tau
    n_eq = m
    if m <= CM:
        inr = (key != 0) & ((key & ~low) == tau)  # tau may still be 0: the dead lanes' key
        slot = tl.cumsum(inr.to(tl.int32), 0) - 1
        tl.store(scr + slot, key.to(tl.int32, bitcast=True), mask=inr)
        tl.debug_barrier()
        i = tl.arange(0, CM)
        ki = tl.load(scr + i, mask=i < m, other=0).to(tl.uint32, bitcast=True)
        gt = i * 0
        eq = i * 0
        later = i * 0
        for j0 in tl.static_range(0, CM, CJ):  # [CM, CJ] tiles: the pairs' registers stay few
            j = j0 + tl.arange(0, CJ)[None, :]
            kj = tl.load(scr + j, mask=j < m, other=0).to(tl.uint32, bitcast=True)
            e = (kj == ki[:, None]) & (j < m)
            gt += tl.sum(((kj > ki[:, None]) & (j < m)).to(tl.int32), 1)
            eq += tl.sum(e.to(tl.int32), 1)
            later += tl.sum((e & (j > i[:, None])).to(tl.int32), 1)
        hit = (i < m) & (gt + later == K - c_up - 1)  # exactly one open key has this rank
        tau, g, q = tl.reduce((tl.where(hit, ki, 0), tl.where(hit, gt, 0), tl.where(hit, eq, 0)), 0, _add3)
        n_gt = c_up + g
        n_eq = q
        tl.debug_barrier()  # the caller may store over scr next
    return tau, n_gt, n_eq


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2




@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def kth_key2(key, live, K, NBITS: tl.constexpr = 32):
    """`kth_key` two bits a step: the live keys >= tau | lo bit, | hi bit, | both of the step's pair
    are counted in ONE reduction (three 21-bit fields of an int64 a lane; CB < 2^21), so a row takes half the
    dependent count / reduce / barrier rounds (sm_90a: the 1-bit loop is ~89 instructions a step at 8 warps,
    100 registers, 2 programs an SM: latency bound). Same tau: the largest with #(live & key >= tau) >= K over
    the top NBITS bits (NBITS even; < 32 leaves the bits below 0: a lower bound)."""
    smear, tau = _search_span(key, live)
    b1 = tl.full([], 0x80000000, tl.uint32)
    for _ in range(NBITS // 2):
        e1 = smear & b1
        e0 = smear & (b1 >> 1)
        if e0 != 0:  # smear is a low mask: e1 != 0 implies e0 != 0
            t1 = tau | e0
            t2 = tau | e1
            t3 = t2 | e0
            v12 = tl.where(live, (key >= t1).to(tl.int32) | ((key >= t2).to(tl.int32) << 16), 0)
            v3 = tl.where(live, (key >= t3).to(tl.int32), 0)
            c12, c3 = tl.reduce((v12, v3), 0, _add2)
            if c3 >= K:
                tau = t3
            elif (c12 >> 16) >= K:
                tau = t2
            elif (c12 & 0xFFFF) >= K:
                tau = t1
        b1 = b1 >> 2
    return tau


@triton.jit
def _select_lanes(key, live, n, K, STEP2: tl.constexpr, scr, CM: tl.constexpr):
    """The lanes of the K largest live `[CB]` keys (key order = lane order; later lanes win ties), as a mask;
    every live lane where n <= K. STEP2: the k-th key by `kth_key2` (two bits a step) instead of `kth_key`;
    CM > 0: by `kth_key_counts` with scr (int32, >= CM slots) as its scratch."""
    sel = live
    if n > K:
        if CM > 0:
            key = tl.where(live, key, 0)  # dead lanes are neither above nor at tau (>= the live min > 0)
            tau, n_gt, n_eq = kth_key_counts(key, live, n, K, scr, CM, 16)
            gt = key > tau
            eq = key == tau
            need = K - n_gt
        else:
            if STEP2:
                tau = kth_key2(key, live, K)
            else:
                tau = kth_key(key, live, K)
            gt = live & (key > tau)
            eq = live & (key == tau)
            need = K - tl.sum(gt.to(tl.int32), 0)
            n_eq = tl.sum(eq.to(tl.int32), 0)
        sel = gt | eq
        if need < n_eq:  # among keys equal to the k-th the later ones win (the reference's rule)
            sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) > n_eq - need))
    return sel


@triton.jit
def _store_lanes(sel, idx, n, K, obase, KB: tl.constexpr):
    """idx of the selected lanes, in lane order, at obase, then -1 up to K."""
    slot = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(obase + slot, idx, mask=sel)
    for c in range(tl.minimum(n, K), K, KB):
        o = c + tl.arange(0, KB)
        tl.store(obase + o, tl.full([KB], -1, tl.int32), mask=o < K)


@triton.jit
def _write_selected(key, idx, live, n, K, obase, KB: tl.constexpr, STEP2: tl.constexpr):
    """The K largest live keys (key order = lane order; later lanes win ties) -> their idx ascending at obase,
    -1 padded to K. STEP2: the k-th key by `kth_key2` (two bits a step) instead of `kth_key`."""
    _store_lanes(_select_lanes(key, live, n, K, STEP2, obase, 0), idx, n, K, obase, KB)
