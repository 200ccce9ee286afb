"""Model-level equivalence: sparse with k >= L is dense; KV-cache decoding equals the full forward."""

import pytest
import torch

from sparse_rl.modelinit import ModelInitConfig, init_model
from sparse_rl.sparse.config import SparseConfig
from sparse_rl.sparse.convert import ConvertConfig, convert
from sparse_rl.sparse.layer import set_recorder, set_topk, sparse_layers
from sparse_rl.sparse.loader import load_model, set_attention
from sparse_rl.sparse.patch import cache_kwarg

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
L = 24


@pytest.fixture(scope="module", params=ARCHS)
def sparse_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    init_model(root / "dense", ModelInitConfig(arch=request.param, size="tiny", seed=1))
    sc = SparseConfig(topk=L + 8, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
    convert(root / "dense", root / "sparse", ConvertConfig(sparse=sc, seed=3))
    return root / "sparse"


def _batch(seed=0, pad=6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 500, (2, L), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0  # left padding in row 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def _logits(model, ids, mask, pos):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


def test_sparse_full_topk_equals_dense_with_left_padding(sparse_dir):
    model = load_model(sparse_dir, attention="sparse")
    ids, mask, pos = _batch()
    sparse = _logits(model, ids, mask, pos)
    set_attention(model, "dense")
    dense = _logits(model, ids, mask, pos)
    valid = mask.bool()
    torch.testing.assert_close(sparse[valid], dense[valid], atol=2e-5, rtol=1e-5)
    # the dense mode of a sparse dir is the plain transformers model
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(sparse_dir, dtype=torch.float32)
    torch.testing.assert_close(_logits(plain, ids, mask, pos)[valid], dense[valid], atol=2e-5, rtol=1e-5)


def test_small_topk_differs_and_padding_is_invisible(sparse_dir):
    model = load_model(sparse_dir, attention="sparse")
    set_topk(model, 6)
    ids, mask, pos = _batch(pad=6)
    sparse = _logits(model, ids, mask, pos)
    set_attention(model, "dense")
    dense = _logits(model, ids, mask, pos)
    assert (sparse[0, 10:] - dense[0, 10:]).abs().max() > 1e-3
    # the first 6 positions see at most 6 keys: still exact
    torch.testing.assert_close(sparse[0, :6], dense[0, :6], atol=2e-5, rtol=1e-5)
    # a left-padded row gives the same logits as the same tokens without padding
    set_attention(model, "sparse")
    alone = _logits(model, ids[1:, 6:], mask[1:, 6:], pos[1:, 6:])
    torch.testing.assert_close(sparse[1, 6:], alone[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_incremental_decoding_matches_full_forward(sparse_dir, mode):
    from transformers import DynamicCache

    model = load_model(sparse_dir, attention=mode)
    set_topk(model, 7)
    ids, mask, pos = _batch(seed=2, pad=4)
    full = _logits(model, ids, mask, pos)
    P = 10
    cache = DynamicCache()
    ck = cache_kwarg(model)
    with torch.no_grad():
        out = model(input_ids=ids[:, :P], attention_mask=mask[:, :P], position_ids=pos[:, :P],
                    use_cache=True, **{ck: cache})
        steps = [out.logits]
        for t in range(P, L):
            out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1],
                        use_cache=True, **{ck: cache})
            steps.append(out.logits)
    inc = torch.cat(steps, 1)
    valid = mask.bool()
    torch.testing.assert_close(inc[valid], full[valid], atol=3e-5, rtol=1e-5)


def test_block_selector_model(tmp_path):
    init_model(tmp_path / "d", ModelInitConfig(arch="qwen2", seed=4))
    sc = SparseConfig(selector="block", block_size=4, topk_blocks=3, sink_blocks=1, recent_blocks=1, dense_layers=[])
    convert(tmp_path / "d", tmp_path / "s", ConvertConfig(sparse=sc))
    assert not (tmp_path / "s" / "indexer.safetensors").exists()
    model = load_model(tmp_path / "s", attention="sparse")
    ids, mask, pos = _batch(pad=4)
    sparse = _logits(model, ids, mask, pos)
    set_attention(model, "dense")
    dense = _logits(model, ids, mask, pos)
    torch.testing.assert_close(sparse[0, :12], dense[0, :12], atol=2e-5, rtol=1e-5)  # <= 3 blocks visible
    assert (sparse[0, 16:] - dense[0, 16:]).abs().max() > 1e-3
    set_attention(model, "sparse")
    alone = _logits(model, ids[1:, 4:], mask[1:, 4:], pos[1:, 4:])
    torch.testing.assert_close(sparse[1, 4:], alone[0], atol=2e-5, rtol=1e-5)


def test_gradients_reach_model_and_indexer(sparse_dir):
    from sparse_rl.sparse.ops import indexer_scores

    model = load_model(sparse_dir, attention="sparse")
    set_topk(model, 6)
    model.train()
    rec = {}

    def recorder(module, **t):
        rec.setdefault("calls", []).append((module, t))

    for m in sparse_layers(model):
        set_recorder(m, recorder)
    ids, mask, pos = _batch()
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=ids)
    out.loss.backward()
    attn = model.model.layers[-1].self_attn
    assert attn.q_proj.weight.grad.abs().sum() > 0 and attn.v_proj.weight.grad.abs().sum() > 0
    module, t = rec["calls"][-1]
    q, w, k = module.indexer(t["hidden"].detach(), *t["position_embeddings"])
    s = indexer_scores(q, w, k, kv_start=t["kv_start"])
    torch.log_softmax(s, -1).nan_to_num(0.0, neginf=0.0).sum().backward()
    assert module.indexer.wq.weight.grad.abs().sum() > 0 and module.indexer.wk.weight.grad.abs().sum() > 0
