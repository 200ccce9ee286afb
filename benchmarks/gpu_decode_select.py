"""One device call for the decode-time indexer select (`ops.indexer_topk_decode`, Triton):
correctness on the GPU first, then timing against the two paths it replaces, then `bench decode`.

    PYTHONPATH=. python benchmarks/gpu_decode_select.py --out $OUT

1. Checks: integer-valued bf16 inputs (every score exact) must give exactly the reference's keys, ties
   included; random bf16 inputs must give a set whose reference scores equal the reference set's
   (up to fp32 summation order: reported as the largest score gap at the threshold).
2. Timing (CUDA-graph replays, median): new kernel vs (a) the engine's former path (bmm, ReLU-weighted
   sum, masks, `torch.topk`) and (b) the prefill kernel with one query per row (scores + one-program-
   per-row radix select), batch 16/32/64 at 8K-128K keys, 4 index heads x 64, k = 2048.
3. `sparse-rl bench decode` at 32K and 128K (batch 32), the issue's table.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sparse_rl.bench.timing import bench_ms
from sparse_rl.sparse.ops import indexer_topk_decode
from sparse_rl.sparse.ops.indexer_topk import triton as it
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_scores_naive, indexer_topk_decode_naive


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def old_engine_select(q, w, kc, pos, K, sink, window):
    """The engine's selection before this kernel (forward.py `_select_indexer`, CUDA branch)."""
    S = kc.shape[1]
    keys = torch.arange(S, device=kc.device)
    scores = (torch.bmm(q, kc.transpose(1, 2)).float().relu() * w.float()[:, :, None]).sum(1)
    vis = keys[None] <= pos[:, None]
    forced = vis & ((keys[None] < sink) | (keys[None] > pos[:, None] - window))
    s = scores.masked_fill(forced, float("inf")).masked_fill(~vis, float("-inf"))
    vals, idx = torch.topk(s, min(K, S), dim=-1, sorted=False)
    return torch.where(vals == float("-inf"), -1, idx.to(torch.int32))


def checks(dev) -> list[dict]:
    out = []
    g = torch.Generator(device=dev).manual_seed(0)
    for B, S, K, sink, window, HI, DI in [(5, 1000, 64, 4, 16, 4, 64), (32, 33000, 2048, 4, 64, 4, 64),
                                          (3, 70000, 2048, 0, 0, 8, 128), (64, 9000, 2048, 4, 64, 4, 64)]:
        pos = torch.randint(0, S, (B,), device=dev, generator=g)
        pos[0] = S - 1
        pos[-1] = min(S - 1, 100)  # a row with fewer visible keys than K
        kvs = torch.randint(0, 50, (B,), device=dev, generator=g).minimum(pos)
        ri = lambda *s: torch.randint(-2, 3, s, device=dev, generator=g).to(torch.bfloat16)  # noqa: E731
        q, w, k = ri(B, HI, DI), ri(B, HI).abs(), ri(B, S, DI)
        got = indexer_topk_decode(q, w, k, pos, K, sink=sink, window=window, kv_start=kvs, backend="triton")
        ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=sink, window=window, kv_start=kvs)
        r = {"case": "integer", "B": B, "S": S, "K": K, "exact": bool(torch.equal(got, ref)),
             "rows_differ": int((got != ref).any(-1).sum())}
        rn = lambda *s: torch.randn(*s, device=dev, generator=g).to(torch.bfloat16)  # noqa: E731
        q, w, k = rn(B, HI, DI), rn(B, HI), rn(B, S, DI)
        got = indexer_topk_decode(q, w, k, pos, K, sink=sink, window=window, kv_start=kvs, backend="triton")
        ref = indexer_topk_decode_naive(q, w, k, pos, K, sink=sink, window=window, kv_start=kvs)
        sc = indexer_scores_naive(q[:, None].double(), w[:, None].double(), k.double(), q_offset=0)[:, 0]
        s = torch.arange(S, device=dev)[None]
        vis = (s <= pos[:, None]) & (s >= kvs[:, None])
        forced = vis & ((s < kvs[:, None] + sink) | (s > pos[:, None] - window))
        sc = torch.where(vis, sc, float("-inf")).masked_fill(forced, float("inf"))

        def vals(ix):
            v = torch.gather(sc, 1, ix.clamp(min=0).long())
            return torch.where(ix >= 0, v, torch.full_like(v, -1e30)).sort(-1).values

        gv, rv = vals(got), vals(ref)
        fin = torch.isfinite(gv) & torch.isfinite(rv)
        asc = got.clone()
        asc[asc < 0] = torch.iinfo(torch.int32).max
        r.update({"random_same_count": bool(torch.equal(got >= 0, ref >= 0)),
                  "random_max_score_gap": float((gv - rv)[fin].abs().max()) if fin.any() else 0.0,
                  "random_rows_identical": int((got == ref).all(-1).sum()), "rows": B,
                  "ascending": bool(torch.equal(asc, asc.sort(-1).values)),
                  "in_range": bool(((got >= -1) & (got <= pos[:, None])).all())})
        out.append(r)
        log(f"check {r}")
    return out


def timing(dev) -> list[dict]:
    rows = []
    g = torch.Generator(device=dev).manual_seed(1)
    HI, DI, K, sink, window = 4, 64, 2048, 4, 64
    for B, S in [(16, 8192), (16, 16384), (32, 16384), (64, 16384), (32, 32768), (64, 32768), (32, 131072)]:
        q = torch.randn(B, HI, DI, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.rand(B, HI, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, S, DI, device=dev, dtype=torch.bfloat16, generator=g)
        pos = torch.full((B,), S - 1, device=dev, dtype=torch.long)
        new = lambda: indexer_topk_decode(q, w, k, pos, K, sink=sink, window=window, backend="triton")  # noqa: E731
        old_e = lambda: old_engine_select(q, w, k, pos, K, sink, window)  # noqa: E731
        old_r = lambda: it.indexer_topk(q[:, None], w[:, None], k, K, q_offset=S - 1, sink=sink,  # noqa: E731
                                        window=window, topk_impl="radix")
        r = {"B": B, "S": S, "new_ms": bench_ms(new, dev, graph=True), "old_engine_ms": bench_ms(old_e, dev, graph=True),
             "old_radix_ms": bench_ms(old_r, dev, graph=True)}
        r["index_key_GB"] = B * S * DI * 2 / 1e9
        r["new_TBps_on_keys"] = r["index_key_GB"] / r["new_ms"]
        rows.append(r)
        log(f"time {r}")
        del q, w, k
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["checks"] = checks(dev)
    res["timing"] = timing(dev)
    with open(f"{a.out}/decode_select.json", "w") as f:
        json.dump(res, f, indent=1)
    lines = ["| batch | keys | new kernel ms | former engine path ms | prefill kernel, T=1 ms | speedup vs engine path |"
             " index-key TB/s |", "|---|---|---|---|---|---|---|"]
    for r in res["timing"]:
        lines.append(f"| {r['B']} | {r['S']} | {r['new_ms']:.4f} | {r['old_engine_ms']:.4f} | {r['old_radix_ms']:.4f} "
                     f"| {r['old_engine_ms'] / r['new_ms']:.1f}x | {r['new_TBps_on_keys']:.2f} |")
    open(f"{a.out}/decode_select.md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
