"""Name -> function registries for the GRPO options, and the masked reductions they all share.

Every option a recipe can choose (advantage estimator, loss aggregation, policy loss, mismatch
correction, KL estimator, distillation loss, reward shaping) is a pure function registered under a
name. The trainer resolves names with `lookup(REGISTRY, name, "config.key")`, which turns an
unknown name into a UsageError naming the config key and the valid names.

All functions here compute in float32 whatever the input dtype (bf16 log-probs from the model are
upcast), and work unchanged on CPU and CUDA.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from sparse_rl.errors import UsageError

F = TypeVar("F", bound=Callable)


class Registry(dict):
    """A dict of name -> function with a human-readable kind ("advantage estimator", ...)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self[name] = fn
            fn.registry_name = name  # type: ignore[attr-defined]
            return fn

        return deco


def lookup(registry: Registry, name: str, key: str) -> Callable:
    """`registry[name]`, or a UsageError naming the config `key` and the valid names."""
    try:
        return registry[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(registry))
        raise UsageError(
            f"{key}: unknown {registry.kind} {name!r}; valid names: {valid}"
        ) from None


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of `x` where `mask` is 1, in float32. x, mask: `[B, T]` (any equal shapes)."""
    x = x.float() * mask.float()
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of `x` over positions where the 0/1 `mask` is 1, in float32; 0 where nothing is valid.

    x, mask: `[B, T]`; dim=None gives a scalar, dim=-1 gives `[B]` (per-sequence means).
    """
    count = mask.float().sum() if dim is None else mask.float().sum(dim)
    # clamp_min(1): an all-masked row has sum 0, so its mean is 0 instead of 0/0 = NaN.
    return masked_sum(x, mask, dim) / count.clamp_min(1.0)
