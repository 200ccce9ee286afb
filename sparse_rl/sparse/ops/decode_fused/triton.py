"""Triton `add_rmsnorm`, `qk_norm_rope_cache` and `silu_mul`: one launch each for what the PyTorch ops take 8-20.

Why: one eager decode step of Qwen3-4B's shape at batch 32 on the H200 ran ~1,500 small kernels
(RMSNorm's cast/pow/mean/add/rsqrt/mul/cast/mul, RoPE's slices/neg/cat/mul/add, residual adds, cache
index writes) taking ~3.7 ms of the 9.1 ms of kernel time at 2K context
(benchmarks/results/2026-12-01-h200-rollout-qwen3-4b-profile.json); each reads or writes a few KB.
Arithmetic in fp32, rounded to the input dtype wherever the HF modules round (the norm's output
before the weight, RoPE's two products and their sum), so on a GPU the results equal the modules'
up to the order of the norm's fp32 sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.pdl import pdl_enter


@triton.jit
def _add_rmsnorm_kernel(X, R, W, Y, H, sx, sr, sy, sh, N, eps, HAS_RES: tl.constexpr, BN: tl.constexpr,
                        PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BN)
    m = offs < N
    x = tl.load(X + b * sx + offs, mask=m, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(R + b * sr + offs, mask=m, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        tl.store(H + b * sh + offs, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * rstd).to(X.dtype.element_ty).to(tl.float32) * tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + b * sy + offs, y.to(Y.dtype.element_ty), mask=m)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, pdl: bool = False):
    """Same contract as `naive.add_rmsnorm_naive`; x, residual `[B, N]` with the last dim contiguous. pdl: launch
    with programmatic dependent launch (the caller decides it once: `_backend.resolve_pdl`)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    B, N = x.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(B, N, device=x.device, dtype=out_dtype)
    if residual is None:
        h, r = x, x
    else:
        r = residual if residual.stride(-1) == 1 else residual.contiguous()
        h = torch.empty_like(x)
    BN = triton.next_power_of_2(N)
    _add_rmsnorm_kernel[(B,)](x, r, weight, y, h, x.stride(0), r.stride(0), y.stride(0), h.stride(0), N, eps,
                              HAS_RES=residual is not None, BN=BN, PDL=pdl, launch_pdl=bool(pdl),
                              num_warps=1 if not x.is_cuda else min(8, max(1, BN // 512)))
    return y, h


@triton.jit
def _qk_rope_kernel(Q, K, V, QW, KW, COS, SIN, POS, KC, VC, QO,
                    sqb, sqh, skb, skh, svb, svh, scos, ssin, skcb, skcs, skch, svcb, svcs, svch, sqob, sqoh,
                    H, D, eps, NORM: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BD)
    half = D // 2
    m = offs < D
    partner = tl.where(offs < half, offs + half, offs - half)
    is_q = h < H
    if is_q:
        base = Q + b * sqb + h * sqh
        wp = QW
    else:
        base = K + b * skb + (h - H) * skh
        wp = KW
    x = tl.load(base + offs, mask=m, other=0.0)
    xp = tl.load(base + partner, mask=m, other=0.0)
    if NORM:
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
        x = ((xf * rstd).to(x.dtype).to(tl.float32) * tl.load(wp + offs, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
        xp = ((xp.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)
              * tl.load(wp + partner, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
    cs = tl.load(COS + b * scos + offs, mask=m, other=0.0).to(x.dtype).to(tl.float32)
    sn = tl.load(SIN + b * ssin + offs, mask=m, other=0.0).to(x.dtype).to(tl.float32)
    rot = tl.where(offs < half, -xp.to(tl.float32), xp.to(tl.float32))
    # rounded where HF's `q * cos + rotate_half(q) * sin` rounds: after each product and the sum
    y = ((x.to(tl.float32) * cs).to(x.dtype).to(tl.float32) + (rot * sn).to(x.dtype).to(tl.float32))
    if is_q:
        tl.store(QO + b * sqob + h * sqoh + offs, y.to(QO.dtype.element_ty), mask=m)
    else:
        p = tl.load(POS + b).to(tl.int64)
        kh = h - H
        tl.store(KC + b * skcb + p * skcs + kh * skch + offs, y.to(KC.dtype.element_ty), mask=m)
        vv = tl.load(V + b * svb + kh * svh + offs, mask=m, other=0.0)
        tl.store(VC + b * svcb + p * svcs + kh * svch + offs, vv.to(VC.dtype.element_ty), mask=m)


def qk_norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       pdl: bool = False) -> torch.Tensor:
    """Same contract as `naive.qk_norm_rope_cache_naive`; every tensor's last dim contiguous. pdl: as `add_rmsnorm`."""
    B, H, D = q.shape
    H_kv = k.shape[1]
    assert D % 2 == 0 and all(t.stride(-1) == 1 for t in (q, k, v, k_cache, v_cache))
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    qo = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    norm = q_weight is not None
    qw = q_weight if norm else q
    kw = k_weight if norm else q
    _qk_rope_kernel[(B, H + H_kv)](
        q, k, v, qw, kw, cos, sin, pos.reshape(B), k_cache, v_cache, qo,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), qo.stride(0), qo.stride(1), H, D, eps, NORM=norm, BD=triton.next_power_of_2(D),
        PDL=pdl, launch_pdl=bool(pdl), num_warps=1)
    return qo


@triton.jit
def _silu_mul_kernel(GU, Y, sg, sy, N, BN: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BN + tl.arange(0, BN)
    m = offs < N
    g = tl.load(GU + b * sg + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(GU + b * sg + N + offs, mask=m, other=0.0)
    # rounded where the module rounds: SiLU's output, then the product
    a = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(Y + b * sy + offs, (a.to(tl.float32) * u.to(tl.float32)).to(Y.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """Same contract as `naive.silu_mul_naive`; gate_up `[B, 2N]` with the last dim contiguous. pdl: as
    `add_rmsnorm`."""
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    B, N2 = gate_up.shape
    N = N2 // 2
    y = torch.empty(B, N, device=gate_up.device, dtype=gate_up.dtype)
    BN = min(1024, triton.next_power_of_2(N)) if gate_up.is_cuda else min(64, triton.next_power_of_2(N))
    _silu_mul_kernel[(B, triton.cdiv(N, BN))](gate_up, y, gate_up.stride(0), y.stride(0), N, BN=BN, PDL=pdl,
                                             launch_pdl=bool(pdl), num_warps=4 if gate_up.is_cuda else 1)
    return y
