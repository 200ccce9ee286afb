"""The fused Triton warm-up KL (run by the Triton interpreter on the CPU) against the chunked torch path."""

import pytest
import torch

from sparse_rl.sparse.ops import indexer_topk
from sparse_rl.sparse.ops.indexer_kl.naive import dense_lse, warmup_kl
from sparse_rl.sparse.ops.indexer_kl.triton import warmup_kl_fused, warmup_kl_triton

B, D = 2, 8


def _inputs(T, S, H, HKV, HI, DI, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g) * 1.5
    k = torch.randn(B, HKV, S, D, generator=g) * 1.5
    qi = torch.randn(B, T, HI, DI, generator=g, requires_grad=True)
    w = torch.randn(B, T, HI, generator=g, requires_grad=True)
    ki = torch.randn(B, S, DI, generator=g, requires_grad=True)
    return q, k, qi, w, ki


def _reference(q, k, qi, w, ki, q_offset, idx=None):
    ref = warmup_kl(q, k, qi, w, ki, scale=0.3, indices=idx, q_offset=q_offset, grad_scale=0.5, chunk=5)
    grads = [x.grad.clone() for x in (qi, w, ki)]
    for x in (qi, w, ki):
        x.grad = None
    return ref, grads


# odd lengths; a KV offset; GQA groups of 2, 3 and 1; 1, 3 and 5 indexer heads; D_I below the tile width
@pytest.mark.parametrize("T,q_offset,H,HKV,HI,DI", [(37, 0, 4, 2, 3, 6), (21, 6, 3, 1, 1, 16), (33, 0, 2, 2, 5, 8)])
def test_fused_triton_warmup_kl_equals_the_chunked_torch_path(T, q_offset, H, HKV, HI, DI):
    S = T + q_offset
    q, k, qi, w, ki = _inputs(T, S, H, HKV, HI, DI, seed=7 + T)
    idx = indexer_topk(qi.detach(), w.detach(), ki.detach(), 6, q_offset=q_offset, sink=1, window=2, backend="torch")
    ref, g_ref = _reference(q, k, qi, w, ki, q_offset, idx)
    got = warmup_kl_triton(q, k, qi, w, ki, scale=0.3, indices=idx, q_offset=q_offset, grad_scale=0.5)
    torch.testing.assert_close(got.kl, ref.kl, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.recall, ref.recall, rtol=1e-5, atol=1e-5)
    assert got.n == ref.n
    for x, g in zip((qi, w, ki), g_ref):
        torch.testing.assert_close(x.grad, g, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bm,bn", [(16, 32), (32, 16)])
def test_fused_tiles_of_other_shapes_and_a_given_lse(bm, bn):
    """Unequal tiles move the masked/unmasked boundary; a caller-given dense lse replaces the lse pass;
    without grad_scale no gradient is computed."""
    T, q_offset = 45, 3
    q, k, qi, w, ki = _inputs(T, T + q_offset, 4, 2, 2, 8, seed=3)
    ref, g_ref = _reference(q, k, qi, w, ki, q_offset)
    lse = dense_lse(q, k, 0.3, q_offset=q_offset).transpose(1, 2)  # [B, H, T]
    kl, lse_out, grads = warmup_kl_fused(q, k, qi, w, ki, scale=0.3, q_offset=q_offset, grad_scale=0.5, lse=lse,
                                         config=(bm, bn, 4, 1), index_config=(bn, bm, 4, 1))
    torch.testing.assert_close(kl.sum().double(), ref.kl, rtol=1e-5, atol=1e-4)
    assert lse_out is lse
    for got, want in zip(grads, g_ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    kl2, lse2, none = warmup_kl_fused(q, k, qi, w, ki, scale=0.3, q_offset=q_offset, config=(bm, bn, 4, 1))
    assert none is None
    torch.testing.assert_close(kl2, kl, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse2, lse, rtol=1e-5, atol=1e-5)  # the kernel's own dense lse pass


def test_more_indexer_heads_than_the_kernel_holds_use_the_torch_path():
    T = 9
    q, k, qi, w, ki = _inputs(T, T, 2, 1, 9, 4, seed=1)
    ref, g_ref = _reference(q, k, qi, w, ki, 0)
    got = warmup_kl_triton(q, k, qi, w, ki, scale=0.3, grad_scale=0.5)
    torch.testing.assert_close(got.kl, ref.kl, rtol=1e-6, atol=1e-5)  # other query chunks
    for x, g in zip((qi, w, ki), g_ref):
        torch.testing.assert_close(x.grad, g, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="at most 8"):
        warmup_kl_fused(q, k, qi, w, ki, scale=0.3)


def test_public_entry_takes_the_backend():
    """`ops.warmup_kl(backend=...)`: "triton" is the fused kernel, "torch" the chunked reference (both
    back-propagate the same gradients); rows with left padding (kv_start) always take the reference."""
    from sparse_rl.sparse import ops

    T, q_offset = 13, 2
    q, k, qi, w, ki = _inputs(T, T + q_offset, 4, 2, 3, 8, seed=5)
    ref, g_ref = _reference(q, k, qi, w, ki, q_offset)
    for backend in ("triton", "torch"):
        got = ops.warmup_kl(q, k, qi, w, ki, scale=0.3, q_offset=q_offset, grad_scale=0.5, chunk=5, backend=backend)
        torch.testing.assert_close(got.kl, ref.kl, rtol=1e-5, atol=1e-4)
        for x, g in zip((qi, w, ki), g_ref):
            torch.testing.assert_close(x.grad, g, rtol=1e-4, atol=1e-5)
            x.grad = None
    kv_start = torch.tensor([0, 3])
    want = warmup_kl(q, k, qi.detach(), w.detach(), ki.detach(), scale=0.3, q_offset=q_offset, kv_start=kv_start)
    got = ops.warmup_kl(q, k, qi.detach(), w.detach(), ki.detach(), scale=0.3, q_offset=q_offset, kv_start=kv_start,
                        backend="triton")
    assert torch.equal(got.kl, want.kl)


def test_lse_attention_backend_is_an_argument():
    from sparse_rl.sparse.train.hooks import AttentionWithLse

    assert AttentionWithLse().backend == "auto" and AttentionWithLse("flash").backend == "flash"
    with pytest.raises(ValueError, match="expected one of auto, cudnn, flash"):
        AttentionWithLse("sdpa")
