"""`ModelRunner(skinny_impl="swapab")`: the engine's decode GEMMs (fused q/k/v, gate/up, o_proj, down) as the
swap-AB kernel (skinny_gemm/swapab.py, the interpreter on the CPU) give the log-probs of a teacher-forced
forward; the choice is checked and `set_skinny_gemm(names, impl)` changes it."""

import pytest
import torch

from sparse_rl.modelinit import ModelInitConfig, init_model
from sparse_rl.rl.rollout import RolloutEngine, SamplingParams, process_logits
from sparse_rl.sparse.config import SparseConfig
from sparse_rl.sparse.convert import ConvertConfig, convert
from sparse_rl.sparse.loader import load_model


@pytest.fixture(scope="module")
def llama_sw(tmp_path_factory):
    """A tiny sparse llama (test_rollout's: top-k 12 below the prompts' lengths, layer 0 dense)."""
    root = tmp_path_factory.mktemp("llama-sw")
    init_model(root / "dense", ModelInitConfig(arch="llama", size="tiny", seed=1))
    convert(root / "dense", root / "sparse", ConvertConfig(sparse=SparseConfig(
        topk=12, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0]), seed=3))
    return root / "sparse"


def _engine(model, max_batch=2, **kw):
    return RolloutEngine(model, None, max_batch=max_batch, max_seq_len=96, eos_token_ids=[], **kw)


def _prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in lengths]


def _teacher_forced(model, c, params):
    ids = torch.tensor([c.prompt_tokens + c.tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(c.prompt_tokens) - 1:-1]
    return process_logits(logits, params).gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]


def test_engine_on_swapab_gemms_equals_reference_forward(llama_sw, monkeypatch):
    from sparse_rl.sparse.ops.skinny_gemm import swapab

    model = load_model(llama_sw, attention="sparse")
    params = SamplingParams(temperature=0.7, max_new_tokens=4, seed=5)
    calls = []

    class Count:  # the kernel's launches (grids), counted; `ops.kernel` caches the wrapper, not this global
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    real = swapab._swapab_kernel
    monkeypatch.setattr(swapab, "_swapab_kernel", Count())
    monkeypatch.setenv("SPARSE_RL_BACKEND", "triton")
    eng = _engine(model, max_batch=2, fuse_projections=True,
                  runner_options={"skinny_gemm": True, "skinny_impl": "swapab", "pdl": 1})
    assert eng.runner.skinny_impl == "swapab" and eng.runner.pdl == 0  # PDL resolves off on a CPU
    outs = eng.generate(_prompts(2, lengths=(14, 9)), params)
    monkeypatch.setenv("SPARSE_RL_BACKEND", "torch")
    layers = eng.runner.n_layers
    # every decode step: four GEMMs a layer (q/k/v fused, o_proj, gate/up fused, down; distinct grids), 3 steps
    # after the prefill
    assert len(calls) >= 4 * layers * 3 and len(set(calls)) >= 3
    for c in outs:
        assert len(c.tokens) == 4
        torch.testing.assert_close(torch.tensor(c.logprobs), _teacher_forced(model, c, params), atol=1e-4, rtol=0)


def test_skinny_choice_is_checked_and_defaults(llama_sw):
    """The skinny GEMM choice: checked; None is the default (on a CPU no GEMM: `skinny_default` names GEMMs only
    on sm_90+ CUDA devices with PDL); swapab's default tiles; the PDL level that goes with swapab (2) only where
    PDL is supported (here 0)."""
    from sparse_rl.rl.rollout import forward

    assert forward.skinny_default("cpu") == frozenset() == forward.skinny_default("cpu", torch.float32)
    model = load_model(llama_sw, attention="sparse")
    with pytest.raises(ValueError, match="skinny_impl"):
        _engine(model, runner_options={"skinny_impl": "cublas"})
    with pytest.raises(ValueError, match="skinny_tiles"):
        _engine(model, runner_options={"skinny_tiles": {"o_proj": {"bm": 32}}})
    r = _engine(model).runner
    assert r.skinny_gemm == frozenset() and r.skinny_impl == "swapab" and r.skinny_tiles == forward.SKINNY_TILES
    assert r._pdl_default() == forward.PDL_DEFAULT and r.pdl == 0  # no GEMM as swapab: level 1 asked, 0 here
    r.set_skinny_gemm(("o_proj",), "splitk")
    assert r.skinny_impl == "splitk" and r.skinny_gemm == {"o_proj"} and r.skinny_tiles == {}
    assert r._pdl_default() == forward.PDL_DEFAULT
    r.set_skinny_gemm(True, None, {"gate_up": {"bw": 64}})  # impl None: the default, swapab
    assert r.skinny_impl == "swapab" and r.skinny_tiles == {"gate_up": {"bw": 64}}
    assert r._pdl_default() == forward.PDL_SWAPAB
    r.set_pdl(None)
    assert r.pdl == 0  # level 2 asked, PDL unsupported on a CPU
    with pytest.raises(ValueError, match="skinny_impl"):
        r.set_skinny_gemm(True, "mma")


def test_fused_silu_gives_the_logits_of_two_launches(llama_sw, monkeypatch, random_cache):
    """`ModelRunner(fuse_silu=True)` (the default) with the gate/up GEMM as swapab: SiLU(gate) * up in the GEMM's epilogue
    (`ops.skinny_silu_mul`, one launch a layer) gives bitwise the logits of the GEMM + `silu_mul` (interpreter; one
    eager sparse step of 2 rows at 20 and 14 keys on a random cache, bf16 so the roundings are the real ones); the
    fused kernel runs once a layer, the separate silu_mul not at all; without swapab gate/up the flag changes nothing."""
    from sparse_rl.rl.rollout import forward

    model = load_model(llama_sw, attention="sparse").bfloat16()
    eng = _engine(model, max_batch=2, fuse_projections=True,
                  runner_options={"skinny_gemm": True, "skinny_impl": "swapab"})
    r = eng.runner
    assert r.fuse_silu  # the default
    fused, plain = [], []
    real_f, real_p = forward.skinny_silu_mul, forward.silu_mul
    monkeypatch.setattr(forward, "skinny_silu_mul", lambda *a, **k: fused.append(1) or real_f(*a, **k))
    monkeypatch.setattr(forward, "silu_mul", lambda *a, **k: plain.append(1) or real_p(*a, **k))
    monkeypatch.setenv("SPARSE_RL_BACKEND", "triton")
    cache = random_cache(eng, 32, 9)
    tok, pos = torch.tensor([7, 99]), torch.tensor([19, 13])
    out = {}
    with torch.inference_mode():
        for on in (False, True):
            r.set_fuse_silu(on)
            del fused[:], plain[:]
            out[on] = r.decode_eager(cache, tok, pos, 20, "sparse")
            assert (len(fused), len(plain)) == ((r.n_layers, 0) if on else (0, r.n_layers))
        r.set_skinny_gemm(("o_proj",), "swapab")  # gate/up back on F.linear: silu_mul runs whatever fuse_silu says
        del fused[:], plain[:]
        r.decode_eager(cache, tok, pos, 20, "sparse")
        assert (len(fused), len(plain)) == (0, r.n_layers)
    monkeypatch.setenv("SPARSE_RL_BACKEND", "torch")
    assert torch.equal(out[True], out[False])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fused_post_norm_gives_the_logits_of_add_rmsnorm(llama_sw, monkeypatch, random_cache, backend):
    """`ModelRunner(fuse_norm=True)`: the residual adds + RMSNorms inside the swap-AB GEMMs (o_proj / down epilogues,
    gate/up / q/k/v prologues) instead of `add_rmsnorm`: one eager sparse step (2 rows at 20 and 14 keys,
    random cache, fp32) gives the unfused logits within fp32 summation order, on the kernels (interpreter) and on
    the reference ops; with it `add_rmsnorm` runs only for the first layer's input and the final norm (each down
    GEMM adds the residual for the next layer's q/k/v GEMM to normalize); off (the default) twice a layer + 1."""
    from sparse_rl.rl.rollout import forward

    model = load_model(llama_sw, attention="sparse")
    eng = _engine(model, max_batch=2, fuse_projections=True,
                  runner_options={"skinny_gemm": True, "skinny_impl": "swapab"})
    r = eng.runner
    assert not r.fuse_norm
    norms = []
    real = forward.add_rmsnorm
    monkeypatch.setattr(forward, "add_rmsnorm", lambda *a, **k: norms.append(1) or real(*a, **k))
    monkeypatch.setenv("SPARSE_RL_BACKEND", backend)
    cache = random_cache(eng, 32, 11)
    tok, pos = torch.tensor([7, 99]), torch.tensor([19, 13])
    out = {}
    with torch.inference_mode():
        for on in (False, True):
            r.set_fuse_norm(on)
            del norms[:]
            out[on] = r.decode_eager(cache, tok, pos, 20, "sparse")
            # on: the first layer's input norm and the final one only (the rest inside the GEMMs)
            assert len(norms) == (2 if on else 2 * r.n_layers + 1)
    monkeypatch.setenv("SPARSE_RL_BACKEND", "torch")
    torch.testing.assert_close(out[True], out[False], atol=1e-5, rtol=1e-5)


def test_tma_and_prefetch_tiles_give_the_default_logits(llama_sw, monkeypatch, random_cache):
    """`skinny_tiles` keywords "loads" ("tma": the weight through a tensor descriptor) and "prefetch" (its K slice into
    L2 before the PDL wait) at every site (the fused gate/up with SiLU * up too): one eager sparse step (bf16,
    interpreter) gives bitwise the default tiles' logits."""
    from sparse_rl.rl.rollout import forward

    model = load_model(llama_sw, attention="sparse").bfloat16()
    eng = _engine(model, max_batch=2, fuse_projections=True,
                  runner_options={"skinny_gemm": True, "skinny_impl": "swapab"})
    r = eng.runner
    monkeypatch.setenv("SPARSE_RL_BACKEND", "triton")
    cache = random_cache(eng, 32, 5)
    tok, pos = torch.tensor([7, 99]), torch.tensor([19, 13])
    tiles = {s: {**forward.SKINNY_TILES.get(s, {}), "loads": "tma", "prefetch": True} for s in forward.SKINNY}
    assert r.fuse_silu  # the gate/up site runs `skinny_silu_mul`
    with torch.inference_mode():
        base = r.decode_eager(cache, tok, pos, 20, "sparse")
        r.set_skinny_gemm(True, "swapab", tiles)
        assert torch.equal(r.decode_eager(cache, tok, pos, 20, "sparse"), base)


def test_fuse_merge_reaches_the_decode_attention(llama_sw, monkeypatch, random_cache):
    """`ModelRunner(fuse_merge=)` / `set_fuse_merge`: every decode attention of the eager step gets merge="fused" (the
    split partials merged inside the attention kernel; `tests/sparse/test_kernels.py` checks its values), and the
    logits stay those of the merge kernel; off (the default) "kernel"."""
    from sparse_rl.rl.rollout import forward

    model = load_model(llama_sw, attention="sparse")
    eng = _engine(model, max_batch=2, fuse_projections=True)
    r = eng.runner
    assert not r.fuse_merge
    seen = []
    real = forward.sparse_decode
    monkeypatch.setattr(forward, "sparse_decode", lambda *a, **k: seen.append(k["merge"]) or real(*a, **k))
    monkeypatch.setenv("SPARSE_RL_BACKEND", "triton")
    cache = random_cache(eng, 32, 4)
    tok, pos = torch.tensor([7, 99]), torch.tensor([19, 13])
    out = {}
    with torch.inference_mode():
        for on in (False, True):
            r.set_fuse_merge(on)
            del seen[:]
            out[on] = r.decode_eager(cache, tok, pos, 20, "sparse")
            # the sparse layers (layer 0 is dense: SDPA on a CPU)
            assert seen == ["fused" if on else "kernel"] * (r.n_layers - 1)
    assert torch.equal(out[True], out[False])
