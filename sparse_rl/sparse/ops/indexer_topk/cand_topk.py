"""Prefill indexer top-k from a sampled quantile threshold and ONE compacting score sweep, never writing
`[T, S]` scores (issue 15 item 1, session 10; `topk_impl="cand"`).

`indexer_topk_cand(q_idx [B, T, H_I, D_I], w [B, T, H_I], k_idx [B, S, D_I], topk)` -> `[B, T, topk]` int32,
ascending, -1 padded: the reference's keys (`naive.indexer_topk_naive`: forced sinks and window, the highest
scores, among equal scores the later key, -0.0 == +0.0, -inf never selected, rows with < k keys keep all).

Phases (why each):
1. Sample (`_sample_kernel`): per 64-query tile, the scores of every R-th key (strided keys, not strided
   tiles: a trained indexer's scores are locally correlated, so whole sampled tiles would bias the count)
   are written to a small `[Tc, S/R]` fp32 scratch (1/R of the scores; forced and invisible keys -inf).
2. Quantile (`_quantile_kernel`, one program a row): the m-th largest sampled score, m = ceil(E * (k - forced)
   * sampled / visible), found by a bitwise binary search on the order-preserving uint32 keys (one count
   reduction a bit, only the bits where the row's sampled min and max differ), so that ~E * k keys score
   >= it. Distribution-free: the z grid of `stream.py`'s moment threshold assumes a shape (on the trained
   indexer's scores it redid many rows: NOTES item 13). Rows with <= C visible keys take all (-inf).
3. Gather (`_gather_words_kernel`, the default `gather="words"`; session 10's `stream._gather_kernel` with
   "scan"): every key tile scored once more; keys >= the threshold and the forced ones (+inf) appended in key
   order to a per-row buffer `[Tc, C]` (packed: one int64 (fp32 bits, position)) at a running count (one program
   owns a row tile, so the running count is the slot reservation; no atomics); a count per row, -1 when the
   buffer overflowed or came out short. Slots without a scan over the tile: the row's mask packed into 32-key
   words, popcounts, a prefix over the BN/32 word counts; the whole, unforced tiles in a loop whose candidate
   test is one compare; the predicated stores as inline PTX in the accumulator's layout (see the kernel).
4. Select (`_select_kernel`, one program a row): the exact k-th key of the buffer by the same binary search
   (no `tl.histogram`: it lowers to ~55-100 instructions an element, NOTES item 16; a bit step is a compare,
   a convert and a block sum), then the kept lanes (> tau, and the last `need` of the lanes == tau: the
   buffer is in key order, so later lanes are later keys) written ascending by one prefix sum.
5. Ties (`cand_ties.py`, `CandConfig.ties`, in chunks of at least `tie_min_work` flagged row-keys): flagged rows
   whose threshold sits on a mass of equal scores (a ReLU indexer's exact zeros: on the trained indexer every
   flagged row, benchmarks/cpu_cand_flags.py) are gathered again, their keys split into spans, the keys above
   the threshold into the buffer and the latest ties beside it, and merged exactly from the two.
6. Exactness: rows still flagged -1 (the sample was unlucky, or too many keys above the threshold) are redone
   exactly: on CUDA by the split-row decode select (`stream._redo_rows`, ~10 us a row), under the interpreter on
   the materialising path (`redo_tiles`: the flagged rows' 64-row tiles scored and `bin_topk`), because there the
   decode select broke the tie rule on a row of 57 equal scores (tests/sparse/test_cand_topk.py; on the H200
   the redone rows matched bin_topk's in every session-10 case, and in session 11 in all but one, below).

Measured (H200, B = 1, k = 2048, 4 x 64 bf16; session 11 call 1, NOTES item 20): the words gather 1.56 ms at
32K trained (scan: 4.22; the sweep alone 0.76), 22.2 at 128K random (scan: 45.0; sweep 11.0); whole (this default
form) 32K 5.51 trained / 5.00 random against bin_topk's 7.93 / 7.12 on materialised scores; 128K 44.5 random
(bin 111.6, session 10's default 72.5) / 54.1 trained (3,166 rows redone). Then the select (2.0 / 8.3 ms), the
threshold (0.7 / 5.6 ms) and the redo. The buffer holds every key >= the threshold, so a row it serves is exact
whatever the threshold was: the sample decides speed only. A redone row takes the decode select's own score pass
(a tree sum over the heads instead of the gather's running FMA): at a near-tie of last-ulp size at the k-th key
it can differ from bin's row; the one row of 131K that differed in call 1 (16-bit quantile, 133 rows redone at
128K random) is most likely that (not reproducible on the CPU), so quantile_bits stays 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops._backend import cuda_index
from sparse_rl.sparse.ops.indexer_topk.radix_topk import (_okey, _select_lanes, _store_lanes, _write_selected, kth_key,
                                                          kth_key2, kth_key_counts)
from sparse_rl.sparse.ops.indexer_topk.bin_topk import bin_topk
from sparse_rl.sparse.ops.indexer_topk.scores import indexer_scores_chunk
from sparse_rl.sparse.ops.indexer_topk.stream import (_common, _gather_kernel, _kv_start, _redo_rows, _rows,
                                                      _threshold_kernel, NZ, Z0, DZ, load_queries, score_tile,
                                                      score_tile_q, stream_buffer_slots)

from sparse_rl.sparse.ops.indexer_topk.cand_words import HAS_POPC, _append_words, _store_kept
from sparse_rl.sparse.ops.sparse_attention.tl_utils import maxnreg_option

# the candidate and sample buffers' bytes on CUDA: a quarter of the memory free to PyTorch, within these bounds
# (128K rows of k 2048 take 6.4 GB in one chunk: 32 KB of candidates and 16 KB of samples a row)
BUFFER_BUDGET_BYTES = 8 << 30
BUFFER_BUDGET_MIN = 1 << 30


def buffer_budget(dev: torch.device) -> int:
    """Bytes the buffers may take on dev: a quarter of the driver's free memory plus the caching allocator's unused
    reserve, between BUFFER_BUDGET_MIN and BUFFER_BUDGET_BYTES (the interpreter: 4 MB). Fewer chunks are faster and
    the rows do not depend on the chunking (H200, session 19, 128K trained: 1 chunk 29.0 ms, 2 chunks 30.7, 4 chunks
    32.9; rows equal)."""
    if dev.type != "cuda":
        return 1 << 22
    free, _ = torch.cuda.mem_get_info(dev)
    spare = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    return max(BUFFER_BUDGET_MIN, min(BUFFER_BUDGET_BYTES, (free + spare) // 4))


@triton.jit
def _key_to_float(key):
    """Inverse of `radix_topk._okey` (for keys of finite or infinite floats; -0.0 comes back as +0.0)."""
    u = tl.where((key >> 31) == 1, key & 0x7FFFFFFF, ~key)
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _sample_kernel(Q, W, KI, KVS, SMP, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, spb, spt,
                   T, S, t0, q_offset, sink, window, C, SW,
                   R: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BD: tl.constexpr, PREC: tl.constexpr):
    """SMP `[B, Tc, SW]` fp32: column j = the score of key j * R for the chunk's rows t0 + m (-inf where that
    key is invisible or forced); rows with <= C visible keys are not needed (their tiles are skipped)."""
    b, offs_m, tq, mmask, pos, start, first, last, nvis, nf = _rows(KVS, T, S, t0, q_offset, sink, window, BM, BN)
    if tl.max((nvis > C).to(tl.int32), 0) > 0:
        SR = (S + R - 1) // R
        qs, ws = load_queries(Q, W, b, tq, mmask, sqb, sqt, sqh, sqd, swb, swt, swh, HI, DI, BD)  # the loop stores
        for j0 in range(0, last // R + 1, BN):
            # a score tile over the sampled keys: key j is position j * R (stride sks * R, bound SR)
            s, _, _, offs_j = score_tile_q(qs, ws, KI, b, mmask, pos, start, j0, SR, sink, window, skb, sks * R, skd,
                                           HI, DI, BM, BN, BD, PREC)
            key = offs_j[None, :] * R
            vis = (key <= pos[:, None]) & (key >= start) & (key < S)
            forced = (key < start + sink) | (key > pos[:, None] - window)
            s = tl.where(vis & ~forced, s, float("-inf"))
            tl.store(SMP + b * spb + offs_m[:, None] * spt + offs_j[None, :], s,
                     mask=mmask[:, None] & (offs_j[None, :] < SW))


@triton.jit
def _quantile_kernel(SMP, KVS, TH, spb, spt, stb, Tc, S, t0, q_offset, sink, window, K, C, E, SW,
                     R: tl.constexpr, CB: tl.constexpr, QBITS: tl.constexpr, STEP2: tl.constexpr = False,
                     CM: tl.constexpr = 0):
    """TH `[B, Tc]`: each row's threshold, the m-th largest of its sampled scores (see the module docstring);
    -inf for rows of <= C visible keys (take all) or too few samples, +inf where the forced keys fill k. CM > 0
    (QBITS 32 only): the m-th by `kth_key_counts`, the row's SMP (read already) as its scratch."""
    row = tl.program_id(0)
    b = (row // Tc).to(tl.int64)
    t = row % Tc
    start = tl.load(KVS + b)
    pos = q_offset + t0 + t
    nvis = tl.maximum(tl.minimum(pos, S - 1) - start + 1, 0)
    nf = tl.minimum(nvis, sink + window)
    kk = K - nf
    th = float("-inf")
    if nvis > C:
        if kk <= 0:
            th = float("inf")
        else:
            offs = tl.arange(0, CB)
            sbase = SMP + b * spb + t.to(tl.int64) * spt
            x = tl.load(sbase + offs, mask=(offs <= pos // R) & (offs < SW), other=float("-inf"))
            live = x > float("-inf")
            ns = tl.sum(live.to(tl.int32), 0)
            m = tl.ceil(E * kk.to(tl.float32) * ns.to(tl.float32) / (nvis - nf).to(tl.float32)).to(tl.int32)
            m = tl.maximum(m, 1)
            if ns > m:
                if CM > 0:
                    tau, _, _ = kth_key_counts(_okey(x), live, ns, m, sbase.to(tl.pointer_type(tl.int32)), CM, 16)
                    th = _key_to_float(tau)
                elif STEP2:
                    th = _key_to_float(kth_key2(_okey(x), live, m, QBITS))
                else:
                    th = _key_to_float(kth_key(_okey(x), live, m, QBITS))
    tl.store(TH + b * stb + t, th)


@triton.jit
def _gather_packed_kernel(Q, W, KI, KVS, TH, BUF, NROW, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, svb, svt,
                          snb, T, S, t0, q_offset, sink, window, K, C,
                          HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                          DOT_SCAN: tl.constexpr, PREC: tl.constexpr):
    """`stream._gather_kernel` with ONE 8-byte store a candidate instead of two 4-byte ones: BUF `[B, Tc, C]`
    int64 = (order-preserving key << 32) | position (call 1: the gather cost ~5x the sweep, and fewer
    candidates, E 1.15 vs 1.3, changed nothing, so it is the per-score work: scan, slots, predicated stores)."""
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
        if DOT_SCAN:  # the in-tile prefix sum on the tensor cores: 0/1 x triangular ones, exact
            if PREC == 2:
                pre = tl.dot(cand.to(tl.float32), tri.to(tl.float32)).to(tl.int32)
            else:
                pre = tl.dot(cand.to(tl.float16), tri).to(tl.int32)
        else:
            pre = tl.cumsum(cand.to(tl.int32), 1)
        slot = run[:, None] + pre - 1
        ok = cand & (slot < C)
        key = _okey(tl.where(forced, float("inf"), s)).to(tl.int64)
        word = (key << 32) | offs_n[None, :].to(tl.int64)
        tl.store(BUF + b * svb + offs_m[:, None] * svt + slot, word, mask=ok)
        run += tl.sum(cand.to(tl.int32), 1)
    good = (run >= tl.minimum(nvis, K)) & (run <= C)
    tl.store(NROW + b * snb + offs_m, tl.where(good, run, -1), mask=mmask)


@triton.jit
def _tile(qs, ws, Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks,
          skd, HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
          PREC: tl.constexpr, HOIST: tl.constexpr):
    """A score tile from the hoisted queries (HOIST) or loading them (`stream.score_tile`)."""
    if HOIST:
        return score_tile_q(qs, ws, KI, b, mmask, pos, start, n0, S, sink, window, skb, sks, skd, HI, DI, BM, BN, BD,
                            PREC)
    else:
        return score_tile(Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window, sqb, sqt, sqh, sqd, swb, swt, swh,
                          skb, sks, skd, HI, DI, BM, BN, BD, PREC)


@triton.jit
def _gather_words_kernel(Q, W, KI, KVS, TH, VAL, IDX, NROW, sqb, sqt, sqh, sqd, swb, swt, swh, skb, sks, skd, svb,
                         svt, snb, T, S, t0, q_offset, sink, window, K, C,
                         HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                         COMPACT: tl.constexpr, SPLIT: tl.constexpr, PACKED: tl.constexpr, HWPOPC: tl.constexpr,
                         ASM: tl.constexpr, PREC: tl.constexpr, HOIST: tl.constexpr,
                         SKIP: tl.constexpr):
    """`stream._gather_kernel` (same buffers, key order, counts; PACKED: `_gather_packed_kernel`'s int64 buffer)
    with two changes, each a constexpr so that the device run can time them apart:
    COMPACT 1: slots by `_append_words` (32-key words and popcounts) instead of `tl.cumsum` over the tile;
    SPLIT: the key tiles every row of the program sees whole and unforced (n0 >= start + sink and
    n0 + BN - 1 <= the first row's position - window, below S) run in a loop of their own whose candidate test
    is the one compare `s >= th`: the sm_90a SASS of the single loop spends several integer compares a score on
    the visibility / forced masks, which only the head (sinks, kv_start) and diagonal tiles need.
    HOIST: the query tiles loaded once before the loops (`stream.load_queries`). SKIP: a whole tile is appended only
    where some score reaches its row's threshold (a trained indexer's candidates cluster)."""
    b, offs_m, tq, mmask, pos, start, first, last, nvis, nf = _rows(KVS, T, S, t0, q_offset, sink, window, BM, BN)
    qs, ws = (), ()
    if HOIST:  # the loops store, so Triton would re-copy every head's query tile at each key tile
        qs, ws = load_queries(Q, W, b, tq, mmask, sqb, sqt, sqh, sqd, swb, swt, swh, HI, DI, BD)
    th = tl.load(TH + b * snb + offs_m, mask=mmask, other=float("inf"))  # +inf: rows past T take nothing
    run = tl.zeros([BM], tl.int32)
    vbase = (VAL + b * svb + offs_m * svt)[:, None]
    ibase = vbase
    if not PACKED:
        ibase = (IDX + b * svb + offs_m * svt)[:, None]
    if SPLIT:
        pos0 = tl.min(tl.where(mmask, pos, S + window), 0)  # the program's first row
        a = tl.maximum(first, tl.minimum((start + sink + BN - 1) // BN * BN, last + 1))
        e = tl.maximum(a, (tl.minimum(pos0 - window, S - 1) + 1) // BN * BN)
    else:
        a = last + 1
        e = a
    for n0 in range(first, a, BN):  # head tiles (all tiles without SPLIT)
        s, vis, forced, offs_n = _tile(qs, ws, Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window, sqb, sqt,
                                       sqh, sqd, swb, swt, swh, skb, sks, skd, HI, DI, BM, BN, BD, PREC, HOIST)
        cand = vis & (forced | (s >= th[:, None]))
        run = _append(s, cand, forced, n0, offs_n, run, vbase, ibase, C, True, COMPACT, PACKED, HWPOPC, ASM, BM, BN)
    for n0 in range(a, e, BN):  # whole, unforced tiles
        s, vis, forced, offs_n = _tile(qs, ws, Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window, sqb, sqt,
                                       sqh, sqd, swb, swt, swh, skb, sks, skd, HI, DI, BM, BN, BD, PREC, HOIST)
        cand = s >= th[:, None]
        if SKIP:  # a tile without a candidate appends nothing: one reduction instead of the words' work
            if tl.max(cand.to(tl.int32)) > 0:
                run = _append(s, cand, forced, n0, offs_n, run, vbase, ibase, C, False, COMPACT, PACKED, HWPOPC, ASM,
                              BM, BN)
        else:
            run = _append(s, cand, forced, n0, offs_n, run, vbase, ibase, C, False, COMPACT, PACKED, HWPOPC, ASM, BM,
                          BN)
    for n0 in range(e, last + 1, BN):  # diagonal / window tiles
        s, vis, forced, offs_n = _tile(qs, ws, Q, W, KI, b, tq, mmask, pos, start, n0, S, sink, window, sqb, sqt,
                                       sqh, sqd, swb, swt, swh, skb, sks, skd, HI, DI, BM, BN, BD, PREC, HOIST)
        cand = vis & (forced | (s >= th[:, None]))
        run = _append(s, cand, forced, n0, offs_n, run, vbase, ibase, C, True, COMPACT, PACKED, HWPOPC, ASM, BM, BN)
    good = (run >= tl.minimum(nvis, K)) & (run <= C)
    tl.store(NROW + b * snb + offs_m, tl.where(good, run, -1), mask=mmask)


@triton.jit
def _append(s, cand, forced, n0, offs_n, run, vbase, ibase, C, EDGE: tl.constexpr, COMPACT: tl.constexpr,
            PACKED: tl.constexpr, HWPOPC: tl.constexpr, ASM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """One tile's append: COMPACT 1 by words (`_append_words`), 0 by `tl.cumsum` (stream.py's form)."""
    if COMPACT == 1:
        run = _append_words(s, cand, forced, n0, run, vbase, ibase, C, EDGE, PACKED, HWPOPC, ASM, BM, BN)
    else:
        slot = run[:, None] + tl.cumsum(cand.to(tl.int32), 1) - 1
        ok = cand & (slot < C)
        v = s
        if EDGE:
            v = tl.where(forced, float("inf"), s)
        _store_kept(vbase + slot, ibase + slot, v, tl.broadcast_to(offs_n[None, :], [BM, BN]), ok, PACKED, ASM)
        run += tl.sum(cand.to(tl.int32), 1)
    return run


@triton.jit
def _select_packed_kernel(BUF, NROW, OUT, Tc, svb, svt, snb, sob, sot, K, CB: tl.constexpr, KB: tl.constexpr,
                          RAW: tl.constexpr = False, STEP2: tl.constexpr = False, LEAN: tl.constexpr = False,
                          CM: tl.constexpr = 0):
    """`_select_kernel` on the packed buffer of `_gather_packed_kernel` (high word the order-preserving key) or,
    RAW, of `_gather_words_kernel` (high word the score's fp32 bits: the key is made here, once a candidate,
    instead of once a score in the gather). LEAN: only the keys stay in registers through the k-th key search
    (the positions are loaded again, L2-hot, for the kept lanes): the search is a chain of dependent block
    reductions, so the rows an SM holds at once, set by the registers a program takes, decide its speed. CM > 0:
    the k-th key by `kth_key_counts`, the row's OUT as its scratch (written over by the result)."""
    row = tl.program_id(0)
    b = (row // Tc).to(tl.int64)
    t = (row % Tc).to(tl.int64)
    n = tl.load(NROW + b * snb + t)
    if n >= 0:
        offs = tl.arange(0, CB)
        live = offs < n
        base = BUF + b * svb + t * svt
        if LEAN:
            hi = tl.load(base.to(tl.pointer_type(tl.int32)) + 2 * offs + 1, mask=live, other=0)
            if RAW:
                key = _okey(hi.to(tl.float32, bitcast=True))
            else:
                key = hi.to(tl.uint32, bitcast=True)
            sel = _select_lanes(key, live, n, K, STEP2, OUT + b * sob + t * sot, CM)
            idx = tl.load(base.to(tl.pointer_type(tl.int32)) + 2 * offs, mask=sel, other=0)
            _store_lanes(sel, idx, n, K, OUT + b * sob + t * sot, KB)
        else:
            word = tl.load(base + offs, mask=live, other=0)
            if RAW:
                key = _okey((word >> 32).to(tl.int32).to(tl.float32, bitcast=True))
            else:
                key = (word >> 32).to(tl.uint32)
            idx = (word & 0xFFFFFFFF).to(tl.int32)
            obase = OUT + b * sob + t * sot
            _store_lanes(_select_lanes(key, live, n, K, STEP2, obase, CM), idx, n, K, obase, KB)


@triton.jit
def _select_kernel(VAL, IDX, NROW, OUT, Tc, svb, svt, snb, sob, sot, K, CB: tl.constexpr, KB: tl.constexpr,
                   STEP2: tl.constexpr = False):
    """OUT `[B, Tc, K]`: the exact top-K of each row's buffer (NROW >= 0 entries, key order), ascending."""
    row = tl.program_id(0)
    b = (row // Tc).to(tl.int64)
    t = (row % Tc).to(tl.int64)
    n = tl.load(NROW + b * snb + t)
    if n >= 0:
        offs = tl.arange(0, CB)
        live = offs < n
        x = tl.load(VAL + b * svb + t * svt + offs, mask=live, other=float("-inf"))
        idx = tl.load(IDX + b * svb + t * svt + offs, mask=live, other=0)
        _write_selected(_okey(x), idx, live, n, K, OUT + b * sob + t * sot, KB, STEP2)


SELECT_IMPLS = ("triton", "cuda")  # `CandConfig.select_impl` and `.quantile_impl`


@dataclass(frozen=True)
class CandConfig:
    """Launch shapes, threshold and redo. The defaults are the H200's fastest form measured exact at 32K and
    128K (session 11 call 1, NOTES item 20: the words gather, packed; 44.5 ms at 128K random against 72.5 for
    session 10's default and 111.6 for bin_topk; 5.51 / 5.00 at 32K trained / random against 7.93 / 7.12).
    Session 18 (results/2026-12-03-h200-session18.md): the k-th key searches stopped at 64 open keys and ranked
    all-pairs, the select lean at 4 warps capped at 128 registers, the quantile capped at 64, and 64-key gather
    tiles at 4 warps: whole 32K trained 5.44 -> 4.26 ms, 128K trained 49.9 -> 43.0, 32K random 4.68 -> 3.51 (select
    2.05 -> 1.42 / 8.27 -> 5.64 / 2.00 -> 1.28, threshold 0.72 -> 0.53 / 5.72 -> 3.81), rows equal throughout.
    Measured and not the default: the 16-bit quantile (5.06 at 32K trained, 42.3 at 128K
    random, but one row of 131K differed from bin's there, see the module docstring). Never run on a GPU:
    `search_bits=2` (compiled for sm_90a with Triton 3.6 on the CPU host only). `threshold`: "sample" (the quantile
    of this module) or "zgrid" (stream.py's moments and z grid). `target` E: keys aimed at above the threshold,
    in units of k (1.5: 75 of 131K rows redone at 128K against 916 at 1.3; at 32K trained 1.3 redid fewer, 110
    vs 252, its p99 buffer 3,660 of 4,096). `redo`: flagged rows by "decode" (stream.py's split-row decode select:
    ~10 us a row on the H200, rows equal to bin_topk's in every call-2 case) or "tiles" (their 64-row tiles
    materialised + bin_topk: exact under the interpreter where the decode select was not, but ~150 us a row
    at 128K: 146 ms for 916 rows in call 1)."""
    block_m: int = 64
    block_n: int = 64  # keys per gather tile (128 at 8 warps: gather 1.58 vs 1.35 ms at 32K trained, session 17)
    sample_block_n: int = 64  # sampled keys per sample tile
    sample_stride: int = 16  # R, at least; grows so that a row's sample fits `sample_lanes`
    sample_lanes: int = 4096
    target: float = 1.5
    threshold: str = "sample"
    warps: int = 4
    quantile_warps: int = 4
    quantile_bits: int = 32  # < 32: the threshold from the keys' top bits only (a lower bound of the m-th sample)
    select_warps: int = 4  # 8 warps capped at 64 registers: equal at 32K, 5.80 vs 5.64 ms at 128K (session 18)
    # register caps for the one-program-a-row quantile and select (0: the compiler's choice): their k-th key
    # search is a chain of dependent block reductions, so the rows an SM holds at once (65,536 registers over
    # warps x 32 x the cap) set their speed; select_lean keeps only the keys in registers through the search
    quantile_maxnreg: int = 64
    select_maxnreg: int = 128
    select_lean: bool = True
    # the quantile's / the select's k-th key: the bit search stops once <= this many keys are still open, which
    # are ranked all-pairs (`radix_topk.kth_key_counts`; 0: the plain search of `search_bits`)
    quantile_compact: int = 32  # 64: 0.54 vs 0.47 ms at 32K trained, 3.71 vs 3.41 at 128K (session 18 call 3)
    select_compact: int = 16  # 32 / 64: 1.24 / 1.40 vs 1.21 ms at 32K trained, 4.91 / 5.56 vs 4.84 at 128K (call 3)
    dot_scan: bool = False  # the gather's in-tile prefix sum by a triangular matmul (stream.py) instead of tl.cumsum
    packed: bool = True  # one int64 store a candidate: (fp32 bits, position) with words, (key, position) with scan
    redo: str = "decode"
    # the first redo_ahead flagged rows a chunk redone before their count is read (cand_redo.py; B = 1, redo
    # "decode"; 0: off; off too where that many rows would reach the tie path, as at 128K). H200, session 20
    # (results/2026-12-04-h200-session20.md): whole top-k at 32K trained 4.48 -> 3.82 ms (252 rows redone, rows
    # equal), 32K random 3.56 -> 3.49 (none flagged); prefill 32K 11.50-11.99 -> 10.80-11.00 ms
    redo_ahead: int = 512
    # the gather kernel: "words" (`_gather_words_kernel`: session 11, 32-key words, no scan over the tile) or
    # "scan" (session 10: stream._gather_kernel, or `_gather_packed_kernel` when packed; dot_scan applies to it)
    gather: str = "words"
    word_compact: bool = True  # words: slots from 32-key words and popcounts (False: tl.cumsum, for timing apart)
    split: bool = True  # words: the whole, unforced key tiles in a loop of their own (one compare a score)
    # words: the query tiles loaded once before the key loops (`stream.load_queries`; False: at every key tile)
    hoist_queries: bool = True
    # rows of at least long_keys keys (their candidates, 1.5 k of them, are a few % of the keys and cluster for a
    # trained indexer): whole gather tiles without a candidate skip the append (one tile-wide reduction) and the
    # gather runs capped at gather_maxnreg registers (0: the compiler's 220, 2 programs an SM; 168: 3). H200, session
    # 19, gather alone at 128K trained: 15.37 ms -> skip 13.50 -> skip + cap 12.36 (whole 29.4 -> 27.4); 128K random
    # 16.28 -> 16.87 (no empty tiles); at 32K both lose (trained 1.17 -> 1.21 / 1.25), so shorter rows take neither
    skip_empty: bool = True
    gather_maxnreg: int = 168
    long_keys: int = 65536
    asm_store: bool = True  # words, CUDA only: the predicated stores as inline PTX (no layout conversion)
    search_bits: int = 1  # bits a step of the quantile's and the select's k-th key search (2: `kth_key2`)
    # flagged rows first gathered again with the strict threshold and their ties at it (cand_ties.py; packed
    # buffers): a ReLU indexer's masses of exact zeros at the threshold, every flagged row of the trained indexer in
    # a CPU replay (benchmarks/cpu_cand_flags.py); the rest are redone by `redo`. Only in a chunk whose flagged rows
    # x keys reach tie_min_work: on the H200 (session 17's profile) the tie path costs ~1.3 ms of launches and
    # host syncs a chunk beyond its GPU time, and saves ~2.3 us a row at 128K keys (the redo 3.8, ties 1.5) and
    # ~0.65 at 32K: even at ~70M row-keys. Measured: 128K trained 56.2 -> 50.4 ms; 32K trained 5.72 vs 5.64 (252
    # rows: below the rule, redone); 128K random +3.8 ms on ~25 rows a chunk (below the rule)
    ties: bool = True
    tie_min_work: int = 1 << 26
    tie_splits: int = 0  # spans a flagged row's keys are split into for the tie path (0: ~2 programs an SM)
    # the buffer select's kernel (packed buffers on a CUDA device): "cuda" (cand_cuda.py, one CUDA block a row;
    # the Triton form where NVRTC or compute capability 8.0 is missing) or "triton" (`_select_packed_kernel`).
    # H100, session 28 (results/2026-12-07-h100-session28.md), rows equal: 32K trained 1.22 -> 0.755 ms, 128K
    # trained 4.84 -> 3.11; whole top-k at 32K 3.45-3.66 -> 2.96-2.98
    select_impl: str = "cuda"
    # the quantile's kernel (32-bit keys, "sample" threshold, on a CUDA device): "cuda" (cand_cuda.sample_kth, the
    # same thresholds) or "triton" (`_quantile_kernel`). H100, session 30 (results/2026-12-07-h100-session30.md),
    # thresholds bitwise equal: the threshold phase at 32K 0.474 -> 0.369 ms (trained and random)
    quantile_impl: str = "cuda"


INTERPRET_CAND = CandConfig(block_m=16, block_n=32, sample_block_n=16, sample_stride=2, sample_lanes=64, target=1.3,
                            warps=1, quantile_warps=1, select_warps=1, redo="tiles", ties=True,
                            quantile_compact=4, select_compact=4,  # the all-pairs rank on the tests' few keys
                            tie_min_work=0, tie_splits=3,  # block_n: a word; 3 spans: the split path, a short last span
                            long_keys=64)  # the tests' longer rows skip empty tiles, the shorter ones do not


def _compact(cm: int, scratch: int, bits: int) -> int:
    """CM of `kth_key_counts`: cfg's value where the row's scratch holds it and the search is exact (32 bits)."""
    return cm if bits == 32 and scratch >= cm else 0


def _takes_ties(cfg: CandConfig, nbad: int, S: int) -> bool:
    """Whether a chunk's nbad flagged rows of S keys go through the tie path first (`CandConfig.tie_min_work`)."""
    return cfg.packed and cfg.ties and nbad * S >= cfg.tie_min_work


def even_chunk(T: int, cap: int, BM: int) -> int:
    """Rows a chunk: the fewest chunks of at most cap rows, of equal length rounded up to BM. The longest rows come
    last (causal), so a short last chunk would be a few programs walking the most keys on a few SMs: at 128K rows
    and cap 43,648 (2 GB), chunks of 43,648 x 3 + 128 took the gather 21.1 ms against 15.4 in one launch (H200,
    session 19)."""
    n = triton.cdiv(T, cap)
    return triton.cdiv(triton.cdiv(T, n), BM) * BM


def sample_stride(cfg: CandConfig, s_max: int) -> int:
    """R: cfg.sample_stride, doubled until a row's sample (ceil(S / R) keys) fits cfg.sample_lanes."""
    r = cfg.sample_stride
    while triton.cdiv(s_max, r) > cfg.sample_lanes:
        r *= 2
    return r


def cand_threshold(q_idx, w, k_idx, kvs, t0, t1, q_offset, sink, window, topk, C, th, smp, cfg: CandConfig):
    """Phases 1-2 for rows t0..t1-1 of the chunk: fills th `[B, Tc]` (smp: `[B, Tc, SW]` scratch, "sample")."""
    B, S = q_idx.shape[0], k_idx.shape[1]
    args, strides, meta = _common(q_idx, w, k_idx, kvs)
    stages = 2 if q_idx.is_cuda else 1
    grid = (triton.cdiv(t1 - t0, cfg.block_m), B)
    if cfg.threshold == "zgrid":
        _threshold_kernel[grid](*args, th, *strides, th.stride(0), t1, S, t0, q_offset, sink, window, topk, C,
                                cfg.target, BM=cfg.block_m, BN=cfg.sample_block_n, R=8, NZ=NZ, Z0=Z0, DZ=DZ,
                                **meta, num_warps=cfg.warps, num_stages=stages)
        return
    R = sample_stride(cfg, S)
    SW = smp.shape[2]
    _sample_kernel[grid](*args, smp, *strides, smp.stride(0), smp.stride(1), t1, S, t0, q_offset, sink, window, C,
                         SW, R=R, BM=cfg.block_m, BN=cfg.sample_block_n, **meta, num_warps=cfg.warps,
                         num_stages=stages)
    if cfg.quantile_impl not in SELECT_IMPLS:
        raise ValueError(f"quantile_impl {cfg.quantile_impl!r}: expected one of {', '.join(SELECT_IMPLS)}")
    if cfg.quantile_impl == "cuda" and cfg.quantile_bits == 32 and smp.is_cuda:
        from sparse_rl.sparse.ops.indexer_topk import cand_cuda

        if SW <= cand_cuda.MAX_SLOTS and cand_cuda.available(cuda_index(smp.device)):
            cand_cuda.sample_threshold(smp, kvs, th, t1 - t0, S, t0, q_offset, sink, window, topk, C, cfg.target, R)
            return
    _quantile_kernel[(B * (t1 - t0),)](smp, kvs, th, smp.stride(0), smp.stride(1), th.stride(0), t1 - t0, S, t0,
                                       q_offset, sink, window, topk, C, cfg.target, SW, R=R,
                                       CB=triton.next_power_of_2(SW), QBITS=cfg.quantile_bits,
                                       STEP2=cfg.search_bits == 2,
                                       CM=_compact(cfg.quantile_compact, SW, cfg.quantile_bits),
                                       num_warps=cfg.quantile_warps,
                                       **maxnreg_option(cfg.quantile_maxnreg, q_idx))


def cand_gather(q_idx, w, k_idx, kvs, t0, t1, q_offset, sink, window, topk, th, val, idx, nrow, cfg: CandConfig):
    """Phase 3 (stream.py's gather sweep): val/idx `[B, Tc, C]` in key order, nrow `[B, Tc]` (-1: redo); with
    cfg.packed, val is the `[B, Tc, C]` int64 buffer and idx is unused."""
    B, S, C = q_idx.shape[0], k_idx.shape[1], val.shape[2]
    args, strides, meta = _common(q_idx, w, k_idx, kvs)
    if cfg.gather == "words":
        assert cfg.block_n % 32 == 0, "the word compaction packs 32-key words"
        long = int(S >= cfg.long_keys)
        _gather_words_kernel[(triton.cdiv(t1 - t0, cfg.block_m), B)](
            *args, th, val, idx, nrow, *strides, val.stride(0), val.stride(1), nrow.stride(0), t1, S, t0, q_offset,
            sink, window, topk, C, BM=cfg.block_m, BN=cfg.block_n, COMPACT=int(cfg.word_compact), SPLIT=cfg.split,
            PACKED=cfg.packed, HWPOPC=q_idx.is_cuda and HAS_POPC, ASM=cfg.asm_store and q_idx.is_cuda,
            HOIST=cfg.hoist_queries, SKIP=cfg.skip_empty and long, **meta,
            num_warps=cfg.warps, num_stages=2 if q_idx.is_cuda else 1, **maxnreg_option(cfg.gather_maxnreg * long, q_idx))
        return
    if cfg.packed:
        _gather_packed_kernel[(triton.cdiv(t1 - t0, cfg.block_m), B)](
            *args, th, val, nrow, *strides, val.stride(0), val.stride(1), nrow.stride(0), t1, S, t0, q_offset,
            sink, window, topk, C, BM=cfg.block_m, BN=cfg.block_n, DOT_SCAN=cfg.dot_scan, **meta,
            num_warps=cfg.warps, num_stages=2 if q_idx.is_cuda else 1)
        return
    _gather_kernel[(triton.cdiv(t1 - t0, cfg.block_m), B)](
        *args, th, val, idx, nrow, *strides, val.stride(0), val.stride(1), nrow.stride(0), t1, S, t0, q_offset,
        sink, window, topk, C, BM=cfg.block_m, BN=cfg.block_n, DOT_SCAN=cfg.dot_scan, **meta,
        num_warps=cfg.warps, num_stages=2 if q_idx.is_cuda else 1)


def cand_select(val, idx, nrow, out, topk, cfg: CandConfig):
    """Phase 4: one program a row, the exact top-k of its buffer into out `[B, Tc, topk]` (rows < 0 skipped)."""
    B, Tc = out.shape[:2]
    CB = triton.next_power_of_2(val.shape[2])
    if cfg.select_impl not in SELECT_IMPLS:
        raise ValueError(f"select_impl {cfg.select_impl!r}: expected one of {', '.join(SELECT_IMPLS)}")
    if cfg.select_impl == "cuda" and cfg.packed and val.is_cuda:
        from sparse_rl.sparse.ops.indexer_topk import cand_cuda

        if val.shape[2] <= cand_cuda.MAX_SLOTS and cand_cuda.available(cuda_index(val.device)):
            cand_cuda.buffer_select(val, nrow, out, topk, raw=cfg.gather == "words")
            return
    if cfg.packed:
        _select_packed_kernel[(B * Tc,)](val, nrow, out, Tc, val.stride(0), val.stride(1), nrow.stride(0),
                                         out.stride(0), out.stride(1), topk, CB=CB, KB=min(1024, CB),
                                         RAW=cfg.gather == "words", STEP2=cfg.search_bits == 2,
                                         LEAN=cfg.select_lean, CM=_compact(cfg.select_compact, topk, 32),
                                         num_warps=cfg.select_warps,
                                         **maxnreg_option(cfg.select_maxnreg, val))
        return
    _select_kernel[(B * Tc,)](val, idx, nrow, out, Tc, val.stride(0), val.stride(1), nrow.stride(0), out.stride(0),
                              out.stride(1), topk, CB=CB, KB=min(1024, CB), STEP2=cfg.search_bits == 2,
                              num_warps=cfg.select_warps)


def redo_tiles(q_idx, w, k_idx, kvs, bad, t0, q_offset, topk, sink, window, out, tile: int):
    """The exact rows of every `tile`-row span of the chunk holding a flagged row (bad `[B, Tc]`): its scores
    materialised (`scores.indexer_scores_chunk`, the gather's score tiles) and `bin_topk`; consecutive
    flagged spans go in one launch pair. out `[B, T, topk]` is written for the whole spans (the same rows)."""
    T, S = q_idx.shape[1], k_idx.shape[1]
    tiles = bad.any(0)
    tiles = torch.nn.functional.pad(tiles, (0, (-tiles.numel()) % tile)).view(-1, tile).any(1).nonzero().flatten()
    runs, prev = [], None
    for i in tiles.tolist():
        if prev is not None and i == prev + 1 and (i + 1 - runs[-1][0]) * tile * S * 4 <= 1 << 30:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
        prev = i
    for a, b in runs:
        r0, r1 = t0 + a * tile, min(T, t0 + b * tile)
        S_c = max(1, min(S, q_offset + r1))
        scores = indexer_scores_chunk(q_idx, w, k_idx, kvs, r0, r1, S_c, q_offset, sink, window)
        bin_topk(scores, topk, q_lim=q_offset + r0, out=out[:, r0:r1])


@torch.no_grad()
def indexer_topk_cand(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, topk: int, *, q_offset: int = 0,
                      sink: int = 0, window: int = 0, kv_start: torch.Tensor | None = None,
                      budget_bytes: int | None = None, slots: int | None = None, config: CandConfig | None = None,
                      info: dict | None = None) -> torch.Tensor:
    """See the module docstring. q_idx `[B, T, H_I, D_I]`, w `[B, T, H_I]`, k_idx `[B, S, D_I]` (T, S >= 1; the
    caller, `triton.indexer_topk`, checks dtypes) -> `[B, T, topk]` int32. slots: buffer entries a row (default
    `stream_buffer_slots(topk)`, 2k rounded up to a power of two); budget_bytes: the buffers' bytes (default
    `buffer_budget`), which set the rows a chunk; config: `CandConfig()` on CUDA, `INTERPRET_CAND` otherwise; info
    (costs a sync per chunk): mean buffer entries a served row, rows redone."""
    B, T = q_idx.shape[:2]
    S = k_idx.shape[1]
    dev = q_idx.device
    cfg = config or (CandConfig() if q_idx.is_cuda else INTERPRET_CAND)
    C = slots or stream_buffer_slots(topk)
    kvs = _kv_start(kv_start, B, dev)
    R = sample_stride(cfg, S)
    SW = triton.cdiv(min(S, q_offset + T), R) if cfg.threshold == "sample" else 1
    budget = budget_bytes or buffer_budget(dev)
    BM = cfg.block_m
    chunk = even_chunk(T, max(BM, min(T, budget // (B * (8 * C + 4 * SW))) // BM * BM), BM)
    rows = min(T, chunk)
    val = torch.empty(B, rows, C, device=dev, dtype=torch.int64 if cfg.packed else torch.float32)
    idx = val if cfg.packed else torch.empty(B, rows, C, device=dev, dtype=torch.int32)
    smp = torch.empty(B, rows, SW, device=dev, dtype=torch.float32)
    small = torch.empty(2, B, rows, device=dev, dtype=torch.int32)  # entry counts, thresholds (fp32 bits)
    nrow, th = small[0], small[1].view(torch.float32)
    # the ahead redo only where its rows alone could not reach the tie path (which would redo them again)
    ahead = cfg.redo_ahead if B == 1 and cfg.redo == "decode" and not _takes_ties(cfg, cfg.redo_ahead, S) else 0
    out_full = torch.empty(B, T + (ahead > 0), topk, dtype=torch.int32, device=dev)  # + the ahead redo's scratch row
    out = out_full[:, :T]
    entries, redone, tied = 0, 0, 0
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        cand_threshold(q_idx, w, k_idx, kvs, t0, t1, q_offset, sink, window, topk, C, th, smp, cfg)
        cand_gather(q_idx, w, k_idx, kvs, t0, t1, q_offset, sink, window, topk, th, val, idx, nrow, cfg)
        cand_select(val, idx, nrow, out[:, t0:t1], topk, cfg)
        bad = nrow[:, :t1 - t0] < 0
        done = -1  # flagged rows the ahead redo served (-1: none; more than `ahead`: all redone again below)
        if ahead:  # the first `ahead` flagged rows redone before their count is read (cand_redo.py)
            from sparse_rl.sparse.ops.indexer_topk.cand_redo import redo_ahead

            n = redo_ahead(q_idx, w, k_idx, kvs, bad, t0, q_offset, topk, sink, window, out_full, ahead)()
            done = n if n <= ahead else -1
        nbad = 0
        if done < 0:
            flagged = bad.nonzero()  # the chunk's one host sync where no row is flagged: the rows and their count
            nbad = flagged.shape[0]
        if nbad and _takes_ties(cfg, nbad, S):  # equal scores at the threshold
            from sparse_rl.sparse.ops.indexer_topk.cand_ties import resolve_ties

            resolve_ties(q_idx, w, k_idx, kvs, bad, th, val, nrow, out[:, t0:t1], t0, q_offset, topk, sink, window,
                         cfg)
            bad = nrow[:, :t1 - t0] < 0
            flagged = bad.nonzero()
            tied += nbad - flagged.shape[0]
            nbad = flagged.shape[0]
        if info is not None:
            entries += int(nrow[:, :t1 - t0].clamp(min=0).sum())
        redone += max(done, 0)
        if nbad:
            redone += nbad
            if cfg.redo == "decode":
                _redo_rows(q_idx, w, k_idx, kvs, bad, t0, q_offset, topk, sink, window, out, rows=flagged)
            else:
                redo_tiles(q_idx, w, k_idx, kvs, bad, t0, q_offset, topk, sink, window, out, BM)
    if info is not None:
        info.update(mean_entries=entries / max(1, B * T - redone), redone_rows=redone, tie_rows=tied, slots=C,
                    sample_stride=R)
    return out
