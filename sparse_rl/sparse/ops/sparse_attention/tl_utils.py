"""Helpers shared by the Triton kernels of every op."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> int:
    """`PREC` constexpr for `dot`: 2 under TRITON_INTERPRET=1 (its numpy dot returns garbage for
    bf16/fp16 operands, seen with triton 3.9, so operands are upcast), 1 for fp32 inputs on the GPU
    (full fp32, not tf32, so fp32 results match the reference to ~1e-6), 0 otherwise."""
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        return 2
    return 1 if dtype == torch.float32 else 0


def maxnreg_option(cap: int, t: torch.Tensor) -> dict:
    """The launch option of a register cap (0: the compiler's choice; CUDA only: the interpreter takes none). A cap
    trades spills for programs resident an SM, which is what a latency-bound kernel lacks."""
    return {"maxnreg": cap} if cap and t.is_cuda else {}


def tma_capable(x: torch.Tensor) -> bool:
    """Whether x's rows can load through tensor descriptors (Hopper's TMA): unit stride along the last dim, every
    other stride and the base 16-byte aligned; on CUDA a GPU of sm_90+ (the bulk tensor copies; the interpreter runs
    descriptors on the CPU). The block kernels' K / V `[B, S, H, D]` and the swap-AB GEMM's weight `[N, K]`."""
    es = x.element_size()
    if x.stride(-1) != 1 or any((x.stride(i) * es) % 16 for i in range(x.dim() - 1)) or x.data_ptr() % 16:
        return False
    return not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] >= 9


@triton.jit
def dot(a, b, PREC: tl.constexpr):
    if PREC == 2:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif PREC == 1:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r
