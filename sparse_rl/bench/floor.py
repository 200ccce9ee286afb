"""Model shapes for the rollout benchmarks, and the memory floor of a decode step.

A decode step at batch B is memory bound: every weight is read once (the input embedding only as
the tied LM head), and every live K/V row once. Its floor is the bytes it must read over the
device's copy bandwidth, measured in the same run (`copy_bandwidth`: bytes read + written by a large
device-to-device copy, per second). In sparse mode a sparse layer reads its index keys (all live
ones) and the top-k selected K/V rows instead of all live K/V; the dense layers (`dense_layers`)
read all of theirs. Writes (one K/V row per layer and sequence, the logits) are left out: at batch
32 they are under 1% of the bytes.

    SHAPES["qwen3-4b"]            # the paper's model shape
    step_bytes(shape, wbytes, B=32, ctx=16384, mode="sparse", topk=2048, index_dim=64)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape: what the floor and a random-weight model need."""

    arch: str  # "qwen2" (q/k/v biases) | "qwen3" (q_norm/k_norm, explicit head_dim)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool  # tied input embedding and LM head

    def kv_row_bytes(self, elsize: int = 2) -> int:
        """K and V of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * elsize


SHAPES = {
    "qwen3-4b": ModelShape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b": ModelShape("qwen3", 4096, 36, 32, 8, 128, 12288, 151936, False),
    "qwen2-0.5b": ModelShape("qwen2", 896, 24, 14, 2, 64, 4864, 151936, True),
    # CPU smoke tests of the benchmarks themselves
    "tiny": ModelShape("qwen2", 64, 3, 4, 2, 16, 128, 512, True),
    "tiny-qwen3": ModelShape("qwen3", 64, 3, 4, 2, 16, 128, 512, True),
}


def build_model(shape: ModelShape, max_positions: int, device, dtype, seed: int = 0):
    """A random-weight HF causal LM of `shape` (no download), eval mode, EOS disabled."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    conf_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if shape.arch == "qwen3" else (Qwen2Config, Qwen2ForCausalLM)
    conf = conf_cls(hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                    num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, intermediate_size=shape.intermediate,
                    vocab_size=shape.vocab, tie_word_embeddings=shape.tied,
                    max_position_embeddings=max(32768, max_positions), rope_theta=1e6, use_sliding_window=False,
                    eos_token_id=None, bos_token_id=None)
    conf._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(conf)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def weight_bytes(model, mode: str) -> int:
    """Bytes of the parameters one decode step reads: all of them, the input embedding only when it is
    the tied LM head (otherwise a step reads B of its rows), the indexers only in sparse mode."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    emb = base.get_input_embeddings().weight
    head = base.get_output_embeddings().weight
    total = 0
    for name, p in base.named_parameters():  # named_parameters lists a tied tensor once
        if p is emb and head is not emb:
            continue
        if ".indexer." in name and mode != "sparse":
            continue
        total += p.numel() * p.element_size()
    return total


def step_bytes(shape: ModelShape, wbytes: int, B: int, ctx: int, mode: str, topk: int = 2048, index_dim: int = 64,
               dense_layers=(0, 1), kv_elsize: int = 2, index_bytes_per_key: float | None = None) -> dict:
    """The bytes one decode step must read with B sequences of `ctx` live tokens: weights, K/V (every
    live row in dense layers, the min(ctx, topk) selected rows in sparse ones) and index keys.
    index_bytes_per_key: one stored index key (default index_dim bf16 values; fp8 keys with an fp32
    scale: index_dim + 4)."""
    kv_row = shape.kv_row_bytes(kv_elsize)
    ik = 2 * index_dim if index_bytes_per_key is None else index_bytes_per_key
    if mode == "dense":
        n_dense, n_sparse = shape.layers, 0
    else:
        n_dense = sum(1 for i in dense_layers if 0 <= i < shape.layers)
        n_sparse = shape.layers - n_dense
    kv = B * (n_dense * ctx + n_sparse * min(ctx, topk)) * kv_row
    index = B * n_sparse * ctx * ik
    return {"weights": wbytes, "kv": kv, "index": int(index), "total": int(wbytes + kv + index)}


def copy_bandwidth(device, gib: float = 2.0) -> float:
    """Bytes per second (read + written) of a device-to-device copy of `gib` GiB, median of do_bench:
    the ceiling a memory-bound step is held against. CPU: a smaller copy, wall clock."""
    import torch

    from sparse_rl.bench.timing import bench_ms

    n = int(gib * (1 << 30)) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device, rep_ms=200)
    del src, dst
    return 2 * n / (ms * 1e-3)


def integrate_steps(points: list[tuple[int, float]], c0: int, c1: int) -> float:
    """Sum of step times (the unit of `points`) for contexts c0+1 .. c1, piecewise linear through the
    measured (context, time) points, the end segments extended. points: at least one."""
    pts = sorted(points)
    if len(pts) == 1:
        return pts[0][1] * (c1 - c0)
    total = 0.0
    j = 0
    for c in range(c0 + 1, c1 + 1):
        while j < len(pts) - 2 and c > pts[j + 1][0]:
            j += 1
        (xa, ya), (xb, yb) = pts[j], pts[j + 1]
        total += ya + (yb - ya) * (c - xa) / (xb - xa)
    return total


def generation_floor_s(shape: ModelShape, wbytes: int, B: int, prompt: int, new: int, mode: str, bw: float,
                       **kw) -> float:
    """Seconds the memory floor allows for `new` decode steps of B sequences after a `prompt`-token
    prompt (contexts prompt+1 .. prompt+new)."""
    return sum(step_bytes(shape, wbytes, B, c, mode, **kw)["total"] for c in range(prompt + 1, prompt + new + 1)) / bw
