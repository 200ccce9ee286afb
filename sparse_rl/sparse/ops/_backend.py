"""Backend choice shared by every op: `auto` takes the Triton kernel for CUDA tensors when one is
registered, the PyTorch reference otherwise. `SPARSE_RL_BACKEND=torch|triton` forces either (the
`backend=` argument wins over the variable); on a CPU, `triton` runs under `TRITON_INTERPRET=1`."""

from __future__ import annotations

import os

import torch

from sparse_rl.errors import UsageError

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def resolve_backend(backend: str | None, x: torch.Tensor, has_triton: bool) -> str:
    """Return "torch" or "triton" for an op whose Triton kernel exists iff `has_triton`."""
    if backend is None or backend == "auto":
        backend = os.environ.get("SPARSE_RL_BACKEND", "auto") or "auto"
    if backend not in BACKENDS:
        raise UsageError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)} (argument or SPARSE_RL_BACKEND)")
    if backend == "auto":
        if has_triton and x.is_cuda and triton_available():
            return "triton"
        return "torch"
    if backend == "triton":
        if not has_triton:
            return "torch"  # no kernel for this op (yet): the reference is the documented fallback
        if not triton_available():
            raise UsageError("backend 'triton': the triton package is not installed")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "") != "1":
            raise UsageError("backend 'triton' on CPU tensors needs TRITON_INTERPRET=1")
    return backend
