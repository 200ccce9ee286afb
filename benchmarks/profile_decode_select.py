"""Per-kernel profile and launch-parameter variants of `indexer_topk_decode` (one device call).

    PYTHONPATH=. python benchmarks/profile_decode_select.py --out $OUT
"""

from __future__ import annotations

import argparse
import json

import torch

from sparse_rl.bench.timing import bench_ms
from sparse_rl.sparse.ops.indexer_topk import decode as itd


def inputs(B, S, dev, kind):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, 4, 64, device=dev, generator=g).to(torch.bfloat16)
    w = torch.rand(B, 4, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(B, S, 64, device=dev, generator=g).to(torch.bfloat16)
    if kind == "peaked":  # a trained indexer's shape: most keys score ~0, a few stand out
        w = w - 0.6
    return q, w, k, torch.full((B,), S - 1, device=dev, dtype=torch.long)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    res = {"profile": {}, "variants": []}
    for kind in ("random",):
        q, w, k, pos = inputs(32, 32768, dev, kind)
        f = lambda: itd.indexer_topk_decode(q, w, k, pos, 2048, sink=4, window=64)  # noqa: E731
        f()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                f()
            torch.cuda.synchronize()
        tab = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
        res["profile"][kind] = tab
        print(kind, "\n", tab, flush=True)
    for kind in ("random", "peaked"):
        for B, S in ((32, 32768), (64, 16384), (16, 16384)):
            q, w, k, pos = inputs(B, S, dev, kind)
            ref = itd.indexer_topk_decode(q, w, k, pos, 2048, sink=4, window=64)
            for ch in (None, 1024, 2048):
                for nw in (4, 8):
                    fn = lambda: itd.indexer_topk_decode(q, w, k, pos, 2048, sink=4, window=64,  # noqa: E731
                                                         chunk=ch, num_warps=nw)
                    same = bool(torch.equal(fn(), ref))
                    r = {"kind": kind, "B": B, "S": S, "chunk": ch, "warps": nw,
                         "ms": bench_ms(fn, dev, graph=True), "same": same}
                    res["variants"].append(r)
                    print(r, flush=True)
    json.dump(res, open(f"{a.out}/profile_decode_select.json", "w"), indent=1)


if __name__ == "__main__":
    main()
