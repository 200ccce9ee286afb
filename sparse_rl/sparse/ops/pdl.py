"""Programmatic dependent launch inside the kernels: the prologue every PDL-capable Triton kernel of the decode
step starts with (`pdl_enter`), and the one-launch check behind `_backend.pdl_supported` (`probe`). Its own
module: importing it imports Triton. Levels: `_backend.PDL_LEVELS`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first statement. PDL 0: nothing. >= 1 (launched early with `launch_pdl`): wait until the
    previous kernel is done and its memory visible, so no load may come before this call. 2: then let the next
    kernel launch (its programs wait the same way)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _probe_kernel(X, N, PDL: tl.constexpr, BN: tl.constexpr):
    pdl_enter(PDL)
    offs = tl.arange(0, BN)
    tl.store(X + offs, offs, mask=offs < N)


def probe(index: int) -> bool:
    """Launch `_probe_kernel` with PDL on cuda:`index` and check what it wrote (raises what the launch raises)."""
    with torch.cuda.device(index):
        x = torch.zeros(16, dtype=torch.int32, device=f"cuda:{index}")
        _probe_kernel[(1,)](x, 16, PDL=True, BN=16, launch_pdl=True)
        torch.cuda.synchronize(index)
        return bool((x == torch.arange(16, device=x.device, dtype=torch.int32)).all())
