"""The preallocated KV cache of the rollout engine, addressed by slot.

k, v: `[layers, slots, S_max, H_kv, D]`; in sparse mode with the indexer selector also the index
keys `idx: [layers, slots, S_max, d_I]` (layers without an indexer keep an unused row so one
tensor serves all); with fp8 index keys (`SparseConfig.index_dtype`) idx is float8_e4m3fn and
`idx_scale: [layers, slots, S_max]` fp32 holds each key's scale (`ops.quantize_index_keys`). A slot holds one sequence; position p of the sequence lives at row p.
Allocated once and reused: a finished sequence's slot is simply overwritten by the next prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    k: torch.Tensor
    v: torch.Tensor
    idx: torch.Tensor | None
    # query groups (`SparseConfig.query_group` > 1): each slot's group representative's index query
    # `[layers, slots, H_I, d_I]` and weights `[layers, slots, H_I]` (`layer.update_group`)
    rep_q: torch.Tensor | None = None
    rep_w: torch.Tensor | None = None
    idx_scale: torch.Tensor | None = None

    def ensure_groups(self, heads: int, dim: int) -> None:
        """Allocate the query-group buffers (once)."""
        if self.rep_q is None:
            L, n = self.k.shape[:2]
            self.rep_q = self.k.new_zeros(L, n, heads, dim)
            self.rep_w = self.k.new_zeros(L, n, heads)

    def group(self, layer: int) -> tuple | None:
        """The layer's (q_rep, w_rep) buffers, None without query groups."""
        return None if self.rep_q is None else (self.rep_q[layer], self.rep_w[layer])

    @classmethod
    def allocate(cls, layers: int, slots: int, s_max: int, kv_heads: int, head_dim: int, index_dim: int | None,
                 dtype, device, index_dtype: str = "bf16") -> "KVCache":
        shape = (layers, slots, s_max, kv_heads, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        v = torch.zeros(shape, dtype=dtype, device=device)
        cache = cls(k, v, None)
        if index_dim:
            cache.add_index(index_dim, dtype, index_dtype)
        return cache

    def add_index(self, index_dim: int, dtype, index_dtype: str = "bf16") -> None:
        """Allocate the index-key cache (and its fp8 scales): keys in `dtype`, or e4m3 for index_dtype fp8."""
        L, n, s_max = self.k.shape[:3]
        fp8 = index_dtype == "fp8"
        self.idx = self.k.new_zeros(L, n, s_max, index_dim, dtype=torch.float8_e4m3fn if fp8 else dtype)
        self.idx_scale = self.k.new_zeros(L, n, s_max, dtype=torch.float32) if fp8 else None

    def index(self, layer: int) -> tuple:
        """The layer's index-key cache `[slots, S_max, d_I]`, and its scales `[slots, S_max]` for fp8 keys."""
        return (self.idx[layer],) if self.idx_scale is None else (self.idx[layer], self.idx_scale[layer])

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def s_max(self) -> int:
        return self.k.shape[2]

    def copy_prefix(self, src: int, dsts: list[int], length: int) -> None:
        """Copy the first `length` rows of slot `src` into slots `dsts` (n samples share a prefill)."""
        if not dsts:
            return
        d = torch.tensor(dsts, device=self.k.device)
        for t in (self.k, self.v, self.idx, self.idx_scale):
            if t is not None:
                t[:, d, :length] = t[:, src:src + 1, :length]
        for t in (self.rep_q, self.rep_w):
            if t is not None:
                t[:, d] = t[:, src:src + 1]
