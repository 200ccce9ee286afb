"""The chunked indexer losses against brute-force computations that materialise everything."""

import pytest
import torch

from sparse_rl.sparse.ops import indexer_topk, sparse_attention
from sparse_rl.sparse.ops.indexer_kl.naive import dense_lse, dense_target, selected_kl, warmup_kl

B, H, HKV, D, HI, DI = 2, 4, 2, 8, 3, 6


def _inputs(T, S=None, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    S = S or T
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype) * 1.5
    k = torch.randn(B, HKV, S, D, generator=g, dtype=dtype) * 1.5
    qi = torch.randn(B, T, HI, DI, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(B, T, HI, generator=g, dtype=dtype, requires_grad=True)
    ki = torch.randn(B, S, DI, generator=g, dtype=dtype, requires_grad=True)
    return q, k, qi, w, ki


def _brute_probs(q, k, scale, q_offset=0, kv_start=None):
    """Full `[B, H, T, S]` dense attention probabilities, causal (and left-padding) mask."""
    T, S = q.shape[2], k.shape[2]
    kk = k.repeat_interleave(H // HKV, 1)
    logits = torch.einsum("bhtd,bhsd->bhts", q, kk) * scale
    pos = torch.arange(T)[:, None] + q_offset
    s = torch.arange(S)[None]
    start = torch.zeros(B, dtype=torch.long) if kv_start is None else kv_start.long()
    vis = (s <= pos)[None] & (s[None] >= start[:, None, None])  # [B, T, S]
    return torch.softmax(logits.masked_fill(~vis[:, None], float("-inf")), -1).nan_to_num(0.0), vis


def _selected(idx, S):
    """`[B, T, S]` bool membership of the selected keys (-1 entries ignored)."""
    ii = idx.long()
    sel = torch.zeros(*ii.shape[:2], S + 1, dtype=torch.bool)
    sel.scatter_(-1, torch.where(ii >= 0, ii, S), True)
    return sel[..., :S]


def _brute_indexer(qi, w, ki, vis):
    sc = torch.einsum("bthd,bsd->bths", qi, ki).relu()
    sc = torch.einsum("bths,bth->bts", sc, w)
    return torch.log_softmax(sc.masked_fill(~vis, float("-inf")), -1)


@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("q_offset,kv_start", [(0, None), (0, [0, 3]), (4, [2, 0])])
def test_dense_target_chunks_equal_brute_force(chunk, q_offset, kv_start):
    T = 13
    q, k, *_ = _inputs(T, T + q_offset, seed=1)
    ks = None if kv_start is None else torch.tensor(kv_start)
    probs, vis = _brute_probs(q, k, 0.3, q_offset, ks)
    ref = probs.sum(1) / H  # [B, T, S]
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        got = dense_target(q, k, 0.3, t0, t1, q_offset, ks)
        Sc = got.shape[-1]
        assert Sc == min(T + q_offset, q_offset + t1)
        torch.testing.assert_close(got, ref[:, t0:t1, :Sc], atol=1e-12, rtol=1e-10)
        assert float(ref[:, t0:t1, Sc:].sum()) == 0.0  # the keys left out carry no mass
    # rows are L1-normalised over the visible keys
    has = vis.any(-1)
    torch.testing.assert_close(ref.sum(-1)[has], torch.ones(int(has.sum()), dtype=ref.dtype))


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_warmup_kl_value_grad_and_recall_equal_brute_force(chunk):
    T, scale = 11, 0.4
    kv = torch.tensor([0, 2])
    q, k, qi, w, ki = _inputs(T, seed=2)
    probs, vis = _brute_probs(q, k, scale, 0, kv)
    p = probs.sum(1) / H
    logq = _brute_indexer(qi, w, ki, vis)
    kl_rows = (torch.xlogy(p, p) - p * torch.where(vis, logq, torch.zeros_like(logq))).sum(-1)
    ref = kl_rows.sum()
    ref.backward()
    grads = [x.grad.clone() for x in (qi, w, ki)]
    for x in (qi, w, ki):
        x.grad = None
    idx = indexer_topk(qi.detach(), w.detach(), ki.detach(), 4, sink=1, window=1, kv_start=kv, backend="torch")
    stats = warmup_kl(q, k, qi, w, ki, scale=scale, indices=idx, kv_start=kv, chunk=chunk, grad_scale=1.0)
    torch.testing.assert_close(stats.kl, ref.detach(), atol=1e-10, rtol=1e-10)
    for x, g in zip((qi, w, ki), grads):
        torch.testing.assert_close(x.grad, g, atol=1e-10, rtol=1e-9)
    assert stats.n == int(vis.any(-1).sum())
    sel = _selected(idx, T)
    torch.testing.assert_close(stats.recall, (p * sel).sum(), atol=1e-10, rtol=1e-10)
    assert stats.kl > 0


def test_warmup_kl_is_zero_when_the_indexer_matches_a_uniform_target():
    # q = 0 gives uniform dense attention; an indexer with w = 0 gives uniform scores: KL must be 0
    T = 9
    q, k, qi, w, ki = _inputs(T, seed=3)
    stats = warmup_kl(torch.zeros_like(q), k, qi.detach(), torch.zeros_like(w), ki.detach(), scale=1.0)
    assert abs(float(stats.kl)) < 1e-12 and stats.n == B * T


@pytest.mark.parametrize("chunk", [2, 64])
def test_selected_kl_and_recall_equal_brute_force(chunk):
    T, K, scale = 12, 5, 0.35
    q, k, qi, w, ki = _inputs(T, seed=4)
    idx = indexer_topk(qi.detach(), w.detach(), ki.detach(), K, sink=1, window=2, backend="torch")
    _, lse = sparse_attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), idx, scale, backend="torch")
    probs, vis = _brute_probs(q, k, scale)
    sel = _selected(idx, T)
    # target: dense probabilities renormalised per head over the selected set, then head-averaged
    ph = probs * sel[:, None]
    p = (ph / ph.sum(-1, keepdim=True)).sum(1) / H
    logq = _brute_indexer(qi, w, ki, sel)
    ref = (torch.xlogy(p, p) - p * torch.where(sel, logq, torch.zeros_like(logq))).sum()
    ref.backward()
    grads = [x.grad.clone() for x in (qi, w, ki)]
    for x in (qi, w, ki):
        x.grad = None
    lse_d = dense_lse(q, k, scale, chunk=3)
    stats = selected_kl(q, k, qi, w, ki, idx, lse, scale=scale, lse_dense=lse_d, chunk=chunk, grad_scale=1.0)
    torch.testing.assert_close(stats.kl, ref.detach(), atol=1e-9, rtol=1e-9)
    for x, g in zip((qi, w, ki), grads):
        torch.testing.assert_close(x.grad, g, atol=1e-9, rtol=1e-8)
    recall = (probs * sel[:, None]).sum(-1).mean(1).sum()  # share of dense mass inside Sel, head-averaged
    torch.testing.assert_close(stats.recall, recall, atol=1e-10, rtol=1e-10)
    assert stats.n == B * T


def test_dense_lse_equals_logsumexp():
    T = 10
    q, k, *_ = _inputs(T, seed=5)
    kk = k.repeat_interleave(H // HKV, 1)
    logits = torch.einsum("bhtd,bhsd->bhts", q, kk) * 0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ref = torch.logsumexp(logits.masked_fill(~causal, float("-inf")), -1).transpose(1, 2)
    torch.testing.assert_close(dense_lse(q, k, 0.5, chunk=4), ref)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k norms before RoPE
def test_captured_target_equals_the_models_own_attention_probabilities(tmp_path, arch):
    """End to end: the (q, k) the warm-up captures give exactly the head-averaged attention
    probabilities that transformers' eager attention returns (RoPE, GQA, scaling, q/k norms)."""
    from transformers import AutoModelForCausalLM

    from sparse_rl.modelinit import ModelInitConfig, init_model
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.convert import ConvertConfig, convert
    from sparse_rl.sparse.loader import load_model
    from sparse_rl.sparse.train.hooks import capture_dense

    init_model(tmp_path / "d", ModelInitConfig(arch=arch, size="tiny", seed=3))
    convert(tmp_path / "d", tmp_path / "s", ConvertConfig(sparse=SparseConfig(
        topk=8, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])))
    model = load_model(tmp_path / "s")
    with torch.no_grad():  # sharper attention than the random init, so the comparison is not trivially uniform
        for layer in model.model.layers:
            a = layer.self_attn
            for lin in (a.q_norm, a.k_norm) if arch == "qwen3" else (a.q_proj, a.k_proj):  # qwen3 normalises q, k
                lin.weight.mul_(8)
    ids = torch.randint(5, 500, (2, 19), generator=torch.Generator().manual_seed(0))
    got = {}

    def grab(module, query, key, stash):
        got[module.layer_idx] = dense_target(query, key, module.scaling)

    with capture_dense(model, grab), torch.no_grad():
        logits = model(input_ids=ids).logits
    eager = AutoModelForCausalLM.from_pretrained(tmp_path / "s", attn_implementation="eager", dtype=torch.float32)
    eager.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        out = eager(input_ids=ids, output_attentions=True)
    torch.testing.assert_close(logits, out.logits, atol=1e-4, rtol=1e-4)  # capturing changes nothing (SDPA vs eager)
    assert sorted(got) == [1, 2, 3]
    for i, target in got.items():
        ref = out.attentions[i].sum(1) / out.attentions[i].shape[1]
        torch.testing.assert_close(target, ref, atol=1e-5, rtol=1e-4)  # fp32; earlier layers ran SDPA vs eager
        assert float(ref[:, 8:].max()) > 0.3  # peaked (uniform would be <= 1/9 there): positions are told apart
