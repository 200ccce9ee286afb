"""The one-launch check behind `_backend.pdl_supported` (its own module: importing it imports Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _probe_kernel(X, N, PDL: tl.constexpr, BN: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    offs = tl.arange(0, BN)
    tl.store(X + offs, offs, mask=offs < N)


def probe(index: int) -> bool:
    """Launch `_probe_kernel` with PDL on cuda:`index` and check what it wrote (raises what the launch raises)."""
    with torch.cuda.device(index):
        x = torch.zeros(16, dtype=torch.int32, device=f"cuda:{index}")
        _probe_kernel[(1,)](x, 16, PDL=True, BN=16, launch_pdl=True)
        torch.cuda.synchronize(index)
        return bool((x == torch.arange(16, device=x.device, dtype=torch.int32)).all())
