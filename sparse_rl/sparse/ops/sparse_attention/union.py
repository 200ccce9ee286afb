"""Query-tile union path of the sparse attention forward (Triton).

Why: the per-query kernel reads every selected K/V row once per query and KV head, 4*D bytes per
selected pair; with GQA (G = 4 query heads per KV head) that is G FLOP/byte, so it runs at the L2
gather rate (~25 TFLOP/s on an H200) whatever the selection looks like. When neighbouring queries
select mostly the same keys (block-sparse selections, sinks, local windows, a trained indexer's
smooth choices) the same rows are fetched again and again. Here a tile of BT consecutive queries
takes the *union* U of its index rows; one program per (tile, KV head) streams U once with all
BT*G query rows as the M dimension of the tile (64 rows), masking each row to its own keys with a
per-key bitmask of the queries that chose it. Bytes drop by the overlap factor BT*K/|U|; in the
worst case (no overlap) the work is the per-query kernel's, with 4x more MMA rows.

The union is built with three small kernels and no sort:
1. bitmap: each tile sets bit s of a `[S/32]` word array for every selected key s (atomic OR);
2. compact: popcount prefix sums turn the bitmap into the ascending key list U and a word->rank table;
3. query masks: each (query i, key s) ORs bit i into the mask of s's slot (rank via the table).
`build_union` returns what the attention kernel needs plus |U| per tile, so the caller can pick
this path only when the overlap pays (see triton.sparse_attention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot


@triton.jit
def _popc(x):
    """Population count of int32/uint32 words (SWAR; runs under the interpreter too)."""
    x = x.to(tl.uint32, bitcast=True)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24) & 0xFF


@triton.jit
def _bitmap_kernel(IDX, BITS, T, NK, S, NW, NT, sib, sit, sik, BT: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    wbase = BITS + (b * NT + tile) * NW
    for i in range(0, BT):
        t = tile * BT + i
        if t < T:
            for k0 in range(0, NK, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                idx = tl.load(IDX + b * sib + t * sit + offs * sik, mask=offs < NK, other=-1)
                ok = (idx >= 0) & (idx < S)  # out-of-range keys are dropped like -1
                one = tl.full([BLOCK_K], 1, tl.int32)
                tl.atomic_or(wbase + tl.where(ok, idx >> 5, 0), one << (idx & 31), mask=ok, sem="relaxed")


@triton.jit
def _compact_kernel(BITS, PREF, UKEY, ULEN, NW, NT, UMAX, BLOCK_W: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = b * NT + tile
    offs_w = tl.arange(0, BLOCK_W)
    bitpos = tl.arange(0, 32)
    run = 0
    for w0 in range(0, NW, BLOCK_W):
        wm = w0 + offs_w < NW
        words = tl.load(BITS + row * NW + w0 + offs_w, mask=wm, other=0)
        cnt = _popc(words).to(tl.int32)
        excl = tl.cumsum(cnt, 0) - cnt
        tl.store(PREF + row * NW + w0 + offs_w, run + excl, mask=wm)
        bits = (words[:, None] >> bitpos[None, :]) & 1  # [BLOCK_W, 32] (arithmetic shift is fine: & 1)
        flat = tl.reshape(bits, [BLOCK_W * 32])
        pos = run + tl.cumsum(flat, 0) - 1
        key = tl.reshape((w0 + offs_w)[:, None] * 32 + bitpos[None, :], [BLOCK_W * 32])
        tl.store(UKEY + row * UMAX + pos, key, mask=flat == 1)
        run += tl.sum(cnt, 0)
    tl.store(ULEN + row, run)


@triton.jit
def _qmask_kernel(IDX, BITS, PREF, QMASK, T, NK, S, NW, NT, UMAX, sib, sit, sik,
                  BT: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = b * NT + tile
    for i in range(0, BT):
        t = tile * BT + i
        if t < T:
            for k0 in range(0, NK, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                idx = tl.load(IDX + b * sib + t * sit + offs * sik, mask=offs < NK, other=-1)
                ok = (idx >= 0) & (idx < S)  # out-of-range keys are dropped like -1
                w = tl.where(ok, idx >> 5, 0)
                word = tl.load(BITS + row * NW + w, mask=ok, other=0)
                below = word & ((tl.full([BLOCK_K], 1, tl.int32) << (idx & 31)) - 1)  # two's complement wrap
                rank = tl.load(PREF + row * NW + w, mask=ok, other=0) + _popc(below).to(tl.int32)
                tl.atomic_or(QMASK + row * UMAX + rank, tl.full([BLOCK_K], 1, tl.int32) << i, mask=ok, sem="relaxed")


def build_union(indices: torch.Tensor, S: int, BT: int):
    """indices `[B, T, K]` int32 -> (ukey `[B, nT, Umax]` int32, qmask `[B, nT, Umax]` int32,
    ulen `[B, nT]` int32): per tile of BT queries, its selected keys ascending and, per key, the
    bitmask of the tile's queries that chose it."""
    B, T, K = indices.shape
    NT = triton.cdiv(T, BT)
    NW = triton.cdiv(max(S, 1), 32)
    umax = max(1, min(BT * K, NW * 32))
    dev = indices.device
    bits = torch.zeros(B, NT, NW, dtype=torch.int32, device=dev)
    pref = torch.empty(B, NT, NW, dtype=torch.int32, device=dev)
    ukey = torch.empty(B, NT, umax, dtype=torch.int32, device=dev)
    qmask = torch.zeros(B, NT, umax, dtype=torch.int32, device=dev)
    ulen = torch.empty(B, NT, dtype=torch.int32, device=dev)
    BK = 256 if indices.is_cuda else 32
    warps = 4 if indices.is_cuda else 1
    _bitmap_kernel[(NT, B)](indices, bits, T, K, S, NW, NT, *indices.stride(), BT=BT, BLOCK_K=BK, num_warps=warps)
    _compact_kernel[(NT, B)](bits, pref, ukey, ulen, NW, NT, umax, BLOCK_W=64 if indices.is_cuda else 8,
                             num_warps=warps)
    _qmask_kernel[(NT, B)](indices, bits, pref, qmask, T, K, S, NW, NT, umax, *indices.stride(), BT=BT, BLOCK_K=BK,
                           num_warps=warps)
    return ukey, qmask, ulen


@triton.jit
def _union_fwd_kernel(Q, K, V, UKEY, QMASK, ULEN, O, LSE,
                      sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                      sob, sot, soh, sod, slb, slt, slh,
                      T, G, D, NT, UMAX, qk_scale,
                      BT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                      PREC: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    qi = r // G  # query within the tile
    gh = r % G
    t = tile * BT + qi
    rmask = (qi < BT) & (t < T)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    heads = kvh * G + gh
    q = tl.load(Q + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd,
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row = b * NT + tile
    n = tl.load(ULEN + row)
    kbase = K + b * skb + kvh * skh
    vbase = V + b * svb + kvh * svh
    for u0 in range(0, n, BLOCK_K):
        offs_u = u0 + tl.arange(0, BLOCK_K)
        um = offs_u < n
        key = tl.load(UKEY + row * UMAX + offs_u, mask=um, other=0).to(tl.int64)
        qm = tl.load(QMASK + row * UMAX + offs_u, mask=um, other=0)
        kt = tl.load(kbase + key[None, :] * sks + offs_d[:, None] * skd, mask=um[None, :] & dmask[:, None], other=0.0)
        s = dot(q, kt, PREC)
        sel = (((qm[None, :] >> qi[:, None]) & 1) == 1) & um[None, :] & rmask[:, None]
        s = tl.where(sel, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vbase + key[:, None] * svs + offs_d[None, :] * svd, mask=um[:, None] & dmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PREC)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    tl.store(O + b * sob + t[:, None] * sot + heads[:, None] * soh + offs_d[None, :] * sod,
             out.to(O.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
    tl.store(LSE + b * slb + t * slt + heads * slh, lse, mask=rmask)


def tile_queries(G: int) -> int:
    """Queries per tile: 64 MMA rows (G=4 -> 16 queries), at most 32 (int32 query masks)."""
    return max(1, min(32, 64 // triton.next_power_of_2(G)))


def union_fwd(q, k, v, union, scale: float, prec: int, out=None, tune: tuple[int, int, int] | None = None):
    """Forward over a prebuilt union: q `[B, T, H, D]` -> out `[B, T, H, D]`, lse `[B, T, H]` fp32."""
    B, T, H, D = q.shape
    H_kv = k.shape[2]
    G = H // H_kv
    BT = tile_queries(G)
    ukey, qmask, ulen = union
    NT, umax = ukey.shape[1], ukey.shape[2]
    if out is None:
        o = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
        lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    else:
        o, lse = out
    BM = max(16, triton.next_power_of_2(BT * G))
    BD = max(16, triton.next_power_of_2(D))
    BK, warps, stages = tune or (64, 4, 2 if q.is_cuda else 1)
    _union_fwd_kernel[(NT, H_kv, B)](q, k, v, ukey, qmask, ulen, o, lse, *q.stride(), *k.stride(), *v.stride(),
                                     *o.stride(), *lse.stride(), T, G, D, NT, umax, scale * 1.4426950408889634,
                                     BT=BT, BLOCK_M=BM, BLOCK_K=BK, BLOCK_D=BD, PREC=prec,
                                     num_warps=warps, num_stages=stages)
    return o, lse


@triton.jit
def _union_bwd_kernel(Q, K, V, UKEY, QMASK, ULEN, O, DO, LSE, DLSE, DQ, DK, DV,
                      sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                      sob, sot, soh, sod, sdob, sdot, sdoh, sdod, slb, slt, slh,
                      sdqb, sdqt, sdqh, sdqd, sab, sas, sah,
                      T, G, D, NT, UMAX, scale, qk_scale,
                      BT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                      PREC: tl.constexpr):
    """Backward over a tile's union: dq in registers, dk/dv of each union key summed over the
    tile's rows before one fp32 atomic add per (key, tile) instead of one per (key, query)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    qi = r // G
    gh = r % G
    t = tile * BT + qi
    rmask = (qi < BT) & (t < T)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    heads = kvh * G + gh
    rd = rmask[:, None] & dmask[None, :]
    q = tl.load(Q + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd, mask=rd, other=0.0)
    do = tl.load(DO + b * sdob + t[:, None] * sdot + heads[:, None] * sdoh + offs_d[None, :] * sdod, mask=rd,
                 other=0.0)
    o = tl.load(O + b * sob + t[:, None] * sot + heads[:, None] * soh + offs_d[None, :] * sod, mask=rd, other=0.0)
    lse = tl.load(LSE + b * slb + t * slt + heads * slh, mask=rmask, other=float("-inf"))
    dlse = tl.load(DLSE + b * slb + t * slt + heads * slh, mask=rmask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1) - dlse
    row_ok = (lse != float("-inf")) & rmask
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row = b * NT + tile
    n = tl.load(ULEN + row)
    kbase = K + b * skb + kvh * skh
    vbase = V + b * svb + kvh * svh
    for u0 in range(0, n, BLOCK_K):
        offs_u = u0 + tl.arange(0, BLOCK_K)
        um = offs_u < n
        key = tl.load(UKEY + row * UMAX + offs_u, mask=um, other=0).to(tl.int64)
        qm = tl.load(QMASK + row * UMAX + offs_u, mask=um, other=0)
        kk = tl.load(kbase + key[:, None] * sks + offs_d[None, :] * skd, mask=um[:, None] & dmask[None, :], other=0.0)
        vv = tl.load(vbase + key[:, None] * svs + offs_d[None, :] * svd, mask=um[:, None] & dmask[None, :], other=0.0)
        s = dot(q, tl.trans(kk), PREC)
        dp = dot(do, tl.trans(vv), PREC)
        sel = (((qm[None, :] >> qi[:, None]) & 1) == 1) & um[None, :] & row_ok[:, None]
        p = tl.where(sel, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        dq += dot(ds.to(kk.dtype), kk, PREC)
        dv_c = dot(tl.trans(p.to(do.dtype)), do, PREC)
        dk_c = dot(tl.trans(ds.to(q.dtype)), q, PREC)
        amask = um[:, None] & dmask[None, :]
        aoff = b * sab + key[:, None] * sas + kvh * sah + offs_d[None, :]
        tl.atomic_add(DV + aoff, dv_c, mask=amask, sem="relaxed")
        tl.atomic_add(DK + aoff, dk_c * scale, mask=amask, sem="relaxed")
    tl.store(DQ + b * sdqb + t[:, None] * sdqt + heads[:, None] * sdqh + offs_d[None, :] * sdqd,
             (dq * scale).to(DQ.dtype.element_ty), mask=rd)


def union_bwd(q, k, v, union, o, lse, do, dlse, scale: float, prec: int):
    """dq `[B, T, H, D]` (q.dtype) and fp32 dk/dv `[B, S, H_kv, D]` over a prebuilt union."""
    B, T, H, D = q.shape
    S, H_kv = k.shape[1], k.shape[2]
    G = H // H_kv
    BT = tile_queries(G)
    ukey, qmask, ulen = union
    NT, umax = ukey.shape[1], ukey.shape[2]
    dq = torch.empty_like(q)
    dk = torch.zeros(B, S, H_kv, D, device=q.device, dtype=torch.float32)
    dv = torch.zeros_like(dk)
    BM = max(16, triton.next_power_of_2(BT * G))
    BD = max(16, triton.next_power_of_2(D))
    _union_bwd_kernel[(NT, H_kv, B)](q, k, v, ukey, qmask, ulen, o, do, lse, dlse, dq, dk, dv,
                                     *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(),
                                     *lse.stride(), *dq.stride(), *dk.stride()[:3],
                                     T, G, D, NT, umax, scale, scale * 1.4426950408889634,
                                     BT=BT, BLOCK_M=BM, BLOCK_K=32, BLOCK_D=BD, PREC=prec,
                                     num_warps=4, num_stages=2 if q.is_cuda else 1)
    return dq, dk, dv
