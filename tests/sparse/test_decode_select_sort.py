"""The decode select's threshold by one in-register sort of the candidates (`sort`, opt-in) and by four
radix passes (sort=0, the default, and rows with more candidates than `sort`): the same keys as the reference
(TRITON_INTERPRET=1 on the CPU), with heavy ties (integer scores, ReLU zeros) and without; and the
implementations after the score pass (`impl`: chunked, row, split, fine, bits, bsearch, cuda, auto) likewise
(cuda: its PyTorch reference over the interpreted score pass; the kernel itself in test_decode_cuda.py)."""

import pytest
import torch

from sparse_rl.sparse.ops.indexer_topk import decode as itd
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive


@pytest.mark.parametrize("ints", [True, False])
@pytest.mark.parametrize("B,S,K,sink,window,chunk", [(3, 150, 24, 2, 3, 32)])
def test_sort_and_radix_thresholds_pick_the_reference_keys(ints, B, S, K, sink, window, chunk):
    g = torch.Generator().manual_seed(S + K + ints)
    HI, DI = 3, 16
    if ints:  # exact scores, many ties: the index cut decides
        q = torch.randint(-2, 3, (B, HI, DI), generator=g).float()
        w = torch.randint(-1, 3, (B, HI), generator=g).float()
        k = torch.randint(-2, 3, (B, S, DI), generator=g).float()
    else:
        q, w, k = torch.randn(B, HI, DI, generator=g), torch.randn(B, HI, generator=g), torch.randn(B, S, DI, generator=g)
    pos = torch.randint(K // 2, S, (B,), generator=g)
    pos[0] = S - 1
    ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=sink, window=window)
    counts = None
    for sort in (0, 2, 256):  # 2: rows overflow to the radix passes; 256: every row sorts
        got, n_cand = itd.indexer_topk_decode(q, w, k, pos, K, sink=sink, window=window, chunk=chunk, sort=sort,
                                              candidates=True, impl="chunked")
        assert torch.equal(got, ref), sort
        counts = n_cand
    assert int(counts.max()) > 2  # some row really overflowed sort=2
    with pytest.raises(ValueError, match="power of two"):
        itd.indexer_topk_decode(q, w, k, pos, K, sort=48)


@pytest.mark.parametrize("impl", ["row", "split", "fine", "bits", "bsearch", "cuda", "auto"])
@pytest.mark.parametrize("ints", [True, False])
def test_row_and_split_selects_pick_the_reference_keys(impl, ints):
    """impl="row" (the score pass, then one program per row: decode_row.py) and "split" (then three
    (chunk, row) passes: decode_split.py) against the reference, and auto past row_max_keys (chunked): exact
    ties (integer scores), left padding (kv_start), rows shorter than K, every threshold path (sort of the
    candidates, radix levels when they overflow `sort`)."""
    g = torch.Generator().manual_seed(21 + ints)
    B, HI, DI, S, K = 4, 3, 16, 133, 20
    if ints:
        q = torch.randint(-2, 3, (B, HI, DI), generator=g).float()
        w = torch.randint(-1, 3, (B, HI), generator=g).float()
        k = torch.randint(-2, 3, (B, S, DI), generator=g).float()
    else:
        q, w = torch.randn(B, HI, DI, generator=g), torch.randn(B, HI, generator=g)
        k = torch.randn(B, S, DI, generator=g)
    pos = torch.tensor([S - 1, 70, 12, 100])
    kvs = torch.tensor([0, 3, 0, 40])
    ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=2, window=3, kv_start=kvs)
    for sort in (2, 64) if impl not in ("auto", "bits", "bsearch", "cuda") else (0,):  # 2: most rows overflow to the radix levels; 64: all sort
        got = itd.indexer_topk_decode(q, w, k, pos, K, sink=2, window=3, kv_start=kvs, chunk=32, impl=impl, sort=sort,
                                      row_max_keys=100)  # auto: this S takes the chunked passes
        assert torch.equal(got, ref), sort
    with pytest.raises(ValueError, match="impl"):
        itd.indexer_topk_decode(q, w, k, pos, K, impl="rows")
    with pytest.raises(ValueError, match="auto_long"):
        itd.indexer_topk_decode(q, w, k, pos, K, auto_long="auto")
    with pytest.raises(ValueError, match="decode select"):
        itd.DecodeSelect(long="rows")
    with pytest.raises(ValueError, match="num_warps"):
        itd.DecodeSelect(num_warps=3)
    assert itd.DecodeSelect(num_warps=2).as_kwargs()["num_warps"] == 2 and itd.DecodeSelect().as_kwargs()["num_warps"] is None


@pytest.mark.parametrize("impl", ["chunked", "split", "fine", "bits", "bsearch", "cuda"])
def test_chunked_and_split_select_edge_distributions(impl):
    """Forced keys filling the budget, all-equal scores, a span set by a few huge keys (nearly every key
    a candidate), negative weights against the reference (the default, row at these sizes, is held to
    the same cases in test_kernels.py)."""
    g = torch.Generator().manual_seed(2)
    B, HI, DI, S = 3, 2, 16, 90
    pos = torch.tensor([89, 60, 15])
    q = torch.randint(-2, 3, (B, HI, DI), generator=g).float()
    k = torch.randint(-2, 3, (B, S, DI), generator=g).float()
    w = torch.ones(B, HI)
    scale = 2.0 ** torch.randint(0, 40, (B, S, 1), generator=g).float()
    for qq, ww, kk, K, sink, window in [(q, w, k, 8, 3, 5), (torch.zeros_like(q), w, k, 20, 1, 1),
                                        (q.abs(), w, k.abs() * scale, 20, 2, 2), (q, -w, k, 20, 1, 2)]:
        got = itd.indexer_topk_decode(qq, ww, kk, pos, K, sink=sink, window=window, chunk=32, impl=impl)
        assert torch.equal(got, indexer_topk_decode_naive(qq, ww, kk, pos, K, sink=sink, window=window))


def test_fine_select_sub_bins_rank_and_radix_fallback():
    """impl="fine" (decode_fine.py): the threshold's sub-bin ranked in registers (rows with at most `cap`
    keys there) and the radix levels over the first-level bin's keys (more), against the reference; a far
    outlier key widens the span so that the first-level bin holds many keys and the sub-bins decide, and
    integer inputs (exact, heavily tied nonzero scores) put many keys in one sub-bin."""
    g = torch.Generator().manual_seed(3)
    B, HI, DI, S, K = 3, 2, 16, 300, 40
    q, w, k = torch.randn(B, HI, DI, generator=g), torch.randn(B, HI, generator=g), torch.randn(B, S, DI, generator=g)
    k[:, 50] *= 100
    qi, wi = torch.randint(-2, 3, (B, HI, DI), generator=g).float(), torch.randint(1, 3, (B, HI), generator=g).float()
    ki = torch.randint(-2, 3, (B, S, DI), generator=g).float()
    ki[:, 50] *= 100
    pos = torch.tensor([S - 1, 250, 200])
    seen = set()
    for qq, ww, kk in ((q, w, k), (qi, wi, ki)):
        ref = indexer_topk_decode_naive(qq, ww, kk, pos, K, sink=2, window=3)
        for cap in (2, 64):
            got, n2 = itd.indexer_topk_decode(qq, ww, kk, pos, K, sink=2, window=3, chunk=64, impl="fine",
                                              fine_cap=cap, candidates=True)
            assert torch.equal(got, ref), cap
            seen |= {"rank" if 0 < n <= cap else "radix" for n in n2.tolist() if n > 0}
    assert seen == {"rank", "radix"}
    with pytest.raises(ValueError, match="power of two"):
        itd.indexer_topk_decode(q, w, k, pos, K, impl="fine", fine_cap=48)


@pytest.mark.parametrize("K", [60, 150, 250])
def test_bsearch_select_relu_zero_ties(K):
    """impl="bsearch" (decode_bsearch.py) on the ReLU-zero rows below: the threshold above, among (the
    position search picks the later zeros) or below the zeros."""
    g = torch.Generator().manual_seed(K)
    B, HI, DI, S = 3, 2, 16, 300
    q, k = torch.randn(B, HI, DI, generator=g), torch.randn(B, S, DI, generator=g)
    w = torch.tensor([[1.0, -1.0]]).expand(B, HI).contiguous()
    k[:, 7::37] *= 1e-7
    pos = torch.tensor([S - 1, 280, 270])
    ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=2, window=3)
    assert torch.equal(itd.indexer_topk_decode(q, w, k, pos, K, sink=2, window=3, chunk=64, impl="bsearch"), ref)


@pytest.mark.parametrize("K", [60, 150, 250])
def test_fine_select_relu_zero_ties(K):
    """impl="fine": keys whose every index head's ReLU is 0 score exactly 0 (one tie, the later keys win):
    with weights of both signs the threshold falls above the zeros (K 60), among them (150: a block of
    zeros: the later ones by their order in key order) or below them (250: every zero kept, the rank
    among the nonzero keys shifted by their count); a few keys of tiny nonzero score sit next to the
    zeros. Against the reference, cap 2 and 32."""
    g = torch.Generator().manual_seed(K)
    B, HI, DI, S = 3, 2, 16, 300
    q, k = torch.randn(B, HI, DI, generator=g), torch.randn(B, S, DI, generator=g)
    w = torch.tensor([[1.0, -1.0]]).expand(B, HI).contiguous()
    k[:, 7::37] *= 1e-7  # tiny scores of either sign, next to the zeros
    pos = torch.tensor([S - 1, 280, 270])
    ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=2, window=3)
    for cap in (2, 32):
        got, n2 = itd.indexer_topk_decode(q, w, k, pos, K, sink=2, window=3, chunk=64, impl="fine", fine_cap=cap,
                                          candidates=True)
        assert torch.equal(got, ref), cap
    if K == 150:  # the threshold is a zero in every row: the zeros' order decides, no sub-bin is resolved
        assert int(n2.max()) == 0


@pytest.mark.parametrize("impl", ["chunked", "row", "fine", "bits", "bsearch"])
def test_score_block_keeps_the_selection(impl):
    """`score_block` (the score pass's keys a step, a register/occupancy knob) selects the same keys; one that
    does not divide the chunk is refused."""
    g = torch.Generator().manual_seed(8)
    B, HI, DI, S, K = 3, 2, 16, 150, 24
    q, w, k = torch.randn(B, HI, DI, generator=g), torch.randn(B, HI, generator=g), torch.randn(B, S, DI, generator=g)
    pos = torch.tensor([S - 1, 90, 40])
    ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=2, window=3)
    got = itd.indexer_topk_decode(q, w, k, pos, K, sink=2, window=3, chunk=32, impl=impl, score_block=8)
    assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="score_block"):
        itd.indexer_topk_decode(q, w, k, pos, K, chunk=32, impl=impl, score_block=12)


def _bits_code(x):
    """decode_bits._code in torch: the fp16 image's top 11 bits (+1 above zero), forced +inf on top."""
    xz = torch.where(x == 0, torch.zeros_like(x), x)
    h = xz.clamp(-65504, 65504).half().view(torch.int16).int() & 0xFFFF
    k16 = torch.where((h & 0x8000) != 0, (~h) & 0xFFFF, h | 0x8000)
    return torch.where(x == float("inf"), 2047, (k16 >> 5) + (xz > 0).int())


def _bits_paths(scores, pos, K, rw, chunk):
    """Which way each row's threshold is resolved (decode_bits._resolve), from the score pass's scores."""
    out = set()
    for row, p in zip(scores, pos.tolist()):
        vis = (row > float("-inf")) & (torch.arange(row.numel()) <= p)
        code = _bits_code(row[vis])
        if code.numel() <= K:
            out.add("all")
            continue
        cs = torch.sort(code, descending=True).values
        bstar = int(cs[K - 1])
        rem, n_b = K - int((code > bstar).sum()), int((code == bstar).sum())
        where = torch.nonzero(vis).flatten()[code == bstar] // chunk
        per_chunk = int(torch.bincount(where).max())
        out.add("bin" if rem == n_b else "zeros" if bstar == 1024 else "sort" if per_chunk <= rw else "radix")
    return out


@pytest.mark.parametrize("K", [60, 150])
def test_bits_select_every_threshold_path(K):
    """impl="bits" (decode_bits.py: fixed fp16-bit bins counted by the score pass, the row's last program
    resolving the threshold) against the reference on every path of its resolve: the threshold bin taken
    whole, exact zeros (keys whose every head's ReLU is 0, one tie block: the later ones), the sort tile,
    and the radix levels when a chunk holds more b* keys than the tile (rw 2; integer scores, heavy ties);
    tiny nonzero scores beside the zeros, rows shorter than K, left padding."""
    from sparse_rl.sparse.ops.indexer_topk.decode_bits import bits_scratch, bits_select
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

    g = torch.Generator().manual_seed(K)
    B, HI, DI, S, chunk = 3, 2, 16, 250, 64
    q, k = torch.randn(B, HI, DI, generator=g), torch.randn(B, S, DI, generator=g)
    w = torch.tensor([[1.0, -1.0]]).expand(B, HI).contiguous()
    k[:, 7::37] *= 1e-7
    qi, wi = torch.randint(-2, 3, (B, HI, DI), generator=g).float(), torch.randint(1, 3, (B, HI), generator=g).float()
    ki = torch.randint(-2, 3, (B, S, DI), generator=g).float()
    pos = torch.tensor([S - 1, 230, 40])
    kvs = torch.tensor([0, 9, 0])
    seen = set()
    for qq, ww, kk in ((q, w, k), (qi, wi, ki)):
        ref = indexer_topk_decode_naive(qq, ww, kk, pos, K, sink=2, window=3, kv_start=kvs)
        assert torch.equal(itd.indexer_topk_decode(qq, ww, kk, pos, K, sink=2, window=3, kv_start=kvs, chunk=chunk,
                                                   impl="bits"), ref)
        scratch = bits_scratch(B, "cpu")
        sc = torch.empty(B, S)
        itd._score_max[(S // chunk + 1, B)](qq, ww, kk, sc, pos, kvs.int(), sc, scratch, *qq.stride(), *ww.stride(),
                                           *kk.stride(), 0, S, 2, 3, HI, DI, S // chunk + 1, HB=16, BD=16, CH=chunk,
                                           BN=16, PREC=dot_precision(torch.float32), FP8=False, PER_CHUNK=False, BITS=True)
        for rw in (2, 64):
            got = bits_select(sc, pos.int(), scratch.clone(), K, chunk, 16, num_warps=1, interpret=True, rw=rw)
            assert torch.equal(got, ref), rw
            seen |= _bits_paths(sc, pos, K, rw, chunk)
    want = {"all", "radix", "zeros" if K == 150 else "sort"}
    assert want <= seen, seen
