"""Triton `swapab_linear`: y = x @ wᵀ for a decode step's few rows (M <= 64) computed as yᵀ = W xᵀ ("swap AB"),
split over K inside one launch, the split-K reduce done by the last program of each output tile.

Why: `triton.skinny_linear` (session 9) puts the batch (M = 32) in the MMA's M dimension: on sm_90a Triton then
emits mma.sync (wgmma needs M >= 64 a warpgroup), a [32, BN] fp32 accumulator at 168 registers, and the
weight streamed at 40-60% of the H200's bandwidth: slower than cuBLAS (NOTES.md session 9). Here the weight's
BW rows (64 / 128 output features) are the MMA's M and the batch, padded to BX = 16 / 32 / 64, its N: wgmma
reads the weight tile from shared memory (filled by the software pipeline's asynchronous copies, num_stages
deep), and the accumulator [BW, BX] is 16-32 fp32 registers a thread. Program (n, s) multiplies weight rows
n * BW.. by xᵀ over the s-th slice of K; with SPLIT > 1 it stores its fp32 partial `[BX, BW]`, counts itself in
the tile's counter, and the tile's last program sums the partials (from L2), writes y and resets the counter
to 0 (CUDA-graph replays need no memset; the counters are `triton.counters`, one set a call site).

PDL (programmatic dependent launch, level `_backend.PDL_LEVELS`): the weight is no output of the previous
kernel, so the program's first weight tile is loaded BEFORE `gdc_wait` (overlapping this kernel's ramp with
the previous kernel's tail); x (the previous kernel's output) only after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.decode_fused.triton import rms_scale, silu_mul_rounded
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot, dot_precision


@triton.jit
def _epilogue(tot, OUT, RES, PS, pn, offs_x, offs_w, omask, som, srm, BX: tl.constexpr, RESID: tl.constexpr):
    """Store the tile `[BW, BX]` (weight rows = output columns) of y, or with RESID of h = residual + y (rounded as
    `ops.add_rmsnorm` rounds: y, then the sum) and the tile's per-row sum of h^2 at PS[pn] `[BX]` fp32, the next
    GEMM's RMSNorm statistics (summed over the tiles in a fixed order there)."""
    dt = OUT.dtype.element_ty
    y = tot.to(dt)
    if RESID:
        r = tl.load(RES + offs_x[None, :] * srm + offs_w[:, None], mask=omask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
        hf = tl.where(omask, y.to(tl.float32), 0.0)
        tl.store(PS + pn * BX + offs_x, tl.sum(hf * hf, 0))
    tl.store(OUT + offs_x[None, :] * som + offs_w[:, None], y, mask=omask)


@triton.jit
def _normed_x(x, k, K, offs_x, NW, rstd, NORM: tl.constexpr, BK: tl.constexpr):
    """x's tile `[BK, BX]` (K rows from k) as the GEMM reads it: with NORM, RMSNorm(h) = weight * (h * rstd), rounded
    as `ops.add_rmsnorm` rounds (h * rstd to the dtype, then the product)."""
    if NORM:
        kk = k + tl.arange(0, BK)
        nw = tl.load(NW + kk, mask=kk < K, other=0.0).to(tl.float32)
        x = rms_scale(x.to(tl.float32), rstd[None, :], nw[:, None], x.dtype).to(x.dtype)
    return x


@triton.jit
def _swapab_kernel(X, W, OUT, PART, CNT, M, N, K, sxm, swn, som, KS, SPLIT: tl.constexpr, BW: tl.constexpr,
                   BX: tl.constexpr, BK: tl.constexpr, ONE: tl.constexpr, PDL: tl.constexpr, PREC: tl.constexpr,
                   GLU: tl.constexpr = False, RES=None, PS=None, srm=0, RESID: tl.constexpr = False, PSIN=None,
                   NW=None, NPS=1, eps=1e-6, NORM: tl.constexpr = False, NPSB: tl.constexpr = 16):
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    if GLU:  # W = [gate; up], N = the output's width: rows r < BW / 2 the gate's, the rest the up's, same columns
        r = tl.arange(0, BW)
        col = pn * (BW // 2) + r % (BW // 2)
        offs_w = col + (r // (BW // 2)) * N
        mw = col < N
    else:
        offs_w = pn * BW + tl.arange(0, BW)
        mw = offs_w < N
    offs_x = tl.arange(0, BX)
    offs_k = tl.arange(0, BK)
    mx = offs_x < M
    k0 = ps * KS
    k_end = tl.minimum(k0 + KS, K)
    wp = W + offs_w[:, None].to(tl.int64) * swn + offs_k[None, :]  # [BW, BK]: the weight rows as the MMA's M
    xp = X + offs_x[None, :] * sxm + offs_k[:, None]  # [BK, BX]: xᵀ read in place (its rows are x's columns)
    kk = k0 + offs_k
    # the first weight tile before the wait: weights are never written by the kernels this one depends on
    w = tl.load(wp + k0, mask=mw[:, None] & (kk[None, :] < k_end), other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    rstd = tl.zeros([BX], tl.float32)
    if NORM:  # x is the residual h, PSIN the producer's per-tile sums of h^2 `[NPS, BX]`: RMSNorm's rstd per row
        t = tl.arange(0, NPSB)
        ss = tl.sum(tl.load(PSIN + t[:, None] * BX + offs_x[None, :], mask=t[:, None] < NPS, other=0.0), 0)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    x = _normed_x(tl.load(xp + k0, mask=(kk[:, None] < k_end) & mx[None, :], other=0.0), k0, K, offs_x, NW, rstd,
                  NORM, BK)
    acc = dot(w, x, PREC)  # [BW, BX] fp32
    for k in range(k0 + BK, k_end, BK):
        kk = k + offs_k
        mk = kk < k_end
        w = tl.load(wp + k, mask=mw[:, None] & mk[None, :], other=0.0)
        x = _normed_x(tl.load(xp + k, mask=mk[:, None] & mx[None, :], other=0.0), k, K, offs_x, NW, rstd, NORM, BK)
        acc += dot(w, x, PREC)
    omask = mw[:, None] & mx[None, :]
    if GLU:  # SiLU(gate) * up, rounded where `ops.silu_mul` rounds (the GEMM's output, SiLU's, the product)
        g, u = tl.split(tl.permute(tl.reshape(acc, [2, BW // 2, BX]), [1, 2, 0]))  # [BW / 2, BX] each
        y = silu_mul_rounded(g, u, OUT.dtype.element_ty)
        oc = pn * (BW // 2) + tl.arange(0, BW // 2)
        tl.store(OUT + offs_x[None, :] * som + oc[:, None], y, mask=(oc < N)[:, None] & mx[None, :])
    elif ONE:
        _epilogue(acc, OUT, RES, PS, pn, offs_x, offs_w, omask, som, srm, BX, RESID)
    else:
        tl.store(PART + (ps * BX + offs_x[None, :]) * N + offs_w[:, None], acc, mask=omask)
        tl.debug_barrier()  # every thread's partial is written before the count releases it
        done = tl.atomic_add(CNT + pn, 1, sem="acq_rel")
        if done == SPLIT - 1:  # the tile's last program: sum the partials (L2), write, reset the counter
            # SPLIT a constexpr, the loop unrolled: the partials' loads are all in flight at once (session 12's
            # first call: with a runtime bound they went one L2 round trip after another, ~0.5 us a partial:
            # o_proj at 13 slices 14.8 us alone against cuBLAS's 8.0)
            tot = tl.zeros([BW, BX], tl.float32)
            for s in tl.static_range(SPLIT):
                tot += tl.load(PART + (s * BX + offs_x[None, :]) * N + offs_w[:, None], mask=omask, other=0.0,
                               cache_modifier=".cg")
            _epilogue(tot, OUT, RES, PS, pn, offs_x, offs_w, omask, som, srm, BX, RESID)
            tl.atomic_xchg(CNT + pn, 0)


def plan(M: int, N: int, K: int, bw: int = 128, bk: int = 64, programs: int = 264) -> tuple[int, int, int, int, int]:
    """(BX, BW, BK, SPLIT, KS): the batch padded to 16 / 32 / 64 (the MMA's N), and K split so that at most
    `programs` programs run, one wave (the H200's 132 SMs hold two programs each at BW = 128, BK = 64, BX = 32,
    4 stages: ~100 KB of shared memory, 101-126 registers; more than a wave leaves a tail), but at least the
    weight tiles' count (Qwen3-4B at M = 32: o_proj 20 tiles x 13 slices, down 20 x 13, q/k/v 51 x 5,
    gate/up 152 x 1, all at once); every slice a whole number of BK steps."""
    bx = max(16, triton.next_power_of_2(M))
    k_blocks = triton.cdiv(K, bk)
    split = max(1, min(k_blocks, programs // triton.cdiv(N, bw)))
    ks_blocks = triton.cdiv(k_blocks, split)
    return bx, bw, bk, triton.cdiv(k_blocks, ks_blocks), ks_blocks * bk


def _stages(num_stages: int, BW: int, BX: int, BK: int, itemsize: int) -> int:
    """num_stages, fewer where the pipeline's tiles would pass the shared memory a program may take: ~(stages + 1) *
    (BW + BX) * BK * itemsize bytes (sm_90a under Triton 3.6: 100 KB at 128 / 32 / 64, 200 KB at BK 128, 4 stages;
    the H200 gives a program at most 227 KB)."""
    while num_stages > 2 and (num_stages + 1) * (BW + BX) * BK * itemsize > 220 * 1024:
        num_stages -= 1
    return num_stages


def _norm_args(norm, x: torch.Tensor) -> dict:
    """The kernel's RMSNorm-prologue arguments of norm = (partials `[NPS, BX]` fp32 from a `residual=` call, the norm's
    weight `[K]`, eps), or none."""
    if norm is None:
        return {}
    ps, weight, eps = norm
    return dict(PSIN=ps, NW=weight, NPS=ps.shape[0], eps=float(eps), NORM=True,
                NPSB=max(16, triton.next_power_of_2(ps.shape[0])))


def swapab_linear(x: torch.Tensor, w: torch.Tensor, cnt: torch.Tensor | None = None, *, bw: int = 128, bk: int = 64,
                  programs: int = 264, num_warps: int = 4, num_stages: int = 4, pdl: int = 0,
                  residual: torch.Tensor | None = None, norm: tuple | None = None):
    """x `[M, K]` (M <= 64, last dim contiguous), w `[N, K]` (contiguous rows) -> `[M, N]` in x's dtype, as
    `naive.skinny_linear_naive` up to the fp32 summation order. cnt: this call site's `triton.counters(N, ...)`
    (None: fresh ones, not for CUDA graphs). pdl: a resolved PDL level (0 off; launched with launch_pdl at >= 1).
    residual `[M, N]`: returns (h = residual + y, partials `[tiles, BX]` fp32, each tile's per-row sum of h^2), the
    residual add of `ops.add_rmsnorm` in the epilogue; norm = (partials, weight `[K]`, eps) of such a call: x is
    that h and the GEMM reads RMSNorm(h) (its prologue: `ops.add_rmsnorm`'s roundings, the sum of squares in the
    partials' order)."""
    from sparse_rl.sparse.ops.skinny_gemm.triton import counters

    M, K = x.shape
    N = w.shape[0]
    if M > 64 or w.shape[1] != K:
        raise ValueError(f"swapab_linear: x {tuple(x.shape)}, w {tuple(w.shape)} (needs M <= 64 and a shared K)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    interp = not x.is_cuda
    if interp:  # few, small programs (the interpreter runs them one by one); still split over K
        bw, bk, programs, pdl = 16, 16, 3 * triton.cdiv(N, 16), 0
    BX, BW, BK, SPLIT, KS = plan(M, N, K, bw, bk, programs)
    cnt = counters(N, x.device) if cnt is None else cnt
    if BW < 16 or cnt.numel() < triton.cdiv(N, BW):
        raise ValueError(f"swapab_linear: {cnt.numel()} counters for {triton.cdiv(N, BW)} tiles")
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    part = torch.empty(SPLIT if SPLIT > 1 else 1, BX, N, device=x.device, dtype=torch.float32)
    extra = _norm_args(norm, x)
    if residual is not None:
        if residual.shape != (M, N) or residual.stride(-1) != 1:
            raise ValueError(f"swapab_linear: residual {tuple(residual.shape)} (needs [{M}, {N}], last dim contiguous)")
        ps = torch.empty(triton.cdiv(N, BW), BX, device=x.device, dtype=torch.float32)
        extra.update(RES=residual, PS=ps, srm=residual.stride(0), RESID=True)
    num_stages = _stages(num_stages, BW, BX, BK, x.element_size())
    kw = {"launch_pdl": True} if pdl else {}
    _swapab_kernel[(triton.cdiv(N, BW), SPLIT)](x, w, out, part, cnt, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                                KS, SPLIT, BW=BW, BX=BX, BK=BK, ONE=SPLIT == 1, PDL=int(pdl),
                                                PREC=dot_precision(x.dtype), num_warps=1 if interp else num_warps,
                                                num_stages=1 if interp else num_stages, **extra, **kw)
    return (out, extra["PS"]) if residual is not None else out


def swapab_silu_mul(x: torch.Tensor, w: torch.Tensor, *, bw: int = 128, bk: int = 64, num_warps: int = 4,
                    num_stages: int = 4, pdl: int = 0, programs: int | None = None,
                    norm: tuple | None = None) -> torch.Tensor:
    """SiLU(x @ gateᵀ) * (x @ upᵀ) in one launch: x `[M, K]` (M <= 64), w `[2N, K]` (the gate's N rows, then the up's:
    the fused gate/up weight) -> `[M, N]` in x's dtype, bitwise `ops.silu_mul(swapab_linear(x, w))` at the same tile
    (each program's BW rows are BW / 2 gate rows and the same columns' up rows, so the accumulators are the plain
    kernel's and the epilogue applies silu_mul's arithmetic; one K slice a program: gate/up's shapes need no split).
    programs: ignored (the plain kernel's split-K knob). norm: as `swapab_linear`'s (x then the residual h)."""
    M, K = x.shape
    N2 = w.shape[0]
    if M > 64 or w.shape[1] != K or N2 % 2:
        raise ValueError(f"swapab_silu_mul: x {tuple(x.shape)}, w {tuple(w.shape)} (needs M <= 64, a shared K, "
                         "an even number of weight rows)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    interp = not x.is_cuda
    if interp:
        bw, bk, pdl = 16, 16, 0
    N = N2 // 2
    BX = max(16, triton.next_power_of_2(M))
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    num_stages = _stages(num_stages, bw, BX, bk, x.element_size())
    kw = {"launch_pdl": True} if pdl else {}
    _swapab_kernel[(triton.cdiv(N, bw // 2), 1)](x, w, out, out, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                                 K, 1, BW=bw, BX=BX, BK=bk, ONE=True, PDL=int(pdl),
                                                 PREC=dot_precision(x.dtype), GLU=True,
                                                 num_warps=1 if interp else num_warps,
                                                 num_stages=1 if interp else num_stages, **_norm_args(norm, x), **kw)
    return out
