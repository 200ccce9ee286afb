"""keyq.py's dk/dv pass with two-level query lists: each 64-key tile's queries split by which 32-key halves they
selected in (`bwd_path="keyq2"`, issue 15).

Why: keyq.py runs one [rows, 64] MMA block per 128-row chunk of a key tile's query list, but on the trained
indexer's 32K rows a (64-key tile, query) pair holds ~27 of its 64 keys, so about half the MMA work is masked.
Many pairs touch only one 32-key half of the tile; here those go in a "lo" / "hi" list whose chunks run 32-wide
dots against that half only, half the MMA work of a 64-wide chunk. Pairs with keys in both halves stay in the
"both" list and cost what keyq's chunks cost (two 32-wide dots a product instead of one 64-wide).

Lists (`key_query_lists2`): keyq's bits kernel (int64 word (tile j, query t) = the 64-bit mask of t's keys in j),
then a count and a compact kernel that classify each nonzero word w:
  class 0 "both": both 32-bit halves of w nonzero, mask = w;
  class 1 "lo": only bits 0..31 set, mask = bits 0..31 of w;
  class 2 "hi": only bits 32..63 set, mask = bits 32..63 of w shifted down to 0..31.
CSR offsets over B * NKT * 3 segments ordered (batch, key tile, class); within a segment the queries ascend. One
host sync (the total length). Half masks are stored in the int64 array sign-extended from bit 31 (the shifts
below are arithmetic); only bits 0..31 are read.

The kernel (`keyq2_dkdv`): one program per (KV head, 64-key tile, batch), four fp32 accumulators
dk_lo, dk_hi, dv_lo, dv_hi `[BLOCK_D, 32]` (the registers of keyq's two `[BLOCK_D, 64]`), k / v as two 32-key
halves, three loops over the tile's three lists; dk / dv written once, no atomics.
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
    """(both, lo-only, hi-only) of int64 words w. `w << 32` keeps bits 0..31 (nonzero iff the low half is);
    `w >> 32` is arithmetic, nonzero iff bits 32..63 are (avoids an unsigned 0xFFFFFFFF literal)."""
    has_lo = (w << 32) != 0
    has_hi = (w >> 32) != 0
    return has_lo & has_hi, has_lo & (~has_hi), has_hi & (~has_lo)


@triton.jit
def _kq2_count_kernel(M, CNT, T, NKT, CH: tl.constexpr):
    """CNT[(b NKT + j) 3 + c] = the words of tile j in class c."""
    j = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = M + (b * NKT + j) * T
    n0 = 0
    n1 = 0
    n2 = 0
    for c0 in range(0, T, CH):
        offs = c0 + tl.arange(0, CH)
        w = tl.load(row + offs, mask=offs < T, other=0)
        both, lo, hi = _classes(w)
        n0 += tl.sum(both.to(tl.int32), 0)
        n1 += tl.sum(lo.to(tl.int32), 0)
        n2 += tl.sum(hi.to(tl.int32), 0)
    seg = CNT + (b * NKT + j) * 3
    tl.store(seg, n0)
    tl.store(seg + 1, n1)
    tl.store(seg + 2, n2)


@triton.jit
def _compact_class(LIST, MSK, base, n, offs, keep, val):
    """Append the queries `offs` where `keep` (ascending: a cumsum over one chunk) at base + n; -> the new n."""
    pos = base + n + tl.cumsum(keep.to(tl.int32), 0) - 1
    tl.store(LIST + pos, offs, mask=keep)
    tl.store(MSK + pos, val, mask=keep)
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
        both, lo, hi = _classes(w)
        n0 = _compact_class(LIST, MSK, b0, n0, offs, both, w)
        n1 = _compact_class(LIST, MSK, b1, n1, offs, lo, (w << 32) >> 32)  # bits 0..31, sign-extended
        n2 = _compact_class(LIST, MSK, b2, n2, offs, hi, w >> 32)  # bits 32..63 -> 0..31


def key_query_lists2(indices: torch.Tensor, S: int):
    """Per-query indices `[B, T, K]` -> each 64-key tile's queries in three class lists (module docstring):
    (offsets `[B * NKT * 3 + 1]` int32 CSR over (batch, key tile, class) segments, queries `[nnz]` int32 ascending
    per segment, masks `[nnz]` int64: "both" the 64-bit word, "lo" / "hi" its low / high 32 bits in bits 0..31).
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
    """(dk^T, dv^T) `[BLOCK_D, 32]` of one 32-key half: kh / vh `[32, BLOCK_D]`, nbit the half's bit positions in w
    (0..31 or 32..63), the "dt" form of keyq.py on 32 keys."""
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
def _kq2_dkdv_kernel(Q, K, V, DO, LSE, DELTA, OFF, LIST, MSK, DK, DV,
                     sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                     sdob, sdot, sdoh, sdod, slb, slt, slh, sdkb, sdks, sdkh, sdkd,
                     S, G, D, NKT, scale, qk_scale,
                     BQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    """dk/dv of one (KV head, 64-key tile j, batch) over its three lists, BQ queries (BQ G rows) a step. The KV
    head is the grid's fastest dimension, as in keyq.py: the long sink-tile lists start first."""
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
    bit_lo = tl.arange(0, 32).to(tl.int64)
    bit_hi = bit_lo + 32
    seg = OFF + (b * NKT + j) * 3
    e0 = tl.load(seg)
    e1 = tl.load(seg + 1)
    e2 = tl.load(seg + 2)
    e3 = tl.load(seg + 3)
    for c in range(e0, e1, BQ):  # "both": two 32-wide halves a chunk, the 64-bit word
        q, do, lse2, delta, row_ok, w = _chunk_rows(Q, DO, LSE, DELTA, LIST, MSK, b, c, e1, qi, heads, offs_d, dmask,
                                                    sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt, slh, BQ)
        a, v = _half_grads(q, do, k_lo, v_lo, w, bit_lo, row_ok, lse2, delta, qk_scale, PREC)
        dk_lo += a
        dv_lo += v
        a, v = _half_grads(q, do, k_hi, v_hi, w, bit_hi, row_ok, lse2, delta, qk_scale, PREC)
        dk_hi += a
        dv_hi += v
    for c in range(e1, e2, BQ):  # "lo": only the low half's accumulators
        q, do, lse2, delta, row_ok, w = _chunk_rows(Q, DO, LSE, DELTA, LIST, MSK, b, c, e2, qi, heads, offs_d, dmask,
                                                    sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt, slh, BQ)
        a, v = _half_grads(q, do, k_lo, v_lo, w, bit_lo, row_ok, lse2, delta, qk_scale, PREC)
        dk_lo += a
        dv_lo += v
    for c in range(e2, e3, BQ):  # "hi": the high half, its bits stored shifted down to 0..31
        q, do, lse2, delta, row_ok, w = _chunk_rows(Q, DO, LSE, DELTA, LIST, MSK, b, c, e3, qi, heads, offs_d, dmask,
                                                    sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt, slh, BQ)
        a, v = _half_grads(q, do, k_hi, v_hi, w, bit_lo, row_ok, lse2, delta, qk_scale, PREC)
        dk_hi += a
        dv_hi += v
    _store_half(DK, dk_lo * scale, b, n_lo, kvh, S, sdkb, sdks, sdkh, sdkd, offs_d, dmask)
    _store_half(DK, dk_hi * scale, b, n_hi, kvh, S, sdkb, sdks, sdkh, sdkd, offs_d, dmask)
    _store_half(DV, dv_lo, b, n_lo, kvh, S, sdkb, sdks, sdkh, sdkd, offs_d, dmask)
    _store_half(DV, dv_hi, b, n_hi, kvh, S, sdkb, sdks, sdkh, sdkd, offs_d, dmask)


def default_tune(cuda: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, rows, num_warps, num_stages): keyq.py's measured default on the GPU (not yet measured for keyq2:
    benchmarks/gpu_keyq2_session14.py times it beside (64, 64, 4, 2)); small rows under the interpreter."""
    return (64, 128, 8, 3) if cuda else (64, 64, 4, 1)


def keyq2_dkdv(q, k, v, indices, do, lse, delta, scale: float, prec: int, tune: tuple | None = None, lists=None):
    """dk, dv `[B, S, H_kv, D]` (k's dtype) of per-query `indices` `[B, T, K]` from the 64-key tiles' three class
    lists, one write per element. q/do `[B, T, H, D]`, lse/delta `[B, T, H]` fp32 with equal strides.
    `tune=(BLOCK_N, rows, num_warps, num_stages)` as keyq.keyq_dkdv's, BLOCK_N 64 only (the two-level split is of
    a 64-bit word); `lists`: a prebuilt `key_query_lists2(indices, S)` (benchmarks)."""
    B, T, H, D = q.shape
    S, H_kv = k.shape[1], k.shape[2]
    G = H // H_kv
    bn, rows, warps, stages = tuple(tune or default_tune(q.is_cuda))
    if bn != BN or rows not in (16, 32, 64, 128, 256):
        raise ValueError(f"keyq2_dkdv: BLOCK_N {bn} (64 only), rows {rows}")
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
        BQ=BQ, BLOCK_M=BM, BLOCK_D=BD, PREC=prec, num_warps=warps, num_stages=stages)
    return dk, dv
