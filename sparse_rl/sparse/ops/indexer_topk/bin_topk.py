"""Row-wise exact top-k of masked fp32 scores with ONE histogram pass over the row: value-linear bins
between the row's finite min and max, the threshold bin's scores compacted to a small buffer and
selected exactly in registers, in Triton. Same rows as `radix_topk.radix_topk` (ascending columns,
-1 padded, among equal scores the later column wins, -0.0 == +0.0, -inf never selected).

Why: `tl.histogram` lowers to a ballot per bit of the bin index plus, per thread, a popcount for each
bin it owns (~100 instructions per element per warp lane at 256 bins, ~55 at 128: Triton's
HistogramOpToLLVM), and the radix select (`radix_row`) runs four 256-bin histograms over every score
of a row plus a prefix-sum pass; more, smaller radix programs per SM gained <= 1.12x on the H200, so it
is issue bound more than latency bound (benchmarks/NOTES.md item 16). Here a row costs:
1. a min / max / count pass (a few instructions per score, the row's one HBM read);
2. one NB-bin histogram of `bin(x) = floor((x - lo) * NB / (hi - lo))` (monotone in x, so every score
   in a higher bin is larger than every score in a lower one; +inf, the forced keys, in the top bin);
   the bin d* holding the k-th largest score and its count c* follow from the suffix sums; if c* is
   over the buffer (an outlier stretched the span), a second histogram pass splits bin d* into NB
   sub-bins the same way;
3. if c* <= CAP: one pass compacts the c* scores to a per-row buffer (prefix sum, no histogram) and
   `select_threshold` on the buffer (register radix, 4 x 256-bin levels over CAP lanes) gives the
   exact k-th key and how many of its ties are kept; otherwise (masses of equal scores) the row takes
   `radix_row`, in the same program;
4. the collect pass of `radix_row` (`collect_row`): ascending output by a running prefix sum.
Ties: keys equal to the k-th are all in bin d* (equal values, -0.0 and +0.0 included, have equal
bins), so the buffer counts them all and the collect pass keeps the later ones.
Measured (H200, session 9, trained indexer, k = 2048; NOTES item 16): 6.21 vs 11.38 ms for radix on
the 32K token-level scores (32K causal rows), 3.41 vs 5.70 ms on the g64 rows at 128K (2K rows of
128K blocks), rows equal to radix's everywhere; per pass at 32K: span 0.50, histogram ~1.4, compaction
+ buffer select ~2.1, collect 1.26 ms (the prefix-sum passes are the largest part).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.radix_topk import (collect_row, radix_row, row_bases, row_topk_args,
                                                         select_threshold)


@triton.jit
def row_span(base, n, BLOCK: tl.constexpr):
    """(lo, hi, nvalid) of base[0:n]: the smallest and largest finite score (+inf / -inf if none) and
    the count of entries > -inf."""
    offs = tl.arange(0, BLOCK)
    vmin = tl.full([BLOCK], float("inf"), tl.float32)
    vmax = tl.full([BLOCK], float("-inf"), tl.float32)
    cnt = tl.zeros([BLOCK], tl.int32)
    for c in range(0, n, BLOCK):
        x = tl.load(base + c + offs, mask=c + offs < n, other=float("-inf"))
        valid = x > float("-inf")
        fin = valid & (x < float("inf"))
        vmin = tl.minimum(vmin, tl.where(fin, x, float("inf")))
        vmax = tl.maximum(vmax, tl.where(fin, x, float("-inf")))
        cnt += valid.to(tl.int32)
    return tl.min(vmin, 0), tl.max(vmax, 0), tl.sum(cnt, 0)


@triton.jit
def _bin(x, lo, scale, NB: tl.constexpr):
    """Value-linear bin in [0, NB) of finite or +inf x, non-decreasing in x (fp32 subtraction and a
    multiplication by scale >= 0 are monotone): +inf -> NB - 1; NaN from 0 * inf (a span so small that
    its scale overflowed) -> 0."""
    f = (x - lo) * scale
    f = tl.where(f > 0.0, f, 0.0)
    f = tl.where(f < NB, f, NB - 1.0)
    return tl.where(x == float("inf"), NB - 1, f.to(tl.int32))


@triton.jit
def bin_hist(base, n, K, lo, scale, total, lo0, scale0, d0, NESTED: tl.constexpr, NB: tl.constexpr,
             BLOCK: tl.constexpr):
    """A histogram pass: NB bins of `_bin(x, lo, scale)` over the finite entries of base[0:n] (NESTED: only
    those in bin d0 of `_bin(x, lo0, scale0)`), `total` > K of them -> (d*, the bin holding their K-th
    largest; kk, that entry's rank inside d*; c*, d*'s count)."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, NB)
    hist = tl.zeros([NB], tl.int32)
    for c in range(0, n, BLOCK):
        x = tl.load(base + c + offs, mask=c + offs < n, other=float("-inf"))
        m = x > float("-inf")
        if NESTED:
            m = m & (_bin(x, lo0, scale0, NB) == d0)
        b = tl.where(m, _bin(x, lo, scale, NB), 0)
        hist += tl.histogram(b, NB) - tl.where(bins == 0, tl.sum((~m).to(tl.int32), 0), 0)
    suf = total - tl.cumsum(hist, 0) + hist  # entries in bins >= b
    dstar = tl.sum((suf >= K).to(tl.int32), 0) - 1
    kk = K - tl.sum(tl.where(bins > dstar, hist, 0), 0)
    cstar = tl.sum(tl.where(bins == dstar, hist, 0), 0)
    return dstar, kk, cstar


@triton.jit
def bin_compact(base, n, lo, scale, dstar, lo2, scale2, d2, bufv, NB: tl.constexpr, BLOCK: tl.constexpr):
    """The finite scores of base[0:n] in bin d* of `_bin(x, lo, scale)` and bin d2 of `_bin(x, lo2, scale2)`
    (the same test twice without a second level) to bufv (any order: only their values count)."""
    offs = tl.arange(0, BLOCK)
    cnt = 0
    for c in range(0, n, BLOCK):
        x = tl.load(base + c + offs, mask=c + offs < n, other=float("-inf"))
        m = (x > float("-inf")) & (_bin(x, lo, scale, NB) == dstar) & (_bin(x, lo2, scale2, NB) == d2)
        slot = cnt + tl.cumsum(m.to(tl.int32), 0) - 1
        tl.store(bufv + slot, x, mask=m)
        cnt += tl.sum(m.to(tl.int32), 0)
    tl.debug_barrier()  # the buffer was written by other threads of this program


@triton.jit
def bin_threshold(base, n, K, bufv, NB: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Passes 1-3 of `bin_row` -> (path, c*, tau, need, n_eq): path 0 = <= K finite entries (keep them
    all: tau = need = n_eq = 0), 1 = the first level's bin fit the buffer, 3 = a second level over the
    first's bin d* (NB sub-bins of its width) was needed and fit, 2 = neither fit (no threshold)."""
    lo, hi, nvalid = row_span(base, n, BLOCK)
    tau = tl.zeros([], tl.uint32)  # keep key > tau, plus the last `need` of the n_eq keys == tau
    need = 0
    n_eq = 0
    path = 0
    cstar = nvalid
    if nvalid > K:
        span = hi - lo
        scale = tl.where(span > 0.0, NB / span, 0.0)
        dstar, kk, cstar = bin_hist(base, n, K, lo, scale, nvalid, lo, scale, 0, False, NB, BLOCK)
        lo2 = lo
        scale2 = scale
        d2 = dstar
        path = 1
        if cstar > CAP:  # masses of scores in one bin (an outlier stretched the span): split that bin
            lo2 = lo + dstar.to(tl.float32) / scale
            scale2 = scale * NB
            d2, kk, cstar = bin_hist(base, n, kk, lo2, scale2, cstar, lo, scale, dstar, True, NB, BLOCK)
            path = 3
        if cstar <= CAP:
            bin_compact(base, n, lo, scale, dstar, lo2, scale2, d2, bufv, NB, BLOCK)
            ocap = tl.arange(0, CAP)
            live = ocap < cstar
            xv = tl.load(bufv + ocap, mask=live, other=float("-inf"))
            tau, need, n_eq = select_threshold(xv, live, kk)
        else:
            path = 2
    return path, cstar, tau, need, n_eq


@triton.jit
def bin_row(base, obase, n, K, bufv, stats, WITH_STATS: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr,
            BLOCK: tl.constexpr):
    """Exact top-K of the row base[0:n] fp32 (-inf = not selectable) into obase[0:K] (ascending columns,
    -1 padded, ties to the later column); bufv: this row's CAP-float scratch. With WITH_STATS, stats[0:2]
    receives (path, c*) of `bin_threshold`; path 2 takes `radix_row`."""
    path, cstar, tau, need, n_eq = bin_threshold(base, n, K, bufv, NB, CAP, BLOCK)
    if WITH_STATS:
        tl.store(stats, path)
        tl.store(stats + 1, cstar)
    if path == 2:
        radix_row(base, obase, n, K, BLOCK)
    else:
        collect_row(base, obase, n, K, tau, need, n_eq, BLOCK)


@triton.jit
def _bin_topk_kernel(SC, OUT, BUFV, STATS, Tc, S_c, q_lim, srb, srt, sob, sot, K,
                     NB: tl.constexpr, CAP: tl.constexpr, BLOCK: tl.constexpr, WITH_STATS: tl.constexpr,
                     LONG_FIRST: tl.constexpr):
    row, base, obase, n = row_bases(SC, OUT, Tc, S_c, q_lim, srb, srt, sob, sot, LONG_FIRST)
    bin_row(base, obase, n, K, BUFV + row.to(tl.int64) * CAP, STATS + row.to(tl.int64) * 2, WITH_STATS,
            NB, CAP, BLOCK)


def bin_launch(cuda: bool) -> tuple[int, int, int, int]:
    """Default (bins, buffer slots, BLOCK, num_warps): the fastest of the H200 sweeps (NOTES item 16;
    more bins or buffer slots, BLOCK 512 / 2 warps and BLOCK 2048 were 1.02-1.6x slower)."""
    return (128, 1024, 1024, 4) if cuda else (32, 64, 64, 1)


def bin_topk(scores: torch.Tensor, topk: int, q_lim: int | None = None, out: torch.Tensor | None = None,
             launch: tuple[int, int, int, int] | None = None, stats: torch.Tensor | None = None,
             long_first: bool = True) -> torch.Tensor:
    """`radix_topk.radix_topk` (same arguments and rows: `[B, Tc, Sc]` fp32, -inf = not visible ->
    `[B, Tc, topk]` int32 ascending, -1 padded, ties to the later column) with one histogram pass.
    launch: (bins NB, buffer slots CAP, BLOCK, num_warps), `bin_launch`'s by default; NB and CAP powers
    of two, NB >= 32. stats: optional `[B * Tc, 2]` int32 per row (path, c*), see `bin_row`. long_first:
    the programs take the rows last to first (`row_bases`; H200: 3.41 vs 3.60 ms on 2K causal rows of
    128K, equal on 4K-32K rows)."""
    scores, out = row_topk_args(scores, topk, out)
    B, Tc, Sc = scores.shape
    if B * Tc == 0 or topk == 0:
        return out
    nb, cap, block, warps = launch or bin_launch(scores.is_cuda)
    if nb < 32 or nb & (nb - 1) or cap & (cap - 1):
        raise ValueError(f"bin_topk: bins {nb} must be a power of two >= 32 and slots {cap} a power of two")
    if stats is not None and (stats.shape != (B * Tc, 2) or stats.dtype != torch.int32 or not stats.is_contiguous()):
        raise ValueError(f"bin_topk: stats must be a contiguous [{B * Tc}, 2] int32 tensor")
    bufv = torch.empty(B * Tc, cap, device=scores.device, dtype=torch.float32)
    q_lim = Sc if q_lim is None else q_lim
    _bin_topk_kernel[(B * Tc,)](scores, out, bufv, stats if stats is not None else out, Tc, Sc, q_lim,
                                scores.stride(0), scores.stride(1), out.stride(0), out.stride(1), topk,
                                NB=nb, CAP=cap, BLOCK=block, WITH_STATS=stats is not None, LONG_FIRST=long_first,
                                num_warps=warps)
    return out
