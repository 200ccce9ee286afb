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

from sparse_rl.sparse.ops.indexer_decode.triton import indexer_launch, indexer_row
from sparse_rl.sparse.ops.pdl import pdl_enter


@triton.jit
def rms_scale(xf, rstd, w, DT: tl.constexpr):
    """HF RMSNorm's last steps on fp32 x (rstd and the weight w fp32, broadcastable): x * rstd rounded to DT, then
    times the weight (fp32; the caller rounds it). `_add_rmsnorm_kernel` and the swap-AB GEMM's norm prologue."""
    return (xf * rstd).to(DT).to(tl.float32) * w


@triton.jit
def silu_mul_rounded(g, u, DT: tl.constexpr):
    """SiLU(g) * u as the gated MLP rounds (g and u in DT or fp32 holding DT values): SiLU's output rounded to DT,
    then the product, in DT. `_silu_mul_kernel` and the swap-AB gate/up GEMM's epilogue."""
    g = g.to(DT).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(DT)
    return (a.to(tl.float32) * u.to(DT).to(tl.float32)).to(DT)


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
    y = rms_scale(xf, rstd, tl.load(W + offs, mask=m, other=0.0).to(tl.float32), X.dtype.element_ty)
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
def _qk_rope_head(b, h, Q, K, V, QW, KW, COS, SIN, POS, KC, VC, QO,
                  sqb, sqh, skb, skh, svb, svh, scos, ssin, skcb, skcs, skch, svcb, svcs, svch, sqob, sqoh,
                  H, D, eps, NORM: tl.constexpr, BD: tl.constexpr):
    """Head h < H + H_kv of row b: a query head's norm + RoPE, or a KV head's norm + RoPE and K/V cache write."""
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


@triton.jit
def _qk_rope_kernel(Q, K, V, QW, KW, COS, SIN, POS, KC, VC, QO,
                    sqb, sqh, skb, skh, svb, svh, scos, ssin, skcb, skcs, skch, svcb, svcs, svch, sqob, sqoh,
                    H, D, eps, NORM: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    _qk_rope_head(tl.program_id(0).to(tl.int64), tl.program_id(1), Q, K, V, QW, KW, COS, SIN, POS, KC, VC, QO,
                  sqb, sqh, skb, skh, svb, svh, scos, ssin, skcb, skcs, skch, svcb, svcs, svch, sqob, sqoh,
                  H, D, eps, NORM, BD)


@triton.jit
def _qk_rope_index_kernel(Q, K, V, QW, KW, COS, SIN, POS, KC, VC, QO,
                          sqb, sqh, skb, skh, svb, svh, scos, ssin, skcb, skcs, skch, svcb, svcs, svch, sqob, sqoh,
                          H, H_KV, D, eps,
                          ZQ, ZK, ZW, ICOS, ISIN, LNW, LNB, IPOS, IKC, IKS, IQO, IWO,
                          szq, szk, szw, iscos, issin, iskb, isks, isksb, isqb, isqh, iswb,
                          HI, DI, q_scale, w_scale, ln_eps,
                          NORM: tl.constexpr, BD: tl.constexpr, HB: tl.constexpr, IBD: tl.constexpr,
                          HALF: tl.constexpr, ROPE: tl.constexpr, AFFINE: tl.constexpr, HAS_BIAS: tl.constexpr,
                          FP8: tl.constexpr, PDL: tl.constexpr):
    """`_qk_rope_kernel` over heads 0..H+H_kv-1 and, as each row's last program (h = H + H_kv), the layer's
    indexer (`indexer_decode.triton.indexer_row`): one launch a sparse layer instead of two."""
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < H + H_KV:
        _qk_rope_head(b, h, Q, K, V, QW, KW, COS, SIN, POS, KC, VC, QO,
                      sqb, sqh, skb, skh, svb, svh, scos, ssin, skcb, skcs, skch, svcb, svcs, svch, sqob, sqoh,
                      H, D, eps, NORM, BD)
    else:
        indexer_row(b, ZQ, ZK, ZW, ICOS, ISIN, LNW, LNB, IPOS, IKC, IKS, IQO, IWO,
                    szq, szk, szw, iscos, issin, iskb, isks, isksb, isqb, isqh, iswb, HI, DI, q_scale, w_scale,
                    ln_eps, HB, IBD, HALF, ROPE, AFFINE, HAS_BIAS, FP8)


def _qk_args(q, k, v, q_weight, k_weight, eps, cos, sin, pos, k_cache, v_cache):
    """The rotated q's buffer and `_qk_rope_head`'s arguments (tuple, in order) and constexprs (dict)."""
    B, H, D = q.shape
    assert D % 2 == 0 and all(t.stride(-1) == 1 for t in (q, k, v, k_cache, v_cache))
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    qo = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    norm = q_weight is not None
    args = (q, k, v, q_weight if norm else q, k_weight if norm else q, cos, sin, pos.reshape(B), k_cache, v_cache,
            qo, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
            v_cache.stride(1), v_cache.stride(2), qo.stride(0), qo.stride(1))
    return qo, args, dict(NORM=norm, BD=triton.next_power_of_2(D))


def qk_norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       pdl: bool = False) -> torch.Tensor:
    """Same contract as `naive.qk_norm_rope_cache_naive`; every tensor's last dim contiguous. pdl: as `add_rmsnorm`."""
    B, H, D = q.shape
    qo, args, const = _qk_args(q, k, v, q_weight, k_weight, eps, cos, sin, pos, k_cache, v_cache)
    _qk_rope_kernel[(B, H + k.shape[1])](*args, H, D, eps, **const, PDL=pdl, launch_pdl=bool(pdl), num_warps=1)
    return qo


def qk_rope_indexer_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                           k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                           pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, zq: torch.Tensor,
                           zk: torch.Tensor, zw: torch.Tensor, ln_weight: torch.Tensor | None,
                           ln_bias: torch.Tensor | None, ln_eps: float, rope_dim: int, idx_cache: torch.Tensor,
                           idx_scale: torch.Tensor | None = None, pdl: bool = False):
    """`qk_norm_rope_cache` and `indexer_decode.triton.indexer_decode` of one sparse layer in one launch (grid
    `[B, H + H_kv + 1]`: the last program of a row runs the indexer): -> (q rotated `[B, H, D]`, q_I
    `[B, H_I, d_I]`, w `[B, H_I]`), the same values as the two launches; both caches written."""
    B, H, D = q.shape
    qo, args, const = _qk_args(q, k, v, q_weight, k_weight, eps, cos, sin, pos, k_cache, v_cache)
    qi, wi, iargs, iconst = indexer_launch(zq, zk, zw, cos, sin, ln_weight, ln_bias, ln_eps, rope_dim, pos,
                                           idx_cache, idx_scale)
    HI, DI = qi.shape[1], qi.shape[2]
    _qk_rope_index_kernel[(B, H + k.shape[1] + 1)](
        *args, H, k.shape[1], D, eps, *iargs, **const, HB=iconst["HB"], IBD=iconst["BD"], HALF=iconst["HALF"],
        ROPE=iconst["ROPE"], AFFINE=iconst["AFFINE"], HAS_BIAS=iconst["HAS_BIAS"], FP8=iconst["FP8"], PDL=pdl,
        launch_pdl=bool(pdl), num_warps=1 if HI * DI <= 1024 else 4)
    return qo, qi, wi


@triton.jit
def _silu_mul_kernel(GU, Y, sg, sy, N, BN: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # first: no load before the previous kernel is done (PDL)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BN + tl.arange(0, BN)
    m = offs < N
    g = tl.load(GU + b * sg + offs, mask=m, other=0.0)
    u = tl.load(GU + b * sg + N + offs, mask=m, other=0.0)
    tl.store(Y + b * sy + offs, silu_mul_rounded(g, u, Y.dtype.element_ty), mask=m)  # rounded where the module rounds


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
