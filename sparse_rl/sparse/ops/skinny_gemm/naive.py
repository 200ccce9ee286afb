"""Reference for `ops.skinny_linear`: F.linear (no bias), fp32 accumulation, rounded to x's dtype."""

from __future__ import annotations

import torch


def skinny_linear_naive(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x `[M, K]`, w `[N, K]` -> `[M, N]` in x's dtype (x @ wᵀ accumulated in fp32)."""
    return (x.float() @ w.float().t()).to(x.dtype)


def residual_epilogue_naive(y: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor | None = None):
    """The swap-AB residual epilogue's reference: a GEMM's output y `[M, N]`, residual `[M, N]` -> (h = residual + y
    `[M, N]` (rounded as `ops.add_rmsnorm`), its per-row sum of h^2 `[1, M]` fp32, hn = h * scale `[M, N]` in y's dtype,
    or None without scale `[N]`)."""
    h = (y.float() + residual.float()).to(y.dtype)
    ps = (h.float() ** 2).sum(-1)[None]
    return h, ps, None if scale is None else (h.float() * scale.float()).to(y.dtype)


def rms_linear_naive(hn: torch.Tensor, w: torch.Tensor, ps: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(h) @ wᵀ from hn = h * (the norm's weight) `[M, K]` and partial sums of h^2 `[tiles, >= M]` fp32 (summed
    over the tiles): rstd * (hn @ wᵀ) per row, the product and the factor in fp32, rounded once to hn's dtype."""
    M, K = hn.shape
    rstd = torch.rsqrt(ps.sum(0)[:M] / K + eps)
    return ((hn.float() @ w.float().t()) * rstd[:, None]).to(hn.dtype)
