"""Reward-aware oversampling and dynamic sampling: which of the sampled completions a step trains on.

- `select_top_n`: sample M >= n completions per prompt with the rollout policy, keep the n with
  the highest reward (DistillSparse's reward-aware oversampling: the extra samples make up for the
  sparse policy's lower hit rate); ties are broken uniformly at random by a seeded generator so a
  resumed run makes the same choice.
- `informative_groups` / `prompts_to_refill`: DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2):
  a group whose rewards are all equal has zero advantage everywhere and contributes no gradient,
  so it is dropped and the batch is refilled with more prompts.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def _as_groups(rewards) -> torch.Tensor:
    r = rewards if isinstance(rewards, torch.Tensor) else torch.tensor(rewards, dtype=torch.float32)
    if r.dim() == 1:
        r = r[None]
    if r.dim() != 2:
        raise ValueError(f"rewards must be [G, M] (one row per prompt), got shape {tuple(r.shape)}")
    r = r.float()
    if torch.isnan(r).any():
        raise ValueError("rewards contain NaN; drop or score those completions before oversampling")
    return r


def select_top_n(rewards: torch.Tensor | Sequence[Sequence[float]], n: int,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices of the n highest-reward completions in each group, ties broken at random.

    rewards: `[G, M]` (or `[M]` for a single group) -> LongTensor `[G, n]` of column indices in
    0..M-1, sorted ascending within each row (the kept completions stay in sampling order).
    `generator`: a seeded CPU torch.Generator; the same seed and rewards give the same choice.
    """
    r = _as_groups(rewards).cpu()
    g, m = r.shape
    if not 0 < n <= m:
        raise ValueError(f"n must be in 1..M={m}, got {n}")
    # A random permutation first, then a *stable* sort by reward: equal rewards keep their random
    # relative order, so which tied completion survives is uniform.
    perm = torch.rand(g, m, generator=generator).argsort(dim=1)
    order = torch.sort(r.gather(1, perm), dim=1, descending=True, stable=True).indices
    kept = perm.gather(1, order[:, :n])
    return kept.sort(dim=1).values


def informative_groups(rewards: torch.Tensor | Sequence[Sequence[float]], *, atol: float = 0.0) -> torch.Tensor:
    """BoolTensor `[G]`: True where a group's rewards are not all equal (max - min > atol). rewards `[G, n]`."""
    r = _as_groups(rewards)
    return (r.max(dim=1).values - r.min(dim=1).values) > atol


def prompts_to_refill(kept_groups: int, target_groups: int, keep_rate: float | None = None,
                      *, min_keep_rate: float = 0.1) -> int:
    """How many more prompts to sample so that about `target_groups` informative groups are collected.

    With no estimate (`keep_rate` None) this is the deficit itself; with an observed fraction of
    groups that survived filtering it is ceil(deficit / keep_rate). keep_rate is floored at
    `min_keep_rate` so a run where nearly every group is uniform asks for at most deficit /
    min_keep_rate prompts per refill rather than an unbounded number (the trainer caps refills).
    """
    deficit = max(target_groups - kept_groups, 0)
    if deficit == 0 or keep_rate is None:
        return deficit
    # - 1e-9: 3 / 0.3 is 10.000000000000002 in floating point, which must not round up to 11.
    return math.ceil(deficit / max(keep_rate, min_keep_rate) - 1e-9)
