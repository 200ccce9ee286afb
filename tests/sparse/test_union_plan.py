"""`auto`'s full statistics (paths.full_stats: every tile's bitmap and |U|, one host sync, handed to the union
build) against the sampled ones and a plain build, and the tile forward's variants (the lazy rescale, the AND
bit test, the prefetching loop; 16- and 32-query tiles) against the float32 reference and the default kernel, on the CPU
(TRITON_INTERPRET=1, tests/conftest.py), odd sizes."""

import pytest
import torch

from sparse_rl.sparse.ops.sparse_attention import paths, union
from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision


def _clustered(B, T, S, K, g, drop=0.2):
    """Per-query selections that neighbours partly share (a window of K keys around a drifting centre plus
    random keys), -1 holes, out-of-range entries, one empty row: a small stand-in for a trained indexer."""
    t = torch.arange(T)[:, None]
    base = (t * S // T - torch.arange(K // 2)[None]).clamp(min=-1)
    rnd = torch.randint(0, S, (B, T, K - K // 2), generator=g)
    idx = torch.cat([base[None].expand(B, T, K // 2), rnd], -1).to(torch.int32)
    idx[torch.rand(B, T, K, generator=g) < drop] = -1
    idx[:, 1, 0] = S + 3  # out of range: ignored like -1
    idx[0, 5] = -1
    # distinct keys per row (the contract): duplicates -> -1
    srt, order = idx.sort(-1)
    dup = torch.zeros_like(srt, dtype=torch.bool)
    dup[..., 1:] = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    srt[dup] = -1
    return srt.gather(-1, order.argsort(-1))


@pytest.mark.parametrize("T,BT", [(75, 32), (49, 16)])
def test_full_stats_equal_the_sample_when_it_covers_every_tile_and_feed_the_build(T, BT):
    g = torch.Generator().manual_seed(T)
    B, S, K = 2, 70, 24
    idx = _clustered(B, T, S, K, g)
    assert -(-T // BT) <= paths.SAMPLE_TILES and T <= paths.PAIR_ROWS  # the sample is every tile, every row
    sample = paths.sample_stats(idx, S, BT)
    (pairs, ukeys, touched, kq), (bits, ulen, umax) = paths.full_stats(idx, S, BT)
    assert (pairs, ukeys, touched, kq) == pytest.approx(sample, rel=1e-12)
    ref_ulen = union.union_sizes(idx, S, BT)
    assert torch.equal(ulen, ref_ulen) and umax == int(ref_ulen.max())
    # the plans agree, and the full one carries what the build skips
    ps = paths.plan(idx, S, 8, BT, is_cuda=True, stats="sample")
    pf = paths.plan(idx, S, 8, BT, is_cuda=True, stats="full")
    assert (ps.fwd, ps.bwd, ps.dq) == (pf.fwd, pf.bwd, pf.dq) and ps.union is None
    assert ps.estimate_ms == pytest.approx(pf.estimate_ms, rel=1e-12)
    plain = union.build_union(idx, S, BT)
    pre = union.build_union(idx, S, BT, prebuilt=(bits, ulen, umax))
    for name in ("ukey", "qmask", "ulen", "bits", "pref"):
        a, b = getattr(plain, name), getattr(pre, name)
        if name == "ukey":  # slots past |U| are never read (uninitialised memory)
            live = torch.arange(a.shape[-1])[None, None] < plain.ulen[..., None]
            a, b = a[live], b[live]
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="stats"):
        paths.plan(idx, S, 8, BT, is_cuda=True, stats="all")


def test_full_stats_count_pairs_on_strided_rows_at_length():
    """Past PAIR_ROWS rows the pairs come from a strided view: within a few percent of the exact count here
    (and the union / touched statistics stay exact: every tile)."""
    g = torch.Generator().manual_seed(1)
    B, T, S, K, BT = 1, 2 * paths.PAIR_ROWS + 40, 3000, 16, 32
    idx = _clustered(B, T, S, K, g)
    (pairs, ukeys, _, _), (bits, ulen, _) = paths.full_stats(idx, S, BT)
    nt = -(-T // BT)
    exact = float(((idx >= 0) & (idx < S)).sum()) / nt
    assert abs(pairs - exact) / exact < 0.03
    assert ukeys == pytest.approx(float(ulen.sum()) / nt, rel=1e-12)


VARIANTS = [(0, 0), (0, 1), (1, 0), (1, 1)]  # (lazy, mask_and)


@pytest.mark.parametrize("BT", [32, 16])
@pytest.mark.parametrize("H,H_kv,D,T", [(8, 2, 64, 71), (12, 3, 32, 37)])
def test_tile_fwd_variants_match_reference_and_the_default(BT, H, H_kv, D, T):
    g = torch.Generator().manual_seed(T + BT)
    B, S, K = 2, 83, 28
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, S, H_kv, D, generator=g), torch.randn(B, S, H_kv, D, generator=g)
    idx = _clustered(B, T, S, K, g)
    sel = union.build_union(idx, S, BT)
    scale = D ** -0.5
    ref, rl = sparse_attention_naive(q, k, v, idx, scale)
    fin = torch.isfinite(rl)
    base = None
    for lazy, ma in VARIANTS:
        o, lse = union.tile_fwd(q, k, v, sel, scale, dot_precision(q.dtype),
                                tune=(32 if BT == 32 else 64, 4, 1, 0, lazy, ma))
        torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.isfinite(lse), fin)
        torch.testing.assert_close(lse[fin], rl[fin], atol=1e-5, rtol=1e-5)
        if base is None:
            base = (o, lse)
        elif not lazy:  # the AND test selects the same pairs, the same arithmetic: the default's bits
            assert torch.equal(o, base[0]) and torch.equal(lse, base[1])


@pytest.mark.parametrize("BT,BK,warps", [(16, 32, 4), (16, 16, 4), (32, 16, 8)])
@pytest.mark.parametrize("H,H_kv,D,T", [(8, 2, 64, 71), (14, 2, 32, 37)])
def test_tile_fwd_prefetch_is_the_default_loop_bitwise(BT, BK, warps, H, H_kv, D, T):
    """The prefetching key loop (tune's 8th entry) against the default loop with the AND bit test at the same key
    block: the same blocks in the same order, the same arithmetic, so the same bits; per-query unions (empty
    rows, -1 holes, out-of-range keys; a tile whose union is empty; G 7 pads the MMA rows) and shared rows (query
    groups, q_offset)."""
    g = torch.Generator().manual_seed(T + BT + BK)
    B, S, K = 2, 83, 28
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, S, H_kv, D, generator=g), torch.randn(B, S, H_kv, D, generator=g)
    idx = _clustered(B, T, S, K, g)
    idx[1, :BT] = -1  # batch 1's first tile: an empty union (left padding)
    sel = union.build_union(idx, S, BT)
    prec, scale = dot_precision(q.dtype), D ** -0.5
    base = union.tile_fwd(q, k, v, sel, scale, prec, tune=(BK, warps, 1, 0, 0, 1))
    pf = union.tile_fwd(q, k, v, sel, scale, prec, tune=(BK, warps, 1, 0, 0, 1, 0, 1))
    assert torch.equal(pf[0], base[0]) and torch.equal(pf[1], base[1])
    ref, rl = sparse_attention_naive(q, k, v, idx, scale)
    torch.testing.assert_close(pf[0], ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(pf[1]), torch.isinf(rl)) and bool((pf[0][1, :BT] == 0).all())
    # shared rows: groups of 2 * BT queries share one row (causality masked per query)
    grp, q_off = 2 * BT, 5
    ng = -(-T // grp)
    rows = _clustered(B, max(6, ng), S + q_off, K, g)[:, :ng].contiguous()
    shr = union.shared_tiles(rows, S + q_off, grp, BT, q_offset=q_off, bits=False)
    k2, v2 = torch.randn(B, S + q_off, H_kv, D, generator=g), torch.randn(B, S + q_off, H_kv, D, generator=g)
    a = union.tile_fwd(q, k2, v2, shr, scale, prec, tune=(BK, warps, 1, 0, 0, 1))
    b = union.tile_fwd(q, k2, v2, shr, scale, prec, tune=(BK, warps, 1, 0, 0, 1, 0, 1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="prefetch"):
        union.tile_fwd(q, k, v, sel, scale, prec, tune=(BK, warps, 1, 0, 1, 1, 0, 1))
    # the prefetching loop reads the key lists in whole blocks: build_union pads them, a hand-cut one is refused
    assert sel.ukey.shape[2] % union.SLOT_PAD == 0 and bool((sel.qmask[..., int(sel.ulen.max()):] == 0).all())
    cut = int(sel.ulen.max())
    if cut % BK:
        short = union.TileSelection(BT, 1, 0, sel.ukey[..., :cut].contiguous(), sel.bits, sel.ulen,
                                    sel.qmask[..., :cut].contiguous(), sel.pref)
        with pytest.raises(ValueError, match="whole"):
            union.tile_fwd(q, k, v, short, scale, prec, tune=(BK, warps, 1, 0, 0, 1, 0, 1))


@pytest.mark.parametrize("BT,BK", [(16, 32), (32, 16)])
@pytest.mark.parametrize("shared", [False, True])
def test_tile_dq_prefetch_is_the_default_loop_bitwise(BT, BK, shared):
    """The dq pass's prefetching loop (tune's 5th entry) against its default loop at the same key block, per-query
    unions (an empty tile, G 7) and shared rows; and dq against autograd through the float32 reference."""
    g = torch.Generator().manual_seed(BT + BK + shared)
    B, T, S, K, H, H_kv, D = 2, 53, 83, 28, 14, 2, 32
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, S, H_kv, D, generator=g), torch.randn(B, S, H_kv, D, generator=g)
    do = torch.randn(B, T, H, D, generator=g)
    if shared:
        grp = 2 * BT
        rows = _clustered(B, 6, S, K, g)[:, :-(-T // grp)].contiguous()
        sel = union.shared_tiles(rows, S, grp, BT)
        idx = rows.repeat_interleave(grp, 1)[:, :T]
        idx = torch.where(idx <= torch.arange(T)[None, :, None], idx, -1)  # the shared row, causal per query
    else:
        idx = _clustered(B, T, S, K, g)
        idx[1, :BT] = -1
        sel = union.build_union(idx, S, BT)
    prec, scale = dot_precision(q.dtype), D ** -0.5
    o, lse = union.tile_fwd(q, k, v, sel, scale, prec)
    delta = (o * do).sum(-1)
    base = union.tile_dq(q, k, v, sel, do, lse, delta, scale, prec, tune=(BK, 4, 1))
    pf = union.tile_dq(q, k, v, sel, do, lse, delta, scale, prec, tune=(BK, 4, 1, 0, 1))
    assert torch.equal(pf, base)
    qr = q.clone().requires_grad_()
    ref, _ = sparse_attention_naive(qr, k, v, idx, scale)
    ref.backward(do)
    torch.testing.assert_close(pf, qr.grad, atol=1e-4, rtol=1e-4)


def test_dq_default_prefetches_only_padded_per_query_lists():
    """The GPU's dq default for 16-query (64-row) tiles is the prefetching loop at 32 keys, on build_union's padded
    lists only: a hand-cut list whose slots are not whole 32-key blocks takes the plain loop rather than the
    prefetch's refusal. Both defaults, run here under the interpreter, give the same dq as the plain 32-key loop."""
    g = torch.Generator().manual_seed(7)
    B, T, S, K, H, H_kv, D, BT = 1, 40, 90, 20, 8, 2, 32, 16
    q, do = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, S, H_kv, D, generator=g), torch.randn(B, S, H_kv, D, generator=g)
    sel = union.build_union(_clustered(B, T, S, K, g), S, BT)
    BM = max(16, BT * H // H_kv)
    assert BM == 64 and union.dq_default_tune(BM, True, sel.shared, sel.ukey.shape[2]) == (32, 4, 1, 0, 1)
    assert union.dq_default_tune(BM, True, True) == (64, 4, 2)
    assert union.dq_default_tune(2 * BM, True, False) == (128, 8, 2)
    cut = int(sel.ulen.max()) | 1  # odd: never whole 32-key blocks
    short = union.TileSelection(BT, 1, 0, sel.ukey[..., :cut].contiguous(), sel.bits, sel.ulen,
                                sel.qmask[..., :cut].contiguous(), sel.pref)
    assert union.dq_default_tune(BM, True, False, cut) == (64, 4, 2)
    prec, scale = dot_precision(q.dtype), D ** -0.5
    o, lse = union.tile_fwd(q, k, v, sel, scale, prec)
    delta = (o * do).sum(-1)
    plain = union.tile_dq(q, k, v, sel, do, lse, delta, scale, prec, tune=(32, 4, 1))
    for s_, umax in ((sel, sel.ukey.shape[2]), (short, cut)):
        dq = union.tile_dq(q, k, v, s_, do, lse, delta, scale, prec, tune=union.dq_default_tune(BM, True, False, umax))
        torch.testing.assert_close(dq, plain, atol=1e-5, rtol=1e-5)


def test_lazy_rescale_survives_a_max_that_grows_late_and_rows_that_start_empty():
    """Scores that rise by far more than 2^8 (log2) along the union (each later key block holds a larger
    score) and rows whose first keys come late: the lazy rescale must move the max then, never overflow."""
    g = torch.Generator().manual_seed(5)
    B, T, S, H, H_kv, D, K = 1, 40, 96, 4, 1, 16, 24
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.randn(B, S, H_kv, D, generator=g) * 0.1
    k[:, :, :, 0] = torch.linspace(0, 60, S)[None, :, None]  # key s scores ~ q0 * s * 0.6: rises along the keys
    q[..., 0] = q[..., 0].abs() + 1.0
    v = torch.randn(B, S, H_kv, D, generator=g)
    idx = _clustered(B, T, S, K, g, drop=0.1)
    idx[0, :7, : K // 2] = -1  # rows whose selection starts in a later key block
    sel = union.build_union(idx, S, 32)
    ref, rl = sparse_attention_naive(q, k, v, idx, 1.0)
    fin = torch.isfinite(rl)
    o, lse = union.tile_fwd(q, k, v, sel, 1.0, dot_precision(q.dtype), tune=(16, 4, 1, 0, 1, 1, 128))  # a cap: CUDA only
    o0, _ = union.tile_fwd(q, k, v, sel, 1.0, dot_precision(q.dtype), tune=(16, 4, 1, 0, 0, 0))
    assert torch.isfinite(o).all()
    # logits up to ~1e2: fp32 rounding of the exponent is ~1e-5 relative here, for the default kernel too
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)
    assert (o - ref).abs().max() <= 2 * (o0 - ref).abs().max() + 1e-6
    torch.testing.assert_close(lse[fin], rl[fin], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("T", [96, 83])
def test_half_tiles_stats_and_the_choice_of_16_query_tiles(T):
    """full_stats(half=True): BT's bitmap is the OR of its two BT/2 tiles' (== a direct build), |U| of both;
    the plan takes 16-query tiles where 16 queries share their keys but 32 do not, 32 where 32 share them,
    and the 16-query union it hands over builds tiles whose forward matches the reference."""
    from sparse_rl.sparse.ops.sparse_attention import union as un

    g = torch.Generator().manual_seed(T)
    B, S, K = 1, 400, 40
    idx = _clustered(B, T, S, K, g)
    (_, ukeys, _, _), (bits, ulen, umax), (ukeys_h, (bits_h, ulen_h, umax_h)) = paths.full_stats(idx, S, 32, half=True)
    assert torch.equal(bits, un._bitmap(idx, S, 32)) and torch.equal(ulen, un.union_sizes(idx, S, 32))
    assert torch.equal(bits_h, un._bitmap(idx, S, 16)) and torch.equal(ulen_h, un.union_sizes(idx, S, 16))
    assert umax == int(ulen.max()) and umax_h == int(ulen_h.max())
    assert ukeys_h == pytest.approx(float(ulen_h.sum()) / ulen_h.numel(), rel=1e-12)
    t = torch.arange(T)[:, None]
    by16 = (torch.arange(K)[None] + (t // 16) * K).clamp(max=S - 1)  # 16 queries share K keys, the next 16 others
    by16 = torch.where(by16 <= t + 300, by16, -1)[None].to(torch.int32)  # (keys past the query allowed: any rows)
    p16 = paths.plan(by16, S, 8, 32, is_cuda=True, small_tiles=True)
    assert p16.bt == 16 and p16.estimate_ms["tile_fwd"] == p16.estimate_ms["tile_fwd_half"]
    assert paths.plan(by16, S, 8, 32, is_cuda=True).bt == 32  # without small_tiles: the backward's tiles
    by32 = (torch.arange(K)[None] + (t // 32) * K).clamp(max=S - 1)
    p32 = paths.plan(by32[None].to(torch.int32), S, 8, 32, is_cuda=True, small_tiles=True)
    assert p32.bt == 32 and p32.estimate_ms["tile_fwd_half"] > p32.estimate_ms["tile_fwd"]
    # the handed-over 16-query union == a direct build, and its forward == the reference
    sel = un.build_union(by16, S, p16.bt, prebuilt=p16.union)
    direct = un.build_union(by16, S, 16)
    assert torch.equal(sel.qmask, direct.qmask) and torch.equal(sel.ulen, direct.ulen)
    H, Hkv, D = 8, 2, 16
    q = torch.randn(B, T, H, D, generator=g)
    k, v = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    o, lse = un.tile_fwd(q, k, v, sel, D ** -0.5, dot_precision(q.dtype))
    ref, rl = sparse_attention_naive(q, k, v, by16, D ** -0.5)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("BT", [1, 16, 5])
def test_bitmap_dedupe_sets_the_same_bits(BT):
    """The bitmap pass with reads of the bits earlier rows set (no atomic for those) and without: both equal a
    scatter of each tile's valid keys (-1 holes and out-of-range keys dropped), on rows that share most keys."""
    g = torch.Generator().manual_seed(11)
    B, T, S, K = 2, 37, 300, 24
    idx = _clustered(B, T, S, K, g)
    got = union._bitmap(idx, S, BT)
    assert torch.equal(got, union._bitmap(idx, S, BT, dedupe=False))
    ref = torch.zeros_like(got)
    ok = (idx >= 0) & (idx < S)
    for b in range(B):
        for t in range(T):
            for key in idx[b, t][ok[b, t]].tolist():
                ref[b, t // BT, key >> 5] |= 1 << (key & 31) if (key & 31) < 31 else -(1 << 31)
    assert torch.equal(got, ref)
