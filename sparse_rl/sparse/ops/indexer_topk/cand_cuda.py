"""The prefill top-k's buffer select (phase 4 of `cand_topk`) as one CUDA block a row (`CandConfig.select_impl`,
"cuda" by default on a GPU since session 28).

Why CUDA: the select finds the k-th largest of a row's ~3K buffered candidates, then writes the kept positions in
order. The Triton form (`cand_topk._select_packed_kernel`) does it by a bit search whose every step is a block-wide
`tl.sum` over every lane (1.22 ms for the 32K rows of a 32K prefill on the H100). Here each key is visited a fixed
number of times: the row's smallest and largest key (`redux.sync`, one barrier); one shared 2048-bin histogram of
the 11 key bits below the highest bit where they differ (one atomic a key) and a block suffix scan over per-thread
runs of bins, which gives the bin holding the k-th; the <= 32 keys of that bin ranked in one warp by shuffles (a bin
of more keys, exact ties or a far outlier's spread, first takes one-bit steps over its keys); then one ballot scan
over per-(slot, warp) counts of the keys above and equal to the k-th gives every kept lane its place. H100 (session
28, results/2026-12-07-h100-session28.md): 0.73 ms at 32K, 3.1 at 128K, rows equal to the Triton select's. What
was tried first: the bit search in CUDA (0.87 ms: ~25 steps, each visiting every slot) and 4-bit digits a step
(1.24: more instructions a key; the kernel is bound by instructions, not by its barriers). Its DRAM floor is the
buffer's int64 entries and the output, ~0.35 ms at 32K.

`buffer_select(val [B, R, C] int64, nrow [B, R] int32, out [B, Tc, K] int32, K)`: val holds each row's entries in
key order (high word the score's fp32 bits, `raw`, or its order-preserving key; low word the position), nrow
their count (-1: a flagged row, left for the redo). Out: the positions of the K largest (among equal scores the
later key; -0.0 equals +0.0), ascending; a row of at most K entries keeps them all, then -1. The same keys as the
Triton select (`buffer_select_naive` is its rule in PyTorch; tests/sparse/test_cand_cuda.py checks both on a GPU and
replays the kernel's steps in Python on the CPU).

Compiled at first use by NVRTC (`torch.cuda._compile_kernel`), cached per device; a plain launch (the prefill's
select needs neither PDL nor clusters). On a CPU, or where it does not build, `cand_select` runs the Triton form.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from sparse_rl.sparse.ops._backend import cuda_index

LPT = 16  # the kernels' key slots a thread (cand_cuda.cu's LPT, set at compile time)
MAX_SLOTS = LPT * 1024  # a row's keys a 1024-thread block holds
SOURCE = (Path(__file__).parent / "cand_cuda.cu").read_text()
KERNELS = ("buffer_topk", "sample_kth")


@functools.lru_cache(maxsize=None)
def _kernel(device: int, name: str, lpt: int = LPT):
    """The compiled kernel `name` of cand_cuda.cu for cuda:`device`; the keys sit in dynamic shared memory (4 bytes
    a slot), raised past the 48 KB default where a 1024-thread block needs it."""
    with torch.cuda.device(device):
        k = torch.cuda._compile_kernel(SOURCE, name, nvcc_options=["-std=c++17", f"-DLPT={lpt}"])
    if lpt * 1024 * 4 >= 48 * 1024 and hasattr(k, "set_shared_memory_config"):
        k.set_shared_memory_config(lpt * 1024 * 4)
    return k


@functools.lru_cache(maxsize=None)
def available(device: int) -> bool:
    """Whether both kernels build and load on cuda:`device` (NVRTC present, compute capability 8.0+ for the warp
    reductions); warned once where not."""
    try:
        if not hasattr(torch.cuda, "_compile_kernel"):
            raise RuntimeError("torch.cuda._compile_kernel is missing (PyTorch >= 2.8 with CUDA)")
        if torch.cuda.get_device_capability(device) < (8, 0):
            raise RuntimeError("compute capability below 8.0")
        for name in KERNELS:
            _kernel(device, name)
        return True
    except Exception as e:  # noqa: BLE001 - any failure to build means the Triton kernels run instead
        import warnings

        warnings.warn(f"cand top-k 'cuda' kernels unavailable on cuda:{device} ({e}); the Triton ones run instead",
                      RuntimeWarning, stacklevel=2)
        return False


def threads(slots: int, lpt: int = LPT) -> int:
    """The block size for rows of `slots` keys: lpt keys a thread, a power of two of at least one warp (the
    histogram's 2048 bins are split evenly over the threads)."""
    t = 32
    while t * lpt < slots:
        t *= 2
    return t


def _int32(*vals: int) -> tuple:
    if max(vals) >= 2 ** 31:
        raise ValueError("cand_cuda: strides past int32")
    return vals


def buffer_select(val: torch.Tensor, nrow: torch.Tensor, out: torch.Tensor, topk: int, raw: bool = True,
                  lpt: int = LPT) -> None:
    """See the module docstring: val `[B, R, C]` int64 (contiguous entries), nrow `[B, R]` int32, out `[B, Tc,
    topk]` int32 (Tc <= R, contiguous rows), all on one CUDA device; rows with nrow < 0 are not written. lpt: the
    buffer entries a thread holds (the block is C / lpt threads, a power of two, at most 1024)."""
    B, Tc = out.shape[:2]
    C = val.shape[2]
    if not (val.is_cuda and val.dtype == torch.int64 and nrow.dtype == torch.int32 and out.dtype == torch.int32):
        raise ValueError("cand_cuda.buffer_select: val int64, nrow / out int32, on a CUDA device")
    if C > lpt * 1024 or val.stride(2) != 1 or out.stride(2) != 1 or out.shape[2] != topk or val.shape[1] < Tc:
        raise ValueError(f"cand_cuda.buffer_select: val {tuple(val.shape)} (at most {lpt * 1024} contiguous entries a "
                         f"row), out {tuple(out.shape)} (contiguous rows of {topk})")
    if Tc == 0 or B == 0:
        return
    strides = _int32(val.stride(0), val.stride(1), nrow.stride(0), out.stride(0), out.stride(1))
    T = threads(C, lpt)
    _kernel(cuda_index(val.device), "buffer_topk", lpt)((B * Tc, 1, 1), (T, 1, 1),
                                                      [val, nrow, out, Tc, *strides, topk, int(raw)],
                                                      shared_mem=T * lpt * 4)


def sample_threshold(smp: torch.Tensor, kvs: torch.Tensor, th: torch.Tensor, Tc: int, S: int, t0: int, q_offset: int,
                     sink: int, window: int, topk: int, C: int, target: float, R: int) -> None:
    """`cand_topk._quantile_kernel` (phase 2, 32-bit keys) as `sample_kth`: th `[B, Tc]` fp32 from the sampled
    scores smp `[B, *, SW]` fp32 (stride R keys) of the chunk's rows t0.. and kvs `[B]` int32, the same thresholds
    (the m-th largest sample, m in the Triton kernel's fp32 arithmetic)."""
    B, SW = smp.shape[0], smp.shape[2]
    if not (smp.is_cuda and smp.dtype == torch.float32 and th.dtype == torch.float32 and kvs.dtype == torch.int32):
        raise ValueError("cand_cuda.sample_threshold: smp / th fp32, kvs int32, on a CUDA device")
    if SW > MAX_SLOTS or smp.stride(2) != 1:
        raise ValueError(f"cand_cuda.sample_threshold: smp {tuple(smp.shape)} (at most {MAX_SLOTS} contiguous samples)")
    if Tc == 0 or B == 0:
        return
    strides = _int32(smp.stride(0), smp.stride(1), th.stride(0))
    T = threads(SW)
    _kernel(cuda_index(smp.device), "sample_kth")((B * Tc, 1, 1), (T, 1, 1),
                                                  [smp, kvs, th, *strides, Tc, S, t0, q_offset, sink, window, topk, C,
                                                   float(target), SW, R], shared_mem=T * LPT * 4)


def buffer_select_naive(val: torch.Tensor, nrow: torch.Tensor, topk: int, raw: bool = True) -> torch.Tensor:
    """`buffer_select`'s rule in PyTorch (any device): `[B, R, topk]` int32, rows with nrow < 0 all -1."""
    from sparse_rl.sparse.ops.indexer_topk.naive import select_topk

    hi = (val >> 32).to(torch.int32)
    score = hi.view(torch.float32) if raw else _okey_inv(hi)
    lanes = torch.arange(val.shape[2], device=val.device)
    live = lanes[None, None, :] < nrow[..., None].long()
    sel = select_topk(score, live, torch.zeros_like(live), topk)  # lanes, ascending = key order
    pos = torch.gather((val & 0xFFFFFFFF).to(torch.int32), 2, sel.clamp(min=0).long())
    return torch.where((sel >= 0) & (nrow[..., None] >= 0), pos, -1).to(torch.int32)


def _okey_inv(k: torch.Tensor) -> torch.Tensor:
    """fp32 scores of order-preserving uint32 keys held in int32 (the packed scan gather's high words)."""
    u = k.long() & 0xFFFFFFFF
    bits = torch.where(u >= 0x80000000, u & 0x7FFFFFFF, (~u) & 0xFFFFFFFF)
    return bits.to(torch.int32).view(torch.float32)
