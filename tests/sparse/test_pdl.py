"""Programmatic dependent launch (`ops/_backend.py: pdl_supported / resolve_pdl`, the `pdl=` argument of the
decode step's Triton kernels): resolved off on a CPU / under the interpreter / with a Triton that lacks it,
never an error; and, with the choice forced on, every kernel of the eager decode step waits in
`gdc_wait` first and gives the same results (TRITON_INTERPRET=1, where `gdc_wait` is replaced by a
recorder: the interpreter has no grid dependency control of its own)."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from sparse_rl.sparse.ops import _backend


def test_pdl_resolves_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    assert not _backend.pdl_supported("cpu")
    assert _backend.resolve_pdl(True, "cpu", default=0) == 0
    assert _backend.resolve_pdl(None, torch.device("cpu"), default=2) == 0
    with pytest.raises(ValueError, match="pdl"):
        _backend.resolve_pdl(3, "cpu", default=0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _backend.pdl_supported("cuda:0")  # no CUDA call is made to decide it


def test_triton_capability_guard(monkeypatch):
    """Triton 3.4+ (3.6 on the H200, 3.9 here) has `launch_pdl` and `gdc_wait`; a Triton without either reads
    as unsupported (so the caller launches plainly)."""
    from triton.backends.nvidia import compiler

    assert _backend._triton_has_pdl()

    class Old:  # a CUDAOptions without the launch option
        __dataclass_fields__ = {"num_warps": None}

    monkeypatch.setattr(compiler, "CUDAOptions", Old)
    assert not _backend._triton_has_pdl()
    monkeypatch.undo()
    monkeypatch.delattr(tl.extra.cuda, "gdc_wait")
    assert not _backend._triton_has_pdl()


def test_probe_failure_reads_as_unsupported(monkeypatch):
    """A launch the driver rejects (here: no CUDA at all) is False from the probe, not an exception."""
    _backend._pdl_probe.cache_clear()
    try:
        assert _backend._pdl_probe(0) is False or torch.cuda.is_available()
    finally:
        _backend._pdl_probe.cache_clear()


@pytest.fixture
def waits(monkeypatch, pdl_kernel_name):
    """Records the kernel (its function name) of every `gdc_wait` under the interpreter, and as ("launch", name)
    every `gdc_launch_dependents`."""
    got = []
    monkeypatch.setattr(tl.extra.cuda, "gdc_wait", lambda: got.append(pdl_kernel_name()))
    monkeypatch.setattr(tl.extra.cuda, "gdc_launch_dependents", lambda: got.append(("launch", pdl_kernel_name())))
    return got


def test_decode_ops_with_pdl_wait_first_and_equal_plain_launches(waits):
    """Each decode op's Triton wrapper with pdl=True: every launch waits, results bitwise those of pdl=False
    (odd sizes; the decode attention over 300 keys in 3 splits of 128, so its merge kernel runs too)."""
    from sparse_rl.sparse.ops.decode_fused import triton as F
    from sparse_rl.sparse.ops.indexer_decode.triton import indexer_decode
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_decode

    g = torch.Generator().manual_seed(0)
    B, N, H, H_kv, D, S = 3, 37, 4, 2, 8, 29
    x, r, w = torch.randn(B, N, generator=g), torch.randn(B, N, generator=g), torch.randn(N, generator=g)
    pos = torch.tensor([5, 28, 0])
    cos, sin = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)

    def run(pdl):
        out = list(F.add_rmsnorm(x, r, w, 1e-6, pdl=pdl))
        out.append(F.silu_mul(torch.randn(B, 2 * N, generator=torch.Generator().manual_seed(1)), pdl=pdl))
        kc, vc = torch.zeros(B, S, H_kv, D), torch.zeros(B, S, H_kv, D)
        q, k, v = (torch.randn(B, h, D, generator=torch.Generator().manual_seed(h)) for h in (H, H_kv, H_kv))
        out += [F.qk_norm_rope_cache(q, k, v, torch.ones(D), torch.ones(D), 1e-6, cos, sin, pos, kc, vc, pdl=pdl),
                kc, vc]
        ki = torch.zeros(B, S, 16)
        zq, zk, zw = (torch.randn(B, n, generator=torch.Generator().manual_seed(n)) for n in (2 * 16, 16, 2))
        out += [*indexer_decode(zq, zk, zw, cos, sin, None, None, 1e-6, 8, pos, ki, pdl=pdl), ki]
        idx = torch.randint(0, S, (B, 300), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
        out += list(sparse_decode(torch.randn(B, H, D, generator=torch.Generator().manual_seed(3)),
                                  torch.randn(B, S, H_kv, D, generator=torch.Generator().manual_seed(4)),
                                  torch.randn(B, S, H_kv, D, generator=torch.Generator().manual_seed(5)), idx,
                                  nsplit=3, pdl=pdl))
        return out

    plain = run(False)
    assert waits == []
    early = run(True)
    names = {"_add_rmsnorm_kernel", "_silu_mul_kernel", "_qk_rope_kernel", "_indexer_decode_kernel", "_fwd_kernel",
             "_merge_kernel"}
    assert set(waits) == names
    n = len(waits)
    trig = run(2)  # level 2: each program's wait, then its trigger
    assert waits[n::2] == waits[:n] and waits[n + 1::2] == [("launch", x) for x in waits[:n]]
    for a, b, c in zip(plain, early, trig):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("impl", ["fine", "split"])
def test_decode_select_with_pdl_equals_plain(waits, impl):
    """`DecodeSelect(pdl=True)`: the score pass and every fine / split pass wait; the same keys."""
    from sparse_rl.sparse.ops import indexer_topk_decode
    from sparse_rl.sparse.ops.indexer_topk.decode_select import DecodeSelect

    g = torch.Generator().manual_seed(7)
    B, HI, DI, S = 3, 2, 16, 83
    q, w, k = torch.randn(B, HI, DI, generator=g), torch.randn(B, HI, generator=g), torch.randn(B, S, DI, generator=g)
    pos = torch.tensor([82, 40, 70])
    kw = dict(sink=1, window=2, backend="triton")
    plain = indexer_topk_decode(q, w, k, pos, 24, select=DecodeSelect(impl), **kw)
    assert waits == []
    early = indexer_topk_decode(q, w, k, pos, 24, select=DecodeSelect(impl, pdl=True), **kw)
    want = {"_score_max", "_hist_chunk"} | ({"_sub_gather", "_resolve_write"} if impl == "fine"
                                            else {"_gather_chunk", "_thresh_write"})
    assert set(waits) == want
    assert torch.equal(plain, early)
    assert DecodeSelect(pdl=True).as_kwargs()["pdl"] == 1 and DecodeSelect().as_kwargs()["pdl"] == 0
    with pytest.raises(ValueError, match="pdl"):
        DecodeSelect(pdl=3)


def test_inductor_pdl_patch_is_a_real_config_key():
    """The compiled step's PDL switch (`compiled.inductor_pdl_patch`): a key inductor's config accepts (torch
    2.13 has `triton.enable_pdl`), or nothing where this torch lacks it."""
    import torch._inductor.config as inductor_config

    from sparse_rl.rl.rollout.compiled import inductor_pdl_patch

    patch = inductor_pdl_patch()
    assert patch in ({}, {"triton.enable_pdl": True})
    with inductor_config.patch(patch):
        assert getattr(inductor_config.triton, "enable_pdl", True)
