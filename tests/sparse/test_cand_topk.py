"""The sampled-quantile prefill top-k (`ops/indexer_topk/cand_topk.py`) under the Triton interpreter: the
reference's keys (ties to the later key, -0.0 == +0.0, forced sinks/window, left padding, q_offset, row chunks,
k above the visible count) through the quantile threshold, the take-all rows, the buffer select's tie rule and
the exact redo of flagged rows on the materialising path."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk import triton as it
from sparse_rl.sparse.ops.indexer_topk.cand_topk import INTERPRET_CAND, indexer_topk_cand
from sparse_rl.sparse.ops.indexer_topk.cand_words import _popc
from sparse_rl.sparse.ops.indexer_topk.radix_topk import _okey, kth_key, kth_key2, kth_key_counts
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
    (1, 16, 160, 2, 16, 6, 0, 0, None, False, True, None, "scan"),  # session 10's pair-buffer gather, integer ties
    (2, 21, 75, 3, 16, 8, 2, 3, [0, 17], False, True, None, "compact"),  # k-th keys by all-pairs ranks, ties
    (1, 23, 61, 2, 20, 9, 0, 0, None, False, False, None, "compact-lean"),  # the same, the select's keys only
    (2, 21, 75, 3, 16, 8, 2, 3, [0, 17], False, True, None, "loaded-queries"),  # query tiles loaded at every key tile
])
def test_cand_selects_exactly_the_reference_keys(B, T, S, HI, DI, K, sink, window, kvs, positive_w, integer, budget,
                                                 threshold):
    q, w, k = _inputs(B, T, S, HI, DI, seed=K + S, positive_w=positive_w, integer=integer)
    kv_start = None if kvs is None else torch.tensor(kvs)
    q_off = S - T
    info = {}
    over = {"packed": dict(gather="scan", packed=True),  # session 10's gather kernels, still selectable
            "packed-dot-q16": dict(gather="scan", packed=True, dot_scan=True, quantile_bits=16),
            "scan": dict(gather="scan", packed=False),
            "compact": dict(packed=True, quantile_compact=4, select_compact=4, block_n=32),
            "compact-lean": dict(packed=True, quantile_compact=4, select_compact=4, select_lean=True, block_n=32),
            "loaded-queries": dict(hoist_queries=False),
            }.get(threshold, dict(threshold=threshold))
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


def test_empty_whole_tiles_are_skipped_without_changing_the_buffers():
    """Keys 96.. scaled up: every row's candidates lie there, so the whole 32-key tiles 0-95 hold none and
    `skip_empty` leaves them out of the append; the rows equal the reference, and the buffers the unskipped run's
    (the same entries a row and no row flagged that was not flagged before: a tile skipped wrongly would shorten
    rows into the redo, which is exact and would hide it)."""
    g = torch.Generator().manual_seed(5)
    T, S, K = 16, 160, 8
    q, w, k = torch.randn(1, T, 2, 16, generator=g), torch.rand(1, T, 2, generator=g), torch.randn(1, S, 16, generator=g)
    k[0, 96:] *= 8
    ref = indexer_topk_naive(q, w, k, K, q_offset=S - T)
    infos = []
    for skip in (False, True):
        info = {}
        got = indexer_topk_cand(q, w, k, K, q_offset=S - T, info=info,
                                config=dataclasses.replace(INTERPRET_CAND, skip_empty=skip))
        assert torch.equal(got, ref)
        infos.append(info)
    assert infos[0] == infos[1] and infos[1]["redone_rows"] < T
    assert int((ref < 96).sum()) <= T  # the candidates do cluster in the scaled keys


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


def _words(**over):
    return dataclasses.replace(INTERPRET_CAND, **{"gather": "words", "packed": False, **over})


@pytest.mark.parametrize("over", [dict(), dict(packed=True), dict(split=False), dict(word_compact=False)])
def test_words_gather_fills_the_scan_gathers_buffer(over):
    """`_gather_words_kernel` (32-key words + popcounts, the whole-tile loop, the store helper) writes the same
    entries in the same (key) order and the same counts as stream.py's cumsum gather, row by row, on the same
    thresholds: left padding, sinks and window (head, whole and diagonal tiles), a row tile past T, a tight
    buffer (rows that overflow: count -1 on both)."""
    from sparse_rl.sparse.ops.indexer_topk import cand_topk as ct
    from sparse_rl.sparse.ops.indexer_topk.stream import _kv_start

    B, T, S, K, C = 1, 30, 131, 6, 32
    q, w, k = _inputs(B, T, S, 2, 16, seed=5)
    kvs = _kv_start(torch.tensor([35]), B, q.device)
    sink, window, q_off = 2, 3, S - T
    base = dataclasses.replace(INTERPRET_CAND, gather="scan", packed=False)
    cfg = _words(**over)
    R = ct.sample_stride(base, S)
    th = torch.empty(B, T)
    smp = torch.empty(B, T, triton.cdiv(S, R))
    ct.cand_threshold(q, w, k, kvs, 0, T, q_off, sink, window, K, C, th, smp, base)
    th[0, ::5] = float("-inf")  # take-all rows: every visible key (these overflow C: -1)
    val, idx = torch.full((B, T, C), 7.0), torch.full((B, T, C), -9, dtype=torch.int32)
    nrow = torch.empty(B, T, dtype=torch.int32)
    ct.cand_gather(q, w, k, kvs, 0, T, q_off, sink, window, K, th, val, idx, nrow, base)
    wv = torch.full((B, T, C), -9, dtype=torch.int64) if cfg.packed else torch.full((B, T, C), 7.0)
    wi = wv if cfg.packed else torch.full((B, T, C), -9, dtype=torch.int32)
    wn = torch.empty(B, T, dtype=torch.int32)
    ct.cand_gather(q, w, k, kvs, 0, T, q_off, sink, window, K, th, wv, wi, wn, cfg)
    assert torch.equal(wn, nrow) and bool((nrow >= 0).any()) and bool((nrow < 0).any())
    if cfg.packed:
        wi = (wv & 0xFFFFFFFF).to(torch.int32)
        wv = (wv >> 32).to(torch.int32).view(torch.float32)
    live = torch.arange(C)[None, None, :] < nrow[:, :, None]
    assert torch.equal(torch.where(live, wi, 0), torch.where(live, idx, 0))
    assert torch.equal(torch.where(live, wv, 0.0), torch.where(live, val, 0.0))


@pytest.mark.parametrize("case", ["integer", "inf"])
def test_words_cand_selects_exactly_the_reference_keys(case):
    """The whole cand path with the words gather (packed buffer: the select makes the key from the fp32 bits):
    integer scores (masses of ties, -0.0), and +inf / -inf scores (a head weight of +-1e38 on every third row:
    1e38 x ReLU(dot) overflows to +inf, which ties the forced keys; -1e38 gives -inf, never selected)."""
    B, T, S, K = 1, 16, 100, 7
    if case == "integer":
        S = 72
        q, w, k = _inputs(B, T, S, 2, 16, seed=11, integer=True)
    else:
        q, w, k = _inputs(B, T, S, 2, 16, seed=12)
        w[0, ::3, 0], w[0, 1::3, 1] = 1e38, -1e38  # disjoint rows: no inf - inf
    ref = indexer_topk_naive(q, w, k, K, q_offset=S - T, sink=1, window=2)
    cfg = _words(packed=True, search_bits=2 if case == "integer" else 1)  # the 2-bit k-th key search on ties
    got = indexer_topk_cand(q, w, k, K, q_offset=S - T, sink=1, window=2, config=cfg)
    assert torch.equal(got, ref)


@triton.jit
def _popc_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, _popc(tl.load(X + offs).to(tl.uint32, bitcast=True), False))


def test_swar_popcount():
    """`cand_words._popc`'s interpreter form (the SWAR popcount; CUDA takes libdevice's POPC) on edge words."""
    vals = [0, 1, -1, -2**31, 2**31 - 1, 0x55555555, -0x55555556, 0x0F0F0F0F] + list(
        torch.randint(-2**31, 2**31 - 1, (8,), generator=torch.Generator().manual_seed(0)).tolist())
    x = torch.tensor(vals, dtype=torch.int32)
    y = torch.empty_like(x)
    _popc_kernel[(1,)](x, y, N=16)
    assert y.tolist() == [bin(v & 0xFFFFFFFF).count("1") for v in vals]


@triton.jit
def _kth_kernel(X, OUT, K, N: tl.constexpr, NBITS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    live = x > float("-inf")
    key = _okey(x)
    tl.store(OUT + 0, kth_key(key, live, K, NBITS).to(tl.int32, bitcast=True))
    tl.store(OUT + 1, kth_key2(key, live, K, NBITS).to(tl.int32, bitcast=True))


def _kth_rows(g):
    """Rows of 64 scores for the k-th key searches: distinct, masses of ties, +inf, -inf (not live), one live key,
    keys differing in the lowest bit only."""
    rows = [torch.randn(64, generator=g), torch.randint(-3, 4, (64,), generator=g).float(),
            torch.full((64,), 1.5), torch.tensor([float("inf")] * 3 + [0.0] * 61)]
    one = torch.full((64,), float("-inf"))
    one[17] = 2.0
    lowbit = (torch.full((64,), 1.0).view(torch.int32) + torch.arange(64, dtype=torch.int32) % 2).view(torch.float32)
    neg = torch.randn(64, generator=g)
    neg[::3] = float("-inf")
    return rows + [one, lowbit, neg]


@pytest.mark.parametrize("nbits", [32, 16])
def test_kth_key2_equals_the_one_bit_search(nbits):
    """`kth_key2` (two bits a step, one reduction) finds the one-bit search's tau: distinct scores, masses of
    ties, +inf, -inf (not live), one live key, keys differing in the lowest bit only, K at the edges."""
    rows = _kth_rows(torch.Generator().manual_seed(nbits))
    out = torch.empty(2, dtype=torch.int32)
    for x in rows:
        n = int((x > float("-inf")).sum())
        for k in sorted({1, n // 2 or 1, n}):
            _kth_kernel[(1,)](x, out, k, N=64, NBITS=nbits)
            assert out[0] == out[1], (x, k)


@triton.jit
def _kth_counts_kernel(X, OUT, SCR, K, N: tl.constexpr, CM: tl.constexpr, CJ: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    live = x > float("-inf")
    key = _okey(x)
    tau, n_gt, n_eq = kth_key_counts(key, live, tl.sum(live.to(tl.int32), 0), K, SCR, CM, CJ)
    tl.store(OUT + 0, kth_key(key, live, K).to(tl.int32, bitcast=True))
    tl.store(OUT + 1, tau.to(tl.int32, bitcast=True))
    tl.store(OUT + 2, n_gt)
    tl.store(OUT + 3, n_eq)


@pytest.mark.parametrize("cm,cj", [(4, 4), (16, 4), (64, 16)])
def test_kth_key_counts_equal_the_bit_search(cm, cj):
    """`kth_key_counts` (the search stopped at <= cm open keys, ranked all-pairs in [cm, cj] tiles) finds
    `kth_key`'s exact k-th key and the live keys above and at it: distinct scores, masses of ties wider than cm
    (the search runs to its last bit) and narrower, +inf, -inf (not live), one live key, keys differing in the
    lowest bit only, keys of both signs (the search's first bit), k from 1 to all."""
    g = torch.Generator().manual_seed(cm)
    rows = _kth_rows(g) + [torch.randint(0, 40, (64,), generator=g).float()]
    out = torch.empty(4, dtype=torch.int32)
    scr = torch.empty(64, dtype=torch.int32)
    for x in rows:
        live = x > float("-inf")
        n = int(live.sum())
        for k in sorted({1, min(2, n), n // 4 or 1, n // 2 or 1, 3 * n // 4 or 1, max(1, n - 1), n}):
            _kth_counts_kernel[(1,)](x, out, scr, k, N=64, CM=cm, CJ=cj)
            kth = torch.sort(x[live], descending=True).values[k - 1]
            assert out[0] == out[1], (x, k)
            assert out[2] == int((x[live] > kth).sum()) and out[3] == int((x[live] == kth).sum()), (x, k)


@pytest.mark.parametrize("zeros,kvs,spans,redo", [(0.9, None, 3, "off"), (0.8, [0, 37], 3, "few"),
                                                  (0.9, [5, 0], 1, None)])
def test_rows_of_zeros_at_the_threshold_are_resolved_by_their_ties(zeros, kvs, spans, redo):
    """A ReLU indexer's exact zeros where the k-th score is 0 (the trained indexer's flagged rows, NOTES session
    16): the threshold is 0, every zero a candidate, the buffer overflows. The tie path gathers those rows
    again, keeps the keys above 0 and the LATEST zeros (the reference's tie rule), and redoes none of them;
    with the rows' keys in 3 spans (the latest ties across spans, a short last span) or in one. The same rows
    redone instead, with the tie path off or below its work rule, in one case each (the redo is the slow part
    under the interpreter)."""
    g = torch.Generator().manual_seed(int(zeros * 10))
    B, T, S, K = 2, 16, 300, 40
    q = torch.randn(B, T, 3, 16, generator=g)
    w = torch.rand(B, T, 3, generator=g) + 0.1  # positive: a zero key scores exactly 0, the others >= 0
    k = torch.randn(B, S, 16, generator=g)
    k[torch.rand(B, S, generator=g) < zeros] = 0.0
    kv_start = None if kvs is None else torch.tensor(kvs)
    # a threshold never above the k-th score: no short rows
    cfg = dataclasses.replace(INTERPRET_CAND, target=2.0, tie_splits=spans)
    info = {}
    got = indexer_topk_cand(q, w, k, K, q_offset=S - T, sink=2, window=3, kv_start=kv_start, info=info, config=cfg)
    ref = indexer_topk_naive(q, w, k, K, q_offset=S - T, sink=2, window=3, kv_start=kv_start)
    assert torch.equal(got, ref)
    tied = info["tie_rows"]
    assert tied >= 8 and info["redone_rows"] == 0
    if redo == "off":
        off = indexer_topk_cand(q, w, k, K, q_offset=S - T, sink=2, window=3, kv_start=kv_start, info=info,
                                config=dataclasses.replace(cfg, ties=False))
        assert torch.equal(off, ref) and info["redone_rows"] == tied  # without it: the same rows redone
    if redo == "few":
        few = indexer_topk_cand(q, w, k, K, q_offset=S - T, sink=2, window=3, kv_start=kv_start, info=info,
                                config=dataclasses.replace(cfg, tie_min_work=B * T * S + 1))
        assert torch.equal(few, ref) and info["redone_rows"] == tied and info["tie_rows"] == 0  # below the rule


def test_ties_at_a_nonzero_threshold_keep_the_later_keys():
    """Integer scores (21 values over 300 keys: exact in any summation order) put masses of equal nonzero
    scores at the threshold: the tie path resolves those rows with the later-key rule, the rest are redone."""
    g = torch.Generator().manual_seed(5)
    B, T, S, K = 2, 16, 300, 24
    q = torch.randint(-1, 2, (B, T, 2, 8), generator=g).float()
    w = torch.randint(1, 3, (B, T, 2), generator=g).float()
    k = torch.randint(-1, 2, (B, S, 8), generator=g).float()
    ref = indexer_topk_naive(q, w, k, K, q_offset=S - T, sink=1, window=2)
    info = {}
    got = indexer_topk_cand(q, w, k, K, q_offset=S - T, sink=1, window=2, info=info,
                            config=dataclasses.replace(INTERPRET_CAND, target=2.0))
    assert torch.equal(got, ref) and info["tie_rows"] >= 8


def test_ties_of_one_tile_beyond_k_keep_the_latest():
    """k = 8 under 32-key tiles: one tile holds more ties of a row than k; only the latest k are stored, each
    in a slot of its own (a shared slot's winner would be undefined on a GPU; the interpreter would hide it)."""
    g = torch.Generator().manual_seed(9)
    B, T, S, K = 1, 16, 200, 8
    q = torch.randn(B, T, 2, 16, generator=g)
    w = torch.rand(B, T, 2, generator=g) + 0.1
    k = torch.randn(B, S, 16, generator=g)
    k[torch.rand(B, S, generator=g) < 0.97] = 0.0  # ~6 nonzero keys a row: the k-th score is 0
    ref = indexer_topk_naive(q, w, k, K, q_offset=S - T, sink=1, window=1)
    info = {}
    got = indexer_topk_cand(q, w, k, K, q_offset=S - T, sink=1, window=1, info=info,
                            config=dataclasses.replace(INTERPRET_CAND, target=2.0))
    assert torch.equal(got, ref) and info["tie_rows"] > 0 and info["redone_rows"] == 0


def test_rows_of_ties_only_take_the_latest_keys():
    """Every key scores 0 and none is forced: the buffer holds no key above the threshold (n = 0) and a row's
    selection is its latest k keys, merged from the ties alone; left padding too."""
    B, T, S, K = 2, 16, 120, 24
    q = torch.randn(B, T, 2, 16, generator=torch.Generator().manual_seed(3))
    w = torch.rand(B, T, 2) + 0.1
    k = torch.zeros(B, S, 16)
    kv_start = torch.tensor([0, 30])
    ref = indexer_topk_naive(q, w, k, K, q_offset=S - T, kv_start=kv_start)
    info = {}
    got = indexer_topk_cand(q, w, k, K, q_offset=S - T, kv_start=kv_start, info=info,
                            config=dataclasses.replace(INTERPRET_CAND, target=2.0))
    assert torch.equal(got, ref) and info["tie_rows"] == B * T and info["redone_rows"] == 0


@pytest.mark.parametrize("cap", [64, 3])
def test_redo_ahead_equals_the_synchronous_redo(cap):
    """A buffer of k slots overflows on most rows, which are redone by the decode select: launched ahead of their
    count on the first `cap` flagged rows (cand_redo.py; 3: fewer than the flagged rows, the synchronous path
    redoes them all again) the rows equal the synchronous redo's and the reference, with left padding and forced
    keys; the returned rows are contiguous (the spare scratch row is not part of them)."""
    B, T, S, K = 1, 20, 90, 6
    q, w, k = _inputs(B, T, S, 2, 16, seed=4, positive_w=True)
    kv_start = torch.tensor([5])
    args = dict(q_offset=S - T, sink=1, window=2, kv_start=kv_start, slots=8)
    sync_cfg = dataclasses.replace(INTERPRET_CAND, redo="decode", redo_ahead=0)
    infos = [{}, {}]
    ref = indexer_topk_naive(q, w, k, K, q_offset=S - T, sink=1, window=2, kv_start=kv_start)
    sync = indexer_topk_cand(q, w, k, K, config=sync_cfg, info=infos[0], **args)
    got = indexer_topk_cand(q, w, k, K, config=dataclasses.replace(sync_cfg, redo_ahead=cap), info=infos[1], **args)
    assert infos[0]["redone_rows"] > 3 and infos[0] == infos[1]
    assert torch.equal(sync, ref) and torch.equal(got, ref) and got.is_contiguous() and got.shape == ref.shape


@pytest.mark.parametrize("T,cap,BM", [(131072, 43648, 64), (32768, 43648, 64), (1000, 64, 16), (100, 32, 16),
                                      (17, 64, 16)])
def test_even_chunks_are_the_fewest_within_the_cap(T, cap, BM):
    """`even_chunk`: a multiple of BM, at most cap (cap a multiple of BM), as few chunks as cap allows, and no chunk
    much shorter than the others (128K rows at a 43,648-row cap: 4 x 32,768, not 3 x 43,648 + 128)."""
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import even_chunk

    c = even_chunk(T, cap, BM)
    n = -(-T // c)
    assert c % BM == 0 and c <= max(cap, BM) and n == -(-T // cap)
    assert T - (n - 1) * c >= c - BM * n or n == 1  # the last chunk within rounding of the others
    if (T, cap) == (131072, 43648):
        assert c == 32768
