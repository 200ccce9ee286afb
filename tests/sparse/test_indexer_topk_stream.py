"""The streaming prefill indexer top-k paths under the Triton interpreter: the buffered one
(`ops/indexer_topk/stream.py`) and the binned one (`stream_binned.py`) select exactly the reference's
keys (ties to the later key, forced sinks/window, left padding, q_offset, several row chunks), through
the sampled threshold, the take-all rows, the binned path's recomputed boundary bin and the exact
redo of rows neither can serve; and the streamed row maxima they are timed against."""

import dataclasses

import pytest
import torch

from sparse_rl.sparse.ops.indexer_topk import triton as it
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_scores_naive, indexer_topk_naive
from sparse_rl.sparse.ops.indexer_topk.stream import INTERPRET_CONFIG, indexer_row_max, indexer_topk_stream
from sparse_rl.sparse.ops.indexer_topk.stream_binned import INTERPRET_BINNED, indexer_topk_binned


def _inputs(B, T, S, HI, DI, seed, positive_w=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HI, DI, generator=g)
    w = torch.rand(B, T, HI, generator=g) if positive_w else torch.randn(B, T, HI, generator=g)
    return q, w, torch.randn(B, S, DI, generator=g)


@pytest.mark.parametrize("B,T,S,HI,DI,K,sink,window,kvs,dot_scan,positive_w,budget", [
    # left padding, forced keys, rows past the buffer, two row chunks (the smallest budget)
    (2, 21, 75, 3, 16, 8, 2, 3, [0, 17], False, True, 1),
    (1, 23, 61, 2, 20, 9, 0, 0, None, True, False, None),  # prefix sum on the tensor cores, odd D_I, mixed-sign w
    (2, 11, 13, 4, 8, 40, 1, 1, [3, 0], False, False, None),  # k above every row's visible count: -1 padding
])
def test_stream_selects_exactly_the_reference_keys(B, T, S, HI, DI, K, sink, window, kvs, dot_scan, positive_w,
                                                   budget):
    q, w, k = _inputs(B, T, S, HI, DI, seed=K + S, positive_w=positive_w)
    kv_start = None if kvs is None else torch.tensor(kvs)
    q_off = S - T
    info = {}
    got = indexer_topk_stream(q, w, k, K, q_offset=q_off, sink=sink, window=window, kv_start=kv_start,
                              config=dataclasses.replace(INTERPRET_CONFIG, dot_scan=dot_scan), budget_bytes=budget,
                              info=info)
    ref = indexer_topk_naive(q, w, k, K, q_offset=q_off, sink=sink, window=window, kv_start=kv_start)
    assert got.dtype == torch.int32 and torch.equal(got, ref)
    assert info["redone_rows"] < B * T // 2  # the sampled threshold, not the exact redo, served most rows
    if S < 20:  # the public entry point routes topk_impl="stream" here
        got2 = it.indexer_topk(q, w, k, K, q_offset=q_off, sink=sink, window=window, kv_start=kv_start,
                               topk_impl="stream")
        assert torch.equal(got2, ref)


def test_stream_threshold_path_is_taken_and_exact():
    """Rows far longer than the buffer: every one goes through the sampled statistics and threshold,
    and the buffer ends up holding fewer entries than the row has keys."""
    B, T, S, K = 1, 16, 160, 6
    q, w, k = _inputs(B, T, S, 2, 16, seed=5, positive_w=True)
    info = {}
    got = indexer_topk_stream(q, w, k, K, q_offset=S - T, info=info)
    assert torch.equal(got, indexer_topk_naive(q, w, k, K, q_offset=S - T))
    assert info["slots"] == 16 and info["mean_entries"] < 16 < S - T


@pytest.mark.parametrize("path,B", [("stream", 1), ("binned", 1), ("stream", 2)])
def test_rows_of_equal_scores_are_redone_exactly(path, B):
    """Equal scores everywhere (zero head weights): every row's threshold bin holds all its keys, so the
    buffer overflows (stream) or the boundary bin exceeds the recompute cap (binned), and the row is
    redone by the exact decode select: the latest keys win. A stream buffer smaller than k on random
    scores takes the same road."""
    fn = indexer_topk_stream if path == "stream" else indexer_topk_binned
    B, T, S, K = 1, 4, 40, 5
    q, w, k = _inputs(B, T, S, 2, 8, seed=1)
    info = {}
    got = fn(q, torch.zeros_like(w), k, K, q_offset=S - T, sink=1, info=info)
    ref = indexer_topk_naive(q, torch.zeros_like(w), k, K, q_offset=S - T, sink=1)
    assert torch.equal(got, ref) and info["redone_rows"] == B * T
    assert torch.equal(got[0, -1], torch.tensor([0, 36, 37, 38, 39], dtype=torch.int32))
    if path == "stream":
        info = {}
        got = indexer_topk_stream(q[:, :2], w[:, :2], k, K, q_offset=S - T, slots=4, info=info)
        assert torch.equal(got, indexer_topk_naive(q[:, :2], w[:, :2], k, K, q_offset=S - T))
        assert info["redone_rows"] == 2


def test_row_max_equals_reference():
    B, T, S = 2, 19, 45
    q, w, k = _inputs(B, T, S, 3, 16, seed=2)
    kvs = torch.tensor([0, 9])
    got = indexer_row_max(q, w, k, q_offset=S - T, kv_start=kvs)
    ref = indexer_scores_naive(q, w, k, q_offset=S - T, kv_start=kvs).max(-1).values
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B,T,S,HI,DI,K,sink,window,kvs,positive_w,budget,bins", [
    # left padding, forced keys, rows past k, three row chunks (budget of 16 rows x 75 keys)
    (2, 21, 75, 3, 16, 8, 2, 3, [0, 17], True, 2 * 16 * 75, 8),
    (1, 23, 61, 2, 20, 9, 0, 0, None, False, None, 8),  # odd D_I, mixed-sign w (ties at 0 in some rows)
    (1, 16, 160, 2, 16, 6, 0, 0, None, True, None, 254),  # the GPU's bin count: boundary bins of one key
    (2, 11, 13, 4, 8, 40, 1, 1, [3, 0], False, None, 8),  # k above every row's visible count: -1 padding
])
def test_binned_selects_exactly_the_reference_keys(B, T, S, HI, DI, K, sink, window, kvs, positive_w, budget, bins):
    q, w, k = _inputs(B, T, S, HI, DI, seed=K + S, positive_w=positive_w)
    kv_start = None if kvs is None else torch.tensor(kvs)
    q_off = S - T
    info = {}
    got = indexer_topk_binned(q, w, k, K, q_offset=q_off, sink=sink, window=window, kv_start=kv_start,
                              budget_bytes=budget, config=dataclasses.replace(INTERPRET_BINNED, bins=bins), info=info)
    ref = indexer_topk_naive(q, w, k, K, q_offset=q_off, sink=sink, window=window, kv_start=kv_start)
    assert got.dtype == torch.int32 and torch.equal(got, ref)
    assert info["redone_rows"] < B * T // 4  # the bins, not the exact redo, served the rows
    if bins == 8 and K < S - T:  # few bins: the k-th key shares its bin, whose scores are recomputed
        assert info["boundary_rows"] > 0
    if S < 20:  # the public entry point routes topk_impl="binned" here
        got2 = it.indexer_topk(q, w, k, K, q_offset=q_off, sink=sink, window=window, kv_start=kv_start,
                               topk_impl="binned")
        assert torch.equal(got2, ref)


def test_binned_ties_inside_the_boundary_bin_go_to_the_later_key():
    """Duplicated keys give exactly equal scores inside one boundary bin: the recomputed select keeps the
    later copies, as the reference does, and the row is not redone."""
    B, T, S, K = 1, 3, 48, 7
    q, w, k = _inputs(B, T, S, 2, 8, seed=3, positive_w=True)
    k[0, 20:40] = k[0, 0:20]  # keys 20..39 repeat keys 0..19
    info = {}
    cfg = dataclasses.replace(INTERPRET_BINNED, bins=2)
    got = indexer_topk_binned(q, w, k, K, q_offset=S - T, config=cfg, info=info)
    assert torch.equal(got, indexer_topk_naive(q, w, k, K, q_offset=S - T))
    assert info["redone_rows"] == 0 and info["boundary_rows"] >= 1
