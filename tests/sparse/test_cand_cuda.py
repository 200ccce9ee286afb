"""The prefill top-k's CUDA buffer select (cand_cuda.py): its rule against the Triton select on the CPU, the
kernel's search (histogram, bit steps, rank) and write replayed in Python on the CPU, and the kernel itself
against both on a GPU."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import pytest
import torch

from sparse_rl.sparse.ops.indexer_topk import cand_cuda
from sparse_rl.sparse.ops.indexer_topk import cand_topk as ct
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_naive

GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")


def _buffers(B, R, C, kind, seed=0, device="cpu"):
    """Packed buffers as the words gather writes them (high word the score's fp32 bits, low word the position,
    positions increasing along the row) with varied entry counts: -1 (flagged), <= K, and up to C."""
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        s = torch.randn(B, R, C, generator=g)
    elif kind == "ties":  # few distinct values: masses of equal scores at the k-th
        s = torch.randint(0, 6, (B, R, C), generator=g).float() * 0.25
    elif kind == "zeros":  # a ReLU indexer's scores: exact zeros of either sign beside positives
        s = torch.relu(torch.randn(B, R, C, generator=g))
        s = torch.where(torch.rand(B, R, C, generator=g) < 0.3, -s * 0.0, s)
    elif kind == "dense":  # one far outlier: the rest share one histogram bin (the kernel's bit steps)
        s = 1.0 + torch.randint(0, 5000, (B, R, C), generator=g).float() * 1e-6
        s[..., 3] = 1e30
    else:  # "forced": +inf sinks / window among them
        s = torch.randn(B, R, C, generator=g)
        s[..., :5] = float("inf")
        s[..., -40:] = float("inf")
    pos = torch.cumsum(torch.randint(1, 4, (B, R, C), generator=g), -1).to(torch.int32)
    val = (s.view(torch.int32).long() << 32) | pos.long()
    nrow = torch.randint(0, C + 1, (B, R), generator=g).to(torch.int32)
    nrow[:, 0], nrow[:, 1 % R] = C, -1
    return val.to(device), nrow.to(device)


def _okey(hi: int) -> int:
    u = 0 if hi == 0x80000000 else hi
    return (~u & 0xFFFFFFFF) if u >> 31 else (u | 0x80000000)


def _replay_row(words: list, n: int, K: int, CM: int = 32) -> list:
    """The kernel's algorithm for one row, step by step (a histogram of 11 bits below the highest differing one,
    bit steps in a bin of more than CM keys, the last <= CM ranked, then the write's offsets from the counts
    above / equal before each lane)."""
    if n <= K:
        return [w & 0xFFFFFFFF for w in words[:n]] + [-1] * (K - n)
    key = [_okey((w >> 32) & 0xFFFFFFFF) for w in words[:n]]
    lo, hi = min(key), max(key)
    smear = lo ^ hi
    for sh in (1, 2, 4, 8, 16):
        smear |= smear >> sh
    tau, low, c_up, open_n = lo & ~smear, smear, 0, n
    if smear:  # one histogram of the 11 bits below the highest differing one, the bin holding the K-th
        sh = max(0, smear.bit_length() - 1 - 10)
        hist = [0] * 2048
        for k in key:
            hist[(k & smear) >> sh] += 1
        acc, d = 0, 2047
        while acc + hist[d] < K:
            acc += hist[d]
            d -= 1
        tau, c_up, open_n, low = tau | (d << sh), acc, hist[d], (1 << sh) - 1
    bit = (low + 1) >> 1
    while bit and open_n > CM:  # a dense bin: one bit a step
        tot = sum(k >= (tau | bit) for k in key)
        if tot >= K:
            tau, open_n = tau | bit, tot - c_up
        else:
            c_up, open_n = tot, open_n - (tot - c_up)
        low, bit = bit - 1, bit >> 1
    n_gt, n_eq = c_up, open_n
    if open_n <= CM:
        open_ = [k for k in key if (k & ~low) == tau]
        want = K - c_up
        for v in open_:
            gt, ge = sum(u > v for u in open_), sum(u >= v for u in open_)
            if gt < want <= ge:
                tau, n_gt, n_eq = v, c_up + gt, ge - gt
    drop = n_eq - (K - n_gt)
    out, above, eq = [0] * K, 0, 0
    for k, w in zip(key, words):
        if k > tau or (k == tau and eq >= drop):
            out[above + max(0, eq - drop)] = w & 0xFFFFFFFF
        above += k > tau
        eq += k == tau
    return out


@pytest.mark.parametrize("kind", ["randn", "ties", "zeros", "forced", "dense"])
@pytest.mark.interpreter
def test_replayed_kernel_and_naive_rule_equal_the_triton_select(kind):
    """On the CPU: the Triton select (interpreter), `buffer_select_naive` and the kernel's algorithm replayed in
    Python give the same positions on every served row."""
    B, R, C, K = 2, 5, 96, 40
    val, nrow = _buffers(B, R, C, kind, seed=3)
    out = torch.full((B, R, K), -7, dtype=torch.int32)
    ct.cand_select(val, val, nrow, out, K, dataclasses.replace(ct.INTERPRET_CAND, packed=True, gather="words"))
    ref = cand_cuda.buffer_select_naive(val, nrow, K)
    served = nrow >= 0
    assert torch.equal(out[served], ref[served])
    assert (ref[~served] == -1).all()
    for b in range(B):
        for r in range(R):
            if nrow[b, r] >= 0:
                got = _replay_row(val[b, r].tolist(), int(nrow[b, r]), K)
                assert got == ref[b, r].tolist(), (kind, b, r)


def test_replay_of_a_large_equal_mass_runs_the_search_to_its_last_bit():
    """More than CM keys equal at the k-th: the search ends on its last bit and drops the earliest of them."""
    words = [(0x3F800000 << 32) | p for p in range(100)]  # 100 scores of 1.0
    words[7] = (0x40000000 << 32) | 7  # one 2.0
    got = _replay_row(words, 100, 50)
    assert got == [7] + list(range(51, 100))


def test_replay_of_a_dense_bin_of_distinct_keys_takes_bit_steps():
    """One far outlier spreads the histogram's bits so the other 199 distinct keys share one bin: the bit steps
    and the rank still give the reference's positions."""
    x = torch.cat([torch.tensor([1e30]), 1.0 + torch.arange(199) * 1e-6])
    val = ((x.view(torch.int32).long() << 32) | torch.arange(200)).view(1, 1, 200)
    nrow = torch.tensor([[200]], dtype=torch.int32)
    ref = cand_cuda.buffer_select_naive(val, nrow, 60)
    assert _replay_row(val[0, 0].tolist(), 200, 60) == ref[0, 0].tolist() == [0] + list(range(141, 200))


def test_okey_inverse_round_trips_the_packed_scan_keys():
    x = torch.tensor([-3.5, -0.0, 0.0, 1e-30, 2.0, float("inf"), float("-inf")])
    keys = torch.tensor([_okey(v) for v in x.view(torch.int32).tolist()], dtype=torch.int64).to(torch.int32)
    back = cand_cuda._okey_inv(keys)
    assert torch.equal(back, torch.where(x == 0, torch.zeros_like(x), x))


def test_threads_and_bad_input():
    assert cand_cuda.threads(4096) == 256 and cand_cuda.threads(100) == 32 and cand_cuda.threads(16384) == 1024
    assert cand_cuda.threads(5000) == 512  # a power of two: the histogram's bins split evenly
    with pytest.raises(ValueError, match="select_impl"):
        ct.cand_select(*([torch.zeros(1, 1, 4, dtype=torch.int64)] * 2), torch.zeros(1, 1, dtype=torch.int32),
                       torch.zeros(1, 1, 2, dtype=torch.int32), 2,
                       dataclasses.replace(ct.CandConfig(), select_impl="x"))
    with pytest.raises(ValueError, match="CUDA"):
        cand_cuda.buffer_select(torch.zeros(1, 1, 4, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int32),
                                torch.zeros(1, 1, 2, dtype=torch.int32), 2)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA toolkit's nvcc")
def test_source_compiles_for_sm90_in_32_registers(tmp_path):
    """Both kernels build for sm_90 with 32 registers (8 blocks of 256 an SM; a few bytes of spills at most)."""
    src = tmp_path / "cand_cuda.cu"
    src.write_text(cand_cuda.SOURCE)
    res = subprocess.run(["nvcc", "-cubin", "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v", str(src),
                          "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    for name in cand_cuda.KERNELS:
        assert f"Compiling entry function '{name}'" in res.stderr, res.stderr
    regs = [int(x) for x in __import__("re").findall(r"Used (\d+) registers", res.stderr)]
    spills = [int(x) for x in __import__("re").findall(r"(\d+) bytes spill stores", res.stderr)]
    assert regs and max(regs) <= 32 and max(spills) <= 128, res.stderr


@needs_gpu
@pytest.mark.parametrize("kind", ["randn", "ties", "zeros", "forced", "dense"])
@pytest.mark.parametrize("C,K", [(4096, 2048), (1000, 333), (64, 7), (16384, 5000)])
@pytest.mark.parametrize("lpt", [16, 8])
def test_kernel_equals_naive_and_triton(kind, C, K, lpt):
    B, R = 2, 37
    val, nrow = _buffers(B, R, C, kind, seed=C + K, device="cuda")
    ref = cand_cuda.buffer_select_naive(val, nrow, K)
    out = torch.full((B, R, K), -7, dtype=torch.int32, device="cuda")
    if C > lpt * 1024:
        pytest.skip("more entries than a block of this lpt holds")
    cand_cuda.buffer_select(val, nrow, out, K, lpt=lpt)
    served = nrow >= 0
    assert torch.equal(out[served], ref[served])
    assert (out[~served] == -7).all()  # flagged rows are left for the redo
    if C <= 4096:
        tri = torch.full_like(out, -7)
        ct.cand_select(val, val, nrow, tri, K, dataclasses.replace(ct.CandConfig(), select_impl="triton"))
        assert torch.equal(out[served], tri[served])


@needs_gpu
def test_kernel_on_order_preserving_keys_and_a_row_slice():
    """raw=False (the scan gather's packed keys) and an out slice of a longer output (the chunk loop's view)."""
    B, R, C, K = 1, 50, 512, 100
    val, nrow = _buffers(B, R, C, "zeros", seed=9, device="cuda")
    hi = (val >> 32).to(torch.int32).cpu()
    keys = torch.tensor([_okey(v & 0xFFFFFFFF) for v in hi.flatten().tolist()], dtype=torch.int64)
    kval = ((keys.view(hi.shape).to("cuda") & 0xFFFFFFFF) << 32) | (val & 0xFFFFFFFF)
    full = torch.full((B, R + 10, K), -7, dtype=torch.int32, device="cuda")
    cand_cuda.buffer_select(kval, nrow, full[:, 5:5 + R], K, raw=False)
    ref = cand_cuda.buffer_select_naive(val, nrow, K)
    served = nrow >= 0
    assert torch.equal(full[:, 5:5 + R][served], ref[served])
    assert (full[:, :5] == -7).all() and (full[:, 5 + R:] == -7).all()


@needs_gpu
@pytest.mark.parametrize("S", [3000, 9000])
def test_cand_topk_with_the_cuda_select_equals_the_reference(S):
    g = torch.Generator(device="cuda").manual_seed(S)
    T, HI, DI, K = S, 4, 64, 512
    q = torch.randn(1, T, HI, DI, device="cuda", generator=g).bfloat16()
    w = torch.randn(1, T, HI, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, S, DI, device="cuda", generator=g).bfloat16()
    cfg = dataclasses.replace(ct.CandConfig(), select_impl="cuda")
    got = ct.indexer_topk_cand(q, w, k, K, sink=4, window=64, config=cfg)
    ref = indexer_topk_naive(q.float(), w.float(), k.float(), K, sink=4, window=64)
    tri = ct.indexer_topk_cand(q, w, k, K, sink=4, window=64, config=dataclasses.replace(cfg, select_impl="triton"))
    assert torch.equal(got, tri)
    assert (got != ref).any(-1).float().mean() < 0.01  # bf16 inputs scored in fp32 by two summation orders


@needs_gpu
@pytest.mark.parametrize("positive_w", [False, True])
def test_cuda_quantile_gives_the_triton_thresholds(positive_w):
    """`sample_kth` against `_quantile_kernel` on the same samples: the same fp32 thresholds, bit for bit (rows of
    <= C visible keys -inf, forced keys filling k +inf, ReLU zeros at the m-th)."""
    from sparse_rl.sparse.ops.indexer_topk.stream import _kv_start

    g = torch.Generator(device="cuda").manual_seed(int(positive_w))
    B, T, S, K, C = 2, 2500, 2500, 300, 512
    q = torch.randn(B, T, 4, 64, device="cuda", generator=g).bfloat16()
    w = torch.randn(B, T, 4, device="cuda", generator=g).bfloat16()
    w = w.abs() if positive_w else w
    k = torch.randn(B, S, 64, device="cuda", generator=g).bfloat16()
    kvs = _kv_start(torch.tensor([0, 37]), B, "cuda")
    cfg = dataclasses.replace(ct.CandConfig(), sample_stride=4, sample_lanes=2048)
    R = ct.sample_stride(cfg, S)
    SW = -(-S // R)
    ths = []
    for impl in ("triton", "cuda"):
        th = torch.full((B, T), 7.0, device="cuda")
        smp = torch.empty(B, T, SW, device="cuda")
        ct.cand_threshold(q, w, k, kvs, 0, T, 0, 4, 64, K, C, th, smp, dataclasses.replace(cfg, quantile_impl=impl))
        ths.append(th)
    assert torch.equal(ths[0].view(torch.int32), ths[1].view(torch.int32))
    assert (ths[0] == float("-inf")).any() and torch.isfinite(ths[0]).any()
