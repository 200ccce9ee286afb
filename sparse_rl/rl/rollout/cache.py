"""The preallocated KV cache of the rollout engine, addressed by slot.

k, v: `[layers, slots, S_max, H_kv, D]`; in sparse mode with the indexer selector also the index
keys `idx: [layers, slots, S_max, d_I]` (layers without an indexer keep an unused row so one
tensor serves all). A slot holds one sequence; position p of the sequence lives at row p.
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
                 dtype, device) -> "KVCache":
        shape = (layers, slots, s_max, kv_heads, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        v = torch.zeros(shape, dtype=dtype, device=device)
        idx = None if not index_dim else torch.zeros(layers, slots, s_max, index_dim, dtype=dtype, device=device)
        return cls(k, v, idx)

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
        for t in (self.k, self.v, self.idx):
            if t is not None:
                t[:, d, :length] = t[:, src:src + 1, :length]
        for t in (self.rep_q, self.rep_w):
            if t is not None:
                t[:, d] = t[:, src:src + 1]
