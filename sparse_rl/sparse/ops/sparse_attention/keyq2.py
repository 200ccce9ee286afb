"""keyq.py's dk/dv pass with two-level query lists: each 64-key tile's queries split by which 32-key halves they
selected in (`bwd_path="keyq2"`, issue 15).

Why: keyq.py runs one [rows, 64] MMA block per 128-row chunk of a key tile's query list, but on the trained
indexer's 32K rows a (64-key tile, query) pair holds ~27 of its 64 keys, so about half the MMA work is masked.
Many pairs touch only one 32-key half of the tile; here those go in a "lo" / "hi" list whose chunks run 32-wide
dots against that half only, half the MMA work of a 64-wide chunk. Pairs with keys in both halves stay in the
"both" list and cost what keyq's chunks cost (two 32-wide dots a product instead of one 64-wide).

Lists (`key_query_lists2`): keyq's bits kernel (int64 word (tile j, query t) = the 64-bit mask of t's keys in j),
then a count and a compact kernel that classify each nonzero word w:
  class 0 "lo": only bits 0..31 set (keys j 64 .. j 64 + 31);
  class 1 "both": both 32-bit halves of w nonzero;
  class 2 "hi": only bits 32..63 set.
CSR offsets over B * NKT * 3 segments ordered (batch, key tile, class); within a segment the queries ascend. One
host sync (the total length). Every mask is the word w itself (a "lo" mask is w's low 32 bits, a "hi" mask keeps
its bits at 32..63). Why "lo" before "both" before "hi" and the raw word: "lo" + "both" and "both" + "hi" are then
contiguous, each half's bits read the same way in every class, so the split launch (below) walks them as two lists.

The kernel (`keyq2_dkdv`): one program per (KV head, 64-key tile, batch), four fp32 accumulators
dk_lo, dk_hi, dv_lo, dv_hi `[BLOCK_D, 32]` (the registers of keyq's two `[BLOCK_D, 64]`), k / v as two 32-key
halves; dk / dv written once, no atomics. Two launch forms (tune's 5th entry):
- split 0 (default): three loops, "both" (two 32-wide halves a chunk), "lo" (the lo accumulators only), "hi";
- split 1: two loops, "lo" + "both" for the low half, "both" + "hi" for the high half: each "both" chunk's rows are
  gathered twice, but one loop carries only one half's work. Why: on sm_90a (Triton 3.6) the three-loop form's
  "both" loop spills (272 B of stack at (128 rows, 8 warps, 3 stages), benchmarks/sm90_keyq2.py) and the
  two-loop form does not (239 registers); which is faster is for the H200 to say (gpu_keyq2_session14.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.sparse_attention.keyq import _kq_bits_kernel
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot
from sparse_rl.sparse.ops.sparse_attention.union import LOG2E

BN = 64  # keys per tile: the word is int64, split into two 32-key halves
HALF = 32
CLASSES = 3  # 0 both, 1 lo, 2 hi


@triton.jit
def _classes(w):
    """(lo-only, both, hi-only) of int64 words w. `w << 32` keeps bits 0..31 (nonzero iff the low half is);
    `w >> 32` is arithmetic, nonzero iff bits 32..63 are (avoids an unsigned 0xFFFFFFFF literal)."""
    has_lo = (w << 32) != 0
    has_hi = (w >> 32) != 0
    return has_lo & (~has_hi), has_lo & has_hi, has_hi & (~has_lo)


@triton.jit
def _kq2_count_kernel(M, CNT, T, NKT, CH: tl.constexpr):
    """CNT[(b NKT + j) 3 + c] = the words of tile j in class c (0 lo, 1 both, 2 hi)."""
    j = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = M + (b * NKT + j) * T
    n0 = 0
    n1 = 0
    n2 = 0
    for c0 in range(0, T, CH):
        offs = c0 + tl.arange(0, CH)
        w = tl.load(row + offs, mask=offs < T, other=0)
        c0_, c1_, c2_ = _classes(w)
        n0 += tl.sum(c0_.to(tl.int32), 0)
        n1 += tl.sum(c1_.to(tl.int32), 0)
        n2 += tl.sum(c2_.to(tl.int32), 0)
    seg = CNT + (b * NKT + j) * 3
    tl.store(seg, n0)
    tl.store(seg + 1, n1)
    tl.store(seg + 2, n2)


@triton.jit
def _compact_class(LIST, MSK, base, n, offs, keep, w):
    """Append the queries `offs` where `keep` and their words (ascending: a cumsum over one chunk) at base + n;
    -> the new n."""
    pos = base + n + tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(LIST + pos, offs, mask=keep)
    tl.store(MSK + pos, w, mask=keep)
    return n + tl.sum(keep.to(tl.int32), 0)


@triton.jit
def _kq2_compact_kernel(M, OFF, LIST, MSK, T, NKT, CH: tl.constexpr):
    j = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = M + (b * NKT + j) * T
    seg = (b * NKT + j) * 3
    b0 = tl.load(OFF + seg).to(tl.int64)
    b1 = tl.load(OFF + seg + 1).to(tl.int64)
    b2 = tl.load(OFF + seg + 2).to(tl.int64)
    n0 = 0
    n1 = 0
    n2 = 0
    for c0 in range(0, T, CH):
        offs = c0 + tl.arange(0, CH)
        w = tl.load(row + offs, mask=offs < T, other=0)
        c0_, c1_, c2_ = _classes(w)
        n0 = _compact_class(LIST, MSK, b0, n0, offs, c0_, w)
        n1 = _compact_class(LIST, MSK, b1, n1, offs, c1_, w)
        n2 = _compact_class(LIST, MSK, b2, n2, offs, c2_, w)


def key_query_lists2(indices: torch.Tensor, S: int):
    """Per-query indices `[B, T, K]` -> each 64-key tile's queries in three class lists (module docstring):
    (offsets `[B * NKT * 3 + 1]` int32 CSR over (batch, key tile, class) segments, queries `[nnz]` int32 ascending
    per segment (class 0 "lo", 1 "both", 2 "hi"), masks `[nnz]` int64: the 64-bit word, bit n = key j 64 + n).
    NKT = ceil(S / 64). One host sync."""
    B, T, K = indices.shape
    dev = indices.device
    NKT = triton.cdiv(S, BN)
    m = torch.zeros(B, NKT, T, dtype=torch.int64, device=dev)
    BQ, BK, CH = (16, 256, 1024) if indices.is_cuda else (4, 32, 32)
    _kq_bits_kernel[(triton.cdiv(T, BQ), B)](indices, m, T, K, S, NKT, *indices.stride(), BN=BN, BQ=BQ, BLOCK_K=BK,
                                             num_warps=4)
    cnt = torch.empty(B * NKT * CLASSES, dtype=torch.int32, device=dev)
    _kq2_count_kernel[(NKT, B)](m, cnt, T, NKT, CH=CH, num_warps=4)
    off = torch.zeros(B * NKT * CLASSES + 1, dtype=torch.int32, device=dev)
    off[1:] = cnt.cumsum(0)
    nnz = int(off[-1])  # the one host sync: the lists' size
    lst = torch.empty(max(nnz, 1), dtype=torch.int32, device=dev)
    msk = torch.empty(max(nnz, 1), dtype=torch.int64, device=dev)
    _kq2_compact_kernel[(NKT, B)](m, off, lst, msk, T, NKT, CH=CH, num_warps=4)
    return off, lst, msk


@triton.jit
def _chunk_rows(Q, DO, LSE, DELTA, LIST, MSK, b, c, end, qi, heads, offs_d, dmask,
                sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt, slh, BQ: tl.constexpr):
    """The gathered rows of list entries c .. c+BQ (< end): q, do `[BLOCK_M, BLOCK_D]`, lse in log2 units (0 on a
    dead row), delta, whether the row is live, and its mask word."""
    e = c + qi
    ok = (qi < BQ) & (e < end)
    t = tl.load(LIST + e, mask=ok, other=0).to(tl.int64)
    w = tl.load(MSK + e, mask=ok, other=0)
    rd = ok[:, None] & dmask[None, :]
    q = tl.load(Q + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd, mask=rd, other=0.0)
    do = tl.load(DO + b * sdob + t[:, None] * sdot + heads[:, None] * sdoh + offs_d[None, :] * sdod, mask=rd,
                 other=0.0)
    lse = tl.load(LSE + b * slb + t * slt + heads * slh, mask=ok, other=float("-inf"))
    delta = tl.load(DELTA + b * slb + t * slt + heads * slh, mask=ok, other=0.0)
    row_ok = (lse != float("-inf")) & ok  # an empty row (lse -inf) contributes nothing
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
    return q, do, lse2, delta, row_ok, w


@triton.jit
def _half_grads(q, do, kh, vh, w, nbit, row_ok, lse2, delta, qk_scale, PREC: tl.constexpr):
    """(dk^T, dv^T) `[BLOCK_D, 32]` of one 32-key half: kh / vh `[32, BLOCK_D]`, w the half's 32-bit mask (int32,
    bit 31 the sign: the arithmetic shift still reads it right), nbit 0..31; the "dt" form of keyq.py on 32 keys.
    An int32 word, not keyq's int64, halves the registers of the [BLOCK_M, 32] bit test (sm_90a: 320 -> 272 B of
    stack in the three-loop form)."""
    sel = (((w[:, None] >> nbit[None, :]) & 1) == 1) & row_ok[:, None]  # [BLOCK_M, 32]
    s = dot(q, tl.trans(kh), PREC)
    pm = tl.where(sel, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
    dp = dot(do, tl.trans(vh), PREC)
    ds = pm * (dp - delta[:, None])
    return dot(tl.trans(q), ds.to(q.dtype), PREC), dot(tl.trans(do), pm.to(do.dtype), PREC)


@triton.jit
def _load_half(K, b, n0, kvh, S, skb, sks, skh, skd, offs_d, dmask):
    """Keys n0 .. n0+32 of K `[32, BLOCK_D]` (zeros past S: their mask bits are never set)."""
    offs_n = n0 + tl.arange(0, 32)
    nd = (offs_n < S)[:, None] & dmask[None, :]
    return tl.load(K + b * skb + offs_n[:, None] * sks + kvh * skh + offs_d[None, :] * skd, mask=nd, other=0.0)


@triton.jit
def _store_half(DK, acc, b, n0, kvh, S, sdkb, sdks, sdkh, sdkd, offs_d, dmask):
    """acc `[BLOCK_D, 32]` (transposed) -> DK rows n0 .. n0+32 below S."""
    offs_n = n0 + tl.arange(0, 32)
    m = (offs_n < S)[None, :] & dmask[:, None]
    tl.store(DK + b * sdkb + offs_n[None, :] * sdks + kvh * sdkh + offs_d[:, None] * sdkd,
             acc.to(DK.dtype.element_ty), mask=m)


@triton.jit
def _half_word(w, HIGH: tl.constexpr):
    """The 32-bit mask of one half of int64 words w, as int32 (bits 32..63 shifted down for the high half)."""
    if HIGH:
        return (w >> 32).to(tl.int32)
    return w.to(tl.int32)


@triton.jit
def _half_loop(dk, dv, lo, hi, kh, vh, Q, DO, LSE, DELTA, LIST, MSK, b, qi, heads, offs_d, dmask, nbit, qk_scale,
               sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt, slh,
               HIGH: tl.constexpr, BQ: tl.constexpr, PREC: tl.constexpr):
    """One half's accumulators (dk, dv) += list entries lo .. hi, BQ queries a chunk, against that half's keys."""
    for c in range(lo, hi, BQ):
        q, do, lse2, delta, row_ok, w = _chunk_rows(Q, DO, LSE, DELTA, LIST, MSK, b, c, hi, qi, heads, offs_d, dmask,
                                                    sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt, slh, BQ)
        a, v = _half_grads(q, do, kh, vh, _half_word(w, HIGH), nbit, row_ok, lse2, delta, qk_scale, PREC)
        dk += a
        dv += v
    return dk, dv


@triton.jit
def _kq2_dkdv_kernel(Q, K, V, DO, LSE, DELTA, OFF, LIST, MSK, DK, DV,
                     sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                     sdob, sdot, sdoh, sdod, slb, slt, slh, sdkb, sdks, sdkh, sdkd,
                     S, G, D, NKT, scale, qk_scale,
                     BQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
                     SPLIT: tl.constexpr):
    """dk/dv of one (KV head, 64-key tile j, batch) over its class lists, BQ queries (BQ G rows) a chunk; SPLIT: the
    two-loop form (module docstring). The KV head is the grid's fastest dimension, as in keyq.py: the long
    sink-tile lists start first."""
    kvh = tl.program_id(0)
    j = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    n_lo = j * 64
    n_hi = j * 64 + 32
    k_lo = _load_half(K, b, n_lo, kvh, S, skb, sks, skh, skd, offs_d, dmask)
    k_hi = _load_half(K, b, n_hi, kvh, S, skb, sks, skh, skd, offs_d, dmask)
    v_lo = _load_half(V, b, n_lo, kvh, S, svb, svs, svh, svd, offs_d, dmask)
    v_hi = _load_half(V, b, n_hi, kvh, S, svb, svs, svh, svd, offs_d, dmask)
    dk_lo = tl.zeros([BLOCK_D, 32], tl.float32)
    dk_hi = tl.zeros([BLOCK_D, 32], tl.float32)
    dv_lo = tl.zeros([BLOCK_D, 32], tl.float32)
    dv_hi = tl.zeros([BLOCK_D, 32], tl.float32)
    r = tl.arange(0, BLOCK_M)
    qi = r // G
    heads = kvh * G + r % G
    nbit = tl.arange(0, 32)
    seg = OFF + (b * NKT + j) * 3
    e0 = tl.load(seg)  # "lo" e0 .. e1, "both" e1 .. e2, "hi" e2 .. e3
    e1 = tl.load(seg + 1)
    e2 = tl.load(seg + 2)
    e3 = tl.load(seg + 3)
    if SPLIT:
        lo_end = e2  # the low half over "lo" + "both", the high half over "both" + "hi"
        hi_start = e1
    else:
        lo_end = e1
        hi_start = e2
        for c in range(e1, e2, BQ):  # "both": two 32-wide halves a chunk, its rows gathered once
            q, do, lse2, delta, row_ok, w = _chunk_rows(Q, DO, LSE, DELTA, LIST, MSK, b, c, e2, qi, heads, offs_d,
                                                        dmask, sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt,
                                                        slh, BQ)
            a, v = _half_grads(q, do, k_lo, v_lo, _half_word(w, False), nbit, row_ok, lse2, delta, qk_scale, PREC)
            dk_lo += a
            dv_lo += v
            a, v = _half_grads(q, do, k_hi, v_hi, _half_word(w, True), nbit, row_ok, lse2, delta, qk_scale, PREC)
            dk_hi += a
            dv_hi += v
    dk_lo, dv_lo = _half_loop(dk_lo, dv_lo, e0, lo_end, k_lo, v_lo, Q, DO, LSE, DELTA, LIST, MSK, b, qi, heads, offs_d,
                              dmask, nbit, qk_scale, sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt, slh,
                              False, BQ, PREC)
    dk_hi, dv_hi = _half_loop(dk_hi, dv_hi, hi_start, e3, k_hi, v_hi, Q, DO, LSE, DELTA, LIST, MSK, b, qi, heads,
                              offs_d, dmask, nbit, qk_scale, sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt, slh,
                              True, BQ, PREC)
    _store_half(DK, dk_lo * scale, b, n_lo, kvh, S, sdkb, sdks, sdkh, sdkd, offs_d, dmask)
    _store_half(DK, dk_hi * scale, b, n_hi, kvh, S, sdkb, sdks, sdkh, sdkd, offs_d, dmask)
    _store_half(DV, dv_lo, b, n_lo, kvh, S, sdkb, sdks, sdkh, sdkd, offs_d, dmask)
    _store_half(DV, dv_hi, b, n_hi, kvh, S, sdkb, sdks, sdkh, sdkd, offs_d, dmask)


def default_tune(cuda: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, rows, num_warps, num_stages, split): keyq.py's measured default launch, the three-loop form, on the
    GPU (not measured for keyq2 yet: benchmarks/gpu_keyq2_session14.py times it beside split 1 and 64 rows); small
    rows under the interpreter."""
    return (64, 128, 8, 3, 0) if cuda else (64, 64, 4, 1, 0)


def keyq2_dkdv(q, k, v, indices, do, lse, delta, scale: float, prec: int, tune: tuple | None = None, lists=None):
    """dk, dv `[B, S, H_kv, D]` (k's dtype) of per-query `indices` `[B, T, K]` from the 64-key tiles' three class
    lists, one write per element. q/do `[B, T, H, D]`, lse/delta `[B, T, H]` fp32 with equal strides.
    `tune=(BLOCK_N, rows, num_warps, num_stages[, split])` as keyq.keyq_dkdv's, BLOCK_N 64 only (the two-level split
    is of a 64-bit word), split 0 (three loops, default) or 1 (two, module docstring); `lists`: a prebuilt
    `key_query_lists2(indices, S)` (benchmarks)."""
    B, T, H, D = q.shape
    S, H_kv = k.shape[1], k.shape[2]
    G = H // H_kv
    bn, rows, warps, stages, split = (tuple(tune) + (0,))[:5] if tune else default_tune(q.is_cuda)
    if bn != BN or rows not in (16, 32, 64, 128, 256) or split not in (0, 1):
        raise ValueError(f"keyq2_dkdv: BLOCK_N {bn} (64 only), rows {rows}, split {split} (0 or 1)")
    BM = max(16, triton.next_power_of_2(G), rows)
    BQ = max(1, BM // G)  # whole queries per chunk (G = 7, 128 rows: 18 queries, 126 live rows)
    BD = max(16, triton.next_power_of_2(D))
    off, lst, msk = lists if lists is not None else key_query_lists2(indices, S)
    NKT = triton.cdiv(S, BN)
    dk = torch.empty(B, S, H_kv, D, device=q.device, dtype=k.dtype)
    dv = torch.empty_like(dk)
    _kq2_dkdv_kernel[(H_kv, NKT, B)](
        q, k, v, do, lse, delta, off, lst, msk, dk, dv, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        *lse.stride(), *dk.stride(), S, G, D, NKT, scale, scale * LOG2E,
        BQ=BQ, BLOCK_M=BM, BLOCK_D=BD, PREC=prec, SPLIT=bool(split), num_warps=warps, num_stages=stages)
    return dk, dv
