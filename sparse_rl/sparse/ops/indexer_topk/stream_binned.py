"""Binned streaming indexer top-k for prefill: one byte per score instead of a candidate buffer.

`indexer_topk_binned(q_idx [B, T, H_I, D_I], w [B, T, H_I], k_idx [B, S, D_I], topk)` -> `[B, T, topk]`
int32, ascending, -1 padded: the same keys as `naive.indexer_topk_naive` (forced sinks and window, the
highest scores, among equal scores the later key), like `stream.indexer_topk_stream`.

Why (benchmarks/NOTES.md items 10-11): the buffered stream path spends 5.3 of its 9 ms at 32K in the
sweep that appends candidates (an in-tile prefix sum and scattered stores from the MMA layout) and
3.6 ms in a per-row select; the score dots alone take 0.77 ms. Here the full sweep does no
compaction: each score becomes a one-byte bin code written densely (a plain tile store, like an
attention output), and the per-row work runs over bytes in a 1-D layout. Three kernels per row chunk:

1. `_bins_kernel` (every R-th key tile, `stream.row_threshold`): a threshold `lo` per row aimed at
   TARGET * k keys above it, and the sample's largest score `hi`;
2. `_codes_kernel` (every key tile of the causal rows): code 0 for a key below `lo` or not visible,
   255 for a forced key, else 1 + the linear bin of its score in [lo, hi] (1..`bins` <= 254, clamped);
3. `_select_kernel`, one program per row over its visible codes: a 256-bin histogram gives the bin
   holding the k-th largest key (exact: bins are monotone in the score); the keys of that boundary bin
   (at most CAP) get their scores recomputed (the same dots as the sweep), and the exact radix
   select among them (`radix_topk.select_mask`, later key among equals) decides which of them are
   kept; a last pass writes every key of a higher bin and the kept boundary keys in ascending order.

A row is redone exactly by the split-row decode select (`decode.indexer_topk_decode`, same rule)
when fewer than min(k, visible) keys reached the bins (a threshold the sample put too high) or its
boundary bin holds more than CAP keys (masses of equal scores, e.g. every head weight negative); the
threshold itself only decides speed. Exactness: bins are assigned from the sweep's scores and the
boundary is ordered by recomputed ones; both are `stream.score_tile`'s arithmetic (one dot per head,
fp32 accumulation), so the order is the materialising path's up to the rounding of the tensor-core
instruction shape (the sweep's 64-row tiles against 16-row ones here).

Cost model (L = 32K, 4 x 64 index heads, k = 2048): the sample sweeps read 1/R of the tiles twice;
the code sweep is the score sweep plus ~8 operations and one byte stored per score (0.54 GB at
32K, 8.6 GB at 128K, written once and read twice by the select, mostly from L2 on the second read);
the select does two or three byte passes per row plus a CAP-key recompute. Measured on an H200
(benchmarks/results/2026-12-01-h200-topk-session5.md): exact, but 9.24 ms at 32K and 118.5 ms at 128K
against 9.06 / 79.0 for the buffered stream path; the select is most of it (5.5 / 79 ms: it loaded
the codes one byte per instruction, NOTES item 12), so `triton.indexer_topk`'s "auto" does not take
this path: it is `topk_impl="binned"`. Since then (session 6) the code rows are padded to the
select's step and its steps aligned to it, so the code loads carry no per-key mask: the sm_90a SASS
(Triton 3.9 on the CPU host) loads 8 codes per instruction (`LDG.E.64`, 1,024-code steps over 128
threads) where it loaded one (`LDG.E.U8`), and the per-code position compares are 32-bit (the
histogram step: 85 instructions for 8 codes a thread, was ~124). Timed on the H200 (NOTES item 13):
the select still takes 5.66 / 81.9 ms at 32K / 128K, so the loads were not its bound; what is left per
step is the 256-bin `tl.histogram` (three barriers, eight shared-memory atomics a thread) and, in the
later passes, two prefix sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.radix_topk import _pick_digit, select_mask
from sparse_rl.sparse.ops.indexer_topk.stream import (DZ, NZ, Z0, _common, _kv_start, _redo_rows, _rows,
                                                      row_threshold, score_tile)
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot

CODE_BUDGET_BYTES = 2 << 30  # one byte per (row, key) of a row chunk


@triton.jit
def _bins_kernel(Q, W, KI, KVS, TH, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, stb, stk,
                 T, S, t0, q_offset, sink, window, K, E, E2, dense_keys, NBIN: tl.constexpr,
                 HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                 R: tl.constexpr, NZ: tl.constexpr, Z0: tl.constexpr, DZ: tl.constexpr, PREC: tl.constexpr):
    """Per row of the chunk: TH[0] the candidate threshold (aimed at E * k keys above it), TH[1] bins per
    score unit, TH[2] the bin of score 0 (`[3, B, Tc]` fp32: a key's bin is floor(s * TH[1] + TH[2]),
    one FMA: any monotone map keeps the bins exact). The bins span [TH[0], the score aimed
    at E2 * k keys above it]: higher scores share the top bin, which holds the k-th largest key only
    when the sample was far off. Rows of at most k visible keys take every visible key (threshold -inf)."""
    b, offs_m, tq, mmask, pos, start, first, last, nvis, nf = _rows(KVS, T, S, t0, q_offset, sink, window, BM, BN)
    th, th2, smin, smax = row_threshold(Q, W, KI, b, tq, mmask, pos, start, first, last, nvis, nf, S, sink, window,
                                        K, K, E, E2, dense_keys, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                                        HI, DI, BM, BN, BD, R, NZ, Z0, DZ, PREC, True)
    finite = (th > float("-inf")) & (th < float("inf"))
    lo = tl.where(finite, th, smin)  # threshold -inf (take all): bins from the sample's smallest score
    lo = tl.where(lo < float("inf"), lo, 0.0)  # rows without statistics: one bin
    hi = tl.where((th2 > lo) & (th2 < float("inf")), th2, tl.maximum(smax, lo))
    inv = tl.where((hi > lo) & (hi < float("inf")), NBIN / (hi - lo), 0.0)
    base = TH + b * stb + offs_m
    tl.store(base, th, mask=mmask)
    tl.store(base + stk, inv, mask=mmask)
    tl.store(base + 2 * stk, -lo * inv, mask=mmask)


@triton.jit
def _codes_kernel(Q, W, KI, KVS, TH, CODES, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, stb, stk, scb, sct,
                  T, S, t0, q_offset, sink, window, NBIN: tl.constexpr, FORCED: tl.constexpr,
                  HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                  PREC: tl.constexpr):
    """Every key tile of the query tile's causal range: CODES `[B, Tc, S]` uint8 (see module docstring).
    FORCED: sink + window > 0 (else the forced-key masks are dead code: ~100 fewer integer compares per
    thread and tile in the SASS)."""
    b, offs_m, tq, mmask, pos, start, first, last, nvis, nf = _rows(KVS, T, S, t0, q_offset, sink, window, BM, BN)
    base = TH + b * stb + offs_m
    th = tl.load(base, mask=mmask, other=float("inf"))
    inv = tl.load(base + stk, mask=mmask, other=0.0)
    off = tl.load(base + 2 * stk, mask=mmask, other=0.0)
    crow = CODES + b * scb + offs_m[:, None] * sct
    for n0 in range(first, last + 1, BN):
        s, vis, forced, offs_n = score_tile(Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window,
                                              sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                                              HI, DI, BM, BN, BD, PREC)
        z = tl.minimum(tl.maximum(s * inv[:, None] + off[:, None], 0.0), NBIN - 1.0)
        code = tl.where(vis & (s >= th[:, None]), 1 + z.to(tl.int32), 0)
        if FORCED:
            code = tl.where(forced, 255, code)
        tl.store(crow + offs_n[None, :], code.to(tl.uint8), mask=mmask[:, None] & (offs_n[None, :] < S))


@triton.jit
def _boundary_scores(Q, W, KI, b, tq, kpos, live, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                     HI: tl.constexpr, DI: tl.constexpr, BD: tl.constexpr, CAP: tl.constexpr, PREC: tl.constexpr):
    """Scores `[CAP]` fp32 of query tq against the keys at kpos `[CAP]` (`score_tile`'s arithmetic: one
    dot per head on a 16-row tile holding the query 16 times, fp32 accumulation)."""
    offs_d = tl.arange(0, BD)
    kt = tl.load(KI + b * skb + kpos[None, :] * sks + offs_d[:, None] * skd,
                 mask=live[None, :] & (offs_d[:, None] < DI), other=0.0)  # [BD, CAP]
    rep = tl.zeros([16, 1], tl.int32)
    acc = tl.zeros([16, CAP], tl.float32)
    for j in tl.static_range(HI):
        qj = tl.load(Q + b * sqb + tq * sqt + j * sqh + rep + offs_d[None, :] * sqd,
                     mask=(rep == 0) & (offs_d[None, :] < DI), other=0.0)
        wj = tl.load(W + b * swb + tq * swt + j * swh).to(tl.float32)
        acc += wj * tl.maximum(dot(qj, kt, PREC), 0.0)
    return tl.max(acc, 0)


@triton.jit
def _codes_step(crow, c0, offs, start, end, BLK: tl.constexpr):
    """The codes of keys c0 .. c0 + BLK - 1 `[BLK]` int32, 0 outside [start, end]. c0 is a multiple of BLK
    and the row is padded to a multiple of BLK (`padded_keys`), so the load needs no mask: a mask that
    changes at any key compiled to one byte per load instruction (`LDG.E.U8`, NOTES item 12); the
    visible range is applied after the load (the bytes outside it may be unwritten)."""
    c0 = tl.multiple_of(c0, BLK)
    pos = c0 + offs
    code = tl.load(crow + pos).to(tl.int32)
    return tl.where((pos >= start) & (pos <= end), code, 0)


@triton.jit
def _select_kernel(Q, W, KI, KVS, CODES, BPOS, BVAL, FLAG, OUT, BAD, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                   scb, sct, sbb, sbt, sob, sot, Tc, S, t0, q_offset, K,
                   HI: tl.constexpr, DI: tl.constexpr, BD: tl.constexpr, BLK: tl.constexpr, CAP: tl.constexpr,
                   RB: tl.constexpr, KB: tl.constexpr, PREC: tl.constexpr):
    """One row of the chunk: its top-k from the codes into OUT `[B, Tc, K]`; BAD `[B * Tc]`: 1 where the
    row must be redone, 2 where its boundary bin was recomputed, 0 where whole bins made the top-k.
    BPOS / BVAL / FLAG `[B, Tc, CAP]`: the boundary keys' positions, scores (RB at a time) and kept flags."""
    row = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows first: less tail imbalance
    b = (row // Tc).to(tl.int64)
    t = (row % Tc).to(tl.int64)
    tq = t0 + t
    start = tl.load(KVS + b)
    # the last visible key; int32 (rows < 2^31 keys): the per-code position compares stay 32-bit
    end = tl.minimum(q_offset + tq, S - 1).to(tl.int32)
    nvis = tl.maximum(end - start + 1, 0)
    crow = CODES + b * scb + t * sct
    offs = tl.arange(0, BLK)
    bins = tl.arange(0, 256)
    hist = tl.zeros([256], tl.int32)
    lo = (start // BLK) * BLK  # steps aligned to BLK codes (rows are padded to it): 16-byte loads
    for c0 in range(lo, end + 1, BLK):
        code = _codes_step(crow, c0, offs, start, end, BLK)
        hist += tl.histogram(code, 256)
    hist = tl.where(bins == 0, 0, hist)
    ncand = tl.sum(hist, 0)
    dstar = tl.full([], 1, tl.int32)  # keep codes > dstar and, of the n_eq codes == dstar, `need`
    need = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    if ncand > K:
        d, need, n_eq = _pick_digit(hist, K, tl.zeros([], tl.uint32), 0)
        dstar = d.to(tl.int32)
    partial = (need < n_eq).to(tl.int32)  # else every code == dstar is kept
    bad = (ncand < tl.minimum(K, nvis)) | ((partial != 0) & (n_eq > CAP))
    brow = b * sbb + t * sbt
    if (partial != 0) & (bad == 0):
        run = 0
        for c0 in range(lo, end + 1, BLK):
            code = _codes_step(crow, c0, offs, start, end, BLK)
            eq = code == dstar
            r = run + tl.cumsum(eq.to(tl.int32), 0) - 1
            tl.store(BPOS + brow + r, c0 + offs, mask=eq)
            run += tl.sum(eq.to(tl.int32), 0)
        tl.debug_barrier()  # the positions, written by other threads of this program
        for j0 in range(0, n_eq, RB):
            slot = j0 + tl.arange(0, RB)
            live = slot < n_eq
            kpos = tl.load(BPOS + brow + slot, mask=live, other=0)
            x = _boundary_scores(Q, W, KI, b, tq, kpos, live, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                                 HI, DI, BD, RB, PREC)
            tl.store(BVAL + brow + slot, x, mask=live)
        tl.debug_barrier()
        slot = tl.arange(0, CAP)
        live = slot < n_eq
        keep = select_mask(tl.load(BVAL + brow + slot, mask=live, other=0.0), live, need)
        tl.store(FLAG + brow + slot, keep.to(tl.uint8), mask=live)
        tl.debug_barrier()
    orow = OUT + b * sob + t * sot
    cnt = 0
    if bad == 0:
        lim = tl.where(partial != 0, n_eq, 0)  # boundary ranks below lim are kept by their flag, above all kept
        run = 0
        for c0 in range(lo, end + 1, BLK):
            code = _codes_step(crow, c0, offs, start, end, BLK)
            eq = code == dstar
            r = run + tl.cumsum(eq.to(tl.int32), 0) - 1
            run += tl.sum(eq.to(tl.int32), 0)
            kept = tl.load(FLAG + brow + r, mask=eq & (r < lim), other=0) != 0
            sel = (code > dstar) | (eq & (kept | (r >= lim)))
            slot = cnt + tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.store(orow + slot, (c0 + offs).to(tl.int32), mask=sel)
            cnt += tl.sum(sel.to(tl.int32), 0)
        for c in range(cnt, K, KB):
            o = c + tl.arange(0, KB)
            tl.store(orow + o, tl.full([KB], -1, tl.int32), mask=o < K)
    tl.store(BAD + row, tl.where(bad, 1, 2 * partial))


@dataclass(frozen=True)
class BinnedConfig:
    """Launch shapes of the three kernels (the stream path's shapes where they are the same work)."""
    block_m: int = 64  # queries per program (statistics and code sweep)
    block_n: int = 128  # keys per tile of the code sweep
    stats_block_n: int = 64  # keys per tile of the statistics sweeps
    # the statistics read every R-th key tile (and every tile where a query tile's key range is shorter than
    # dense_keys): a count 2x off only widens the bins, so a sparser sample than the stream path's will do
    sample_stride: int = 16
    dense_keys: int = 0
    target: float = 2.0  # keys above the threshold, in units of k: the bins cost the same whatever it is
    target_hi: float = 0.5  # keys above the top bin's floor, in units of k
    warps: int = 8
    select_block: int = 1024  # codes per step of the per-row select (80 registers at 4 warps in the SASS; 2048: 215)
    select_warps: int = 4
    cap: int = 256  # boundary keys recomputed per row (more: the row is redone), a power of two
    bins: int = 254  # score bins, codes 1..bins (at most 254; 0: not a candidate, 255: forced)


INTERPRET_BINNED = BinnedConfig(block_m=16, block_n=16, stats_block_n=16, sample_stride=2, dense_keys=0, warps=1,
                                select_block=16, select_warps=1, cap=16, bins=8)


def padded_keys(S: int, cfg: BinnedConfig) -> int:
    """Code-row length: S rounded up to the select's step, so its aligned steps never leave the buffer."""
    return triton.cdiv(S, cfg.select_block) * cfg.select_block


def _chunk_kernels(q_idx, w, k_idx, kvs, t0, t1, q_offset, sink, window, topk, codes, th, bpos, bval, flag, bad,
                   out, cfg: BinnedConfig):
    """Bins, codes and select for rows t0..t1-1 into out `[B, t1 - t0, topk]`; bad `[B * (t1 - t0)]`."""
    B, S = q_idx.shape[0], k_idx.shape[1]
    args, strides, meta = _common(q_idx, w, k_idx, kvs)
    stages = 2 if q_idx.is_cuda else 1
    grid = (triton.cdiv(t1 - t0, cfg.block_m), B)
    _bins_kernel[grid](*args, th, *strides, th.stride(1), th.stride(0), t1, S, t0, q_offset, sink, window, topk,
                       cfg.target, cfg.target_hi, cfg.dense_keys, NBIN=cfg.bins, BM=cfg.block_m, BN=cfg.stats_block_n, R=cfg.sample_stride,
                       NZ=NZ, Z0=Z0, DZ=DZ, **meta, num_warps=cfg.warps, num_stages=stages)
    _codes_kernel[grid](*args, th, codes, *strides, th.stride(1), th.stride(0), codes.stride(0), codes.stride(1),
                        t1, S, t0, q_offset, sink, window, NBIN=cfg.bins, FORCED=sink + window > 0, BM=cfg.block_m, BN=cfg.block_n, **meta,
                        num_warps=cfg.warps, num_stages=stages)
    Tc = t1 - t0
    _select_kernel[(B * Tc,)](*args[:3], kvs, codes, bpos, bval, flag, out, bad, *strides, codes.stride(0),
                              codes.stride(1), bpos.stride(0), bpos.stride(1), out.stride(0), out.stride(1), Tc, S,
                              t0, q_offset, topk, BLK=cfg.select_block, CAP=cfg.cap, RB=min(64, cfg.cap),
                              KB=min(1024, triton.next_power_of_2(topk)), **meta, num_warps=cfg.select_warps)


@torch.no_grad()
def indexer_topk_binned(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, topk: int, *, q_offset: int = 0,
                        sink: int = 0, window: int = 0, kv_start: torch.Tensor | None = None,
                        budget_bytes: int | None = None, config: BinnedConfig | None = None,
                        info: dict | None = None) -> torch.Tensor:
    """See the module docstring. q_idx `[B, T, H_I, D_I]`, w `[B, T, H_I]`, k_idx `[B, S, D_I]` (T, S >= 1,
    supported dtypes: the caller, `triton.indexer_topk`, checks) -> `[B, T, topk]` int32. `budget_bytes`:
    the code buffer of a row chunk (default CODE_BUDGET_BYTES on CUDA); `config`: launch shapes (default
    `BinnedConfig()` on CUDA, `INTERPRET_BINNED` under the interpreter); `info`, when given, receives the
    number of rows redone exactly and of rows whose boundary bin was recomputed (costs a sync)."""
    B, T = q_idx.shape[:2]
    S = k_idx.shape[1]
    dev = q_idx.device
    cfg = config or (BinnedConfig() if q_idx.is_cuda else INTERPRET_BINNED)
    kvs = _kv_start(kv_start, B, dev)
    budget = budget_bytes or (CODE_BUDGET_BYTES if q_idx.is_cuda else 1 << 20)
    BM = cfg.block_m
    S_pad = padded_keys(S, cfg)
    chunk = max(BM, min(T, budget // (B * S_pad), (2**31 - 1) // S_pad) // BM * BM)  # int32 offsets in a batch row
    rows = min(T, chunk)
    codes = torch.empty(B, rows, S_pad, device=dev, dtype=torch.uint8)
    th = torch.empty(3, B, rows, device=dev, dtype=torch.float32)
    bpos = torch.empty(B, rows, cfg.cap, device=dev, dtype=torch.int32)
    bval = torch.empty(B, rows, cfg.cap, device=dev, dtype=torch.float32)
    flag = torch.empty(B, rows, cfg.cap, device=dev, dtype=torch.uint8)
    bad = torch.empty(B * rows, device=dev, dtype=torch.int32)
    out = torch.empty(B, T, topk, dtype=torch.int32, device=dev)
    redone, boundary = 0, 0
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        _chunk_kernels(q_idx, w, k_idx, kvs, t0, t1, q_offset, sink, window, topk, codes, th, bpos, bval, flag,
                       bad, out[:, t0:t1], cfg)
        status = bad[:B * (t1 - t0)].view(B, t1 - t0)
        flagged = status == 1
        if info is not None:
            boundary += int((status == 2).sum())
        if bool(flagged.any()):
            redone += int(flagged.sum())
            _redo_rows(q_idx, w, k_idx, kvs, flagged, t0, q_offset, topk, sink, window, out)
    if info is not None:
        info.update(redone_rows=redone, boundary_rows=boundary)
    return out
