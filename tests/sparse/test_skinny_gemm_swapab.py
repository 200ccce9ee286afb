"""`swapab_linear` (yᵀ = W xᵀ, split-K in one launch, the last program of a tile reducing) and
`ops.skinny_linear(impl="swapab")` against F.linear's arithmetic under TRITON_INTERPRET=1: odd sizes, 1-64 rows
(the batch padded to 16 / 32 / 64), one split and many, fp32 and bf16, strided x rows, the counters left at zero
(so a second call, or a CUDA-graph replay, needs no reset), PDL asked for (it resolves off here)."""

import pytest
import torch

from sparse_rl.sparse import ops
from sparse_rl.sparse.ops.skinny_gemm.naive import skinny_linear_naive
from sparse_rl.sparse.ops.skinny_gemm.swapab import plan, swapab_linear
from sparse_rl.sparse.ops.skinny_gemm.triton import counters


@pytest.mark.parametrize("M,N,K", [(1, 37, 50), (3, 100, 200), (17, 80, 300), (32, 64, 16), (45, 19, 77)])
def test_swapab_linear_equals_reference(M, N, K):
    g = torch.Generator().manual_seed(M + N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    cnt = counters(N, "cpu")
    bx, _, _, split, ks = plan(M, N, K, 16, 16, 3 * -(-N // 16))
    assert bx == max(16, 1 << (M - 1).bit_length()) and (split > 1) == (K > 16)  # K = 16: one slice, written directly
    assert (split - 1) * ks < K <= split * ks  # every slice holds some of K
    for _ in range(2):  # the same counters twice: the first call left them at zero
        torch.testing.assert_close(swapab_linear(x, w, cnt), skinny_linear_naive(x, w), atol=1e-4, rtol=1e-5)
        assert int(cnt.abs().sum()) == 0
    xb, wb = x.bfloat16(), w.bfloat16()
    torch.testing.assert_close(swapab_linear(xb, wb).float(), skinny_linear_naive(xb, wb).float(), atol=0.3, rtol=1e-2)


def test_swapab_strided_rows_and_pdl_request():
    """x rows with a stride above K (a column slice of a wider tensor), through the ops entry, PDL asked for:
    the result is the reference's, and the interpreter runs it without PDL."""
    g = torch.Generator().manual_seed(3)
    wide, w = torch.randn(5, 90, generator=g), torch.randn(70, 61, generator=g)
    x = wide[:, 7:68]
    assert x.stride(0) == 90
    cnt = counters(70, "cpu")
    got = ops.skinny_linear(x, w, cnt, impl="swapab", pdl=1)
    torch.testing.assert_close(got, skinny_linear_naive(x, w), atol=1e-4, rtol=1e-5)
    assert int(cnt.abs().sum()) == 0


def test_skinny_linear_impls_agree_and_fall_back():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(9, 40, generator=g), torch.randn(33, 40, generator=g)
    a = ops.skinny_linear(x, w, impl="splitk")
    b = ops.skinny_linear(x, w, impl="swapab")
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    x65 = torch.randn(65, 40, generator=g)  # more rows than the kernel takes: the reference runs
    torch.testing.assert_close(ops.skinny_linear(x65, w, impl="swapab"), skinny_linear_naive(x65, w))
    with pytest.raises(ValueError, match="impl"):
        ops.skinny_linear(x, w, impl="cublas")


def test_swapab_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="M <= 64"):
        swapab_linear(torch.randn(65, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="counters"):
        swapab_linear(torch.randn(2, 8), torch.randn(64, 8), torch.zeros(1, dtype=torch.int32))


def test_plan_fills_one_wave_at_most():
    """The device tiles: o_proj / down / q/k/v of Qwen3-4B at 128-row weight tiles split into at most 264
    programs (two an SM); gate/up (152 tiles) is not split; 128-wide K steps halve the programs."""
    for N, K in ((2560, 4096), (2560, 9728), (6528, 2560)):
        bx, bw, bk, split, ks = plan(32, N, K)
        assert bx == 32 and 200 < -(-N // bw) * split <= 264 and split > 1 and (split - 1) * ks < K <= split * ks
    assert plan(1, 19456, 2560)[3] == 1
    assert plan(32, 2560, 4096, 128, 128, 132)[3:] == (6, 768)


@pytest.mark.parametrize("M,N,K", [(1, 37, 50), (5, 40, 33), (32, 24, 64), (45, 19, 77)])
def test_swapab_silu_mul_is_the_gemm_then_silu_mul(M, N, K):
    """`swapab_silu_mul` (the fused gate/up GEMM with SiLU(gate) * up in its epilogue, one launch): bitwise the plain
    kernel's output followed by `ops.silu_mul` in bf16 (the same accumulators, the same roundings), and the
    reference's within fp32 rounding; odd widths (tiles past the last column), through the ops entry too."""
    from sparse_rl.sparse.ops.decode_fused.naive import silu_mul_naive
    from sparse_rl.sparse.ops.decode_fused.triton import silu_mul
    from sparse_rl.sparse.ops.skinny_gemm.swapab import swapab_silu_mul

    g = torch.Generator().manual_seed(M * N + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(2 * N, K, generator=g) / K ** 0.5
    torch.testing.assert_close(swapab_silu_mul(x, w), silu_mul_naive(skinny_linear_naive(x, w)), atol=1e-5,
                               rtol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    # the plain kernel at one K slice a program (programs = its tiles), as the fused one runs
    two = silu_mul(swapab_linear(xb, wb, counters(2 * N, "cpu"), bw=16, bk=16, programs=-(-2 * N // 16)))
    assert torch.equal(swapab_silu_mul(xb, wb), two)
    torch.testing.assert_close(ops.skinny_silu_mul(x, w, pdl=1), silu_mul_naive(skinny_linear_naive(x, w)),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="even number"):
        swapab_silu_mul(x, w[1:])


@pytest.mark.parametrize("M,K,N,NI,split", [(5, 40, 72, 24, True), (3, 33, 50, 17, False), (32, 64, 16, 8, True)])
def test_residual_epilogue_and_norm_epilogue_are_add_rmsnorm(M, K, N, NI, split):
    """The post-attention add + RMSNorm inside the GEMMs: `swapab_linear(residual=, scale=)` returns h = residual +
    x @ wᵀ (the unfused GEMM's output plus the residual, bitwise in fp32), each tile's per-row sum of h^2 and hn = h *
    scale; a GEMM given x = hn and norm = (those sums, eps) returns RMSNorm(h) @ wᵀ: the plain GEMM / the fused gate/up
    on `add_rmsnorm`'s output within fp32 rounding, one K slice or several; the ops entries' reference path gives the
    same from its own sums."""
    from sparse_rl.sparse.ops.decode_fused.naive import add_rmsnorm_naive, silu_mul_naive
    from sparse_rl.sparse.ops.skinny_gemm.swapab import swapab_silu_mul

    g = torch.Generator().manual_seed(M + K + N)
    a, wo = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5
    res, nw = torch.randn(M, N, generator=g), 1 + 0.1 * torch.randn(N, generator=g)
    wg = torch.randn(2 * NI, N, generator=g) / N ** 0.5
    programs = 3 * -(-N // 16) if split else -(-N // 16)  # the interpreter's 16-row tiles, 3 K slices or 1
    h, ps, hn = swapab_linear(a, wo, counters(N, "cpu"), residual=res, scale=nw, programs=programs)
    x, h_ref = add_rmsnorm_naive(swapab_linear(a, wo, counters(N, "cpu"), programs=programs), res, nw, 1e-6)
    assert torch.equal(h, h_ref) and ps.shape == (-(-N // 16), max(16, 1 << (M - 1).bit_length()))
    assert torch.equal(hn, h * nw)
    torch.testing.assert_close(ps.sum(0)[:M], (h * h).sum(-1), atol=1e-4, rtol=1e-5)
    assert swapab_linear(a, wo, counters(N, "cpu"), residual=res, programs=programs)[2] is None
    norm = (ps, 1e-6)
    torch.testing.assert_close(swapab_silu_mul(hn, wg, norm=norm), silu_mul_naive(skinny_linear_naive(x, wg)),
                               atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(swapab_linear(hn, wg, norm=norm), skinny_linear_naive(x, wg), atol=2e-5, rtol=1e-5)
    # a split-K consumer (the q/k/v GEMM's form: 1 / rms applied after the partials' sum)
    torch.testing.assert_close(swapab_linear(hn, wg, counters(2 * NI, "cpu"), norm=norm, programs=3 * -(-2 * NI // 16)),
                               skinny_linear_naive(x, wg), atol=2e-5, rtol=1e-5)
    # the ops entries, both paths, each on its own sums (the reference's one `[1, M]` row)
    for be in ("triton", "torch"):
        h2, ps2, hn2 = ops.skinny_linear(a, wo, counters(N, "cpu"), impl="swapab", residual=res, scale=nw, backend=be)
        torch.testing.assert_close(h2, h_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hn2, h_ref * nw, atol=1e-5, rtol=1e-5)
        assert ps2.shape[0] == (1 if be == "torch" else -(-N // 16))
        torch.testing.assert_close(ops.skinny_silu_mul(hn2, wg, norm=(ps2, 1e-6), backend=be),
                                   silu_mul_naive(skinny_linear_naive(x, wg)), atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="norm partials"):  # another path's sums (BX columns) are refused
        swapab_linear(hn, wg, norm=(torch.zeros(1, 3), 1e-6))
    with pytest.raises(ValueError, match="scale= needs residual"):
        swapab_linear(a, wo, scale=nw)
    with pytest.raises(ValueError, match="swapab"):
        ops.skinny_linear(a, wo, impl="splitk", residual=res)


@pytest.mark.parametrize("M,N,K,split", [(5, 72, 40, True), (3, 50, 48, False), (32, 19, 64, True), (45, 37, 80, True)])
def test_tma_weight_loads_equal_pointer_loads(M, N, K, split):
    """`swapab_linear(loads="tma")`: the weight tiles through a host tensor descriptor (rows past N and columns past K
    zero-filled by the copy, every K slice whole BK steps so none reads into the next) give bitwise the pointer
    loads' result, split over K or not, with the residual epilogue too, and the fused gate/up (its weight as `[2, N,
    K]`, one box the gate's and the up's rows of a program's columns); the L2 prefetch keyword runs (a no-op off the
    GPU). Rows the descriptor cannot take (not 16-byte aligned) are refused."""
    from sparse_rl.sparse.ops.skinny_gemm.swapab import swapab_silu_mul

    g = torch.Generator().manual_seed(M + N + K)
    x, w, res = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(M, N, generator=g)
    programs = 3 * -(-N // 16) if split else -(-N // 16)
    ptr = swapab_linear(x, w, counters(N, "cpu"), programs=programs)
    assert torch.equal(swapab_linear(x, w, counters(N, "cpu"), programs=programs, loads="tma", prefetch=True), ptr)
    hp = swapab_linear(x, w, counters(N, "cpu"), programs=programs, residual=res)
    ht = swapab_linear(x, w, counters(N, "cpu"), programs=programs, residual=res, loads="tma")
    assert torch.equal(ht[0], hp[0]) and torch.equal(ht[1], hp[1])
    torch.testing.assert_close(ptr, skinny_linear_naive(x, w), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="16-byte aligned"):
        swapab_linear(x[:, 1:], w[:, 1:], loads="tma")
    with pytest.raises(ValueError, match="ptr or tma"):
        swapab_linear(x, w, loads="bulk")
    wg = torch.randn(2 * N, K, generator=g)
    assert torch.equal(swapab_silu_mul(x, wg, loads="tma", prefetch=True), swapab_silu_mul(x, wg))
