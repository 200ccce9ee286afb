"""The decode select's CUDA kernel, a block or a cluster of blocks a row (`decode_cuda.row_select`), against its
PyTorch reference (`row_select_naive`) on the same scores, and that reference against the decode reference's rule.
The kernel has no CPU form (CUDA C++ compiled by NVRTC): its tests run where a GPU is, the reference's everywhere."""

import pytest
import torch

from sparse_rl.sparse.ops.indexer_topk import decode_cuda as dc

GPU = torch.cuda.is_available()


def _clusters():
    """The one-block kernel, and the cluster kernel at every size where the GPU has clusters (sm_90+)."""
    return (1, 2, 4, 8) if torch.cuda.get_device_capability() >= (9, 0) else (1,)


def _rows(B, S, g, kind, device="cpu"):
    """Scores as the score pass writes them: -inf before a row's first key (left padding), +inf on forced
    keys at the row's end, finite in between; kind picks ties (integers, ReLU zeros of either sign) or not."""
    if kind == "ints":
        x = torch.randint(-3, 3, (B, S), generator=g).float()
    elif kind == "zeros":
        x = torch.randn(B, S, generator=g).clamp(min=0) * torch.where(torch.rand(B, 1, generator=g) < 0.5, -1.0, 1.0)
    elif kind == "narrow":  # one exponent: the first radix level cannot split it
        x = 5 + 1e-3 * torch.randn(B, S, generator=g)
    else:
        x = torch.randn(B, S, generator=g)
    pos = torch.randint(0, S, (B,), generator=g)
    pos[0] = S - 1
    for b in range(B):
        x[b, : int(torch.randint(0, max(1, S // 4), (1,), generator=g))] = float("-inf")
        nf = int(torch.randint(0, 8, (1,), generator=g))
        p = int(pos[b])
        x[b, max(0, p - nf + 1): p + 1] = float("inf")
    return x.to(device), pos.to(device)


def _brute(x, pos, K):
    """Each row's keys ranked by (score, position) in Python: larger score first, the later key first on a tie."""
    out = torch.full((x.shape[0], K), -1, dtype=torch.int32)
    for b in range(x.shape[0]):
        vals = [(0.0 if v == 0 else v, i) for i, v in enumerate(x[b, : int(pos[b]) + 1].tolist()) if v != float("-inf")]
        keep = sorted(i for _, i in sorted(vals, reverse=True)[:K])
        out[b, : len(keep)] = torch.tensor(keep, dtype=torch.int32)
    return out


@pytest.mark.parametrize("kind", ["randn", "ints", "zeros", "narrow"])
def test_reference_keeps_the_rule(kind):
    g = torch.Generator().manual_seed(len(kind))
    x, pos = _rows(5, 300, g, kind)
    for K in (1, 17, 64, 400):
        assert torch.equal(dc.row_select_naive(x, pos, K), _brute(x, pos, K)), K


@pytest.mark.skipif(not GPU, reason="the CUDA kernel needs a GPU")
@pytest.mark.parametrize("kind", ["randn", "ints", "zeros", "narrow"])
@pytest.mark.parametrize("B,S,K", [(3, 1, 4), (5, 300, 4), (5, 300, 64), (4, 2304, 2048), (3, 16411, 2048), (2, 70001, 2048)])
def test_kernel_equals_reference(kind, B, S, K):
    """Rows shorter than K, a row of one key, odd lengths, rows longer than the shared-memory cache (70001),
    and the re-read path (cache_keys=0) on every shape; PDL launches alike."""
    g = torch.Generator().manual_seed(B * S + K)
    x, pos = _rows(B, S, g, kind, "cuda")
    ref = dc.row_select_naive(x, pos, K)
    for cluster in _clusters():
        for cache in (dc.CACHE_KEYS, 0):
            for pdl in (0, 2):
                got = dc.row_select(x, pos, K, pdl=pdl, cache_keys=cache, cluster=cluster)
                assert torch.equal(got, ref), (cluster, cache, pdl)


@pytest.mark.skipif(not GPU, reason="the CUDA kernel needs a GPU")
def test_kernel_in_a_cuda_graph_reads_pos_on_the_device():
    g = torch.Generator().manual_seed(4)
    x, pos = _rows(4, 5000, g, "randn", "cuda")
    static_pos = pos.clone()
    dc.row_select(x, static_pos, 256)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dc.row_select(x, static_pos, 256, pdl=2)
    for shift in (0, 7, 1000):
        static_pos.copy_((pos - shift).clamp(min=0))
        graph.replay()
        assert torch.equal(out, dc.row_select_naive(x, static_pos, 256)), shift


@pytest.mark.skipif(not GPU, reason="the CUDA kernel needs a GPU")
def test_cluster_kernel_in_a_cuda_graph_with_pdl_behind_a_writer():
    """The cluster form captured with PDL right after the kernel that writes its scores: it waits for them."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread-block clusters need sm_90")
    g = torch.Generator().manual_seed(5)
    x, pos = _rows(8, 9000, g, "zeros", "cuda")
    buf = torch.empty_like(x)
    buf.copy_(x)
    dc.row_select(buf, pos, 2048, cluster=4, pdl=2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        buf.copy_(x)
        out = dc.row_select(buf, pos, 2048, cluster=4, pdl=2)
    x.neg_()
    graph.replay()
    assert torch.equal(out, dc.row_select_naive(x, pos, 2048))


def test_launch_attributes_carry_their_values():
    """The driver reads an attribute's value from the struct's own bytes (a c_char field read back is a copy)."""
    import ctypes

    a = dc._attr(dc._CLUSTER_DIMENSION, 4, 1, 1)
    raw = ctypes.string_at(ctypes.addressof(a), ctypes.sizeof(a))
    assert raw[:4] == (4).to_bytes(4, "little") and raw[8:20] == b"".join(v.to_bytes(4, "little") for v in (4, 1, 1))
    b = dc._attr(dc._PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    assert ctypes.string_at(ctypes.addressof(b), 12)[8:12] == (1).to_bytes(4, "little")


def test_auto_cluster_fills_one_wave():
    """Up to 4 blocks a row while the rows' clusters fit the SMs and each block keeps 8K keys; 1 before sm_90."""
    assert dc.auto_cluster(16, 32768, 132, (9, 0)) == 4
    assert dc.auto_cluster(16, 65536, 132, (9, 0)) == 4
    assert dc.auto_cluster(32, 16384, 132, (9, 0)) == 2
    assert dc.auto_cluster(48, 32768, 132, (9, 0)) == 2
    assert dc.auto_cluster(200, 32768, 132, (9, 0)) == 1
    assert dc.auto_cluster(1, 8192, 132, (9, 0)) == 1
    assert dc.auto_cluster(1, 32768, 108, (8, 0)) == 1


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="CUDA"):
        dc.row_select(torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32), 4)
    from sparse_rl.sparse.ops.indexer_topk.decode_select import DecodeSelect

    with pytest.raises(ValueError, match="cuda_cluster 3"):
        DecodeSelect("cuda", cuda_cluster=3)


@pytest.mark.skipif(not GPU, reason="the CUDA kernel needs a GPU")
def test_indexer_topk_decode_cuda_equals_fine_on_the_same_scores():
    """impl="cuda" after the shared score pass selects exactly fine's keys (bf16 inputs, sink and window)."""
    from sparse_rl.sparse.ops.indexer_topk import decode as itd

    g = torch.Generator().manual_seed(9)
    B, S, K = 6, 5000, 2048
    q, w, k = torch.randn(B, 4, 64, generator=g), torch.randn(B, 4, generator=g), torch.randn(B, S, 64, generator=g)
    q, w, k = (t.cuda().bfloat16() for t in (q, w, k))
    pos = torch.randint(S // 3, S, (B,), generator=g).cuda().int()
    kw = dict(sink=4, window=64, score_block=64)
    assert torch.equal(itd.indexer_topk_decode(q, w, k, pos, K, impl="cuda", **kw),
                       itd.indexer_topk_decode(q, w, k, pos, K, impl="fine", **kw))


@pytest.mark.skipif(not GPU, reason="the CUDA kernel needs a GPU")
def test_kernel_reads_the_score_pass_span_of_visible_chunks_only():
    """span `[B, P, 2]` per `chunk` keys as the score pass writes it: chunks past a row's pos hold garbage (never
    written), which must not reach the row's extremes."""
    g = torch.Generator().manual_seed(6)
    B, S, CH = 5, 9000, 1024
    x, pos = _rows(B, S, g, "zeros", "cuda")
    P = -(-S // CH)
    span = torch.full((B, P, 2), 1e30, device="cuda")
    span[..., 1] = -1e30
    for b in range(B):
        for p in range(P):
            if p * CH <= int(pos[b]):
                blk = x[b, p * CH: min((p + 1) * CH, int(pos[b]) + 1)]
                fin = blk[torch.isfinite(blk)]
                span[b, p] = torch.stack([fin.max(), fin.min()]) if fin.numel() else torch.tensor(
                    [float("-inf"), float("inf")], device="cuda")
    for cluster in _clusters():
        got = dc.row_select(x, pos, 2048, span=span, chunk=CH, cluster=cluster, pdl=2)
        assert torch.equal(got, dc.row_select_naive(x, pos, 2048)), cluster


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="needs the CUDA toolkit's nvcc")
def test_source_compiles_for_sm90_in_64_registers_without_spills(tmp_path):
    """The kernel runs 1024 threads a block, so it must fit 64 registers a thread; more would spill (the
    launch bound caps it). Compiled by nvcc on a host without a GPU, as NVRTC compiles it on one."""
    import re
    import subprocess

    src = tmp_path / "k.cu"
    src.write_text(dc.SOURCE)
    res = subprocess.run(["nvcc", "-cubin", "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v", str(src),
                          "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", res.stderr)]
    assert regs and max(regs) <= 64, res.stderr
    assert "0 bytes spill stores" in res.stderr and "bytes spill stores" not in res.stderr.replace(
        "0 bytes spill stores", ""), res.stderr


def test_launch_packs_the_kernel_signature(monkeypatch):
    """The host side of a launch, on a CPU: `_launch` hands the driver the kernel's parameters in the order and
    kinds its CUDA signature declares (pointers, then ints), the grid of B clusters of C blocks, the shared
    memory, and the PDL / cluster attributes (the driver call itself recorded instead of made)."""
    import ctypes
    import re

    sig = re.search(r"row_topk\((.*?)\)\s*\{", dc.SOURCE, re.S).group(1)
    kinds = ["ptr" if "*" in p else "int" for p in sig.split(",")]
    seen = {}

    class Driver:
        def cuLaunchKernelEx(self, cfgp, func, params, extra):
            cfg = ctypes.cast(cfgp, ctypes.POINTER(dc._LaunchConfig)).contents
            p = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p * len(kinds))).contents
            seen["args"] = [ctypes.cast(p[i], ctypes.POINTER(ctypes.c_void_p if k == "ptr" else ctypes.c_int))
                            .contents.value for i, k in enumerate(kinds)]
            seen["grid"] = (cfg.gridDimX, cfg.blockDimX, cfg.sharedMemBytes)
            seen["attrs"] = {cfg.attrs[i].id: ctypes.string_at(ctypes.addressof(cfg.attrs[i]) + 8, 12)
                             for i in range(cfg.numAttrs)}
            return 0

    class Stream:
        cuda_stream = 0

    monkeypatch.setattr(dc, "_kernel", lambda dev: type("K", (), {"func": None})())
    monkeypatch.setattr(dc, "_libcuda", lambda: Driver())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    t = [torch.zeros(3, 64), torch.zeros(3, 2, 2), torch.zeros(3, dtype=torch.int32), torch.zeros(3, 16)]
    ints = [64, 16, 16, 32, 32, 2, 1]
    assert kinds == ["ptr"] * 4 + ["int"] * 7
    dc._launch(0, 3, 2, 128, t, ints, pdl=2, clusters=True)
    assert seen["args"] == [x.data_ptr() for x in t] + ints
    assert seen["grid"] == (6, dc.THREADS, 128)
    le = b"".join(v.to_bytes(4, "little") for v in (2, 1, 1))
    assert seen["attrs"] == {dc._PROGRAMMATIC_STREAM_SERIALIZATION: (1).to_bytes(4, "little") + bytes(8),
                             dc._CLUSTER_DIMENSION: le}
