"""Public sparse-attention ops. Each lives in `ops/<op>/` with the PyTorch reference in `naive.py`
and, where written, a Triton kernel in `triton.py` exposing a function of the same name and
signature. `backend="auto"` picks Triton for CUDA tensors, the reference elsewhere
(`SPARSE_RL_BACKEND=torch|triton` forces either)."""

from __future__ import annotations

import functools
import importlib

import torch

from sparse_rl.sparse.ops._backend import resolve_backend
from sparse_rl.sparse.ops.block_select.naive import block_select_naive
from sparse_rl.sparse.ops.decode_fused.naive import add_rmsnorm_naive, qk_norm_rope_cache_naive, silu_mul_naive
from sparse_rl.sparse.ops.indexer_decode.naive import indexer_decode_naive
from sparse_rl.sparse.ops.indexer_kl.naive import KLStats, dense_lse, selected_kl
from sparse_rl.sparse.ops.indexer_kl.naive import warmup_kl as warmup_kl_naive
from sparse_rl.sparse.ops.indexer_topk.naive import (granular_topk_decode_naive, granular_topk_naive,
                                                     indexer_scores_naive, indexer_topk_decode_naive, indexer_topk_naive,
                                                     quantize_index_keys, shared_rows_ok, visible_mask)
from sparse_rl.sparse.ops.sparse_attention.naive import (MERGES, dense_attention_naive, shared_to_per_query,
                                                         sparse_attention_naive)

__all__ = ["sparse_attention", "sparse_decode", "indexer_topk", "indexer_topk_decode", "indexer_scores", "indexer_decode",
           "block_select", "visible_mask", "granular_topk", "granular_topk_decode", "shared_rows_ok",
           "dense_attention_naive", "kernel", "warmup_kl", "selected_kl", "dense_lse", "KLStats", "add_rmsnorm",
           "qk_norm_rope_cache", "silu_mul", "quantize_index_keys", "skinny_linear"]


@functools.lru_cache(maxsize=None)
def kernel(op: str, name: str | None = None, module: str = "triton"):
    """The Triton implementation `ops/<op>/<module>.py:<name>`, or None when it does not exist."""
    try:
        mod = importlib.import_module(f"sparse_rl.sparse.ops.{op}.{module}")
    except ImportError:
        return None
    return getattr(mod, name or op, None)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                     scale: float | None = None, *, query_group: int = 1, q_offset: int = 0,
                     fwd_path: str = "auto", bwd_path: str = "auto", key_block: int = 1, backend: str = "auto"):
    """Attention over selected keys. q `[B, T, H, D]`, k/v `[B, S, H_kv, D]`, indices `[B, T, K]`
    int32 (-1 = none), or `[B, ceil(T/g), K]` rows shared by g = `query_group` consecutive queries
    (each query sees its row's keys <= q_offset + t) -> (out `[B, T, H, D]`, lse `[B, T, H]` float32).
    Differentiable in q, k, v. `fwd_path` (auto/query/tile/block) and `bwd_path` (auto/atomic/tile/keyq) pick
    the Triton kernels (ops/sparse_attention/paths.py); `key_block` says shared rows are whole key blocks
    of that size (the block kernels' cue); the reference ignores all three."""
    fn = kernel("sparse_attention")
    if resolve_backend(backend, q, fn is not None) == "triton":
        return fn(q, k, v, indices, scale, query_group=query_group, q_offset=q_offset, fwd_path=fwd_path,
                  bwd_path=bwd_path, key_block=key_block)
    if query_group > 1:
        indices = shared_to_per_query(indices, query_group, q.shape[1], q_offset)
    return sparse_attention_naive(q, k, v, indices, scale)


def sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor,
                  scale: float | None = None, *, backend: str = "auto", pdl: bool = False, nsplit: int | None = None,
                  merge: str = "kernel"):
    """One decode step. q `[B, H, D]`, caches `[B, S_max, H_kv, D]`, indices `[B, K]` (-1 = none;
    each row names only filled cache slots) -> (out `[B, H, D]`, lse `[B, H]`). pdl: the Triton launches with
    programmatic dependent launch (decided by the caller, `_backend.resolve_pdl`; the reference ignores it;
    so do the decode ops below). nsplit: the kernel's split of each index list (None: its heuristic, about one
    program an SM). merge: "kernel" (the splits' partials merged by a second launch) or "fused" (by the last
    program of each (row, kv head) inside the forward; never two such launches at once on two streams)."""
    if merge not in MERGES:  # checked here too: the reference path takes no merge
        raise ValueError(f"sparse_decode: merge {merge!r} not among {MERGES}")
    fn = kernel("sparse_attention", "sparse_decode")
    if resolve_backend(backend, q, fn is not None) == "triton":
        return fn(q, k_cache, v_cache, indices, scale, nsplit=nsplit, pdl=pdl, merge=merge)
    out, lse = sparse_attention_naive(q[:, None], k_cache, v_cache, indices[:, None], scale)
    return out[:, 0], lse[:, 0]


def indexer_topk(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, topk: int, *, q_offset: int = 0,
                 sink: int = 0, window: int = 0, kv_start: torch.Tensor | None = None, backend: str = "auto"):
    """Lightning-indexer scores + causal top-k. q_idx `[B, T, H_I, D_I]`, w `[B, T, H_I]`,
    k_idx `[B, S, D_I]` -> `[B, T, topk]` int32 key positions (ascending, -1 padded)."""
    fn = kernel("indexer_topk")
    if resolve_backend(backend, q_idx, fn is not None) == "triton":
        return fn(q_idx, w, k_idx, topk, q_offset=q_offset, sink=sink, window=window, kv_start=kv_start)
    return indexer_topk_naive(q_idx, w, k_idx, topk, q_offset=q_offset, sink=sink, window=window,
                              kv_start=kv_start)


def indexer_topk_decode(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, pos: torch.Tensor, topk: int,
                        *, sink: int = 0, window: int = 0, kv_start: torch.Tensor | None = None,
                        k_scale: torch.Tensor | None = None, select=None, backend: str = "auto"):
    """Decode-time indexer top-k, every row at its own position. q_idx `[B, H_I, D_I]`, w `[B, H_I]`,
    k_idx `[B, S, D_I]` (index-key cache; float8_e4m3fn with k_scale `[B, S]`, see
    `quantize_index_keys`), pos `[B]` -> `[B, topk]` int32 (ascending, -1 padded). select: the Triton
    kernel's choice of select after the score pass (`indexer_topk.decode.DecodeSelect`; None: its
    default); every choice selects the same keys."""
    fn = kernel("indexer_topk", "indexer_topk_decode")
    if resolve_backend(backend, q_idx, fn is not None) == "triton":
        return fn(q_idx, w, k_idx, pos, topk, sink=sink, window=window, kv_start=kv_start, k_scale=k_scale,
                  **({} if select is None else select.as_kwargs()))
    return indexer_topk_decode_naive(q_idx, w, k_idx, pos, topk, sink=sink, window=window, kv_start=kv_start,
                                     k_scale=k_scale)


def granular_topk(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, topk: int, *, q_offset: int = 0,
                  sink: int = 0, window: int = 0, kv_start: torch.Tensor | None = None, key_block: int = 1,
                  query_group: int = 1, block_score: str = "max", history: tuple | None = None,
                  shared: bool = False, topk_impl: str = "auto", backend: str = "auto"):
    """Indexer selection at a granularity: whole key blocks of `key_block` tokens, one selection per
    group of `query_group` queries (docs/DESIGN.md "Selection granularity"). Shapes as `indexer_topk`
    (history: the earlier positions' (q_I, w) when a group started before q_offset) -> `[B, T, topk]`
    int32 token positions; shared: one row per group `[B, ceil(T / G), topk]` for `sparse_attention(...,
    query_group=G, q_offset=)` (only where `shared_rows_ok(kv_start, q_offset, G)`: no left padding,
    q_offset a multiple of G). Triton: `indexer_topk/granular.py` (float64 inputs take the reference;
    topk_impl auto | keys | threshold | radix | sampled | bin: its block top-k, `granular.top_blocks`)."""
    if shared and not shared_rows_ok(kv_start, q_offset, query_group):
        raise ValueError(f"granular_topk(shared=True): needs query_group > 1, no left padding and q_offset "
                         f"({q_offset}) a multiple of query_group ({query_group})")
    kw = dict(q_offset=q_offset, sink=sink, window=window, kv_start=kv_start, key_block=key_block,
              query_group=query_group, block_score=block_score, history=history, shared=shared)
    fn = kernel("indexer_topk", "granular_topk", "granular") if q_idx.dtype != torch.float64 else None
    if resolve_backend(backend, q_idx, fn is not None) == "triton":
        return fn(q_idx, w, k_idx, topk, topk_impl=topk_impl, **kw)
    return granular_topk_naive(q_idx, w, k_idx, topk, **kw)


def granular_topk_decode(q_rep: torch.Tensor, w_rep: torch.Tensor, k_idx: torch.Tensor, pos: torch.Tensor, topk: int,
                         *, sink: int = 0, window: int = 0, kv_start: torch.Tensor | None = None, key_block: int = 1,
                         query_group: int = 1, block_score: str = "max", backend: str = "auto"):
    """Decode form of `granular_topk`: q_rep `[B, H_I, D_I]`, w_rep `[B, H_I]` of each row's group
    representative, k_idx `[B, S, D_I]`, pos `[B]` -> `[B, topk]` int32. Triton: `granular.py`
    (static shapes, no host reads: CUDA-graph capturable)."""
    kw = dict(sink=sink, window=window, kv_start=kv_start, key_block=key_block, query_group=query_group,
              block_score=block_score)
    fn = kernel("indexer_topk", "granular_topk_decode", "granular") if q_rep.dtype != torch.float64 else None
    if resolve_backend(backend, q_rep, fn is not None) == "triton":
        return fn(q_rep, w_rep, k_idx, pos, topk, **kw)
    return granular_topk_decode_naive(q_rep, w_rep, k_idx, pos, topk, **kw)


def indexer_decode(zq: torch.Tensor, zk: torch.Tensor, zw: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, eps: float, rope_dim: int,
                   pos: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None = None, *,
                   backend: str = "auto", pdl: bool = False):
    """The lightning indexer's per-token work in a decode step, after its projections: zq `[B, H_I * d_I]`,
    zk `[B, d_I]`, zw `[B, H_I]`, the model's rotary cos/sin `[B, D_h]` at pos `[B]` -> q_I
    `[B, H_I, d_I]`, w `[B, H_I]`; writes the normalised, rotated key into k_cache `[B, S_max, d_I]` at pos
    (float8_e4m3fn with k_scale `[B, S_max]` fp32: quantized, its per-token scale into k_scale)."""
    fn = kernel("indexer_decode")
    if resolve_backend(backend, zq, fn is not None) == "triton":
        return fn(zq, zk, zw, cos, sin, ln_weight, ln_bias, eps, rope_dim, pos, k_cache, k_scale, pdl=pdl)
    return indexer_decode_naive(zq, zk, zw, cos, sin, ln_weight, ln_bias, eps, rope_dim, pos, k_cache, k_scale)


def indexer_scores(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, *, q_offset: int = 0,
                   kv_start: torch.Tensor | None = None, t0: int = 0) -> torch.Tensor:
    """Differentiable indexer scores `[B, T, S]` float32 (-inf where not visible), for training."""
    return indexer_scores_naive(q_idx, w, k_idx, q_offset=q_offset, kv_start=kv_start, t0=t0)


def block_select(q: torch.Tensor, k: torch.Tensor, block_size: int, topk_blocks: int, *, q_offset: int = 0,
                 sink_blocks: int = 1, recent_blocks: int = 2, kv_start: torch.Tensor | None = None,
                 backend: str = "auto"):
    """Block selector. q `[B, T, H, D]`, k `[B, S, H_kv, D]` -> `[B, T, topk_blocks*block_size]` int32."""
    fn = kernel("block_select")
    if resolve_backend(backend, q, fn is not None) == "triton":
        return fn(q, k, block_size, topk_blocks, q_offset=q_offset, sink_blocks=sink_blocks,
                  recent_blocks=recent_blocks, kv_start=kv_start)
    return block_select_naive(q, k, block_size, topk_blocks, q_offset=q_offset, sink_blocks=sink_blocks,
                              recent_blocks=recent_blocks, kv_start=kv_start)


def warmup_kl(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, *,
              scale: float, indices: torch.Tensor | None = None, q_offset: int = 0,
              kv_start: torch.Tensor | None = None, chunk: int | None = None, grad_scale: float | None = None,
              lse: torch.Tensor | None = None, oracle: bool = False, key_block: int = 1, query_group: int = 1,
              block_score: str = "max", backend: str = "auto") -> KLStats:
    """The indexer's warm-up loss of one layer, KL(dense attention || softmax(indexer scores)) summed over
    queries (contract: `indexer_kl/naive.py:warmup_kl`). q `[B, H, T, D]`, k `[B, H_kv, S, D]`, q_idx
    `[B, T, H_I, D_I]`, w `[B, T, H_I]`, k_idx `[B, S, D_I]` -> KLStats; with grad_scale the gradients
    are back-propagated into the indexer outputs. Triton: the fused kernel (rows without left padding,
    no oracle; lse `[B, H, T]`, the dense log-sum-exp, skips its dense pass when given); torch: the
    query-chunked reference (chunk: queries per chunk). key_block / query_group / block_score: the target
    at a selection granularity (`naive.granular_target`), on the reference (the fused kernel is token-level)."""
    fn = kernel("indexer_kl", "warmup_kl_triton")
    gran = key_block > 1 or query_group > 1
    if kv_start is None and not oracle and not gran and resolve_backend(backend, q, fn is not None) == "triton":
        return fn(q, k, q_idx, w, k_idx, scale=scale, indices=indices, q_offset=q_offset, grad_scale=grad_scale,
                  lse=lse)
    return warmup_kl_naive(q, k, q_idx, w, k_idx, scale=scale, indices=indices, q_offset=q_offset, kv_start=kv_start,
                           chunk=chunk, grad_scale=grad_scale, oracle=oracle, key_block=key_block,
                           query_group=query_group, block_score=block_score)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                backend: str = "auto", pdl: bool = False):
    """Residual add + RMSNorm of one token per row, as the HF modules compute it: x `[B, N]`, residual
    `[B, N]` or None, weight `[N]` -> (RMSNorm(residual + x) `[B, N]`, residual + x `[B, N]`)."""
    fn = kernel("decode_fused", "add_rmsnorm")
    if resolve_backend(backend, x, fn is not None) == "triton":
        return fn(x, residual, weight, eps, pdl=pdl)
    return add_rmsnorm_naive(x, residual, weight, eps)


def qk_norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, backend: str = "auto",
                       pdl: bool = False):
    """A decode step's q/k work after the projections: q `[B, H, D]`, k/v `[B, H_kv, D]`, Qwen3's q/k
    RMSNorm weights `[D]` (None: none), the rotary cos/sin `[B, D]` at pos `[B]` -> q rotated `[B, H, D]`;
    writes the (normalised) rotated k and v into the caches `[B, S_max, H_kv, D]` at pos."""
    fn = kernel("decode_fused", "qk_norm_rope_cache")
    if resolve_backend(backend, q, fn is not None) == "triton":
        return fn(q, k, v, q_weight, k_weight, eps, cos, sin, pos, k_cache, v_cache, pdl=pdl)
    return qk_norm_rope_cache_naive(q, k, v, q_weight, k_weight, eps, cos, sin, pos, k_cache, v_cache)


def qk_rope_indexer_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                           k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                           pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, zq: torch.Tensor,
                           zk: torch.Tensor, zw: torch.Tensor, ln_weight: torch.Tensor | None,
                           ln_bias: torch.Tensor | None, ln_eps: float, rope_dim: int, idx_cache: torch.Tensor,
                           idx_scale: torch.Tensor | None = None, *, backend: str = "auto", pdl: bool = False):
    """`qk_norm_rope_cache` and `indexer_decode` of one sparse decode layer (same arguments, the indexer's after
    the K/V cache's) -> (q rotated `[B, H, D]`, q_I `[B, H_I, d_I]`, w `[B, H_I]`), every cache written; Triton:
    one launch for the two (`decode_fused.triton.qk_rope_indexer_decode`), the same values."""
    fn = kernel("decode_fused", "qk_rope_indexer_decode")
    if resolve_backend(backend, q, fn is not None) == "triton":
        return fn(q, k, v, q_weight, k_weight, eps, cos, sin, pos, k_cache, v_cache, zq, zk, zw, ln_weight, ln_bias,
                  ln_eps, rope_dim, idx_cache, idx_scale, pdl=pdl)
    qo = qk_norm_rope_cache_naive(q, k, v, q_weight, k_weight, eps, cos, sin, pos, k_cache, v_cache)
    return (qo, *indexer_decode_naive(zq, zk, zw, cos, sin, ln_weight, ln_bias, ln_eps, rope_dim, pos, idx_cache,
                                      idx_scale))


def silu_mul(gate_up: torch.Tensor, *, backend: str = "auto", pdl: bool = False) -> torch.Tensor:
    """The gated MLP's SiLU(gate) * up from one fused gate/up GEMM: gate_up `[B, 2N]` -> `[B, N]`."""
    fn = kernel("decode_fused", "silu_mul")
    if resolve_backend(backend, gate_up, fn is not None) == "triton":
        return fn(gate_up, pdl=pdl)
    return silu_mul_naive(gate_up)


def _linear_naive(x: torch.Tensor, w: torch.Tensor, norm: tuple | None) -> torch.Tensor:
    """The reference GEMM, with norm = (partials of h^2, eps) the RMSNorm form (x = h * the norm's weight)."""
    from sparse_rl.sparse.ops.skinny_gemm.naive import rms_linear_naive, skinny_linear_naive

    return skinny_linear_naive(x, w) if norm is None else rms_linear_naive(x, w, *norm)


def skinny_silu_mul(x: torch.Tensor, w: torch.Tensor, *, backend: str = "auto", norm: tuple | None = None,
                    **kw) -> torch.Tensor:
    """The gated MLP's SiLU(x @ gateᵀ) * (x @ upᵀ) from the fused gate/up weight w `[2N, K]` (gate rows first), x
    `[M, K]` (M <= 64) -> `[M, N]`: one swap-AB launch (`skinny_gemm/swapab.py`, kw its tile and `pdl`) for what
    `skinny_linear` + `silu_mul` take two; the reference is theirs. norm: as `skinny_linear`'s."""
    fn = kernel("skinny_gemm", "swapab_silu_mul", module="swapab")
    if x.shape[0] <= SKINNY_ROWS["swapab"] and resolve_backend(backend, x, fn is not None) == "triton":
        return fn(x, w, norm=norm, **kw)
    return silu_mul_naive(_linear_naive(x, w, norm))


SKINNY_IMPLS = ("splitk", "swapab")  # `skinny_linear`'s kernels
SKINNY_ROWS = {"splitk": 32, "swapab": 64}  # the most rows each takes


def skinny_linear(x: torch.Tensor, w: torch.Tensor, cnt: torch.Tensor | None = None, *, backend: str = "auto",
                  impl: str = "splitk", residual: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                  norm: tuple | None = None, **kw):
    """x `[M, K]` (M <= 32; 64 for "swapab") @ w `[N, K]`ᵀ -> `[M, N]`, no bias: the Triton kernel splits K inside
    one launch (cnt: the call site's tile counters, `skinny_gemm.triton.counters`; kw: its tiles). impl:
    "splitk" (`skinny_gemm/triton.py`: the rows in the MMA's M) or "swapab" (`skinny_gemm/swapab.py`: yᵀ = W xᵀ,
    the weight rows in the MMA's M, wgmma on sm_90a; kw may carry its `pdl` level). The reference is
    F.linear's arithmetic. Swapab only: residual `[M, N]` returns (h = residual + y, partials: the per-tile sums of
    h^2 for the next GEMM's RMSNorm, hn = h * scale `[N]` (the next norm's weight) or None without scale),
    `ops.add_rmsnorm`'s residual add in the epilogue; norm = (partials, eps): x is such an hn and the GEMM returns
    RMSNorm(h) @ wᵀ (`swapab_linear`; a path's partials are its own: the reference's sum each row in one `[1, M]`).
    """
    from sparse_rl.sparse.ops.skinny_gemm.naive import residual_epilogue_naive

    if impl not in SKINNY_IMPLS:
        raise ValueError(f"skinny_linear: impl {impl!r} not among {SKINNY_IMPLS}")
    if (residual is not None or norm is not None or scale is not None) and impl != "swapab":
        raise ValueError("skinny_linear: residual / scale / norm need impl='swapab'")
    fn = (kernel("skinny_gemm", "skinny_linear") if impl == "splitk"
          else kernel("skinny_gemm", "swapab_linear", module="swapab"))
    if x.shape[0] <= SKINNY_ROWS[impl] and resolve_backend(backend, x, fn is not None) == "triton":
        return (fn(x, w, cnt, **kw) if impl == "splitk"
                else fn(x, w, cnt, residual=residual, scale=scale, norm=norm, **kw))
    if residual is not None:
        return residual_epilogue_naive(_linear_naive(x, w, norm), residual, scale)
    return _linear_naive(x, w, norm)
