"""Session 17, issue 15: where the prefill top-k's tie path spends its time (torch.profiler), on the H200.

Why: call 4 of gpu_tok11_session11.py measured cand with ties (keys split into spans) at 32K trained 5.68 ms
against 5.51 with the redo, though its three kernels over 252 rows should take well under 0.2 ms. This profiles
`indexer_topk_cand` at 32K and 128K on the trained indexer, ties off and on: every kernel's CUDA time per call,
and resolve_ties alone (synchronized wall time), so the next design starts from the measured term.

    PYTHONPATH=$PWD python benchmarks/gpu_ties_profile_session17.py --out $OUT/ties17
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from granular_harness import log, trained_indexer  # noqa: E402


def profile(fn, calls: int = 5) -> list[dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in p.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:  # kernels and the aten ops that launched them (both listed: the ops name the torch work)
            rows.append({"name": e.key[:90], "us_per_call": round(t / calls, 1), "count": e.count // calls})
    return sorted(rows, key=lambda r: -r["us_per_call"])[:25]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ties17"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from sparse_rl.bench import patterns
    from sparse_rl.sparse.ops.indexer_topk import cand_ties
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import CandConfig, indexer_topk_cand

    dev = torch.device("cuda")
    ix, kl, gen = trained_indexer(dev, 0, 4, 64, 150)
    res = {"kl": kl, "shapes": {}}
    real = cand_ties.resolve_ties
    spent = []

    def timed(*args, **kw):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = real(*args, **kw)
        torch.cuda.synchronize()
        spent.append(time.perf_counter() - t)
        return r

    for L in (32768, 131072):
        qi, wi, ki = patterns.trained_index(ix, L, dev, gen)
        out = {}
        for ties in (False, True):
            cfg = dataclasses.replace(CandConfig(), ties=ties)
            fn = lambda: indexer_topk_cand(qi, wi, ki, 2048, sink=4, window=64, config=cfg)  # noqa: E731
            rows = profile(fn)
            cand_ties.resolve_ties = timed  # indexer_topk_cand imports it from the module at each call
            spent.clear()
            info = {}
            indexer_topk_cand(qi, wi, ki, 2048, sink=4, window=64, config=cfg, info=info)
            cand_ties.resolve_ties = real
            out[f"ties={ties}"] = {"kernels": rows, "resolve_ties_ms": [round(s * 1e3, 3) for s in spent],
                                   "info": info}
            log(f"L {L} ties {ties}: resolve_ties {out[f'ties={ties}']['resolve_ties_ms']} ms, info {info}")
            for r in rows[:14]:
                log(f"   {r['us_per_call']:9.1f} us x{r['count']:3d}  {r['name']}")
        res["shapes"][L] = out
        with open(os.path.join(a.out, "ties17.json"), "w") as f:
            json.dump(res, f, indent=1)
        del qi, wi, ki


if __name__ == "__main__":
    main()
