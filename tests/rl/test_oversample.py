"""Reward-aware oversampling (top-n with random tie-breaks) and dynamic sampling."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from sparse_rl.rl.oversample import informative_groups, prompts_to_refill, select_top_n


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_top_n_keeps_exactly_the_best():
    r = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0]])
    # three rewards of 1 at columns 1, 2, 4; then .5 at 3
    assert select_top_n(r, 3, gen(0)).tolist() == [[1, 2, 4]]
    assert select_top_n(r, 4, gen(0)).tolist() == [[1, 2, 3, 4]]
    assert select_top_n(r, 5, gen(0)).tolist() == [[0, 1, 2, 3, 4]]
    two = select_top_n(r, 2, gen(0))[0].tolist()
    assert len(two) == 2 and set(two) <= {1, 2, 4} and two == sorted(two)
    # several groups, list input, one group as a flat list
    assert select_top_n([[3.0, 1.0, 2.0], [0.0, 5.0, -1.0]], 2, gen(0)).tolist() == [[0, 2], [0, 1]]
    assert select_top_n([0.2, 0.9, 0.1], 1, gen(0)).tolist() == [[1]]


def test_ties_are_broken_at_random_but_reproducibly():
    r = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0]])
    assert select_top_n(r, 2, gen(7)).tolist() == select_top_n(r, 2, gen(7)).tolist()
    g = gen(123)
    counts = Counter(tuple(select_top_n(r, 2, g)[0].tolist()) for _ in range(600))
    # the 3 possible pairs of tied columns, each expected 200 times
    assert set(counts) == {(1, 2), (1, 4), (2, 4)}
    assert min(counts.values()) > 140, counts


def test_top_n_bad_inputs():
    r = torch.tensor([[0.0, 1.0]])
    with pytest.raises(ValueError):
        select_top_n(r, 3)
    with pytest.raises(ValueError):
        select_top_n(r, 0)
    with pytest.raises(ValueError, match="NaN"):
        select_top_n(torch.tensor([[0.0, float("nan")]]), 1)


def test_dynamic_sampling_drops_uniform_groups():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 0.0]])
    assert informative_groups(r).tolist() == [False, True, False, False]
    assert informative_groups([[0.0, 0.001]], atol=0.01).tolist() == [False]


def test_prompts_to_refill():
    assert prompts_to_refill(5, 8) == 3  # no keep-rate estimate: the deficit
    assert prompts_to_refill(5, 8, keep_rate=0.3) == 10  # ceil(3 / .3), not 11 from float error
    assert prompts_to_refill(5, 8, keep_rate=0.5) == 6
    assert prompts_to_refill(5, 8, keep_rate=0.0) == 30  # keep-rate floored at .1
    assert prompts_to_refill(9, 8, keep_rate=0.5) == 0
