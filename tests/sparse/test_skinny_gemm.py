"""`ops.skinny_linear` (split-K in one launch, the last program of a tile reducing) against F.linear's
arithmetic under TRITON_INTERPRET=1: odd sizes, 1-32 rows, one split and many, the counters left at zero
(so a second call, or a CUDA-graph replay, needs no reset)."""

import pytest
import torch

from sparse_rl.sparse.ops.skinny_gemm.naive import skinny_linear_naive
from sparse_rl.sparse.ops.skinny_gemm.triton import counters, plan, skinny_linear


@pytest.mark.parametrize("M,N,K", [(1, 37, 50), (3, 100, 200), (17, 80, 300), (32, 64, 16)])
def test_skinny_linear_equals_reference(M, N, K):
    g = torch.Generator().manual_seed(M + N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    cnt = counters(N, "cpu")
    split = plan(M, N, K, 16, 16, 3 * -(-N // 16))[3]
    assert (split > 1) == (K > 16)  # K = 16: one slice, written directly
    for _ in range(2):
        torch.testing.assert_close(skinny_linear(x, w, cnt), skinny_linear_naive(x, w), atol=1e-4, rtol=1e-5)
        assert int(cnt.abs().sum()) == 0
    xb, wb = x.bfloat16(), w.bfloat16()
    torch.testing.assert_close(skinny_linear(xb, wb).float(), skinny_linear_naive(xb, wb).float(), atol=0.3, rtol=1e-2)


def test_skinny_linear_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="M <= 32"):
        skinny_linear(torch.randn(33, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="counters"):
        skinny_linear(torch.randn(2, 8), torch.randn(64, 8), torch.zeros(1, dtype=torch.int32))
