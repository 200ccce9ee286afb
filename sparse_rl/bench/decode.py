"""`sparse-rl bench decode`: one sparse decode step (indexer scores of the new token against the
cached index keys + top-k + sparse attention over the selected cache rows) against one dense decode
step (SDPA, the fastest of the flash/cuDNN variants, K/V in its preferred `[B, H_kv, S, D]` layout),
batch 32 by default. Both sides are timed as CUDA-graph replays (a decode loop is graph-captured in
practice; eager launches of these ~0.1 ms kernels measure Python overhead); the eager sparse step is
reported too.

Bytes per step (the floor, both memory bound): dense reads B*S*H_kv*D*4 bytes of K/V; sparse reads
B*k*H_kv*D*4 bytes of selected K/V plus B*S*D_I*2 bytes of index keys (and writes/reads a
`[B, S]` fp32 score row for the top-k).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from sparse_rl.bench.attention import bench_setup, best_dense
from sparse_rl.bench.timing import bench_ms, device_name, fmt, rel_err, table_title


@dataclass
class BenchDecodeConfig:
    contexts: list[int] = field(default_factory=lambda: [32768, 131072])
    batch: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    topk: int = 2048
    index_heads: int = 4
    index_dim: int = 64
    splits: list[int] = field(default_factory=list)  # also time these split-K counts (heuristic always)
    check: bool = True
    dtype: str = "bfloat16"
    warmup_ms: int = 25
    rep_ms: int = 100
    seed: int = 0
    device: str = "auto"


def run_decode_bench(cfg: BenchDecodeConfig, log=print) -> dict:
    import torch

    from sparse_rl.sparse.ops import indexer_topk, sparse_decode
    from sparse_rl.sparse.ops.sparse_attention import triton as sa
    from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive

    dev, dtype = bench_setup(cfg)
    B, H, Hkv, D, K = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.topk
    HI, DI = cfg.index_heads, cfg.index_dim
    W = dict(warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms, graph=True)
    gen = torch.Generator(device=dev).manual_seed(cfg.seed)
    rows, checks = [], []
    for S in cfg.contexts:
        log(f"S={S}: inputs")
        rnd = lambda *s: torch.randn(*s, device=dev, dtype=dtype, generator=gen)  # noqa: E731
        q = rnd(B, H, D)
        kc, vc = rnd(B, S, Hkv, D), rnd(B, S, Hkv, D)
        qi, ki = rnd(B, 1, HI, DI), rnd(B, S, DI)
        wi = torch.rand(B, 1, HI, device=dev, dtype=dtype, generator=gen)
        row: dict = {"context": S, "batch": B}
        # dense: flash decode over the whole cache in SDPA's layout
        qd = q[:, :, None]  # [B, H, 1, D]
        kd, vd = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        label, _, _, _, dense_all = best_dense(qd, kd, vd, lambda f: bench_ms(f, dev, **W), causal=False)
        row["dense_label"] = label
        row["dense_all_ms"] = dense_all
        row["dense_ms"] = dense_all[label]
        kv_bytes = B * S * Hkv * D * 2 * kc.element_size()
        row["dense_TBps"] = kv_bytes / row["dense_ms"] / 1e9
        del kd, vd
        # sparse: indexer step, attention alone, both
        step_idx = lambda: indexer_topk(qi, wi, ki, K, q_offset=S - 1, backend="triton")[:, 0]  # noqa: E731
        idx = step_idx()
        row["indexer_ms"] = bench_ms(step_idx, dev, **W)
        row["sparse_attn_ms"] = bench_ms(lambda: sparse_decode(q, kc, vc, idx, backend="triton"), dev, **W)
        sel_bytes = int((idx >= 0).sum()) * Hkv * D * 2 * kc.element_size()
        row["sparse_attn_TBps"] = sel_bytes / row["sparse_attn_ms"] / 1e9
        row["splits"] = sa.decode_splits(B, Hkv, K, dev)
        for ns in cfg.splits:
            row[f"sparse_attn_ms_split{ns}"] = bench_ms(lambda: sa.sparse_decode(q, kc, vc, idx, nsplit=ns), dev, **W)
        step = lambda: sparse_decode(q, kc, vc, step_idx(), backend="triton")  # noqa: E731
        row["sparse_step_ms"] = bench_ms(step, dev, **W)
        row["sparse_step_eager_ms"] = bench_ms(step, dev, **{**W, "graph": False})
        row["step_speedup"] = row["dense_ms"] / row["sparse_step_ms"]
        row["attn_speedup"] = row["dense_ms"] / row["sparse_attn_ms"]
        if cfg.check:
            out, lse = sparse_decode(q, kc, vc, idx, backend="triton")
            ro, rl = sparse_attention_naive(q[:, None].float(), kc.float(), vc.float(), idx[:, None],
                                            1.0 / math.sqrt(D))
            checks.append({"context": S, "out_rel_err": rel_err(out, ro[:, 0]),
                           "lse_max_abs_err": float((lse - rl[:, 0]).abs().max()),
                           "nan_free": bool(torch.isfinite(out).all() and torch.isfinite(lse).all()),
                           "indices_ok": bool(((idx >= 0) & (idx < S)).all())})
        rows.append(row)
        log(f"S={S}: " + ", ".join(f"{a}={b:.3g}" for a, b in row.items() if isinstance(b, float)))
        del q, kc, vc, qi, ki, wi, idx
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"bench": "decode", "config": dataclasses.asdict(cfg), "device": device_name(dev), "rows": rows,
            "checks": checks}


def markdown_decode(res: dict) -> str:
    lines = [table_title("Sparse decode step vs dense", res), "",
             "| context | dense ms | dense TB/s | indexer+top-k ms | sparse attn ms | attn TB/s (selected rows) "
             "| sparse step ms | step speedup | attn-only speedup | sparse step ms (eager) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        g = r.get
        lines.append("| " + " | ".join(fmt(x) for x in (
            r["context"], g("dense_ms"), g("dense_TBps"), g("indexer_ms"), g("sparse_attn_ms"),
            g("sparse_attn_TBps"), g("sparse_step_ms"), g("step_speedup"), g("attn_speedup"),
            g("sparse_step_eager_ms"))) + " |")
    lines += ["", "Dense = the fastest SDPA variant: " + "; ".join(
        f"S={r['context']}: " + ", ".join(f"{a} {fmt(b, 3)} ms" for a, b in r.get("dense_all_ms", {}).items())
        for r in res["rows"])]
    extra = [(r["context"], a, b) for r in res["rows"] for a, b in r.items() if a.startswith("sparse_attn_ms_split")]
    if extra:
        lines += ["", "Split-K sweep (sparse attention only): " + ", ".join(
            f"S={c} {a.removeprefix('sparse_attn_ms_')}={fmt(b, 4)} ms" for c, a, b in extra)]
    if res.get("checks"):
        lines += ["", "Checks (float32 reference):", ""]
        for c in res["checks"]:
            lines.append("- " + ", ".join(f"{a}={fmt(b, 4) if isinstance(b, float) else b}" for a, b in c.items()))
    return "\n".join(lines) + "\n"
