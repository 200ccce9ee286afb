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
