"""Process plumbing for the GRPO trainer: the data-parallel group, per-phase timers, step seeds.

`Dist` uses accelerate's `PartialState`, so `torchrun` and `accelerate launch` both work (gloo on CPU,
NCCL on GPUs). Gradients are summed with one flat all-reduce per update (`reduce_grads`) instead of
wrapping the model in DDP: theta and the LoRA adapter phi train in turn on the same model object,
and DDP's hooks assume one fixed set of trainable parameters.
"""

from __future__ import annotations

import time
import zlib

import torch


def mix_seed(*parts: int) -> int:
    """A 31-bit seed from integers (stable across processes and Python runs)."""
    return zlib.crc32(",".join(str(int(p)) for p in parts).encode()) & 0x7FFFFFFF


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Accumulates wall time per name; synchronises CUDA so GPU work lands in the right bucket."""

    def __init__(self, device):
        self.device = device
        self.t: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                _sync(timer.device)
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                _sync(timer.device)
                timer.t[name] = timer.t.get(name, 0.0) + time.perf_counter() - self.t0

        return _Ctx()


# ----------------------------------------------------------------------------- processes


class Dist:
    """Process group through accelerate's PartialState (torchrun / `accelerate launch` set it up);
    a single process needs none. CPU runs use gloo."""

    def __init__(self, device: str):
        import os

        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.world > 1:
            from accelerate import PartialState

            state = PartialState(cpu=(device == "cpu"))
            self.rank, self.world = state.process_index, state.num_processes
            # plain "cpu" (not "cpu:0", which safetensors rejects); "cuda:<local rank>" on GPUs
            self.device = torch.device("cpu") if state.device.type == "cpu" else state.device
        else:
            from sparse_rl.cli.common import resolve_device

            self.rank = 0
            self.device = torch.device(resolve_device(device))
            if self.device.type == "cuda" and self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        return t.tolist()

    def max(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` over processes (missing grads count as zero), one all-reduce."""
        if self.world == 1:
            return
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
            p.grad = g

    def _comm_device(self):
        import torch.distributed as dist

        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")
