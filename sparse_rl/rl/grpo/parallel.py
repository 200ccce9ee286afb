"""Process plumbing for the GRPO trainer: the data-parallel group, FSDP sharding of the policy,
per-phase timers, step seeds.

`Dist` uses accelerate's `PartialState`, so `torchrun` and `accelerate launch` both work (gloo on CPU,
NCCL on GPUs). Two layouts, chosen by the config key `parallel`:

- `ddp` (default): every process holds the whole policy; gradients are summed with one flat
  all-reduce per update (`reduce_grads`) instead of wrapping the model in DDP: theta and the LoRA
  adapter phi train in turn on the same model object, and DDP's hooks assume one fixed set of
  trainable parameters.
- `fsdp`: theta is sharded over the processes with PyTorch's FSDP2 (`fully_shard`); see `FSDPPolicy`.
  Same math as `ddp` (global normalisers, summed gradients), so the two reach the same weights up
  to float rounding (the gradient-norm clip is computed shard-wise; see tests/rl/test_grpo_fsdp.py).
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
            from sparse_rl.devices import resolve_device

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


# ----------------------------------------------------------------------------- FSDP


PARALLEL = ("ddp", "fsdp")


def _fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every process must call it), a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class FSDPPolicy:
    """FSDP2 sharding of the GRPO policy (`parallel: fsdp`). One instance per trainer.

    Layout. `fully_shard` is applied AFTER peft wraps the model (so theta's parameter objects are the
    peft model's), once per decoder layer and once on the HF causal LM under the peft wrapper (the
    root: embeddings, final norm, lm_head). Wrapping the inner HF model rather than the PeftModel
    keeps the PeftModel's class, hence `disable_adapter()`, `save_pretrained` and
    `get_base_model()`, untouched. Each param `[d0, ...]` becomes a DTensor sharded on dim 0
    (`Shard(0)`, `[ceil(d0 / world), ...]` per process).

    The LoRA adapter phi stays replicated (`ignored_params`): it is tiny (rank r x (in + out) per
    projection), it trains in a separate phase with its own optimizer, and keeping it a plain
    tensor leaves its gradient sync (`Dist.reduce_grads`, one all-reduce), its optimizer state and
    its peft save/load exactly as in `ddp` mode. Sharding it would save a few MB and cost an FSDP
    reduce-scatter per layer per distillation step. The frozen indexers are sharded with their layer
    (they are part of the layer's parameters; FSDP handles parameters without gradients). The frozen
    KL reference model, if any, is sharded the same way (forward only).

    Training. The policy loss and the distillation run the model's normal forward, so FSDP's hooks
    all-gather each layer before its forward/backward and free it after. The backward reduce-scatters
    theta's gradients with a SUM (gradient divide factor 1, sum-only collectives: gloo has no
    PREMUL_SUM/AVG): the loss already uses global token/sequence normalisers, so a sum is what
    `ddp` mode's all-reduce computes; the trainer therefore skips its manual all-reduce for theta.
    AdamW and `clip_grad_norm_` run on the local shards (DTensors; the norm is a collective).
    Distillation freezes theta (requires_grad off on the sharded params; FSDP copies the flag to
    the unsharded ones on every all-gather), so only phi gets gradients.

    Rollouts. The rollout engine calls the model's submodules (q_proj, mlp, ...) directly, not the
    layers' forward, so FSDP's hooks never run there. `gathered()` therefore all-gathers EVERY FSDP
    unit (`unshard()`, which swaps the full parameters into the modules) for the rollout/eval, and
    reshards after. The full parameters get a freshly allocated storage on every all-gather, so
    `on_gather` callbacks (the trainer's `engine.refresh()`) drop CUDA graphs captured against the
    previous addresses; on GPUs the decode graphs are therefore recaptured every step. Peak memory
    during a rollout is that of the whole policy (plus phi and the KV cache) on every process:
    FSDP here shards the weights at rest, theta's gradients and AdamW state, and the training
    passes gather one layer at a time; the rollout itself still needs the full weights.

    Checkpoints (same on-disk format as `ddp`). `full_state()` gathers theta's full weights
    (`get_model_state_dict(full_state_dict=True, cpu_offload=True)`: full tensors on rank 0's CPU)
    and rank 0 writes `policy/` as a normal model dir; `adapter/` is written from the replicated phi.
    The policy optimizer's state is gathered the same way (`get_optimizer_state_dict`, full state,
    keyed by parameter name) into `optimizer.pt["policy"]`; resume reads it on every process and
    `set_optimizer_state_dict` reshards it. Weights are loaded back by copying each full tensor into
    the local shard (`distribute_tensor` with the parameter's mesh and placement).
    A single process (`WORLD_SIZE` unset or 1) has nothing to shard over: `parallel: fsdp` then
    runs unsharded, exactly as `ddp`.
    """

    def __init__(self, dist: Dist):
        from torch.distributed.device_mesh import init_device_mesh

        self.dist = dist
        self.mesh = init_device_mesh(dist.device.type, (dist.world,))
        self.on_gather: list = []  # callables run after every all-gather of the full weights

    def shard(self, model, replicated: list[torch.nn.Parameter] = ()) -> None:
        """Shard `model` (peft-wrapped or not) in place; `replicated` params (phi) are left whole."""
        from torch.distributed.fsdp import fully_shard

        from sparse_rl.sparse.patch import decoder_layers

        ignored = set(replicated)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=self.mesh, ignored_params=ignored)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        fully_shard(base, mesh=self.mesh, ignored_params=ignored)
        for m in _fsdp_modules(model):
            m.set_gradient_divide_factor(1.0)  # gradients are summed, the loss is globally normalised
            m.set_force_sum_reduction_for_comms(True)

    def gathered(self, model):
        """Context: every FSDP unit of `model` unsharded (full parameters in the modules) inside."""
        import contextlib

        @contextlib.contextmanager
        def ctx():
            units = _fsdp_modules(model)
            handles = [u.unshard(async_op=True) for u in units]
            for h in handles:
                if h is not None:
                    h.wait()
            for fn in self.on_gather:
                fn()
            try:
                yield
            finally:
                for u in units:
                    u.reshard()

        return ctx()

    @staticmethod
    def grad_norm(gn: torch.Tensor) -> torch.Tensor:
        """`clip_grad_norm_`'s total norm as a plain tensor (a DTensor over shards otherwise)."""
        return _local(gn)

    def full_state(self, model) -> dict[str, torch.Tensor]:
        """The full state dict (peft parameter names) on rank 0's CPU; {} on the other ranks. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.dist.main else {}

    def optim_state(self, model, optimizer) -> dict:
        """The optimizer's full state (keyed by parameter name) on rank 0's CPU. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        sd = get_optimizer_state_dict(model, optimizer,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.dist.main else {}

    def load_optim_state(self, model, optimizer, state: dict) -> None:
        """Load a full optimizer state (every rank passes the same dict) and reshard it. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))
