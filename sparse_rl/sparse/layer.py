"""The sparse layer: one owner for a layer's sparse state and for the choice of its selector.

Every attention module of a sparse model carries one `LayerState` (its `SparseConfig`, whether the
layer is kept dense, the attention mode, the op backend, the training callbacks and the inputs its
pre-hook stashed), stored under one attribute that only this module reads or writes. Everything
else goes through the functions here:

- `layer_state(module)`, `layer_states(model)`, `sparse_layers(model)`, `sparse_config(model)`;
- `set_attention(model, mode, backend)` / `get_attention(model)`: the attention mode ("dense" or
  "sparse") of the whole model; the HF forward and the rollout engine both read it from here;
- `set_topk(model, topk)`, `set_granularity(model, key_block, query_group)`: new selection settings
  for every layer, validated like the config itself (`sink + window <= topk`, ...);
- `select(state, q, k, index, ...)`: THE selector dispatch (indexer or block, sinks, window, left
  padding, and the ops' tie rule: among equal scores the later key wins). The registered HF attention
  (`patch.py`), the rollout engine's prefill and decode (`rl/rollout/forward.py`) and indexer training
  (`train/hooks.py`) all call it; `select_rows` / `attend` are its form for the attention itself
  (query groups as one shared row per group, read by the shared-rows attention kernels).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

import torch

from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.sparse.config import SparseConfig
from sparse_rl.sparse.ops import (block_select, granular_topk, granular_topk_decode, indexer_topk, indexer_topk_decode,
                                  shared_rows_ok, shared_to_per_query, sparse_attention)

MODES = ("dense", "sparse")
_ATTR = "sparse_rl_layer"  # the one attribute name; read and written only here


class LayerInputs(NamedTuple):
    """What the registered attention function does not receive: the layer's input hidden state
    `[B, T, hidden]`, the rotary tables (cos, sin) `[B, T, D]` and the KV cache (or None)."""

    hidden: torch.Tensor
    position_embeddings: tuple
    cache: object


@dataclass
class LayerState:
    """Per-attention-module sparse state.

    recorder: callback(module, **tensors) on every sparse forward (indexer training, fidelity).
    capture: callback(module, query, key, inputs[, lse]) of the training capture attention
    (`train/hooks.py`), on every forward, dense mode included; capture_lse: the dense attention that
    also returns the lse for it (`hooks.AttentionWithLse`), None for a callback without the lse.
    inputs: what the pre-hook stashed for the next attention call (consumed by it).
    """

    cfg: SparseConfig
    dense_layer: bool
    mode: str = "dense"
    backend: str = "auto"
    recorder: Callable | None = field(default=None, repr=False)
    capture: Callable | None = field(default=None, repr=False)
    capture_lse: Callable | None = field(default=None, repr=False)
    inputs: LayerInputs | None = field(default=None, repr=False)
    hooked: bool = False  # the stashing pre-hook is registered on the module

    @property
    def sparse(self) -> bool:
        """This layer runs sparse attention now."""
        return self.mode == "sparse" and not self.dense_layer


def decoder_layers(model) -> list:
    """The decoder layers of a (possibly peft-wrapped) HF causal LM."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(base.get_decoder().layers)


def layer_state(module) -> LayerState | None:
    """The attention module's state, None for a module that was never made sparse."""
    return module.__dict__.get(_ATTR)


def layer_states(model) -> list[LayerState | None]:
    """One entry per decoder layer (None where the layer has no state)."""
    return [layer_state(layer.self_attn) for layer in decoder_layers(model)]


def sparse_layers(model) -> list:
    """The attention modules that can run sparse (they have a state and are not kept dense)."""
    return [layer.self_attn for layer in decoder_layers(model)
            if (s := layer_state(layer.self_attn)) is not None and not s.dense_layer]


def sparse_config(model) -> SparseConfig | None:
    """The model's sparse config (shared by every layer), None for a dense model."""
    return next((s.cfg for s in layer_states(model) if s is not None), None)


def attach_layer(module, cfg: SparseConfig, dense: bool) -> LayerState:
    """Give an attention module a fresh state (dense mode); non-dense layers get the pre-hook that
    stashes their inputs for the registered attention function (registered once per module)."""
    prev = layer_state(module)
    st = LayerState(cfg=cfg, dense_layer=dense, hooked=prev is not None and prev.hooked)
    if not dense and not st.hooked:
        module.register_forward_pre_hook(_stash_inputs, with_kwargs=True)
        st.hooked = True
    module.__dict__[_ATTR] = st
    return st


def _stash_inputs(module, args, kwargs):
    st = layer_state(module)
    if st is None:
        return
    h = kwargs.get("hidden_states", args[0] if args else None)
    pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
    cache = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("past_key_value")))
    st.inputs = LayerInputs(h, pe, cache)


def take_inputs(module) -> LayerInputs | None:
    """The inputs the pre-hook stashed for this call, removed from the state (None if none)."""
    st = layer_state(module)
    if st is None:
        return None
    inputs, st.inputs = st.inputs, None
    return inputs


def set_attention(model, mode: str, backend: str | None = None) -> None:
    """Switch a loaded model between "dense" and "sparse" attention in place (optionally the op
    backend too). The HF forward and every rollout engine over this model follow."""
    if mode not in MODES:
        raise UsageError(f"attention mode {mode!r}: expected dense or sparse")
    states = [s for s in layer_states(model) if s is not None]
    if mode == "sparse" and not states:
        raise SparseRLError("this model has no sparse selector: convert it with `sparse-rl convert` first")
    for s in states:
        s.mode = mode
        if backend is not None:
            s.backend = backend


def get_attention(model) -> str:
    """The model's attention mode: "dense" or "sparse" ("dense" for a model without a selector)."""
    return next((s.mode for s in layer_states(model) if s is not None), "dense")


def set_topk(model, topk: int) -> SparseConfig:
    """Set the indexer's top-k of every layer; returns the new config. Validated like the config
    itself: a top-k below sink + window (or below 1) is a UsageError naming the numbers."""
    return set_selection(model, f"set_topk({topk})", topk=int(topk))


def set_granularity(model, key_block: int = 1, query_group: int = 1, block_score: str | None = None) -> SparseConfig:
    """Set the selection granularity of every layer (validated like the config); returns the new config."""
    extra = {} if block_score is None else {"block_score": block_score}
    return set_selection(model, f"set_granularity({key_block}, {query_group})", key_block=int(key_block),
                         query_group=int(query_group), **extra)


def set_selection(model, what: str, **changes) -> SparseConfig:
    """Replace config fields of every layer (`dataclasses.replace`, so validated); returns the new config."""
    cfg = sparse_config(model)
    if cfg is None:
        raise SparseRLError(f"{what}: this model has no sparse selector: convert it with `sparse-rl convert` first")
    try:
        new = replace(cfg, **changes)
    except UsageError as e:
        raise UsageError(f"{what}: {e}") from None
    for s in layer_states(model):
        if s is not None:
            s.cfg = new
    return new


def set_recorder(module, fn: Callable | None) -> Callable | None:
    """Set the module's sparse-forward recorder; returns the previous one."""
    st = layer_state(module)
    prev, st.recorder = st.recorder, fn
    return prev


def set_capture(module, fn: Callable | None, lse_attention: Callable | None = None) -> None:
    """Set (fn, with its lse attention or None) or clear (None) the module's training-capture callback."""
    st = layer_state(module)
    st.capture, st.capture_lse = fn, lse_attention if fn is not None else None


# ---------------------------------------------------------------------------------------------
# the selector dispatch


def block_select_rows(q: torch.Tensor, k_cache: torch.Tensor, pos, block_size: int, topk_blocks: int,
                      sink_blocks: int, recent_blocks: int, backend: str) -> torch.Tensor:
    """Block selection per decode row (rows sit at different positions): q `[B, H, D]`, k_cache
    `[B, S_max, H_kv, D]`, pos `[B]` (host ints or a tensor) -> `[B, topk_blocks * block_size]` int32."""
    pos = pos.tolist() if isinstance(pos, torch.Tensor) else pos
    rows = [block_select(q[b:b + 1, None], k_cache[b:b + 1, :p + 1], block_size, topk_blocks, q_offset=p,
                         sink_blocks=sink_blocks, recent_blocks=recent_blocks, backend=backend)[0, 0]
            for b, p in enumerate(pos)]
    return torch.stack(rows)


class DecodeOps:
    """The decode-time selector ops `select` calls (eager). The rollout engine's compiled step passes
    its opaque custom ops instead (`rl/rollout/compiled.py`), with the same signatures."""

    @staticmethod
    def indexer_topk_decode(q_idx, w, k_idx, pos, S: int, topk: int, sink: int, window: int, backend: str,
                            k_scale=None, select=None):
        return indexer_topk_decode(q_idx, w, k_idx[:, :S], pos, topk, sink=sink, window=window,
                                   k_scale=None if k_scale is None else k_scale[:, :S], select=select,
                                   backend=backend)

    block_select_rows = staticmethod(block_select_rows)


def update_group(pos: torch.Tensor, q_i: torch.Tensor, w: torch.Tensor, group: tuple, query_group: int):
    """Decode with query groups: rows whose position starts a group store their index query and
    weights in `group` = (q_rep `[B, H_I, d_I]`, w_rep `[B, H_I]`, updated in place); the others read
    their representative's from there. -> (q_rep, w_rep) for this step."""
    starts = (pos % query_group == 0)
    q_rep = torch.where(starts[:, None, None], q_i, group[0])
    w_rep = torch.where(starts[:, None], w, group[1])
    group[0].copy_(q_rep)
    group[1].copy_(w_rep)
    return q_rep, w_rep


def _group_rows(q_rep, w_rep, k_cache, pos, S: int, c: SparseConfig, backend: str, ops) -> torch.Tensor:
    """Decode rows of token-level query groups (key_block 1): the representative r's top-(topk - G + 1)
    from the indexer's decode op at position r, then the group's keys r+1..pos; `[B, topk]` int32, the
    reference's row (`ops.granular_topk_decode`), ascending, -1 padded."""
    from sparse_rl.sparse.ops.indexer_topk.naive import group_start

    G = c.query_group
    rep = group_start(pos, torch.zeros_like(pos), G)
    rows = ops.indexer_topk_decode(q_rep, w_rep, k_cache, rep, S, c.topk - G + 1, c.sink, c.window, backend)
    extra = rep[:, None] + torch.arange(1, G, device=pos.device)
    extra = torch.where(extra <= pos[:, None], extra, -1).to(rows.dtype)
    big = torch.iinfo(torch.int32).max
    both = torch.cat([rows, extra], -1)
    both = torch.where(both < 0, big, both).sort(-1).values
    return torch.where(both == big, -1, both)


class Selection(NamedTuple):
    """A sequence's selection as the attention reads it: indices `[B, T, K]` per query (query_group 1),
    or `[B, ceil(T / G), K]` one row per group of G = query_group consecutive queries, each query seeing
    its row's keys <= q_offset + t (`ops.sparse_attention(..., query_group=, q_offset=)`)."""

    indices: torch.Tensor
    query_group: int = 1
    q_offset: int = 0
    key_block: int = 1  # the rows' key block (shared rows of whole blocks take the block kernels)

    def per_query(self, T: int) -> torch.Tensor:
        """The per-query rows `[B, T, K]` (what `select` returns)."""
        if self.query_group == 1:
            return self.indices
        return shared_to_per_query(self.indices, self.query_group, T, self.q_offset)


def select_rows(st: LayerState, q: torch.Tensor, k: torch.Tensor, index: tuple | None = None, *, q_offset: int = 0,
                kv_start: torch.Tensor | None = None, history: tuple | None = None) -> Selection:
    """`select` for a sequence (same arguments), in the form the attention reads fastest: an indexer
    with query groups returns one row per group where the groups start at query 0 of every row
    (`ops.shared_rows_ok`: no left padding, q_offset a multiple of the group), so the attention
    streams each group's keys once per tile (no union build); everything else per-query rows."""
    c = st.cfg
    if c.selector == "indexer" and shared_rows_ok(kv_start, q_offset, c.query_group):
        q_i, w, k_i = index
        rows = granular_topk(q_i, w, k_i, c.topk, q_offset=q_offset, sink=c.sink, window=c.window,
                             key_block=c.key_block, query_group=c.query_group, block_score=c.block_score,
                             shared=True, backend=st.backend)
        return Selection(rows, c.query_group, q_offset, c.key_block)
    return Selection(select(st, q, k, index, q_offset=q_offset, kv_start=kv_start, history=history), 1, q_offset)


def attend(st: LayerState, sel: Selection, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           scale: float | None = None):
    """Sparse attention of the layer over `sel`: q `[B, T, H, D]`, k/v `[B, S, H_kv, D]` -> (out
    `[B, T, H, D]`, lse `[B, T, H]` fp32), on the layer's op backend."""
    return sparse_attention(q, k, v, sel.indices, scale, query_group=sel.query_group, q_offset=sel.q_offset,
                            key_block=sel.key_block if sel.query_group > 1 else 1, backend=st.backend)


def select(st: LayerState, q: torch.Tensor, k: torch.Tensor, index: tuple | None = None, *, q_offset: int = 0,
           kv_start: torch.Tensor | None = None, pos=None, S: int | None = None, visible: torch.Tensor | None = None,
           ops=DecodeOps, history: tuple | None = None, group: tuple | None = None,
           decode_select=None) -> torch.Tensor:
    """The layer's selector: which keys each query attends to (causal; the first `sink` and last
    `window` keys forced for the indexer, sink/recent blocks for the block selector).

    Sequences (HF attention, prefill, training): q `[B, T, H, D]`, k `[B, S, H_kv, D]`, index (indexer
    selector) = (q_I `[B, T, H_I, d_I]`, w `[B, T, H_I]`, k_I `[B, S, d_I]`), queries at q_offset..,
    kv_start `[B]` first valid key per row (left padding) or None -> `[B, T, K]` int32 (-1 = none).

    Decode (`pos` given: one query per row, each at its own position): q `[B, H, D]`, k the layer's
    key cache `[B, S_max, H_kv, D]`, index = (q_I `[B, H_I, d_I]`, w `[B, H_I]`, index-key cache
    `[B, S_max, d_I]`, then its fp8 scales `[B, S_max]` when `cfg.index_dtype` is fp8), S the bucket
    (keys read: the first S) -> `[B, K]` int32. pos is a `[B]`
    tensor, or host ints for the eager block selector. visible: every visible key `[B, S]`, given
    when the caller knows S <= topk (the indexer then keeps them all). ops: `DecodeOps` or the
    compiled step's equivalents. decode_select: the indexer's decode select kernel choice
    (`ops.indexer_topk.decode_select.DecodeSelect`, None: its default; the rollout runner's `decode_select`).

    Granularity (`cfg.key_block`, `cfg.query_group`, docs/DESIGN.md "Selection granularity"): the
    granular selection of `ops.granular_topk`; a sequence whose first group started before q_offset
    needs `history` = (q_I `[B, q_offset, H_I, d_I]`, w `[B, q_offset, H_I]`) of the earlier
    positions; decode with query_group > 1 needs `group` = the rows' representative buffers
    (`update_group`; decode rows then start at key 0, as in the rollout engine).
    """
    c = st.cfg
    if pos is None:
        if c.selector == "indexer" and c.granular:
            q_i, w, k_i = index
            return granular_topk(q_i, w, k_i, c.topk, q_offset=q_offset, sink=c.sink, window=c.window,
                                 kv_start=kv_start, key_block=c.key_block, query_group=c.query_group,
                                 block_score=c.block_score, history=history, backend=st.backend)
        if c.selector == "indexer":
            q_i, w, k_i = index
            return indexer_topk(q_i, w, k_i, c.topk, q_offset=q_offset, sink=c.sink, window=c.window,
                                kv_start=kv_start, backend=st.backend)
        return block_select(q, k, c.block_size, c.topk_blocks, q_offset=q_offset, sink_blocks=c.sink_blocks,
                            recent_blocks=c.recent_blocks, kv_start=kv_start, backend=st.backend)
    if c.selector == "indexer" and c.granular:
        q_i, w, k_cache = index
        if c.query_group > 1:
            if group is None:
                raise SparseRLError(f"query_group {c.query_group}: decode needs the rows' group buffers")
            q_i, w = update_group(torch.as_tensor(pos, device=q_i.device), q_i, w, group, c.query_group)
        if visible is not None:
            return visible
        if c.key_block == 1:  # token-level groups: the indexer's own decode top-k at the representative
            return _group_rows(q_i, w, k_cache, torch.as_tensor(pos, device=q_i.device), S, c, st.backend, ops)
        return granular_topk_decode(q_i, w, k_cache[:, :S], torch.as_tensor(pos, device=q_i.device), c.topk,
                                    sink=c.sink, window=c.window, key_block=c.key_block,
                                    query_group=c.query_group, block_score=c.block_score, backend=st.backend)
    if c.selector == "indexer":
        if visible is not None:
            return visible
        q_i, w, k_cache, *scale = index  # fp8 index keys: their per-token scales `[B, S_max]` follow
        return ops.indexer_topk_decode(q_i, w, k_cache, pos, S, c.topk, c.sink, c.window, st.backend,
                                       k_scale=scale[0] if scale else None, select=decode_select)
    return ops.block_select_rows(q, k, pos, c.block_size, c.topk_blocks, c.sink_blocks, c.recent_blocks, st.backend)
