"""Issue 15, session 12 (fwd12), follow-up run: the new `auto` (full statistics, one sync; 16-query tiles where
their estimate wins for a forward no backward follows; the AND bit test in the 128-row launch) against the
previous default (sampled statistics, 32-query tiles, (32, 4, 3) shift test), on the trained and block patterns,
with the end-to-end token-level prefill (trained indexer -> default top-k -> auto attention) vs dense cuDNN SDPA.
<= 60 s of device time.

Call 1 (193a700, results/2026-12-02-h200-fwd12-session12.md) measured, 32K trained: auto sample 11.55 ms, full
10.69 (same output), tile kernel 9.29 (AND 9.11, bit-equal), 16-query tiles at (32, 4, 3) 7.88 (0.848x; 128K
0.800x; block pattern 1.066x: slower there), union/pairs 0.071 (BT 32) / 0.111 (BT 16); prefill 17.7 -> 16.6 ms.

Phases (gated on the time LEFT of --budget; JSON + log after every row):
1. 32K trained: old / full-BT32 / new auto: path and tile size taken, times, new vs the float32 reference (last
   256 queries) and vs the old output; the 16-query kernel with and without the AND test;
2. 32K end to end: indexer + top-k + auto, old vs new, against dense cuDNN;
3. 32K block pattern: old vs new auto (the estimate must keep 32-query tiles here);
4. 128K trained: old vs new auto, the end-to-end prefill with both.

Predictions (written before the call): 32K trained new auto picks BT 16: ~7.9 + 1.3 (BT 16 build) + ~0.2 =
**~9.4 ms** (0.81x the old 11.55; 0.88x full BT32 10.69); the 16-query kernel with AND 0.97-1.0x without;
prefill 17.7 -> ~15.3 ms (0.97x dense 14.8); block: new auto takes BT 32, ~= full BT32 + AND (4.0 + 1.25 + 0.2,
~0.93x the old); 128K trained: new auto ~37.7 + 6.1 + 0.5 = ~44 ms (0.81x old 54.3), prefill 110 -> ~100 ms
(indexer + top-k ~57).

    PYTHONPATH=$PWD python benchmarks/gpu_fwd12_session12b.py --budget 60 --commit <sha>
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_fwd12_session12b.py --cpu-smoke --budget 600
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from granular_harness import Run, dense_times, log, trained_indexer  # noqa: E402
from gpu_fwd12_session12 import errors, parse_args, reference_rows  # noqa: E402

OLD = {"plan": "sample", "small_tiles": False, "fwd": (32, 4, 3)}  # the default before session 12
FULL32 = {"small_tiles": False}  # full statistics, 32-query tiles (with the AND test)


def auto_rows(run, name, q, k, v, idx, dev, W, n_check) -> dict:
    from sparse_rl.bench.timing import bench_ms, rel_err
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention_forward

    res = {"name": name, "ms": {}, "plan": {}}
    outs = {}
    for lab, tune in (("old", OLD), ("full32", FULL32), ("new", None)):
        o, lse, pl = sparse_attention_forward(q, k, v, idx, tune=tune)
        res["plan"][lab] = {"path": f"{pl.fwd}/{pl.bwd}/{pl.dq}", "bt": pl.bt,
                            "estimate_ms": {a: round(b, 3) for a, b in pl.estimate_ms.items()}}
        outs[lab] = (o, lse)
    ref = reference_rows(q, k, v, idx, n_check)
    res["proof"] = {lab: errors(*outs[lab], ref, outs["old"] if lab != "old" else None) for lab in outs}
    res["new_vs_old_rel_err"] = rel_err(outs["new"][0], outs["old"][0])
    del outs
    log(f"{name} plans {res['plan']} proof {res['proof']}")
    run.save()
    for lab, tune in (("old", OLD), ("full32", FULL32), ("new", None)):
        if not run.gate(3, f"{name} {lab}"):
            break
        res["ms"][lab] = bench_ms(lambda: sparse_attention_forward(q, k, v, idx, tune=tune), dev, **W)
        log(f"{name} auto {lab} {res['ms'][lab]:.3f} ms")
        run.save()
    if "new" in res["ms"]:
        res["new_over_old"] = res["ms"]["new"] / res["ms"]["old"]
    return res


def kernel16(run, q, k, v, idx, dev, W) -> dict:
    """The 16-query tile kernel at (32, 4, 3) with and without the AND bit test (same union)."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.sparse_attention import union
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

    sel = union.build_union(idx, k.shape[1], 16)
    sc, prec = 1 / math.sqrt(q.shape[-1]), dot_precision(q.dtype)
    o0 = union.tile_fwd(q, k, v, sel, sc, prec, tune=(32, 4, 3))
    o1 = union.tile_fwd(q, k, v, sel, sc, prec, tune=(32, 4, 3, 0, 0, 1))
    res = {"and_equal": bool(torch.equal(o0[0], o1[0]) and torch.equal(o0[1], o1[1])), "ms": {}}
    del o0, o1
    for lab, tune in (("bt16", (32, 4, 3)), ("bt16-and", (32, 4, 3, 0, 0, 1))):
        if run.gate(3, f"kernel16 {lab}"):
            res["ms"][lab] = bench_ms(lambda: union.tile_fwd(q, k, v, sel, sc, prec, tune=tune), dev, **W)
    log(f"kernel16 {res}")
    return res


def prefill(run, name, q, k, v, tidx, K, dev, W, dense_ms) -> dict:
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import indexer_topk
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention_forward

    kw = dict(sink=min(4, K // 4), window=min(64, K // 2))
    res = {"ms": {}, "dense_ms": dense_ms}
    for lab, tune in (("new", None), ("old", OLD)):
        if not run.gate(4, f"{name} prefill {lab}"):
            break
        res["ms"][lab] = bench_ms(lambda: sparse_attention_forward(q, k, v, indexer_topk(*tidx, K, **kw), tune=tune),
                                  dev, **W)
        if dense_ms:
            res[f"speedup_{lab}"] = dense_ms / res["ms"][lab]
        log(f"{name} prefill {lab} {res['ms'][lab]:.3f} ms")
        run.save()
    return res


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    dev = torch.device("cpu" if a.cpu_smoke else "cuda")
    import triton

    from sparse_rl.bench import patterns
    from sparse_rl.bench.attention import block_pattern, block_pattern_indices
    from sparse_rl.bench.timing import device_name
    from sparse_rl.sparse.ops import indexer_topk

    if dev.type == "cuda":
        torch.zeros(1, device=dev)
    run = Run(a.out, "fwd12b.json", a.budget, {"device": device_name(dev), "torch": torch.__version__,
                                               "triton": triton.__version__, "commit": a.commit, "args": vars(a)})
    res = run.res
    log("trained indexer")
    ix, kl, gen = trained_indexer(dev, 0, a.index[0], a.index[1], a.train_steps)
    res["trained_indexer_kl"] = kl
    W = dict(warmup_ms=5, rep_ms=a.rep_ms)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for L, tag in ((a.L32, "32K"), (a.L128, "128K")):
        if tag == "128K" and not run.gate(18, "128K"):
            break
        rnd = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=gen)  # noqa: E731
        q, k, v = rnd(1, L, a.H, a.D), rnd(1, L, a.Hkv, a.D), rnd(1, L, a.Hkv, a.D)
        tidx = patterns.trained_index(ix, L, dev, gen)
        idx = indexer_topk(*tidx, a.K, sink=min(4, a.K // 4), window=min(64, a.K // 2))
        n = min(a.check_n, L)
        res[f"{tag}_auto"] = run.guarded(f"{tag} auto", auto_rows, run, f"{tag} trained", q, k, v, idx, dev, W, n)
        run.save()
        if tag == "32K" and run.gate(10, "kernel16"):
            res["32K_kernel16"] = run.guarded("kernel16", kernel16, run, q, k, v, idx, dev, W)
            run.save()
        del idx
        dense = None
        if tag == "32K" and run.gate(8, "dense"):
            dense = (run.guarded("dense", dense_times, q, k, v, dev, W, False) or {}).get("dense_ms")
        if run.gate(8, f"{tag} prefill"):
            res[f"{tag}_prefill"] = run.guarded(f"{tag} prefill", prefill, run, tag, q, k, v, tidx, a.K, dev, W, dense)
            run.save()
        if tag == "32K" and run.gate(8, "32K block"):
            blk = 128 if dev.type == "cuda" else 16
            fb, cnt = block_pattern(L, blk, max(1, a.K // blk), dev, gen)
            bidx = block_pattern_indices(fb, cnt, L, blk, a.K)
            res["32K_block"] = run.guarded("32K block", auto_rows, run, "32K block", q, k, v, bidx, dev, W, n)
            del bidx
            run.save()
        del q, k, v, tidx
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    run.save()
    print("== fwd12b summary ==")
    for key in ("32K_auto", "32K_kernel16", "32K_prefill", "32K_block", "128K_auto", "128K_prefill"):
        r = res.get(key)
        if r:
            print(key, {x: y for x, y in r.items() if x in ("ms", "new_over_old", "and_equal", "speedup_new",
                                                             "speedup_old", "dense_ms", "new_vs_old_rel_err")},
                  {lab: (p["path"], p["bt"]) for lab, p in r.get("plan", {}).items()})
    print("skipped:", res.get("skipped"), "errors:", res.get("errors"))


if __name__ == "__main__":
    main()
