"""Backend choice shared by every op: `auto` takes the Triton kernel for CUDA tensors when one is
registered, the PyTorch reference otherwise. `SPARSE_RL_BACKEND=torch|triton` forces either (the
`backend=` argument wins over the variable); on a CPU, `triton` runs under `TRITON_INTERPRET=1`."""

from __future__ import annotations

import functools
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


# What a kernel's `PDL` constexpr / a wrapper's `pdl` may be. 0 (False): plain launches. 1 (True): launched with
# programmatic dependent launch, the kernel's first statement `gdc_wait` (nothing read before the previous kernel
# has finished and its memory is visible); with no explicit trigger a kernel's dependents launch as its programs
# exit, so the overlap is the launch itself. 2: as 1, then `gdc_launch_dependents` right after the wait, so the next
# kernel's programs launch once every program of this one has started (the trigger fires only when all have
# called it or exited: all of this kernel is resident by then, so the waiting dependents cannot starve it) and
# wait on SMs this one leaves idle; memory order is the wait's alone, as at 1
PDL_LEVELS = (0, 1, 2)


def _triton_has_pdl() -> bool:
    """Whether the installed Triton has programmatic dependent launch: the `launch_pdl` launch option and
    `tl.extra.cuda.gdc_wait` (both since Triton 3.4, triton-lang/triton#6394; 3.6 and 3.9 have them)."""
    try:
        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return "launch_pdl" in fields and hasattr(cuda, "gdc_wait")


@functools.lru_cache(maxsize=None)
def _pdl_probe(index: int) -> bool:
    """One launch of a tiny kernel with PDL on device `index` (eagerly, outside any capture): False if the
    compiler, the driver or the launch rejects it, so a caller falls back to plain launches with no error."""
    try:
        from sparse_rl.sparse.ops.pdl import probe

        return probe(index)
    except Exception:
        return False


def cuda_index(device: torch.device) -> int:
    """The ordinal of a CUDA device (`cuda` without one: the current device), for per-device caches and launches."""
    return device.index if device.index is not None else torch.cuda.current_device()


def pdl_supported(device) -> bool:
    """Whether kernels on `device` can be launched with programmatic dependent launch (Hopper's PDL: a
    kernel's programs start while the previous kernel drains, then wait in `griddepcontrol.wait`): a CUDA
    device of compute capability 9.0 or later, not under TRITON_INTERPRET=1, a Triton with `launch_pdl` and
    `gdc_wait`, and one probe launch that succeeds. Everything else (CPU, interpreter, Ampere, an older
    Triton, a driver that rejects the attribute) is False, never an error."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "") == "1" or not torch.cuda.is_available():
        return False
    if not triton_available() or not _triton_has_pdl():
        return False
    index = cuda_index(device)
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    return _pdl_probe(index)


def resolve_pdl(pdl: bool | int | None, device, default: int) -> int:
    """The PDL level (`PDL_LEVELS`) of `pdl` (None: `default`) where `pdl_supported(device)`, else 0: the one
    place that decides whether a caller's Triton launches carry PDL."""
    want = int(default if pdl is None else pdl)
    if want not in PDL_LEVELS:
        raise ValueError(f"pdl {pdl!r}: expected one of {PDL_LEVELS} (False / True are 0 / 1)")
    return want if want and pdl_supported(device) else 0


_RETIRED: list = []  # outgrown counter buffers, kept alive: a CUDA graph captured with one still writes to it


def grown_counters(table: dict, dev: torch.device, n: int, least: int, lead: tuple = ()) -> torch.Tensor:
    """A zeroed int32 buffer `[*lead, >= n]` held per device in `table` (at least `least` entries, grown by doubling)
    for kernels that leave their counters zeroed (the decode select's barriers, the decode attention's fused merge).
    An outgrown buffer is kept alive (`_RETIRED`): a CUDA graph captured with it still writes to it, and freed, its
    memory could be handed to another tensor."""
    key = (dev.type, dev.index)
    buf = table.get(key)
    if buf is None or buf.shape[-1] < n:
        if buf is not None:
            _RETIRED.append(buf)
        size = max(least, 1 << max(0, n - 1).bit_length())
        buf = table[key] = torch.zeros(*lead, size, device=dev, dtype=torch.int32)
    return buf
