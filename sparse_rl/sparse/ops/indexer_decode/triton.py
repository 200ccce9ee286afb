"""Triton `indexer_decode`: one program per row does the indexer's per-token arithmetic in fp32
(q scale and RoPE for every index head, LayerNorm and RoPE of the key, the weights' scale) and
writes the key into the index cache: one launch where the PyTorch ops take ~20 per layer.

Why: in a decode step at batch 64, context 16K, on the H200 those small launches (the rotary
slices and concatenations, LayerNorm, the cache scatter) summed to 0.71 ms over 22 sparse layers,
against 0.87 ms for all the indexer scoring; this kernel takes 0.05 ms for the same work
(benchmarks/results/2026-11-29-h200-rollout-long.md). It rounds once at the end instead of after
each op, so bf16 results may differ from the module's by an ulp.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.pdl import pdl_enter


@triton.jit
def _rope(x, cs, sn, offs_d, x_partner, HALF: tl.constexpr, ROPE: tl.constexpr):
    """Rotate-half RoPE on dims < ROPE: x*cos + (-x[d+half] | x[d-half])*sin; other dims unchanged."""
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    return tl.where(offs_d < ROPE, x * cs + sign * x_partner * sn, x)


@triton.jit
def _e4m3(y):
    """fp32 y in [-448, 448] rounded to the nearest-even float8_e4m3fn value (still fp32): 3 mantissa
    bits from 2^-6 up, multiples of 2^-9 below. Done by hand so that the cast after it is exact (the
    interpreter's own fp8 cast does not carry a rounding into the exponent)."""
    bits = y.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    sub = (y + 24576.0) - 24576.0  # 24576 = 1.5 * 2^14, whose ulp is 2^-9
    return tl.where(tl.abs(y) < 0.015625, sub, normal)


@triton.jit
def indexer_row(b, ZQ, ZK, ZW, COS, SIN, LNW, LNB, POS, KC, KS, QO, WO,
                szq, szk, szw, scos, ssin, skb, sks, sksb, sqb, sqh, swb,
                HI, DI, q_scale, w_scale, eps,
                HB: tl.constexpr, BD: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr,
                AFFINE: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr):
    """Row b's indexer work (`_indexer_decode_kernel`'s body; also the last program of each row of
    decode_fused's `_qk_rope_index_kernel`). Every constexpr is passed explicitly: Triton 3.6 mis-binds a
    defaulted constexpr of a nested jit call."""
    offs_d = tl.arange(0, BD)
    offs_h = tl.arange(0, HB)
    dm = offs_d < DI
    # partner dim of the rotation and the frequency index of each dim (the first HALF frequencies)
    partner = tl.where(offs_d < HALF, offs_d + HALF, tl.where(offs_d < ROPE, offs_d - HALF, offs_d))
    fidx = tl.where(offs_d < HALF, offs_d, offs_d - HALF)
    rm = offs_d < ROPE
    cs = tl.load(COS + b * scos + fidx, mask=rm, other=1.0).to(tl.float32)
    sn = tl.load(SIN + b * ssin + fidx, mask=rm, other=0.0).to(tl.float32)
    # queries [HB, BD]
    m2 = (offs_h[:, None] < HI) & dm[None, :]
    qp = ZQ + b * szq + offs_h[:, None] * DI
    q = tl.load(qp + offs_d[None, :], mask=m2, other=0.0).to(tl.float32) * q_scale
    qx = tl.load(qp + partner[None, :], mask=m2, other=0.0).to(tl.float32) * q_scale
    q = _rope(q, cs[None, :], sn[None, :], offs_d[None, :], qx, HALF, ROPE)
    tl.store(QO + b * sqb + offs_h[:, None] * sqh + offs_d[None, :], q.to(QO.dtype.element_ty), mask=m2)
    # key: LayerNorm over d_I, then RoPE (the partner dims normalised the same way)
    k = tl.load(ZK + b * szk + offs_d, mask=dm, other=0.0).to(tl.float32)
    kx = tl.load(ZK + b * szk + partner, mask=dm, other=0.0).to(tl.float32)
    mean = tl.sum(k, 0) / DI
    var = tl.sum(tl.where(dm, (k - mean) * (k - mean), 0.0), 0) / DI
    rstd = 1.0 / tl.sqrt(var + eps)
    k = (k - mean) * rstd
    kx = (kx - mean) * rstd
    if AFFINE:
        k = k * tl.load(LNW + offs_d, mask=dm, other=0.0).to(tl.float32)
        kx = kx * tl.load(LNW + partner, mask=dm, other=0.0).to(tl.float32)
    if HAS_BIAS:
        k = k + tl.load(LNB + offs_d, mask=dm, other=0.0).to(tl.float32)
        kx = kx + tl.load(LNB + partner, mask=dm, other=0.0).to(tl.float32)
    k = _rope(k, cs, sn, offs_d, kx, HALF, ROPE)
    p = tl.load(POS + b).to(tl.int64)
    if FP8:  # e4m3 with one scale per token: max |k| / 448
        scale = tl.maximum(tl.max(tl.where(dm, tl.abs(k), 0.0), 0), 1e-12) / 448.0
        k8 = _e4m3(tl.minimum(tl.maximum(k / scale, -448.0), 448.0))
        tl.store(KC + b * skb + p * sks + offs_d, k8.to(KC.dtype.element_ty), mask=dm)
        tl.store(KS + b * sksb + p, scale)
    else:
        tl.store(KC + b * skb + p * sks + offs_d, k.to(KC.dtype.element_ty), mask=dm)
    # head weights
    wv = tl.load(ZW + b * szw + offs_h, mask=offs_h < HI, other=0.0).to(tl.float32) * w_scale
    tl.store(WO + b * swb + offs_h, wv.to(WO.dtype.element_ty), mask=offs_h < HI)


@triton.jit
def _indexer_decode_kernel(ZQ, ZK, ZW, COS, SIN, LNW, LNB, POS, KC, KS, QO, WO,
                           szq, szk, szw, scos, ssin, skb, sks, sksb, sqb, sqh, swb,
                           HI, DI, q_scale, w_scale, eps,
                           HB: tl.constexpr, BD: tl.constexpr, HALF: tl.constexpr, ROPE: tl.constexpr,
                           AFFINE: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr,
                           PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    indexer_row(tl.program_id(0).to(tl.int64), ZQ, ZK, ZW, COS, SIN, LNW, LNB, POS, KC, KS, QO, WO,
                szq, szk, szw, scos, ssin, skb, sks, sksb, sqb, sqh, swb, HI, DI, q_scale, w_scale, eps,
                HB, BD, HALF, ROPE, AFFINE, HAS_BIAS, FP8)


def indexer_launch(zq: torch.Tensor, zk: torch.Tensor, zw: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, eps: float, rope_dim: int,
                   pos: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None = None):
    """The outputs q_I `[B, H_I, d_I]`, w `[B, H_I]`, and `indexer_row`'s arguments (a tuple, in its order)
    and constexprs (a dict) for those inputs: shared by `indexer_decode` and decode_fused's fused launch."""
    B, DI = zk.shape
    HI = zw.shape[1]
    zq, zk, zw, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (zq, zk, zw, cos, sin))
    assert k_cache.stride(-1) == 1 and rope_dim % 2 == 0 and rope_dim <= DI
    q = torch.empty(B, HI, DI, device=zq.device, dtype=zq.dtype)
    w = torch.empty(B, HI, device=zq.device, dtype=zw.dtype)
    dummy = zk  # unused pointer when the LayerNorm has no weight/bias
    args = (zq, zk, zw, cos, sin, ln_weight if ln_weight is not None else dummy,
            ln_bias if ln_bias is not None else dummy, pos.reshape(B), k_cache, k_scale if k_scale is not None else dummy,
            q, w, zq.stride(0), zk.stride(0), zw.stride(0), cos.stride(0), sin.stride(0), k_cache.stride(0),
            k_cache.stride(1), k_scale.stride(0) if k_scale is not None else 0, q.stride(0), q.stride(1), w.stride(0),
            HI, DI, DI ** -0.5, 1.0 / math.sqrt(HI), eps)
    const = dict(HB=max(2, triton.next_power_of_2(HI)), BD=max(16, triton.next_power_of_2(DI)), HALF=rope_dim // 2,
                 ROPE=rope_dim, AFFINE=ln_weight is not None, HAS_BIAS=ln_bias is not None, FP8=k_scale is not None)
    return q, w, args, const


def indexer_decode(zq: torch.Tensor, zk: torch.Tensor, zw: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, eps: float, rope_dim: int,
                   pos: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None = None, pdl: bool = False):
    """Same contract as `naive.indexer_decode_naive`. Every row's last dim must be contiguous. pdl: launch with
    programmatic dependent launch (the caller decides it once: `_backend.resolve_pdl`)."""
    q, w, args, const = indexer_launch(zq, zk, zw, cos, sin, ln_weight, ln_bias, eps, rope_dim, pos, k_cache, k_scale)
    HI, DI = q.shape[1], q.shape[2]
    _indexer_decode_kernel[(q.shape[0],)](*args, **const, PDL=pdl, launch_pdl=bool(pdl),
                                          num_warps=1 if HI * DI <= 1024 else 4)
    return q, w
