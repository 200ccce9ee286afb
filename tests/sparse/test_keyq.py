"""dk/dv over each key tile's compacted query list (`bwd_path="keyq"`, ops/sparse_attention/keyq.py), through
TRITON_INTERPRET=1 against the PyTorch reference: odd sizes, GQA 1/4/7, left padding (shared rows expanded),
-1 holes and out-of-range keys, an empty row, an lse gradient; and the lists against a direct reading of the
index rows."""

import pytest
import torch

from sparse_rl.sparse.ops import shared_to_per_query
from sparse_rl.sparse.ops.sparse_attention import keyq
from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive
from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention

from .test_kernels import shared_rows_case
from .test_keymajor import _rel


def _grads(q, k, v, rows, per, **kw):
    g = torch.Generator().manual_seed(11)
    go, gl = torch.randn(q.shape, generator=g), torch.randn(q.shape[:3], generator=g)
    res = []
    for fn in (lambda a, b, c: sparse_attention(a, b, c, rows, **kw), lambda a, b, c: sparse_attention_naive(a, b, c, per)):
        qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
        o, lse = fn(qs, ks, vs)
        fin = torch.isfinite(lse)
        ((o * go).sum() + (lse.masked_fill(~fin, 0) * gl.masked_fill(~fin, 0)).sum()).backward()
        res.append((o, lse, qs.grad, ks.grad, vs.grad))
    return res


def _random_rows(B, T, S, K, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(B, T, S, generator=g).argsort(-1)[..., :K].to(torch.int32)
    idx[torch.rand(B, T, K, generator=g) < 0.3] = -1
    idx[0, 5] = -1  # an empty row: lse -inf, no list entry
    idx[-1, 3, 0] = S + 4  # out of range: dropped like -1, as the reference does
    return idx


@pytest.mark.parametrize("H,H_kv,T,S,tune,fwd", [
    (8, 2, 40, 75, (32, 64, 4, 1), "tile"),  # G 4, 16 queries a chunk
    (7, 1, 37, 70, (16, 128, 4, 1), "tile"),  # G 7: 18 queries a 128-row chunk, 126 live rows
    (3, 3, 29, 66, (64, 16, 4, 1), "query"),  # G 1, 64-bit masks, dq from the per-query kernel
    (8, 2, 33, 130, (64, 32, 4, 1), "tile"),  # BN 64 over 130 keys: a partial last key tile
])
def test_keyq_grads_match_reference(H, H_kv, T, S, tune, fwd):
    g = torch.Generator().manual_seed(T)
    B, D, K = 2, 16, 20
    q, k, v = (torch.randn(B, n, h, D, generator=g) for n, h in ((T, H), (S, H_kv), (S, H_kv)))
    idx = _random_rows(B, T, S, K, T)
    got, ref = _grads(q, k, v, idx, idx, fwd_path=fwd, bwd_path="keyq", tune={"keyq": tune})
    fin = torch.isfinite(ref[1])
    torch.testing.assert_close(got[1][fin], ref[1][fin], atol=1e-5, rtol=1e-5)
    for a, b in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("H,H_kv,group,T,left", [(8, 2, 8, 27, 0), (7, 1, 16, 40, 5)])
def test_keyq_on_shared_rows_with_left_padding(H, H_kv, group, T, left):
    """Shared rows (q_offset 9, row 1 left-padded): "keyq" expands them to per-query rows, dq from the shared tiles."""
    _, q, k, v, sh, q_off = shared_rows_case(H, H_kv, group, T, left)
    per = shared_to_per_query(sh, group, T, q_off)
    got, ref = _grads(q, k, v, sh, per, query_group=group, q_offset=q_off, bwd_path="keyq",
                      tune={"keyq": (32, 32, 4, 1, 128)})
    for a, b in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
        assert _rel(a, b) < 1e-5


def _ascending_rows(B, T, S, K, seed):
    """The top-k's order: ascending keys, -1 padding at the end; holes inside runs of one tile, an out-of-range key,
    K over two of the interpreter's 32-key blocks (runs cut by a block edge), the last bit of a 64-key word."""
    idx = _random_rows(B, T, S, K, seed)
    idx[1, 7] = torch.arange(S - K, S)  # consecutive keys to the last one: whole tiles, bits 31 / 63 set
    idx[1, 8, K // 2:] = -1
    srt = torch.where(idx < 0, S + 100, idx).sort(-1).values
    return torch.where(srt == S + 100, -1, srt).to(torch.int32)


@pytest.mark.parametrize("BN,K,order", [(16, 11, "random"), (32, 11, "random"), (64, 11, "random"),
                                        (16, 75, "ascending"), (64, 75, "ascending")])
def test_key_query_lists_are_the_transposed_selection(BN, K, order):
    """The bits pass adds each run of a row's keys in one tile at the run's ends (`keyq._kq_bits_kernel`): random
    rows make runs of one key, ascending rows (the top-k's order) one run a tile, cut by the interpreter's 32-key
    block edges at K 75; both give the lists read off the rows directly."""
    B, T, S = 2, 45, 140
    idx = (_random_rows if order == "random" else _ascending_rows)(B, T, S, K, BN)
    off, lst, msk = keyq.key_query_lists(idx, S, BN)
    NKT = -(-S // BN)
    n = 0
    for b in range(B):
        for j in range(NKT):
            want_q, want_m = [], []
            for t in range(T):
                keys = [int(s) for s in idx[b, t] if 0 <= s < S and s // BN == j]
                if keys:
                    want_q.append(t)
                    want_m.append(sum(1 << (s - j * BN) for s in keys))
            lo, hi = int(off[b * NKT + j]), int(off[b * NKT + j + 1])
            assert lst[lo:hi].tolist() == want_q
            got_m = [m & ((1 << BN) - 1) for m in msk[lo:hi].tolist()]  # int32 words hold bit 31 as the sign
            assert got_m == want_m
            n += len(want_q)
    assert int(off[-1]) == n


def test_auto_takes_keyq_on_scattered_runs_and_keeps_keymajor_on_blocks():
    """paths.plan: per-query rows of scattered 16-key runs (few of a 32-query tile's queries in each touched key
    tile, as the trained indexer's) -> dk/dv from the query lists; 64-query blocks sharing their keys (every
    query of a touched tile selects the whole tile) -> the key-major pass (keyq's estimate is not below
    KEYQ_MARGIN of it)."""
    from sparse_rl.sparse.ops.sparse_attention import paths

    T = 2048
    t = torch.arange(T)[None, :, None]
    starts = (torch.rand(1, T, 8, generator=torch.Generator().manual_seed(0)) * t).long()
    runs = (starts[..., None] + torch.arange(16)).flatten(2)
    runs = torch.where(runs <= t, runs, -1).to(torch.int32)
    p = paths.plan(runs, T, 8, 32, is_cuda=True)
    assert (p.bwd, p.dq) == ("keyq", "tile")
    assert p.estimate_ms["keyq_dkdv"] < paths.KEYQ_MARGIN * p.estimate_ms["keymajor_dkdv"]
    block = (t[0] // 64) * 64 - torch.arange(64)[None]
    block = torch.where(block >= 0, block, -1)[None, :512].to(torch.int32)
    assert paths.plan(block, 512, 8, 32, is_cuda=True).bwd == "tile"
    assert paths.plan(runs, T, 8, 32, bwd="keyq", is_cuda=False).bwd == "keyq"  # explicit: taken as asked


def test_sample_stats_count_what_they_say_on_a_partial_last_tile():
    """paths.sample_stats on every tile (NT <= SAMPLE_TILES), T not a multiple of the tile: per tile averages of the
    selected pairs, union keys, touched 64-key tiles and (query, 64-key tile) pairs, counted here directly."""
    from sparse_rl.sparse.ops.sparse_attention import paths

    B, T, S, K, BT = 2, 37, 150, 9, 16
    idx = _random_rows(B, T, S, K, 5)
    got = paths.sample_stats(idx, S, BT)
    NT = -(-T // BT)
    pairs = ukeys = touched = kq = 0
    for b in range(B):
        for tile in range(NT):
            rows = [[int(s) for s in idx[b, t] if 0 <= s < S] for t in range(tile * BT, min(T, tile * BT + BT))]
            pairs += sum(len(r) for r in rows)
            keys = {s for r in rows for s in r}
            ukeys += len(keys)
            touched += len({s // 64 for s in keys})
            kq += sum(len({s // 64 for s in r}) for r in rows)
    want = [x / (B * NT) for x in (pairs, ukeys, touched, kq)]
    assert got == pytest.approx(want)


@pytest.mark.parametrize("H,H_kv,T,bt", [(8, 2, 45, 16), (7, 1, 37, 8)])
def test_keyq_with_half_tiles_for_forward_and_dq(H, H_kv, T, bt, monkeypatch):
    """Union tiles of BT/2 queries (tune "bt", what `auto` takes under keyq when their estimate is lower): the
    forward's tiles are kept for the tile dq (keyq's dk/dv reads its own lists), grads == the reference."""
    from sparse_rl.sparse.ops.sparse_attention import union

    seen, tile_dq = [], union.tile_dq
    monkeypatch.setattr(union, "tile_dq", lambda q, k, v, sel, *a, **kw:
                        seen.append(sel.BT) or tile_dq(q, k, v, sel, *a, **kw))
    g = torch.Generator().manual_seed(H + T)
    B, D, K, S = 2, 16, 20, 75
    q, k, v = (torch.randn(B, n, h, D, generator=g) for n, h in ((T, H), (S, H_kv), (S, H_kv)))
    idx = _random_rows(B, T, S, K, T)
    got, ref = _grads(q, k, v, idx, idx, fwd_path="tile", bwd_path="keyq", tune={"keyq": (32, 64, 4, 1), "bt": bt})
    assert seen == [bt]  # the dq pass ran on the forward's tiles, not a rebuild at BT
    fin = torch.isfinite(ref[1])
    torch.testing.assert_close(got[1][fin], ref[1][fin], atol=1e-5, rtol=1e-5)
    for a, b in zip(got[:1] + got[2:], ref[:1] + ref[2:]):
        assert _rel(a, b) < 1e-5


def test_auto_halves_the_tiles_under_keyq_only():
    """paths.plan with a backward (grad): 16 queries sharing their keys but 32 not -> BT/2 tiles for the forward
    and the tile dq when dk/dv is keyq; the key-major dk/dv (bwd "tile") reads BT's tiles, so they stay BT."""
    from sparse_rl.sparse.ops.sparse_attention import paths

    T, S, K = 96, 400, 40
    t = torch.arange(T)[:, None]
    by16 = (torch.arange(K)[None] + (t // 16) * K).clamp(max=S - 1)[None].to(torch.int32)
    p = paths.plan(by16, S, 8, 32, bwd="keyq", is_cuda=True, small_tiles=True, grad=True)
    assert (p.fwd, p.dq, p.bt) == ("tile", "tile", 16)
    assert p.estimate_ms["tile_dq"] == p.estimate_ms["tile_dq_half"]
    assert p.union[0].shape[1] == -(-T // 16)  # the handed-over bitmaps are the 16-query tiles'
    assert paths.plan(by16, S, 8, 32, bwd="tile", is_cuda=True, small_tiles=True, grad=True).bt == 32
    assert paths.plan(by16, S, 8, 32, bwd="keyq", is_cuda=True, small_tiles=False, grad=True).bt == 32


@pytest.mark.parametrize("H,H_kv", [(8, 4), (6, 6)])
def test_keyq_program_order_changes_nothing(H, H_kv):
    """`keyq_dkdv`'s heads_together (its tune's sixth entry): the KV heads interleaved in the program order (all, some, one: key tiles
    fastest) give bitwise the same dk / dv (each program's work is the same, only when it runs changes); a count
    that does not divide the heads is refused."""
    g = torch.Generator().manual_seed(H)
    B, T, S, D, K = 2, 30, 70, 16, 12
    q, k, v = (torch.randn(B, n, h, D, generator=g) for n, h in ((T, H), (S, H_kv), (S, H_kv)))
    idx = _random_rows(B, T, S, K, H)
    o, lse = sparse_attention_naive(q, k, v, idx)
    do = torch.randn(q.shape, generator=g)
    delta = (o * do).sum(-1)
    outs = [keyq.keyq_dkdv(q, k, v, idx, do, lse, delta, D ** -0.5, 0, tune=(32, 32, 4, 1, 0, gh))
            for gh in (None, H_kv // 2 if H_kv % 2 == 0 else H_kv, 1)]
    for dk, dv in outs[1:]:
        assert torch.equal(dk, outs[0][0]) and torch.equal(dv, outs[0][1])
    with pytest.raises(ValueError, match="heads_together"):
        keyq.keyq_dkdv(q, k, v, idx, do, lse, delta, D ** -0.5, 0, tune=(32, 32, 4, 1, 0, 5))


def test_keyq_default_order_pairs_the_kv_heads_where_they_pair():
    """The GPU default runs two KV heads together (session 25's fastest order) where two divide H_kv and all of
    them otherwise (Mistral-like 8, Qwen 2 / 4; an odd count such as 7 or 1); the CPU default is unchanged. With
    H_kv odd, the default tune must run, not raise the divisibility error."""
    assert keyq.default_tune(True, 8)[5] == 2 and keyq.default_tune(True, 2)[5] == 2
    for odd in (1, 7):
        t = keyq.default_tune(True, odd)
        assert len(t) < 6 or t[5] is None
    assert keyq.default_tune(False, 7) == (32, 64, 4, 1)
    g = torch.Generator().manual_seed(3)
    B, T, S, D, K, H, H_kv = 1, 20, 40, 16, 8, 7, 7
    q, k, v = (torch.randn(B, n, h, D, generator=g) for n, h in ((T, H), (S, H_kv), (S, H_kv)))
    idx = _random_rows(B, T, S, K, H)
    o, lse = sparse_attention_naive(q, k, v, idx)
    do = torch.randn(q.shape, generator=g)
    delta = (o * do).sum(-1)
    base = keyq.keyq_dkdv(q, k, v, idx, do, lse, delta, D ** -0.5, 0, tune=(64, 128, 8, 3, 0, 1))
    dflt = keyq.keyq_dkdv(q, k, v, idx, do, lse, delta, D ** -0.5, 0, tune=keyq.default_tune(True, H_kv))
    assert torch.equal(base[0], dflt[0]) and torch.equal(base[1], dflt[1])
