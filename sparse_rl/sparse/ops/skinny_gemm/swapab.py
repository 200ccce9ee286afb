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

from sparse_rl.sparse.ops.decode_fused.triton import silu_mul_rounded
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot, dot_precision, tma_capable


@triton.jit
def _epilogue(tot, OUT, RES, PS, HN, SC, pn, offs_x, offs_w, omask, som, srm, shm, BX: tl.constexpr,
              RESID: tl.constexpr, SCALE: tl.constexpr):
    """Store the tile `[BW, BX]` (weight rows = output columns) of y, or with RESID of h = residual + y (rounded as
    `ops.add_rmsnorm` rounds: y, then the sum) and the tile's per-row sum of h^2 at PS[pn] `[BX]` fp32, the next
    GEMM's RMSNorm statistics (summed over the tiles in a fixed order there); with SCALE also hn = h * SC (the next
    RMSNorm's weight, per column) at HN, the next GEMM's input (its epilogue applies the per-row 1 / rms)."""
    dt = OUT.dtype.element_ty
    y = tot.to(dt)
    if RESID:
        r = tl.load(RES + offs_x[None, :] * srm + offs_w[:, None], mask=omask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(dt)
        hf = tl.where(omask, y.to(tl.float32), 0.0)
        tl.store(PS + pn * BX + offs_x, tl.sum(hf * hf, 0))
        if SCALE:
            sc = tl.load(SC + offs_w[:, None] + 0 * offs_x[None, :], mask=omask, other=0.0).to(tl.float32)
            tl.store(HN + offs_x[None, :] * shm + offs_w[:, None], (hf * sc).to(dt), mask=omask)
    tl.store(OUT + offs_x[None, :] * som + offs_w[:, None], y, mask=omask)


@triton.jit
def _prefetch_l2(rows, nbytes):
    """One bulk L2 prefetch a weight row (`cp.async.bulk.prefetch.L2`, sm_90: 16-byte aligned, a multiple of 16 bytes;
    bf16 / fp16 rows whose K slice starts at a multiple of BK): rows `[BW]` pointers, nbytes a scalar (<= 0: none).
    Why: issued before `gdc_wait`, while the previous kernel still runs, the slice streams into L2 on whatever DRAM
    bandwidth that kernel leaves, and the loop's loads after the wait hit L2."""
    n = tl.zeros_like(rows.to(tl.int64)).to(tl.int32) + nbytes
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [rows, n], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _w_tile(wp, WD, pn, k, m, BW: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, GLU: tl.constexpr):
    """Program pn's weight tile `[BW, BK]` at K offset k: pointer loads under the mask m (cp.async in the pipeline), or
    with TMA one bulk tensor copy from the descriptor WD (Hopper's TMA: no address registers or per-thread load issue;
    rows past N and columns past K read as zero, and a K slice is whole BK steps, so no step reads into the next
    slice). GLU: WD is the fused weight as `[2, N, K]` (gate, up) and one `[2, BW / 2, BK]` box holds the gate's and
    the up's rows of the program's columns, in the pointer path's row order."""
    if not TMA:
        w = tl.load(wp + k, mask=m, other=0.0)
    elif GLU:
        w = tl.reshape(WD.load([0, pn * (BW // 2), k]), [BW, BK])
    else:
        w = WD.load([pn * BW, k])
    return w


@triton.jit
def _swapab_kernel(X, W, OUT, PART, CNT, M, N, K, sxm, swn, som, KS, SPLIT: tl.constexpr, BW: tl.constexpr,
                   BX: tl.constexpr, BK: tl.constexpr, ONE: tl.constexpr, PDL: tl.constexpr, PREC: tl.constexpr,
                   GLU: tl.constexpr = False, RES=None, PS=None, srm=0, RESID: tl.constexpr = False, HN=None, SC=None,
                   shm=0, SCALE: tl.constexpr = False, PSIN=None, NPS=1, eps=1e-6, NORM: tl.constexpr = False,
                   NPSB: tl.constexpr = 16, PREFETCH: tl.constexpr = False, WD=None, TMA: tl.constexpr = False):
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
    # the first weight tile before the wait: weights are never written by the kernels this one depends on; with
    # PREFETCH the rest of the program's slice into L2 first (`_prefetch_l2`; issued after the tile's loads, it
    # would wait for their data to arrive)
    if PREFETCH:
        _prefetch_l2(W + tl.where(mw, offs_w, 0).to(tl.int64) * swn + k0 + BK, (k_end - k0 - BK) * 2)
    w = _w_tile(wp, WD, pn, k0, mw[:, None] & (kk[None, :] < k_end), BW, BK, TMA, GLU)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(xp + k0, mask=(kk[:, None] < k_end) & mx[None, :], other=0.0)
    acc = dot(w, x, PREC)  # [BW, BX] fp32
    for k in range(k0 + BK, k_end, BK):
        kk = k + offs_k
        mk = kk < k_end
        w = _w_tile(wp, WD, pn, k, mw[:, None] & mk[None, :], BW, BK, TMA, GLU)
        x = tl.load(xp + k, mask=mk[:, None] & mx[None, :], other=0.0)
        acc += dot(w, x, PREC)
    omask = mw[:, None] & mx[None, :]
    # NORM: x is hn = h * (the norm's weight), PSIN the producer's per-tile sums of h^2 `[NPS, BX]`; RMSNorm's 1 / rms
    # is a per-row factor of the product (a column of yᵀ), applied to the whole sum here, not to x in the loop
    # (session 21: normalizing each x tile in the loop cost ~28 us a GEMM on the H200, its loads no longer pipelined)
    rstd = tl.full([BX], 1.0, tl.float32)
    if NORM:
        t = tl.arange(0, NPSB)
        ss = tl.sum(tl.load(PSIN + t[:, None] * BX + offs_x[None, :], mask=t[:, None] < NPS, other=0.0), 0)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    if GLU:  # SiLU(gate) * up, rounded where `ops.silu_mul` rounds (the GEMM's output, SiLU's, the product)
        if NORM:
            acc = acc * rstd[None, :]
        g, u = tl.split(tl.permute(tl.reshape(acc, [2, BW // 2, BX]), [1, 2, 0]))  # [BW / 2, BX] each
        y = silu_mul_rounded(g, u, OUT.dtype.element_ty)
        oc = pn * (BW // 2) + tl.arange(0, BW // 2)
        tl.store(OUT + offs_x[None, :] * som + oc[:, None], y, mask=(oc < N)[:, None] & mx[None, :])
    elif ONE:
        if NORM:
            acc = acc * rstd[None, :]
        _epilogue(acc, OUT, RES, PS, HN, SC, pn, offs_x, offs_w, omask, som, srm, shm, BX, RESID, SCALE)
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
            if NORM:
                tot = tot * rstd[None, :]
            _epilogue(tot, OUT, RES, PS, HN, SC, pn, offs_x, offs_w, omask, som, srm, shm, BX, RESID, SCALE)
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


def _tma_args(loads: str, w: torch.Tensor, BW: int, BK: int, glu: bool = False) -> dict:
    """The kernel's descriptor arguments for loads = "tma": w's `[N, K]` tensor descriptor of `[BW, BK]` boxes (glu:
    the fused gate/up `[2N, K]` as `[2, N, K]` with `[2, BW / 2, BK]` boxes; unit stride along K, 16-byte aligned
    rows and base; a CUDA device of sm_90+, or the interpreter), none for "ptr"."""
    if loads not in ("ptr", "tma"):
        raise ValueError(f"swapab: loads {loads!r} (ptr or tma)")
    if loads == "ptr":
        return {}
    if not tma_capable(w):
        raise ValueError("swapab (loads='tma'): the weight needs unit stride along K, 16-byte aligned rows and base, "
                         "and an sm_90+ GPU")
    from triton.tools.tensor_descriptor import TensorDescriptor

    if glu:
        n = w.shape[0] // 2
        return dict(WD=TensorDescriptor(w, [2, n, w.shape[1]], [n * w.stride(0), w.stride(0), 1], [2, BW // 2, BK]),
                    TMA=True)
    return dict(WD=TensorDescriptor(w, list(w.shape), list(w.stride()), [BW, BK]), TMA=True)


def _prefetch_ok(prefetch: bool, w: torch.Tensor, K: int) -> bool:
    """Whether the kernel takes the L2 prefetch asked for: a CUDA device of sm_90+ (the bulk prefetch; never the
    interpreter), 2-byte weights whose rows and K slices are 16-byte aligned."""
    return bool(prefetch) and w.is_cuda and torch.cuda.get_device_capability(w.device)[0] >= 9 and (
        w.element_size() == 2 and K % 8 == 0 and w.stride(0) % 8 == 0 and w.data_ptr() % 16 == 0)


def _norm_args(norm, BX: int) -> dict:
    """The kernel's RMSNorm arguments of norm = (partials `[NPS, BX]` fp32 from a `residual=` call, eps), or none."""
    if norm is None:
        return {}
    ps, eps = norm
    if ps is None or ps.dim() != 2 or ps.shape[1] != BX or ps.dtype != torch.float32:
        raise ValueError(f"swapab: norm partials {None if ps is None else tuple(ps.shape)} (needs [tiles, {BX}] fp32 "
                         "from a residual= call on the same rows)")
    return dict(PSIN=ps, NPS=ps.shape[0], eps=float(eps), NORM=True, NPSB=max(16, triton.next_power_of_2(ps.shape[0])))


def _resid_args(residual, scale, M: int, N: int, BW: int, BX: int, x: torch.Tensor) -> dict:
    """The residual epilogue's arguments: h = residual + y, the per-tile sums of h^2 `[tiles, BX]` fp32, and with
    scale `[N]` (the next RMSNorm's weight) hn = h * scale."""
    if residual is None:
        if scale is not None:
            raise ValueError("swapab: scale= needs residual=")
        return {}
    if residual.shape != (M, N) or residual.stride(-1) != 1:
        raise ValueError(f"swapab_linear: residual {tuple(residual.shape)} (needs [{M}, {N}], last dim contiguous)")
    ps = torch.empty(triton.cdiv(N, BW), BX, device=x.device, dtype=torch.float32)
    out = dict(RES=residual, PS=ps, srm=residual.stride(0), RESID=True)
    if scale is not None:
        if scale.shape != (N,):
            raise ValueError(f"swapab_linear: scale {tuple(scale.shape)} (needs [{N}])")
        hn = torch.empty(M, N, device=x.device, dtype=x.dtype)
        out.update(HN=hn, SC=scale, shm=hn.stride(0), SCALE=True)
    return out


def _operands(x: torch.Tensor, w: torch.Tensor, who: str, even_rows: bool = False):
    """Both forms' operand checks (M <= 64, a shared K; the fused gate/up's weight rows even) and their last dims
    made contiguous -> (x, w, whether the interpreter runs it)."""
    M, K = x.shape
    if M > 64 or w.shape[1] != K or (even_rows and w.shape[0] % 2):
        raise ValueError(f"{who}: x {tuple(x.shape)}, w {tuple(w.shape)} (needs M <= 64, a shared K"
                         + (", an even number of weight rows)" if even_rows else ")"))
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    return x, w, not x.is_cuda


def swapab_linear(x: torch.Tensor, w: torch.Tensor, cnt: torch.Tensor | None = None, *, bw: int = 128, bk: int = 64,
                  programs: int = 264, num_warps: int = 4, num_stages: int = 4, pdl: int = 0,
                  residual: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                  norm: tuple | None = None, prefetch: bool = False, loads: str = "ptr"):
    """x `[M, K]` (M <= 64, last dim contiguous), w `[N, K]` (contiguous rows) -> `[M, N]` in x's dtype, as
    `naive.skinny_linear_naive` up to the fp32 summation order. cnt: this call site's `triton.counters(N, ...)`
    (None: fresh ones, not for CUDA graphs). pdl: a resolved PDL level (0 off; launched with launch_pdl at >= 1).
    residual `[M, N]`: returns (h = residual + y, partials `[tiles, BX]` fp32, each tile's per-row sum of h^2, hn),
    the residual add of `ops.add_rmsnorm` in the epilogue; with scale `[N]` (the next RMSNorm's weight) hn = h * scale
    in x's dtype, else None. norm = (partials, eps) of such a call: x is that hn and the GEMM returns RMSNorm(h) @ wᵀ
    as rstd * (hn @ wᵀ), rstd = 1 / sqrt(mean(h^2) + eps) per row from the partials, applied to the fp32 sum (not
    `ops.add_rmsnorm`'s roundings: the norm's weight is rounded into hn, the 1 / rms only once, in fp32). prefetch:
    each program prefetches its whole weight slice into L2 before `gdc_wait` (CUDA, 2-byte weights; `_prefetch_l2`).
    loads: the weight tiles by "ptr" (pointer loads) or "tma" (a host tensor descriptor, `_w_tile`; sm_90+ or the
    interpreter, 16-byte aligned rows, else a ValueError)."""
    from sparse_rl.sparse.ops.skinny_gemm.triton import counters

    x, w, interp = _operands(x, w, "swapab_linear")
    M, K = x.shape
    N = w.shape[0]
    if interp:  # few, small programs (the interpreter runs them one by one); still split over K
        bw, bk, programs, pdl = 16, 16, 3 * triton.cdiv(N, 16), 0
    BX, BW, BK, SPLIT, KS = plan(M, N, K, bw, bk, programs)
    cnt = counters(N, x.device) if cnt is None else cnt
    if BW < 16 or cnt.numel() < triton.cdiv(N, BW):
        raise ValueError(f"swapab_linear: {cnt.numel()} counters for {triton.cdiv(N, BW)} tiles")
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    part = torch.empty(SPLIT if SPLIT > 1 else 1, BX, N, device=x.device, dtype=torch.float32)
    extra = {**_norm_args(norm, BX), **_resid_args(residual, scale, M, N, BW, BX, x)}
    num_stages = _stages(num_stages, BW, BX, BK, x.element_size())
    kw = {"launch_pdl": True} if pdl else {}
    _swapab_kernel[(triton.cdiv(N, BW), SPLIT)](x, w, out, part, cnt, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                                KS, SPLIT, BW=BW, BX=BX, BK=BK, ONE=SPLIT == 1, PDL=int(pdl),
                                                PREC=dot_precision(x.dtype), num_warps=1 if interp else num_warps,
                                                num_stages=1 if interp else num_stages,
                                                PREFETCH=_prefetch_ok(prefetch, w, K), **_tma_args(loads, w, BW, BK),
                                                **extra, **kw)
    return (out, extra["PS"], extra.get("HN")) if residual is not None else out


def swapab_silu_mul(x: torch.Tensor, w: torch.Tensor, *, bw: int = 128, bk: int = 64, num_warps: int = 4,
                    num_stages: int = 4, pdl: int = 0, programs: int | None = None,
                    norm: tuple | None = None, prefetch: bool = False, loads: str = "ptr") -> torch.Tensor:
    """SiLU(x @ gateᵀ) * (x @ upᵀ) in one launch: x `[M, K]` (M <= 64), w `[2N, K]` (the gate's N rows, then the up's:
    the fused gate/up weight) -> `[M, N]` in x's dtype, bitwise `ops.silu_mul(swapab_linear(x, w))` at the same tile
    (each program's BW rows are BW / 2 gate rows and the same columns' up rows, so the accumulators are the plain
    kernel's and the epilogue applies silu_mul's arithmetic; one K slice a program: gate/up's shapes need no split).
    programs: ignored (the plain kernel's split-K knob). norm, prefetch: as `swapab_linear`'s (x then hn = h * the
    norm's weight). loads: as `swapab_linear`'s ("tma": one `[2, BW / 2, BK]` box of the weight as `[2, N, K]`)."""
    x, w, interp = _operands(x, w, "swapab_silu_mul", even_rows=True)
    M, K = x.shape
    N2 = w.shape[0]
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
                                                 num_stages=1 if interp else num_stages, **_norm_args(norm, BX),
                                                 PREFETCH=_prefetch_ok(prefetch, w, K),
                                                 **_tma_args(loads, w, bw, bk, glu=True), **kw)
    return out
