"""Sparse attention inside stock Hugging Face models, through transformers' attention registry.

Every supported family (llama, qwen2, qwen3, mistral) computes q/k/v, applies RoPE, updates the
KV cache and then calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`. We register one
function, "sparse_rl", under that name. A forward pre-hook on each attention module stashes what
the registry call does not receive (the layer's input hidden state, the rotary tables and the
cache) so the function can run the selector. In dense mode, and in layers kept dense, it simply
delegates to PyTorch SDPA, so a sparse model dir in dense mode is the dense model.

The layer's state and its selector belong to `sparse_rl.sparse.layer`; this module is the HF side.
Per layer, sparse mode: `layer.select_rows` -> `[B, T, K]` int32 indices (causal, sinks + window kept,
left padding skipped; one row per query group where groups line up) -> `layer.attend` over the selected keys. In incremental decoding the
indexer keys are cached beside the KV cache (attribute on the cache object, or the cache's own
`srl_index_keys(layer_idx, k_new)` method if it defines one, as the rollout engine's cache does).
"""

from __future__ import annotations

import torch

from sparse_rl.errors import SparseRLError
from sparse_rl.sparse.config import SparseConfig
from sparse_rl.sparse.indexer import LightningIndexer
from sparse_rl.sparse.layer import (LayerInputs, attach_layer, attend, decoder_layers, layer_state, select_rows,
                                    take_inputs)

__all__ = ["ATTN_NAME", "SUPPORTED", "register", "attach_sparse", "cache_kwarg", "decoder_layers",
           "indexer_state_dict", "load_indexer_state_dict", "sparse_rl_attention"]

ATTN_NAME = "sparse_rl"
SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
# the indexer keys of a transformers cache that has no `srl_index_keys` method: {layer_idx: [B, S, d_I]}
_CACHE_KEYS = "sparse_rl_index_keys"
# with query groups, the index queries and weights of the earlier positions: {layer_idx: (q_I, w)}
_CACHE_QUERIES = "sparse_rl_index_queries"


_registered = False


def register() -> None:
    """Register the "sparse_rl" attention and mask functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, sparse_rl_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    _registered = True


def attach_sparse(model, cfg: SparseConfig) -> None:
    """Give every attention module its LayerState (and, for the indexer selector, a freshly
    initialised LightningIndexer in non-dense layers). Switches the model to the "sparse_rl"
    attention implementation; it starts in dense mode."""
    register()
    config = model.config
    if config.model_type not in SUPPORTED:
        raise SparseRLError(f"unsupported architecture '{config.model_type}' (supported: {', '.join(SUPPORTED)})")
    layers = decoder_layers(model)
    bad = [i for i in cfg.dense_layers if not 0 <= i < len(layers)]
    if bad:
        raise SparseRLError(f"dense_layers {bad}: the model has layers 0..{len(layers) - 1}")
    cfg = cfg.resolved(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    ref = next(model.parameters())
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        dense = i in cfg.dense_layers
        attach_layer(attn, cfg, dense)
        if not dense and cfg.selector == "indexer" and not hasattr(attn, "indexer"):
            attn.indexer = LightningIndexer(config.hidden_size, cfg.index_heads, cfg.index_dim, cfg.rope_dim).to(
                device=ref.device, dtype=ref.dtype)
    config._attn_implementation = ATTN_NAME
    for module in model.modules():  # sub-configs (peft wrappers share the same config object)
        if hasattr(module, "config") and hasattr(module.config, "_attn_implementation"):
            module.config._attn_implementation = ATTN_NAME


def cache_kwarg(model) -> str:
    """Name of the KV-cache argument of `model.forward`: transformers >= 5.2x says `cache`, earlier
    releases `past_key_values`."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def indexer_state_dict(model) -> dict[str, torch.Tensor]:
    """Indexer weights keyed `layers.{i}.{param}` (independent of wrappers such as peft)."""
    out = {}
    for i, layer in enumerate(decoder_layers(model)):
        idx = getattr(layer.self_attn, "indexer", None)
        if idx is not None:
            for k, v in idx.state_dict().items():
                out[f"layers.{i}.{k}"] = v
    return out


def load_indexer_state_dict(model, state: dict[str, torch.Tensor], source: str = "indexer weights") -> None:
    layers = decoder_layers(model)
    expected = set(indexer_state_dict(model))
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        what = f"missing {sorted(missing)[:3]}" if missing else f"unexpected {sorted(unexpected)[:3]}"
        raise SparseRLError(f"{source}: do not match the sparse config ({what})")
    for i, layer in enumerate(layers):
        idx = getattr(layer.self_attn, "indexer", None)
        if idx is not None:
            sub = {k.split(".", 2)[2]: v for k, v in state.items() if k.startswith(f"layers.{i}.")}
            try:
                idx.load_state_dict(sub)
            except RuntimeError as e:
                raise SparseRLError(f"{source}: layer {i}: {str(e).splitlines()[0]}") from None


def _kv_start(mask: torch.Tensor | None, S: int) -> torch.Tensor | None:
    """First valid key per row `[B]` from a 4D mask `[B, 1, T, S']` (left padding), None without mask."""
    if mask is None:
        return None
    last = mask[:, 0, -1, :S]
    valid = last if last.dtype == torch.bool else last == 0
    first = valid.to(torch.int32).argmax(-1)
    return torch.where(valid.any(-1), first, torch.full_like(first, S))


def _index_keys(cache, layer_idx: int, k_new: torch.Tensor, S: int) -> torch.Tensor:
    """Append the new indexer keys `[B, T, d_I]` to the cache's store; return all `[B, S, d_I]`."""
    if cache is None:
        k_all = k_new
    elif hasattr(cache, "srl_index_keys"):
        k_all = cache.srl_index_keys(layer_idx, k_new)
    else:
        store = cache.__dict__.setdefault(_CACHE_KEYS, {})
        prev = store.get(layer_idx)
        k_all = k_new if prev is None else torch.cat([prev, k_new], 1)
        store[layer_idx] = k_all
    if k_all.shape[1] != S:
        raise SparseRLError(f"layer {layer_idx}: indexer key cache holds {k_all.shape[1]} tokens but the KV cache "
                            f"{S} (a cache filled outside sparse_rl, or a sliding-window cache, is not supported)")
    return k_all


def _index_history(cache, layer_idx: int, q_new: torch.Tensor, w_new: torch.Tensor):
    """Query groups in incremental decoding: the (q_I, w) of the positions before this call (None
    without a cache or before the first call); this call's are appended for the next one."""
    if cache is None:
        return None
    store = cache.__dict__.setdefault(_CACHE_QUERIES, {})
    prev = store.get(layer_idx)
    store[layer_idx] = (q_new, w_new) if prev is None else (torch.cat([prev[0], q_new], 1),
                                                            torch.cat([prev[1], w_new], 1))
    return prev


def select_indices(module, query, key, attention_mask, inputs: LayerInputs):
    """The layer's selection inside the HF forward. query `[B, H, T, D]`, key `[B, H_kv, S, D]` ->
    (`layer.Selection`, kv_start `[B]` or None)."""
    st = layer_state(module)
    h, pe, cache = inputs
    T, S = query.shape[2], key.shape[2]
    kv_start = _kv_start(attention_mask, S)
    index = history = None
    if st.cfg.selector == "indexer":
        with torch.no_grad():
            q_i, w, k_i = module.indexer(h.detach(), *pe)
        index = (q_i, w, _index_keys(cache, module.layer_idx, k_i, S))
        if st.cfg.query_group > 1:
            history = _index_history(cache, module.layer_idx, q_i, w)
    sel = select_rows(st, query.detach().transpose(1, 2), key.detach().transpose(1, 2), index, q_offset=S - T,
                      kv_start=kv_start, history=history)
    return sel, kv_start


def sparse_rl_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The registered attention function. query `[B, H, T, D]`, key/value `[B, H_kv, S, D]`;
    returns (out `[B, T, H, D]`, None) like transformers' SDPA integration."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    st = layer_state(module)
    ctx = take_inputs(module)
    if st is None or not st.sparse:
        if ctx is not None and getattr(module, "indexer", None) is not None and ctx.cache is not None:
            # keep the indexer key cache in step, so a dense prefill can be followed by sparse decoding
            with torch.no_grad():
                q_i, w, k_i = module.indexer(ctx.hidden.detach(), *ctx.position_embeddings)
                _index_keys(ctx.cache, module.layer_idx, k_i, key.shape[2])
                if st is not None and st.cfg.query_group > 1:
                    _index_history(ctx.cache, module.layer_idx, q_i, w)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if ctx is None:
        raise SparseRLError("sparse attention called without the layer's inputs (model not prepared by sparse_rl)")
    sel, kv_start = select_indices(module, query, key, attention_mask, ctx)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    out, lse = attend(st, sel, q, k, v, scaling)
    if st.recorder is not None:
        st.recorder(module, hidden=ctx.hidden, position_embeddings=ctx.position_embeddings, query=query, key=key,
                    indices=sel.per_query(q.shape[1]), kv_start=kv_start, lse=lse)
    return out, None
