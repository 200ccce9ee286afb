"""Process plumbing for the GRPO trainer: FSDP sharding of the policy, per-phase timers, step seeds.
The process group itself is `sparse_rl.distributed.Dist` (shared with indexer training).

Two layouts, chosen by the config key `parallel`:

- `ddp` (default): every process holds the whole policy; gradients are averaged with one flat
  all-reduce per update (`Dist.reduce_grads`) instead of wrapping the model in DDP: theta and the
  LoRA adapter phi train in turn on the same model object, and DDP's hooks assume one fixed set of
  trainable parameters. The loss uses global normalisers, so the trainer scales it by
  `Dist.grad_scale` (= world) before the backward: the average is then the sum of the processes'
  shares, the single-process gradient on the union of their data.
- `fsdp`: theta is sharded over the processes with PyTorch's FSDP2 (`fully_shard`); see `FSDPPolicy`.
  Same math as `ddp` (global normalisers, scaled loss, averaged gradients), so the two reach the same
  weights up to float rounding (the gradient-norm clip is computed shard-wise; see
  tests/rl/test_grpo_fsdp.py).
"""

from __future__ import annotations

import time
import zlib

import torch

from sparse_rl.distributed import Dist  # noqa: F401  (the trainers' process group)


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
    theta's gradients as an AVERAGE (gradient divide factor = world, done as a sum and a division
    because gloo has no PREMUL_SUM/AVG), the same as `Dist.reduce_grads` in `ddp` mode (the trainer
    scaled the loss by `Dist.grad_scale`); the trainer therefore skips its manual all-reduce for theta.
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
            m.set_gradient_divide_factor(float(self.dist.world))  # an average, as Dist.reduce_grads
            m.set_force_sum_reduction_for_comms(True)  # gloo has no AVG/PREMUL_SUM: sum, then divide

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
