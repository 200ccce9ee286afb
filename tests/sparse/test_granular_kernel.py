"""The granular selection kernel (ops/indexer_topk/granular.py, run through TRITON_INTERPRET=1) against
the reference rule `granular_topk_naive`, exactly (ties included), and the shared-rows attention that
`layer.select_rows` routes query groups to."""

import pytest
import torch

from sparse_rl.sparse.config import SparseConfig
from sparse_rl.sparse.layer import LayerState, attend, select, select_rows
from sparse_rl.sparse.ops import granular_topk, shared_rows_ok
from sparse_rl.sparse.ops.indexer_topk import granular
from sparse_rl.sparse.ops.indexer_topk.naive import granular_topk_naive
from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive


def _ints(*shape, g):
    # small integers: every score is exact in fp32 whatever the summation order, and ties (zeros
    # from the ReLU, -0.0 from negative weights) are everywhere, so the tie rule is exercised
    return torch.randint(-2, 3, shape, generator=g).float()


def _index(B=2, T=29, H=3, D=16, seed=0, exact=True):
    g = torch.Generator().manual_seed(seed)
    make = (lambda *s: _ints(*s, g=g)) if exact else (lambda *s: torch.randn(*s, generator=g))
    return make(B, T, H, D), make(B, T, H), make(B, T, D)


CASES = [(1, 1, 16, 2, 3, "max"), (4, 1, 16, 2, 3, "mean"), (1, 4, 16, 2, 3, "max"), (4, 4, 20, 1, 2, "mean"),
         (2, 8, 24, 0, 0, "max"), (16, 1, 36, 2, 3, "mean"), (1, 16, 24, 2, 3, "mean"), (64, 1, 70, 1, 1, "max"),
         (8, 2, 12, 4, 4, "mean"), (4, 4, 20, 1, 2, "max")]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_equals_reference_exactly(case):
    """Odd sizes, left padding, an incremental chunk with history, shared rows; integer scores (exact
    ties); the block top-k forms take turns over the cases (all of them: the float test below)."""
    kb, G, topk, sink, window, score = CASES[case]
    impl = ("keys", "threshold", "radix", "sampled", "bin")[case % 5]
    q, w, k = _index(seed=kb * 7 + G)
    kw = dict(sink=sink, window=window, key_block=kb, query_group=G, block_score=score)
    for ks in (None, torch.tensor([0, 5])):
        ref = granular_topk_naive(q, w, k, topk, kv_start=ks, **kw)
        assert torch.equal(granular_topk(q, w, k, topk, kv_start=ks, backend="triton", topk_impl=impl, **kw), ref)
    off = 16
    hist = (q[:, :off], w[:, :off])
    ref = granular_topk_naive(q[:, off:], w[:, off:], k, topk, q_offset=off, history=hist, **kw)
    assert torch.equal(granular_topk(q[:, off:], w[:, off:], k, topk, q_offset=off, history=hist, backend="triton",
                                     topk_impl=impl, **kw), ref)
    # a chunk at q_offset (a multiple of G) without history: the arithmetic-rows path (no group_plan tensors)
    ref = granular_topk_naive(q[:, off:], w[:, off:], k, topk, q_offset=off, **kw)
    assert torch.equal(granular.granular_topk(q[:, off:], w[:, off:], k, topk, q_offset=off, budget=2048,
                                              topk_impl=impl, **kw), ref)
    if G > 1:  # one row per group, in row chunks smaller than the rows (budget in bytes)
        ref = granular_topk_naive(q, w, k, topk, shared=True, **kw)
        assert ref.shape[1] == -(-q.shape[1] // G)
        assert torch.equal(granular.granular_topk(q, w, k, topk, shared=True, budget=4096, topk_impl=impl, **kw), ref)


@pytest.mark.parametrize("kb,G", [(4, 1), (1, 4), (16, 4)])
def test_kernel_equals_reference_on_random_floats(kb, G):
    q, w, k = _index(B=2, T=41, H=4, D=32, seed=3, exact=False)
    kw = dict(sink=1, window=2, key_block=kb, query_group=G, block_score="mean", kv_start=torch.tensor([4, 0]))
    ref = granular_topk_naive(q, w, k, 24, **kw)
    for impl in ("auto", "threshold") if kb > 1 else granular.TOPK_IMPLS:
        assert torch.equal(granular_topk(q, w, k, 24, backend="triton", topk_impl=impl, **kw), ref), impl
    with pytest.raises(ValueError, match="topk_impl"):
        granular_topk(q, w, k, 24, backend="triton", topk_impl="sort", **kw)


def test_shared_rows_need_aligned_groups():
    assert shared_rows_ok(None, 32, 16) and not shared_rows_ok(None, 8, 16)
    assert not shared_rows_ok(torch.tensor([0, 3]), 0, 4) and not shared_rows_ok(None, 0, 1)
    q, w, k = _index()
    with pytest.raises(ValueError, match="multiple of query_group"):
        granular_topk(q[:, 3:], w[:, 3:], k, 16, q_offset=3, query_group=4, shared=True,
                      history=(q[:, :3], w[:, :3]))


def _layer(kb, G, backend="triton"):
    cfg = SparseConfig(topk=16, sink=1, window=2, key_block=kb, query_group=G, index_heads=3, index_dim=16)
    return LayerState(cfg=cfg, dense_layer=False, mode="sparse", backend=backend)


@pytest.mark.parametrize("kb,G,H,H_kv", [(1, 4, 4, 1), (4, 8, 7, 1), (4, 4, 2, 2)])
def test_select_rows_attention_forward_and_gradients_match_reference(kb, G, H, H_kv):
    """`select_rows` gives query groups one row per group and `attend` runs the shared-rows attention;
    outputs and q/k/v gradients equal the reference over the per-query rows of `select`."""
    g = torch.Generator().manual_seed(H * 10 + G)
    B, T, D = 2, 21, 16
    qi, w, ki = _index(B=B, T=T, seed=G + kb)
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, T, H_kv, D, generator=g), torch.randn(B, T, H_kv, D, generator=g)
    st = _layer(kb, G)
    sel = select_rows(st, q, k, (qi, w, ki))
    assert sel.query_group == (G if G > 1 else 1)
    assert sel.indices.shape[1] == -(-T // sel.query_group)
    per = select(st, q, k, (qi, w, ki))
    assert torch.equal(sel.per_query(T), per)
    assert torch.equal(per, select(_layer(kb, G, "torch"), q, k, (qi, w, ki)))
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    out, _ = attend(st, sel, qs, ks, vs)
    go = torch.randn(out.shape, generator=g)
    (out * go).sum().backward()
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref, _ = sparse_attention_naive(qr, kr, vr, per)
    (ref * go).sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in ((qs, qr), (ks, kr), (vs, vr)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)


def test_select_rows_left_padding_falls_back_to_per_query_rows():
    qi, w, ki = _index()
    st = _layer(4, 4)
    ks = torch.tensor([0, 5])
    sel = select_rows(st, None, None, (qi, w, ki), kv_start=ks)
    assert sel.query_group == 1
    assert torch.equal(sel.indices, select(st, None, None, (qi, w, ki), kv_start=ks))


@pytest.mark.parametrize("kb,G,score", [(4, 1, "max"), (4, 4, "mean"), (16, 2, "max")])
def test_decode_kernel_equals_reference(kb, G, score):
    """The decode form (one row per batch row at its own position, left padding) equals the reference's
    decode rows and the sequence's rows; `select` takes it on the Triton backend."""
    from sparse_rl.sparse.ops import granular_topk_decode
    from sparse_rl.sparse.ops.indexer_topk.naive import granular_topk_decode_naive, group_start

    q, w, k = _index(B=2, T=29, seed=kb + G)
    ks = torch.tensor([0, 3])
    kw = dict(sink=1, window=2, key_block=kb, query_group=G, block_score=score, kv_start=ks)
    rows = granular_topk_naive(q, w, k, 24, **kw)
    for t in (17, 22, 28):
        pos = torch.tensor([t, t - 1])
        rep = group_start(pos, ks, G)
        qr, wr = q[torch.arange(2), rep], w[torch.arange(2), rep]
        got = granular_topk_decode(qr, wr, k[:, :t + 1], pos, 24, backend="triton", **kw)
        assert torch.equal(got, granular_topk_decode_naive(qr, wr, k[:, :t + 1], pos, 24, **kw))
        assert torch.equal(got, rows[torch.arange(2), pos])
    if G != 4:
        return
    st = _layer(kb, G)
    seq = select(st, None, None, (q[:1], w[:1], k[:1]))
    group = (torch.zeros(1, 3, 16), torch.zeros(1, 3))
    for t in range(q.shape[1]):
        got = select(st, None, None, (q[:1, t], w[:1, t], k[:1]), pos=torch.tensor([t]), S=t + 1, group=group)
        assert torch.equal(got, seq[:, t]), t


def test_assemble_kernel_equals_torch_assembly():
    """The per-row Triton assembly against the torch one on random chosen blocks (non-candidate blocks,
    blocks cut by the sink and the window, short rows, left padding)."""
    g = torch.Generator().manual_seed(0)
    for kb, G, sink, window, topk in [(1, 1, 0, 0, 16), (4, 1, 2, 5, 37), (16, 4, 3, 7, 70), (1, 8, 1, 3, 41)]:
        B, N, S = 2, 7, 200
        nb = (topk - (G - 1) - sink - window) // kb
        start = torch.tensor([[0], [13]])
        rep = torch.randint(0, S - 30, (B, N), generator=g) + start
        pos = rep + torch.randint(0, G, (B, N), generator=g)
        blocks = torch.full((B, N, nb), -1, dtype=torch.long)
        for b in range(B):
            for n in range(N):
                m = int(torch.randint(0, nb + 1, (1,), generator=g))
                blocks[b, n, :m] = torch.randperm(-(-S // kb), generator=g)[:m].sort().values
        kw = dict(key_block=kb, query_group=G, sink=sink, window=window)
        ref = granular.assemble_rows(blocks, pos, rep, start, topk, **kw)
        assert torch.equal(granular.assemble_rows_triton(blocks.int(), pos, rep, start, topk, **kw), ref), kw


def test_shared_tiles_bitmap_only_when_a_backward_can_follow():
    from sparse_rl.sparse.ops.sparse_attention import union

    rows = torch.tensor([[[0, 2, 5, -1], [1, 3, 6, 7]]], dtype=torch.int32)
    lazy = union.shared_tiles(rows, 9, 4, 4, bits=False)
    assert lazy.bits is None and lazy.tensors() == [rows]
    assert torch.equal(union.with_bits(lazy, 9).bits, union.shared_tiles(rows, 9, 4, 4).bits)


def test_attend_takes_the_block_kernels_for_key_block_groups():
    """key_block 16 with query_group 16: `select_rows` says the rows are key blocks (Selection.key_block) and
    `attend` runs the block kernels (ops/sparse_attention/blocks.py), equal to the reference over `select`."""
    from unittest import mock

    from sparse_rl.sparse.ops.sparse_attention import blocks

    g = torch.Generator().manual_seed(5)
    B, T, H, H_kv, D = 1, 61, 4, 1, 16
    qi, w, ki = _index(B=B, T=T, seed=16)
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, T, H_kv, D, generator=g), torch.randn(B, T, H_kv, D, generator=g)
    cfg = SparseConfig(topk=48, sink=1, window=2, key_block=16, query_group=16, index_heads=3, index_dim=16)
    st = LayerState(cfg=cfg, dense_layer=False, mode="sparse", backend="triton")
    sel = select_rows(st, q, k, (qi, w, ki))
    assert (sel.query_group, sel.key_block) == (16, 16)
    with mock.patch.object(blocks, "block_fwd", wraps=blocks.block_fwd) as bf:
        out, _ = attend(st, sel, q, k, v)
    assert bf.call_count == 1
    ref, _ = sparse_attention_naive(q, k, v, select(st, q, k, (qi, w, ki)))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
