"""Group-relative advantages (GRPO and Dr. GRPO).

Registry `ADVANTAGES`; every entry has the signature
`fn(rewards, group_ids=None, *, eps=1e-6) -> advantages` with the shape of `rewards`:
- rewards `[G, n]` (one row per prompt group), group_ids None; or
- rewards `[N]` flat, with group_ids `[N]` (a tensor of ints, or any sequence of hashables,
  e.g. task ids) saying which prompt each completion belongs to; groups may differ in size.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sparse_rl.rl.algos.registry import Registry

ADVANTAGES = Registry("advantage estimator")


def _group_index(group_ids, n: int, device) -> torch.Tensor:
    """Map arbitrary group ids `[N]` to contiguous ints 0..G-1 `[N]`."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.shape != (n,):
            raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, rewards has {n} entries")
        return torch.unique(group_ids, return_inverse=True)[1].to(device)
    ids = list(group_ids)
    if len(ids) != n:
        raise ValueError(f"group_ids has {len(ids)} entries, rewards has {n}")
    first: dict = {}
    return torch.tensor([first.setdefault(g, len(first)) for g in ids], dtype=torch.long, device=device)


def _group_relative(rewards: torch.Tensor, group_ids, norm_std: bool, eps: float) -> torch.Tensor:
    r = rewards.float()
    if group_ids is None:
        if r.dim() != 2:
            raise ValueError(f"rewards must be [G, n] when group_ids is None, got shape {tuple(r.shape)}")
        mean = r.mean(dim=1, keepdim=True)
        adv = r - mean
        if norm_std:
            n = r.shape[1]
            # Bessel-corrected std (torch.std's default, as in the GRPO reference code); a group of
            # one has no spread, its advantage is 0 anyway.
            var = (adv**2).sum(dim=1, keepdim=True) / max(n - 1, 1)
            adv = adv / (var.sqrt() + eps)
        return adv
    if r.dim() != 1:
        raise ValueError(f"rewards must be [N] with group_ids, got shape {tuple(r.shape)}")
    idx = _group_index(group_ids, r.shape[0], r.device)
    g = int(idx.max()) + 1 if idx.numel() else 0
    count = torch.zeros(g, device=r.device).index_add_(0, idx, torch.ones_like(r))
    mean = torch.zeros(g, device=r.device).index_add_(0, idx, r) / count
    adv = r - mean[idx]
    if norm_std:
        ss = torch.zeros(g, device=r.device).index_add_(0, idx, adv**2)
        std = (ss / (count - 1).clamp_min(1.0)).sqrt()
        adv = adv / (std[idx] + eps)
    return adv


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_ids: Sequence | torch.Tensor | None = None, *, eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage A_i = (r_i - mean_g) / (std_g + eps) (Shao et al. 2024, DeepSeekMath, eq. 3 / sec. 4.1.2).

    std is the Bessel-corrected group std. A group whose rewards are all equal has r_i - mean_g = 0,
    so `eps` keeps 0/0 from becoming NaN and its advantages are exactly 0.
    rewards `[G, n]` or `[N]` + group_ids `[N]` -> advantages, same shape, float32.
    """
    return _group_relative(rewards, group_ids, norm_std=True, eps=eps)


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, group_ids: Sequence | torch.Tensor | None = None, *, eps: float = 1e-6) -> torch.Tensor:
    """Dr. GRPO advantage A_i = r_i - mean_g, no std division (Liu et al. 2025, "Understanding R1-Zero-Like Training").

    Dividing by the group std up-weights prompts that are nearly always right or wrong (question-level
    difficulty bias); Dr. GRPO drops it. `eps` is accepted for a uniform signature and unused.
    rewards `[G, n]` or `[N]` + group_ids `[N]` -> advantages, same shape, float32.
    """
    return _group_relative(rewards, group_ids, norm_std=False, eps=eps)
