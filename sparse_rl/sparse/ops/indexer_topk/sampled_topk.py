"""Row-wise exact top-k of masked fp32 scores: a sampled threshold, one compaction pass, then the radix
select in registers on the few candidates (`radix_topk.radix_topk`'s rows, same tie rule), in Triton.

Why: the radix select (`radix_topk.py`) reads each row five times and runs a 256-bin `tl.histogram`
over every element in four of them; on 2K-8K rows of 32K-128K block scores (the granular prefill's
query groups) it was the largest term of the selection on an H200 (1.4 ms of 2.1 at 32K, 22.5 ms in
one launch at 128K, benchmarks/NOTES.md item 13), ~10-50x over its bytes. Here one program per row:
1. sample SB scores (SB / PIECE contiguous pieces spread evenly over the visible prefix) and take,
   by `select_mask` in registers, the score `thr` whose sample rank is `rate` times the row's k
   scaled to the sample (so ~rate * k of the row's scores are >= thr);
2. one pass over the row writes every score >= thr with its column to a per-row buffer of CAP
   slots in ascending column order (a running `cumsum`, no histogram);
3. if k <= count <= CAP the k best of the row are all in the buffer (every score equal to the k-th
   best is >= thr), so `select_row` on the buffer is exact: ties go to the later column as in the
   reference; otherwise (a sample far off, masses of equal scores) the row falls back to
   `radix_topk.radix_row`, in the same program.
Rows of <= CAP visible columns skip the sample: the whole row is selected in registers.
Cost per row: ~SB / n of a pass for the sample (a quarter to a sixteenth), one pass with a prefix
sum, and a register select over CAP, against five passes with four histograms.
Measured (H200, benchmarks/NOTES.md item 14): 1.3x faster than radix on random scores, 1.1-1.4x
slower on a trained indexer's block scores (the sample misses there often enough to pay the
fallback; session 8: 28% of trained rows fall back), so `granular.resolve_topk_impl` does not take it
(its prefill default is now `bin_topk.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.radix_topk import radix_row, row_bases, row_topk_args, select_mask, select_row

RATE16 = 24  # the sampled threshold aims at rate = RATE16 / 16 = 1.5 x k candidates


@triton.jit
def _sampled_topk_kernel(SC, OUT, BUFV, BUFI, STATS, Tc, S_c, q_lim, srb, srt, sob, sot, K, rate16,
                         CAP: tl.constexpr, SB: tl.constexpr, PIECE: tl.constexpr, BLOCK: tl.constexpr,
                         WITH_STATS: tl.constexpr):
    row, base, obase, n = row_bases(SC, OUT, Tc, S_c, q_lim, srb, srt, sob, sot)
    ocap = tl.arange(0, CAP)
    if n <= CAP:
        x = tl.load(base + ocap, mask=ocap < n, other=float("-inf"))
        select_row(x, ocap.to(tl.int32), x > float("-inf"), K, obase, BLOCK)
        if WITH_STATS:
            tl.store(STATS + row * 2, 0)
            tl.store(STATS + row * 2 + 1, n)
    else:
        NP: tl.constexpr = SB // PIECE
        j = tl.arange(0, SB)
        first = ((j // PIECE).to(tl.int64) * (n - PIECE)) // (NP - 1)  # the last piece ends at n
        xs = tl.load(base + first + j % PIECE)
        ls = xs > float("-inf")
        r = (((K + tl.zeros([], tl.int64)) * rate16 * SB) // (16 * n) + 1).to(tl.int32)
        r = tl.minimum(r, SB)
        sel = select_mask(xs, ls, r)
        thr = tl.min(tl.where(sel, xs, float("inf")), 0)
        # fewer live samples than the rank: the row may hold few candidates, keep every live one
        thr = tl.where(tl.sum(ls.to(tl.int32), 0) < r, float("-inf"), thr)
        bv = BUFV + row.to(tl.int64) * CAP
        bi = BUFI + row.to(tl.int64) * CAP
        offs = tl.arange(0, BLOCK)
        cnt = 0
        for c in range(0, n, BLOCK):
            x = tl.load(base + c + offs, mask=c + offs < n, other=float("-inf"))
            keep = (x > float("-inf")) & (x >= thr)
            slot = cnt + tl.cumsum(keep.to(tl.int32), 0) - 1
            m = keep & (slot < CAP)
            tl.store(bv + slot, x, mask=m)
            tl.store(bi + slot, (c + offs).to(tl.int32), mask=m)
            cnt += tl.sum(keep.to(tl.int32), 0)
        if (cnt <= CAP) & ((cnt >= K) | (thr == float("-inf"))):
            tl.debug_barrier()  # the buffer was written by other threads of this program
            live = ocap < cnt
            xv = tl.load(bv + ocap, mask=live, other=float("-inf"))
            iv = tl.load(bi + ocap, mask=live, other=0)
            select_row(xv, iv, live, K, obase, BLOCK)
            if WITH_STATS:
                tl.store(STATS + row * 2, 1)
        else:
            radix_row(base, obase, n, K, BLOCK)
            if WITH_STATS:
                tl.store(STATS + row * 2, tl.where(cnt < K, 2, 3))
        if WITH_STATS:
            tl.store(STATS + row * 2 + 1, cnt)


def sampled_sizes(Sc: int, topk: int, cuda: bool) -> tuple[int, int, int]:
    """(CAP, SB, PIECE): a buffer of >= 2 k slots, a sample of a sixteenth of a row (1K-4K scores on
    CUDA: enough for the rank estimate, few enough registers for `select_mask`) in pieces of 64."""
    piece = 64 if cuda else 8
    cap = max(2 * piece, triton.next_power_of_2(2 * max(1, topk)))
    lo, hi = (1024, 4096) if cuda else (2 * piece, 64)
    sb = min(hi, max(lo, triton.next_power_of_2(max(1, Sc // 16))))
    return cap, sb, piece


def sampled_topk(scores: torch.Tensor, topk: int, q_lim: int | None = None, out: torch.Tensor | None = None,
                 rate16: int = RATE16, stats: torch.Tensor | None = None) -> torch.Tensor:
    """`radix_topk.radix_topk` (same arguments and rows: `[B, Tc, Sc]` fp32, -inf = not visible ->
    `[B, Tc, topk]` int32 ascending, -1 padded, ties to the later column) by a sampled threshold.
    rate16: candidates aimed at, in sixteenths of topk (tests force the fallback with it).
    stats: optional `[B * Tc, 2]` int32 written per row: (path, count) with path 0 = the row fit the
    register select (count = its visible columns), 1 = the sampled buffer served, 2 = fallback to the
    radix select with count < topk (threshold too high), 3 = fallback with count > the buffer (too
    low); count = the scores at or above the sampled threshold."""
    scores, out = row_topk_args(scores, topk, out)
    B, Tc, Sc = scores.shape
    if B * Tc == 0 or topk == 0:
        return out
    cuda = scores.is_cuda
    cap, sb, piece = sampled_sizes(Sc, topk, cuda)
    bufv = torch.empty(B * Tc, cap, device=scores.device, dtype=torch.float32)
    bufi = torch.empty(B * Tc, cap, device=scores.device, dtype=torch.int32)
    q_lim = Sc if q_lim is None else q_lim
    if stats is not None and (stats.shape != (B * Tc, 2) or stats.dtype != torch.int32 or not stats.is_contiguous()):
        raise ValueError(f"sampled_topk: stats must be a contiguous [{B * Tc}, 2] int32 tensor")
    _sampled_topk_kernel[(B * Tc,)](scores, out, bufv, bufi, stats if stats is not None else out, Tc, Sc, q_lim,
                                    scores.stride(0), scores.stride(1), out.stride(0), out.stride(1), topk, rate16,
                                    CAP=cap, SB=sb, PIECE=piece, BLOCK=2048 if cuda else 64,
                                    WITH_STATS=stats is not None, num_warps=8 if cuda else 1)
    return out
