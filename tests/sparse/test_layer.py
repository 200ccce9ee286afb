"""The sparse layer's public API (`sparse_rl.sparse.layer`): mode, top-k, config, the selector dispatch."""

import pytest
import torch

from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.sparse import layer
from sparse_rl.sparse.config import SparseConfig
from sparse_rl.sparse.ops import block_select, indexer_topk
from sparse_rl.sparse.patch import attach_sparse


def _model(arch="llama", sparse=True, **cfg):
    import transformers

    conf = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[arch](
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    conf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(conf).eval()
    if sparse:
        sc = dict(topk=8, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
        sc.update(cfg)
        attach_sparse(model, SparseConfig(**sc))
    return model


def test_set_topk_validates_and_updates_every_layer():
    model = _model()
    new = layer.set_topk(model, 5)
    assert new.topk == 5 and layer.sparse_config(model) is new
    assert all(s.cfg is new for s in layer.layer_states(model))
    with pytest.raises(UsageError, match=r"set_topk\(2\).*--sink \(1\) \+ --window \(2\) must not exceed --index-topk \(2\)"):
        layer.set_topk(model, 2)
    assert layer.sparse_config(model).topk == 5  # a refused top-k leaves the layers as they were
    with pytest.raises(SparseRLError, match="no sparse selector"):
        layer.set_topk(_model(sparse=False), 8)


def test_set_get_attention_round_trip():
    model = _model()
    assert layer.get_attention(model) == "dense"  # attach_sparse starts dense
    layer.set_attention(model, "sparse", backend="torch")
    assert layer.get_attention(model) == "sparse"
    states = layer.layer_states(model)
    assert [s.sparse for s in states] == [False, True, True]  # layer 0 is kept dense
    assert {s.backend for s in states} == {"torch"}
    layer.set_attention(model, "dense")
    assert layer.get_attention(model) == "dense" and not any(s.sparse for s in states)
    assert {s.backend for s in states} == {"torch"}  # backend kept when not given
    with pytest.raises(UsageError, match="attention mode 'fast'"):
        layer.set_attention(model, "fast")
    dense = _model(sparse=False)
    assert layer.get_attention(dense) == "dense" and layer.sparse_config(dense) is None
    layer.set_attention(dense, "dense")
    with pytest.raises(SparseRLError, match="no sparse selector"):
        layer.set_attention(dense, "sparse")
    assert [m.layer_idx for m in layer.sparse_layers(model)] == [1, 2]


def test_engine_mode_follows_the_layer_state():
    from sparse_rl.rl.rollout import RolloutEngine, SamplingParams

    model = _model()
    eng = RolloutEngine(model, None, max_batch=2, max_seq_len=32, eos_token_ids=[])
    assert eng.mode == "dense"
    layer.set_attention(model, "sparse")
    assert eng.mode == "sparse"
    eng.set_attention("dense")
    assert layer.get_attention(model) == "dense" and eng.mode == "dense"
    eng.set_attention("sparse")
    assert layer.get_attention(model) == "sparse"
    # and the engine then generates what the HF forward of the same (sparse) model computes
    prompt = [3, 9, 4, 11, 7, 2, 5, 8, 1, 6, 12, 3]
    got = eng.generate([prompt], SamplingParams(temperature=0, max_new_tokens=6))[0].tokens
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert got == ref
    with pytest.raises(UsageError):
        eng.set_attention("fast")


def test_inputs_live_in_the_state_and_are_consumed():
    model = _model()
    layer.set_attention(model, "sparse")
    seen = []
    mods = layer.sparse_layers(model)
    for m in mods:
        layer.set_recorder(m, lambda module, **t: seen.append((module.layer_idx, tuple(t["indices"].shape))))
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]))
    assert seen == [(1, (1, 5, 8)), (2, (1, 5, 8))]
    assert all(layer.layer_state(m).inputs is None for m in mods)
    assert not any(k.startswith("_srl") or k == "srl" for m in mods for k in vars(m))
    assert layer.set_recorder(mods[0], None) is not None


def test_select_dispatch_sequence_and_decode_agree():
    """The decode form (one row per query, each at its own position) selects what the sequence form
    selects for that query, for both selectors."""
    g = torch.Generator().manual_seed(0)
    B, T, H, Hkv, D, HI, DI = 2, 11, 4, 2, 8, 2, 16
    q, k = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, Hkv, D, generator=g)
    q_i, w = torch.randn(B, T, HI, DI, generator=g), torch.randn(B, T, HI, generator=g)
    k_i = torch.randn(B, T, DI, generator=g)
    st = layer.LayerState(cfg=SparseConfig(topk=5, sink=1, window=2, index_heads=HI, index_dim=DI), dense_layer=False,
                          mode="sparse", backend="torch")
    seq = layer.select(st, q, k, (q_i, w, k_i))
    assert torch.equal(seq, indexer_topk(q_i, w, k_i, 5, sink=1, window=2, backend="torch"))
    pos = torch.tensor([6, 10])
    ar = torch.arange(B)
    dec = layer.select(st, q[ar, pos], k, (q_i[ar, pos], w[ar, pos], k_i), pos=pos, S=T)
    for b in range(B):
        assert torch.equal(dec[b], seq[b, pos[b]])
    blk = layer.LayerState(cfg=SparseConfig(selector="block", block_size=2, topk_blocks=3, sink_blocks=1,
                                            recent_blocks=1), dense_layer=False, mode="sparse", backend="torch")
    seq = layer.select(blk, q, k)
    assert torch.equal(seq, block_select(q, k, 2, 3, sink_blocks=1, recent_blocks=1, backend="torch"))
    dec = layer.select(blk, q[ar, pos], k, pos=pos.tolist(), S=T)
    for b in range(B):
        assert torch.equal(dec[b], seq[b, pos[b]])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_rope_equals_the_model_modules(arch):
    import importlib

    from sparse_rl.rl.rollout.forward import apply_rotary

    model = _model(arch, sparse=False)
    hf = importlib.import_module(type(model.model.layers[0].self_attn).__module__).apply_rotary_pos_emb
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 5, 4, 8, generator=g), torch.randn(2, 5, 2, 8, generator=g)
    cos, sin = model.model.rotary_emb(q, torch.arange(5)[None].expand(2, 5))
    for got, ref in zip(apply_rotary(q, k, cos, sin), hf(q, k, cos, sin, unsqueeze_dim=2)):
        assert torch.equal(got, ref)
