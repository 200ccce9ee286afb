"""Triton sparse attention over per-query index lists: prefill forward/backward and decode.

Layout: q `[B, T, H, D]`, k/v `[B, S, H_kv, D]`, indices `[B, T, K]` int32 (-1 = none). Any strides
are accepted (the model passes transposes of `[B, H, T, D]`), so nothing is copied.

Design (why):
- One program per (query, kv head): the G = H / H_kv query heads of the group are the M dimension
  of the tile, so every gathered K/V row is read once per group and used by all G heads (DSA's
  "every head attends to the same set"). M is padded to 16 for `tl.dot`; with G = 4 the tensor
  cores idle 3/4 of the time, which does not matter because the kernel is bound by the gather: each
  selected key costs 4*D bytes of K+V for 4*G*D FLOPs (G FLOP/byte), far below the ~200 FLOP/byte
  at which an H200 becomes compute bound. The grid runs every query of one kv head before the next
  head, so the working set in L2 is one head's K/V (S*D*4 bytes: 16 MB at 32K).
- GQA-packed query tiles (union.py): a tile of 32 queries x 4 heads = 128 MMA rows streams the
  union of its index rows once, cutting the gathered bytes by the overlap; shared selections
  (`query_group`) ARE the union, so they skip the build. paths.py decides `auto` from a sampled
  estimate of each path's time.
- Online softmax in the exp2 domain; out is normalised at the end, lse is natural-log.
- Backward, path "tile" (default where it pays): dq from a query-major pass, dk/dv from a
  key-major pass over the transposed union (union.py), each written once, no atomics. Path
  "atomic": one program per (query, kv head) recomputes P from lse, writes dq directly and
  scatters dk/dv with fp32 atomics into `[B, S, H_kv, D]` scratch (8*D bytes of atomics per pair
  and KV head; 174 ms at 32K on an H200, NOTES.md item 6).
- Decode (T = 1) splits the index list over several programs when B * H_kv alone would not fill
  the GPU, then merges the partial (out, lse) pairs in a second small kernel.

Index entries outside [0, S) are treated as -1 by every kernel (never read, never written): the
contract only allows -1 or valid positions, but an out-of-range entry must not turn into a stray
read or, in the backward, an atomic write past dk/dv.

Unsupported shapes (head dim > 128, G > 64, float64) fall back to the PyTorch reference: that is
the documented behaviour of every entry point here, never a silent wrong answer.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.sparse_attention import blocks, keymajor, keyq, keyq_gluon, paths, union, union_gluon
from sparse_rl.sparse.ops.sparse_attention.naive import MERGES, shared_to_per_query, sparse_attention_naive
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot, dot_precision
from sparse_rl.sparse.ops.pdl import pdl_enter
from sparse_rl.sparse.ops._backend import grown_counters

LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Shapes/dtypes the kernels handle; everything else takes the reference."""
    D, H, H_kv = q.shape[-1], q.shape[-2], k.shape[-2]
    return (q.dtype in _DTYPES and k.dtype == q.dtype and D <= 128 and H % H_kv == 0
            and H // H_kv <= 64)


@triton.jit
def _fwd_kernel(Q, K, V, IDX, O, LSE,
                sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                sib, sit, sik, sob, sot, soh, sod, slb, slt, slh,
                T, NK, S, G, D, KPS, qk_scale,
                NSPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_D: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr = False,
                CNT=None, OF=None, LF=None, sfb=0, sft=0, sfh=0, sgb=0, sgt=0, sgh=0, MERGE: tl.constexpr = False,
                NSP2: tl.constexpr = 2):
    """O/LSE: `[B, T, H, D]`/`[B, T, H]` when NSPLIT == 1, else fp32 partials
    `[B, T*NSPLIT, H, D]`/`[B, T*NSPLIT, H]` (split index fastest) merged by `_merge_kernel`, or with MERGE by the
    last of the NSPLIT programs of each (b, t, kv head) into OF `[B, T, H, D]` / LF `[B, T, H]` (`_merge_group`;
    CNT: zeroed int32 counters `[B * H_kv * T]`, left zeroed)."""
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    t = pid // NSPLIT
    split = pid % NSPLIT
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < G
    dmask = offs_d < D
    heads = kvh * G + offs_h
    q = tl.load(Q + b * sqb + t * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd,
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_lo = split * KPS
    k_hi = tl.minimum(k_lo + KPS, NK)
    kbase = K + b * skb + kvh * skh
    vbase = V + b * svb + kvh * svh
    ibase = IDX + b * sib + t * sit
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(ibase + offs_k * sik, mask=offs_k < k_hi, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < S)  # out-of-range keys are treated as -1, never read
        kt = tl.load(kbase + idx[None, :] * sks + offs_d[:, None] * skd,
                     mask=valid[None, :] & dmask[:, None], other=0.0)  # [BLOCK_D, BLOCK_K]
        s = dot(q, kt, PREC)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vbase + idx[:, None] * svs + offs_d[None, :] * svd,
                    mask=valid[:, None] & dmask[None, :], other=0.0)  # [BLOCK_K, BLOCK_D]
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PREC)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    row = t * NSPLIT + split
    tl.store(O + b * sob + row * sot + heads[:, None] * soh + offs_d[None, :] * sod,
             out.to(O.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
    tl.store(LSE + b * slb + row * slt + heads * slh, lse, mask=hmask)
    if MERGE:
        tl.debug_barrier()  # every thread's partial is written before the count releases it
        ci = (b * tl.num_programs(1) + kvh) * T + t
        if tl.atomic_add(CNT + ci, 1, sem="acq_rel") == NSPLIT - 1:  # the group's last program merges
            _merge_group(O, LSE, OF, LF, b, t, heads, hmask, offs_d, dmask, sob, sot, soh, sod, slb, slt, slh,
                         sfb, sft, sfh, sgb, sgt, sgh, NSPLIT, NSP2, BLOCK_H, BLOCK_D)
            tl.atomic_xchg(CNT + ci, 0)  # zero again for the next launch (CUDA-graph replays need no memset)


@triton.jit
def _merge_group(O, LSE, OF, LF, b, t, heads, hmask, offs_d, dmask, sob, sot, soh, sod, slb, slt, slh,
                 sfb, sft, sfh, sgb, sgt, sgh, NSPLIT: tl.constexpr, NSP2: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """`_merge_kernel`'s arithmetic for one (b, t, kv head)'s G heads inside the forward: the NSPLIT partials
    (written by other programs: read from L2, .cg) weighted by exp(lse_s - max), summed split by split."""
    offs_s = tl.arange(0, NSP2)  # NSPLIT padded to a power of 2
    lrow = LSE + b * slb + (t * NSPLIT + offs_s[:, None]) * slt + heads[None, :] * slh
    lse_s = tl.load(lrow, mask=(offs_s[:, None] < NSPLIT) & hmask[None, :], other=float("-inf"),
                    cache_modifier=".cg")  # [S, BLOCK_H]
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tot = tl.sum(tl.exp(lse_s - m_safe[None, :]), 0)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    omask = hmask[:, None] & dmask[None, :]
    for sp in tl.static_range(NSPLIT):  # unrolled: every partial's loads in flight at once
        row = t * NSPLIT + sp
        w = tl.exp(tl.load(LSE + b * slb + row * slt + heads * slh, mask=hmask, other=float("-inf"),
                           cache_modifier=".cg") - m_safe)
        o_s = tl.load(O + b * sob + row * sot + heads[:, None] * soh + offs_d[None, :] * sod, mask=omask, other=0.0,
                      cache_modifier=".cg")
        acc += o_s * w[:, None]
    empty = tot == 0.0
    out = acc / tl.where(empty, 1.0, tot)[:, None]
    lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, tot)))
    tl.store(OF + b * sfb + t * sft + heads[:, None] * sfh + offs_d[None, :], out.to(OF.dtype.element_ty), mask=omask)
    tl.store(LF + b * sgb + t * sgt + heads * sgh, lse, mask=hmask)


@triton.jit
def _merge_kernel(PO, PL, O, LSE, H, D, sob, soh, slb, slh,
                  NSPLIT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Merge split partials `PO [B, NSPLIT, H, D]`, `PL [B, NSPLIT, H]` (contiguous fp32) into
    O `[B, H, D]`, LSE `[B, H]`. One program per (head, batch row)."""
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < NSPLIT
    lse_s = tl.load(PL + (b * NSPLIT + offs_s) * H + h, mask=smask, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wgt = tl.exp(lse_s - m_safe)
    tot = tl.sum(wgt, 0)
    o_s = tl.load(PO + ((b * NSPLIT + offs_s[:, None]) * H + h) * D + offs_d[None, :],
                  mask=smask[:, None] & (offs_d[None, :] < D), other=0.0)
    out = tl.sum(o_s * wgt[:, None], 0) / tl.where(tot == 0.0, 1.0, tot)
    lse = tl.where(tot == 0.0, float("-inf"), m_safe + tl.log(tl.where(tot == 0.0, 1.0, tot)))
    tl.store(O + b * sob + h * soh + offs_d, out.to(O.dtype.element_ty), mask=offs_d < D)
    tl.store(LSE + b * slb + h * slh, lse)


@triton.jit
def _bwd_kernel(Q, K, V, IDX, O, DO, LSE, DLSE, DQ, DK, DV,
                sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                sib, sit, sik, sob, sot, soh, sod, sdob, sdot, sdoh, sdod, slb, slt, slh,
                sdqb, sdqt, sdqh, sdqd, sab, sas, sah,
                NK, S, G, D, scale, qk_scale,
                BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
                DKDV: tl.constexpr):
    """dq (stored) and, when DKDV, dk/dv (fp32 atomics into DK/DV `[B, S, H_kv, D]`, last dim
    contiguous, strides sab/sas/sah) for one (query, kv head). DLSE is the upstream grad of lse."""
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < G
    dmask = offs_d < D
    heads = kvh * G + offs_h
    hd = hmask[:, None] & dmask[None, :]
    q = tl.load(Q + b * sqb + t * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd, mask=hd, other=0.0)
    do = tl.load(DO + b * sdob + t * sdot + heads[:, None] * sdoh + offs_d[None, :] * sdod, mask=hd, other=0.0)
    o = tl.load(O + b * sob + t * sot + heads[:, None] * soh + offs_d[None, :] * sod, mask=hd, other=0.0)
    lse = tl.load(LSE + b * slb + t * slt + heads * slh, mask=hmask, other=float("-inf"))
    dlse = tl.load(DLSE + b * slb + t * slt + heads * slh, mask=hmask, other=0.0)
    # d lse / d s = P, so an upstream lse grad enters exactly like -delta.
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1) - dlse
    row_ok = lse != float("-inf")
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    kbase = K + b * skb + kvh * skh
    vbase = V + b * svb + kvh * svh
    ibase = IDX + b * sib + t * sit
    for k0 in range(0, NK, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(ibase + offs_k * sik, mask=offs_k < NK, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < S)  # out-of-range keys are treated as -1, never read
        kk = tl.load(kbase + idx[:, None] * sks + offs_d[None, :] * skd,
                     mask=valid[:, None] & dmask[None, :], other=0.0)  # [BLOCK_K, BLOCK_D]
        vv = tl.load(vbase + idx[:, None] * svs + offs_d[None, :] * svd,
                     mask=valid[:, None] & dmask[None, :], other=0.0)
        s = dot(q, tl.trans(kk), PREC)
        dp = dot(do, tl.trans(vv), PREC)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        p = tl.where(valid[None, :] & row_ok[:, None], p, 0.0)
        ds = p * (dp - delta[:, None])
        dq += dot(ds.to(kk.dtype), kk, PREC)
        if DKDV:
            dv_c = dot(tl.trans(p.to(do.dtype)), do, PREC)
            dk_c = dot(tl.trans(ds.to(q.dtype)), q, PREC)
            amask = valid[:, None] & dmask[None, :]
            aoff = b * sab + idx[:, None] * sas + kvh * sah + offs_d[None, :]
            tl.atomic_add(DV + aoff, dv_c, mask=amask, sem="relaxed")
            tl.atomic_add(DK + aoff, dk_c * scale, mask=amask, sem="relaxed")
    tl.store(DQ + b * sdqb + t * sdqt + heads[:, None] * sdqh + offs_d[None, :] * sdqd,
             (dq * scale).to(DQ.dtype.element_ty), mask=hd)


def _meta(q, k):
    G = q.shape[-2] // k.shape[-2]
    D = q.shape[-1]
    return G, D, max(16, triton.next_power_of_2(G)), max(16, triton.next_power_of_2(D))


def _fwd(q, k, v, indices, scale, nsplit: int = 1, out=None, tune: tuple[int, int, int] | None = None,
         pdl: bool = False, merged: tuple | None = None):
    """q `[B, T, H, D]` -> out `[B, T, H, D]` (q.dtype), lse `[B, T, H]` fp32, nsplit used.
    pdl: launch with programmatic dependent launch (decode: `sparse_decode(pdl=)`).
    `out=(o, lse)` writes into given buffers (nsplit 1 only; the benchmark poisons them);
    `tune=(BLOCK_K, num_warps, num_stages)` overrides the launch config (benchmark sweeps). merged = (out `[B, T, H,
    D]`, lse `[B, T, H]`, zeroed int32 counters `[>= B * H_kv * T]`): with more than one split, the kernel's last
    program of each group merges the partials into them (no `_merge_kernel` launch)."""
    B, T, H, D = q.shape
    H_kv = k.shape[2]
    NK = indices.shape[-1]
    G, D, BH, BD = _meta(q, k)
    # (128, 4 warps, 2 stages) was fastest of 7 configs at 32K, G=4, D=128 on an H200 (NOTES.md);
    # bigger head groups get smaller key blocks to bound registers.
    BK, warps, stages = tune or ((128 if BH <= 16 else 64 if BH <= 32 else 32), 4, 2 if q.is_cuda else 1)
    kps = triton.cdiv(triton.cdiv(NK, nsplit), BK) * BK  # keys per split, a multiple of BLOCK_K
    nsplit = max(1, triton.cdiv(NK, kps)) if NK else 1
    if out is not None:
        o, lse = out
        nsplit = 1
    elif nsplit == 1:
        o = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
        lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    else:
        o = torch.empty(B, T * nsplit, H, D, device=q.device, dtype=torch.float32)
        lse = torch.empty(B, T * nsplit, H, device=q.device, dtype=torch.float32)
    grid = (T * nsplit, H_kv, B)
    mk = {}
    if merged is not None and nsplit > 1:
        of, lf, cnt = merged
        mk = dict(CNT=cnt, OF=of, LF=lf, sfb=of.stride(0), sft=of.stride(1), sfh=of.stride(2), sgb=lf.stride(0),
                  sgt=lf.stride(1), sgh=lf.stride(2), MERGE=True, NSP2=max(2, triton.next_power_of_2(nsplit)))
    _fwd_kernel[grid](q, k, v, indices, o, lse, *q.stride(), *k.stride(), *v.stride(), *indices.stride(),
                      *o.stride(), *lse.stride(), T, NK, k.shape[1], G, D, kps, scale * LOG2E,
                      NSPLIT=nsplit, BLOCK_H=BH, BLOCK_K=BK, BLOCK_D=BD, PREC=dot_precision(q.dtype),
                      PDL=pdl, launch_pdl=bool(pdl), num_warps=warps, num_stages=stages, **mk)
    return o, lse, nsplit


def _query_bwd(q, k, v, indices, o, lse, do, dlse, scale, dkdv: bool = True, tune=None):
    """The per-query backward: dq, and with `dkdv` fp32 atomics for dk/dv (else None, None)."""
    B, T, H, D = q.shape
    S, H_kv = k.shape[1], k.shape[2]
    G, D, BH, BD = _meta(q, k)
    dq = torch.empty_like(q)
    dk = torch.zeros(B, S, H_kv, D, device=q.device, dtype=torch.float32) if dkdv else dq
    dv = torch.zeros_like(dk) if dkdv else dq
    BK, warps, stages = tune or ((32 if BD > 64 else 64), 4, 2 if q.is_cuda else 1)
    _bwd_kernel[(T, H_kv, B)](q, k, v, indices, o, do, lse, dlse, dq, dk, dv,
                              *q.stride(), *k.stride(), *v.stride(), *indices.stride(), *o.stride(),
                              *do.stride(), *lse.stride(), *dq.stride(), *dk.stride()[:3],
                              indices.shape[-1], S, G, D, scale, scale * LOG2E,
                              BLOCK_H=BH, BLOCK_K=BK, BLOCK_D=BD, PREC=dot_precision(q.dtype), DKDV=dkdv,
                              num_warps=warps, num_stages=stages)
    return (dq, dk.to(k.dtype), dv.to(v.dtype)) if dkdv else (dq, None, None)


def _pow2_divisor(n: int) -> int:
    return n & -n


class _Call:
    """One call's arguments besides the tensors: scale, sharing, requested paths, launch overrides
    (`tune`: {"fwd" | "dq" | "dkdv" | "bwd": (block, num_warps, num_stages), "keyq": keyq.keyq_dkdv's tune,
    "fwd_impl" / "bwd_impl": the tile kernels' Triton or Gluon forms, `_use_gluon`; "fwd_gluon" / "dq_gluon" /
    "keyq_gluon": the Gluon kernels' tunes, apart from the Triton ones'},
    benchmarks; "plan": the statistics `auto` estimates from, "full" (default) or "sample", paths.plan's `stats`;
    "small_tiles": whether the union tiles may hold BT/2 queries where `auto` estimates them faster, default True;
    "bt": the per-query union tiles' queries, forced (benchmarks; a forward without a backward, or one whose dk/dv
    is keyq, keeps them for the tile dq))."""

    def __init__(self, scale, query_group, q_offset, fwd_path, bwd_path, tune, key_block: int = 1):
        self.scale, self.group, self.q_offset, self.key_block = scale, query_group, q_offset, key_block
        self.fwd_path, self.bwd_path, self.tune = fwd_path, bwd_path, tune or {}
        self.needs_grad = True  # set by the caller: whether a backward can follow this forward
        self.lists = {}  # the block path's key-tile lists {BLOCK_N: blocks.BlockLists}, forward to backward


def _forward(q, k, v, indices, call: _Call, out=None):
    """-> (out, lse, per-query indices or None, TileSelection or None, Plan)."""
    S, H_kv = k.shape[1], k.shape[2]
    G = q.shape[2] // H_kv
    BT = union.tile_queries(G)
    prec = dot_precision(q.dtype)
    sel = None
    if call.group > 1:
        bts = min(BT, _pow2_divisor(call.group))
        if call.fwd_path != "query" and bts >= min(BT, 4):
            # the bitmap only serves the key-major backward: not built for a forward without one
            pl = paths.plan(indices, S, H_kv, bts, call.fwd_path, call.bwd_path, shared=True, key_block=call.key_block)
            if pl.fwd == "block" and not blocks.supported(q):
                pl = paths.Plan("tile", pl.bwd, "tile", pl.estimate_ms)
            block = pl.fwd == "block"
            sel = union.shared_tiles(indices, S, call.group, bts, call.q_offset, bits=call.needs_grad or block)
            if block:  # the key-tile lists, kept for the backward's dq pass (call.lists {BLOCK_N: lists})
                o, lse = blocks.block_fwd(q, k, v, sel, call.scale, prec, out=out, tune=call.tune.get("fwd"),
                                          cache=call.lists, key_block=call.key_block)
            else:
                o, lse = union.tile_fwd(q, k, v, sel, call.scale, prec, out=out, tune=call.tune.get("fwd"))
            return o, lse, None, sel, pl
        indices = shared_to_per_query(indices, call.group, q.shape[1], call.q_offset)
    pl = paths.plan(indices, S, H_kv, BT, call.fwd_path, call.bwd_path, is_cuda=q.is_cuda,
                    stats=call.tune.get("plan", "full"), small_tiles=bool(call.tune.get("small_tiles", True)),
                    grad=call.needs_grad)
    if call.tune.get("bt") and pl.fwd == "tile" and int(call.tune["bt"]) != (pl.bt or BT):
        pl.bt, pl.union = int(call.tune["bt"]), None  # the prebuilt bitmaps are of the plan's tiles
    if pl.fwd == "tile":
        sel = union.build_union(indices, S, pl.bt or BT, prebuilt=pl.union)
        o, lse = _tile_forward(q, k, v, sel, call, prec, out)
    else:
        o, lse, _ = _fwd(q, k, v, indices, call.scale, out=out, tune=call.tune.get("fwd"))
    return o, lse, indices, sel, pl


KERNEL_IMPLS = ("auto", "triton", "gluon")


def _use_gluon(q, call: _Call, key: str, fits: bool, auto: bool) -> bool:
    """Whether the kernels of tune key `key` ("fwd_impl": the per-query tile forward; "bwd_impl": the tile dq and
    the keyq dk/dv) run their Gluon forms (`union_gluon`, `keyq_gluon`: cp.async rings + warpgroup MMAs) instead of
    Triton's: auto / triton / gluon. `auto`: what "auto" picks where Gluon runs and the shapes fit (`fits`), from
    the H100 timings of session 30 (32K, trained selections): the Gluon tile dq 6.60 ms against Triton's 7.84 and
    the Gluon dk/dv 14.81 against 15.02 (so the backward's on), the Gluon forward 6.42 against 6.34 (so off).
    "gluon" where they cannot run is an error naming the key."""
    impl = call.tune.get(key, "auto")
    if impl not in KERNEL_IMPLS:
        raise ValueError(f"{key} {impl!r}: expected one of {KERNEL_IMPLS}")
    runs = union_gluon.available(q) and fits
    if impl == "gluon" and not runs:
        raise ValueError(f"{key} 'gluon' needs an sm_90 GPU, Gluon and the kernels' shapes (64-row per-query tiles "
                         "of bf16 / fp16; D 128 for dk/dv)")
    return impl == "gluon" or (impl == "auto" and auto and runs)


def _tile_forward(q, k, v, sel: union.TileSelection, call: _Call, prec: int, out=None):
    """The per-query tile forward (tune "fwd": the Triton launch; "fwd_gluon": the Gluon kernel's)."""
    if _use_gluon(q, call, "fwd_impl", union_gluon.supports(q, k, sel), auto="fwd" not in call.tune):
        return union_gluon.tile_fwd_gluon(q, k, v, sel, call.scale, out=out, tune=call.tune.get("fwd_gluon"))
    return union.tile_fwd(q, k, v, sel, call.scale, prec, out=out, tune=call.tune.get("fwd"))


def _tile_dq(q, k, v, sel: union.TileSelection, do, lse, delta, call: _Call, prec: int):
    """The tile dq pass (tune "dq": the Triton launch; "dq_gluon": the Gluon kernel's)."""
    if _use_gluon(q, call, "bwd_impl", union_gluon.supports(q, k, sel), auto="dq" not in call.tune):
        return union_gluon.tile_dq_gluon(q, k, v, sel, do, lse, delta, call.scale, tune=call.tune.get("dq_gluon"))
    return union.tile_dq(q, k, v, sel, do, lse, delta, call.scale, prec, tune=call.tune.get("dq"))


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, call):
        o, lse, per_query, sel, pl = _forward(q, k, v, indices, call)
        ctx.call, ctx.plan = call, pl
        ctx.sel_meta = (sel.BT, sel.group, sel.q_offset, len(sel.tensors())) if sel is not None else None
        ctx.has_per_query = per_query is not None
        saved = [q, k, v, o, lse, per_query if per_query is not None else indices]
        ctx.save_for_backward(*saved, *(sel.tensors() if sel is not None else ()))
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, idx, *st = ctx.saved_tensors
        call, pl = ctx.call, ctx.plan
        sel = union.TileSelection.from_tensors(*ctx.sel_meta[:3], st) if ctx.sel_meta else None
        if sel is not None and not sel.shared and sel.BT != union.tile_queries(q.shape[2] // k.shape[2]) \
                and pl.bwd != "keyq":
            sel = None  # tiles of BT/2 queries serve the tile dq; the key-major dk/dv builds BT's
        if sel is not None and sel.shared:
            sel = union.with_bits(sel, k.shape[1])
        do = do if do is not None else torch.zeros_like(o)
        dlse = torch.zeros_like(lse) if dlse is None else dlse.float().contiguous()
        lse = lse.contiguous()
        prec = dot_precision(q.dtype)
        per_query = idx if ctx.has_per_query else None
        if pl.bwd == "atomic":
            if per_query is None:
                per_query = shared_to_per_query(idx, call.group, q.shape[1], call.q_offset)
            dq, dk, dv = _query_bwd(q, k, v, per_query, o, lse, do, dlse, call.scale, tune=call.tune.get("bwd"))
            return dq, dk, dv, None, None
        if pl.bwd == "keyq":  # dk/dv over each key tile's query list (keyq.py), dq as the plan says
            if per_query is None:
                per_query = shared_to_per_query(idx, call.group, q.shape[1], call.q_offset)
            delta = keymajor.bwd_delta(o, do, dlse)
            if pl.dq == "tile":
                if sel is None:
                    sel = union.build_union(per_query, k.shape[1], union.tile_queries(q.shape[2] // k.shape[2]),
                                            prebuilt=pl.union)
                dq = _tile_dq(q, k, v, sel, do, lse, delta, call, prec)
            elif pl.dq == "block":
                dq = blocks.block_dq(q, k, v, sel, do, lse, delta, call.scale, prec, tune=call.tune.get("dq"),
                                     cache=call.lists, key_block=call.key_block)
            else:
                dq = _query_bwd(q, k, v, per_query, o, lse, do, dlse, call.scale, dkdv=False,
                                tune=call.tune.get("bwd"))[0]
            if _use_gluon(q, call, "bwd_impl", keyq_gluon.supports(q, k), auto="keyq" not in call.tune):
                dk, dv = keyq_gluon.keyq_dkdv_gluon(q, k, v, per_query, do, lse, delta, call.scale,
                                                    tune=call.tune.get("keyq_gluon"))
            else:
                dk, dv = keyq.keyq_dkdv(q, k, v, per_query, do, lse, delta, call.scale, prec,
                                        tune=call.tune.get("keyq"))
            return dq, dk, dv, None, None
        if sel is None:
            sel = union.build_union(per_query, k.shape[1], union.tile_queries(q.shape[2] // k.shape[2]),
                                    prebuilt=pl.union)
        delta = keymajor.bwd_delta(o, do, dlse)
        if pl.dq == "block":
            dq = blocks.block_dq(q, k, v, sel, do, lse, delta, call.scale, prec, tune=call.tune.get("dq"),
                                 cache=call.lists, key_block=call.key_block)
        elif pl.dq == "tile" or per_query is None:
            dq = _tile_dq(q, k, v, sel, do, lse, delta, call, prec)
        else:
            dq = _query_bwd(q, k, v, per_query, o, lse, do, dlse, call.scale, dkdv=False, tune=call.tune.get("bwd"))[0]
        dk, dv = keymajor.key_major_dkdv(q, k, v, sel, do, lse, delta, call.scale, prec, tune=call.tune.get("dkdv"),
                                         key_block=call.key_block if sel.shared else 1)
        return dq, dk, dv, None, None


def _check(q, k, v, indices, query_group: int = 1):
    B, T, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[-1] != D or H % k.shape[2]:
        raise ValueError(f"sparse_attention: q {tuple(q.shape)} and k/v {tuple(k.shape)}/{tuple(v.shape)} "
                         "must be [B, T, H, D] and [B, S, H_kv, D] with H a multiple of H_kv")
    rows = -(-T // query_group)
    if query_group < 1 or indices.dim() != 3 or tuple(indices.shape[:2]) != (B, rows):
        raise ValueError(f"indices shape {tuple(indices.shape)} does not match q {tuple(q.shape)} "
                         f"with query_group {query_group} (expected [{B}, {rows}, K])")


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                     scale: float | None = None, *, query_group: int = 1, q_offset: int = 0,
                     fwd_path: str = "auto", bwd_path: str = "auto", tune: dict | None = None, key_block: int = 1):
    """Sparse attention, Triton. q `[B, T, H, D]`, k/v `[B, S, H_kv, D]`, indices `[B, T, K]` int
    (-1 = none), or with `query_group` g > 1 one row per g consecutive queries `[B, ceil(T/g), K]`
    shared by them (each query then sees the row's keys <= q_offset + t) -> (out `[B, T, H, D]`,
    lse `[B, T, H]` fp32). Differentiable in q, k, v. `fwd_path` in auto/query/tile/block, `bwd_path` in
    auto/atomic/tile/keyq (paths.py); `key_block`: the shared rows' key block (a hint for `auto` and the block
    launches; any rows stay exact). Falls back to the reference for unsupported shapes/dtypes."""
    _check(q, k, v, indices, query_group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if fwd_path not in paths.FWD_PATHS or bwd_path not in paths.BWD_PATHS:
        raise ValueError(f"fwd_path {fwd_path!r} / bwd_path {bwd_path!r}: expected one of "
                         f"{paths.FWD_PATHS} / {paths.BWD_PATHS}")
    if indices.dtype != torch.int32:
        indices = indices.to(torch.int32)
    if not supported(q, k) or indices.shape[-1] == 0 or q.shape[1] == 0 or v.dtype != q.dtype:
        if query_group > 1:
            indices = shared_to_per_query(indices, query_group, q.shape[1], q_offset)
        return sparse_attention_naive(q, k, v, indices, scale)
    call = _Call(scale, query_group, q_offset, fwd_path, bwd_path, tune, key_block)
    call.needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return _SparseAttention.apply(q, k, v, indices, call)


def sparse_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                             scale: float | None = None, *, query_group: int = 1, q_offset: int = 0,
                             fwd_path: str = "auto", out: tuple | None = None, tune: dict | None = None,
                             key_block: int = 1):
    """The forward alone, no autograd (benchmarks, checks): same arguments as `sparse_attention`;
    `out=(o, lse)` writes into given buffers. Returns (out, lse, paths.Plan actually taken)."""
    _check(q, k, v, indices, query_group)
    if not supported(q, k) or indices.shape[-1] == 0 or q.shape[1] == 0:
        raise ValueError("sparse_attention_forward: shape/dtype not supported by the kernels")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    call = _Call(scale, query_group, q_offset, fwd_path, "auto", tune, key_block)
    call.needs_grad = False
    o, lse, _, _, pl = _forward(q, k, v, indices.to(torch.int32), call, out=out)
    return o, lse, pl


@functools.lru_cache(maxsize=None)
def _num_sms(device_type: str, index: int | None) -> int:
    if device_type != "cuda":
        return 4
    dev = index if index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(dev).multi_processor_count


def decode_splits(B: int, H_kv: int, NK: int, device) -> int:
    """Split the index list until the grid has ~1 program per SM, keeping >= 256 keys a split
    (B=32, H_kv=8, k=2048 on an H200: 1 split 0.068 ms, 2: 0.078, 4: 0.072, 8: 0.074; NOTES.md)."""
    sms = _num_sms(device.type, device.index)
    return max(1, min(triton.cdiv(NK, 256), triton.cdiv(sms, max(1, B * H_kv))))


_MERGE_COUNTERS: dict = {}  # device -> zeroed int32 counters of the fused merge (every launch leaves them zeroed)


def _merge_counters(dev: torch.device, n: int) -> torch.Tensor:
    """The fused merge's counters `[>= n]`: one buffer per device (`_backend.grown_counters`). Launches in one stream's
    order share it; two at once (side streams) must not (`sparse_decode(merge=)`)."""
    return grown_counters(_MERGE_COUNTERS, dev, n, 256)


def sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor,
                  scale: float | None = None, nsplit: int | None = None, pdl: bool = False, merge: str = "kernel"):
    """One decode step, Triton. q `[B, H, D]`, caches `[B, S_max, H_kv, D]`, indices `[B, K]`
    (-1 = none) -> (out `[B, H, D]`, lse `[B, H]` fp32). Reads only the selected cache rows.
    Inference only: with inputs that need grad (and grad enabled) it takes the differentiable
    reference. `nsplit` overrides the split-K heuristic (benchmarks). pdl: both launches with programmatic
    dependent launch (the caller decides it once: `_backend.resolve_pdl`). merge: how a split index list's
    partials are merged, "kernel" (`_merge_kernel`, a second launch) or "fused" (the last program of each (row,
    kv head) merges them inside the forward, `_merge_group`: one launch; its counters are one buffer a device, so
    two fused launches must not run at once on two streams). The same values up to the fp32 order of the sum over
    the splits."""
    if merge not in MERGES:
        raise ValueError(f"sparse_decode: merge {merge!r} not among {MERGES}")
    B, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    q4, idx3 = q[:, None], indices[:, None]
    _check(q4, k_cache, v_cache, idx3)
    if (not supported(q, k_cache) or indices.shape[-1] == 0 or v_cache.dtype != q.dtype
            or torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad)):
        out, lse = sparse_attention_naive(q4, k_cache, v_cache, idx3, scale)
        return out[:, 0], lse[:, 0]
    if idx3.dtype != torch.int32:
        idx3 = idx3.to(torch.int32)
    H_kv, NK = k_cache.shape[2], indices.shape[-1]
    ns = nsplit or decode_splits(B, H_kv, NK, q.device)
    merged = None
    if ns > 1:  # the merged result's buffers (unused where `_fwd` rounds the split down to one)
        out = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
        lse = torch.empty(B, H, device=q.device, dtype=torch.float32)
        if merge == "fused":
            merged = (out[:, None], lse[:, None], _merge_counters(q.device, B * H_kv))
    po, pl, ns = _fwd(q4, k_cache, v_cache, idx3, scale, ns, pdl=pdl, merged=merged)
    if ns == 1:
        return po[:, 0], pl[:, 0]
    if merged is not None:
        return out, lse
    _merge_kernel[(H, B)](po, pl, out, lse, H, D, out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
                          NSPLIT=ns, BLOCK_S=max(2, triton.next_power_of_2(ns)),
                          BLOCK_D=triton.next_power_of_2(D), PDL=pdl, launch_pdl=bool(pdl), num_warps=1)
    return out, lse
