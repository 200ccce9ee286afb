"""The prefill top-k's rows whose threshold lands on a mass of equal scores (cand_topk.py's flagged rows), resolved
exactly without redoing them one by one.

Why: a ReLU indexer scores a key exactly 0 wherever every head's dot is negative, so on a trained indexer many rows
hold thousands of zeros; where the k-th largest score is 0, the sampled threshold is 0 and every zero is a
candidate: the buffer of 2k slots overflows and the row was redone by the decode select (~10 us a row on the
H200). A CPU replay of `bench attention`'s trained indexer (benchmarks/cpu_cand_flags.py, results/
2026-12-03-cpu-cand-flags-*.json) finds every flagged row such a row: 216 of 32K at E 1.5 (the H200 redid 252),
~2.7% of the rows at 128K (the H200: 3,166), none short and none overflowing through scores above the threshold.

How: the flagged rows are packed into tiles of their own (`ROWS`: rows of one batch, in any order), their key range
split into P spans so that the few flagged rows still fill the GPU (one program walking a 32K row alone took
2.3 ms where the redo took 1.2: session 17), and gathered again in two passes with the threshold strict:
1. count: each (row tile, span) program counts a row's keys > th (and the forced ones) and its keys == th;
2. store: from the exclusive prefix of those counts over the spans, each program appends its keys > th to the
   row's buffer at their place in key order (as the gather), and its ties with a global index among the latest
   KT >= k to a row of KT slots (among equal scores the reference keeps the later keys).
Then a row whose keys above th number n:
- n >= k' (k' = min(visible, k)): its top-k lies above th: the buffer's select (`_write_selected`);
- n < k' <= n + ties: all n, and the latest k' - n ties: the two ascending lists merged (by binary search);
- else (more than C keys above th, or too few keys at all): still flagged, for the caller's redo.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.cand_words import HAS_POPC, _append_words, _word_slots
from sparse_rl.sparse.ops.indexer_topk.radix_topk import _okey, _write_selected
from sparse_rl.sparse.ops.indexer_topk.stream import load_queries, score_tile, score_tile_q

@triton.jit
def _list_rows(ROWS, NR, srb, KVS, S, q_offset, t0, b, BM: tl.constexpr, BN: tl.constexpr):
    """This program's rows (batch b's chunk rows listed in ROWS `[B, NR]`, -1 padded) and their key range, as
    `stream._rows` gives them for a contiguous tile."""
    offs = tl.program_id(0) * BM + tl.arange(0, BM)
    row = tl.load(ROWS + b * srb + offs, mask=offs < NR, other=-1)
    mmask = row >= 0
    offs_m = tl.where(mmask, row, 0)
    tq = t0 + offs_m
    start = tl.load(KVS + b)
    pos = q_offset + tq
    last = tl.minimum(tl.max(tl.where(mmask, pos, 0), 0), S - 1)
    first = (start // BN) * BN
    nvis = tl.where(mmask, tl.maximum(tl.minimum(pos, S - 1) - start + 1, 0), 0)
    return offs, offs_m, tq, mmask, pos, start, first, last, nvis


@triton.jit
def _ties_pass_kernel(Q, W, KI, KVS, TH, BUF, NROW, TIES, ROWS, CNT, OFF, TOT, NR, sqb, sqt, sqh, sqd, swb, swt,
                      swh, skb, sks, skd, svb, svt, snb, srb, stb, stt, S, t0, q_offset, sink, window, K, C,
                      KT, SPAN, P, HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BD: tl.constexpr, COUNT: tl.constexpr, HWPOPC: tl.constexpr, PREC: tl.constexpr):
    """Program (row tile, span p, batch b) over the listed rows' keys p * SPAN .. (p + 1) * SPAN - 1.
    COUNT: CNT `[2, B, NR, P]` int32 (contiguous) its keys > TH or forced ([0]) and == TH ([1]) a row. Else, from
    OFF (CNT's exclusive prefix over the spans) and TOT `[2, B, NR]` (contiguous; CNT's sums): BUF `[B, Tc, C]`
    int64 the gather's packed (fp32 bits, key) words of the keys > TH and the forced ones, in key order; TIES
    `[B, NR, KT]` int32 the latest KT keys == TH (the tie of global index j at slot j - ties + KT); span 0 writes
    NROW `[B, Tc]` (the entries; -1: still unresolved)."""
    b = tl.program_id(2).to(tl.int64)
    p = tl.program_id(1)
    nb = tl.num_programs(2)
    offs, offs_m, tq, mmask, pos, start, first, last, nvis = _list_rows(ROWS, NR, srb, KVS, S, q_offset, t0, b,
                                                                        BM, BN)
    th = tl.load(TH + b * snb + offs_m, mask=mmask, other=float("inf"))
    lo = tl.maximum(first, p * SPAN)  # SPAN a multiple of BN: lo on a tile edge
    hi = tl.minimum(last + 1, (p + 1) * SPAN)
    cptr = (b * NR + offs) * P + p  # into [.., B, NR, P]
    half = nb * NR * P
    if COUNT:
        na = tl.zeros([BM], tl.int32)
        nt = tl.zeros([BM], tl.int32)
        for n0 in range(lo, hi, BN):
            s, vis, forced, offs_n = score_tile(Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window,
                                                sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd,
                                                HI, DI, BM, BN, BD, PREC)
            na += tl.sum((vis & (forced | (s > th[:, None]))).to(tl.int32), 1)
            nt += tl.sum((vis & ~forced & (s == th[:, None])).to(tl.int32), 1)
        tl.store(CNT + cptr, na, mask=mmask)
        tl.store(CNT + half + cptr, nt, mask=mmask)
    else:
        run = tl.load(OFF + cptr, mask=mmask, other=0)
        tie = tl.load(OFF + half + cptr, mask=mmask, other=0)
        na = tl.load(TOT + b * NR + offs, mask=mmask, other=0)
        nt = tl.load(TOT + nb * NR + b * NR + offs, mask=mmask, other=0)
        vbase = (BUF + b * svb + offs_m * svt)[:, None]
        tbase = (TIES + b * stb + offs * stt)[:, None, None]
        drop = (nt - KT)[:, None, None]  # ties of a global index below this are not among the latest KT
        NW: tl.constexpr = BN // 32
        qs, ws = load_queries(Q, W, b, tq, mmask, sqb, sqt, sqh, sqd, swb, swt, swh, HI, DI, BD)  # the loop stores
        for n0 in range(lo, hi, BN):
            s, vis, forced, offs_n = score_tile_q(qs, ws, KI, b, mmask, pos, start, n0, S, sink, window, skb, sks, skd,
                                                  HI, DI, BM, BN, BD, PREC)
            above = mmask[:, None] & vis & (forced | (s > th[:, None]))  # padding lanes alias row 0: never store
            run = _append_words(s, above, forced, n0, run, vbase, vbase, C, True, True, HWPOPC, False, BM, BN)
            eq = mmask[:, None] & vis & ~forced & (s == th[:, None])
            e3, slot, cnt = _word_slots(eq, tie, HWPOPC, BM, BN)
            key3 = n0 + (tl.arange(0, NW)[:, None] * 32 + tl.arange(0, 32)[None, :])[None, :, :]
            keep = e3 & (slot >= drop)
            tl.store(tbase + (slot - drop), tl.broadcast_to(key3, [BM, NW, 32]), mask=keep)
            tie += cnt
        if p == 0:
            want = tl.minimum(nvis, K)
            ok = (na <= C) & (na + nt >= want)
            tl.store(NROW + b * snb + offs_m, tl.where(ok, na, -1), mask=mmask)


@triton.jit
def _rank(base, n, x, live, STEPS: tl.constexpr, LOW32: tl.constexpr):
    """For each live x: how many of the n ascending keys at base are below it (a binary search, STEPS >=
    log2(n + 1) halvings); LOW32: the keys are the low 32 bits of int64 words."""
    lo = tl.zeros(x.shape, tl.int32)
    hi = tl.zeros(x.shape, tl.int32) + n
    for _ in tl.static_range(STEPS):
        go = live & (lo < hi)
        mid = (lo + hi) // 2
        v = tl.load(base + mid, mask=go, other=0)
        if LOW32:
            v = (v & 0xFFFFFFFF).to(tl.int32)
        lt = v < x
        lo = tl.where(go & lt, mid + 1, lo)
        hi = tl.where(go & ~lt, mid, hi)
    return lo


@triton.jit
def _ties_select_kernel(BUF, NROW, TIES, ROWS, KVS, OUT, NR, svb, svt, snb, srb, stb, stt, sob, sot, t0,
                        q_offset, S, K, CB: tl.constexpr, KB: tl.constexpr, KT: tl.constexpr,
                        LOGC: tl.constexpr, LOGT: tl.constexpr):
    """OUT rows of the listed rows (one program a list entry): the buffer's select where its keys reach k', else
    the buffer's keys and the latest k' - n ties merged ascending (-1 padded). The merge places each key at its
    index plus its rank among the other list's keys (both lists ascending and disjoint: a key above the threshold
    or forced is never a tie), found by binary search: a sort of the CB + KT keys took 1.1 us a row on the H200
    (session 17's profile: 0.29 ms of 252 rows at 32K, 3.4 ms of 3,140 at 128K)."""
    b = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0)
    row = tl.load(ROWS + b * srb + i)
    if row >= 0:
        n = tl.load(NROW + b * snb + row)
        if n >= 0:
            pos = q_offset + t0 + row
            nvis = tl.maximum(tl.minimum(pos, S - 1) - tl.load(KVS + b) + 1, 0)
            want = tl.minimum(nvis, K)
            obase = OUT + b * sob + row.to(tl.int64) * sot
            bbase = BUF + b * svb + row.to(tl.int64) * svt
            offs = tl.arange(0, CB)
            live = offs < n
            word = tl.load(bbase + offs, mask=live, other=0)
            idx = (word & 0xFFFFFFFF).to(tl.int32)
            if n >= want:
                key = _okey((word >> 32).to(tl.int32).to(tl.float32, bitcast=True))
                _write_selected(key, idx, live, n, K, obase, KB, False)
            else:  # all n, then the row's latest `need` ties (slots KT - need .. KT - 1)
                need = want - n
                tbase = TIES + b * stb + i.to(tl.int64) * stt + (KT - need)
                tl.store(obase + offs + _rank(tbase, need, idx, live, LOGT, False), idx, mask=live)
                j = tl.arange(0, KT)
                tlive = j < need
                tv = tl.load(tbase + j, mask=tlive, other=0)
                tl.store(obase + j + _rank(bbase, n, tv, tlive, LOGC, True), tv, mask=tlive)
                tl.store(obase + j, tl.full([KT], -1, tl.int32), mask=(j >= want) & (j < K))


def tie_spans(cfg, S: int, programs: int, device) -> int:
    """P, the spans a flagged row's keys are split into: cfg.tie_splits, or enough for ~2 programs an SM with at
    least 4 key tiles a span (at most one span under 8 tiles)."""
    if cfg.tie_splits:
        return cfg.tie_splits
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(triton.cdiv(2 * sms, programs), S // (4 * cfg.block_n)))


def resolve_ties(q_idx, w, k_idx, kvs, bad, th, val, nrow, out, t0, q_offset, topk, sink, window, cfg):
    """The flagged rows `bad [B, Tc]` (bool) of a chunk, gathered again with the strict threshold and their ties
    (module docstring); fills their `out` rows and nrow (-1 where still unresolved: the caller counts what is
    left). val: the chunk's packed `[B, Tc, C]` int64 buffer."""
    from sparse_rl.sparse.ops.indexer_topk.stream import _common

    B, S, C = q_idx.shape[0], k_idx.shape[1], val.shape[2]
    dev = val.device
    NR = int(bad.sum(1).max())
    if NR == 0:
        return
    # each batch's flagged rows, longest (latest) first, -1 padded: tiles of neighbouring rows share key spans
    order = torch.sort(torch.where(bad, torch.arange(bad.shape[1], device=dev), -1), 1, descending=True)
    rows = order.values[:, :NR].to(torch.int32).contiguous()
    KT = triton.next_power_of_2(topk)  # the latest k ties at most are taken; each has a slot of its own
    BM, BN = cfg.block_m, cfg.block_n
    tiles = triton.cdiv(NR, BM)
    P = tie_spans(cfg, S, tiles * B, dev)
    span = triton.cdiv(triton.cdiv(S, P), BN) * BN
    P = triton.cdiv(S, span)
    ties = torch.empty(B, NR, KT, device=dev, dtype=torch.int32)
    cnt = torch.zeros(2, B, NR, P, device=dev, dtype=torch.int32)
    args, strides, meta = _common(q_idx, w, k_idx, kvs)
    launch = dict(BM=BM, BN=BN, HWPOPC=q_idx.is_cuda and HAS_POPC, **meta, num_warps=cfg.warps,
                  num_stages=2 if q_idx.is_cuda else 1)

    def run(count, off, tot):
        _ties_pass_kernel[(tiles, P, B)](
            *args, th, val, nrow, ties, rows, cnt, off, tot, NR, *strides, val.stride(0), val.stride(1),
            nrow.stride(0), rows.stride(0), ties.stride(0), ties.stride(1), S, t0, q_offset, sink, window,
            topk, C, KT, span, P, COUNT=count, **launch)

    run(True, cnt, cnt)
    tot = cnt.sum(3, dtype=torch.int32).contiguous()
    run(False, (cnt.cumsum(3, dtype=torch.int32) - cnt).contiguous(), tot)
    CB = triton.next_power_of_2(C)
    _ties_select_kernel[(NR, B)](val, nrow, ties, rows, kvs, out, NR, val.stride(0), val.stride(1),
                                 nrow.stride(0), rows.stride(0), ties.stride(0), ties.stride(1), out.stride(0),
                                 out.stride(1), t0, q_offset, S, topk, CB=CB, KB=min(1024, CB), KT=KT,
                                 LOGC=CB.bit_length(), LOGT=KT.bit_length(), num_warps=cfg.select_warps)
