"""Triton kernels (run through TRITON_INTERPRET=1 on the CPU, see tests/conftest.py) against the
PyTorch references on small odd shapes: T and S not multiples of the block sizes, K > visible keys,
-1 padding, empty rows, GQA ratios 1/4/7, head dims 16/64/128, forward and gradients."""

import json
import math
from unittest import mock

import pytest
import torch

from sparse_rl.sparse.ops import block_select, indexer_topk, sparse_attention, sparse_decode
from sparse_rl.sparse.ops.block_select.naive import block_select_naive
from sparse_rl.sparse.ops.indexer_topk import triton as it
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_scores_naive, indexer_topk_naive
from sparse_rl.sparse.ops.indexer_topk.radix_topk import radix_topk
from sparse_rl.sparse.ops.sparse_attention import triton as sa
from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive


def _rel(a, b):
    a, b = a.detach(), b.detach()
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _indices(B, T, S, K, g, drop=0.3):
    """Distinct random indices, K may exceed S (padded with -1), random -1 holes, one empty row."""
    idx = torch.rand(B, T, S, generator=g).argsort(-1)[..., :min(K, S)].to(torch.int32)
    if K > S:
        idx = torch.cat([idx, idx.new_full((B, T, K - S), -1)], -1)
    idx[torch.rand(B, T, K, generator=g) < drop] = -1
    idx[0, 3] = -1
    return idx


CASES = [  # (H, H_kv, D, dtype, tol): GQA 1, 4, 7; head dims 64, 128, 16
    (3, 3, 64, torch.float32, 1e-5),
    (8, 2, 128, torch.float32, 1e-5),
    (7, 1, 64, torch.bfloat16, 1e-2),
    (4, 1, 16, torch.float16, 2e-3),
]


@pytest.mark.parametrize("paths", [("query", "atomic"), ("tile", "tile")])
@pytest.mark.parametrize("H,H_kv,D,dtype,tol", CASES)
def test_sparse_attention_forward_and_gradients(H, H_kv, D, dtype, tol, paths):
    g = torch.Generator().manual_seed(H * 100 + D)
    B, T, S, K = 2, 11, 37, 45  # K > S: trailing -1 everywhere
    q = torch.randn(B, H, T, D, generator=g).to(dtype).transpose(1, 2).requires_grad_()  # non-contiguous
    k = torch.randn(B, S, H_kv, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, S, H_kv, D, generator=g).to(dtype).requires_grad_()
    idx = _indices(B, T, S, K, g)
    out, lse = sparse_attention(q, k, v, idx, backend="triton", fwd_path=paths[0], bwd_path=paths[1])
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    ro, rl = sparse_attention_naive(qr, kr, vr, idx)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert _rel(out, ro) < tol
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse))
    torch.testing.assert_close(lse[fin], rl[fin], atol=1e-4, rtol=1e-4)
    assert torch.all(out[0, 3] == 0) and torch.all(torch.isneginf(lse[0, 3]))  # empty row
    # gradients, including an upstream gradient on lse
    go = torch.randn(out.shape, generator=g)
    gl = torch.randn(lse.shape, generator=g).masked_fill(~fin, 0)
    ((out.float() * go).sum() + (lse.masked_fill(~fin, 0) * gl).sum()).backward()
    ((ro * go).sum() + (rl.masked_fill(~fin, 0) * gl).sum()).backward()
    for a, b in ((q, qr), (k, kr), (v, vr)):
        assert a.grad.dtype == dtype and a.grad.shape == a.shape
        assert _rel(a.grad, b.grad) < tol


def test_sparse_attention_full_selection_equals_causal_dense_gqa4():
    from sparse_rl.sparse.ops import dense_attention_naive, visible_mask

    g = torch.Generator().manual_seed(5)
    B, T, H, H_kv, D = 1, 19, 8, 2, 64
    q, k, v = (torch.randn(B, T, h, D, generator=g) for h in (H, H_kv, H_kv))
    idx = torch.arange(T).expand(T, T).clone()
    idx = torch.where(idx <= torch.arange(T)[:, None], idx, -1)[None].to(torch.int32)
    out, lse = sparse_attention(q, k, v, idx, backend="triton")
    ref, ref_lse = dense_attention_naive(q, k, v, visible_mask(B, T, T))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("merge", ["kernel", "fused"])
@pytest.mark.parametrize("nsplit", [None, 1, 3])
def test_sparse_decode_matches_reference(nsplit, merge):
    g = torch.Generator().manual_seed(7)
    B, H, H_kv, D, S_max, K = 3, 8, 2, 64, 50, 300  # K > 2 x 128: nsplit 3 really splits (128-key blocks)
    q = torch.randn(B, H, D, generator=g)
    kc, vc = torch.randn(B, S_max, H_kv, D, generator=g), torch.randn(B, S_max, H_kv, D, generator=g)
    lengths = [50, 17, 1]  # rows of different lengths: indices name only filled slots
    idx = torch.full((B, K), -1, dtype=torch.int32)
    for b, n in enumerate(lengths):
        sel = torch.randperm(n, generator=g)[:40]
        idx[b, :len(sel)] = sel.to(torch.int32)
    out, lse = sa.sparse_decode(q, kc, vc, idx, nsplit=nsplit, merge=merge)
    ro, rl = sparse_attention_naive(q[:, None], kc, vc, idx[:, None])
    torch.testing.assert_close(out, ro[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, rl[:, 0], atol=1e-5, rtol=1e-5)
    # public entry point, forced backend
    out2, _ = sparse_decode(q, kc, vc, idx, backend="triton")
    torch.testing.assert_close(out2, ro[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("B,H,H_kv,D,S,K,nsplit", [(2, 8, 2, 64, 700, 512, 4), (1, 7, 1, 48, 900, 700, 3),
                                                  (3, 14, 2, 16, 400, 300, 3)])
def test_fused_merge_equals_the_merge_kernel(B, H, H_kv, D, S, K, nsplit):
    """`sparse_decode(merge="fused")`: the last program of each (row, kv head) merges the split partials inside the
    forward (no `_merge_kernel` launch): the merge kernel's out and lse (an all -1 row: lse -inf, out 0), GQA 4 / 7 /
    7, odd head dims; the counters are left at zero for the next launch (a CUDA-graph replay)."""
    g = torch.Generator().manual_seed(B + S)
    q = torch.randn(B, H, D, generator=g)
    kc, vc = torch.randn(B, S, H_kv, D, generator=g), torch.randn(B, S, H_kv, D, generator=g)
    idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B)]).to(torch.int32)
    idx[0, 100:] = -1  # row 0's later splits hold no key
    if B > 2:
        idx[2] = -1
    ref = sa.sparse_decode(q, kc, vc, idx, nsplit=nsplit)
    with mock.patch.object(sa, "_merge_kernel") as merge_kernel:
        out, lse = sa.sparse_decode(q, kc, vc, idx, nsplit=nsplit, merge="fused")
    merge_kernel.__getitem__.assert_not_called()
    torch.testing.assert_close(out, ref[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref[1]))
    torch.testing.assert_close(lse, ref[1], atol=1e-6, rtol=1e-6)
    assert int(sa._merge_counters(q.device, 1).abs().sum()) == 0
    with pytest.raises(ValueError, match="merge"):
        sparse_decode(q, kc, vc, idx, merge="atomic")


def test_outgrown_counter_buffers_stay_alive(monkeypatch):
    """The fused merge's and the sync select's counters grow by a new buffer; the old one stays referenced (a CUDA
    graph captured with it keeps writing to it: freed, its memory could be handed to another tensor)."""
    from sparse_rl.sparse.ops import _backend
    from sparse_rl.sparse.ops.indexer_topk import decode_sync

    for mod, get, small, big in ((sa, sa._merge_counters, 1, 1000), (decode_sync, decode_sync._counters, 1, 1000)):
        monkeypatch.setattr(_backend, "_RETIRED", [])
        cache = {}
        monkeypatch.setattr(mod, "_MERGE_COUNTERS" if mod is sa else "_COUNTERS", cache)
        old = get(torch.device("cpu"), small)
        new = get(torch.device("cpu"), big)
        assert new.numel() > old.numel() and _backend._RETIRED == [old] and get(torch.device("cpu"), small) is new


def test_environment_variable_selects_the_kernel(monkeypatch):
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 5, 2, 16, generator=g), torch.randn(1, 9, 1, 16, generator=g), torch.randn(1, 9, 1, 16, generator=g)
    idx = _indices(1, 5, 9, 4, g, drop=0.0)
    with mock.patch.object(sa, "_fwd", wraps=sa._fwd) as spy:
        monkeypatch.setenv("SPARSE_RL_BACKEND", "triton")
        out, _ = sparse_attention(q, k, v, idx)  # backend "auto" defers to the variable
        assert spy.call_count == 1
        monkeypatch.setenv("SPARSE_RL_BACKEND", "torch")
        ref, _ = sparse_attention(q, k, v, idx)
        assert spy.call_count == 1
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,D", [(torch.float64, 16), (torch.float32, 256)])
def test_unsupported_shapes_fall_back_to_the_reference(dtype, D):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 2, D, generator=g).to(dtype)
    k, v = (torch.randn(1, 6, 1, D, generator=g).to(dtype) for _ in range(2))
    idx = _indices(1, 4, 6, 3, g, drop=0.0)
    with mock.patch.object(sa, "_fwd", wraps=sa._fwd) as spy:
        out, lse = sparse_attention(q, k, v, idx, backend="triton")
        assert spy.call_count == 0
    ref, ref_lse = sparse_attention_naive(q, k, v, idx)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def _score_values(sc, ix):
    """Reference scores at the chosen indices, sorted: equal for any two valid top-k choices."""
    got = torch.gather(sc, 2, ix.clamp(min=0).long())
    return torch.where(ix >= 0, got, torch.full_like(got, -1e30)).sort(-1).values


@pytest.mark.parametrize("sink,window,topk,budget,impl", [
    (0, 0, 9, None, "torch"), (2, 3, 16, 4 * 2 * 50 * 5, "torch"), (1, 1, 200, None, "torch"),
    (2, 3, 16, 4 * 2 * 50 * 7, "radix"), (2, 3, 16, 4 * 2 * 50 * 7, "bin"),
])
def test_indexer_topk_matches_reference(sink, window, topk, budget, impl):
    g = torch.Generator().manual_seed(topk + sink)
    B, T, S, HI, DI = 2, 21, 50, 3, 16
    q_off = S - T
    qi, w, ki = torch.randn(B, T, HI, DI, generator=g), torch.randn(B, T, HI, generator=g), torch.randn(B, S, DI, generator=g)
    kvs = torch.tensor([0, 13])
    got = it.indexer_topk(qi, w, ki, topk, q_offset=q_off, sink=sink, window=window, kv_start=kvs,
                          budget_bytes=budget, topk_impl=impl)
    ref = indexer_topk_naive(qi, w, ki, topk, q_offset=q_off, sink=sink, window=window, kv_start=kvs)
    assert got.dtype == torch.int32 and got.shape == ref.shape
    assert torch.equal(got >= 0, ref >= 0)
    sc = indexer_scores_naive(qi.double(), w.double(), ki.double(), q_offset=q_off, kv_start=kvs)
    # forced keys first: mark them +inf as the selection does
    pos = torch.arange(T)[None, :, None] + q_off
    s = torch.arange(S)[None, None]
    st = kvs.view(B, 1, 1)
    forced = (s >= st) & (s <= pos) & ((s < st + sink) | (s > pos - window))
    sc = sc.masked_fill(forced, float("inf"))
    assert torch.equal(_score_values(sc, got), _score_values(sc, ref))  # ReLU ties (score 0) may pick other keys
    valid = got[got >= 0]
    rows = got.clone()
    rows[rows < 0] = torch.iinfo(torch.int32).max
    assert torch.equal(rows, rows.sort(-1).values) and valid.numel() > 0  # ascending, -1 at the end
    # public entry point with the kernel forced
    got2 = indexer_topk(qi, w, ki, topk, q_offset=q_off, sink=sink, window=window, kv_start=kvs, backend="triton")
    assert torch.equal(_score_values(sc, got2), _score_values(sc, ref))


def test_radix_topk_exact_with_ties_infinities_and_short_rows():
    g = torch.Generator().manual_seed(3)
    B, Tc, Sc, K = 2, 4, 150, 20
    s = torch.randn(B, Tc, Sc, generator=g)
    s[0, 0, :5] = float("inf")  # forced keys
    s[:, :, 30:40] = 0.25  # exact ties straddling the threshold
    s[0, 1, 12:] = float("-inf")  # fewer than K visible
    s[1, 2] = -s[1, 2].abs() * 1e3  # all negative
    s[1, 3, :] = s[1, 3, :].round()  # many ties
    got = radix_topk(s, K)
    vals = torch.topk(s, K, -1).values
    for b in range(B):
        for t in range(Tc):
            row = got[b, t]
            sel = row[row >= 0]
            assert torch.equal(sel, sel.sort().values) and torch.all(row[len(sel):] == -1)
            want = vals[b, t][vals[b, t] > float("-inf")]
            assert torch.equal(s[b, t, sel.long()].sort(descending=True).values, want)
    # exactly the reference's keys: among scores equal to the threshold the later keys win
    from sparse_rl.sparse.ops.indexer_topk.naive import select_topk

    fin = s > float("-inf")
    assert torch.equal(got, select_topk(s, fin, fin & (s == float("inf")), K))
    # q_lim: row t reads only columns <= q_lim + t
    lim = radix_topk(s, K, q_lim=10)
    for t in range(Tc):
        assert int(lim[1, t].max()) <= 10 + t


@pytest.mark.parametrize("B,HI,DI,S,K,sink,window,chunk,starts", [
    (3, 4, 16, 100, 24, 2, 3, 32, None),  # several chunks, ties
    (5, 3, 20, 257, 40, 0, 0, 64, None),  # S not a multiple of the chunk, odd head count and dim
    (2, 5, 8, 70, 100, 1, 1, 32, None),  # K above every row's visible count: -1 padding
    (3, 4, 16, 200, 32, 2, 2, 32, [0, 5, 50]),  # left padding (kv_start)
    (2, 2, 16, 96, 8, 0, 0, 96, None),  # one chunk per row
])
def test_indexer_topk_decode_kernel_equals_reference_exactly(B, HI, DI, S, K, sink, window, chunk, starts):
    """Integer-valued inputs make every score exact, so the kernel must pick exactly the reference's keys,
    including its tie rule (among equal scores the later key wins; ReLU zeros and small integers tie a lot)."""
    from sparse_rl.sparse.ops import indexer_topk_decode
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive

    g = torch.Generator().manual_seed(B * S + K)
    q = torch.randint(-2, 3, (B, HI, DI), generator=g).float()
    w = torch.randint(-1, 3, (B, HI), generator=g).float()
    k = torch.randint(-2, 3, (B, S, DI), generator=g).float()
    pos = torch.randint(0, S, (B,), generator=g)
    pos[0] = S - 1
    kvs = None if starts is None else torch.tensor(starts)
    if kvs is not None:
        pos = torch.maximum(pos, kvs)
    ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=sink, window=window, kv_start=kvs)
    got = itd.indexer_topk_decode(q, w, k, pos, K, sink=sink, window=window, kv_start=kvs, chunk=chunk)
    assert got.dtype == torch.int32 and torch.equal(got, ref)
    # public entry point, kernel forced; index keys as a strided view of a larger cache (the engine's case)
    cache = torch.zeros(B, S + 37, DI)
    cache[:, :S] = k
    got2 = indexer_topk_decode(q, w, cache[:, :S], pos, K, sink=sink, window=window, kv_start=kvs, backend="triton")
    assert torch.equal(got2, ref)


def test_indexer_topk_decode_edge_distributions():
    """Forced keys filling the whole budget, all-equal scores, scores spanning 40 factors of 2 (the
    span is set by a few huge keys: nearly all others share the first bin and the one-program radix
    reads them all), negative and mixed-sign head weights."""
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive

    g = torch.Generator().manual_seed(1)
    B, HI, DI, S = 3, 2, 16, 150
    pos = torch.tensor([149, 90, 20])
    q = torch.randint(-2, 3, (B, HI, DI), generator=g).float()
    k = torch.randint(-2, 3, (B, S, DI), generator=g).float()
    w = torch.ones(B, HI)
    scale = 2.0 ** torch.randint(0, 40, (B, S, 1), generator=g).float()
    cases = [(q, w, k, 8, 3, 5), (torch.zeros_like(q), w, k, 20, 1, 1), (q.abs(), w, k.abs() * scale, 20, 0, 0),
             (q.abs(), w, k.abs() * scale, 20, 2, 2), (q, -w, k, 20, 1, 2),
             (q, torch.tensor([[1., -1.], [2., -3.], [-1., -1.]]), k, 30, 0, 3)]
    for qq, ww, kk, K, sink, window in cases:
        got = itd.indexer_topk_decode(qq, ww, kk, pos, K, sink=sink, window=window)
        assert torch.equal(got, indexer_topk_decode_naive(qq, ww, kk, pos, K, sink=sink, window=window))


def test_indexer_topk_decode_mixed_sign_weights_few_candidates():
    """A converted model's index-head weights have mixed signs, so most scores are negative. The first
    level must still narrow the threshold to a few keys (the former max-relative bins put every
    negative score into one clamped bin: about all keys were candidates)."""
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive

    g = torch.Generator().manual_seed(11)
    B, HI, DI, S, K = 3, 8, 32, 1500, 160
    q, k = torch.randn(B, HI, DI, generator=g), torch.randn(B, S, DI, generator=g)
    w = -(0.5 + torch.rand(B, HI, generator=g))
    w[:, 0] = 0.3  # one positive head: a few positive scores, the threshold deep among the negative ones
    pos = torch.tensor([S - 1, 1200, 700])
    got, n_cand = itd.indexer_topk_decode(q, w, k, pos, K, sink=2, window=4, chunk=256, candidates=True)
    ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=2, window=4)
    sc = indexer_scores_naive(q[:, None].double(), w[:, None].double(), k.double(), q_offset=S - 1)[:, 0]
    assert float(sc[0].topk(K).values[-1]) < 0  # the case at issue (the former bins: ~1490 candidates a row)
    assert torch.equal(_score_values(sc[:, None], got[:, None]), _score_values(sc[:, None], ref[:, None]))
    assert int(n_cand.max()) <= S // 16, n_cand  # about 1-2% of a row's keys near the threshold


def test_sampled_topk_equals_reference_on_both_paths_and_the_fallback():
    """The sampled-threshold top-k (`sampled_topk.py`) gives the reference's rows: short rows (in
    registers), long rows through the sample and the candidate buffer, and with the sample's rate
    forced far too low (fewer than k candidates) or too high (buffer overflow) the radix fallback."""
    from sparse_rl.sparse.ops.indexer_topk.naive import select_topk
    from sparse_rl.sparse.ops.indexer_topk.sampled_topk import sampled_topk

    g = torch.Generator().manual_seed(3)
    Tc, Sc, K = 6, 150, 20  # CAP 64 on CPU: rows of > 64 visible columns are sampled
    s = torch.randn(1, Tc, Sc, generator=g)
    s[0, 0, :5] = float("inf")  # forced keys
    s[0, :, 30:40] = 0.25  # exact ties straddling the threshold
    s[0, 1, 12:] = float("-inf")  # fewer than K visible
    s[0, 2] = torch.where(torch.rand(Sc, generator=g) < 0.5, -0.0, 0.0)  # signed zeros: one tie
    s[0, 3, :] = s[0, 3, :].round()  # masses of equal scores
    s[0, 4, 100:] = float("-inf")
    s[0, 4, :100:3] = float("-inf")
    fin = s > float("-inf")
    ref = select_topk(s, fin, fin & (s == float("inf")), K)
    for rate16, path in ((24, 1), (1, 2), (4000, 3)):
        stats = torch.full((Tc, 2), -1, dtype=torch.int32)
        assert torch.equal(sampled_topk(s, K, rate16=rate16, stats=stats), ref), rate16
        # the per-row path counter: row 5 (150 random scores) takes the buffer at the default rate and the
        # radix fallback when the rate is forced too low / too high; every row's count agrees with its path
        # (path 1 may hold < k where the threshold is -inf: every visible score is a candidate)
        assert int(stats[5, 0]) == path, (rate16, stats.tolist())
        for code, cnt in stats.tolist():
            assert {1: cnt <= 64, 2: cnt < K, 3: cnt > 64}[code], (rate16, stats.tolist())
    stats = torch.full((Tc, 2), -1, dtype=torch.int32)
    sampled_topk(s, K, q_lim=0, stats=stats)  # query t sees t + 1 columns: all rows fit the registers
    assert stats.tolist() == [[0, t + 1] for t in range(Tc)]


def test_radix_topk_signed_zeros_tie():
    """-0.0 and +0.0 are equal scores: the reference's sort ties them (the later key wins), so the
    kernel's order-preserving keys must not order them by their bit patterns."""
    from sparse_rl.sparse.ops.indexer_topk.naive import select_topk

    g = torch.Generator().manual_seed(5)
    s = torch.randn(2, 3, 120, generator=g)
    zeros = torch.rand(2, 3, 120, generator=g) < 0.4
    signs = torch.where(torch.rand(2, 3, 120, generator=g) < 0.5, -1.0, 1.0)
    s = torch.where(zeros, signs * 0.0, -s.abs())  # the top scores are the zeros, half of them -0.0
    assert bool((torch.signbit(s) & (s == 0)).any()) and bool((~torch.signbit(s) & (s == 0)).any())
    fin = torch.ones_like(s, dtype=torch.bool)
    for K in (10, 30):
        assert torch.equal(radix_topk(s, K), select_topk(s, fin, fin & False, K))


def test_indexer_topk_decode_random_scores_match_reference_values():
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive

    g = torch.Generator().manual_seed(7)
    B, HI, DI, S, K = 4, 4, 32, 300, 48
    q, w, k = torch.randn(B, HI, DI, generator=g), torch.randn(B, HI, generator=g), torch.randn(B, S, DI, generator=g)
    pos = torch.tensor([299, 10, 150, 47])
    got = itd.indexer_topk_decode(q, w, k, pos, K, sink=3, window=5)
    ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=3, window=5)
    sc = indexer_scores_naive(q[:, None].double(), w[:, None].double(), k.double(), q_offset=0)[:, 0]
    s = torch.arange(S)[None]
    vis = s <= pos[:, None]
    sc = torch.where(vis, sc, float("-inf")).masked_fill(vis & ((s < 3) | (s > pos[:, None] - 5)), float("inf"))
    assert torch.equal(_score_values(sc[:, None], got[:, None]), _score_values(sc[:, None], ref[:, None]))
    rows = got.clone()
    rows[rows < 0] = torch.iinfo(torch.int32).max
    assert torch.equal(rows, rows.sort(-1).values)


@pytest.mark.parametrize("bs,kb,sink_b,recent_b,H,H_kv,D", [
    (4, 3, 1, 1, 4, 4, 64), (5, 4, 1, 2, 8, 2, 128), (3, 50, 1, 2, 7, 1, 64), (16, 3, 1, 2, 4, 2, 16),
])
def test_block_select_matches_reference(bs, kb, sink_b, recent_b, H, H_kv, D):
    g = torch.Generator().manual_seed(bs * kb)
    B, T, S = 2, 29, 41
    q = torch.randn(B, H, T, D, generator=g).transpose(1, 2)
    k = torch.randn(B, S, H_kv, D, generator=g)
    kvs = torch.tensor([0, 7])
    kw = dict(q_offset=S - T, sink_blocks=sink_b, recent_blocks=recent_b, kv_start=kvs)
    got = block_select(q, k, bs, kb, backend="triton", **kw)
    ref = block_select_naive(q, k, bs, kb, **kw)
    assert torch.equal(got, ref)


def test_model_sparse_full_topk_equals_dense_with_triton_backend(tmp_path):
    """The model-level contract with the kernels: a sparse model with k >= L is the dense model."""
    from sparse_rl.modelinit import ModelInitConfig, init_model
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.convert import ConvertConfig, convert
    from sparse_rl.sparse.loader import load_model, set_attention

    L = 13
    init_model(tmp_path / "dense", ModelInitConfig(arch="llama", size="tiny", seed=1))
    sc = SparseConfig(topk=L + 3, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
    convert(tmp_path / "dense", tmp_path / "sparse", ConvertConfig(sparse=sc, seed=3))
    model = load_model(tmp_path / "sparse", attention="sparse")
    set_attention(model, "sparse", backend="triton")
    ids = torch.randint(5, 500, (2, L), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with mock.patch.object(sa, "_fwd", wraps=sa._fwd) as spy, torch.no_grad():
        sparse = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        assert spy.call_count > 0  # the kernel ran
    set_attention(model, "dense")
    with torch.no_grad():
        dense = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    valid = mask.bool()
    torch.testing.assert_close(sparse[valid], dense[valid], atol=1e-4, rtol=1e-4)


def test_cli_bench_attention_and_decode_write_json_and_table(tmp_path):
    from typer.testing import CliRunner

    from sparse_rl.cli.main import app

    small = ["--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--index-topk", "8", "--index-heads", "1",
             "--index-dim", "16", "--device", "cpu"]
    out = tmp_path / "att.json"
    res = CliRunner().invoke(app, ["bench", "attention", "--seqlens", "24", "--backward-seqlens", "24",
                                   "--out", str(out), *small])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    row = data["rows"][0]
    assert row["seqlen"] == 24 and row["sparse_attn_ms"] > 0 and row["sparse_fwdbwd_ms"] > 0
    assert row["indexer_rowmax_ms"] > 0 and row["indexer_topk_over_scores"] > 0
    assert "| 24 |" in res.stdout and data["markdown"].startswith("### Sparse prefill")
    out = tmp_path / "dec.json"
    res = CliRunner().invoke(app, ["bench", "decode", "--contexts", "40", "--batch", "2", "--dtype", "float32", "--out", str(out),
                                   *small])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["rows"][0]["context"] == 40 and data["checks"][0]["out_rel_err"] < 1e-5
    res = CliRunner().invoke(app, ["bench", "attention", "--seqlens", "12,x", *small])
    assert res.exit_code == 2 and "--seqlens" in res.output


def test_scale_argument_is_used():
    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(1, 4, 2, 16, generator=g), torch.randn(1, 6, 2, 16, generator=g), torch.randn(1, 6, 2, 16, generator=g)
    idx = _indices(1, 4, 6, 6, g, drop=0.0)
    out, lse = sparse_attention(q, k, v, idx, scale=0.3, backend="triton")
    ref, rl = sparse_attention_naive(q, k, v, idx, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not math.isclose(0.3, 1 / math.sqrt(16))


@pytest.mark.parametrize("H,H_kv,D,T", [(8, 2, 64, 37), (7, 1, 32, 19), (3, 3, 16, 41)])
def test_tile_path_builds_the_tile_union_and_matches_reference(H, H_kv, D, T):
    from sparse_rl.sparse.ops.sparse_attention import union

    g = torch.Generator().manual_seed(T)
    B, S, K = 2, 53, 20
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, S, H_kv, D, generator=g), torch.randn(B, S, H_kv, D, generator=g)
    idx = _indices(B, T, S, K, g)
    BT = union.tile_queries(H // H_kv)
    sel = union.build_union(idx, S, BT)
    for b in range(B):
        for tile in range(-(-T // BT)):
            rows = idx[b, tile * BT:(tile + 1) * BT]
            want = sorted(set(rows[rows >= 0].tolist()))
            got = sel.ukey[b, tile, :int(sel.ulen[b, tile])].tolist()
            assert got == want
            for j, key in enumerate(got):
                m = int(sel.qmask[b, tile, j]) & 0xFFFFFFFF
                assert m == sum(1 << i for i in range(rows.shape[0]) if key in rows[i].tolist())
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    with mock.patch.object(sa, "_fwd", wraps=sa._fwd) as spy, mock.patch.object(sa, "_bwd_kernel") as atomic:
        out, lse = sparse_attention(qs, ks, vs, idx, backend="triton", fwd_path="tile", bwd_path="tile")
        assert spy.call_count == 0  # the per-query kernel did not run
        qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
        ref, rl = sparse_attention_naive(qr, kr, vr, idx)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        fin = torch.isfinite(rl)
        assert torch.equal(fin, torch.isfinite(lse))
        torch.testing.assert_close(lse[fin], rl[fin], atol=1e-5, rtol=1e-5)
        # the tile backward (dq per tile, dk/dv key-major, no atomics), with an lse gradient too
        go = torch.randn(out.shape, generator=g)
        gl = torch.randn(lse.shape, generator=g).masked_fill(~fin, 0)
        ((out * go).sum() + (lse.masked_fill(~fin, 0) * gl).sum()).backward()
        assert atomic.call_count == 0  # the per-query (atomic) backward did not run
    ((ref * go).sum() + (rl.masked_fill(~fin, 0) * gl).sum()).backward()
    for a, b in ((qs, qr), (ks, kr), (vs, vr)):
        assert _rel(a.grad, b.grad) < 1e-5


@pytest.mark.parametrize("fwd_path,bwd_path", [("query", "tile"), ("tile", "atomic")])
def test_mixed_paths_match_reference(fwd_path, bwd_path):
    """Each forward with the other backward (the tile backward then builds the union itself, and its
    dq comes from the per-query kernel without atomics)."""
    g = torch.Generator().manual_seed(3)
    B, T, S, H, H_kv, D, K = 1, 23, 29, 8, 2, 16, 11
    q, k, v = (torch.randn(B, n, h, D, generator=g).requires_grad_() for n, h in ((T, H), (S, H_kv), (S, H_kv)))
    idx = _indices(B, T, S, K, g)
    out, _ = sparse_attention(q, k, v, idx, backend="triton", fwd_path=fwd_path, bwd_path=bwd_path)
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref, _ = sparse_attention_naive(qr, kr, vr, idx)
    go = torch.randn(out.shape, generator=g)
    (out * go).sum().backward()
    (ref * go).sum().backward()
    assert _rel(out, ref) < 1e-5
    for a, b in ((q, qr), (k, kr), (v, vr)):
        assert _rel(a.grad, b.grad) < 1e-5


def shared_rows_case(H, H_kv, group, T, left):
    """q [2, T, H, 16], k/v [2, T + 9, H_kv, 16] and a shared selection [2, ceil(T / group), 24] (-1 =
    empty slot) of random rows: a group selects only keys its last query sees (q_offset 9), and
    batch row 1 is left-padded by `left` keys that no selection names. Returns (gen, q, k, v, sh, q_off)."""
    g = torch.Generator().manual_seed(group * T)
    B, D, K, q_off = 2, 16, 24, 9
    S = T + q_off
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, S, H_kv, D, generator=g), torch.randn(B, S, H_kv, D, generator=g)
    NG = -(-T // group)
    sh = torch.rand(B, NG, S, generator=g)
    last = (torch.arange(NG) * group + group - 1).clamp(max=T - 1) + q_off
    sh = sh.masked_fill(torch.arange(S) > last[:, None], -1.0)
    sh[1, :, :left] = -1.0
    vals, sh = sh.topk(min(K, S), -1)
    return g, q, k, v, torch.where(vals >= 0, sh, -1).to(torch.int32), q_off


@pytest.mark.parametrize("H,H_kv,group,T,left", [(8, 2, 8, 37, 0), (7, 1, 16, 40, 5), (3, 3, 4, 13, 3), (4, 1, 3, 17, 2)])
def test_shared_selection_matches_per_query_reference(H, H_kv, group, T, left):
    """A selection shared by `group` consecutive queries `[B, ceil(T/group), K]`: the tile kernels read
    it directly (no union build), mask causality themselves, and match the reference on the per-query
    selection it means; keys are shifted by q_offset (prefix) and a left-padded row selects no pad keys.
    group 3 is not a multiple of a tile: it is expanded to the per-query selection."""
    from sparse_rl.sparse.ops import shared_to_per_query
    from sparse_rl.sparse.ops.sparse_attention import union

    g, q, k, v, sh, q_off = shared_rows_case(H, H_kv, group, T, left)
    per = shared_to_per_query(sh, group, T, q_off)
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    with mock.patch.object(union, "build_union", wraps=union.build_union) as built:
        out, lse = sparse_attention(qs, ks, vs, sh, query_group=group, q_offset=q_off, backend="triton")
        go = torch.randn(out.shape, generator=g)
        (out * go).sum().backward()
        if group != 3:
            assert built.call_count == 0
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref, rl = sparse_attention_naive(qr, kr, vr, per)
    (ref * go).sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    fin = torch.isfinite(rl)
    torch.testing.assert_close(lse[fin], rl[fin], atol=1e-5, rtol=1e-5)
    for a, b in ((qs, qr), (ks, kr), (vs, vr)):
        assert _rel(a.grad, b.grad) < 1e-5
    # the public op's reference backend takes the same shared selection
    out2, _ = sparse_attention(q, k, v, sh, query_group=group, q_offset=q_off, backend="torch")
    torch.testing.assert_close(out2, ref.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fwd_path,bwd_path", [("query", "atomic"), ("tile", "tile")])
def test_full_selection_equals_dense_on_both_paths(fwd_path, bwd_path):
    """k >= L still equals dense causal attention, gradients included, on each path."""
    from sparse_rl.sparse.ops import dense_attention_naive, visible_mask

    g = torch.Generator().manual_seed(8)
    B, T, H, H_kv, D = 1, 35, 8, 2, 16
    q, k, v = (torch.randn(B, T, h, D, generator=g, dtype=torch.float64).float().requires_grad_()
               for h in (H, H_kv, H_kv))
    idx = torch.arange(T + 4).expand(T, T + 4).clone()
    idx = torch.where(idx <= torch.arange(T)[:, None], idx, -1)[None].to(torch.int32)  # K = T + 4 > L
    out, _ = sparse_attention(q, k, v, idx, backend="triton", fwd_path=fwd_path, bwd_path=bwd_path)
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref, _ = dense_attention_naive(qr, kr, vr, visible_mask(B, T, T))
    go = torch.randn(out.shape, generator=g)
    (out * go).sum().backward()
    (ref * go).sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in ((q, qr), (k, kr), (v, vr)):
        assert _rel(a.grad, b.grad) < 1e-5


def test_bad_paths_and_shapes_are_one_line_errors():
    q, k = torch.randn(1, 5, 2, 16), torch.randn(1, 9, 1, 16)
    idx = torch.zeros(1, 5, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="fwd_path"):
        sa.sparse_attention(q, k, k, idx, fwd_path="fast")
    with pytest.raises(ValueError, match="query_group 2"):
        sa.sparse_attention(q, k, k, idx, query_group=2)


def test_auto_plan_prefers_tiles_when_neighbours_share_keys():
    """The cheap estimate (paths.plan) on a block selection picks the tile paths; on independent
    random selections at long range it keeps the per-query forward."""
    from sparse_rl.sparse.ops.sparse_attention import paths

    T, K = 512, 64
    t = torch.arange(T)[:, None]
    block = (t // 64) * 64 - torch.arange(K)[None]  # each 64-query block shares its 64 previous keys
    block = torch.where(block >= 0, block, -1)[None].to(torch.int32)
    p = paths.plan(block, T, 8, 32, is_cuda=True)
    assert (p.fwd, p.bwd, p.dq) == ("tile", "tile", "tile") and p.estimate_ms["tile_fwd"] < p.estimate_ms["query_fwd"]
    g = torch.Generator().manual_seed(0)
    S = 1 << 15
    rnd = torch.rand(1, T, S, generator=g).topk(K, -1).indices.to(torch.int32)  # independent, far apart
    assert paths.plan(rnd, S, 8, 32, is_cuda=True).fwd == "query"


@pytest.mark.parametrize("path", ["query", "tile"])
def test_out_of_range_indices_are_ignored_not_read(path):
    g = torch.Generator().manual_seed(11)
    B, T, S, H, H_kv, D, K = 1, 40, 30, 4, 1, 16, 12
    q = torch.randn(B, T, H, D, generator=g, requires_grad=True)
    k = torch.randn(B, S, H_kv, D, generator=g, requires_grad=True)
    v = torch.randn(B, S, H_kv, D, generator=g, requires_grad=True)
    idx = _indices(B, T, S, K, g, drop=0.0)
    bad = idx.clone()
    bad[:, ::3, 0] = S + 1000  # outside the contract: must behave like -1, not read/write out of bounds
    clean = torch.where(bad >= S, -1, bad)
    bwd = "atomic" if path == "query" else "tile"
    out, _ = sparse_attention(q, k, v, bad, backend="triton", fwd_path=path, bwd_path=bwd)
    out.sum().backward()
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref, _ = sparse_attention_naive(qr, kr, vr, clean)
    ref.sum().backward()
    torch.testing.assert_close(out.detach(), ref.detach(), atol=1e-5, rtol=1e-5)
    for a, b in ((q, qr), (k, kr), (v, vr)):
        assert _rel(a.grad, b.grad) < 1e-5


@pytest.mark.parametrize("HI,DI,rope_dim,affine,dtype", [
    (3, 20, 8, True, torch.float32),  # odd head count and dim
    (4, 64, 32, True, torch.float32),
    (5, 16, 0, False, torch.float32),  # no RoPE, LayerNorm without weight/bias
    (4, 64, 32, True, torch.bfloat16),
])
def test_indexer_decode_kernel_equals_module(HI, DI, rope_dim, affine, dtype):
    """`ops.indexer_decode` (reference and Triton) against `LightningIndexer.forward` for one token per
    row: q_I and w returned, k_I written into the cache (a strided view) at each row's position only."""
    from sparse_rl.sparse.indexer import LightningIndexer
    from sparse_rl.sparse.ops import indexer_decode

    g = torch.Generator().manual_seed(HI * DI + rope_dim)
    B, hidden, Dh, S = 5, 48, 64, 40
    torch.manual_seed(HI * DI + rope_dim)  # the module's init: the same weights whichever tests ran before
    ix = LightningIndexer(hidden, HI, DI, rope_dim)
    if not affine:
        ix.k_norm = torch.nn.LayerNorm(DI, elementwise_affine=False)
    else:
        with torch.no_grad():
            ix.k_norm.weight.normal_(generator=g)
            ix.k_norm.bias.normal_(generator=g)
    ix = ix.to(dtype)
    h = torch.randn(B, 1, hidden, generator=g).to(dtype)
    ang = torch.rand(B, 1, Dh // 2, generator=g) * 10
    cos, sin = (torch.cat([f, f], -1).to(dtype) for f in (ang.cos(), ang.sin()))
    with torch.no_grad():
        q0, w0, k0 = ix(h, cos, sin)
        pos = torch.tensor([39, 0, 17, 17, 5])
        z = (ix.wq(h[:, 0]), ix.wk(h[:, 0]), ix.ww(h[:, 0]))
        for backend in ("torch", "triton"):
            big = torch.full((B, S + 3, DI + 5), 7.0, dtype=dtype)
            cache = big[:, :S, :DI]
            q, w = indexer_decode(*z, cos[:, 0], sin[:, 0], ix.k_norm.weight, ix.k_norm.bias, ix.k_norm.eps,
                                  rope_dim, pos, cache, backend=backend)
            # the reference is the module's own arithmetic: exact in fp32; the kernel rounds once (fp32:
            # 1e-5). In bf16 the module rounds after every op of its LayerNorm and RoPE while the kernel
            # rounds once: up to 1.3% of (1 + |k|) apart over 40 init seeds, so 2% + 2% here
            if dtype == torch.bfloat16:
                t = dict(rtol=2e-2, atol=2e-2)
            else:
                t = dict(rtol=0, atol=0) if backend == "torch" else dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(q, q0[:, 0], **t)
            torch.testing.assert_close(w, w0[:, 0], **t)
            torch.testing.assert_close(cache[torch.arange(B), pos], k0[:, 0], **t)
            written = torch.zeros(B, S + 3, DI + 5, dtype=torch.bool)
            written[torch.arange(B), pos, :DI] = True
            assert bool((big[~written] == 7.0).all())  # nothing else touched
