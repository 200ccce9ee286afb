"""The decode select with its histogram built by the score pass itself (`indexer_topk_decode(impl="bits")`):
after the score pass, one (chunk, row) launch whose last program per row resolves the threshold, and one
(chunk, row) launch that writes; a memset before (the histogram and the row tickets).

Why: the fine select (decode_fine.py) bins over the row's span (max - min), which is known only once every
chunk's scores are in, so it needs a histogram pass, a sub-bin pass and a resolve pass after the score, each
latency-bound at decode sizes (H200, 32 x 16K, session-9 profile: 4.9 + 9.1 + 22.8 us a layer after a 20 us
score pass, whose index keys take ~16 us). Bins fixed in advance need no span: here a key's bin is its
score's fp16 image (sign, 5 exponent and the top 5 mantissa bits: ~3% wide, as TensorRT-LLM's DSA decode
top-k bins the fp16 bits), 2048 bins, counted by the score pass with one global atomic per key into the
row's histogram `[B, NBB]`. Then:

1. `_gather` (chunk p of row b): b*, the bin holding the k-th largest score (forced keys in the top bin),
   and the rank left in it, from the row's histogram (every program reads the same 8 KB); the chunk's count
   of keys above b* and its keys in b* (u = okey(score), position) to the chunk's own region of the row's
   list (`c0 + slot`: no cross-chunk offsets). Each program then takes a ticket on its row; the row's last
   program (the tile-counter pattern of ops/skinny_gemm) resolves the threshold among b*'s ~100 keys:
   - every key of b* is taken (rem = its count), or
   - b* is the exact-zero bin (a key whose every index head's ReLU is 0: ~1/16 of the keys with 4 heads,
     one tie block): the later `rem` zeros in key order, from the chunks' counts alone, or
   - at most RW keys a chunk: one [PMAX, RW] tile of (u, position) pairs, one in-register sort, the
     rem-th largest is (tau, cut), or
   - else (many equal scores): the regions compacted into one list and the exact radix levels
     (`decode_steps._radix_threshold`),
   and writes (b*, tau, cut) and each chunk's output offset.
2. `_write`: every chunk emits its selected positions (forced, bin above b*, or in b* with (u, position)
   >= (tau, cut): ties to the later key, the reference's rule) in ascending order; the row's last pads -1.

Measured (H200, Qwen3-4B shape, batch 32, random caches; benchmarks/results/2026-12-02-h200-rollout-session10.md,
call 2): exact (== the reference on integer ties, == fine on random rows at 32 x 16K and 16 x 32K), but SLOWER
than the fine select in the step: 7.089 / 8.046 / 8.982 ms at 2304 / 8192 / 16384 against 6.515 / 7.568 / 8.763
(2 warps: slower still). Profile at 32 x 16K: the score pass 26.4 us a layer with the atomics (20.2 without),
`_gather` 32.9 (its row's last program sorting a 1,024-slot int64 tile after the row's other programs: a serial
tail), `_write` 4.5, the memset 0.8: 64.6 us a layer against fine's ~57. Opt-in, not the default. Next, if
taken up: rank the ~100 keys of b* compacted to a [128] list (no 1,024-slot sort), and a per-program histogram
merged once instead of one atomic a key.

Bins: code(x) = top 11 bits of the order-preserving 16-bit image of fp16(clamp(x, +-65504)), plus 1 for
x > 0, so that exact zeros (+0 and -0: equal scores) are alone in code 1024 and tiny nonzero scores that
round to fp16 zero fall beside it; forced keys (+inf) take code NBB - 1. Monotone in x (fp16 rounding
is), equal scores share a code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.decode_steps import _emit, _pad_rest, _radix_threshold
from sparse_rl.sparse.ops.indexer_topk.radix_topk import _okey

NBB = 2048  # bins: the fp16 image's top 11 bits
ZCODE = 1024  # the bin of exact zeros
U0 = tl.constexpr(0x80000000)  # okey(0.0)
RW_SLOTS = 1024  # the last program's sort tile, [PMAX, RW_SLOTS // PMAX] (u, position) pairs


@triton.jit
def _code(x, NBB: tl.constexpr):
    """Bin `[BN]` int32 of scores x (see the module docstring); +inf (forced) -> NBB - 1."""
    xz = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0
    h = tl.minimum(tl.maximum(xz, -65504.0), 65504.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    k16 = tl.where((h & 0x8000) != 0, (~h) & 0xFFFF, h | 0x8000)
    code = (k16 >> 5) + (xz > 0.0).to(tl.int32)
    return tl.where(x == float("inf"), NBB - 1, code)


@triton.jit
def _keys(SC, b, S, pos, n0, BN: tl.constexpr, NBB: tl.constexpr):
    """Keys n0..n0+BN-1 of row b: positions, visibility (scored, not -inf), bin and u = okey(score)."""
    offs_n = n0 + tl.arange(0, BN)
    x = tl.load(SC + b * S + offs_n, mask=(offs_n <= pos) & (offs_n < S), other=float("-inf"))
    return offs_n, x > float("-inf"), _code(x, NBB), _okey(x)


@triton.jit
def _bstar_bits(HIST, b, K, NBB: tl.constexpr):
    """From the row's histogram `[NBB]`: b* (the highest bin whose keys and those above reach K; -1 when the
    row has at most K visible keys: all are taken) and the rank left inside it (>= 1)."""
    bins = tl.arange(0, NBB)
    h = tl.load(HIST + b * NBB + bins)
    total = tl.sum(h, 0)
    suf = total - tl.cumsum(h, 0) + h  # keys in bins >= c
    bstar = tl.where(total <= K, -1, tl.sum((suf >= K).to(tl.int32), 0) - 1)
    rem = K - tl.sum(tl.where(bins > bstar, h, 0), 0)
    return bstar, rem, tl.sum(tl.where(bins == bstar, h, 0), 0)


@triton.jit
def _resolve(CNT, CU, CI, CU2, CI2, TC, OFF, b, S, K, P, bstar, rem, n_b, CH: tl.constexpr, PMAX: tl.constexpr,
             RW: tl.constexpr, BLOCK: tl.constexpr):
    """The row's last `_gather` program: (tau, cut) among b*'s keys, each chunk's output offset `[P]`."""
    offs_p = tl.arange(0, PMAX)
    pm = offs_p < P
    above = tl.load(CNT + (b * P + offs_p) * 2, mask=pm, other=0, cache_modifier=".cg")
    inb = tl.load(CNT + (b * P + offs_p) * 2 + 1, mask=pm, other=0, cache_modifier=".cg")
    tau = tl.zeros([], tl.uint32)  # (0, 0): every key of b* is kept
    cut = 0
    kept = inb
    if (bstar >= 0) & (rem < n_b):
        if bstar == 1024:  # ZCODE, exact zeros, one tie block: the later rem in key order
            later = n_b - tl.cumsum(inb, 0)  # b* keys in the chunks after each
            kept = tl.minimum(tl.maximum(rem - later, 0), inb)
            cfirst = tl.min(tl.where(kept > 0, offs_p, PMAX), 0)
            j = tl.sum(tl.where(offs_p == cfirst, inb - kept, 0), 0)
            tau = tl.full([], U0, tl.uint32)
            cut = tl.load(CI + b * S + cfirst * CH + j, cache_modifier=".cg")
        elif tl.max(inb, 0) <= RW:  # one tile, one sort: the rem-th largest (u, position)
            offs_r = tl.arange(0, RW)
            live = pm[:, None] & (offs_r[None, :] < inb[:, None])
            at = b * S + offs_p[:, None] * CH + offs_r[None, :]
            u = tl.load(CU + at, mask=live, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
            idx = tl.load(CI + at, mask=live, other=0, cache_modifier=".cg")
            hi = (u ^ 0x80000000).to(tl.int32, bitcast=True).to(tl.int64)
            key = tl.where(live, (hi << 32) | idx.to(tl.int64), -9223372036854775807 - 1)
            flat = tl.sort(tl.reshape(key, [PMAX * RW]), descending=True)
            kth = tl.sum(tl.where(tl.arange(0, PMAX * RW) == rem - 1, flat, 0), 0)
            tau = ((kth >> 32).to(tl.int32) ^ -2147483648).to(tl.uint32, bitcast=True)
            cut = (kth & 0xFFFFFFFF).to(tl.int32)
            kept = tl.sum((live & (key >= kth)).to(tl.int32), 1)
        else:  # many equal scores: the regions into one list, then the exact radix levels
            n = 0
            offs = tl.arange(0, BLOCK)
            for c in range(0, P):
                nc = tl.load(CNT + (b * P + c) * 2 + 1, cache_modifier=".cg")
                for j0 in range(0, nc, BLOCK):
                    m = j0 + offs < nc
                    src = b * S + c * CH + j0 + offs
                    tl.store(CU2 + b * S + n + j0 + offs, tl.load(CU + src, mask=m, cache_modifier=".cg"), mask=m)
                    tl.store(CI2 + b * S + n + j0 + offs, tl.load(CI + src, mask=m, cache_modifier=".cg"), mask=m)
                n += nc
            tl.debug_barrier()  # the list is written before the radix levels read it
            tau, cut, kept = _radix_threshold(CU2, CI2, b, S, n_b, rem, CH, PMAX, BLOCK)
    emit = above + kept
    tl.store(OFF + b * P + offs_p, tl.cumsum(emit, 0) - emit, mask=pm)
    tl.store(TC + b * 4, bstar)
    tl.store(TC + b * 4 + 1, tau.to(tl.int32, bitcast=True))
    tl.store(TC + b * 4 + 2, cut)
    tl.store(TC + b * 4 + 3, tl.sum(emit, 0))


@triton.jit
def _gather(SC, POS, HIST, CNT, TICK, CU, CI, CU2, CI2, TC, OFF, S, K, P, CH: tl.constexpr, BN: tl.constexpr,
            NBB: tl.constexpr, PMAX: tl.constexpr, RW: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    bstar, rem, n_b = _bstar_bits(HIST, b, K, NBB)
    above = 0
    off = 0
    if c0 <= pos:
        for i in range(0, CH // BN):
            offs_n, vis, code, u = _keys(SC, b, S, pos, c0 + i * BN, BN, NBB)
            above += tl.sum((vis & (code > bstar)).to(tl.int32), 0)
            m = vis & (code == bstar)
            slot = b * S + c0 + off + tl.cumsum(m.to(tl.int32), 0) - 1
            tl.store(CU + slot, u.to(tl.int32, bitcast=True), mask=m)
            tl.store(CI + slot, offs_n, mask=m)
            off += tl.sum(m.to(tl.int32), 0)
    tl.store(CNT + (b * P + p) * 2, above)
    tl.store(CNT + (b * P + p) * 2 + 1, off)
    tl.debug_barrier()  # every thread's stores are done before the ticket releases them
    if tl.atomic_add(TICK + b, 1, sem="acq_rel") == P - 1:  # the row's last program
        _resolve(CNT, CU, CI, CU2, CI2, TC, OFF, b, S, K, P, bstar, rem, n_b, CH, PMAX, RW, BLOCK)


@triton.jit
def _write(SC, POS, TC, OFF, OUT, sob, S, K, P, CH: tl.constexpr, BN: tl.constexpr, NBB: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    if c0 <= pos:
        bstar = tl.load(TC + b * 4)
        tau = tl.load(TC + b * 4 + 1).to(tl.uint32, bitcast=True)
        cut = tl.load(TC + b * 4 + 2)
        off = tl.load(OFF + b * P + p)
        for i in range(0, CH // BN):
            offs_n, vis, code, u = _keys(SC, b, S, pos, c0 + i * BN, BN, NBB)
            sel = vis & ((code > bstar) | ((code == bstar) & ((u > tau) | ((u == tau) & (offs_n >= cut)))))
            off = _emit(OUT, b, sob, offs_n, sel, off)
    if p == P - 1:
        _pad_rest(OUT, b, sob, tl.load(TC + b * 4 + 3), K, BN)


def bits_scratch(B: int, device) -> torch.Tensor:
    """The score pass's histogram `[B, NBB]` and the row tickets `[B]`, zeroed (one memset a call)."""
    return torch.zeros(B * (NBB + 1), device=device, dtype=torch.int32)


def bits_select(sc: torch.Tensor, pos: torch.Tensor, scratch: torch.Tensor, topk: int, chunk: int, block: int, *,
                num_warps: int, interpret: bool, rw: int | None = None) -> torch.Tensor:
    """The select after `decode._score_max(BITS=True)` filled scratch's histogram: sc `[B, S]` fp32 scores,
    pos `[B]` int32 -> `[B, topk]` int32 ascending, -1 padded (block: keys a step of each chunk's loop; rw: the
    most b* keys a chunk for the sort tile, a power of two, default RW_SLOTS // PMAX; more take the radix levels)."""
    B, S = sc.shape
    P = triton.cdiv(S, chunk)
    PMAX = max(16, triton.next_power_of_2(P))
    dev = sc.device
    hist, tick = scratch[:B * NBB], scratch[B * NBB:]
    cnt = torch.empty(B, P, 2, device=dev, dtype=torch.int32)
    cu, ci, cu2, ci2 = (torch.empty(B, S, device=dev, dtype=torch.int32) for _ in range(4))
    tc = torch.empty(B, 4, device=dev, dtype=torch.int32)
    off = torch.empty(B, P, device=dev, dtype=torch.int32)
    out = torch.empty(B, topk, device=dev, dtype=torch.int32)
    grid = (P, B)
    _gather[grid](sc, pos, hist, cnt, tick, cu, ci, cu2, ci2, tc, off, S, topk, P, CH=chunk, BN=block, NBB=NBB,
                  PMAX=PMAX, RW=rw or max(1, RW_SLOTS // PMAX), BLOCK=64 if interpret else 1024, num_warps=num_warps)
    _write[grid](sc, pos, tc, off, out, out.stride(0), S, topk, P, CH=chunk, BN=block, NBB=NBB, num_warps=num_warps)
    return out
