"""Device and dtype names -> torch objects: the one place `--device` and `--dtype` are resolved.

Every stage (CLI, trainers, rollout engine, eval, benchmarks) resolves its `device`/`dtype` options
here, so "auto" means the same everywhere: the first CUDA device if there is one (bfloat16 there),
else the CPU (float32).
"""

from __future__ import annotations

from sparse_rl.errors import UsageError

__all__ = ["resolve_device", "resolve_dtype"]


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when CUDA is available, else "cpu"; "cpu", "cuda", "cuda:N" are checked and returned."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine (use --device cpu or auto)")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise UsageError(f"--device {device}: expected auto, cpu, cuda or cuda:N")
    return device


def _table() -> dict:
    import torch

    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
            "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def resolve_dtype(dtype, device: str = "cpu"):
    """"auto"/None -> bfloat16 on CUDA, float32 on CPU; a name (float32/fp32, bfloat16/bf16, float16/fp16, float64) -> its torch dtype; a torch
    dtype passes through. The one dtype-name table of the package."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    table = _table()
    if dtype not in table:
        raise UsageError(f"--dtype {dtype}: expected auto, float32, bfloat16 or float16")
    return table[dtype]
