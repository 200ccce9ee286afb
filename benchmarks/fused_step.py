"""Prototype of the fused decode step, measured before it moves into `rl/rollout/forward.py` (which is
being refactored around `sparse/layer.py` at the time of writing, so it is not edited here).

`FusedRunner` is `ModelRunner` with `_decode_core`'s eager path rewritten around two fused ops:
- `ops.add_rmsnorm`: every residual add and the RMSNorm after it (input, post-attention and final
  norms) in one launch, the residual stream carried alongside;
- `ops.qk_norm_rope_cache`: Qwen3's q/k RMSNorm, RoPE and the K/V cache write in one launch.
The rotary tables are computed once per step. On a CPU the ops are their references, which compute
exactly what the HF modules compute, so the step's logits are unchanged there.
"""

from __future__ import annotations

import torch

from sparse_rl.rl.rollout.forward import ModelRunner
from sparse_rl.sparse.ops import add_rmsnorm, indexer_topk_decode, qk_norm_rope_cache


def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class FusedRunner(ModelRunner):
    def _decode_core(self, tokens, pos, keys, k_all, v_all, idx_all, mode, short, compiled):
        if compiled or self.dense_impl != "index":  # the prototype covers the eager CUDA path
            return super()._decode_core(tokens, pos, keys, k_all, v_all, idx_all, mode, short, compiled)
        B = tokens.shape[0]
        vis = keys[None] <= pos[:, None]
        all_idx = torch.where(vis, keys[None], -1).to(torch.int32)
        h = self.embed(tokens)  # [B, hidden]
        cos, sin = self.rotary(h[:, None], pos[:, None])  # [B, 1, D]
        c2, s2 = cos[:, 0], sin[:, 0]
        res, pending = None, h  # pending: the sublayer output not yet added to the residual stream
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x, res = add_rmsnorm(pending, res, layer.input_layernorm.weight, _eps(layer.input_layernorm))
            q = attn.q_proj(x).view(B, -1, self.D)
            k = attn.k_proj(x).view(B, -1, self.D)
            v = attn.v_proj(x).view(B, -1, self.D)
            qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            q = qk_norm_rope_cache(q, k, v, qn.weight if qn is not None else None,
                                   kn.weight if kn is not None else None, _eps(qn) if qn is not None else 1e-6,
                                   c2, s2, pos, k_all[i], v_all[i])
            if self._sparse(i, mode):
                st = self.states[i]
                c = st.cfg
                q_i, w = self._indexer_step(attn.indexer, x[:, None], cos, sin, pos, idx_all[i], st.backend)
                sel = all_idx if short else indexer_topk_decode(q_i, w, idx_all[i][:, :keys.shape[0]], pos, c.topk,
                                                                sink=c.sink, window=c.window, backend=st.backend)
                o = self._attend(q, k_all[i], v_all[i], sel, attn.scaling, st.backend, False)
            else:
                o = self._attend(q, k_all[i], v_all[i], all_idx, attn.scaling, "auto", False)
            x, res = add_rmsnorm(attn.o_proj(o.reshape(B, -1)), res, layer.post_attention_layernorm.weight,
                                 _eps(layer.post_attention_layernorm))
            pending = layer.mlp(x)
        y, _ = add_rmsnorm(pending, res, self.norm.weight, _eps(self.norm))
        return self.lm_head(y).float()


def use_fused(engine) -> None:
    """Swap an engine's runner for the fused prototype (same model, device and options)."""
    r = engine.runner
    engine.runner = FusedRunner(r.model, r.device, r.use_graphs, compile=False)
