"""The sampled-quantile prefill top-k (`ops/indexer_topk/cand_topk.py`) under the Triton interpreter: the
reference's keys (ties to the later key, -0.0 == +0.0, forced sinks/window, left padding, q_offset, row chunks,
k above the visible count) through the quantile threshold, the take-all rows, the buffer select's tie rule and
the exact redo of flagged rows on the materialising path."""

import dataclasses

import pytest
import torch

from sparse_rl.sparse.ops.indexer_topk import triton as it
from sparse_rl.sparse.ops.indexer_topk.cand_topk import INTERPRET_CAND, indexer_topk_cand
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_naive


def _inputs(B, T, S, HI, DI, seed, positive_w=False, integer=False):
    g = torch.Generator().manual_seed(seed)
    if integer:  # small integers: exact scores in any order, masses of equal scores, -0.0 from w < 0 x ReLU 0
        q = torch.randint(-2, 3, (B, T, HI, DI), generator=g).float()
        k = torch.randint(-2, 3, (B, S, DI), generator=g).float()
        w = torch.randint(-1, 3, (B, T, HI), generator=g).float()
        return q, w, k
    q = torch.randn(B, T, HI, DI, generator=g)
    w = torch.rand(B, T, HI, generator=g) if positive_w else torch.randn(B, T, HI, generator=g)
    return q, w, torch.randn(B, S, DI, generator=g)


@pytest.mark.parametrize("B,T,S,HI,DI,K,sink,window,kvs,positive_w,integer,budget,threshold", [
    (2, 21, 75, 3, 16, 8, 2, 3, [0, 17], True, False, 1, "sample"),  # left padding, forced keys, one row tile a chunk
    (1, 23, 61, 2, 20, 9, 0, 0, None, False, False, None, "sample"),  # odd D_I, mixed-sign w
    (1, 16, 160, 2, 16, 6, 0, 0, None, False, True, None, "sample"),  # integer scores: ties inside the buffer
    (2, 11, 13, 4, 8, 40, 1, 1, [3, 0], False, False, None, "sample"),  # k above every row's visible count
    (1, 16, 160, 2, 16, 6, 1, 2, None, True, False, None, "zgrid"),  # stream.py's moment threshold
    (2, 21, 75, 3, 16, 8, 2, 3, [0, 17], False, True, None, "packed"),  # int64 (key, position) buffer, integer ties
    (1, 23, 61, 2, 20, 9, 1, 1, None, False, False, None, "packed-dot-q16"),  # tensor-core scan, 16-bit quantile
])
def test_cand_selects_exactly_the_reference_keys(B, T, S, HI, DI, K, sink, window, kvs, positive_w, integer, budget,
                                                 threshold):
    q, w, k = _inputs(B, T, S, HI, DI, seed=K + S, positive_w=positive_w, integer=integer)
    kv_start = None if kvs is None else torch.tensor(kvs)
    q_off = S - T
    info = {}
    over = {"packed": dict(packed=True), "packed-dot-q16": dict(packed=True, dot_scan=True, quantile_bits=16)}.get(
        threshold, dict(threshold=threshold))
    got = indexer_topk_cand(q, w, k, K, q_offset=q_off, sink=sink, window=window, kv_start=kv_start,
                            config=dataclasses.replace(INTERPRET_CAND, **over), budget_bytes=budget, info=info)
    ref = indexer_topk_naive(q, w, k, K, q_offset=q_off, sink=sink, window=window, kv_start=kv_start)
    assert got.dtype == torch.int32 and torch.equal(got, ref)
    if S > 4 * K:  # rows longer than the buffer: the threshold served some of them
        assert info["redone_rows"] < B * T and info["mean_entries"] < S - T
    if S < 20:  # the public entry point routes topk_impl="cand" here
        got2 = it.indexer_topk(q, w, k, K, q_offset=q_off, sink=sink, window=window, kv_start=kv_start,
                               topk_impl="cand")
        assert torch.equal(got2, ref)


def test_cand_redoes_rows_of_equal_scores_exactly():
    """57 keys with one index key: rows whose threshold lands on them overflow the buffer and are redone on the
    materialising path, with the later-key rule among the equal scores (the decode select got this row wrong)."""
    g = torch.Generator().manual_seed(3)
    T, S, K = 16, 160, 16
    q, w, k = torch.randn(1, T, 2, 16, generator=g), torch.randn(1, T, 2, generator=g), torch.randn(1, S, 16, generator=g)
    k[0, 100:] = k[0, 99]
    info = {}
    got = indexer_topk_cand(q, w, k, K, q_offset=S - T, sink=2, window=4, info=info)
    assert info["redone_rows"] > 0
    assert torch.equal(got, indexer_topk_naive(q, w, k, K, q_offset=S - T, sink=2, window=4))
