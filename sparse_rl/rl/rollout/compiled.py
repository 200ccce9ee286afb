"""torch.compile support for the rollout engine's decode step (forward.py).

Inductor fuses the step's elementwise chains (RMSNorm, RoPE, SiLU*mul, residual and bias adds,
the KV-cache writes) between the matmuls; `ModelRunner` then captures the *compiled* step in its
own per-bucket CUDA graphs, so a replay launches far fewer kernels.

What lives here:
- Our sparse ops as opaque `torch.library.custom_op`s (the decode selectors among them with the
  signatures of `layer.DecodeOps`: this module is what the compiled step passes `layer.select` as `ops`). Their Python sides pick backends, split-K
  counts and Triton launch grids from shapes; dynamo must not trace into them, it only needs each
  op's output shape (`register_fake`). `sparse_rl.sparse.ops` is called unchanged inside.
- `fresh_function`: a copy of a function with its own code object. Dynamo keeps its compiled
  entries (and its recompile limit, 8 by default) per code object; every `ModelRunner` variant
  (runner x mode x short/long selection) gets its own, so many engines in one process (benchmarks,
  evals) never exhaust a shared limit and silently run uncompiled.
- `counting_backend`: the compiler backend wrapped so the runner can count the graphs it compiled
  (a recompile or a graph break shows up as more graphs) and notice when dynamo compiled nothing;
  inductor runs under `INDUCTOR_PATCHES` (no pointwise autotuning, see there).
"""

from __future__ import annotations

import dataclasses
import types

from typing import Optional

import torch

from sparse_rl.sparse import layer, ops

NS = "sparse_rl_rollout"


@torch.library.custom_op(f"{NS}::sparse_decode", mutates_args=())
def sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor,
                  scale: float, backend: str) -> torch.Tensor:
    """`ops.sparse_decode` without the lse: q `[B, H, D]`, caches `[B, S_max, H_kv, D]`, indices
    `[B, K]` int32 (-1 = none) -> out `[B, H, D]` in q's dtype."""
    # .contiguous(): the compiled caller assumes the fake's (contiguous) strides
    return ops.sparse_decode(q, k_cache, v_cache, indices, scale, backend=backend)[0].contiguous()


@sparse_decode.register_fake
def _(q, k_cache, v_cache, indices, scale, backend):
    return torch.empty_like(q)


@torch.library.custom_op(f"{NS}::indexer_topk_decode", mutates_args=())
def _indexer_topk_decode(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, pos: torch.Tensor, S: int,
                         topk: int, sink: int, window: int, backend: str, k_scale: Optional[torch.Tensor] = None,
                         impl: str = "auto", row_max_keys: int = 8192, auto_long: str = "chunked",
                         fine_cap: int = 32, score_block: int = 0, num_warps: int = 0,
                         fine_resolve: str = "each", fine_block: int = 0, fine_prefetch: bool = False,
                         fine_maxnreg: int = 0, sync_per_sm: int = 0, sync_keep: bool = True,
                         sync_split: int = 0, sync_max_chunks: int = 0, sync_block: int = 0,
                         sync_coop: bool = True, sync_min_batch: int = 0, cuda_cluster: int = 0) -> torch.Tensor:
    from sparse_rl.sparse.ops.indexer_topk.decode_select import DecodeSelect

    sel = DecodeSelect(impl, row_max_keys, auto_long, fine_cap, score_block, num_warps, fine_resolve, fine_block,
                       fine_prefetch, fine_maxnreg, sync_per_sm, sync_keep, sync_split, sync_max_chunks, sync_block,
                       sync_coop, sync_min_batch, cuda_cluster)
    return ops.indexer_topk_decode(q_idx, w, k_idx[:, :S], pos, topk, sink=sink, window=window,
                                   k_scale=None if k_scale is None else k_scale[:, :S], select=sel,
                                   backend=backend).contiguous()


@_indexer_topk_decode.register_fake
def _(q_idx, w, k_idx, pos, S, topk, sink, window, backend, k_scale=None, impl="auto", row_max_keys=8192,
      auto_long="chunked", fine_cap=32, score_block=0, num_warps=0, fine_resolve="each",
      fine_block=0, fine_prefetch=False, fine_maxnreg=0, sync_per_sm=0, sync_keep=True, sync_split=0,
      sync_max_chunks=0, sync_block=0, sync_coop=True, sync_min_batch=0, cuda_cluster=0):
    return q_idx.new_empty(q_idx.shape[0], topk, dtype=torch.int32)


def indexer_topk_decode(q_idx, w, k_idx, pos, S: int, topk: int, sink: int, window: int, backend: str,
                        k_scale=None, select=None) -> torch.Tensor:
    """`ops.indexer_topk_decode` over the first S rows of the index-key cache, as one opaque op: q_idx
    `[B, H_I, d_I]`, w `[B, H_I]`, k_idx `[B, S_max, d_I]` (fp8: k_scale `[B, S_max]`), pos `[B]` ->
    `[B, topk]` int32 (ascending, -1 padded); select (`DecodeSelect` or None) travels as its fields."""
    # the op's keyword arguments are DecodeSelect's fields (`long` spelt auto_long), less pdl: the runner's own
    kw = {} if select is None else {("auto_long" if f.name == "long" else f.name): getattr(select, f.name)
                                    for f in dataclasses.fields(select) if f.name != "pdl"}
    return _indexer_topk_decode(q_idx, w, k_idx, pos, S, topk, sink, window, backend, k_scale, **kw)


@torch.library.custom_op(f"{NS}::block_select_rows", mutates_args=())
def block_select_rows(q: torch.Tensor, k_cache: torch.Tensor, pos: torch.Tensor, block_size: int, topk_blocks: int,
                      sink_blocks: int, recent_blocks: int, backend: str) -> torch.Tensor:
    """`layer.block_select_rows` with device positions (reads them to the host: no CUDA graphs)."""
    return layer.block_select_rows(q, k_cache, pos.tolist(), block_size, topk_blocks, sink_blocks, recent_blocks,
                                   backend)


@block_select_rows.register_fake
def _(q, k_cache, pos, block_size, topk_blocks, sink_blocks, recent_blocks, backend):
    return q.new_empty(q.shape[0], topk_blocks * block_size, dtype=torch.int32)


def fresh_function(fn):
    """A copy of `fn` with a code object of its own (dynamo's cache and recompile limit are per code object)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


# Inductor config for the decode step. Every KV-cache write (K and V of a layer, or its index keys) is
# fused into a 1-D pointwise Triton kernel whose mutated arguments are the WHOLE cache tensors
# `[L, B, S_max, ...]` (the layer is a constant offset, so each layer gets a kernel of its own). By
# default inductor autotunes pointwise kernels at their first call (2 configs) and protects mutated
# arguments during the benchmark launches: it clones them, or, when the clone does not fit in
# max_memory_allocated() - memory_allocated() (small once the cache is allocated), copies them to
# pinned host memory and back before EVERY benchmark launch (>= 8 per config). That is >= 2 x 9
# round trips of the whole K+V cache per layer (12.9 GB at batch 64, S_max 16K, Qwen2-0.5B), the part
# of the compile time that grows with batch x S_max. One config per pointwise kernel: no benchmark
# runs at all for them (reductions are still tuned; none of them writes the cache; matmuls are cuBLAS).
# Measured on the H200, batch 64, S_max 16K: the dense step's first compile took 269 s, 23 s without
# (benchmarks/results/2026-11-29-h200-rollout-long.md).
INDUCTOR_PATCHES = {"triton.autotune_pointwise": False}


def inductor_pdl_patch() -> dict:
    """Inductor's programmatic-dependent-launch switch as a config patch (`triton.enable_pdl`, in torch 2.13's
    config; {} where this torch has none). Inductor itself emits it only for CUDA sm_90+."""
    import torch._inductor.config as inductor_config

    return {"triton.enable_pdl": True} if hasattr(inductor_config.triton, "enable_pdl") else {}


def counting_backend(name, counter: dict, pdl: bool = False):
    """The dynamo backend `name` ("inductor", "aot_eager", ... or a callable), counting compiled graphs in
    counter["graphs"] and the symbolic sizes of the last graph's inputs in counter["symbols"] (1 = S only).
    "inductor" compiles under `INDUCTOR_PATCHES`, and with pdl under its `triton.enable_pdl` where this torch has
    it (`inductor_pdl_patch`)."""
    from torch._dynamo import lookup_backend

    inner = lookup_backend(name)
    patches = {**INDUCTOR_PATCHES, **(inductor_pdl_patch() if pdl else {})} if name == "inductor" else None

    def backend(gm, example_inputs):
        counter["graphs"] += 1
        counter["symbols"] = len({str(d) for x in example_inputs if isinstance(x, torch.Tensor)
                                  for d in x.shape if isinstance(d, torch.SymInt)}
                                 | {str(x) for x in example_inputs if isinstance(x, torch.SymInt)})
        if patches is None:
            return inner(gm, example_inputs)
        import torch._inductor.config as inductor_config

        # the kernels' autotune setting is fixed in their generated source, at this compile
        with inductor_config.patch(patches):
            return inner(gm, example_inputs)

    return backend
