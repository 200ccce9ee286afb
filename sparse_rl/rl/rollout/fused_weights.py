"""Concatenated projection weights for the eager decode step: one GEMM where the modules run several.

Per layer, `qkv`: the attention's q/k/v projections and, after them, the lightning indexer's wq/wk/ww
(they read the same normalised input; dense mode multiplies by the leading q/k/v rows only), and
`gate_up`: the MLP's gate and up projections (SiLU(gate) * up is then one `ops.silu_mul` launch).

Why: at batch 32 on an H200, cuBLAS runs each skinny projection of Qwen3-4B's shape as its own GEMM
(k and v 6 us each for 5 MB, the indexer's three 3-5 us each), ~3.0 ms a step for 8 GB of weights
against a 1.9 ms floor (benchmarks/results/2026-12-01-h200-rollout-qwen3-4b.md).

No copy of the weights: each module's parameter becomes a view of its group's buffer (`param.data =
view`, the Parameter objects themselves unchanged), so optimizer steps, `load_state_dict` and LoRA
merges, which write in place, are read by the next fused GEMM, and the CUDA graphs keep their
addresses. What replaces a parameter's storage instead (`model.to(...)`, `param.data = ...`, a
sharding wrapper), or a member module replaced (a peft wrap after the engine was built), is found by
`FusedLayer.valid` (identity and pointer checks, run before each generation) and the group is built
again. Only plain `nn.Linear` modules with ordinary tensors join a group; a
peft LoRA layer (whose adapter must run live) keeps its own GEMM, and so does its whole group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def _plain(mods) -> bool:
    """Every module a plain nn.Linear on ordinary tensors with one input size, dtype and device."""
    if not mods or any(type(m) is not nn.Linear for m in mods):
        return False
    w0 = mods[0].weight
    return all(type(m.weight.data) is torch.Tensor and m.in_features == mods[0].in_features
               and m.weight.dtype == w0.dtype and m.weight.device == w0.device
               and (m.bias is None or m.bias.dtype == w0.dtype) for m in mods)


@dataclass
class FusedLinear:
    """One concatenated projection: weight `[sum(out), in]`, bias `[sum(out)]` or None (zeros for the
    members without one), sizes = each member's out_features, in order."""

    mods: list
    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: list[int]
    slots: list  # (owner module, attribute name) of each member, to see it replaced (a peft wrap)

    @classmethod
    def build(cls, slots, pad_to: int = 1) -> "FusedLinear | None":
        """Concatenate the members (`slots`: (owner, attribute name) pairs) and make their parameters views
        of the result; None when they cannot share one GEMM (`_plain`). pad_to: zero rows after the
        members up to a multiple of this many output columns (the GEMM's output rows then start 16-byte
        aligned; the members' outputs are unchanged, the padding's columns are cut off)."""
        mods = [getattr(o, n) for o, n in slots]
        if not _plain(mods):
            return None
        n_out = sum(m.out_features for m in mods)
        pad = -n_out % max(1, pad_to)
        # never inference tensors (a generation may rebuild a group under inference_mode): the buffers
        # become the parameters' storage, which training differentiates through
        with torch.inference_mode(False), torch.no_grad():
            w0 = mods[0].weight
            weight = torch.cat([m.weight.detach() for m in mods] + [w0.new_zeros(pad, w0.shape[1])] * bool(pad))
            bias = None
            if any(m.bias is not None for m in mods):
                bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
                                  for m in mods] + [weight.new_zeros(pad)] * bool(pad))
        sizes = [m.out_features for m in mods]
        off = 0
        for m, n in zip(mods, sizes):
            m.weight.data = weight[off:off + n]
            if m.bias is not None:
                m.bias.data = bias[off:off + n]
            off += n
        return cls(mods, weight, bias, sizes, list(slots))

    def valid(self) -> bool:
        """Whether every member is still in place (not wrapped or swapped since) and its parameters still
        live in this group's buffers."""
        if any(getattr(o, n, None) is not m for (o, n), m in zip(self.slots, self.mods)):
            return False
        off = 0
        for m, n in zip(self.mods, self.sizes):
            w = m.weight
            if (w.data_ptr() != self.weight[off].data_ptr() or w.shape != (n, self.weight.shape[1])
                    or w.dtype != self.weight.dtype):
                return False
            if m.bias is not None and (self.bias is None or m.bias.data_ptr() != self.bias[off].data_ptr()):
                return False
            off += n
        return True

    def __call__(self, x: torch.Tensor, rows: int | None = None, weight_left: bool = False,
                 skinny: torch.Tensor | None = None, skinny_kw: dict | None = None,
                 norm: tuple | None = None) -> torch.Tensor:
        """x `[B, in]` -> `[B, rows or sum(out)]`: the members' outputs side by side (the first `rows`).
        weight_left: the same product as W @ xᵀ, then one transpose copy back to `[B, out]` (cuBLAS
        picks another kernel for it: on an H200 at M = 32 the q/k/v + indexer GEMM of Qwen3-4B's shape,
        N = 6468, took 8.4 us this way against 17.5 through F.linear; equal for the other shapes;
        benchmarks/results/2026-12-01-h200-rollout-session7.md). skinny: tile counters of this GEMM for
        `ops.skinny_linear` (split-K in one launch; skinny_kw its keywords: impl, the PDL level and tiles "swapab"
        takes), used when there is no bias and x has no more rows than that kernel takes (`ops.SKINNY_ROWS`). norm:
        x is a residual h and the swap-AB GEMM reads RMSNorm(h) (`ops.skinny_linear(norm=)`; only on that path)."""
        w, b = self.weight, self.bias
        n = sum(self.sizes)
        if rows is not None:
            w, b, n = w[:rows], None if b is None else b[:rows], rows
        from sparse_rl.sparse.ops import SKINNY_ROWS

        skinny_kw = skinny_kw or {}
        if skinny is not None and b is None and x.shape[0] <= SKINNY_ROWS[skinny_kw.get("impl", "splitk")]:
            from sparse_rl.sparse.ops import skinny_linear

            y = skinny_linear(x, w, skinny, norm=norm, **skinny_kw)
        elif norm is not None:
            raise ValueError("FusedLinear: norm= needs the swap-AB skinny path (no bias, few rows)")
        elif not weight_left:
            y = torch.nn.functional.linear(x, w, b)
        else:
            y = torch.mm(w, x.t()) if b is None else torch.addmm(b[:, None], w, x.t())
            y = y.t().contiguous()
        return y if y.shape[-1] == n else y[..., :n]  # the padding's columns (pad_to) cut off


@dataclass
class FusedLayer:
    """A decoder layer's fused projections (either may be None: the modules run instead). qkv_rows: the
    q/k/v part of `qkv` (the indexer's rows, when present, follow)."""

    qkv: FusedLinear | None
    gate_up: FusedLinear | None
    qkv_rows: int
    silu: bool

    @classmethod
    def build(cls, layer, qkv_pad: int = 1) -> "FusedLayer":
        """qkv_pad: `FusedLinear.build`'s pad_to for the q/k/v (+ indexer) group."""
        attn, mlp = layer.self_attn, layer.mlp
        ix = getattr(attn, "indexer", None)
        attn_slots = [(attn, n) for n in ("q_proj", "k_proj", "v_proj")]
        qkv = None
        if ix is not None and all(isinstance(getattr(ix, n, None), nn.Module) for n in ("wq", "wk", "ww")):
            qkv = FusedLinear.build(attn_slots + [(ix, n) for n in ("wq", "wk", "ww")], pad_to=qkv_pad)
        if qkv is None:
            qkv = FusedLinear.build(attn_slots, pad_to=qkv_pad)
        gate_up = None
        if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            gate_up = FusedLinear.build([(mlp, "gate_proj"), (mlp, "up_proj")])
        # torch's nn.SiLU, or transformers' SiLUActivation (5.x): both F.silu
        silu = type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
        return cls(qkv, gate_up, sum(getattr(attn, n).out_features for _, n in attn_slots), silu)

    def valid(self) -> bool:
        return all(g is None or g.valid() for g in (self.qkv, self.gate_up))
