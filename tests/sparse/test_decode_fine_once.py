"""The fine select with its threshold resolved once a row (`fine_resolve="arrive"`: the row's last gather
program, by ticket; "pass": a [B]-program pass; decode_fine_once.py) against the reference under
TRITON_INTERPRET=1, on every path of `_resolve_row`: the k-th key an exact zero (ReLU zeros: the pair's cut read
from the zeros' slots), above or below the zeros (the sub-bin ranked in registers), many equal nonzero scores
(the radix levels over b*'s whole list, zeros stored there as keys), rows shorter than K, forced keys filling
the budget, left padding."""

import pytest
import torch

from sparse_rl.sparse.ops.indexer_topk import decode as itd
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive


def _zero_rows(K, B=3, S=300):
    """Weights (1, -1) over two heads: ~1/4 of the keys score exactly 0 (both ReLUs 0); tiny nonzero scores
    of either sign next to them (keys scaled by 1e-7)."""
    g = torch.Generator().manual_seed(K)
    q, k = torch.randn(B, 2, 16, generator=g), torch.randn(B, S, 16, generator=g)
    w = torch.tensor([[1.0, -1.0]]).expand(B, 2).contiguous()
    k[:, 7::37] *= 1e-7
    return q, w, k, torch.tensor([S - 1, 280, 270])


@pytest.mark.parametrize("K", [60, 150, 250])
@pytest.mark.parametrize("resolve", ["arrive", "pass"])
def test_fine_once_zero_thresholds(resolve, K):
    """The k-th key above the zeros (K 60), a zero itself (150: n2 stays 0, no sub-bin is ranked), below them
    (250: every zero kept); K 60 and 250 with the scores prefetched (fine_prefetch: loaded a step ahead)."""
    q, w, k, pos = _zero_rows(K)
    ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=2, window=3)
    got, n2 = itd.indexer_topk_decode(q, w, k, pos, K, sink=2, window=3, chunk=64, impl="fine",
                                      fine_resolve=resolve, candidates=True, fine_prefetch=K != 150,
                                      fine_maxnreg=128)  # a GPU launch option: not applied under the interpreter
    assert torch.equal(got, ref)
    if K == 150:
        assert int(n2.max()) == 0
    else:
        assert int(n2.min()) > 0


@pytest.mark.parametrize("resolve", ["arrive", "pass"])
def test_fine_once_ties_radix_short_rows_padding(resolve):
    """Integer inputs (exact, heavily tied scores, ReLU zeros among them) with cap 2: rows take the radix levels
    over the list (zeros as keys); left padding (kv_start), a row shorter than K, a row whose forced keys fill
    K, and cap 32 (ranked) on the same rows, there with one loop step a chunk (fine_block 64)."""
    g = torch.Generator().manual_seed(5)
    B, HI, DI, S, K = 4, 3, 16, 200, 24
    q = torch.randint(-2, 3, (B, HI, DI), generator=g).float()
    w = torch.randint(-1, 3, (B, HI), generator=g).float()
    k = torch.randint(-2, 3, (B, S, DI), generator=g).float()
    pos = torch.tensor([S - 1, 150, 12, 100])
    kvs = torch.tensor([0, 3, 0, 40])
    ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=2, window=3, kv_start=kvs)
    paths = set()
    for cap in (2, 32):
        got, n2 = itd.indexer_topk_decode(q, w, k, pos, K, sink=2, window=3, kv_start=kvs, chunk=64, impl="fine",
                                          fine_resolve=resolve, fine_cap=cap, candidates=True,
                                          fine_block=64 if cap == 32 else 0)
        assert torch.equal(got, ref), cap
        paths |= {"radix" if n > cap else "rank" for n in n2.tolist() if n > 0}
    assert paths == {"radix", "rank"}
    full = indexer_topk_decode_naive(q, w, k, pos, 8, sink=3, window=5)  # forced keys fill the budget
    assert torch.equal(itd.indexer_topk_decode(q, w, k, pos, 8, sink=3, window=5, chunk=64, impl="fine",
                                               fine_resolve=resolve), full)


def test_fine_resolve_is_checked_and_carried():
    with pytest.raises(ValueError, match="fine_resolve"):
        itd.DecodeSelect("fine", fine_resolve="once")
    q, w, k = torch.zeros(1, 1, 16), torch.ones(1, 1), torch.zeros(1, 8, 16)
    with pytest.raises(ValueError, match="fine_resolve"):
        itd.indexer_topk_decode(q, w, k, torch.tensor([7]), 4, impl="fine", fine_resolve="once")
    assert itd.DecodeSelect("fine", fine_resolve="arrive").as_kwargs()["fine_resolve"] == "arrive"
    with pytest.raises(ValueError, match="fine_block"):
        itd.DecodeSelect("fine", fine_block=48)
    assert itd.DecodeSelect("fine", fine_block=1024).as_kwargs()["fine_block"] == 1024
    with pytest.raises(ValueError, match="fine_maxnreg"):
        itd.DecodeSelect("fine", fine_maxnreg=8)
    kw = itd.DecodeSelect("fine", fine_prefetch=True, fine_maxnreg=128).as_kwargs()
    assert kw["fine_prefetch"] is True and kw["fine_maxnreg"] == 128
