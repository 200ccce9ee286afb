"""The decode step's memory floor (`bench.floor`): byte counts by hand, the integration rule, and the
weights a step reads on tied and untied models."""

import pytest
import torch

from sparse_rl.bench.floor import SHAPES, build_model, generation_floor_s, integrate_steps, step_bytes, weight_bytes


def test_step_bytes_qwen3_4b_by_hand():
    s = SHAPES["qwen3-4b"]
    W = 8_000_000_000
    kv_row = 2 * 8 * 128 * 2  # K and V, 8 heads x 128 dims, bf16: 4 KB per token and layer
    d = step_bytes(s, W, B=32, ctx=16384, mode="dense")
    assert d["kv"] == 32 * 36 * 16384 * kv_row and d["index"] == 0 and d["total"] == W + d["kv"]
    sp = step_bytes(s, W, B=32, ctx=16384, mode="sparse", topk=2048, index_dim=64, dense_layers=(0, 1))
    assert sp["kv"] == 32 * (2 * 16384 + 34 * 2048) * kv_row
    assert sp["index"] == 32 * 34 * 16384 * 128
    # below top-k the sparse layers read every live row, as dense ones do, plus the index keys
    short = step_bytes(s, W, B=1, ctx=1000, mode="sparse", topk=2048)
    assert short["kv"] == 36 * 1000 * kv_row and short["index"] == 34 * 1000 * 128
    fp8 = step_bytes(s, W, B=1, ctx=1000, mode="sparse", index_bytes_per_key=64 + 4)
    assert fp8["index"] == 34 * 1000 * 68


def test_integrate_steps_is_exact_on_a_line():
    f = lambda c: 3.0 + 0.01 * c  # noqa: E731
    pts = [(200, f(200)), (1000, f(1000)), (5000, f(5000))]
    assert integrate_steps(pts, 128, 6000) == pytest.approx(sum(f(c) for c in range(129, 6001)))
    assert integrate_steps([(10, 2.0)], 0, 5) == 10.0


def test_generation_floor_sums_the_steps():
    s = SHAPES["tiny"]
    got = generation_floor_s(s, 1000, 2, 8, 5, "dense", bw=1e6)
    assert got == pytest.approx(sum(step_bytes(s, 1000, 2, c, "dense")["total"] for c in range(9, 14)) / 1e6)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3"])
def test_weight_bytes_counts_the_lm_head_once(name):
    s = SHAPES[name]
    m = build_model(s, 64, "cpu", torch.float32)
    n_all = sum(p.numel() for p in m.parameters())  # a tied table is listed once
    assert weight_bytes(m, "dense") == 4 * n_all
    if name == "tiny-qwen3":
        assert m.model.layers[0].self_attn.q_norm is not None and m.model.layers[0].self_attn.head_dim == s.head_dim


def test_weight_bytes_untied_skips_the_input_table():
    from dataclasses import replace

    s = replace(SHAPES["tiny-qwen3"], tied=False)
    m = build_model(s, 64, "cpu", torch.float32)
    n_all = sum(p.numel() for p in m.parameters())
    assert weight_bytes(m, "dense") == 4 * (n_all - s.vocab * s.hidden)
