"""A lean forward pass over the loaded HF model's own modules, against the slot KV cache.

No copy of the weights: embeddings, norms, q/k/v/o projections (qwen2 biases, qwen3 q_norm/k_norm
included, since they are the model's modules), MLPs, lm_head, the rotary table and, in sparse mode,
each layer's indexer are called directly. So a trainer that updates the model's parameters in place
is seen by the next step, and peft LoRA layers (if the model is wrapped) simply run as part of
the projections.

Two passes:
- `prefill`: a batch of prompts, right-padded to a common length (causal attention never lets a
  real token see the padding behind it), writes K/V (and index keys) into the prompts' slots and
  returns the last real position's logits.
- `decode`: one token for every slot at once (inactive slots compute on dummies: a fixed batch
  keeps shapes static for CUDA graphs). Keys are read from `cache[:, :S]`, S a bucket of the
  longest live sequence, and masked per slot by its own position.

Sparse semantics are those of `sparse_rl.sparse.patch` (layers in `dense_layers` dense; indexer:
scores over all visible keys, first `sink` and last `window` forced, top-k; block selector per row
through `ops.block_select`). In decode the indexer top-k is done per row here (rows have different
positions); on CPU it uses the reference's exact tie rule (`select_topk`: among equal scores the
later key wins); on CUDA `torch.topk`, like the Triton `indexer_topk`, which leaves ties among
exactly equal scores to the kernel.

Dense decode attention: PyTorch SDPA with a per-slot mask on CPU; on CUDA the split-K Triton
decode kernel (`ops.sparse_decode`) given every visible position as its index list, so it reads
only the slot's live keys (SDPA would read the whole bucket and has no split-K for one query).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from sparse_rl.errors import SparseRLError
from sparse_rl.rl.rollout.cache import KVCache
from sparse_rl.sparse.ops import block_select, indexer_topk, sparse_attention, sparse_decode
from sparse_rl.sparse.ops.indexer_topk.naive import select_topk


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class ModelRunner:
    """Prefill/decode over `model`'s modules. `mode` is "dense" or "sparse"."""

    def __init__(self, model, device, use_graphs: bool | None = None):
        base = _base(model)
        dec = base.get_decoder()
        self.model, self.base = model, base
        self.embed, self.norm, self.rotary = dec.embed_tokens, dec.norm, dec.rotary_emb
        self.lm_head = base.get_output_embeddings()
        self.layers = list(dec.layers)
        cfg = base.config
        self.config = cfg
        self.n_layers = len(self.layers)
        self.H, self.H_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        attn0 = self.layers[0].self_attn
        self.D = attn0.head_dim
        self.vocab = self.lm_head.out_features
        self.rope = sys.modules[type(attn0).__module__].apply_rotary_pos_emb
        self.states = [getattr(layer.self_attn, "srl", None) for layer in self.layers]
        self.index_dim = next((layer.self_attn.indexer.index_dim for layer in self.layers
                               if getattr(layer.self_attn, "indexer", None) is not None), None)
        self.device = torch.device(device)
        self.dtype = next(base.parameters()).dtype
        self.is_cuda = self.device.type == "cuda"
        self.use_graphs = self.is_cuda if use_graphs is None else (use_graphs and self.is_cuda)
        self.dense_impl = "index" if self.is_cuda else "sdpa"
        self.exact_select = not self.is_cuda
        self._graphs: dict = {}
        self._pool = None
        self._static: dict = {}
        self.graph_error: str | None = None

    # ---------------------------------------------------------------- helpers
    def _qkv(self, attn, x, cos, sin):
        """x `[B, T, hidden]` -> q `[B, T, H, D]`, k/v `[B, T, H_kv, D]` (RoPE applied)."""
        B, T, _ = x.shape
        q = attn.q_proj(x).view(B, T, -1, self.D)
        k = attn.k_proj(x).view(B, T, -1, self.D)
        v = attn.v_proj(x).view(B, T, -1, self.D)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rope(q, k, cos, sin, unsqueeze_dim=2)
        return q, k, v

    def _sparse(self, i: int, mode: str) -> bool:
        st = self.states[i]
        return mode == "sparse" and st is not None and not st.dense_layer

    def _mlp_out(self, layer, h):
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _logits(self, h):
        return self.lm_head(self.norm(h)).float()

    # ---------------------------------------------------------------- prefill
    def prefill(self, cache: KVCache, tokens: torch.Tensor, lengths: list[int], slots: list[int],
                mode: str) -> torch.Tensor:
        """tokens `[P, T]` right-padded, lengths `[P]` -> logits `[P, V]` float32 at each row's last
        real token. Writes rows 0..T-1 of each slot (rows past a prompt's length are overwritten by
        decoding before they become visible)."""
        P, T = tokens.shape
        pos = torch.arange(T, device=tokens.device)[None].expand(P, T)
        slot_t = torch.tensor(slots, device=tokens.device)
        h = self.embed(tokens)
        cos, sin = self.rotary(h, pos)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = self._qkv(attn, x, cos, sin)
            cache.k[i][slot_t, :T] = k
            cache.v[i][slot_t, :T] = v
            if self._sparse(i, mode):
                st = self.states[i]
                c = st.cfg
                if c.selector == "indexer":
                    q_i, w, k_i = attn.indexer(x, cos, sin)
                    cache.idx[i][slot_t, :T] = k_i
                    sel = indexer_topk(q_i, w, k_i, c.topk, q_offset=0, sink=c.sink, window=c.window,
                                       backend=st.backend)
                else:
                    sel = block_select(q, k, c.block_size, c.topk_blocks, q_offset=0, sink_blocks=c.sink_blocks,
                                       recent_blocks=c.recent_blocks, backend=st.backend)
                o, _ = sparse_attention(q, k, v, sel, scale=attn.scaling, backend=st.backend)
            else:
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True, scale=attn.scaling,
                                                   enable_gqa=self.H != self.H_kv).transpose(1, 2)
            h = h + attn.o_proj(o.reshape(P, T, -1))
            h = self._mlp_out(layer, h)
        last = torch.tensor([n - 1 for n in lengths], device=tokens.device)
        return self._logits(h[torch.arange(P, device=tokens.device), last])

    # ---------------------------------------------------------------- decode
    def _select_indexer(self, q_i, w, kc, pos, keys, c):
        """q_i `[B, H_I, d_I]`, w `[B, H_I]`, kc `[B, S, d_I]`, pos `[B]` -> `[B, K]` int32 (-1 = none)."""
        if self.exact_select:
            dots = torch.einsum("bhd,bsd->bhs", q_i.float(), kc.float())
        else:
            dots = torch.bmm(q_i, kc.transpose(1, 2)).float()
        scores = (dots.relu() * w.float()[:, :, None]).sum(1)  # [B, S]
        vis = keys[None] <= pos[:, None]
        forced = vis & ((keys[None] < c.sink) | (keys[None] > pos[:, None] - c.window))
        if self.exact_select:
            return select_topk(scores[:, None], vis[:, None], forced[:, None], c.topk)[:, 0]
        s = scores.masked_fill(forced, float("inf")).masked_fill(~vis, float("-inf"))
        vals, idx = torch.topk(s, min(c.topk, s.shape[-1]), dim=-1, sorted=False)
        return torch.where(vals == float("-inf"), -1, idx.to(torch.int32))

    def _select_block(self, q, kc, pos_list, c):
        """Per row (positions differ): q `[B, 1, H, D]`, kc `[B, S, H_kv, D]` -> `[B, K]` int32."""
        rows = []
        for b, p in enumerate(pos_list):
            rows.append(block_select(q[b:b + 1], kc[b:b + 1, :p + 1], c.block_size, c.topk_blocks, q_offset=p,
                                     sink_blocks=c.sink_blocks, recent_blocks=c.recent_blocks,
                                     backend=self.states[0].backend if self.states[0] else "auto")[0, 0])
        return torch.stack(rows)

    def decode_eager(self, cache: KVCache, tokens: torch.Tensor, pos: torch.Tensor, S: int, mode: str) -> torch.Tensor:
        """tokens `[B]` (B = all slots), pos `[B]` (each slot's position for this token) -> logits `[B, V]`."""
        B = tokens.shape[0]
        dev = tokens.device
        ar = torch.arange(B, device=dev)
        keys = torch.arange(S, device=dev)
        vis = keys[None] <= pos[:, None]  # [B, S]
        all_idx = torch.where(vis, keys[None], -1).to(torch.int32)
        pos_list = None
        h = self.embed(tokens[:, None])
        cos, sin = self.rotary(h, pos[:, None])
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k, v = self._qkv(attn, x, cos, sin)
            cache.k[i][ar, pos] = k[:, 0]
            cache.v[i][ar, pos] = v[:, 0]
            kc, vc = cache.k[i][:, :S], cache.v[i][:, :S]
            if self._sparse(i, mode):
                st = self.states[i]
                c = st.cfg
                if c.selector == "indexer":
                    q_i, w, k_i = attn.indexer(x, cos, sin)
                    cache.idx[i][ar, pos] = k_i[:, 0]
                    # with no more visible keys than top-k the selector keeps them all
                    sel = all_idx if S <= c.topk else self._select_indexer(q_i[:, 0], w[:, 0], cache.idx[i][:, :S],
                                                                           pos, keys, c)
                else:
                    pos_list = pos.tolist() if pos_list is None else pos_list
                    sel = self._select_block(q, kc, pos_list, c)
                o, _ = sparse_decode(q[:, 0], kc, vc, sel, scale=attn.scaling, backend=st.backend)
            elif self.dense_impl == "index":
                o, _ = sparse_decode(q[:, 0], kc, vc, all_idx, scale=attn.scaling)
            else:
                o = F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                                   attn_mask=vis[:, None, None, :], scale=attn.scaling,
                                                   enable_gqa=self.H != self.H_kv)[:, :, 0]
            h = h + attn.o_proj(o.reshape(B, 1, -1))
            h = self._mlp_out(layer, h)
        return self._logits(h[:, 0])

    def graphable(self, mode: str) -> bool:
        """Block selection is per row with host-side positions, so it runs eagerly."""
        if not self.use_graphs:
            return False
        return not (mode == "sparse" and any(s is not None and s.cfg.selector == "block" for s in self.states))

    def decode(self, cache: KVCache, tokens: torch.Tensor, pos: torch.Tensor, S: int, mode: str) -> torch.Tensor:
        """One decode step; replays a CUDA graph captured per (mode, S, cache) when possible."""
        if not self.graphable(mode):
            return self.decode_eager(cache, tokens, pos, S, mode)
        key = (mode, S, id(cache.k))
        st = self._static.get(id(cache.k))
        if st is None:
            st = self._static[id(cache.k)] = (torch.zeros_like(tokens), torch.zeros_like(pos))
        st[0].copy_(tokens)
        st[1].copy_(pos)
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(cache, st[0], st[1], S, mode)
            except Exception as e:  # keep generating, eagerly; the reason stays visible in graph_error
                self.use_graphs = False
                self.graph_error = f"{type(e).__name__}: {e}"
                torch.cuda.synchronize()
                return self.decode_eager(cache, tokens, pos, S, mode)
            self._graphs[key] = entry
        entry[0].replay()
        return entry[1]

    def _capture(self, cache, tok, pos, S, mode):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: compiles Triton kernels, settles allocations
            for _ in range(2):
                self.decode_eager(cache, tok, pos, S, mode)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.decode_eager(cache, tok, pos, S, mode)
        return graph, out

    def drop_graphs(self) -> None:
        self._graphs.clear()
        self._static.clear()
        self._pool = None

    def check_supported(self, max_seq_len: int) -> None:
        wins = [w for w in (getattr(layer.self_attn, "sliding_window", None) for layer in self.layers) if w]
        if wins and max_seq_len > min(wins):
            raise SparseRLError(f"max_seq_len {max_seq_len} exceeds the model's sliding window ({min(wins)}): the "
                                "rollout engine attends fully, so keep sequences within the window")
