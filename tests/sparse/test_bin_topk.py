"""The one-histogram row top-k (`ops/indexer_topk/bin_topk.py`) against the reference's rows (ties to the
later column, -0.0 == +0.0, -inf never selected, -1 padding), on its three paths, under the interpreter."""

import pytest
import torch

from sparse_rl.sparse.ops.indexer_topk.bin_topk import bin_topk
from sparse_rl.sparse.ops.indexer_topk.naive import select_topk
from sparse_rl.sparse.ops.indexer_topk.radix_topk import radix_topk


def _ref(s, K, q_lim=None):
    T, S = s.shape[1], s.shape[2]
    vis = s > float("-inf")
    if q_lim is not None:
        vis &= torch.arange(S)[None, None, :] <= q_lim + torch.arange(T)[None, :, None]
    return select_topk(s, vis, vis & (s == float("inf")), K)


def _rows(seed=3, Tc=9, Sc=150):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(1, Tc, Sc, generator=g)
    s[0, 0, :5] = float("inf")  # forced keys
    s[0, 1, 30:40] = 0.25  # exact ties straddling the threshold
    s[0, 1, 12:20] = float("-inf")
    s[0, 2, 12:] = float("-inf")  # fewer than K visible: -1 padding
    s[0, 3] = torch.where(torch.rand(Sc, generator=g) < 0.5, -0.0, 0.0)  # signed zeros: one tie
    s[0, 3, ::7] = -1.0
    s[0, 4] = s[0, 4].round()  # masses of equal scores
    s[0, 5] = -s[0, 5].abs() * 1e3  # all negative
    s[0, 6, 3] = 1e30  # one huge outlier: the rest share the lowest bins
    s[0, 7, :] = 2.0  # all equal: one bin holds the whole row
    s[0, 8, 100] = 300.0  # a milder outlier: the first level's bin overflows, the second level splits it
    return s


@pytest.mark.parametrize("launch", [None, (32, 16, 32, 1), (64, 128, 64, 2)])
def test_bin_topk_equals_reference(launch):
    """Default (CPU) launch, a buffer too small for most rows (radix fallback), a wide one."""
    s = _rows()
    for K in (20, 7):
        stats = torch.full((s.shape[1], 2), -1, dtype=torch.int32)
        got = bin_topk(s, K, launch=launch, stats=stats)
        assert torch.equal(got, _ref(s, K)), (K, launch)
        # row 2 (12 visible) is short for K = 20; the all-equal row 7 has one bin and falls back
        assert stats[2, 0] == (0 if K == 20 else 1) and stats[7, 0] == 2, stats.tolist()
        if launch is None:
            assert stats[8, 0] == 3, stats.tolist()  # the outlier row: two levels, then the buffer
        cap = (launch or (32, 64))[1]
        for path, cstar in stats.tolist():  # the recorded path agrees with the threshold bin's count
            assert path == 0 or (path in (1, 3)) == (cstar <= cap), stats.tolist()


def test_bin_topk_buffer_path_and_q_lim():
    """Random rows take the buffer (path 1); q_lim: row t reads only columns <= q_lim + t (causal chunks),
    rows of a few columns included; equal to the radix select on the same chunk."""
    g = torch.Generator().manual_seed(9)
    s = torch.randn(2, 5, 300, generator=g)
    stats = torch.full((10, 2), -1, dtype=torch.int32)
    got = bin_topk(s, 24, stats=stats)
    assert torch.equal(got, _ref(s, 24)) and bool((stats[:, 0] == 1).all()), stats.tolist()
    for q_lim in (0, 40):
        lim = bin_topk(s, 24, q_lim=q_lim)
        assert torch.equal(lim, _ref(s, 24, q_lim)) and torch.equal(lim, radix_topk(s, 24, q_lim=q_lim))
        assert torch.equal(bin_topk(s, 24, q_lim=q_lim, long_first=False), lim)  # rows in launch order
