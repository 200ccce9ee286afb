"""The rollout engine's decode step compiles with inductor under `compiled.INDUCTOR_PATCHES`.

Why it matters (GPU only, so not measurable here): every KV-cache write is a pointwise Triton kernel
whose mutated arguments are the whole cache tensors; with pointwise autotuning on, inductor's first
call of each such kernel benchmarks 2 configs and copies the whole cache to host memory and back
around every benchmark launch, a compile time that grows with batch x S_max (269 s at batch 64 vs
48 s at batch 16 on an H200). inductor's own code generation is replaced here by a recorder (an
inductor compile of even the tiny model takes ~20 s on a CI CPU): the test checks the setting the
kernels would be generated under, and that the step still equals the eager one."""

import pytest
import torch

from sparse_rl.modelinit import ModelInitConfig, init_model
from sparse_rl.rl.rollout import RolloutEngine
from sparse_rl.rl.rollout import compiled as C
from sparse_rl.sparse.loader import load_model


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile_inductor")
    init_model(root / "dense", ModelInitConfig(arch="qwen2", size="tiny", seed=1))
    return root / "dense"


@torch.inference_mode()
def test_inductor_compiles_the_step_without_pointwise_autotuning(dense_dir, monkeypatch):
    import torch._inductor.compile_fx as cfx
    import torch._inductor.config as icfg

    seen = []

    def recorder(gm, example_inputs, *a, **kw):
        seen.append(icfg.triton.autotune_pointwise)
        return gm.forward  # run the traced graph as it is

    monkeypatch.setattr(cfx, "compile_fx", recorder)
    default = icfg.triton.autotune_pointwise
    model = load_model(dense_dir)
    eng = RolloutEngine(model, None, max_batch=3, max_seq_len=64, eos_token_ids=[], bucket=16, compile=True,
                        compile_backend="inductor")
    r = eng.runner
    cache = eng._ensure_cache(64)
    g = torch.Generator().manual_seed(0)
    for t in (cache.k, cache.v):
        t.copy_(torch.randn(t.shape, generator=g))
    tok, pos = torch.tensor([5, 7, 9]), torch.tensor([31, 12, 3])
    a = r.decode_eager(cache, tok, pos, 32, "dense")
    b = r.decode(cache, tok, pos, 32, "dense")
    assert r.compile and r.compile_error is None and r.compile_stats["graphs"] == 1
    assert seen == [False], seen  # one graph, generated with pointwise autotuning off
    assert icfg.triton.autotune_pointwise == default  # only for this compile
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert C.INDUCTOR_PATCHES == {"triton.autotune_pointwise": False}
