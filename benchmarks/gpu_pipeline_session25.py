"""Session 25 (lead), issue 15: the token-level prefill with its query rows in chunks, each chunk's top-k on a side
stream while the previous chunk's attention runs, on one Hopper card, 32K, the bench's trained indexer (B 1,
32 / 8 heads, D 128, k 2048, sink 4, window 64, bf16), in one short call.

Why: main's CLI at 32K (session 25 call 4, H100) spends 3.55 ms in indexer + top-k and 7.26 in the attention, one
after the other; the top-k's kernels are integer-bound per-row selects with host syncs between them (0.4-1.5 ms of
host time at 32K, NOTES session 19), and the attention is latency-bound at ~54% issue. In chunks, chunk c+1's top-k
(and its host syncs) can proceed while chunk c's attention is queued on the other stream, so the host gaps are
hidden and the two kernels' programs may share SMs.

Variants (the Triton top-k in its "cand" form, which `auto` takes at 32K, for the whole row and every chunk, and
the public attention op; each query's row depends on its own scores only, so chunks give the same rows):
- whole: `sparse_attention(q, k, v, indexer_topk(...))` (the CLI's `trained_prefill_ms`);
- seq{n}: n query chunks, top-k then attention per chunk, one stream;
- pipe{n}: n chunks, top-k on a side stream (an event per chunk), attention on the main stream.

Predictions (before the call): seq4 +0-0.4 ms against whole (four plans / union builds); pipe2 -0.3 to -0.8,
pipe4 -0.5 to -1.0 (the host gaps hidden; little kernel overlap: the attention fills every SM).

    PYTHONPATH=$PWD python benchmarks/gpu_pipeline_session25.py --budget 150 --out $OUT/pipe25
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run, log, trained_indexer  # noqa: E402


def chunks(L: int, n: int) -> list:
    step = -(-L // n)
    return [(t0, min(L, t0 + step)) for t0 in range(0, L, step)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "pipe25"))
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (TRITON_INTERPRET=1)")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from sparse_rl.bench import patterns
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import sparse_attention
    from sparse_rl.sparse.ops.indexer_topk.triton import indexer_topk

    dev = torch.device("cpu" if a.smoke else "cuda")
    L, K, H, H_kv, D = (300, 48, 8, 2, 16) if a.smoke else (32768, 2048, 32, 8, 128)
    sink, window = 4, 8 if a.smoke else 64
    run = Run(a.out, "pipe25.json", a.budget, {"torch": torch.__version__, "seqlen": L})
    ix, _, gen = trained_indexer(dev, 0, 4, 16 if a.smoke else 64, 5 if a.smoke else 150)
    qi, wi, ki = patterns.trained_index(ix, L, dev, gen)
    g = torch.Generator(device=dev).manual_seed(7)
    dt = torch.float32 if a.smoke else torch.bfloat16
    q, k, v = (torch.randn(1, L, h, D, device=dev, generator=g).to(dt) for h in (H, H_kv, H_kv))
    side = torch.cuda.Stream() if dev.type == "cuda" else None

    def topk(t0, t1):
        # cand for every chunk, as `auto` takes for the whole 32K row (a chunk's shorter rows would take bin)
        return indexer_topk(qi[:, t0:t1], wi[:, t0:t1], ki[:, :t1], K, q_offset=t0, sink=sink, window=window,
                            topk_impl="cand" if dev.type == "cuda" else "auto")

    def whole():
        return sparse_attention(q, k, v, topk(0, L), backend="triton")[0]

    def seq(n):
        return torch.cat([sparse_attention(q[:, t0:t1], k, v, topk(t0, t1), backend="triton")[0]
                          for t0, t1 in chunks(L, n)], 1)

    def pipe(n):
        if side is None:
            return seq(n)
        main, outs = torch.cuda.current_stream(), []
        side.wait_stream(main)
        for t0, t1 in chunks(L, n):
            with torch.cuda.stream(side):
                r = topk(t0, t1)
                ev = torch.cuda.Event()
                ev.record(side)
            main.wait_event(ev)
            r.record_stream(main)  # the side stream's allocation, read on main
            outs.append(sparse_attention(q[:, t0:t1], k, v, r, backend="triton")[0])
        return torch.cat(outs, 1)

    variants = [("whole", whole), ("seq2", lambda: seq(2)), ("seq4", lambda: seq(4)), ("pipe2", lambda: pipe(2)),
                ("pipe4", lambda: pipe(4))]
    rows_whole = topk(0, L)
    rows_4 = torch.cat([topk(t0, t1) for t0, t1 in chunks(L, 4)], 1)
    ref = whole()
    proof = {"rows_equal_4": bool(torch.equal(rows_whole, rows_4)),
             "rows_differing_4": int((rows_whole != rows_4).any(-1).sum())}
    for name, fn in variants[1:]:
        o = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        proof[name] = float((o.float() - ref.float()).abs().max() / ref.float().abs().max())
    run.res["proof"] = proof
    log(f"proof: {proof}")
    run.save()
    qd, kd, vd = (t.transpose(1, 2) for t in (q, k, v))
    variants.append(("dense", lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)))
    W = dict(rep_ms=200) if not a.smoke else {}
    times = run.res.setdefault("times", [])
    for rep in range(a.reps):
        if not run.gate(20, f"rep {rep}"):
            break
        for name, fn in variants:
            ms = bench_ms(fn, dev, **W)
            times.append({"rep": rep, "variant": name, "ms": ms})
            log(f"rep {rep} {name}: {ms:.3f} ms")
        run.save()
    run.save()
    print(json.dumps({k: run.res.get(k) for k in ("proof", "times", "errors", "skipped")}))


if __name__ == "__main__":
    main()
