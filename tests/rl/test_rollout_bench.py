"""`sparse-rl bench rollout` runs end to end on a CPU with the tiny shape (the numbers are not checked)."""

import json

from typer.testing import CliRunner

from sparse_rl.cli.main import app


def test_bench_rollout_cpu_smoke(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench", "rollout", "--shape", "tiny", "--batch", "2", "--prompt-len", "8",
                                   "--new-tokens", "6", "--long-new-tokens", "40", "--long-batch", "2", "--index-topk", "16",
                                   "--index-dim", "16", "--dtype", "float32", "--device", "cpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert not r["errors"]
    assert [(x["run"], x["mode"]) for x in r["rows"]] == [("hf_generate", "dense"), ("engine", "dense"),
                                                          ("long", "dense"), ("long", "sparse")]
    assert {"engine_vs_hf", "sparse_vs_dense_40"} <= set(r["summary"])
    assert "| long | sparse |" in res.stdout


def test_bench_rollout_step_rows_and_integrated_generations_cpu(tmp_path):
    """Qwen3-shaped tiny model: fixed-context step rows carry their floor, and a long run integrated from
    step times carries the floor's tokens/s and the summary's floor ratio."""
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench", "rollout", "--shape", "tiny-qwen3", "--no-hf", "--step-contexts", "24,40",
                                   "--step-batch", "2", "--latency-contexts", "24", "--long-new-tokens", "30",
                                   "--long-batches", "2", "--long-prompt-len", "6", "--whole", "integrate",
                                   "--topk", "16", "--index-dim", "16", "--dtype", "float32", "--device", "cpu",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert not r["errors"] and r["copy_bw_tb_s"] > 0
    steps = [x for x in r["rows"] if x["run"] == "step"]
    assert [(x["batch"], x["context"], x["mode"]) for x in steps] == [
        (2, 24, "dense"), (2, 24, "sparse"), (2, 40, "dense"), (2, 40, "sparse"), (1, 24, "dense"), (1, 24, "sparse")]
    assert all(x["floor_ms"] > 0 and abs(x["x_floor"] / (x["ms"] / x["floor_ms"]) - 1) < 0.01 for x in steps)
    longs = [x for x in r["rows"] if x["run"] == "long"]
    assert [(x["mode"], x["how"]) for x in longs] == [("dense", "integrated"), ("sparse", "integrated")]
    for x in longs:
        # both ends of the generation and both sides of top-k are timed
        assert {7, 36, 16} <= {c for c, _ in x["step_points"]}
        assert abs(x["tokens_per_s"] * x["seconds"] / 60 - 1) < 0.01 and x["floor_tokens_per_s"] > 0
    assert {"sparse_vs_dense_30", "floor_ratio_30", "ratio_over_floor_ratio_30"} <= set(r["summary"])
    assert "| long | sparse | 2 | 6 | 30 | integrated |" in res.stdout and "| sparse | 1 | 24 |" in res.stdout


def test_bench_rollout_rejects_mismatched_long_batches():
    res = CliRunner().invoke(app, ["bench", "rollout", "--shape", "tiny", "--long-new-tokens", "8,16",
                                   "--long-batches", "2", "--device", "cpu"])
    assert res.exit_code == 2 and "--long-batches" in res.output


def test_bench_rollout_rejects_zero_select_streams():
    res = CliRunner().invoke(app, ["bench", "rollout", "--shape", "tiny", "--select-streams", "0", "--device", "cpu"])
    assert res.exit_code == 2 and "--select-streams must be >= 1" in res.output


def test_bench_fill_gives_index_keys_whatever_the_mode():
    """`_Bench.fill` on an engine in dense mode (sparse layers attached): the cache gets random index keys as well as
    K/V (a dense-mode cache has none, and sparse steps would read all-zero keys), and the engine is back in dense mode."""
    from sparse_rl.bench.rollout import BenchRolloutConfig, _Bench

    b = _Bench(BenchRolloutConfig(shape="tiny", hf=False, topk=16, index_heads=2, index_dim=16, device="cpu",
                                  dtype="float32"), print, None)
    b.attach_sparse()
    eng = b.engine(2, 64)
    eng.set_attention("dense")
    b.fill(eng, 64)
    cache = eng.cache
    assert eng.mode == "dense" and cache.idx is not None
    assert all(float(t.abs().sum()) > 0 for t in (cache.k, cache.v, cache.idx))


def test_bench_rollout_fp8_index_keys_cpu(tmp_path):
    """`--index-dtype fp8`: the sparse layers cache e4m3 index keys with a scale a token, filled quantized (not zero),
    the floor counts d_I + 4 bytes a stored key instead of 2 d_I, the CLI's step rows run, and a bad dtype is a usage
    error."""
    import torch

    from sparse_rl.bench.rollout import DENSE_LAYERS, BenchRolloutConfig, _Bench

    kw = dict(shape="tiny-qwen3", hf=False, device="cpu", dtype="float32", topk=16, index_dim=16)
    b8, b16 = (_Bench(BenchRolloutConfig(index_dtype=dt, **kw), print, None) for dt in ("fp8", "bf16"))
    for b in (b8, b16):
        b.attach_sparse()
    eng = b8.engine(2, 48)
    b8.fill(eng, 48)
    cache = eng._ensure_cache(48)
    assert cache.idx.dtype == torch.float8_e4m3fn and bool((cache.idx_scale[2] > 0).all())
    assert cache.idx[2].float().abs().amax() > 0
    sparse_layers = b8.shape.layers - len(DENSE_LAYERS)
    assert b16.floor_bytes(2, 40, "sparse") - b8.floor_bytes(2, 40, "sparse") == 2 * 40 * sparse_layers * (32 - 20)
    assert b16.floor_bytes(2, 40, "dense") == b8.floor_bytes(2, 40, "dense")
    out = tmp_path / "fp8.json"
    res = CliRunner().invoke(app, ["bench", "rollout", "--shape", "tiny-qwen3", "--no-hf", "--step-contexts", "40",
                                   "--step-batch", "2", "--long-new-tokens", "none", "--topk", "16", "--index-dim",
                                   "16", "--index-dtype", "fp8", "--dtype", "float32", "--device", "cpu",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert not r["errors"] and r["config"]["index_dtype"] == "fp8"
    assert [x["mode"] for x in r["rows"] if x["run"] == "step"] == ["dense", "sparse"]
    res = CliRunner().invoke(app, ["bench", "rollout", "--shape", "tiny", "--index-dtype", "int4", "--device", "cpu"])
    assert res.exit_code == 2 and "--index-dtype int4" in res.output
