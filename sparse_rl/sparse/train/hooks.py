"""The per-step work of indexer training: hooks into the attention layers, one warm-up or sparse
forward, and `evaluate`. See `trainer.py` for the design; this module holds the tensor plumbing.
"""

from __future__ import annotations

import contextlib

import torch

from sparse_rl.sparse.layer import layer_state, select, set_capture, set_recorder, sparse_layers

CAPTURE = "sparse_rl_capture"


# ---------------------------------------------------------------------------------------------
# hooks into the attention layers


def _capture_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """Registered as "sparse_rl_capture": report (q, k) to the module's callback, then run the
    normal "sparse_rl" attention. query `[B, H, T, D]`, key `[B, H_kv, S, D]` after RoPE.
    A callback registered with an lse attention (`AttentionWithLse`) also gets the dense log-sum-exp
    `[B, H, T]` (or None where it is not available): the attention then runs through that kernel."""
    from sparse_rl.sparse.layer import take_inputs
    from sparse_rl.sparse.patch import sparse_rl_attention

    st = layer_state(module)
    stash = st.inputs if st is not None else None
    if st is not None and st.capture is not None and stash is not None:
        fn = st.capture
        if not st.capture_lse:
            fn(module, query, key, stash)
        else:
            res = _dense_with_lse(module, st.capture_lse, query, key, value, attention_mask, stash, *args, **kwargs)
            if res is None:
                fn(module, query, key, stash, None)
            else:
                take_inputs(module)  # consumed, as sparse_rl_attention would have
                fn(module, query, key, stash, res[1])
                return res[0], None
    return sparse_rl_attention(module, query, key, value, attention_mask, *args, **kwargs)


def _dense_with_lse(module, lse_attention, query, key, value, attention_mask, stash, dropout: float = 0.0,
                    scaling=None, **kwargs):
    """Dense causal attention through ATen's cuDNN or flash kernel (`lse_attention`), which also
    returns the log-sum-exp the fused warm-up KL needs: (out `[B, T, H, D]`, lse `[B, H, T]` fp32).
    None where the plain path must run instead: not CUDA fp16/bf16, a mask (padding), a KV cache,
    sliding window, dropout, a head dim flash does not take, or a layer in sparse mode."""
    st = layer_state(module)
    if st is not None and st.sparse:
        return None
    B, H, T, D = query.shape
    if (not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16) or attention_mask is not None
            or stash[2] is not None or key.shape[2] != T or T < 2 or dropout or D % 8 or D > 256
            or kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None
            or kwargs.get("is_causal", getattr(module, "is_causal", True)) is False):
        return None
    scale = scaling if scaling is not None else module.scaling
    out, lse = lse_attention(query, key, value, scale)
    return out.transpose(1, 2).contiguous(), lse


LSE_BACKENDS = ("auto", "cudnn", "flash")


def _flash(query, key, value, scale):
    fn = torch.ops.aten._scaled_dot_product_flash_attention
    try:  # flash takes grouped KV heads as they are
        res = fn(query, key, value, 0.0, True, False, scale=scale)
    except RuntimeError:
        g = query.shape[1] // key.shape[1]
        res = fn(query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1), 0.0, True, False, scale=scale)
    return res[0], res[1]


def _cudnn(query, key, value, scale):
    g = query.shape[1] // key.shape[1]
    if g > 1:  # expanded: a copy of K and V costs far less than the attention
        key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(query, key, value, None, True, 0.0, True, False,
                                                             scale=scale)
    lse = res[1]
    return res[0], lse.squeeze(-1) if lse.dim() == 4 else lse


def _checked(out, lse, query, value):
    B, H, T, _ = query.shape
    if out.shape != (B, H, T, value.shape[-1]) or lse.dim() != 3 or lse.shape[:2] != (B, H) or lse.shape[2] < T:
        raise RuntimeError(f"attention returned out {tuple(out.shape)}, lse {tuple(lse.shape)} for query "
                           f"{tuple(query.shape)}")
    return out, lse[:, :, :T].float()


class AttentionWithLse:
    """Causal dense attention (no mask, T == S) and its natural-log lse through an ATen kernel: query
    `[B, H, T, D]`, key/value `[B, H_kv, T, D]` (CUDA, fp16/bf16) -> (out `[B, H, T, D]`, lse `[B, H, T]` fp32).

    backend: "cudnn", "flash", or "auto": cuDNN's, kept once it has matched flash's output and lse on
    the first call, else flash's (flash took 6.4 ms against plain SDPA's 4.3 ms at 32K, Qwen2-0.5B
    heads, H200, so cuDNN is tried first). The choice "auto" makes is kept in this object (`backend`
    after the first call): one object serves a whole training run. A cuDNN kernel that raises moves
    the object to flash for good."""

    def __init__(self, backend: str = "auto"):
        if backend not in LSE_BACKENDS:
            raise ValueError(f"lse attention backend {backend!r}: expected one of {', '.join(LSE_BACKENDS)}")
        self.backend = backend

    def __call__(self, query, key, value, scale: float):
        if self.backend in ("auto", "cudnn"):
            try:
                out, lse = _checked(*_cudnn(query, key, value, scale), query, value)
            except RuntimeError:
                self.backend = "flash"
            else:
                if self.backend == "auto":
                    ref, ref_lse = _checked(*_flash(query, key, value, scale), query, value)
                    same = (float((out.float() - ref.float()).abs().max()) <= 2e-2 * max(1.0, float(ref.abs().max()))
                            and float((lse - ref_lse).abs().max()) <= 1e-2)
                    self.backend = "cudnn" if same else "flash"
                    if not same:
                        return ref, ref_lse
                return out, lse
        return _checked(*_flash(query, key, value, scale), query, value)


_capture_registered = False


def _register_capture() -> None:
    global _capture_registered
    if _capture_registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from sparse_rl.sparse.patch import register

    register()
    AttentionInterface.register(CAPTURE, _capture_attention)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    _capture_registered = True


@contextlib.contextmanager
def capture_dense(model, fn, lse: "bool | AttentionWithLse" = False):
    """While active, `fn(module, query, key, (hidden, position_embeddings, cache))` runs in every
    layer that has an indexer, on each forward (dense mode included). With `lse` (True: a fresh
    `AttentionWithLse()`, or the caller's), it is called with a fifth argument: the layer's dense
    log-sum-exp `[B, H, T]` fp32 from its own attention, or None."""
    lse_attention = (AttentionWithLse() if lse is True else lse) or None
    _register_capture()
    configs = {id(m.config): m.config for m in model.modules()
               if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")}
    old = {k: c._attn_implementation for k, c in configs.items()}
    mods = [m for m in indexed_attention(model)]
    try:
        for c in configs.values():
            c._attn_implementation = CAPTURE
        for m in mods:
            set_capture(m, fn, lse_attention)
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = old[k]
        for m in mods:
            set_capture(m, None)


@contextlib.contextmanager
def recording(model, fn):
    """Set the patch's sparse-mode `recorder` hook on every indexed layer while active."""
    mods = indexed_attention(model)
    try:
        for m in mods:
            set_recorder(m, fn)
        yield
    finally:
        for m in mods:
            set_recorder(m, None)


def indexed_attention(model) -> list:
    """The attention modules that carry a trainable indexer (non-dense layers)."""
    return [m for m in sparse_layers(model) if getattr(m, "indexer", None) is not None]


def _select(module, query, key, index, q_offset: int) -> torch.Tensor:
    """The layer's own selection (`layer.select`) for a captured call: query `[B, H, T, D]`, key
    `[B, H_kv, S, D]`, index = the indexer's (q_I, w, k_I) -> `[B, T, K]` int32."""
    return select(layer_state(module), query.detach().transpose(1, 2), key.detach().transpose(1, 2), index,
                  q_offset=q_offset)


# ---------------------------------------------------------------------------------------------
# one training step


class StepStats:
    """Sums of the per-layer KL / recall over one step (divided by query counts at the end)."""

    def __init__(self, device):
        self.v = torch.zeros(5, dtype=torch.float64, device=device)  # kl, n_kl, recall, n_recall, lm_loss

    def add(self, st) -> None:
        self.v[0] += st.kl
        self.v[1] += st.n
        if st.recall is not None:
            self.v[2] += st.recall
            self.v[3] += st.n


def warmup_forward(model, ids: torch.Tensor, stats: StepStats, grad_scale: float, chunk: int | None = None,
                   impl: str = "torch", measure_recall: bool = True,
                   lse_attention: AttentionWithLse | None = None) -> None:
    """Dense frozen forward of the decoder stack; each indexed layer trains its indexer on the warm-up KL.

    impl: the `ops.warmup_kl` backend, "torch" (query chunks) or "triton" (fused tiles; unpadded rows
    only, which is what the packed training data is).
    measure_recall: select the top-k to report attn_recall (the loss itself needs no selection); the
    trainer asks for it on logged steps only.
    With "triton" the dense log-sum-exp comes from each layer's own flash attention where available
    (`capture_dense(lse=...)`), so the fused KL skips its dense-lse pass; lse_attention: the kernel
    choice for that (default: a fresh `AttentionWithLse()`; pass one object for every step of a run)."""
    from sparse_rl.sparse.ops import warmup_kl

    def on_layer(module, query, key, stash, lse=None):
        h, pe, _ = stash
        with torch.enable_grad():
            q_i, w, k_i = module.indexer(h.detach(), pe[0].detach(), pe[1].detach())
        q_offset = key.shape[2] - query.shape[2]
        idx = None
        if measure_recall:
            with torch.no_grad():
                idx = _select(module, query, key, (q_i.detach(), w.detach(), k_i.detach()), q_offset)
        with torch.enable_grad():
            st = warmup_kl(query.detach(), key.detach(), q_i, w, k_i, scale=module.scaling, indices=idx,
                           q_offset=q_offset, chunk=chunk, grad_scale=grad_scale, lse=lse, backend=impl)
        stats.add(st)

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lse = (lse_attention or AttentionWithLse()) if impl == "triton" else False
    with capture_dense(model, on_layer, lse=lse), torch.no_grad():
        base.get_decoder()(input_ids=ids, use_cache=False)


def sparse_forward(model, ids: torch.Tensor, stats: StepStats, grad_scale: float, measure_recall: bool,
                   chunk: int | None = None) -> torch.Tensor:
    """Sparse forward + LM loss (returned, not yet back-propagated); each indexed layer trains its
    indexer on `selected_kl` from the recorder hook."""
    from sparse_rl.sparse.ops import dense_lse, selected_kl

    def recorder(module, hidden, position_embeddings, query, key, indices, kv_start, lse):
        q, k = query.detach(), key.detach()
        q_offset = k.shape[2] - q.shape[2]
        with torch.enable_grad():
            q_i, w, k_i = module.indexer(hidden.detach(), *(x.detach() for x in position_embeddings))
            lse_d = (dense_lse(q, k, module.scaling, q_offset=q_offset, kv_start=kv_start,
                               chunk=chunk) if measure_recall else None)
            st = selected_kl(q, k, q_i, w, k_i, indices, lse.detach(), scale=module.scaling, lse_dense=lse_d,
                             chunk=chunk, grad_scale=grad_scale)
        stats.add(st)

    with recording(model, recorder):
        out = model(input_ids=ids, labels=ids, use_cache=False)
    return out.loss


@torch.no_grad()
def evaluate(model, rows: torch.Tensor, *, chunk: int | None = None, lm_loss: bool = True) -> dict:
    """Indexer quality on token rows `[N, L]` (one row at a time, model left in dense mode).

    Returns mean `kl` (warm-up KL to the dense target), `attn_recall` (dense attention mass inside
    the indexer's selection: top-k + sinks + window), `oracle_recall` (the best any k keys could
    reach: the target's own top-k), per layer and averaged over layers and queries; with `lm_loss`,
    the LM loss of the same rows in dense and in sparse mode.
    """
    from sparse_rl.sparse.layer import get_attention, set_attention
    from sparse_rl.sparse.ops import warmup_kl

    was = get_attention(model)
    set_attention(model, "dense")
    per_layer: dict[int, torch.Tensor] = {}

    def on_layer(module, query, key, stash):
        h, pe, _ = stash
        q_i, w, k_i = module.indexer(h, *pe)
        q_offset = key.shape[2] - query.shape[2]
        idx = _select(module, query, key, (q_i, w, k_i), q_offset)
        st = warmup_kl(query, key, q_i, w, k_i, scale=module.scaling, indices=idx, q_offset=q_offset, chunk=chunk,
                       oracle=True, backend="torch")
        acc = per_layer.setdefault(module.layer_idx, torch.zeros(4, dtype=torch.float64, device=query.device))
        acc += torch.stack([st.kl, st.recall, st.oracle, torch.tensor(float(st.n), dtype=torch.float64,
                                                                         device=query.device)])

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dense_loss, sparse_loss = [], []
    for i in range(rows.shape[0]):
        ids = rows[i:i + 1]
        with capture_dense(model, on_layer):
            base.get_decoder()(input_ids=ids, use_cache=False)
        if lm_loss:
            set_attention(model, "dense")
            dense_loss.append(float(model(input_ids=ids, labels=ids, use_cache=False).loss))
            set_attention(model, "sparse")
            sparse_loss.append(float(model(input_ids=ids, labels=ids, use_cache=False).loss))
            set_attention(model, "dense")
    set_attention(model, was)
    layers = {i: {"kl": float(v[0] / v[3]), "attn_recall": float(v[1] / v[3]), "oracle_recall": float(v[2] / v[3])}
              for i, v in sorted(per_layer.items())}
    out = {k: sum(x[k] for x in layers.values()) / len(layers) for k in ("kl", "attn_recall", "oracle_recall")}
    out["layers"] = layers
    if lm_loss:
        out["lm_loss_dense"] = sum(dense_loss) / len(dense_loss)
        out["lm_loss_sparse"] = sum(sparse_loss) / len(sparse_loss)
    return out
