"""The process group every trainer uses: rank, world, device, and the few collectives they need.

`Dist` goes through accelerate's `PartialState`, so `torchrun` and `accelerate launch` both work
(gloo on CPU, NCCL on GPUs); a single process (`WORLD_SIZE` unset or 1) needs no process group and
every collective is the identity.

Gradients: `reduce_grads` AVERAGES over processes (what DDP does). A loss normalised per process
(indexer training: the mean over this process's rows) then yields the gradient of the global mean.
A loss normalised by GLOBAL counts (GRPO: tokens summed over processes) is a sum of per-process
shares; its trainer multiplies it by `grad_scale` (= world) before `backward`, so the average is
the sum, i.e. the single-process gradient on the union of the processes' data.
"""

from __future__ import annotations

import os

import torch

from sparse_rl.devices import resolve_device


class Dist:
    """Process group through accelerate's PartialState (torchrun / `accelerate launch` set it up);
    a single process needs none. CPU runs use gloo."""

    def __init__(self, device: str = "auto"):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        if self.world > 1:
            from accelerate import PartialState

            state = PartialState(cpu=(device == "cpu"))
            self.rank, self.world = state.process_index, state.num_processes
            # plain "cpu" (not "cpu:0", which safetensors rejects); "cuda:<local rank>" on GPUs
            self.device = torch.device("cpu") if state.device.type == "cpu" else state.device
        else:
            self.rank = 0
            self.device = torch.device(resolve_device(device))
            if self.device.type == "cuda" and self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def grad_scale(self) -> float:
        """Factor for a loss normalised by global counts, so that `reduce_grads`' average is its sum."""
        return float(self.world)

    def _reduce(self, values: list[float], op: str) -> list[float]:
        if self.world == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()

    def sum(self, values: list[float]) -> list[float]:
        return self._reduce(values, "sum")

    def max(self, values: list[float]) -> list[float]:
        return self._reduce(values, "max")

    def sum_named(self, values: dict[str, float]) -> dict[str, float]:
        """`sum` of named values, one all-reduce: {name: value summed over processes}."""
        return dict(zip(values, self.sum(list(values.values()))))

    def max_named(self, values: dict[str, float]) -> dict[str, float]:
        return dict(zip(values, self.max(list(values.values()))))

    def all_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over processes in place (it must live on a device the backend serves)."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj, src: int = 0):
        """Rank `src`'s `obj` on every process (any picklable object)."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        """Leave together: every rank waits for the last writes of rank 0 (plots, checkpoints), then the
        process group is torn down explicitly rather than by interpreter exit, where a rank that leaves
        first can break its peer's teardown."""
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()

    def reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Average the gradients of `params` over processes (missing grads count as zero), one flat
        all-reduce in float32 (bf16 gradients are summed without bf16 rounding of the partial sums)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        off = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[off:off + n].view_as(p).to(p.dtype)
            off += n

    def _comm_device(self):
        import torch.distributed as dist

        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")
