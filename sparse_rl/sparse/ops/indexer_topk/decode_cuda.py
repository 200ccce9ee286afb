"""The decode select after the score pass as a CUDA block, or a thread-block cluster, per row
(`indexer_topk_decode(impl="cuda")`, the rollout engine's default since session 27).

Why CUDA C++ here, where the rest of the ops are Triton: after the score pass the select is a chain of small
block-wide steps over one row (histogram, find the bin holding the k-th key, resolve it; then write the kept
positions in order). Each step is a reduction or a scan across the block. Triton has no block-wide primitive
cheaper than a `tl.sum` / `tl.cumsum` through shared memory, measured at ~1 us each on the H200 (session 10's bit
search: 32 steps, 65 us at 16K), so the Triton forms either split the row over many programs and pay launches or
in-kernel barriers between the levels (fine, sync: ~30 us of chain a layer at 32 x 16K on top of a ~16 us score
pass) or walk it in one program and pay the reductions (row, bsearch). In CUDA a level is shared-memory atomics
and a 32-warp scan. vLLM, SGLang and TensorRT-LLM run the DSA decode top-k the same way (a logits kernel, then
one CTA per row); this kernel is written from the algorithm, not from theirs.

`row_select(sc [B, S] fp32, pos [B] int32, topk, span=, chunk=)` -> `[B, topk]` int32 ascending, -1 padded. The
scores are the score pass's (`decode._score_max`: +inf forced, -inf not visible, only columns <= pos written), so
the kept keys are the reference's (`naive.indexer_topk_decode_naive`): every +inf key, then the highest finite
scores, ties between equal scores to the later key (-0.0 equals +0.0). span: the same pass's per-chunk largest /
smallest finite score, so the select needs no pass of its own for the row's extremes.

A row is split over a cluster of C blocks of 1024 threads (`auto_cluster`: 2-4 on sm_90+ where a block keeps
>= 8K keys, else 1); block rank r holds the row's r-th part, its warp w a contiguous segment, 32 keys a step.
Three passes over a block's keys:
1. the keys as order-preserving uint32 into dynamic shared memory (parts of at most `CACHE_KEYS` keys; longer
   ones are re-read from L2 each pass), the visible and forced counts per warp, and the first level's
   histogram: 2046 bins linear in the score between the row's extremes plus two slots at the bin holding 0.0
   (its negatives / the exact zeros, counted by warp ballot / its positives). Linear bins spread a Gaussian-like
   row (the key's top bits put a row of similar magnitudes in a handful of bins and serialize the atomics:
   session 26's first form); the zeros' slot keeps a threshold at an exact ReLU zero (rows whose head weights
   are mostly negative) from listing ~1,000 equal keys (session 27, call 1). The blocks exchange their counts
   (distributed shared memory, one cluster barrier) and each sums the others' histograms to find the slot
   holding the k-th largest key;
2. one pass counts, per warp, the keys above that slot (forced or a higher slot) and either the zeros (the
   zeros' slot: T = 0 at once) or appends the slot's keys to every block's list (place from rank 0's counter,
   tagged with rank and warp), which each block ranks: one key a thread up to 128, a bitonic sort up to 1024.
   A slot of more keys (a span set by far outliers, exact ties) takes three radix levels of the key's bits and
   a counting pass instead;
3. the write: one scan over the warps (plus the lower ranks' counts) gives every warp its offsets, and the warp
   walks its segment again, placing each kept key at (keys above before it) + (ties before it past the first
   `ties - rem`, the earlier ties being the dropped ones).

Compiled at first use by NVRTC (`torch.cuda._compile_kernel`: no C++ toolchain needed, only the NVRTC library
of PyTorch's CUDA build), cached per device; launched through the driver's `cuLaunchKernelEx` with the cluster
dimension and, where the caller's `pdl` asks for it, programmatic dependent launch (the kernel waits for the
previous kernel, then lets the next one launch, as `pdl.pdl_enter` at level 2). CUDA-graph capturable: `pos` is
read on the device, the grid depends on B only. There is no CPU form: on a CPU `indexer_topk_decode` runs the
reference, and the tests check this kernel against the reference on a GPU (tests/sparse/test_decode_cuda.py).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from sparse_rl.sparse.ops._backend import cuda_index
from sparse_rl.sparse.ops.indexer_topk.decode_select import CUDA_CLUSTERS

THREADS = 1024
# rows of at most this many keys keep their keys in shared memory between the passes (4 bytes a key, plus the
# 8 KB histogram, within the 227 KB a block may have on sm_90); longer rows re-read the scores from L2 each pass
CACHE_KEYS = 53248

# the kernel's CUDA C++ source, a file of its own beside this module (package data)
SOURCE = (Path(__file__).parent / "decode_cuda.cu").read_text()


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("numAttrs", ctypes.c_uint)]


_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"decode_cuda: {what} failed with CUDA driver error {rc}")


@functools.lru_cache(maxsize=None)
def _kernel(device: int):
    """The compiled `row_topk` for cuda:`device` (its func handle), with the dynamic shared memory limit raised
    to what `CACHE_KEYS` needs."""
    if not hasattr(torch.cuda, "_compile_kernel"):
        raise RuntimeError("impl='cuda' needs torch.cuda._compile_kernel (PyTorch >= 2.8 with CUDA)")
    with torch.cuda.device(device):
        k = torch.cuda._compile_kernel(SOURCE, "row_topk", nvcc_options=["-std=c++17"])
    _check(_libcuda().cuFuncSetAttribute(k.func, _MAX_DYNAMIC_SHARED, CACHE_KEYS * 4), "cuFuncSetAttribute")
    return k


@functools.lru_cache(maxsize=None)
def available(device: int) -> bool:
    """Whether `row_topk` compiles and loads on cuda:`device` (NVRTC present, a GPU of compute capability 8.0+
    for the warp reductions); the reason is logged once where not."""
    try:
        if torch.cuda.get_device_capability(device) < (8, 0):
            raise RuntimeError("compute capability below 8.0")
        _kernel(device)
        return True
    except Exception as e:  # noqa: BLE001 - any failure to build means the Triton selects run instead
        _warn_once(f"decode select 'cuda' unavailable on cuda:{device} ({e}); the fine select runs instead")
        return False


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    import warnings

    warnings.warn(msg, RuntimeWarning, stacklevel=3)


CLUSTERS = CUDA_CLUSTERS  # 0: auto_cluster's choice; at most 8, the portable cluster size
CLUSTER_MIN_KEYS = 8192  # auto_cluster: a cluster's blocks hold at least this many keys each


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_cluster(B: int, S: int, sms: int, capability: tuple[int, int]) -> int:
    """The blocks a row of `row_select`'s cluster form on a GPU of `sms` SMs: the most (up to 4) that keep the B
    rows' clusters in one wave (one 1024-thread block an SM) with at least CLUSTER_MIN_KEYS keys a block; 1 (the
    one-block kernel) below compute capability 9.0, where there are no clusters. Measured on the H100 (session 27,
    call 2, the five-pass form of the select alone, us): 16 x 32K 34.2 / 23.2 / 16.7 / 33.3 at 1 / 2 / 4 / 8
    blocks a row, 16 x 16K 19.5 / 15.7 / 13.5 / 27.8, 32 x 8192 11.6 / 12.3 / 20.3 / 41.8, 32 x 2304 7.6 / 10.5 /
    15.2 / 28.6: a cluster's exchanges cost ~3 us, so it pays only where a block keeps ~8K keys; 8 blocks a row
    lose everywhere (16 clusters of 8 need more than one wave of the H100's GPCs)."""
    if tuple(capability) < (9, 0):
        return 1
    c = 4
    while c > 1 and (B * c > sms or S < c * CLUSTER_MIN_KEYS):
        c //= 2
    return c


def _attr(id_: int, *values: int) -> _LaunchAttr:
    a = _LaunchAttr()
    a.id = id_
    vals = (ctypes.c_uint * len(values))(*values)
    # into the struct's own bytes: `a.value` would be a bytes copy (ctypes turns a c_char array field into bytes)
    ctypes.memmove(ctypes.addressof(a) + _LaunchAttr.value.offset, vals, ctypes.sizeof(vals))
    return a


def score_span(sc: torch.Tensor) -> torch.Tensor:
    """`[B, 1, 2]` fp32: each row's largest and smallest finite score, the score pass's per-chunk `span` for one
    chunk of the whole row (+-inf where a row has none), for callers of `row_select` without a score pass."""
    fin = torch.isfinite(sc)
    mx = torch.where(fin, sc, float("-inf")).amax(1)
    mn = torch.where(fin, sc, float("inf")).amin(1)
    return torch.stack([mx, mn], -1)[:, None].contiguous()


def row_select(sc: torch.Tensor, pos: torch.Tensor, topk: int, *, span: torch.Tensor | None = None, chunk: int = 0,
               pdl: int = 0, cache_keys: int = CACHE_KEYS, cluster: int = 0) -> torch.Tensor:
    """sc `[B, S]` fp32 scores of the score pass (+inf forced, -inf not visible; columns past pos unread),
    pos `[B]` int32 on sc's device -> `[B, topk]` int32 ascending, -1 padded. span `[B, P, 2]` fp32: the largest
    and smallest finite score of each `chunk`-key chunk (the score pass's `PER_CHUNK` output; chunks past a row's
    pos are not read); None: `score_span(sc)`. pdl: launched with programmatic dependent launch (any nonzero
    level). cache_keys: a block holds its keys in shared memory between the passes when they are at most this
    many (at most `CACHE_KEYS`; 0 re-reads every pass, for tests of that path). cluster: the blocks a row (a
    thread-block cluster exchanging through distributed shared memory, compute capability 9.0+; 1 a plain
    launch); 0 `auto_cluster`'s choice."""
    if not sc.is_cuda or sc.dtype != torch.float32 or sc.dim() != 2 or sc.stride(1) != 1:
        raise ValueError("decode_cuda.row_select: sc must be a CUDA [B, S] fp32 tensor with contiguous rows")
    if not 0 <= cache_keys <= CACHE_KEYS:
        raise ValueError(f"cache_keys {cache_keys}: must be within 0-{CACHE_KEYS}")
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster {cluster}: expected one of {', '.join(map(str, CLUSTERS))}")
    B, S = sc.shape
    if span is None:
        span, chunk = score_span(sc), S
    if span.dtype != torch.float32 or span.dim() != 3 or span.shape[0] != B or span.shape[2] != 2 or chunk < 1:
        raise ValueError("decode_cuda.row_select: span must be [B, P, 2] fp32 with a chunk of at least 1 key")
    span = span.contiguous()
    dev = cuda_index(sc.device)
    cap = torch.cuda.get_device_capability(dev)
    C = cluster or auto_cluster(B, S, _sm_count(dev), cap)
    if C > 1 and cap < (9, 0):
        raise ValueError(f"cluster {C}: thread-block clusters need compute capability 9.0+")
    pos = pos.to(device=sc.device, dtype=torch.int32).contiguous()
    out = torch.empty(B, topk, device=sc.device, dtype=torch.int32)
    if sc.stride(0) != S:
        sc = sc.contiguous()
    part = -(-S // (C * 32)) * 32  # a block's most keys (the kernel's part of a row of S keys)
    keys = min(cache_keys, part)
    # on sm_90+ even one block a row launches as a cluster (of one): the kernel's cluster barriers and
    # distributed-shared-memory accesses then address a launch of the kind they were written for
    _launch(dev, B, C, keys * 4, [sc, span, pos, out],
            [S, topk, out.stride(0), keys, chunk, span.shape[1], 1 if pdl else 0], pdl, clusters=cap >= (9, 0))
    return out


def _launch(dev: int, B: int, C: int, smem: int, tensors: list, ints: list, pdl: int, clusters: bool) -> None:
    """`row_topk` on the current stream: B rows of C blocks of THREADS threads, as clusters of C where `clusters`
    (sm_90+), smem bytes of dynamic shared memory, the kernel's parameters (tensor pointers, then ints) in its
    order; PDL where asked."""
    k = _kernel(dev)
    args = [ctypes.c_void_p(t.data_ptr()) for t in tensors] + [ctypes.c_int(v) for v in ints]
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
    attrs = ([_attr(_PROGRAMMATIC_STREAM_SERIALIZATION, 1)] if pdl else []) + (
        [_attr(_CLUSTER_DIMENSION, C, 1, 1)] if clusters else [])
    arr = (_LaunchAttr * max(1, len(attrs)))(*attrs)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    cfg = _LaunchConfig(B * C, 1, 1, THREADS, 1, 1, smem, stream, arr if attrs else None, len(attrs))
    _check(_libcuda().cuLaunchKernelEx(ctypes.byref(cfg), k.func, params, None), "cuLaunchKernelEx")


def row_select_naive(sc: torch.Tensor, pos: torch.Tensor, topk: int) -> torch.Tensor:
    """`row_select` in PyTorch (any device), by the reference's own rule (`naive.select_topk`): each row's columns
    0..pos, +inf keys forced, -inf never kept, ties to the later key; `[B, topk]` int32 ascending, -1 padded."""
    from sparse_rl.sparse.ops.indexer_topk.naive import select_topk

    cols = torch.arange(sc.shape[1], device=sc.device)
    visible = (cols[None, :] <= pos.to(sc.device).long()[:, None]) & (sc > float("-inf"))
    return select_topk(sc[:, None], visible[:, None], (sc == float("inf"))[:, None], topk)[:, 0]
