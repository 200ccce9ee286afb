"""The compiled decode step of the rollout engine (forward.py + compiled.py) on a CPU, float32, tiny
models. Compilation uses dynamo's `aot_eager` backend here (dynamo tracing, functionalization and
our custom ops, as with inductor, but no code generation: an inductor compile of even the tiny
model takes ~20 s per graph on a CI CPU). The inductor path is checked on a GPU (benchmarks/results)."""

import copy

import pytest
import torch

from sparse_rl.modelinit import ModelInitConfig, init_model
from sparse_rl.rl.rollout import RolloutEngine, SamplingParams
from sparse_rl.sparse.config import SparseConfig
from sparse_rl.sparse.convert import ConvertConfig, convert
from sparse_rl.sparse.loader import load_model

BACKEND = "aot_eager"


@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    init_model(root / "dense", ModelInitConfig(arch="qwen2", size="tiny", seed=1))  # qwen2: q/k/v biases
    sc = SparseConfig(topk=12, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
    convert(root / "dense", root / "sparse", ConvertConfig(sparse=sc, seed=3))
    return root / "sparse"


def _engine(model, compile, max_batch=3, **kw):
    return RolloutEngine(model, None, max_batch=max_batch, max_seq_len=96, eos_token_ids=[], bucket=16,
                         compile=compile, compile_backend=BACKEND, **kw)


def _prompts(seed=0, lengths=(5, 11, 3, 14)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in lengths]


def _filled_cache(eng, seed=0):
    cache = eng._ensure_cache(96)
    g = torch.Generator().manual_seed(seed)
    for t in (cache.k, cache.v, cache.idx):
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


@torch.inference_mode()
def test_compiled_step_equals_eager_every_bucket_one_graph(sparse_dir):
    """Dense and sparse (top-k 12 < S: a real selection), buckets 16..96 with slots at different
    positions: compiled == eager, and S is dynamic: one graph per mode (sparse: one more for the
    S <= top-k variant, which keeps every visible key) whatever the bucket."""
    model = load_model(sparse_dir, attention="sparse")
    eng = _engine(model, compile=True)
    r = eng.runner
    cache = _filled_cache(eng)
    tok = torch.tensor([5, 7, 9])
    for mode, graphs in (("dense", 1), ("sparse", 3)):  # S = 8 <= top-k: the short variant
        for S in (8, 16, 32, 48, 80, 96):
            pos = torch.tensor([S - 1, S // 2, 3])
            a = r.decode_eager(cache, tok, pos, S, mode)
            b = r.decode(cache, tok, pos, S, mode)
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        assert r.compile_stats["graphs"] == graphs, r.compile_stats
    assert r.compile and r.compile_error is None and r.compile_stats["symbols"] == 1  # S, nothing else


@torch.inference_mode()
def test_second_engine_with_another_batch_compiles_static_batch(sparse_dir):
    """Dynamo's automatic-dynamic state is shared by every runner's copy of the step (keyed by file,
    line and name): without explicit static marks the second engine's graph was dynamic in the batch
    and the cache shapes too."""
    model = load_model(sparse_dir, attention="dense")
    for B in (2, 4):
        eng = _engine(model, compile=True, max_batch=B)
        cache = eng._ensure_cache(96)
        out = eng.runner.decode(cache, torch.zeros(B, dtype=torch.long), torch.full((B,), 5), 16, "dense")
        assert out.shape[0] == B
        assert eng.runner.compile_stats["graphs"] == 1 and eng.runner.compile_stats["symbols"] == 1


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_greedy_generation_with_compile_equals_without(sparse_dir, mode):
    model = load_model(sparse_dir, attention=mode)
    p = SamplingParams(temperature=0, max_new_tokens=24)  # 14 + 24 tokens: buckets 16..48, past top-k 12
    prompts = _prompts(1)
    ref = _engine(model, compile=False).generate(prompts, p)
    eng = _engine(model, compile=True)
    got = eng.generate(prompts, p)
    assert eng.runner.compile and eng.runner.compile_stats["graphs"] >= 1
    for a, b in zip(ref, got):
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)


@torch.inference_mode()
def test_inplace_weight_update_is_seen_by_compiled_step(sparse_dir, tmp_path):
    """Parameters are inputs of the compiled graph, not constants: an in-place change (an optimizer
    step, `load_state_dict`, a LoRA merge) changes the next step, with no recompilation."""
    model = load_model(sparse_dir, attention="sparse")
    eng = _engine(copy.deepcopy(model), compile=True)
    r = eng.runner
    cache = _filled_cache(eng)
    tok, pos = torch.tensor([5, 7, 9]), torch.tensor([40, 20, 3])
    before = r.decode(cache, tok, pos, 48, "sparse").clone()
    graphs = r.compile_stats["graphs"]
    w = r.layers[1].mlp.down_proj.weight
    w.mul_(1.5)  # in place, as an optimizer step would
    after = r.decode(cache, tok, pos, 48, "sparse").clone()
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, r.decode_eager(cache, tok, pos, 48, "sparse"), atol=1e-5, rtol=1e-5)
    # a whole new state dict through the engine
    init_model(tmp_path / "other", ModelInitConfig(arch="qwen2", size="tiny", seed=5))
    other = load_model(tmp_path / "other")
    eng.load_state_dict(other.state_dict())
    new = r.decode(cache, tok, pos, 48, "dense")
    torch.testing.assert_close(new, r.decode_eager(cache, tok, pos, 48, "dense"), atol=1e-5, rtol=1e-5)
    assert r.compile_stats["graphs"] == graphs + 1  # + the dense graph; nothing recompiled for new weights


def test_lora_merge_and_live_peft_model_with_compile(sparse_dir):
    peft = pytest.importorskip("peft")
    model = load_model(sparse_dir, attention="dense")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    pm = peft.get_peft_model(copy.deepcopy(model), cfg)
    p = SamplingParams(temperature=0, max_new_tokens=20)
    prompts = _prompts(2, (6, 9))
    ref = _engine(pm, compile=False).generate(prompts, p)
    live = _engine(pm, compile=True)  # the adapters run inside the compiled step
    assert [c.tokens for c in live.generate(prompts, p)] == [c.tokens for c in ref]
    assert live.runner.compile_error is None
    merged = _engine(copy.deepcopy(model), compile=True)
    merged.generate(prompts, p)  # compile before the merge
    merged.load_lora(pm)
    assert [c.tokens for c in merged.generate(prompts, p)] == [c.tokens for c in ref]


def test_failed_compilation_falls_back_to_eager(sparse_dir):
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    model = load_model(sparse_dir, attention="sparse")
    p = SamplingParams(temperature=0, max_new_tokens=12)
    ref = _engine(model, compile=False).generate(_prompts(3), p)
    eng = RolloutEngine(model, None, max_batch=3, max_seq_len=96, eos_token_ids=[], compile=True,
                        compile_backend=broken)
    got = eng.generate(_prompts(3), p)
    assert [c.tokens for c in got] == [c.tokens for c in ref]
    assert not eng.runner.compile and "no compiler here" in eng.runner.compile_error


def test_compile_default_off_and_env_override(sparse_dir, monkeypatch):
    model = load_model(sparse_dir, attention="dense")
    assert not RolloutEngine(model, None).runner.compile
    monkeypatch.setenv("SPARSE_RL_COMPILE", "1")
    assert RolloutEngine(model, None).runner.compile
    assert not RolloutEngine(model, None, compile=False).runner.compile


def test_generate_cli_compile_flag(tiny_model_dir, tmp_path, monkeypatch):
    """`sparse-rl generate --compile` compiles the engine's step (same greedy output as --no-compile);
    the flag does not outlive the call."""
    import json
    import os

    from typer.testing import CliRunner

    from sparse_rl.cli.main import app
    from sparse_rl.rl.rollout import forward

    runners = []
    init = forward.ModelRunner.__init__

    def spy(self, *a, **kw):
        init(self, *a, **{**kw, "compile_backend": BACKEND})
        runners.append(self)

    monkeypatch.setattr(forward.ModelRunner, "__init__", spy)
    monkeypatch.delenv("SPARSE_RL_COMPILE", raising=False)
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "2+2="}) + "\n" + json.dumps({"id": "b", "prompt": "hello"}) + "\n")
    outs = {}
    for flag in ("--compile", "--no-compile"):
        out = tmp_path / f"{flag}.jsonl"
        res = CliRunner().invoke(app, ["generate", str(tiny_model_dir), "--prompts", str(src), "--out", str(out),
                                       "--temperature", "0", "--max-new-tokens", "10", "--device", "cpu", flag])
        assert res.exit_code == 0, res.output
        outs[flag] = [json.loads(x)["tokens"] for x in out.read_text().splitlines()]
        r = runners[-1]
        assert r.compile == (flag == "--compile") and (r.compile_stats["graphs"] > 0) == (flag == "--compile")
        assert r.compile_error is None
        assert "SPARSE_RL_COMPILE" not in os.environ
    assert outs["--compile"] == outs["--no-compile"]


def test_compile_step_bench_cpu():
    """The GPU comparison script on the tiny shape: rows for every mode and context, compiled == eager."""
    from sparse_rl.bench.rollout import compile_step_bench, markdown_compile

    res = compile_step_bench(shape="tiny", batches=(2,), contexts=(8, 40), topk=16, index_dim=16, dtype="float32",
                             device="cpu", reps=2, compile_backend=BACKEND, log=lambda m: None)
    assert not res["errors"]
    assert [(r["mode"], r["context"]) for r in res["rows"]] == [("dense", 8), ("dense", 40), ("sparse", 8),
                                                                ("sparse", 40)]
    assert all(r["logits_max_abs_diff"] == 0 and r["compiled_ok"] for r in res["rows"])
    assert "| 2 | sparse | 40 |" in markdown_compile(res)


def test_fp8_index_keys_compiled_equal_eager(tmp_path):
    """fp8 index keys in the compiled step: the key quantized in the graph (`ops.quantize_index_keys`,
    written with its scale by index_put_) gives the eager step's tokens and log-probs."""
    init_model(tmp_path / "dense", ModelInitConfig(arch="qwen2", size="tiny", seed=1))
    sc = SparseConfig(topk=12, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0],
                      index_dtype="fp8")
    convert(tmp_path / "dense", tmp_path / "fp8", ConvertConfig(sparse=sc, seed=3))
    model = load_model(tmp_path / "fp8", attention="sparse")
    p = SamplingParams(temperature=0, max_new_tokens=20)
    prompts = _prompts(2, (14, 6))
    ref = _engine(model, compile=False).generate(prompts, p)
    eng = _engine(model, compile=True)
    got = eng.generate(prompts, p)
    assert eng.runner.compile and eng.runner.compile_error is None and eng.cache.idx_scale is not None
    for a, b in zip(ref, got):
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
