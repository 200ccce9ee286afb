"""One device call: GPU checks of the changes made since the last run, then the decode step at batch 64.

    PYTHONPATH=. python benchmarks/gpu_rollout_step.py --out $OUT [--batches 64] [--contexts 16384,8192,2048]

1. Checks (exact-equality on integer-valued inputs, every score exact):
   - `ops.indexer_topk_decode` (Triton) against its reference (`gpu_decode_select.checks`);
   - the prefill radix top-k against `select_topk`, ties included (among equal scores the later key wins);
   then the decode select's time and candidate counts with positive and mixed-sign weights, and the
   sampler's PyTorch path against the fused Triton one.
2. `compile_step_bench`: the engine's decode step, eager vs compiled, dense vs sparse, Qwen2-0.5B shape,
   at the given batches and contexts (CUDA-graph replays, median of 20), with logits agreement.
Writes checks.json, select_timing.json, sampler_timing.json, compile_step.json/.md under --out, row by row (a time limit keeps what finished).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def radix_checks(dev) -> list[dict]:
    from sparse_rl.sparse.ops.indexer_topk.naive import select_topk
    from sparse_rl.sparse.ops.indexer_topk.radix_topk import radix_topk

    out = []
    g = torch.Generator(device=dev).manual_seed(0)
    for B, T, S, K in [(2, 5, 1111, 517), (1, 64, 40000, 2048), (3, 7, 70001, 2048)]:
        s = torch.randint(-3, 4, (B, T, S), device=dev, generator=g).float()
        s[0, 0, :7] = float("inf")
        s[0, 1, 100:] = float("-inf")  # fewer visible than K
        fin = s > float("-inf")
        got = radix_topk(s, K)
        ref = select_topk(s, fin, fin & (s == float("inf")), K)
        out.append({"check": "radix_topk_ties", "B": B, "T": T, "S": S, "K": K, "exact": bool(torch.equal(got, ref)),
                    "rows_differ": int((got != ref).any(-1).sum())})
        log(out[-1])
    return out


def select_timing(dev) -> list[dict]:
    """The decode select alone (CUDA-graph replays, median), with positive and with mixed-sign index-head
    weights (a converted model's case), and its second-level candidate counts."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk import decode as itd

    rows = []
    g = torch.Generator(device=dev).manual_seed(3)
    for B, S in [(64, 16384), (32, 32768), (64, 8192)]:
        q = torch.randn(B, 4, 64, device=dev, generator=g).to(torch.bfloat16)
        k = torch.randn(B, S, 64, device=dev, generator=g).to(torch.bfloat16)
        pos = torch.full((B,), S - 1, device=dev, dtype=torch.long)
        for wname, w in [("positive", torch.rand(B, 4, device=dev, generator=g)),
                         ("mixed", torch.randn(B, 4, device=dev, generator=g))]:
            w = w.to(torch.bfloat16)
            _, nc = itd.indexer_topk_decode(q, w, k, pos, 2048, sink=4, window=64, candidates=True)
            ms = bench_ms(lambda: itd.indexer_topk_decode(q, w, k, pos, 2048, sink=4, window=64), dev, graph=True)
            rows.append({"B": B, "S": S, "weights": wname, "select_ms": round(ms, 4),
                         "candidates_mean": round(float(nc.float().mean()), 1), "candidates_max": int(nc.max())})
            log(rows[-1])
    return rows


def sampler_timing(dev) -> list[dict]:
    """`Sampler.sample` at batch 64 / 128 over Qwen2's 151,936-token vocabulary: the PyTorch path against
    the fused Triton one (CUDA-graph replays would need device-side keys: plain CUDA-event timing of the
    call, host work included), and whether they draw the same tokens."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.rl.rollout.sampler import Sampler, SamplingParams

    rows = []
    V = 151936
    s = Sampler(V, dev)
    for R in (64, 128):
        x = torch.randn(R, V, device=dev) * 3
        for T in (1.0, 0.0):
            p = SamplingParams(temperature=T, seed=1)
            rids, steps = list(range(R)), [7] * R
            r = {"rows": R, "vocab": V, "temperature": T}
            for be in ("torch", "triton"):
                r[f"{be}_ms"] = round(bench_ms(lambda: s.sample(x, p, rids, steps, backend=be), dev), 4)
            a, b = s.sample(x, p, rids, steps, backend="torch"), s.sample(x, p, rids, steps, backend="triton")
            r["same_tokens"] = bool(torch.equal(a[0], b[0]))
            r["logprob_max_diff"] = float((a[1] - b[1]).abs().max())
            r["triton_error"] = s.triton_error
            rows.append(r)
            log(r)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="64")
    ap.add_argument("--contexts", default="16384,8192,2048")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--no-compile-bench", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if not a.skip_checks:
        from gpu_decode_select import checks

        res = radix_checks(dev) + checks(dev)
        json.dump(res, open(f"{a.out}/checks.json", "w"), indent=1)
        json.dump(select_timing(dev), open(f"{a.out}/select_timing.json", "w"), indent=1)
        json.dump(sampler_timing(dev), open(f"{a.out}/sampler_timing.json", "w"), indent=1)
    if a.no_compile_bench:
        return
    from sparse_rl.bench.rollout import compile_step_bench, markdown_compile

    def save(r):
        json.dump(r, open(f"{a.out}/compile_step.json", "w"), indent=1)
        open(f"{a.out}/compile_step.md", "w").write(markdown_compile(r))

    r = compile_step_bench(batches=tuple(int(b) for b in a.batches.split(",")),
                           contexts=tuple(int(c) for c in a.contexts.split(",")), reps=20, on_result=save, log=log)
    save(r)
    print(markdown_compile(r))


if __name__ == "__main__":
    main()
