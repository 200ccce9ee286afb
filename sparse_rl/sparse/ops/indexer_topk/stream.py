"""Streaming indexer top-k for prefill: scores are computed tile by tile and reduced to each row's
top-k without a `[T, S]` score tensor in memory.

`indexer_topk_stream(q_idx [B, T, H_I, D_I], w [B, T, H_I], k_idx [B, S, D_I], topk)` -> `[B, T, topk]`
int32, ascending, -1 padded: the same keys as `naive.indexer_topk_naive` (forced sinks and window, the
highest scores, among equal scores the later key).

Why: the materialising path writes `[T, S/2]` fp32 scores and selects per row in several passes
over them (191 ms at 128K on an H200 against 22 ms for the scores; benchmarks/NOTES.md). Here one
program owns `BM` consecutive queries, keeps their index-query tiles on chip and streams the key
tiles (one small tensor-core dot per index head, ReLU, head-weighted sum in registers), in three
sweeps over the row's visible keys:

1. every `R`-th key tile (a strided sample): per-row mean and variance of the scores (Chan's merge of
   tile moments, stable for any offset);
2. the same sample: per-row counts above `NZ` thresholds `mean + sd * z_j` (a z grid); the threshold
   `th` is interpolated (log-linear in the count) where the sample predicts `E * k` keys above it;
3. every key tile: the keys with score >= th (and the forced keys, as +inf) are appended, in key
   order, to a per-row buffer of `C` slots (value, position); the slot is a running count plus an
   in-tile prefix sum.

A row whose visible keys fit the buffer takes all of them (no statistics needed). Then one program
per row loads its buffer into registers and selects exactly (`radix_topk.select_row`: four 8-bit
radix levels on the order-preserving key, the later entry among equals, ascending output).
The buffer holds every key >= th, so when it holds at least min(k, visible) entries it contains the
exact top-k whatever the threshold was: the statistics only decide speed. A row whose buffer
overflowed or came out short (a threshold the sample mispredicted, e.g. masses of equal scores) is
flagged and redone exactly by the split-row decode select (`decode.indexer_topk_decode`, same
rule); that costs one host sync per row chunk.

Cost model (L = 128K, H_I x D_I = 4 x 64): the score dots are 4.4 TFLOP (causal half); the sweeps do
1 + 2/R of them; the buffers take ~E*k*8 bytes a row (4 GB) against the 34 GB of fp32 scores the
materialising path writes and re-reads five times.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.radix_topk import select_row
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot, dot_precision

Z0, DZ, NZ = -2.0, 0.5, 16  # z grid of the threshold search: -2 sd .. +5.5 sd around the mean
TARGET = 1.5  # the threshold aims at TARGET * k keys above it (the sample's error stays well inside 2x)
BUFFER_BUDGET_BYTES = 1 << 30


@triton.jit
def _tile_scores(Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window,
                 sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                 HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                 PREC: tl.constexpr):
    """Scores `[BM, BN]` fp32 of queries tq against keys n0..n0+BN-1, with (visible, forced) masks."""
    offs_n = n0 + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)
    kt = tl.load(KI + b * skb + offs_n[None, :] * sks + offs_d[:, None] * skd,
                 mask=(offs_n[None, :] < S) & (offs_d[:, None] < DI), other=0.0)  # [BD, BN]
    acc = tl.zeros([BM, BN], tl.float32)
    for j in tl.static_range(HI):
        qj = tl.load(Q + b * sqb + tq[:, None] * sqt + j * sqh + offs_d[None, :] * sqd,
                     mask=mmask[:, None] & (offs_d[None, :] < DI), other=0.0)
        wj = tl.load(W + b * swb + tq * swt + j * swh, mask=mmask, other=0.0).to(tl.float32)
        acc += wj[:, None] * tl.maximum(dot(qj, kt, PREC), 0.0)
    s = offs_n[None, :]
    vis = (s <= pos[:, None]) & (s >= start) & mmask[:, None] & (s < S)
    forced = vis & ((s < start + sink) | (s > pos[:, None] - window))
    return acc, vis, forced, offs_n


@triton.jit
def _stream_kernel(Q, W, KI, KVS, VAL, IDX, NROW, RMAX,
                   sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, svb, svt, snb,
                   T, S, t0, q_offset, sink, window, K, C, E,
                   HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                   R: tl.constexpr, NZ: tl.constexpr, Z0: tl.constexpr, DZ: tl.constexpr,
                   DOT_SCAN: tl.constexpr, SCORES_ONLY: tl.constexpr, PREC: tl.constexpr):
    """Rows t0 + [pm*BM, pm*BM + BM) of the chunk: their candidate buffers VAL/IDX `[B, Tc, C]` and
    entry counts NROW `[B, Tc]` (-1: redo the row exactly). SCORES_ONLY: only the row maxima RMAX
    (the cost of the score sweep alone, for benchmarks)."""
    pm = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows first: less tail imbalance
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
    kk = K - nf  # finite keys still to choose
    nu = nvis - nf
    if SCORES_ONLY:
        mx = tl.full([BM], float("-inf"), tl.float32)
        for n0 in range(first, last + 1, BN):
            s, vis, forced, offs_n = _tile_scores(Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window,
                                                  sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                                                  HI, DI, BM, BN, BD, PREC)
            mx = tl.maximum(mx, tl.max(tl.where(vis, s, float("-inf")), 1))
        tl.store(RMAX + b * snb + offs_m, mx, mask=mmask)
    else:
        th = tl.full([BM], float("-inf"), tl.float32)  # rows whose visible keys fit the buffer take all
        stats = (nvis > C) & (kk > 0)
        if tl.max(stats.to(tl.int32), 0) > 0:
            # sweep 1: moments of the sampled tiles (tile mean / M2 merged as in Chan et al.)
            ns = tl.zeros([BM], tl.float32)
            mean = tl.zeros([BM], tl.float32)
            m2 = tl.zeros([BM], tl.float32)
            for n0 in range(first, last + 1, BN * R):
                s, vis, forced, offs_n = _tile_scores(Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window,
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
            sd = tl.sqrt(m2 / tl.maximum(ns, 1.0))
            # sweep 2: sample counts above the z grid
            zc = tl.arange(0, NZ)
            cnt = tl.zeros([BM, NZ], tl.float32)
            for n0 in range(first, last + 1, BN * R):
                s, vis, forced, offs_n = _tile_scores(Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window,
                                                      sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                                                      HI, DI, BM, BN, BD, PREC)
                fin = vis & ~forced
                for j in tl.static_range(NZ):
                    thj = mean + sd * (Z0 + j * DZ)
                    cj = tl.sum((fin & (s >= thj[:, None])).to(tl.float32), 1)
                    cnt += tl.where(zc[None, :] == j, cj[:, None], 0.0)
            # the grid point just below the target count and the one above, interpolated in log count
            target = E * kk.to(tl.float32) * ns / tl.maximum(nu.to(tl.float32), 1.0)
            ja = tl.sum((cnt >= target[:, None]).to(tl.int32), 1) - 1
            jb = tl.minimum(ja + 1, NZ - 1)
            ca = tl.sum(tl.where(zc[None, :] == ja[:, None], cnt, 0.0), 1)
            cb = tl.maximum(tl.sum(tl.where(zc[None, :] == jb[:, None], cnt, 0.0), 1), 0.5)
            frac = tl.where((jb > ja) & (ca > cb), tl.log(ca / target) / tl.log(ca / cb), 0.0)
            z = Z0 + (ja.to(tl.float32) + tl.minimum(tl.maximum(frac, 0.0), 1.0)) * DZ
            est = tl.where((ja >= 0) & (ns > 0), mean + sd * z, float("-inf"))
            th = tl.where(stats, est, th)
        th = tl.where(kk > 0, th, float("inf"))  # the forced keys fill the budget
        # sweep 3: append the keys above the threshold, in key order
        run = tl.zeros([BM], tl.int32)
        if DOT_SCAN:
            tri = (tl.arange(0, BN)[:, None] <= tl.arange(0, BN)[None, :]).to(tl.float16)  # inclusive prefix
        for n0 in range(first, last + 1, BN):
            s, vis, forced, offs_n = _tile_scores(Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window,
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
            rowp = b * svb + offs_m[:, None].to(tl.int64) * svt + slot
            tl.store(VAL + rowp, tl.where(forced, float("inf"), s), mask=ok)
            tl.store(IDX + rowp, offs_n[None, :] + tl.zeros([BM, BN], tl.int32), mask=ok)
            run += tl.sum(cand.to(tl.int32), 1)
        good = (run >= tl.minimum(nvis, K)) & (run <= C)
        tl.store(NROW + b * snb + offs_m, tl.where(good, run, -1), mask=mmask)


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


def _config(interpret: bool, block_m, block_n, sample_stride):
    if interpret:
        return block_m or 16, block_n or 16, sample_stride or 2
    return block_m or 64, block_n or 128, sample_stride or 8


def stream_buffer_slots(topk: int) -> int:
    """Buffer slots per row: twice the budget (the threshold aims at 1.5x), a power of two."""
    return triton.next_power_of_2(max(16, 2 * topk))


def _launch_stream(q_idx, w, k_idx, kvs, t0, t1, q_offset, sink, window, topk, C, val, idx, nrow, rmax,
                   BM, BN, R, dot_scan, scores_only, target):
    B, T, HI, DI = q_idx.shape
    S = k_idx.shape[1]
    interpret = not q_idx.is_cuda
    grid = (triton.cdiv(t1 - t0, BM), B)
    _stream_kernel[grid](q_idx, w, k_idx, kvs, val, idx, nrow, rmax, *q_idx.stride(), *w.stride(), *k_idx.stride(),
                         val.stride(0), val.stride(1), nrow.stride(0), t1, S, t0, q_offset, sink, window, topk, C,
                         target, HI=HI, DI=DI, BM=BM, BN=BN, BD=max(16, triton.next_power_of_2(DI)), R=R, NZ=NZ,
                         Z0=Z0, DZ=DZ, DOT_SCAN=dot_scan, SCORES_ONLY=scores_only,
                         PREC=dot_precision(q_idx.dtype), num_warps=1 if interpret else 8,
                         num_stages=1 if interpret else 2)


def _redo_rows(q_idx, w, k_idx, kvs, bad, t0, q_offset, topk, sink, window, out, group: int = 512):
    """Exact selection, by the split-row decode select, of the flagged rows bad `[B, Tc]` of the chunk."""
    from sparse_rl.sparse.ops.indexer_topk.decode import indexer_topk_decode

    if k_idx.stride(-1) != 1:
        k_idx = k_idx.contiguous()
    for b, t in _groups(bad.nonzero(), group):
        tt = t + t0
        kb = k_idx[b:b + 1].expand(len(t), *k_idx.shape[1:])  # one key set, broadcast (stride 0)
        pos = (tt + q_offset).to(torch.int32)
        st = kvs[b].expand(len(t)).contiguous()
        out[b, tt] = indexer_topk_decode(q_idx[b, tt], w[b, tt], kb, pos, topk, sink=sink, window=window, kv_start=st)


def _groups(rows: torch.Tensor, group: int):
    """(b, t-tensor) groups of at most `group` flagged rows sharing a batch row."""
    for b in rows[:, 0].unique().tolist():
        t = rows[rows[:, 0] == b, 1]
        for i in range(0, len(t), group):
            yield b, t[i:i + group]


def indexer_topk_stream(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, topk: int, *, q_offset: int = 0,
                        sink: int = 0, window: int = 0, kv_start: torch.Tensor | None = None,
                        budget_bytes: int | None = None, block_m: int | None = None, block_n: int | None = None,
                        sample_stride: int | None = None, slots: int | None = None, dot_scan: bool = False,
                        target: float = TARGET, info: dict | None = None) -> torch.Tensor:
    """See the module docstring. q_idx `[B, T, H_I, D_I]`, w `[B, T, H_I]`, k_idx `[B, S, D_I]` (T, S >= 1,
    supported dtypes: the caller, `triton.indexer_topk`, checks) -> `[B, T, topk]` int32. `slots`: buffer
    entries per row (default `stream_buffer_slots(topk)`); `info`, when given, receives the mean
    buffer entries per row and the number of rows redone exactly (costs a sync)."""
    B, T, HI, DI = q_idx.shape
    S = k_idx.shape[1]
    dev = q_idx.device
    BM, BN, R = _config(not q_idx.is_cuda, block_m, block_n, sample_stride)
    C = slots or stream_buffer_slots(topk)
    CB = triton.next_power_of_2(C)
    kvs = (torch.zeros(B, dtype=torch.int32, device=dev) if kv_start is None
           else torch.as_tensor(kv_start, device=dev).to(torch.int32).reshape(B))
    budget = budget_bytes or (BUFFER_BUDGET_BYTES if q_idx.is_cuda else 1 << 22)
    chunk = max(BM, min(T, budget // (8 * B * C)) // BM * BM)
    val = torch.empty(B, min(T, chunk), C, device=dev, dtype=torch.float32)
    idx = torch.empty(B, min(T, chunk), C, device=dev, dtype=torch.int32)
    nrow = torch.empty(B, min(T, chunk), device=dev, dtype=torch.int32)
    out = torch.empty(B, T, topk, dtype=torch.int32, device=dev)
    interpret = not q_idx.is_cuda
    entries, redone = 0, 0
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        _launch_stream(q_idx, w, k_idx, kvs, t0, t1, q_offset, sink, window, topk, C, val, idx, nrow, nrow,
                       BM, BN, R, dot_scan, False, target)
        o = out[:, t0:t1]
        _select_kernel[(B * (t1 - t0),)](val, idx, nrow, o, t1 - t0, val.stride(0), val.stride(1), nrow.stride(0),
                                         o.stride(0), o.stride(1), topk, CB=CB, KB=min(1024, CB),
                                         num_warps=1 if interpret else 8)
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
                    kv_start: torch.Tensor | None = None, block_m: int | None = None,
                    block_n: int | None = None) -> torch.Tensor:
    """Each query's largest visible index score `[B, T]` fp32, by the same streaming sweep with no
    selection: the time of the score dots alone, which the streaming top-k is measured against."""
    B, T = q_idx.shape[:2]
    dev = q_idx.device
    BM, BN, _ = _config(not q_idx.is_cuda, block_m, block_n, None)
    kvs = (torch.zeros(B, dtype=torch.int32, device=dev) if kv_start is None
           else torch.as_tensor(kv_start, device=dev).to(torch.int32).reshape(B))
    rmax = torch.empty(B, T, device=dev, dtype=torch.float32)
    dummy = torch.empty(1, 1, 1, device=dev, dtype=torch.int32)
    _launch_stream(q_idx, w, k_idx, kvs, 0, T, q_offset, 0, 0, 1, 1, dummy, dummy, rmax, rmax,
                   BM, BN, 1, False, True, TARGET)
    return rmax
