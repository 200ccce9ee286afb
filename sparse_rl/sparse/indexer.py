"""The DSA lightning indexer: a small per-layer scorer that picks which keys each query reads.

From the layer's input hidden state h (the same normalised input the attention sees):
    q_I = W_q h_t -> [H_I, d_I] (partial RoPE on the first rope_dim dims),
    k_I = LayerNorm(W_k h_s) -> [d_I] (one key per token, shared by the index heads),
    w   = W_w h_t -> [H_I],
    I(t, s) = sum_j w_j ReLU(q_I[j] . k_I[s]).
Scales (1/sqrt(d_I) on q, 1/sqrt(H_I) on w) are folded into the projections' outputs so the op
computes exactly the formula. H_I * d_I is far below H * d, so scoring all keys stays cheap.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_slice(cos: torch.Tensor, sin: torch.Tensor, rope_dim: int):
    """Cut HF's rotary tables `[B, T, head_dim]` (layout cat(f, f)) down to the first rope_dim/2
    frequencies, so the indexer rotates with the model's own positions (left padding included)."""
    half = rope_dim // 2
    c, s = cos[..., :half], sin[..., :half]
    return torch.cat([c, c], -1), torch.cat([s, s], -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Rotate the first rope_dim dims of x `[B, T, ..., d]` with cos/sin `[B, T, rope_dim]`."""
    if rope_dim == 0:
        return x
    xr, xp = x[..., :rope_dim], x[..., rope_dim:]
    while cos.dim() < xr.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = xr.chunk(2, -1)
    rot = torch.cat([-x2, x1], -1)
    return torch.cat([xr * cos + rot * sin, xp], -1)


class LightningIndexer(nn.Module):
    def __init__(self, hidden_size: int, index_heads: int, index_dim: int, rope_dim: int):
        super().__init__()
        self.index_heads, self.index_dim, self.rope_dim = index_heads, index_dim, rope_dim
        self.wq = nn.Linear(hidden_size, index_heads * index_dim, bias=False)
        self.wk = nn.Linear(hidden_size, index_dim, bias=False)
        self.k_norm = nn.LayerNorm(index_dim)
        self.ww = nn.Linear(hidden_size, index_heads, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.wq, self.wk, self.ww):
            nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)
        self.k_norm.reset_parameters()

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h `[B, T, hidden]`, cos/sin `[B, T, head_dim]` (HF rotary tables).

        Returns q_I `[B, T, H_I, d_I]`, w `[B, T, H_I]`, k_I `[B, T, d_I]`.
        """
        B, T, _ = h.shape
        c, s = rope_slice(cos, sin, self.rope_dim)
        q = self.wq(h).view(B, T, self.index_heads, self.index_dim) * self.index_dim ** -0.5
        q = apply_rope(q, c.to(q.dtype), s.to(q.dtype), self.rope_dim)
        k = apply_rope(self.k_norm(self.wk(h)), c.to(h.dtype), s.to(h.dtype), self.rope_dim)
        w = self.ww(h) * (1.0 / math.sqrt(self.index_heads))
        return q, w, k
