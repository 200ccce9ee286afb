"""Reference for `ops.skinny_linear`: F.linear (no bias), fp32 accumulation, rounded to x's dtype."""

from __future__ import annotations

import torch


def skinny_linear_naive(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x `[M, K]`, w `[N, K]` -> `[M, N]` in x's dtype (x @ wᵀ accumulated in fp32)."""
    return (x.float() @ w.float().t()).to(x.dtype)
