"""fp8 (e4m3) index keys (`SparseConfig.index_dtype = "fp8"`): the quantization, the indexer's decode
write and the decode select on fp8 keys (Triton through TRITON_INTERPRET=1 against the references, odd
sizes), and the selection's overlap with bf16 keys on the reference."""

import pytest
import torch

from sparse_rl.sparse.ops import indexer_decode, indexer_topk_decode, quantize_index_keys
from sparse_rl.sparse.ops.indexer_topk import decode as itd
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive


def test_quantize_index_keys_bounds_and_rounding():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(7, 33, 20, generator=g) * torch.logspace(-4, 2, 33)[None, :, None]
    k[0, 0] = 0.0  # an all-zero key: scale stays positive, the key stays zero
    k8, scale = quantize_index_keys(k)
    assert k8.dtype == torch.float8_e4m3fn and scale.shape == (7, 33) and bool((scale > 0).all())
    deq = k8.float() * scale[..., None]
    amax = k.abs().amax(-1, keepdim=True)
    # e4m3: 3 mantissa bits, so half an ulp is 1/16 of the value; values far below max |k| land among
    # the subnormals (2^-9 of the scale)
    assert bool(((deq - k).abs() <= k.abs() / 16 + amax / 448 * 2 ** -10 + 1e-30).all())
    assert torch.equal(deq[0, 0], torch.zeros(20))
    top = k8.float().abs().amax(-1)
    assert bool((top.flatten()[1:] == 448).all())  # every nonzero token's largest entry hits the top


@pytest.mark.parametrize("HI,DI,rope_dim,dtype", [(3, 20, 8, torch.float32), (4, 64, 32, torch.bfloat16)])
def test_indexer_decode_writes_fp8_keys_like_the_reference(HI, DI, rope_dim, dtype):
    """The Triton kernel quantizes in the same step as it writes (rounded by hand to the nearest even
    e4m3 value); the reference quantizes the module's key: the same scale (fp32 statistics) and fp8
    values within one e4m3 step (the kernel rounds from fp32, the reference from the model dtype)."""
    from sparse_rl.sparse.indexer import LightningIndexer

    g = torch.Generator().manual_seed(HI * DI)
    B, hidden, Dh, S = 5, 48, 64, 23
    torch.manual_seed(HI * DI)  # the module's own initialisation
    ix = LightningIndexer(hidden, HI, DI, rope_dim).to(dtype)
    h = torch.randn(B, hidden, generator=g).to(dtype)
    ang = torch.rand(B, Dh // 2, generator=g) * 10
    cos, sin = (torch.cat([f, f], -1).to(dtype) for f in (ang.cos(), ang.sin()))
    pos = torch.tensor([22, 0, 9, 9, 4])
    out = {}
    with torch.no_grad():
        z = (ix.wq(h), ix.wk(h), ix.ww(h))
        for backend in ("torch", "triton"):
            cache = torch.zeros(B, S, DI, dtype=torch.float8_e4m3fn)
            scale = torch.zeros(B, S)
            q, w = indexer_decode(*z, cos, sin, ix.k_norm.weight, ix.k_norm.bias, ix.k_norm.eps, rope_dim, pos,
                                  cache, scale, backend=backend)
            out[backend] = (q, w, cache, scale)
    ar = torch.arange(B)
    (q0, w0, c0, s0), (q1, w1, c1, s1) = out["torch"], out["triton"]
    torch.testing.assert_close(q1, q0, **(dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)))
    torch.testing.assert_close(s1[ar, pos], s0[ar, pos], rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=0)
    d0, d1 = c0[ar, pos].float(), c1[ar, pos].float()
    # one e4m3 step (1/8 of the value) plus, in bf16, the reference key's rounding (2^-8 of max |k|, which
    # is 448 in units of the scale)
    assert bool(((d1 - d0).abs() <= d0.abs() / 8 + (448 * 2 ** -7 if dtype == torch.bfloat16 else 2 ** -9)).all())
    if dtype == torch.float32:  # from the same fp32 key: the same e4m3 values bar a rounding tie
        assert (d1 != d0).float().mean() < 0.02
    written = torch.zeros(B, S, dtype=torch.bool)
    written[ar, pos] = True
    assert bool((c1.float()[~written] == 0).all()) and bool((s1[~written] == 0).all())


@pytest.mark.parametrize("B,HI,DI,S,K,sink,window,chunk", [
    (3, 4, 16, 100, 24, 2, 3, 32),  # several chunks
    (5, 3, 20, 257, 40, 0, 0, 64),  # S not a multiple of the chunk, odd head count and dim
    (2, 5, 8, 70, 100, 1, 1, 32),  # K above every row's visible count: -1 padding
])
def test_decode_select_on_fp8_keys_equals_reference(B, HI, DI, S, K, sink, window, chunk):
    """fp8 keys whose scales are powers of two and whose queries are small integers: every score is
    exact in either order of the arithmetic, so the kernel must pick exactly the reference's keys."""
    g = torch.Generator().manual_seed(B * S + K)
    q = torch.randint(-2, 3, (B, HI, DI), generator=g).float()
    w = torch.randint(-1, 3, (B, HI), generator=g).float()
    k8 = (torch.randint(-16, 17, (B, S, DI), generator=g).float() / 4).to(torch.float8_e4m3fn)
    scale = 2.0 ** torch.randint(-3, 3, (B, S), generator=g).float()
    pos = torch.randint(0, S, (B,), generator=g)
    pos[0] = S - 1
    ref = indexer_topk_decode_naive(q, w, k8, pos, K, sink=sink, window=window, k_scale=scale)
    deq = indexer_topk_decode_naive(q, w, k8.float() * scale[..., None], pos, K, sink=sink, window=window)
    assert torch.equal(ref, deq)  # the scale after the head sum = dequantized keys
    got = itd.indexer_topk_decode(q, w, k8, pos, K, sink=sink, window=window, chunk=chunk, k_scale=scale)
    assert torch.equal(got, ref)
    cache, sc = torch.zeros(B, S + 9, DI, dtype=torch.float8_e4m3fn), torch.ones(B, S + 9)
    cache[:, :S], sc[:, :S] = k8, scale
    got2 = indexer_topk_decode(q, w, cache[:, :S], pos, K, sink=sink, window=window, k_scale=sc[:, :S],
                               backend="triton")
    assert torch.equal(got2, ref)
    with pytest.raises(ValueError, match="fp8 index keys"):
        itd.indexer_topk_decode(q, w, k8.float(), pos, K, k_scale=scale)


def selection_overlap(q, w, k, pos, K, sink, window) -> float:
    """Mean fraction of the bf16 keys' selection that fp8 keys select too (the reference, both)."""
    a = indexer_topk_decode_naive(q, w, k, pos, K, sink=sink, window=window)
    k8, scale = quantize_index_keys(k)
    b = indexer_topk_decode_naive(q, w, k8, pos, K, sink=sink, window=window, k_scale=scale)
    hits = [len(set(x[x >= 0].tolist()) & set(y[y >= 0].tolist())) / max(1, int((x >= 0).sum()))
            for x, y in zip(a, b)]
    return sum(hits) / len(hits)


def test_fp8_selection_overlaps_bf16_selection():
    """Index keys as the indexer makes them (LayerNorm'd, bf16), mixed-sign head weights, top-k 256 of 4K:
    e4m3 keys keep ~97% of the bf16 keys' selection (measured 0.97 here; the cut is where scores are
    densest, so the keys that change sides are near-ties)."""
    g = torch.Generator().manual_seed(3)
    B, HI, DI, S, K = 4, 4, 64, 4096, 256
    q = (torch.randn(B, HI, DI, generator=g) * DI ** -0.5).bfloat16()
    w = torch.randn(B, HI, generator=g).bfloat16()
    k = torch.nn.functional.layer_norm(torch.randn(B, S, DI, generator=g), (DI,)).bfloat16()
    pos = torch.tensor([S - 1, S - 1, 3000, 1500])
    assert selection_overlap(q, w, k, pos, K, 4, 64) > 0.93
