"""The decode select's threshold by one in-register sort of the candidates (`sort`, opt-in) and by four
radix passes (sort=0, the default, and rows with more candidates than `sort`): the same keys as the reference
(TRITON_INTERPRET=1 on the CPU), with heavy ties (integer scores, ReLU zeros) and without."""

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
                                              candidates=True)
        assert torch.equal(got, ref), sort
        counts = n_cand
    assert int(counts.max()) > 2  # some row really overflowed sort=2
    with pytest.raises(ValueError, match="power of two"):
        itd.indexer_topk_decode(q, w, k, pos, K, sort=48)
