"""Triton `skinny_linear`: y = x @ wᵀ for M <= 32 rows (a decode step's o_proj / down_proj at batch <= 32)
in one launch, split over K, the split-K reduce done by the last program of each output tile.

Why: at M = 32 on the H200 cuBLAS runs o_proj (2560 x 4096) and down_proj (2560 x 9728) of Qwen3-4B's shape
as an nvjet splitK kernel plus a `splitKreduce_kernel` each: 12.0 us + 1.9 us a GEMM against 4.9 / 11.7 us
of weight bytes, 72 reduce launches a step (benchmarks/results/2026-12-02-h200-rollout-session8.md). Here
program (n, s) multiplies the x rows by the weight's BN rows over the s-th slice of K (the weight read once
overall, ~2-4 programs an SM), stores its fp32 partial `[BM, BN]`, and counts itself in the tile's counter;
the program that counts last sums the tile's partials (from L2), writes the output and resets the counter
to 0 (so CUDA-graph replays need no memset). The counters `[cdiv(N, BN)]` int32 belong to one call site
(one weight): two launches sharing them must never run at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot, dot_precision


@triton.jit
def _skinny_kernel(X, W, OUT, PART, CNT, M, N, K, sxm, swn, som, KS, SPLIT, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, ONE: tl.constexpr, PREC: tl.constexpr):
    pn = tl.program_id(0)
    ps = tl.program_id(1)
    offs_m = tl.arange(0, BM)
    offs_n = pn * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mm = offs_m < M
    mn = offs_n < N
    acc = tl.zeros([BM, BN], tl.float32)
    k0 = ps * KS
    for k in range(k0, k0 + KS, BK):
        kk = k + offs_k
        mk = kk < K
        x = tl.load(X + offs_m[:, None] * sxm + kk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        # the weight tile read as [BK, BN] (its rows are the output columns): no transpose in registers
        w = tl.load(W + offs_n[None, :].to(tl.int64) * swn + kk[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
        acc += dot(x, w, PREC)
    omask = mm[:, None] & mn[None, :]
    if ONE:
        tl.store(OUT + offs_m[:, None] * som + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=omask)
    else:
        tl.store(PART + (ps * BM + offs_m[:, None]) * N + offs_n[None, :], acc, mask=omask)
        tl.debug_barrier()  # every thread's partial is written before the count releases it
        done = tl.atomic_add(CNT + pn, 1, sem="acq_rel")
        if done == SPLIT - 1:  # the tile's last program: sum the partials (L2), write, reset the counter
            tot = tl.zeros([BM, BN], tl.float32)
            for s in range(0, SPLIT):  # a runtime bound: one partial live at a time, not SPLIT unrolled loads
                tot += tl.load(PART + (s * BM + offs_m[:, None]) * N + offs_n[None, :], mask=omask, other=0.0,
                               cache_modifier=".cg")
            tl.store(OUT + offs_m[:, None] * som + offs_n[None, :], tot.to(OUT.dtype.element_ty), mask=omask)
            tl.atomic_xchg(CNT + pn, 0)


def plan(M: int, N: int, K: int, bn: int = 64, bk: int = 64, programs: int = 528) -> tuple[int, int, int, int]:
    """(BM, BN, BK, SPLIT, KS): rows padded to 16 or 32, and K split so that about `programs` programs run
    (~4 an SM of an H200's 132) with every slice a whole number of BK steps. BK 64: on sm_90a (4 warps, BM 32,
    BN 64) the kernel takes 168 registers, at BK 128 255 and spills."""
    bm = 16 if M <= 16 else 32
    k_blocks = triton.cdiv(K, bk)
    split = max(1, min(k_blocks, triton.cdiv(programs, triton.cdiv(N, bn))))
    ks_blocks = triton.cdiv(k_blocks, split)
    return bm, bn, bk, triton.cdiv(k_blocks, ks_blocks), ks_blocks * bk


def counters(N: int, device) -> torch.Tensor:
    """A call site's tile counters, enough for any BN >= 16 (zeros; each launch leaves them zero)."""
    return torch.zeros(triton.cdiv(N, 16), dtype=torch.int32, device=device)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, cnt: torch.Tensor | None = None, *, bn: int = 64, bk: int = 64,
                  programs: int = 528, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x `[M, K]` (M <= 32, last dim contiguous), w `[N, K]` (contiguous rows) -> `[M, N]` in x's dtype, as
    `naive.skinny_linear_naive` up to the fp32 summation order. cnt: this call site's `counters(N, ...)`
    (None: fresh ones, not for CUDA graphs)."""
    M, K = x.shape
    N = w.shape[0]
    if M > 32 or w.shape[1] != K:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)}, w {tuple(w.shape)} (needs M <= 32 and a shared K)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    interp = not x.is_cuda
    if interp:  # few, small programs (the interpreter runs them one by one); still split over K
        bn, bk, programs = 16, 16, 3 * triton.cdiv(N, 16)
    BM, BN, BK, SPLIT, KS = plan(M, N, K, bn, bk, programs)
    cnt = counters(N, x.device) if cnt is None else cnt
    if bn < 16 or cnt.numel() < triton.cdiv(N, BN):
        raise ValueError(f"skinny_linear: {cnt.numel()} counters for {triton.cdiv(N, BN)} tiles")
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    part = torch.empty(SPLIT if SPLIT > 1 else 1, BM, N, device=x.device, dtype=torch.float32)
    _skinny_kernel[(triton.cdiv(N, BN), SPLIT)](x, w, out, part, cnt, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                                KS, SPLIT, BM=BM, BN=BN, BK=BK, ONE=SPLIT == 1, PREC=dot_precision(x.dtype),
                                                num_warps=1 if interp else num_warps,
                                                num_stages=1 if interp else num_stages)
    return out
