"""Fused Triton version of the warm-up KL (`naive.warmup_kl`, the reference beside it): no `[H, Tc, S]` block ever reaches memory.

Kernels, flash-attention style (tiles of BLOCK_M queries x BLOCK_N keys stay in registers):
  0. `_dense_lse` (only when the caller has no dense log-sum-exp): per query and head, the lse of the
     causal dense logits `[B, H, T]`. The warm-up hook normally passes the one the dense forward's own
     flash attention returns (`train/hooks.py`, `_capture_attention`), so this pass is skipped there.
  1. `_index_lse`: per query, the log-sum-exp of the indexer scores I(t, s) `[B, T]`.
  2. `_kl_fused`: per query tile, streams the keys once; rebuilds p(t, s) = (1/H) sum_h exp(l_h - lse_h)
     (each K tile loaded once per KV head and reused by the G query heads of its group) and
     log q(t, s) = I - lse_I, adds p (log p - log q) to the row's KL, and with g = q - p (dKL/dI)
     accumulates dw and dq_I in registers and adds each tile's dk_I into a fp32 buffer with atomics.
     One pass instead of separate query-side and key-side passes: p is rebuilt once, not twice.
Tiles fully below the causal diagonal run without any mask; exponentials are exp2 with log2(e) folded
into the scale. dk_I is summed with fp32 atomics, so its last bits depend on the order tiles finish.
Only causal rows without left padding (kv_start None) and up to 8 indexer heads are supported; the
caller (`warmup_kl_triton`) falls back to the torch path otherwise.

Status: checked against the PyTorch path (value and gradients) under TRITON_INTERPRET=1 in CI and on an
H200 (8K, Qwen2-0.5B shape: KL and attn_recall equal to 5-6 digits, gradients within 1.6e-3 relative).
One layer at 32K: 18.2 ms with the lse given; warm-up step 96 ms at 8K, 591 ms at 32K between log steps
(3.3x a dense forward; 7.3x / 10.2x before): benchmarks/results/2026-11-29-h200-indexer-speed.md.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot, dot_precision

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MAX_INDEX_HEADS = 8  # dq_I / dw live in one register accumulator per indexer head

# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the fused pass and of the index-lse pass on CUDA. Chosen on
# an H200 at 32K (Qwen2-0.5B shape, one layer, lse given: 32x64/4 warps 18.2 ms, 64x64/8 22.3 ms, 64x32/4
# 22.4 ms, 64x32/8 23.5 ms; 2026-11-29-h200-indexer-speed.md). The fused pass is not software-pipelined
# (num_stages 1): with 2 stages Triton 3.6 stages every load of the loop in shared memory (380 KB at 64x64,
# over the 227 KB limit).
FUSED_CONFIG = (32, 64, 4, 1)
INDEX_LSE_CONFIG = (64, 64, 4, 2)


@triton.jit
def _ld(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _dense_lse(Q, K, LSE, sqb, sqh, sqt, sqd, skb, skh, sks, skd, T, S, q_offset, scale_log2,
               H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    """Fallback when no dense lse is given: one program per (query tile, head); natural-log lse out."""
    pm = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // G
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < T
    pos = q_offset + offs_m
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                mask=mmask[:, None] & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    hi = tl.minimum(S, q_offset + tl.minimum((pm + 1) * BLOCK_M, T))
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kt = tl.load(K + b * skb + hk * skh + offs_n[None, :] * sks + offs_d[:, None] * skd,
                     mask=(offs_n[None, :] < S) & (offs_d[:, None] < D), other=0.0)
        s = dot(q, kt, PREC) * scale_log2
        vis = (offs_n[None, :] <= pos[:, None]) & (offs_n[None, :] < S)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    tl.store(LSE + (b * H + h) * T + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=mmask)


@triton.jit
def _index_scores(QI, W, KT, b, offs_m, mmask, offs_d, sib, sit, sih, sid, swb, swt, swh,
                  HI: tl.constexpr, DI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, PREC: tl.constexpr):
    """I = sum_j w_j ReLU(q_j . k) for one tile: `[BLOCK_M, BLOCK_N]` fp32 (KT: `[BLOCK_D, BLOCK_N]`)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for j in range(HI):
        qj = _ld(QI + b * sib + offs_m[:, None] * sit + j * sih + offs_d[None, :] * sid,
                 mmask[:, None] & (offs_d[None, :] < DI), MASKED)
        wj = _ld(W + b * swb + offs_m * swt + j * swh, mmask, MASKED).to(tl.float32)
        acc += wj[:, None] * tl.maximum(dot(qj, KT, PREC), 0.0)
    return acc


@triton.jit
def _index_lse_tile(QI, W, KI, b, n0, offs_m, offs_d, mmask, pos, m_i, l_i, sib, sit, sih, sid, swb, swt, swh,
                    sjb, sjs, sjd, S, HI: tl.constexpr, DI: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, LD_MASKED: tl.constexpr, PREC: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kt = _ld(KI + b * sjb + offs_n[None, :] * sjs + offs_d[:, None] * sjd,
             (offs_n[None, :] < S) & (offs_d[:, None] < DI), LD_MASKED)
    s = _index_scores(QI, W, kt, b, offs_m, mmask, offs_d, sib, sit, sih, sid, swb, swt, swh,
                      HI, DI, BLOCK_M, BLOCK_N, LD_MASKED, PREC) * 1.4426950408889634
    if MASKED:
        s = tl.where((offs_n[None, :] <= pos[:, None]) & (offs_n[None, :] < S), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
    return m_new, l_i


@triton.jit
def _index_lse(QI, W, KI, LSEI, sib, sit, sih, sid, swb, swt, swh, sjb, sjs, sjd, T, S, q_offset,
               HI: tl.constexpr, DI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    n_m = tl.cdiv(T, BLOCK_M)
    pm = n_m - 1 - tl.program_id(0)  # the longest rows first: better balance over the causal triangle
    b = tl.program_id(1).to(tl.int64)
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < T
    pos = q_offset + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    hi = tl.minimum(S, q_offset + tl.minimum((pm + 1) * BLOCK_M, T))
    n_full = tl.where((pm + 1) * BLOCK_M <= T, (q_offset + pm * BLOCK_M + 1) // BLOCK_N * BLOCK_N, 0)
    for n0 in range(0, n_full, BLOCK_N):  # every key visible to every row of the tile: no mask
        m_i, l_i = _index_lse_tile(QI, W, KI, b, n0, offs_m, offs_d, mmask, pos, m_i, l_i, sib, sit, sih, sid,
                                   swb, swt, swh, sjb, sjs, sjd, S, HI, DI, BLOCK_M, BLOCK_N, False,
                                   BLOCK_D != DI, PREC)
    for n0 in range(n_full, hi, BLOCK_N):
        m_i, l_i = _index_lse_tile(QI, W, KI, b, n0, offs_m, offs_d, mmask, pos, m_i, l_i, sib, sit, sih, sid,
                                   swb, swt, swh, sjb, sjs, sjd, S, HI, DI, BLOCK_M, BLOCK_N, True, True, PREC)
    tl.store(LSEI + b * T + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=mmask)


@triton.jit
def _acc(j: tl.constexpr, k: tl.constexpr, acc, upd):
    """acc + upd when the static indices agree (selects one of the per-head accumulators)."""
    if j == k:
        return acc + upd
    else:
        return acc


@triton.jit
def _fused_tile(Q, K, LSE2, QI, W, KI, LSEI, DK, b, n0, offs_m, offs_d, mmask, pos, lsei,
                kl, dq0, dq1, dq2, dq3, dq4, dq5, dq6, dq7, dw0, dw1, dw2, dw3, dw4, dw5, dw6, dw7,
                sqb, sqh, sqt, sqd, skb, skh, sks, skd, sib, sit, sih, sid, swb, swt, swh, sjb, sjs, sjd,
                slb, slh, slt, S, scale_log2, gscale,
                H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, HI: tl.constexpr,
                DI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                GRAD: tl.constexpr, MASKED: tl.constexpr, LD_MASKED: tl.constexpr, PREC: tl.constexpr):
    """One `[BLOCK_M, BLOCK_N]` tile: KL terms, dq/dw into the per-head accumulators, dk out by atomics."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < S
    vis = (offs_n[None, :] <= pos[:, None]) & mmask[:, None]
    # the dense target, log2 domain: exp2(s * scale * log2(e) - lse_h * log2(e))
    # Dynamic (not unrolled) head loops: unrolled, the compiler keeps every head's q tile live at once
    # (registers spill, shared memory overflows); rolled, one q tile is live at a time.
    p = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for hk in range(HKV):
        kt = _ld(K + b * skb + hk * skh + offs_n[None, :] * sks + offs_d[:, None] * skd,
                 nmask[None, :] & (offs_d[:, None] < D), LD_MASKED)  # [BLOCK_D, BLOCK_N], once per group
        for g in range(G):
            q = _ld(Q + b * sqb + (hk * G + g) * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
                    mmask[:, None] & (offs_d[None, :] < D), LD_MASKED)
            lse = _ld(LSE2 + b * slb + (hk * G + g) * slh + offs_m * slt, mmask, LD_MASKED)
            s = dot(q, kt, PREC) * scale_log2 - lse[:, None]
            if MASKED:
                s = tl.where(vis, s, float("-inf"))
            p += tl.exp2(s)
    p = p * (1.0 / H)
    kt_i = _ld(KI + b * sjb + offs_n[None, :] * sjs + offs_d[:, None] * sjd,
               nmask[None, :] & (offs_d[:, None] < DI), LD_MASKED)  # [BLOCK_D, BLOCK_N]
    ind = _index_scores(QI, W, kt_i, b, offs_m, mmask, offs_d, sib, sit, sih, sid, swb, swt, swh,
                        HI, DI, BLOCK_M, BLOCK_N, LD_MASKED, PREC)
    logq = ind - lsei[:, None]
    # p = 0 exactly where a key is invisible (exp2(-inf)), so the KL needs no mask
    pos_p = p > 0
    kl += tl.sum(tl.where(pos_p, p * (tl.log2(tl.where(pos_p, p, 1.0)) * 0.6931471805599453 - logq), 0.0), 1)
    if GRAD:
        g = tl.exp2(logq * 1.4426950408889634) - p
        if MASKED:
            g = tl.where(vis, g, 0.0)
        g = g * gscale  # d(gscale * KL) / dI
        k_i = _ld(KI + b * sjb + offs_n[:, None] * sjs + offs_d[None, :] * sjd,
                  nmask[:, None] & (offs_d[None, :] < DI), LD_MASKED)  # [BLOCK_N, BLOCK_D]
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for j in tl.static_range(HI):
            qj = _ld(QI + b * sib + offs_m[:, None] * sit + j * sih + offs_d[None, :] * sid,
                     mmask[:, None] & (offs_d[None, :] < DI), LD_MASKED)
            wj = _ld(W + b * swb + offs_m * swt + j * swh, mmask, LD_MASKED).to(tl.float32)
            dj = dot(qj, kt_i, PREC)
            on = dj > 0
            dwj = tl.sum(tl.where(on, g * dj, 0.0), 1)
            gj = tl.where(on, g * wj[:, None], 0.0).to(qj.dtype)
            dqj = dot(gj, k_i, PREC)
            dk += dot(tl.trans(gj), qj, PREC)
            dq0, dw0 = _acc(j, 0, dq0, dqj), _acc(j, 0, dw0, dwj)
            dq1, dw1 = _acc(j, 1, dq1, dqj), _acc(j, 1, dw1, dwj)
            dq2, dw2 = _acc(j, 2, dq2, dqj), _acc(j, 2, dw2, dwj)
            dq3, dw3 = _acc(j, 3, dq3, dqj), _acc(j, 3, dw3, dwj)
            dq4, dw4 = _acc(j, 4, dq4, dqj), _acc(j, 4, dw4, dwj)
            dq5, dw5 = _acc(j, 5, dq5, dqj), _acc(j, 5, dw5, dwj)
            dq6, dw6 = _acc(j, 6, dq6, dqj), _acc(j, 6, dw6, dwj)
            dq7, dw7 = _acc(j, 7, dq7, dqj), _acc(j, 7, dw7, dwj)
        dk_ptrs = DK + (b * S + offs_n[:, None]) * DI + offs_d[None, :]
        if LD_MASKED:
            tl.atomic_add(dk_ptrs, dk, mask=nmask[:, None] & (offs_d[None, :] < DI), sem="relaxed")
        else:
            tl.atomic_add(dk_ptrs, dk, sem="relaxed")
    return kl, dq0, dq1, dq2, dq3, dq4, dq5, dq6, dq7, dw0, dw1, dw2, dw3, dw4, dw5, dw6, dw7


@triton.jit
def _store_head(DQ, DW, dq, dw, b, offs_m, offs_d, mmask, T, j: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr):
    if j < HI:
        tl.store(DQ + ((b * T + offs_m[:, None]) * HI + j) * DI + offs_d[None, :], dq,
                 mask=mmask[:, None] & (offs_d[None, :] < DI))
        tl.store(DW + (b * T + offs_m) * HI + j, dw, mask=mmask)


@triton.jit
def _kl_fused(Q, K, LSE2, QI, W, KI, LSEI, KL, DQ, DW, DK,
              sqb, sqh, sqt, sqd, skb, skh, sks, skd, sib, sit, sih, sid, swb, swt, swh, sjb, sjs, sjd,
              slb, slh, slt, T, S, q_offset, scale_log2, gscale,
              H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, GRAD: tl.constexpr,
              PREC: tl.constexpr):
    n_m = tl.cdiv(T, BLOCK_M)
    pm = n_m - 1 - tl.program_id(0)  # the longest rows first: better balance over the causal triangle
    b = tl.program_id(1).to(tl.int64)
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < T
    pos = q_offset + offs_m
    lsei = tl.load(LSEI + b * T + offs_m, mask=mmask, other=0.0)
    kl = tl.zeros([BLOCK_M], tl.float32)
    z = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    zw = tl.zeros([BLOCK_M], tl.float32)
    dq0, dq1, dq2, dq3, dq4, dq5, dq6, dq7 = z, z, z, z, z, z, z, z
    dw0, dw1, dw2, dw3, dw4, dw5, dw6, dw7 = zw, zw, zw, zw, zw, zw, zw, zw
    hi = tl.minimum(S, q_offset + tl.minimum((pm + 1) * BLOCK_M, T))
    # key tiles entirely visible to every row of this (complete) query tile need no mask at all
    n_full = tl.where((pm + 1) * BLOCK_M <= T, (q_offset + pm * BLOCK_M + 1) // BLOCK_N * BLOCK_N, 0)
    for n0 in range(0, n_full, BLOCK_N):
        kl, dq0, dq1, dq2, dq3, dq4, dq5, dq6, dq7, dw0, dw1, dw2, dw3, dw4, dw5, dw6, dw7 = _fused_tile(
            Q, K, LSE2, QI, W, KI, LSEI, DK, b, n0, offs_m, offs_d, mmask, pos, lsei,
            kl, dq0, dq1, dq2, dq3, dq4, dq5, dq6, dq7, dw0, dw1, dw2, dw3, dw4, dw5, dw6, dw7,
            sqb, sqh, sqt, sqd, skb, skh, sks, skd, sib, sit, sih, sid, swb, swt, swh, sjb, sjs, sjd,
            slb, slh, slt, S, scale_log2, gscale, H, HKV, H // HKV, D, HI, DI, BLOCK_M, BLOCK_N, BLOCK_D, GRAD, False,
            (BLOCK_D != D) or (BLOCK_D != DI), PREC)
    for n0 in range(n_full, hi, BLOCK_N):
        kl, dq0, dq1, dq2, dq3, dq4, dq5, dq6, dq7, dw0, dw1, dw2, dw3, dw4, dw5, dw6, dw7 = _fused_tile(
            Q, K, LSE2, QI, W, KI, LSEI, DK, b, n0, offs_m, offs_d, mmask, pos, lsei,
            kl, dq0, dq1, dq2, dq3, dq4, dq5, dq6, dq7, dw0, dw1, dw2, dw3, dw4, dw5, dw6, dw7,
            sqb, sqh, sqt, sqd, skb, skh, sks, skd, sib, sit, sih, sid, swb, swt, swh, sjb, sjs, sjd,
            slb, slh, slt, S, scale_log2, gscale, H, HKV, H // HKV, D, HI, DI, BLOCK_M, BLOCK_N, BLOCK_D, GRAD, True, True, PREC)
    tl.store(KL + b * T + offs_m, kl, mask=mmask)
    if GRAD:
        _store_head(DQ, DW, dq0, dw0, b, offs_m, offs_d, mmask, T, 0, HI, DI)
        _store_head(DQ, DW, dq1, dw1, b, offs_m, offs_d, mmask, T, 1, HI, DI)
        _store_head(DQ, DW, dq2, dw2, b, offs_m, offs_d, mmask, T, 2, HI, DI)
        _store_head(DQ, DW, dq3, dw3, b, offs_m, offs_d, mmask, T, 3, HI, DI)
        _store_head(DQ, DW, dq4, dw4, b, offs_m, offs_d, mmask, T, 4, HI, DI)
        _store_head(DQ, DW, dq5, dw5, b, offs_m, offs_d, mmask, T, 5, HI, DI)
        _store_head(DQ, DW, dq6, dw6, b, offs_m, offs_d, mmask, T, 6, HI, DI)
        _store_head(DQ, DW, dq7, dw7, b, offs_m, offs_d, mmask, T, 7, HI, DI)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def warmup_kl_fused(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, *,
                    scale: float, q_offset: int = 0, grad_scale: float | None = None, lse: torch.Tensor | None = None,
                    config: tuple[int, int, int, int] | None = None,
                    index_config: tuple[int, int, int, int] | None = None):
    """Same contract as `naive.warmup_kl` without indices/kv_start: q `[B, H, T, D]`, k `[B, H_kv, S, D]`,
    q_idx `[B, T, H_I, D_I]` (H_I <= 8), w `[B, T, H_I]`, k_idx `[B, S, D_I]`.

    lse: optional `[B, H, T]` natural-log dense log-sum-exp of `scale * q . k` over the causal keys
        (e.g. from the dense forward's flash attention); computed here when None.
    config / index_config: (BLOCK_M, BLOCK_N, num_warps, num_stages) of the fused and the index-lse
        pass (defaults: FUSED_CONFIG / INDEX_LSE_CONFIG on CUDA, 16-wide tiles in the interpreter).
    Returns (kl_rows `[B, T]` fp32, lse `[B, H, T]` fp32 dense log-sum-exp, grads) where grads is
    None or (dq_idx, dw, dk_idx) of `grad_scale * sum(kl_rows)`, in the indexer outputs' dtypes.
    """
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    HI, DI = q_idx.shape[2], q_idx.shape[3]
    if HI > MAX_INDEX_HEADS:
        raise ValueError(f"warmup_kl_fused: {HI} indexer heads, at most {MAX_INDEX_HEADS} supported")
    dev = q.device
    small = (16, 16, 4, 1)
    config = config or (small if _interpreting() else FUSED_CONFIG)
    index_config = index_config or (small if _interpreting() else INDEX_LSE_CONFIG)
    BD = max(16, triton.next_power_of_2(max(D, DI)))
    prec = dot_precision(q.dtype)
    qi, wi, ki = q_idx.detach(), w.detach(), k_idx.detach()
    if lse is None:
        lse = torch.empty(B, H, T, device=dev, dtype=torch.float32)
        _dense_lse[(triton.cdiv(T, 64 if not _interpreting() else 16), B * H)](
            q, k, lse, *q.stride(), *k.stride(), T, S, q_offset, float(scale) * LOG2E,
            H=H, G=H // Hkv, D=D, BLOCK_M=64 if not _interpreting() else 16, BLOCK_N=64 if not _interpreting() else 16,
            BLOCK_D=BD, PREC=prec, num_warps=4)
    lse2 = lse.float() * LOG2E  # [B, H, T], log2 domain for the exp2 in the fused pass
    bm, bn, nw, ns = index_config
    lsei = torch.empty(B, T, device=dev, dtype=torch.float32)
    _index_lse[(triton.cdiv(T, bm), B)](
        qi, wi, ki, lsei, *qi.stride(), *wi.stride(), *ki.stride(), T, S, q_offset,
        HI=HI, DI=DI, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=BD, PREC=prec, num_warps=nw, num_stages=ns)
    grad = grad_scale is not None
    kl = torch.empty(B, T, device=dev, dtype=torch.float32)
    dq = torch.empty(B, T, HI, DI, device=dev, dtype=torch.float32) if grad else kl
    dw = torch.empty(B, T, HI, device=dev, dtype=torch.float32) if grad else kl
    dk = torch.zeros(B, S, DI, device=dev, dtype=torch.float32) if grad else kl
    bm, bn, nw, ns = config
    _kl_fused[(triton.cdiv(T, bm), B)](
        q, k, lse2, qi, wi, ki, lsei, kl, dq, dw, dk,
        *q.stride(), *k.stride(), *qi.stride(), *wi.stride(), *ki.stride(), *lse2.stride(),
        T, S, q_offset, float(scale) * LOG2E, float(grad_scale) if grad else 0.0,
        H=H, HKV=Hkv, D=D, HI=HI, DI=DI, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=BD, GRAD=grad, PREC=prec,
        num_warps=nw, num_stages=ns)
    grads = (dq.to(q_idx.dtype), dw.to(w.dtype), dk.to(k_idx.dtype)) if grad else None
    return kl, lse, grads


def warmup_kl_triton(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, *,
                     scale: float, indices: torch.Tensor | None = None, q_offset: int = 0,
                     grad_scale: float | None = None, lse: torch.Tensor | None = None):
    """Drop-in for `naive.warmup_kl` (kv_start None): returns KLStats and, with `grad_scale`, back-propagates
    the fused gradients through the indexer outputs. lse: optional `[B, H, T]` dense log-sum-exp (see
    `warmup_kl_fused`). attn_recall comes from log-sum-exps instead of a gather:
    (1/H) sum_h exp(lse_selected_h - lse_dense_h), lse_selected from the sparse-attention kernel.
    More than 8 indexer heads: the chunked torch path (`naive.warmup_kl`)."""
    from sparse_rl.sparse.ops import sparse_attention
    from sparse_rl.sparse.ops.indexer_kl.naive import KLStats, warmup_kl

    if q_idx.shape[2] > MAX_INDEX_HEADS:
        return warmup_kl(q, k, q_idx, w, k_idx, scale=scale, indices=indices, q_offset=q_offset,
                         grad_scale=grad_scale)
    kl, lse, grads = warmup_kl_fused(q.detach(), k.detach(), q_idx, w, k_idx, scale=scale, q_offset=q_offset,
                                     grad_scale=grad_scale, lse=lse)
    recall = None
    if indices is not None:
        with torch.no_grad():
            kt = k.detach().transpose(1, 2)
            _, lse_sel = sparse_attention(q.detach().transpose(1, 2), kt, kt, indices, scale)
            recall = torch.exp(lse_sel.float() - lse.float().transpose(1, 2)).mean(-1).sum().double()
    if grads is not None and torch.is_grad_enabled():
        pairs = [(t, g) for t, g in zip((q_idx, w, k_idx), grads) if t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    B, T = kl.shape
    return KLStats(kl.sum().double(), recall, B * T)
