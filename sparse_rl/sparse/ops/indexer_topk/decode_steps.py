"""The decode select's Triton steps that its three forms share (`decode.py` chunked, `decode_row.py`,
`decode_split.py`), moved here unchanged so the forms import them without importing each other: a
block of a row's scores with its first-level bins, b* from a histogram, and the exact threshold among
the candidates (radix levels or one sort). See decode.py's module docstring for the algorithm."""

from __future__ import annotations

import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.radix_topk import _okey
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot

NB = 128  # first-level bins


@triton.jit
def _okey_inv(k):
    """fp32 of the order-preserving key `_okey` made."""
    return tl.where((k >> 31) == 1, k & 0x7FFFFFFF, ~k).to(tl.float32, bitcast=True)


@triton.jit
def _query_of(Q, W, b, sqb, sqh, sqd, swb, swh, HI, DI, HB: tl.constexpr, BD: tl.constexpr):
    """Row b's index query, transposed `[BD, HB]` (zero-padded), and its head weights `[HB]` fp32."""
    offs_h = tl.arange(0, HB)
    offs_d = tl.arange(0, BD)
    qt = tl.load(Q + b * sqb + offs_h[None, :] * sqh + offs_d[:, None] * sqd,
                 mask=(offs_h[None, :] < HI) & (offs_d[:, None] < DI), other=0.0)
    wv = tl.load(W + b * swb + offs_h * swh, mask=offs_h < HI, other=0.0).to(tl.float32)
    return qt, wv


@triton.jit
def _key_tile(KI, b, skb, sks, skd, offs_n, vis, DI, BD: tl.constexpr):
    """Row b's index keys offs_n `[BN, BD]` (zero where not vis or past DI)."""
    offs_d = tl.arange(0, BD)
    return tl.load(KI + b * skb + offs_n[:, None] * sks + offs_d[None, :] * skd,
                   mask=vis[:, None] & (offs_d[None, :] < DI), other=0.0)


@triton.jit
def _tile_scores(k, KS, b, ssb, offs_n, vis, qt, wv, PREC: tl.constexpr, FP8: tl.constexpr):
    """Index scores `[BN]` fp32 of the key tile k `[BN, BD]` (`_key_tile`): a small tensor-core dot against all
    index heads (qt, wv: `_query_of`), ReLU, the weighted head sum; fp8 keys (e4m3, exact in bf16/fp32) take
    their per-token scale KS after the head sum."""
    if FP8:
        s = tl.sum(tl.maximum(dot(k.to(qt.dtype), qt, PREC), 0.0) * wv[None, :], 1)
        s = s * tl.load(KS + b * ssb + offs_n, mask=vis, other=0.0)
    else:
        s = tl.sum(tl.maximum(dot(k, qt, PREC), 0.0) * wv[None, :], 1)
    return s


@triton.jit
def _score_tile(KI, KS, b, skb, sks, skd, ssb, offs_n, vis, qt, wv, DI, BD: tl.constexpr, PREC: tl.constexpr,
                FP8: tl.constexpr):
    """Index scores `[BN]` fp32 of row b's keys offs_n (0 where not vis): `_tile_scores` of `_key_tile`."""
    k = _key_tile(KI, b, skb, sks, skd, offs_n, vis, DI, BD)
    return _tile_scores(k, KS, b, ssb, offs_n, vis, qt, wv, PREC, FP8)


@triton.jit
def _block(SC, b, S, pos, n0, mx, inv, BN: tl.constexpr, NB: tl.constexpr):
    """Scores of keys n0..n0+BN-1 of row b (the visible prefix only; -inf elsewhere) with their positions,
    finiteness, first-level bin and radix key u = okey(x) (larger u = larger x). The bin is
    floor((max - x) * NB / (max - min)), clamped: monotone in x (so every key of a lower bin scores
    strictly higher), whatever the signs of the scores."""
    offs_n = n0 + tl.arange(0, BN)
    x = tl.load(SC + b * S + offs_n, mask=(offs_n <= pos) & (offs_n < S), other=float("-inf"))
    fin = (x > float("-inf")) & (x < float("inf"))
    d = tl.minimum(((mx - tl.where(fin, x, mx)) * inv).to(tl.int32), NB - 1)
    return offs_n, x, fin, d, _okey(x)


@triton.jit
def _append(CU, CI, b, S, offs_n, u, cand, off):
    """The candidates' radix keys u and positions (where cand) to row b's list from slot off, in key
    order -> the next free slot."""
    slot = off + tl.cumsum(cand.to(tl.int32), 0) - 1
    tl.store(CU + b * S + slot, u.to(tl.int32, bitcast=True), mask=cand)
    tl.store(CI + b * S + slot, offs_n, mask=cand)
    return off + tl.sum(cand.to(tl.int32), 0)


@triton.jit
def _emit(OUT, b, sob, offs_n, sel, off):
    """The selected positions (where sel) to row b of OUT from column off, ascending -> the next column."""
    slot = off + tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(OUT + b * sob + slot, offs_n, mask=sel)
    return off + tl.sum(sel.to(tl.int32), 0)


@triton.jit
def _pad_rest(OUT, b, sob, off, K, BN: tl.constexpr):
    """Columns off..K-1 of row b of OUT set to -1 (no key)."""
    for c in range(off, K, BN):
        offs = c + tl.arange(0, BN)
        tl.store(OUT + b * sob + offs, tl.full([BN], -1, tl.int32), mask=offs < K)


@triton.jit
def _bstar_of(h, nf, K, NB: tl.constexpr):
    """Bin b* that holds the k-th largest finite score once the nf forced keys are counted (h: the
    row's first-level histogram `[NB]`), the rank left to fill inside it, and whether every finite key
    is taken (then b* = NB: no candidates)."""
    bins = tl.arange(0, NB)
    kk = K - nf
    total = tl.sum(h, 0)
    cum = tl.cumsum(h, 0)
    take_all = total <= kk
    bstar = tl.where(take_all, NB, tl.sum((cum < kk).to(tl.int32), 0))
    rem = kk - tl.sum(tl.where(bins < bstar, h, 0), 0)
    return bstar, rem, take_all


@triton.jit
def _radix_level(CU, b, S, n, prefix, kk, lo: tl.constexpr, BLOCK: tl.constexpr):
    """One 8-bit digit (bits lo..lo+7) over the n candidates whose bits above lo+7 equal `prefix`'s:
    the updated prefix, the rank left to place inside it, and the count of keys equal to the prefix."""
    bins = tl.arange(0, 256)
    offs = tl.arange(0, BLOCK)
    hist = tl.zeros([256], tl.int32)
    for c in range(0, n, BLOCK):
        live = c + offs < n
        key = tl.load(CU + b * S + c + offs, mask=live, other=0).to(tl.uint32, bitcast=True)
        if lo == 24:
            m = live
        else:
            m = live & ((key >> (lo + 8)) == (prefix >> (lo + 8)))
        d = tl.where(m, (key >> lo) & 0xFF, 0).to(tl.int32)
        hist += tl.histogram(d, 256) - tl.where(bins == 0, tl.sum((~m).to(tl.int32), 0), 0)
    total = tl.sum(hist, 0)
    suf = total - tl.cumsum(hist, 0) + hist
    dstar = tl.sum((suf >= kk).to(tl.int32), 0) - 1
    kk = kk - tl.sum(tl.where(bins > dstar, hist, 0), 0)
    n_eq = tl.sum(tl.where(bins == dstar, hist, 0), 0)
    return prefix | (dstar.to(tl.uint32) << lo), kk, n_eq


@triton.jit
def _radix_threshold(CU, CI, b, S, n_c, rem, CH: tl.constexpr, PMAX: tl.constexpr, BLOCK: tl.constexpr):
    """The threshold over n_c candidates by four 8-bit radix levels (any n_c): tau (the rem-th largest u),
    cut (keys equal to tau at positions >= cut are kept: the later ones, as the reference's index cut)
    and each chunk's count of kept candidates `[PMAX]`."""
    offs_p = tl.arange(0, PMAX)
    prefix = tl.zeros([], tl.uint32)
    kk = rem
    prefix, kk, n_eq = _radix_level(CU, b, S, n_c, prefix, kk, 24, BLOCK)
    prefix, kk, n_eq = _radix_level(CU, b, S, n_c, prefix, kk, 16, BLOCK)
    prefix, kk, n_eq = _radix_level(CU, b, S, n_c, prefix, kk, 8, BLOCK)
    prefix, kk, n_eq = _radix_level(CU, b, S, n_c, prefix, kk, 0, BLOCK)
    tau = prefix
    r = n_eq - kk  # keys equal to tau of rank >= r (in key order) are kept: the later keys win
    offs = tl.arange(0, BLOCK)
    seen = 0
    cut = 0
    per_chunk = tl.zeros([PMAX], tl.int32)
    for c in range(0, n_c, BLOCK):
        live = c + offs < n_c
        u = tl.load(CU + b * S + c + offs, mask=live, other=0).to(tl.uint32, bitcast=True)
        idx = tl.load(CI + b * S + c + offs, mask=live, other=0)
        eq = live & (u == tau)
        rank = seen + tl.cumsum(eq.to(tl.int32), 0) - 1
        cut += tl.sum(tl.where(eq & (rank == r), idx, 0), 0)
        seen += tl.sum(eq.to(tl.int32), 0)
        sel = live & ((u > tau) | (eq & (rank >= r)))
        cid = tl.where(sel, idx // CH, 0)
        per_chunk += tl.histogram(cid, PMAX) - tl.where(offs_p == 0, tl.sum((~sel).to(tl.int32), 0), 0)
    return tau, cut, per_chunk


@triton.jit
def _sort_threshold(CU, CI, b, S, n_c, rem, CH: tl.constexpr, PMAX: tl.constexpr, SORT: tl.constexpr):
    """`_radix_threshold`'s result for n_c <= SORT candidates by one in-register sort: each candidate as
    the int64 (u, position) (u's top bit flipped so that signed order is u's order), descending, so the
    rem-th entry is (tau, cut) and the kept ones are those at or above it, ties to the later key."""
    offs_p = tl.arange(0, PMAX)
    offs = tl.arange(0, SORT)
    live = offs < n_c
    u = tl.load(CU + b * S + offs, mask=live, other=0).to(tl.uint32, bitcast=True)
    idx = tl.load(CI + b * S + offs, mask=live, other=0)
    hi = (u ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(live, (hi << 32) | idx.to(tl.int64), -9223372036854775807 - 1)
    kth = tl.sum(tl.where(offs == rem - 1, tl.sort(key, descending=True), 0), 0)
    tau = ((kth >> 32).to(tl.int32) ^ -2147483648).to(tl.uint32, bitcast=True)
    cut = (kth & 0xFFFFFFFF).to(tl.int32)
    sel = live & (key >= kth)
    cid = tl.where(sel, idx // CH, 0)
    per_chunk = tl.histogram(cid, PMAX) - tl.where(offs_p == 0, tl.sum((~sel).to(tl.int32), 0), 0)
    return tau, cut, per_chunk
