"""The decode select in one launch (`indexer_topk_decode(impl="sync")`): the index scores, four 8-bit radix
levels and the write, the row's (chunk) programs meeting at in-kernel barriers between them.

Why: the other forms pay a launch per pass. On the H200 (Qwen3-4B shape, batch 32) the fine select's chain (score
pass + three (chunk, row) launches) took ~26 us a layer at 2.3K context, where its bytes are nothing, and ~80 us
at 16K (session 13 profile, results/2026-12-02-h200-lead-session13.md): ~0.9-2.2 ms of a 6.3-8.5 ms step, against
~0.5 ms for the index keys read at the copy bandwidth. What separates the passes is a sum over the row's chunks
(a histogram), which needs every chunk's program to have finished the pass before. Here each program publishes its
chunk's histogram, arrives at the row's counter (release) and waits for the row's other programs (acquire), so a
pass boundary costs an L2 round trip instead of a launch.

One program per (chunk, row), `CH` keys each:
1. scores of the chunk (`_score_stage`: +inf forced, the visible keys only) to a `[B, S]` fp32
   scratch, and the chunk's histogram of the top 8 bits of u = okey(score) (larger u = larger score).
2. for each level l = 0..3: barrier; the row's histogram of level l (the sum of its chunks') gives the digit d*
   holding the rem-th largest remaining key (rem starts at K); each chunk's keys above d* are counted for the
   output offsets; if d*'s keys are exactly the rem left (or l = 3) the threshold is resolved, else each
   program histograms the next 8 bits of its keys whose first 8(l+1) bits equal the prefix.
3. the keys whose resolved prefix is above the threshold's are kept; of those equal to it (exact ties once all 32
   bits are resolved) the rem latest, the reference's rule (ties to the later key): a chunk takes its latest ones
   after the later chunks' are counted. Each program writes its kept positions in ascending order at the offset
   the earlier chunks' counts give; the row's last visible chunk pads with -1.
A row with at most K visible keys keeps them all (no level is needed).

The barriers need every program of a row resident at once: the grid is sized to the programs the SMs hold at
once (`_resident_plan`: the compiled kernel's registers and shared memory, before its first launch), and the
kernel lets the next PDL kernel launch only when its last barrier is passed (a dependent's waiting programs would
otherwise hold SMs the row still needs).
The row's counters return to zero at the end of every launch (its last program resets them), so one zeroed
buffer per device serves every launch (`_counters`).

Under TRITON_INTERPRET (programs run one after another: a barrier would never open) and with `phased=True`,
the same kernel runs as five launches, PHASE 1..5, each doing one stage and re-deriving the earlier levels'
results from the stored histograms: the barrier's place taken by the launch boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.decode_steps import _emit, _key_tile, _pad_rest, _query_of, _tile_scores
from sparse_rl.sparse.ops.indexer_topk.radix_topk import _okey
from sparse_rl.sparse.ops._backend import grown_counters

NR = 256  # bins of a radix level (8 bits)
MAX_CHUNKS = 32  # a row's chunks at most: each program sums `[CMAX, NR]` histograms in registers
MIN_CHUNK = 256  # keys a program at least (shorter rows take fewer chunks)
# Triton 3.6 compiles the one-launch kernel (4 warps, 64-key steps, sm_90a) to 188-228 registers (2 programs an
# SM); its stages alone take 128 (scores + histogram) and 123 (levels + write): capped at 128 it keeps 24 B of
# stack and 4 programs an SM stay resident (benchmarks/sm90_sync.py)
MAXNREG = 128
# the later stages' step over the chunk's stored scores: at 4 warps and a 128-key score step, 256 keys took the
# one-launch select from 19.3 / 61.7 / 67.3 / 25.7 us a layer (rescans at the score step) to 18.6 / 53.4 / 59.6 /
# 23.3 at 32 x 2304 / 32 x 16K / 16 x 32K / 1 x 16K, against the fine select's 21.2 / 64.0 / 64.1 / 30.7
# (H200, one CUDA graph of 34 launches at PDL 2; results/2026-12-03-h200-sync-session15.md)
RESCAN = 256
# measured (H200, session 15, call 5): keep, 17.7 / 45.7 / 55.8 / 22.9 us alone at 32 x 2304 / 32 x 16K / 16 x 32K /
# 1 x 16K, the step at 32 x 16K -0.28 ms against fine but +0.17 at 16 x 32K and +0.29 at batch 1, where a row has
# 32 chunks (a [32, 256] histogram load a level spills at the 128-register cap); split 2 + keep slower than fine in
# every step row (its extra launch and a score launch at 2 programs an SM): split off by default (`sync_split`)
KEEP_MAX = 2048  # the longest chunk held in registers
# the default: keep, at most 16 chunks a row. Session 16 (results/2026-12-03-h200-sync-session16.md), the step
# against fine (ms, three interleaved reps): 32 x 16K 8.18-8.21 vs 8.49-8.55, 32 x 2304 6.29 vs 6.31-6.32, 16 x 32K
# 7.41-7.43 vs 7.38-7.40, batch 1 16K 4.10 vs 3.92-3.94; alone 17.6 / 45.6 / 57.1 / 22.6 us (fine 21.2 / 64.2 /
# 64.0 / 30.4). At most 8 chunks: slower from 16K on (8.47 / 8.20 / 4.72 ms), faster at 32 x 2304 (6.20)
DEFAULT_CHUNKS = 16


@triton.jit
def _row_barrier(ARR, b, target):
    """Program arrives at row b's counter and waits until it reads `target`: every store the program made
    before is visible to the row's programs after theirs (the CTA barrier orders its threads' stores
    before the one thread's release; the acquire and the CTA barrier after it order the loads that follow)."""
    tl.debug_barrier()
    tl.atomic_add(ARR + b, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(ARR + b, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(ARR + b, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _level(H, H0, b, lv, nvis, nvis0, rem, above, CMAX: tl.constexpr, M: tl.constexpr):
    """Level lv of row b from its chunks' histograms H `[B, 4, CMAX, NR]` (level 0: H0 `[B, CMAX * M, NR]`, M
    score chunks a chunk): the digit d* holding the rem-th largest key of those matching the prefix, -> (d*,
    above `[CMAX]` plus each chunk's keys above d*, each chunk's keys in d* `[CMAX]`, the rem left within d*, d*'s
    count in the row, the row's keys at this level, each chunk's `[CMAX]`)."""
    offs_c = tl.arange(0, CMAX)
    offs_d = tl.arange(0, 256)
    if lv == 0:
        offs_m = tl.arange(0, CMAX * M)
        h = tl.load(H0 + (b * CMAX * M + offs_m[:, None]) * 256 + offs_d[None, :],
                    mask=offs_m[:, None] < nvis0, other=0, cache_modifier=".cg")  # score chunks past pos: unwritten
        if M > 1:
            h = tl.sum(tl.reshape(h, [CMAX, M, 256]), 1)
    else:
        h = tl.load(H + ((b * 4 + lv) * CMAX + offs_c[:, None]) * 256 + offs_d[None, :], mask=offs_c[:, None] < nvis,
                    other=0, cache_modifier=".cg")  # [CMAX, NR] (.cg: other SMs wrote it, past this SM's L1)
    row = tl.sum(h, 0)  # [NR]
    ge = tl.sum(row, 0) - tl.cumsum(row, 0) + row  # keys with digit >= d
    dstar = tl.max(tl.where(ge >= rem, offs_d, -1), 0)
    hi = offs_d[None, :] > dstar
    above += tl.sum(tl.where(hi, h, 0), 1)
    ties = tl.sum(tl.where(offs_d[None, :] == dstar, h, 0), 1)
    rem = rem - tl.sum(tl.where(offs_d > dstar, row, 0), 0)
    return dstar, above, ties, rem, tl.sum(ties, 0), tl.sum(row, 0), tl.sum(h, 1)


@triton.jit
def _score_stage(k, KS, SC, b, S, ssb, offs_n, vis, start, pos, sink, window, qt, wv, PREC: tl.constexpr,
                 FP8: tl.constexpr):
    """The key tile k's scores (+inf forced) stored to row b of SC -> their first-level histogram `[NR]`."""
    s = _tile_scores(k, KS, b, ssb, offs_n, vis, qt, wv, PREC, FP8)
    s = tl.where(vis & ((offs_n < start + sink) | (offs_n > pos - window)), float("inf"), s)
    tl.store(SC + b * S + offs_n, s, mask=vis)
    dig = tl.where(vis, (_okey(s) >> 24).to(tl.int32), 0)
    bins = tl.arange(0, 256)
    return tl.histogram(dig, 256) - tl.where(bins == 0, tl.sum((~vis).to(tl.int32), 0), 0)


@triton.jit
def _hist_of(u, vis, prefix, LV: tl.constexpr):
    """Histogram `[NR]` of level LV's digit of the keys u (where vis) whose first 8 * LV bits are prefix."""
    bins = tl.arange(0, 256)
    m = vis & ((u >> (32 - 8 * LV)) == prefix)
    dig = tl.where(m, ((u >> (24 - 8 * LV)) & 255).to(tl.int32), 0)
    return tl.histogram(dig, 256) - tl.where(bins == 0, tl.sum((~m).to(tl.int32), 0), 0)


@triton.jit
def _digits_hist(SC, b, S, pos, start, c0, CH, prefix, LV: tl.constexpr, BN: tl.constexpr):
    """The chunk's histogram `[NR]` of level LV's digit over its visible keys whose first 8 * LV bits are
    prefix (LV 1..3; the scores are this program's own stores), read BN keys a step."""
    hist = tl.zeros([256], tl.int32)
    for i in range(0, CH, BN):
        offs_n = c0 + i + tl.arange(0, BN)
        vis = (offs_n <= pos) & (offs_n >= start) & (offs_n < S) & (offs_n < c0 + CH)
        hist += _hist_of(_okey(tl.load(SC + b * S + offs_n, mask=vis, other=0.0)), vis, prefix, LV)
    return hist


@triton.jit
def _write_tile(OUT, b, sob, offs_w, vw, u, shift, prefix, first, seen, take_all, off):
    """Tile offs_w's kept positions (above the prefix, or ties from the chunk's `first`) to OUT from column off
    -> (next column, ties seen)."""
    v = u >> shift
    tie = vw & (v == prefix)
    order = seen + tl.cumsum(tie.to(tl.int32), 0) - 1
    sel = vw & ((v > prefix) | (tie & (order >= first)) | (take_all + tl.zeros_like(order) > 0))
    return _emit(OUT, b, sob, offs_w, sel, off), seen + tl.sum(tie.to(tl.int32), 0)


@triton.jit
def _sync_select(Q, W, KI, KS, POS, KVS, SC, H, H0, ARR, OUT, sqb, sqh, sqd, swb, swh, skb, sks, skd, ssb, sob,
                 S, K, sink, window, HI, DI, CH, NROW,
                 HB: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, CMAX: tl.constexpr,
                 PREC: tl.constexpr, FP8: tl.constexpr, HAS_START: tl.constexpr, PHASE: tl.constexpr,
                 PREFETCH: tl.constexpr = False, PDL: tl.constexpr = 0, SPLIT: tl.constexpr = False,
                 M: tl.constexpr = 1, KEEP: tl.constexpr = False):
    if PHASE <= 1:
        if PDL:
            tl.extra.cuda.gdc_wait()  # no load before the previous kernel is done
        if PDL == 3:  # dependents may launch once every program of this grid has reached here: all are resident
            tl.extra.cuda.gdc_launch_dependents()
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    if HAS_START:  # left padding: the row's first valid key
        start = tl.load(KVS + b)
    else:
        start = 0
    c0 = p * CH
    nvis = pos // CH + 1  # the row's programs that take part (the later chunks hold no visible key)
    nvis0 = pos // (CH // M) + 1  # the row's score chunks that wrote a first-level histogram
    offs_c = tl.arange(0, CMAX)
    bins = tl.arange(0, 256)
    if c0 <= pos:
        if (PHASE <= 1) & (not SPLIT):  # scores to the scratch and the first level's histogram
            qt, wv = _query_of(Q, W, b, sqb, sqh, sqd, swb, swh, HI, DI, HB, BD)
            hist = tl.zeros([256], tl.int32)
            if PREFETCH:  # the next tile's loads in flight while this one is scored
                offs_n = c0 + tl.arange(0, BN)
                vis = (offs_n <= pos) & (offs_n >= start) & (offs_n < S)
                k = _key_tile(KI, b, skb, sks, skd, offs_n, vis, DI, BD)
                for i in range(0, CH, BN):
                    nxt = offs_n + BN
                    vis_n = (nxt <= pos) & (nxt >= start) & (nxt < S) & (nxt < c0 + CH)
                    k_n = _key_tile(KI, b, skb, sks, skd, nxt, vis_n, DI, BD)
                    hist += _score_stage(k, KS, SC, b, S, ssb, offs_n, vis, start, pos, sink, window, qt, wv, PREC, FP8)
                    offs_n, vis, k = nxt, vis_n, k_n
            else:
                for i in range(0, CH, BN):
                    offs_n = c0 + i + tl.arange(0, BN)
                    vis = (offs_n <= pos) & (offs_n >= start) & (offs_n < S) & (offs_n < c0 + CH)
                    k = _key_tile(KI, b, skb, sks, skd, offs_n, vis, DI, BD)
                    hist += _score_stage(k, KS, SC, b, S, ssb, offs_n, vis, start, pos, sink, window, qt, wv, PREC, FP8)
            tl.store(H0 + (b * CMAX * M + p) * 256 + bins, hist)
        if KEEP:  # the chunk's keys u in registers for every later stage (BR >= CH: one tile)
            if not SPLIT:
                tl.debug_barrier()  # the program's own score stores, by its other threads
            offs_k = c0 + tl.arange(0, BR)
            vk = (offs_k <= pos) & (offs_k >= start) & (offs_k < S) & (offs_k < c0 + CH)
            uk = _okey(tl.load(SC + b * S + offs_k, mask=vk, other=0.0))
        prefix = tl.zeros([], tl.uint32)
        rem = K + tl.zeros([], tl.int32)
        above = tl.zeros([CMAX], tl.int32)
        ties = tl.zeros([CMAX], tl.int32)
        levels = tl.zeros([], tl.int32)  # resolved levels: the threshold's prefix has 8 * levels bits
        done = tl.zeros([], tl.int32)
        take_all = tl.zeros([], tl.int32)
        for lv in tl.static_range(4):
            if done == 0:
                if (PHASE == 0) & ((lv > 0) | (not SPLIT)):  # SPLIT: level 0 came from the score launch before
                    _row_barrier(ARR, b, (lv + 1 - SPLIT) * nvis)
                if (PHASE == 0) | (PHASE > lv + 1):
                    dstar, above, ties, rem, nbin, total, cnt = _level(H, H0, b, lv, nvis, nvis0, rem, above, CMAX, M)
                    prefix = (prefix << 8) | dstar.to(tl.uint32)
                    levels = tl.full([], lv + 1, tl.int32)
                    if lv == 3:  # all 32 bits resolved: what is left are exact ties
                        done = tl.full([], 1, tl.int32)
                    elif rem == nbin:  # the digit's keys are all kept
                        done = tl.full([], 1, tl.int32)
                    if lv == 0:
                        if total <= K:  # every visible key is kept
                            take_all = tl.full([], 1, tl.int32)
                            above = cnt
                            done = tl.full([], 1, tl.int32)
                    if lv < 3:
                        if done == 0:
                            if (PHASE == 0) | (PHASE == lv + 2):
                                if KEEP:
                                    hist = _hist_of(uk, vk, prefix, lv + 1)
                                else:
                                    hist = _digits_hist(SC, b, S, pos, start, c0, CH, prefix, lv + 1, BR)
                                tl.store(H + ((b * 4 + lv + 1) * CMAX + p) * 256 + bins, hist)
        if (PHASE == 0) | (PHASE == 5):
            if PDL == 2:
                tl.extra.cuda.gdc_launch_dependents()  # every program of the grid is past its barriers
            # ties: each chunk keeps its latest ones after the later chunks' (ties to the later key)
            later = tl.sum(ties, 0) - tl.cumsum(ties, 0)
            take = tl.minimum(tl.maximum(rem - later, 0), ties)
            take = tl.where(take_all == 1, 0, take)
            emit = above + take
            off = tl.sum(tl.where(offs_c < p, emit, 0), 0)
            first = tl.sum(tl.where(offs_c == p, ties - take, 0), 0)  # the chunk's ties before `first` are dropped
            shift = 32 - 8 * levels
            seen = 0
            if KEEP:
                off, seen = _write_tile(OUT, b, sob, offs_k, vk, uk, shift, prefix, first, seen, take_all, off)
            else:
                for i in range(0, CH, BR):
                    offs_w = c0 + i + tl.arange(0, BR)
                    vw = (offs_w <= pos) & (offs_w >= start) & (offs_w < S) & (offs_w < c0 + CH)
                    uw = _okey(tl.load(SC + b * S + offs_w, mask=vw, other=0.0))
                    off, seen = _write_tile(OUT, b, sob, offs_w, vw, uw, shift, prefix, first, seen, take_all, off)
            if p == nvis - 1:  # the last visible chunk's end is the row's count: pad the rest with -1
                _pad_rest(OUT, b, sob, off, K, BR)
        if PHASE == 0:  # the row's last program to leave resets its counters for the next launch
            tl.debug_barrier()
            if tl.atomic_add(ARR + NROW + b, 1, sem="acq_rel", scope="gpu") == nvis - 1:
                tl.atomic_xchg(ARR + b, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(ARR + NROW + b, 0, sem="relaxed", scope="gpu")


_COUNTERS: dict = {}  # device -> zeroed int32 `[2, rows]` (arrivals, departures); every launch leaves it zeroed
_RESIDENT: dict = {}  # (device, CMAX, BR, KEEP, launch options) -> programs an SM holds of that compiled kernel


def _counters(dev: torch.device, B: int) -> torch.Tensor:
    """The row counters of the barriers `[2, >= B]`: one buffer per device (`_backend.grown_counters`; the kernels run
    in stream order, so a launch never shares its rows' counters with another)."""
    return grown_counters(_COUNTERS, dev, B, 64, lead=(2,))


def _occupancy(kernel, num_warps: int, dev: torch.device) -> int:
    """Programs of `kernel` (a compiled Triton kernel) one SM holds at once: registers, shared memory, warps."""
    prop = torch.cuda.get_device_properties(dev)
    regs = max(1, getattr(kernel, "n_regs", 255) or 255)
    per_warp = -(-regs * 32 // 256) * 256  # registers are allocated per warp in 256-register units
    by_regs = getattr(prop, "regs_per_multiprocessor", 65536) // (per_warp * num_warps)
    smem = getattr(kernel, "metadata", None)
    shared = getattr(smem, "shared", 0) if smem is not None else 0
    by_smem = (getattr(prop, "shared_memory_per_multiprocessor", 233472) // (shared + 1024)) if shared else 32
    by_warps = getattr(prop, "max_threads_per_multi_processor", 2048) // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_warps, 32))


def sync_chunks(B: int, S: int, programs: int, block: int, max_chunks: int = MAX_CHUNKS) -> tuple[int, int]:
    """(keys a program CH, chunks a row P) with B x P <= programs (every row's programs resident at once), at
    most max_chunks a row and at least MIN_CHUNK keys a chunk where the row has them; CH a multiple of block."""
    p = max(1, min(max_chunks, programs // max(1, B), triton.cdiv(S, MIN_CHUNK)))
    ch = triton.cdiv(triton.cdiv(S, p), block) * block
    return ch, triton.cdiv(S, ch)


def sync_select(q_idx, w, k_idx, k_scale, pos, kvs, topk: int, sink: int, window: int, has_start: bool, *,
                block: int = 0, num_warps: int = 4, per_sm: int = 0, phased: bool = False, pdl: int = 0,
                chunk: int | None = None, maxnreg: int = MAXNREG, prefetch: bool = False,
                rescan: int = 0, early: bool = False, split: int = 0, keep: bool = True,
                max_chunks: int | None = None, coop: bool = True) -> torch.Tensor:
    """`indexer_topk_decode`'s selection in one launch (`phased`, or under the interpreter: five). q_idx
    `[B, H_I, D_I]`, w `[B, H_I]`, k_idx `[B, S, D_I]` (fp8 with k_scale `[B, S]`), pos / kvs `[B]` int32 ->
    `[B, topk]` int32 ascending, -1 padded. block: keys a step of the score stage (0: 128 on a GPU); per_sm: at
    most this many programs an SM (0: 4; fewer where the compiled kernel fits fewer: `_resident_plan`); chunk: the keys a program, forced (tests; must keep the row's programs
    resident); maxnreg: a register cap for the one-launch kernel (0: the compiler's choice); prefetch: the score
    stage loads its next key tile before scoring the current one; rescan: the keys a step of the later stages'
    passes over the chunk's stored scores (0: RESCAN); early: at PDL 2, the next kernel may launch as soon as
    every program has started (they are all resident then), not only after the last barrier; split: the scores
    and the first histogram in a launch of their own before, `split` programs a chunk (no barrier: as many
    programs as the SMs take), the levels and the write in the barrier launch (0: one launch); keep: the chunk's
    keys held in registers from the score stage on (one [pow2 >= chunk] tile, no rescans; only where the chunk
    fits KEEP_MAX; the default); max_chunks: a row's chunks at most (default DEFAULT_CHUNKS, at most MAX_CHUNKS); coop:
    the barrier launch as a cooperative grid (CUDA then guarantees its programs co-resident, or refuses the launch,
    also beside other streams' kernels; the default: no slower than a plain launch in the H200's step, session 17)."""
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

    B, HI, DI = q_idx.shape
    S = k_idx.shape[1]
    dev = q_idx.device
    interpret = not q_idx.is_cuda
    phased = phased or interpret
    BN = block or (16 if interpret else 128)
    fp8 = k_scale is not None
    const = dict(HB=max(16, triton.next_power_of_2(HI)), BD=max(16, triton.next_power_of_2(DI)), BN=BN,
                 PREC=dot_precision(q_idx.dtype), FP8=fp8, HAS_START=has_start, PREFETCH=prefetch)
    mc = max_chunks or DEFAULT_CHUNKS
    M = max(1, split)
    step = M * BN  # a chunk is M score chunks of whole score steps
    level = 3 if pdl == 2 and early else pdl  # 3: PDL 2 with the dependents' launch at entry
    opts = dict(PHASE=0, PDL=level, num_warps=num_warps, launch_pdl=bool(pdl), SPLIT=bool(split), M=M, **const,
                **({"maxnreg": maxnreg} if maxnreg else {}), **({"launch_cooperative_grid": True} if coop else {}))

    def launch_args(CH, CMAX):
        sc = torch.empty(B, S, device=dev, dtype=torch.float32)
        hist = torch.empty(B, 4, CMAX, NR, device=dev, dtype=torch.int32)
        hist0 = torch.empty(B, CMAX * M, NR, device=dev, dtype=torch.int32)
        out = torch.empty(B, topk, device=dev, dtype=torch.int32)
        arr = _counters(dev, B)
        return (q_idx, w, k_idx, k_scale if fp8 else sc, pos, kvs, sc, hist, hist0, arr, out, *q_idx.stride(),
                *w.stride(), *k_idx.stride(), k_scale.stride(0) if fp8 else 0, out.stride(0), S, topk, sink, window,
                HI, DI, CH, arr.shape[1])

    if chunk or interpret:
        CH, P = (chunk, triton.cdiv(S, chunk)) if chunk else sync_chunks(B, S, 4 * B, step, mc)
        CMAX = max(2, triton.next_power_of_2(P))
        BR = triton.next_power_of_2(CH) if keep else (rescan or min(32 if interpret else RESCAN,
                                                                    triton.next_power_of_2(CH)))
        KP = bool(keep) and BR >= CH and (maxnreg > 0 or interpret)  # one tile covers the chunk (else rescans)
    else:
        CH, P, CMAX, BR, KP = _resident_plan(B, S, step, mc, keep, maxnreg, rescan, per_sm, dev, opts, launch_args)
    if CH % step:
        raise ValueError(f"chunk ({CH}) must be a multiple of split x block ({M} x {BN})")
    if P > MAX_CHUNKS:
        raise ValueError(f"{P} chunks a row: at most {MAX_CHUNKS}")
    args = launch_args(CH, CMAX)
    out = args[10]
    grid = (P, B)
    sargs = list(args)
    sargs[-2] = CH // M  # the score stage's chunk: M of them a barrier chunk
    if phased:
        nw = 1 if interpret else num_warps
        _sync_select[(P * M, B)](*sargs, CMAX=CMAX, BR=BR, PHASE=1, M=M, num_warps=nw, **const)
        for phase in range(2, 6):
            _sync_select[grid](*args, CMAX=CMAX, BR=BR, PHASE=phase, M=M, KEEP=KP, num_warps=nw, **const)
        return out
    if split:
        _sync_select[(P * M, B)](*sargs, CMAX=CMAX, BR=BR, PHASE=1, PDL=3 if pdl else 0, M=M, num_warps=num_warps,
                                 launch_pdl=bool(pdl), **const)
    _sync_select[grid](*args, CMAX=CMAX, BR=BR, KEEP=KP, **opts)
    return out


def _resident_plan(B, S, step, mc, keep, maxnreg, rescan, per_sm, dev, opts, launch_args):
    """(CH, P, CMAX, BR, KEEP) for a GPU launch whose B x P programs are all resident at once. The chunks are planned
    for `per_sm` programs an SM (0: 4, what the 128-register cap gives at 4 warps), the kernel of that plan is
    compiled (not launched) and what an SM holds of it read from its registers, shared memory and warps; where that
    is fewer, the plan is made again for as many (a GPU with less shared memory than the H200's, an uncapped
    kernel), down to one an SM."""
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    want = per_sm or 4
    while True:
        ch, p = sync_chunks(B, S, sms * want, step, mc)
        CMAX = max(2, triton.next_power_of_2(p))
        # keys held in registers only under the cap (uncapped, their tile takes the compiler past 200 registers)
        BR = triton.next_power_of_2(ch) if keep and maxnreg and ch <= KEEP_MAX else (rescan or RESCAN)
        KP = bool(keep) and BR >= ch and maxnreg > 0
        key = (dev.index, CMAX, BR, KP, *sorted(opts.items()))
        fit = _RESIDENT.get(key)
        if fit is None:
            k = _sync_select.warmup(*launch_args(ch, CMAX), grid=(p, B), CMAX=CMAX, BR=BR, KEEP=KP, **opts)
            k._init_handles()  # loads the binary: its register count (Triton reads it from the driver)
            fit = _RESIDENT[key] = _occupancy(k, opts["num_warps"], dev)
        if fit >= want or want == 1:
            return ch, p, CMAX, BR, KP
        want = fit
