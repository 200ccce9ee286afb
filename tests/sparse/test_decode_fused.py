"""`ops.add_rmsnorm` and `ops.qk_norm_rope_cache`: the references equal the HF modules' own arithmetic
exactly (a Qwen3 decoder layer's norms and `apply_rotary_pos_emb`), and the Triton kernels (through
TRITON_INTERPRET=1 on the CPU) equal the references on odd sizes."""

import pytest
import torch

from sparse_rl.sparse.ops import add_rmsnorm, qk_norm_rope_cache


def _qwen3_layer(dtype):
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3 as mq

    conf = Qwen3Config(hidden_size=48, num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                       intermediate_size=64, vocab_size=50, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    layer = mq.Qwen3DecoderLayer(conf, 0).to(dtype)
    with torch.no_grad():  # non-trivial norm weights
        for n in (layer.input_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm):
            n.weight.uniform_(0.5, 1.5)
    rot = mq.Qwen3RotaryEmbedding(conf)
    return conf, layer, rot, mq.apply_rotary_pos_emb


def _tol(dtype):
    """Triton against the reference: fp32 statistics summed in another order; in bf16 a few ulps (the
    interpreter rounds bf16 by truncation, at each of the kernel's roundings)."""
    return dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_add_rmsnorm_equals_the_module(dtype, backend):
    conf, layer, _, _ = _qwen3_layer(dtype)
    g = torch.Generator().manual_seed(1)
    x, res = (torch.randn(5, 48, generator=g).to(dtype) for _ in range(2))
    norm = layer.input_layernorm
    y, h = add_rmsnorm(x, res, norm.weight, norm.variance_epsilon, backend=backend)
    ref_h = res + x
    with torch.no_grad():
        ref_y = norm(ref_h)
    if backend == "torch" or dtype == torch.float32:
        assert torch.equal(h, ref_h)
    else:  # the interpreter rounds bf16 by truncation, the GPU to nearest
        torch.testing.assert_close(h, ref_h, atol=0, rtol=1e-2)
    if backend == "torch":
        assert torch.equal(y, ref_y)
    else:  # fp32 statistics summed in another order
        torch.testing.assert_close(y, ref_y, **_tol(dtype))
    y0, h0 = add_rmsnorm(x, None, norm.weight, norm.variance_epsilon, backend=backend)
    assert h0 is x or torch.equal(h0, x)
    with torch.no_grad():
        torch.testing.assert_close(y0, norm(x), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_cache_equals_the_module(dtype, backend, norm):
    conf, layer, rot, apply_rope = _qwen3_layer(dtype)
    attn = layer.self_attn
    B, H, H_kv, D, S = 3, 3, 1, 16, 13
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, h, D, generator=g).to(dtype) for h in (H, H_kv, H_kv))
    pos = torch.tensor([0, 7, 12])
    cos, sin = rot(q, pos[:, None])  # [B, 1, D]
    kc, vc = (torch.full((B, S, H_kv, D), float("nan"), dtype=dtype) for _ in range(2))
    with torch.no_grad():
        qn, kn = (attn.q_norm(q), attn.k_norm(k)) if norm else (q, k)
        rq, rk = apply_rope(qn[:, None], kn[:, None], cos, sin, unsqueeze_dim=2)
    got = qk_norm_rope_cache(q, k, v, attn.q_norm.weight if norm else None, attn.k_norm.weight if norm else None,
                             attn.q_norm.variance_epsilon, cos[:, 0], sin[:, 0], pos, kc, vc, backend=backend)
    ar = torch.arange(B)
    tol = dict(atol=0, rtol=0) if backend == "torch" else _tol(dtype)
    torch.testing.assert_close(got, rq[:, 0], **tol)
    torch.testing.assert_close(kc[ar, pos], rk[:, 0], **tol)
    assert torch.equal(vc[ar, pos], v)
    written = torch.zeros(B, S, dtype=torch.bool)
    written[ar, pos] = True
    assert torch.isnan(kc[~written]).all() and torch.isnan(vc[~written]).all()  # nothing else written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_silu_mul_equals_the_mlp(dtype, backend):
    """One gate/up GEMM's output through `ops.silu_mul`, then down_proj: the Qwen3 MLP's output."""
    from sparse_rl.sparse.ops import silu_mul

    conf, layer, _, _ = _qwen3_layer(dtype)
    mlp = layer.mlp
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        gu = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], 1)
        got = silu_mul(gu, backend=backend)
        ref = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
    tol = dict(atol=0, rtol=0) if backend == "torch" else _tol(dtype)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(mlp.down_proj(got), mlp(x), **tol)


@pytest.mark.parametrize("dtype,HI,DI,rope_dim,affine,fp8,norm", [
    (torch.float32, 3, 20, 8, True, False, True),  # odd index heads and dim
    (torch.bfloat16, 4, 64, 32, True, False, True),
    (torch.float32, 5, 16, 0, False, False, False),  # no index RoPE, LayerNorm without weight / bias, no q/k norm
    (torch.bfloat16, 4, 32, 16, True, True, True),  # fp8 index keys with their scales
])
def test_qk_rope_indexer_decode_equals_the_two_launches(dtype, HI, DI, rope_dim, affine, fp8, norm):
    """One launch for a sparse layer's q/k norm + RoPE + K/V cache write and its indexer's per-token work
    (`ops.qk_rope_indexer_decode`): the Triton kernel (interpreter) gives exactly what `qk_norm_rope_cache` and
    `indexer_decode` give as two launches, every cache row written where those write it and nowhere else; the
    reference path is the two references."""
    from sparse_rl.sparse.ops import indexer_decode, qk_rope_indexer_decode

    g = torch.Generator().manual_seed(HI * DI + rope_dim)
    B, H, H_kv, D, S = 5, 7, 1, 16, 23
    q, k, v = (torch.randn(B, n, D, generator=g).to(dtype) for n in (H, H_kv, H_kv))
    qw, kw = (torch.rand(D, generator=g).add(0.5).to(dtype) for _ in range(2)) if norm else (None, None)
    ang = torch.rand(B, D // 2, generator=g) * 10
    cos, sin = (torch.cat([f, f], -1).to(dtype) for f in (ang.cos(), ang.sin()))
    zq, zk, zw = (torch.randn(B, n, generator=g).to(dtype) for n in (HI * DI, DI, HI))
    lnw, lnb = (torch.randn(DI, generator=g).to(dtype) for _ in range(2)) if affine else (None, None)
    pos = torch.tensor([22, 0, 9, 9, 3])
    idt = torch.float8_e4m3fn if fp8 else dtype

    def caches():
        return (torch.full((B, S, H_kv, D), 5.0, dtype=dtype), torch.full((B, S, H_kv, D), 5.0, dtype=dtype),
                torch.zeros(B, S, DI, dtype=idt), torch.zeros(B, S) if fp8 else None)

    for backend in ("torch", "triton"):
        kc, vc, ic, isc = caches()
        qo, qi, wi = qk_rope_indexer_decode(q, k, v, qw, kw, 1e-6, cos, sin, pos, kc, vc, zq, zk, zw, lnw, lnb, 1e-5,
                                            rope_dim, ic, isc, backend=backend)
        kc2, vc2, ic2, isc2 = caches()
        qo2 = qk_norm_rope_cache(q, k, v, qw, kw, 1e-6, cos, sin, pos, kc2, vc2, backend=backend)
        qi2, wi2 = indexer_decode(zq, zk, zw, cos, sin, lnw, lnb, 1e-5, rope_dim, pos, ic2, isc2, backend=backend)
        for a, b in ((qo, qo2), (qi, qi2), (wi, wi2), (kc, kc2), (vc, vc2), (ic.float(), ic2.float())):
            assert torch.equal(a, b), backend
        if fp8:
            assert torch.equal(isc, isc2)
        other = torch.arange(S)[None] != pos[:, None]  # [B, S]: every row but the one at pos stays as it was
        assert (kc[torch.arange(B), pos] != 5.0).any() and (kc[other] == 5.0).all() and (vc[other] == 5.0).all()
