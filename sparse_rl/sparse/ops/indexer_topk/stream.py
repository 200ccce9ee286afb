"""Streaming indexer top-k for prefill: scores are computed tile by tile and reduced to each row's
top-k without a `[T, S]` score tensor in memory.

`indexer_topk_stream(q_idx [B, T, H_I, D_I], w [B, T, H_I], k_idx [B, S, D_I], topk)` -> `[B, T, topk]`
int32, ascending, -1 padded: the same keys as `naive.indexer_topk_naive` (forced sinks and window, the
highest scores, among equal scores the later key).

Why: the materialising path writes `[T, S/2]` fp32 scores and selects per row in several passes
over them (143 ms for the top-k at 128K on an H200 against 22 ms for the scores; benchmarks/NOTES.md
item 9). Here a program owns `BM` consecutive queries and streams the key tiles (one small
tensor-core dot per index head, ReLU, head-weighted sum in registers), in three sweeps over the rows'
visible keys, in two kernels:

1. `_threshold_kernel`, every `R`-th key tile (a strided sample): per-row mean and variance of the
   scores (Chan's merge of tile moments, stable for any offset); then, on the same sample, per-row
   counts above `NZ` thresholds `mean + sd * z_j` (a z grid); the threshold `th` is interpolated
   (log-linear in the count) where the sample predicts `TARGET * k` keys above it;
2. `_gather_kernel`, every key tile: the keys with score >= th (and the forced keys, as +inf) are
   appended, in key order, to a per-row buffer of `C` slots (value, position); the slot is a
   running count plus an in-tile prefix sum.

A row whose visible keys fit the buffer takes all of them (no statistics needed). Then one program
per row (`_select_kernel`) loads its buffer into registers and selects exactly
(`radix_topk.select_row`: four 8-bit radix levels on the order-preserving key, the later entry among
equals, ascending output). The buffer holds every key >= th, so when it holds at least
min(k, visible) entries it contains the exact top-k whatever the threshold was: the statistics only
decide speed. A row whose buffer overflowed or came out short (a threshold the sample mispredicted,
or masses of equal scores: a row whose head weights are all negative scores 0 on every key where
all heads' dots are negative) is flagged and redone exactly by the split-row decode select
(`decode.indexer_topk_decode`, same rule); that costs one host sync per row chunk.

Cost (L = 128K, H_I x D_I = 4 x 64, k = 2048): the score dots are 4.4 TFLOP (causal half), 10.9 ms
streamed (403 TFLOP/s, `indexer_row_max`); the sweeps do 1 + 2/R of them plus the append; the
buffers take ~TARGET * k * 8 bytes a row (3 GB) against the 34 GB of fp32 scores the materialising
path writes and re-reads. Measured (run 1, one fused sweep kernel): 83 ms against 143 ms for the
materialising path; where the time goes and what changed since is in benchmarks/NOTES.md item 9.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.radix_topk import select_row
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot, dot_precision

Z0, DZ, NZ = -2.0, 0.5, 16  # z grid of the threshold search: -2 sd .. +5.5 sd around the mean
TARGET = 1.5  # the threshold aims at TARGET * k keys above it (the sample's error stays well inside 2x)
BUFFER_BUDGET_BYTES = 1 << 30


@triton.jit
def load_queries(Q, W, b, tq, mmask, sqb, sqt, sqh, sqd, swb, swt, swh, HI: tl.constexpr, DI: tl.constexpr,
                 BD: tl.constexpr):
    """The BM query rows tq of every index head, as tuples of HI `[BM, BD]` query tiles and HI `[BM]` fp32 head
    weights, for `score_tile_q`. A sweep whose loop also stores (the gathers) loads them once before it: Triton's
    loop-invariant code motion hoists loads only out of store-free loops (sm_90a TTGIR, Triton 3.6: the row-max
    sweep's q tiles sit in shared memory once, the words gather re-copied all HI of them at every key tile, 4x the
    key tile's bytes)."""
    offs_d = tl.arange(0, BD)
    qs = ()
    ws = ()
    for j in tl.static_range(HI):
        qs = qs + (tl.load(Q + b * sqb + tq[:, None] * sqt + j * sqh + offs_d[None, :] * sqd,
                           mask=mmask[:, None] & (offs_d[None, :] < DI), other=0.0),)
        ws = ws + (tl.load(W + b * swb + tq * swt + j * swh, mask=mmask, other=0.0).to(tl.float32),)
    return qs, ws


@triton.jit
def score_tile_q(qs, ws, KI, b, mmask, pos, start, n0, S, sink, window, skb, sks, skd,
                 HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                 PREC: tl.constexpr):
    """`score_tile` on queries loaded by `load_queries`: scores `[BM, BN]` fp32 of keys n0..n0+BN-1, with
    (visible, forced) masks."""
    offs_n = n0 + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    kt = tl.load(KI + b * skb + offs_n[None, :] * sks + offs_d[:, None] * skd,
                 mask=(offs_n[None, :] < S) & (offs_d[:, None] < DI), other=0.0)  # [BD, BN]
    acc = tl.zeros([BM, BN], tl.float32)
    for j in tl.static_range(HI):
        acc += ws[j][:, None] * tl.maximum(dot(qs[j], kt, PREC), 0.0)
    s = offs_n[None, :]
    vis = (s <= pos[:, None]) & (s >= start) & mmask[:, None] & (s < S)
    forced = vis & ((s < start + sink) | (s > pos[:, None] - window))
    return acc, vis, forced, offs_n


@triton.jit
def score_tile(Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window,
               sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
               HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
               PREC: tl.constexpr):
    """Scores `[BM, BN]` fp32 of queries tq against keys n0..n0+BN-1, with (visible, forced) masks (the queries
    loaded at every call: see `load_queries`)."""
    qs, ws = load_queries(Q, W, b, tq, mmask, sqb, sqt, sqh, sqd, swb, swt, swh, HI, DI, BD)
    return score_tile_q(qs, ws, KI, b, mmask, pos, start, n0, S, sink, window, skb, sks, skd, HI, DI, BM, BN, BD,
                        PREC)


@triton.jit
def _rows(KVS, T, S, t0, q_offset, sink, window, BM: tl.constexpr, BN: tl.constexpr):
    """This program's rows of the chunk (the longest first: less tail imbalance) and their key range:
    (pm, b, offs_m, tq, mmask, pos, start, first key tile, last key, visible, forced count)."""
    pm = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = pm * BM + tl.arange(0, BM)  # row in the chunk
    tq = t0 + offs_m
    mmask = tq < T
    start = tl.load(KVS + b)
    pos = q_offset + tq
    last = tl.minimum(q_offset + tl.minimum(t0 + pm * BM + BM, T) - 1, S - 1)  # last key any row sees
    first = (start // BN) * BN
    nvis = tl.where(mmask, tl.maximum(tl.minimum(pos, S - 1) - start + 1, 0), 0)
    nf = tl.minimum(nvis, sink + window)  # forced keys: the first `sink` and last `window` visible
    return b, offs_m, tq, mmask, pos, start, first, last, nvis, nf


@triton.jit
def row_threshold(Q, W, KI, b, tq, mmask, pos, start, first, last, nvis, nf, S, sink, window, K, LIM, E, E2, dense_keys,
                  sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                  HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                  R: tl.constexpr, NZ: tl.constexpr, Z0: tl.constexpr, DZ: tl.constexpr, PREC: tl.constexpr,
                  RANGE: tl.constexpr):
    """Sweeps 1 and 2 over every R-th key tile (every tile where the program's key range is shorter
    than `dense_keys`) for the rows of one query tile. Returns th `[BM]`, the threshold aimed at
    E * (k - forced) keys above it (-inf for rows of at most LIM visible keys: take them all; +inf where
    the forced keys fill the budget) and, with RANGE, the one aimed at E2 * (k - forced) and the smallest
    and largest sampled non-forced score of each row (zeros otherwise)."""
    kk = K - nf  # finite keys still to choose
    nu = nvis - nf
    th = tl.full([BM], float("-inf"), tl.float32)
    th2 = tl.zeros([BM], tl.float32)
    smin = tl.zeros([BM], tl.float32)
    smax = tl.zeros([BM], tl.float32)
    stats = (nvis > LIM) & (kk > 0)
    if tl.max(stats.to(tl.int32), 0) > 0:
        step = BN * R
        if last - first < dense_keys:
            step = BN
        # sweep 1: moments of the sampled tiles (tile mean / M2 merged as in Chan et al.)
        ns = tl.zeros([BM], tl.float32)
        mean = tl.zeros([BM], tl.float32)
        m2 = tl.zeros([BM], tl.float32)
        if RANGE:
            smin = tl.full([BM], float("inf"), tl.float32)
            smax = tl.full([BM], float("-inf"), tl.float32)
        for n0 in range(first, last + 1, step):
            s, vis, forced, offs_n = score_tile(Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window,
                                                  sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                                                  HI, DI, BM, BN, BD, PREC)
            fin = vis & ~forced
            nt = tl.sum(fin.to(tl.float32), 1)
            mt = tl.sum(tl.where(fin, s, 0.0), 1) / tl.maximum(nt, 1.0)
            m2t = tl.sum(tl.where(fin, (s - mt[:, None]) * (s - mt[:, None]), 0.0), 1)
            tot = tl.maximum(ns + nt, 1.0)
            delta = mt - mean
            mean += delta * nt / tot
            m2 += m2t + delta * delta * ns * nt / tot
            ns += nt
            if RANGE:
                smin = tl.minimum(smin, tl.min(tl.where(fin, s, float("inf")), 1))
                smax = tl.maximum(smax, tl.max(tl.where(fin, s, float("-inf")), 1))
        sd = tl.sqrt(m2 / tl.maximum(ns, 1.0))
        # sweep 2: sample counts above the z grid
        zc = tl.arange(0, NZ)
        cnt = tl.zeros([BM, NZ], tl.float32)
        for n0 in range(first, last + 1, step):
            s, vis, forced, offs_n = score_tile(Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window,
                                                  sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                                                  HI, DI, BM, BN, BD, PREC)
            fin = vis & ~forced
            for j in tl.static_range(NZ):
                thj = mean + sd * (Z0 + j * DZ)
                cj = tl.sum((fin & (s >= thj[:, None])).to(tl.float32), 1)
                cnt += tl.where(zc[None, :] == j, cj[:, None], 0.0)
        scale = kk.to(tl.float32) * ns / tl.maximum(nu.to(tl.float32), 1.0)  # k - forced, in sampled keys
        th = tl.where(stats, _grid_threshold(cnt, E * scale, mean, sd, ns, NZ, Z0, DZ), th)
        if RANGE:
            th2 = tl.where(stats, _grid_threshold(cnt, E2 * scale, mean, sd, ns, NZ, Z0, DZ), th2)
    th = tl.where(kk > 0, th, float("inf"))  # the forced keys fill the budget
    return th, th2, smin, smax


@triton.jit
def _grid_threshold(cnt, target, mean, sd, ns, NZ: tl.constexpr, Z0: tl.constexpr, DZ: tl.constexpr):
    """The score with `target [BM]` sampled keys above it, from the counts cnt `[BM, NZ]` above the z
    grid: the grid point just below the target count and the one above, interpolated in log count
    (-inf where even the lowest grid point has fewer)."""
    zc = tl.arange(0, NZ)
    ja = tl.sum((cnt >= target[:, None]).to(tl.int32), 1) - 1
    jb = tl.minimum(ja + 1, NZ - 1)
    ca = tl.sum(tl.where(zc[None, :] == ja[:, None], cnt, 0.0), 1)
    cb = tl.maximum(tl.sum(tl.where(zc[None, :] == jb[:, None], cnt, 0.0), 1), 0.5)
    frac = tl.where((jb > ja) & (ca > cb), tl.log(ca / target) / tl.log(ca / cb), 0.0)
    z = Z0 + (ja.to(tl.float32) + tl.minimum(tl.maximum(frac, 0.0), 1.0)) * DZ
    return tl.where((ja >= 0) & (ns > 0), mean + sd * z, float("-inf"))


@triton.jit
def _threshold_kernel(Q, W, KI, KVS, TH, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, stb,
                      T, S, t0, q_offset, sink, window, K, C, E,
                      HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                      R: tl.constexpr, NZ: tl.constexpr, Z0: tl.constexpr, DZ: tl.constexpr, PREC: tl.constexpr):
    """Each row's threshold TH `[B, Tc]` (`row_threshold`; rows whose visible keys fit the buffer of C
    slots take them all)."""
    b, offs_m, tq, mmask, pos, start, first, last, nvis, nf = _rows(KVS, T, S, t0, q_offset, sink, window, BM, BN)
    th, th2, smin, smax = row_threshold(Q, W, KI, b, tq, mmask, pos, start, first, last, nvis, nf, S, sink, window,
                                        K, C, E, 0.0, 0, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                                        HI, DI, BM, BN, BD, R, NZ, Z0, DZ, PREC, False)
    tl.store(TH + b * stb + offs_m, th, mask=mmask)


@triton.jit
def _gather_kernel(Q, W, KI, KVS, TH, VAL, IDX, NROW, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, svb, svt, snb,
                   T, S, t0, q_offset, sink, window, K, C,
                   HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                   DOT_SCAN: tl.constexpr, PREC: tl.constexpr):
    """Sweep 3 over every key tile: the keys scoring >= TH and the forced ones (as +inf) appended in key
    order to VAL/IDX `[B, Tc, C]`; entry counts NROW `[B, Tc]` (-1: overflowed or short, redo the row).
    NROW and TH share the stride snb. A kernel of its own: the statistics sweeps' registers made this
    loop spill (seen in the SASS)."""
    b, offs_m, tq, mmask, pos, start, first, last, nvis, nf = _rows(KVS, T, S, t0, q_offset, sink, window, BM, BN)
    th = tl.load(TH + b * snb + offs_m, mask=mmask, other=float("inf"))
    run = tl.zeros([BM], tl.int32)
    if DOT_SCAN:
        tri = (tl.arange(0, BN)[:, None] <= tl.arange(0, BN)[None, :]).to(tl.float16)  # inclusive prefix
    for n0 in range(first, last + 1, BN):
        s, vis, forced, offs_n = score_tile(Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window,
                                              sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                                              HI, DI, BM, BN, BD, PREC)
        cand = vis & (forced | (s >= th[:, None]))
        if DOT_SCAN:  # the in-tile prefix sum on the tensor cores: 0/1 x triangular ones, exact in fp32
            if PREC == 2:
                pre = tl.dot(cand.to(tl.float32), tri.to(tl.float32)).to(tl.int32)
            else:
                pre = tl.dot(cand.to(tl.float16), tri).to(tl.int32)
        else:
            pre = tl.cumsum(cand.to(tl.int32), 1)
        slot = run[:, None] + pre - 1
        ok = cand & (slot < C)
        # int32 offsets from the batch row's base (the chunk's buffer is < 2^31 entries)
        off = offs_m[:, None] * svt + slot
        tl.store(VAL + b * svb + off, tl.where(forced, float("inf"), s), mask=ok)
        tl.store(IDX + b * svb + off, tl.broadcast_to(offs_n[None, :], [BM, BN]), mask=ok)
        run += tl.sum(cand.to(tl.int32), 1)
    good = (run >= tl.minimum(nvis, K)) & (run <= C)
    tl.store(NROW + b * snb + offs_m, tl.where(good, run, -1), mask=mmask)


@triton.jit
def _row_max_kernel(Q, W, KI, KVS, RMAX, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, snb, T, S, q_offset,
                    HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                    PREC: tl.constexpr):
    """The score sweep alone: each row's largest visible score RMAX `[B, T]`."""
    b, offs_m, tq, mmask, pos, start, first, last, nvis, nf = _rows(KVS, T, S, 0, q_offset, 0, 0, BM, BN)
    mx = tl.full([BM], float("-inf"), tl.float32)
    for n0 in range(first, last + 1, BN):
        s, vis, forced, offs_n = score_tile(Q, W, KI, b, tq, mmask, pos, start, n0, S, 0, 0,
                                              sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                                              HI, DI, BM, BN, BD, PREC)
        mx = tl.maximum(mx, tl.max(tl.where(vis, s, float("-inf")), 1))
    tl.store(RMAX + b * snb + offs_m, mx, mask=mmask)


@triton.jit
def _select_kernel(VAL, IDX, NROW, OUT, Tc, svb, svt, snb, sob, sot, K, CB: tl.constexpr, KB: tl.constexpr):
    row = tl.program_id(0)
    b = (row // Tc).to(tl.int64)
    t = (row % Tc).to(tl.int64)
    n = tl.load(NROW + b * snb + t)
    if n >= 0:
        offs = tl.arange(0, CB)
        live = offs < n
        x = tl.load(VAL + b * svb + t * svt + offs, mask=live, other=float("-inf"))
        idx = tl.load(IDX + b * svb + t * svt + offs, mask=live, other=0)
        select_row(x, idx, live, K, OUT + b * sob + t * sot, KB)


@dataclass(frozen=True)
class StreamConfig:
    """Launch shapes, chosen from the SASS (Triton 3.9, sm_90a, compiled on the CPU host): the
    statistics kernel spills at 128-key tiles (255 registers + 192 B of stack) and not at 64; the
    gather kernel fits 128-key tiles (255 registers, no stack; 64: 194), and fewer tiles mean fewer
    per-tile reductions and barriers (the fused run-1 kernel: 9.25 ms at 128, 9.45 at 64)."""
    block_m: int = 64  # queries per program (both sweeps)
    block_n: int = 128  # keys per tile of the gather sweep
    stats_block_n: int = 64  # keys per tile of the statistics sweeps
    sample_stride: int = 8  # the statistics read every R-th key tile
    warps: int = 8
    select_warps: int = 8
    dot_scan: bool = False  # in-tile prefix sum by a triangular matmul instead of tl.cumsum
    target: float = TARGET


INTERPRET_CONFIG = StreamConfig(block_m=16, block_n=16, stats_block_n=16, sample_stride=2, warps=1, select_warps=1)


def stream_buffer_slots(topk: int) -> int:
    """Buffer slots per row: twice the budget (the threshold aims at 1.5x), a power of two."""
    return triton.next_power_of_2(max(16, 2 * topk))


def _common(q_idx, w, k_idx, kvs):
    """Tensors and strides every sweep takes first, and the score dims as constexprs."""
    HI, DI = q_idx.shape[2:]
    args = (q_idx, w, k_idx, kvs)
    strides = (*q_idx.stride(), *w.stride(), *k_idx.stride())
    meta = dict(HI=HI, DI=DI, BD=max(16, triton.next_power_of_2(DI)), PREC=dot_precision(q_idx.dtype))
    return args, strides, meta


def _sweeps(q_idx, w, k_idx, kvs, t0, t1, q_offset, sink, window, topk, val, idx, nrow, th, cfg: StreamConfig):
    """Threshold then gather for rows t0..t1-1: fills val/idx `[B, Tc, C]`, nrow `[B, Tc]` (th is scratch)."""
    B, S, C = q_idx.shape[0], k_idx.shape[1], val.shape[2]
    args, strides, meta = _common(q_idx, w, k_idx, kvs)
    stages = 1 if not q_idx.is_cuda else 2
    _threshold_kernel[(triton.cdiv(t1 - t0, cfg.block_m), B)](
        *args, th, *strides, th.stride(0), t1, S, t0, q_offset, sink, window, topk, C, cfg.target,
        BM=cfg.block_m, BN=cfg.stats_block_n, R=cfg.sample_stride, NZ=NZ, Z0=Z0, DZ=DZ, **meta,
        num_warps=cfg.warps, num_stages=stages)
    _gather_kernel[(triton.cdiv(t1 - t0, cfg.block_m), B)](
        *args, th, val, idx, nrow, *strides, val.stride(0), val.stride(1), nrow.stride(0), t1, S, t0, q_offset,
        sink, window, topk, C, BM=cfg.block_m, BN=cfg.block_n, DOT_SCAN=cfg.dot_scan, **meta,
        num_warps=cfg.warps, num_stages=stages)


def _select(val, idx, nrow, out, topk, cfg: StreamConfig):
    """One program per row: the exact top-k of its buffer into out `[B, Tc, topk]` (rows with nrow < 0 skipped)."""
    B, Tc = out.shape[:2]
    CB = triton.next_power_of_2(val.shape[2])
    _select_kernel[(B * Tc,)](val, idx, nrow, out, Tc, val.stride(0), val.stride(1), nrow.stride(0), out.stride(0),
                              out.stride(1), topk, CB=CB, KB=min(1024, CB), num_warps=cfg.select_warps)


def decode_rows(q_idx, w, k_idx, kvs, b: int, tt, pos, topk, sink, window) -> torch.Tensor:
    """The split-row decode select's exact rows `[n, topk]` of the queries tt `[n]` of batch row b at positions pos
    `[n]` int32, against that row's keys (k_idx with a unit last stride, broadcast: stride 0) from kvs[b] on."""
    from sparse_rl.sparse.ops.indexer_topk.decode import indexer_topk_decode

    kb = k_idx[b:b + 1].expand(len(tt), *k_idx.shape[1:])
    st = kvs[b].expand(len(tt)).contiguous()
    return indexer_topk_decode(q_idx[b, tt], w[b, tt], kb, pos, topk, sink=sink, window=window, kv_start=st)


def _redo_rows(q_idx, w, k_idx, kvs, bad, t0, q_offset, topk, sink, window, out, group: int = 512, rows=None):
    """Exact selection, by the split-row decode select, of the flagged rows bad `[B, Tc]` of the chunk (rows: their
    `bad.nonzero()`, when the caller has it)."""
    if k_idx.stride(-1) != 1:
        k_idx = k_idx.contiguous()
    for b, t in _groups(bad.nonzero() if rows is None else rows, group, bad.shape[0]):
        tt = t + t0
        out[b, tt] = decode_rows(q_idx, w, k_idx, kvs, b, tt, (tt + q_offset).to(torch.int32), topk, sink, window)


def _groups(rows: torch.Tensor, group: int, B: int):
    """(b, t-tensor) groups of at most `group` flagged rows `[n, 2]` sharing a batch row. With one batch row no
    host sync beyond the one nonzero already paid (its length)."""
    for b in range(1) if B == 1 else rows[:, 0].unique().tolist():
        t = rows[:, 1] if B == 1 else rows[rows[:, 0] == b, 1]
        for i in range(0, len(t), group):
            yield b, t[i:i + group]


def _kv_start(kv_start, B, dev):
    return (torch.zeros(B, dtype=torch.int32, device=dev) if kv_start is None
            else torch.as_tensor(kv_start, device=dev).to(torch.int32).reshape(B))


@torch.no_grad()
def indexer_topk_stream(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, topk: int, *, q_offset: int = 0,
                        sink: int = 0, window: int = 0, kv_start: torch.Tensor | None = None,
                        budget_bytes: int | None = None, slots: int | None = None, config: StreamConfig | None = None,
                        info: dict | None = None) -> torch.Tensor:
    """See the module docstring. q_idx `[B, T, H_I, D_I]`, w `[B, T, H_I]`, k_idx `[B, S, D_I]` (T, S >= 1,
    supported dtypes: the caller, `triton.indexer_topk`, checks) -> `[B, T, topk]` int32. `slots`: buffer
    entries per row (default `stream_buffer_slots(topk)`); `config`: launch shapes (default
    `StreamConfig()` on CUDA, `INTERPRET_CONFIG` under the interpreter); `info`, when given, receives the
    mean buffer entries per row and the number of rows redone exactly (costs a sync)."""
    B, T = q_idx.shape[:2]
    dev = q_idx.device
    cfg = config or (StreamConfig() if q_idx.is_cuda else INTERPRET_CONFIG)
    C = slots or stream_buffer_slots(topk)
    kvs = _kv_start(kv_start, B, dev)
    budget = budget_bytes or (BUFFER_BUDGET_BYTES if q_idx.is_cuda else 1 << 22)
    BM = cfg.block_m
    chunk = max(BM, min(T, budget // (8 * B * C)) // BM * BM)
    rows = min(T, chunk)
    val = torch.empty(B, rows, C, device=dev, dtype=torch.float32)
    idx = torch.empty(B, rows, C, device=dev, dtype=torch.int32)
    small = torch.empty(2, B, rows, device=dev, dtype=torch.int32)  # entry counts, thresholds (fp32 bits)
    nrow, th = small[0], small[1].view(torch.float32)
    out = torch.empty(B, T, topk, dtype=torch.int32, device=dev)
    entries, redone = 0, 0
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        _sweeps(q_idx, w, k_idx, kvs, t0, t1, q_offset, sink, window, topk, val, idx, nrow, th, cfg)
        _select(val, idx, nrow, out[:, t0:t1], topk, cfg)
        bad = nrow[:, :t1 - t0] < 0
        if info is not None:
            entries += int(nrow[:, :t1 - t0].clamp(min=0).sum())
        if bool(bad.any()):
            redone += int(bad.sum())
            _redo_rows(q_idx, w, k_idx, kvs, bad, t0, q_offset, topk, sink, window, out)
    if info is not None:
        info.update(mean_entries=entries / max(1, B * T - redone), redone_rows=redone, slots=C)
    return out


def indexer_row_max(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, *, q_offset: int = 0,
                    kv_start: torch.Tensor | None = None, config: StreamConfig | None = None) -> torch.Tensor:
    """Each query's largest visible index score `[B, T]` fp32, by the same streaming sweep with no
    selection: the time of the score dots alone, which the streaming top-k is measured against."""
    B, T = q_idx.shape[:2]
    cfg = config or (StreamConfig() if q_idx.is_cuda else INTERPRET_CONFIG)
    rmax = torch.empty(B, T, device=q_idx.device, dtype=torch.float32)
    args, strides, meta = _common(q_idx, w, k_idx, _kv_start(kv_start, B, q_idx.device))
    _row_max_kernel[(triton.cdiv(T, cfg.block_m), B)](*args, rmax, *strides, rmax.stride(0), T, k_idx.shape[1],
                                                      q_offset, BM=cfg.block_m, BN=cfg.block_n, **meta,
                                                      num_warps=cfg.warps, num_stages=2 if q_idx.is_cuda else 1)
    return rmax
