"""Session 19 (issue 15): the prefill top-k's gather with its query tiles loaded once, on the H200.

Reading before the call (sm_90a TTGIR / ptxas of Triton 3.6 on the CPU host): Triton's loop-invariant code motion
hoists loads only out of loops that do not store. The row-max sweep (`stream.indexer_row_max`, the score dots alone
that `bench attention` divides by) has no store in its loop, so its HI = 4 query tiles sit in shared memory once;
the words gather (`cand_topk._gather_words_kernel`) appends to the row buffers inside its loops, so every key tile
re-copied all four [64, 64] bf16 query tiles to shared memory (async copies, 32 KB) beside the 8 KB key tile it
needs: 5x the row-max sweep's bytes a tile, 82 KB of shared memory, 254 registers. Loaded once before the loops
(`stream.load_queries` + `score_tile_q`, `CandConfig.hoist_queries`): 50 KB, 220 registers, no spill; same
arithmetic, so the buffers must be bitwise equal. The sample kernel and the tie path's store pass load them once
too (not switchable).

Predictions: gather alone 32K trained 1.36 -> ~0.9-1.0 ms, 128K trained ~27 -> ~15-20 ms (the row-max sweep 0.77 /
10.9 is the floor of this form); whole top-k 32K trained 4.3 -> ~3.8-4.0, 128K trained 43 -> ~32-37; prefill 128K
3.1x -> ~3.6-4.0x, 32K ~1.06 -> ~1.1x. BN 32 (165 registers, 3 programs an SM) and the 8-warp forms: within +-10%.

Call 1 outcome (1fed187): every form's buffers equal. Gather alone, loaded -> hoisted: 32K trained 1.387 -> 1.169
ms, 128K trained 19.68 -> 15.40, 32K random 1.566 -> 1.293, 128K random 20.66 -> 16.35 (row-max sweep 0.77 / 11.0);
r168 15.26 / 15.63 at 128K (within 1-4%), BN 32 and 8 warps slower. Whole: 32K trained 3.955 -> 3.779, 128K trained
41.72 -> 36.63, 128K random 39.12 -> 33.60. Prefill 128K 3.12x -> 3.35x; 32K 1.04-1.14x both (noise). The profile at
128K trained: the gather in its 4 chunks 21.05 ms against 15.40 in one launch: the 2 GB budget made chunks of
43,648 x 3 + 128 rows, the last 2 programs walking 131K keys each.

Call 2 (even chunks, `cand_topk.even_chunk`; the flagged rows by one nonzero, no unique / mask syncs at B = 1):
whole at 128K with the buffer budget giving 4 (default 2 GB), 3, 2 and 1 chunks. Predictions: 128K trained default
36.6 -> ~32-34 ms (gather 21 -> ~16-17), 2 chunks ~31-33, 1 chunk ~30-32; 128K random alike (-3 to -5 ms); 32K
(one chunk) 3.78 -> ~3.6-3.8.

Call 2 outcome (843b725; rows equal at every budget): 128K trained whole 32.93 ms at 4 even chunks (gather x4 15.79
against 21.05 in call 1), 3 chunks 33.44, 2 chunks 30.73, 1 chunk 29.00; 128K random 28.59 / 29.08 / 27.10 / 25.23;
32K trained 3.59 (call 1: 3.78). Prefill 128K 3.54-3.66x at 4 chunks, 3.77-3.83x at 1 chunk (dense 266.9 ms).
So the buffers' budget is now a quarter of the free memory, 1-8 GB (`cand_topk.buffer_budget`: 128K in one chunk on
an idle H200).

Call 3: `skip_empty` (a whole tile without a candidate skips the append: one tile-wide reduction) against the
default, gather alone and whole, prefill in three interleaved reps; then the CLI's `bench attention`. Predictions:
gather alone 128K trained 15.4 -> ~12-13.5 ms (the row-max sweep 11.0 the floor: the trained indexer's candidates
cluster), 32K trained 1.17 -> ~0.95-1.05; random rows (no empty tiles at 2-10% density) +0-3%; whole 128K trained
~29 -> ~26-27.5; prefill 128K ~3.8x -> ~3.9-4.0x.

Call 3 outcome (aca50ad; rows and buffers equal): skip_empty, gather alone: 128K trained 15.37 -> 13.50 ms, with
a 168-register cap 12.36; 32K trained 1.17 -> 1.21 / 1.25; random 32K 1.28 -> 1.33, 128K 16.28 -> 17.39 / 16.87.
Whole 128K trained 29.43 -> 28.39 -> 27.38 (cap), 128K random 27.52 -> 28.54. Prefill 128K 3.62-3.63x -> 3.72-3.76x
(skip). So rows of >= 64K keys take skip + cap (`CandConfig.long_keys`), shorter ones neither. The CLI at aca50ad:
32K 1.10x (13.45 ms: top-k 4.16, attention 8.96), 128K 3.62x (70.8: top-k 29.1, attention 42.3).

Call 4: the whole at 128K with a smaller sample (sample_lanes 2048: the quantile's k-th search over half the lanes,
a noisier threshold), and at E 1.7 beside it; then the CLI's `bench attention` at the final commit. Predictions:
128K trained default ~27.4; lanes 2048 ~26-27 (quantile 2.8 -> ~1.5 ms, more rows flagged); 32K unchanged (its
sample is 2,048 keys already).

Call 4 outcome: see results/2026-12-04-h200-session19.md (128K trained 26.54 ms; lanes 2048 25.77 trained but 31.98
random, not adopted). Call 5 (after the bitmap without redundant atomics, gpu_cap_session19.py call 4): prefill at the
final commit, the default alone, three reps (the device time left did not allow the CLI's run).

Call 5 outcome (5e8cb5c): prefill 32K 1.18-1.21x (12.04-12.36 ms: top-k
4.40-4.60, attention 7.50-7.55), 128K 4.23-4.25x (60.7-60.9 ms).

Call 6 (written for the next session, not run: no device time left): `redo_ahead` 512 (cand_redo.py: the flagged
rows' decode redo launched before their count is read) against the default, whole and prefill at 32K (at 128K the
rule leaves it off: 512 x 131,072 row-keys reach the tie path's threshold). Predictions: 32K trained whole ~4.1-4.6
-> ~3.6-4.0 ms (the host time between the select and the redo hidden), 32K random unchanged +-0.1 (no flagged rows;
512 padded one-key rows cost ~0.05-0.1 ms), prefill 32K +2-5%.

    PYTHONPATH=$PWD python benchmarks/gpu_hoist_session19.py --out $OUT/hoist19 --budget 300 [--call 1|2|3|4|5|6]
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
from granular_harness import kernel_profile, log, trained_indexer  # noqa: E402
import gpu_select_session18 as s18  # noqa: E402

LOADED = dict(hoist_queries=False)  # the query tiles loaded at every key tile (the default until this session)
GATHER = {"loaded": LOADED, "hoist": {}, "n32": dict(block_n=32), "n128-w8": dict(block_n=128, warps=8),
          "w8": dict(warps=8), "r168": dict(gather_maxnreg=168), "loaded-n128-w8": dict(LOADED, block_n=128, warps=8)}


GATHER3 = {"hoist": {}, "skip": dict(skip_empty=True), "skip-r168": dict(skip_empty=True, gather_maxnreg=168)}
SKIP = dict(skip_empty=True)
SAMPLE4 = {"default": {}, "lanes2048": dict(sample_lanes=2048), "lanes2048-E1.7": dict(sample_lanes=2048, target=1.7),
           "long-off": dict(long_keys=1 << 30)}


def gather_alone(a, name, qi, wi, ki, dev, W, GATHER=GATHER) -> dict:
    """Each gather form on the default threshold's rows: ms, and buffers equal to the loaded form's."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk import cand_topk as ct
    from sparse_rl.sparse.ops.indexer_topk.stream import indexer_row_max

    K = a.k
    th, smp, val, nrow, kvs, C = s18.buffers(qi, wi, ki, K, a.sink, a.window, dev)
    del smp
    T = qi.shape[1]
    res = {"rowmax_ms": bench_ms(lambda: indexer_row_max(qi, wi, ki), dev, **W), "gather": {}}
    ref_v, ref_n = None, None
    for lab, over in GATHER.items():
        cfg = dataclasses.replace(ct.CandConfig(), **over)
        v2, n2 = torch.zeros_like(val), torch.empty_like(nrow)
        fn = lambda: ct.cand_gather(qi, wi, ki, kvs, 0, T, 0, a.sink, a.window, K, th, v2, v2, n2, cfg)  # noqa: E731
        try:
            fn()
            torch.cuda.synchronize()
            live = torch.arange(C, device=dev)[None, None, :] < n2.clamp(min=0)[..., None]
            vv = torch.where(live, v2, 0)
            if ref_v is None:
                ref_v, ref_n = vv, n2.clone()
            eq = bool(torch.equal(n2, ref_n) and torch.equal(vv, ref_v))
            res["gather"][lab] = {"ms": bench_ms(fn, dev, **W), "equal": eq}
        except Exception as e:  # noqa: BLE001 (a form that does not compile is a result)
            res["gather"][lab] = {"error": repr(e)[:300]}
        log(f"{name} gather {lab}: {res['gather'][lab]}")
        del v2
    del val, ref_v
    torch.cuda.empty_cache()
    return res


BUDGETS = {"default": None, "3 chunks": 2_200_000_000, "2 chunks": 3_300_000_000, "1 chunk": 6_500_000_000}


def chunks(a, name, qi, wi, ki, dev, W) -> dict:
    """indexer_topk_cand at each buffer budget (chunk count): ms, rows equal to the default's; the default's profile."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import indexer_topk_cand

    T = qi.shape[1]
    res, ref = {"whole": {}}, None
    for lab, bb in BUDGETS.items():
        if T <= 32768 and bb is not None:
            continue  # one chunk already
        fn = lambda: indexer_topk_cand(qi, wi, ki, a.k, sink=a.sink, window=a.window, budget_bytes=bb)  # noqa: E731
        info = {}
        out = indexer_topk_cand(qi, wi, ki, a.k, sink=a.sink, window=a.window, budget_bytes=bb, info=info)
        if ref is None:
            ref = out
        res["whole"][lab] = {"ms": bench_ms(fn, dev, **W), "equal": bool(torch.equal(out, ref)), "info": info,
                             "budget_bytes": bb}
        log(f"{name} whole {lab}: {res['whole'][lab]}")
    del ref, out
    res["profile"] = kernel_profile(fn if T <= 32768 else (
        lambda: indexer_topk_cand(qi, wi, ki, a.k, sink=a.sink, window=a.window)), dev, top=20)
    log(f"{name} profile {res['profile']}")
    return res


def prefill_budgets(a, index, dev, W, L) -> dict:
    """Prefill (top-k + `auto` attention) vs dense, default budget against one chunk, interleaved reps."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import sparse_attention
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import indexer_topk_cand

    gen = torch.Generator(device=dev).manual_seed(7)
    q, k, v = (torch.randn(1, L, h, 128, device=dev, generator=gen).to(torch.bfloat16) for h in (32, 8, 8))
    r = {"seqlen": L, **s18.dense_times(q, k, v, dev, W, False)}
    qi, wi, ki = index
    for rep in range(a.reps):
        for lab in ("default", "1 chunk"):
            bb = BUDGETS[lab]
            sel = lambda: indexer_topk_cand(qi, wi, ki, a.k, sink=a.sink, window=a.window, budget_bytes=bb)  # noqa
            t = {"select_ms": bench_ms(sel, dev, **W),
                 "prefill_ms": bench_ms(lambda: sparse_attention(q, k, v, sel(), backend="triton"), dev, **W)}
            t["speedup"] = r["dense_ms"] / t["prefill_ms"]
            r.setdefault(lab, []).append(t)
    log(f"prefill {L}: {r}")
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "hoist19"))
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--call", type=int, default=6, choices=(1, 2, 3, 4, 5, 6))
    a = ap.parse_args()
    a.reps, a.k, a.sink, a.window = 3, 2048, 4, 64
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    import triton

    from sparse_rl.bench import patterns
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import indexer_topk_cand

    dev = torch.device("cuda")
    W = dict(warmup_ms=25, rep_ms=60)
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
           "commit": a.commit, "shapes": {}}

    def save():
        with open(os.path.join(a.out, "hoist19.json"), "w") as f:
            json.dump(res, f, indent=1)

    ix, kl, gen = trained_indexer(dev, 0, 4, 64, 150)
    res["trained_indexer_kl"] = kl
    log(f"trained indexer kl {kl:.3f} at {time.time() - t0:.0f} s")
    g2 = torch.Generator(device=dev).manual_seed(3)

    def rnd(L):
        return (torch.randn(1, L, 4, 64, device=dev, generator=g2).bfloat16(),
                torch.rand(1, L, 4, device=dev, generator=g2).bfloat16(),
                torch.randn(1, L, 64, device=dev, generator=g2).bfloat16())

    if a.call == 6:
        ahead = {"default": {}, "ahead512": dict(redo_ahead=512)}
        for name, make in (("L32 trained", lambda: patterns.trained_index(ix, 32768, dev, gen)),
                           ("L32 random", lambda: rnd(32768))):
            qi, wi, ki = make()
            res["shapes"][name] = {"whole": s18.whole(a, name, qi, wi, ki, dev, W, ahead)}
            if name == "L32 trained":
                res.setdefault("prefill", {})[name] = s18.prefill(a, (qi, wi, ki), dev, W, ahead, 32768)
            save()
        res["wall_s"] = time.time() - t0
        save()
        return
    if a.call == 5:
        for name, L in (("L32 trained", 32768), ("L128 trained", 131072)):
            idx5 = patterns.trained_index(ix, L, dev, gen)
            res.setdefault("prefill", {})[name] = s18.prefill(a, idx5, dev, W, {"default": {}}, L)
            save()
            del idx5
            torch.cuda.empty_cache()
        res["wall_s"] = time.time() - t0
        save()
        return
    shapes = [("L32 trained", lambda: patterns.trained_index(ix, 32768, dev, gen)),
              ("L128 trained", lambda: patterns.trained_index(ix, 131072, dev, gen)),
              ("L32 random", lambda: rnd(32768)), ("L128 random", lambda: rnd(131072))]
    idx = {}
    for name, make in shapes:
        if time.time() - t0 > a.budget - 60:
            log(f"skip {name}: budget")
            continue
        qi, wi, ki = make()
        if a.call == 4:
            r = {"whole": s18.whole(a, name, qi, wi, ki, dev, W, SAMPLE4)}
            res["shapes"][name] = r
            save()
            del qi, wi, ki
            torch.cuda.empty_cache()
            continue
        if a.call == 2:
            r = chunks(a, name, qi, wi, ki, dev, W)
            res["shapes"][name] = r
            save()
            if name == "L128 trained":
                idx[name] = (qi, wi, ki)
            del qi, wi, ki
            torch.cuda.empty_cache()
            continue
        gv = GATHER3 if a.call == 3 else GATHER
        r = gather_alone(a, name, qi, wi, ki, dev, W, gv)
        ok = {k: v["ms"] for k, v in r["gather"].items() if v.get("equal") and "ms" in v}
        best = min(ok, key=ok.get)
        combos = {"default": {}, "skip": SKIP} if a.call == 3 else {"default": {}, "loaded": LOADED}
        if best not in ("hoist", "loaded", "skip"):
            combos["best"] = gv[best]
        r["whole"] = s18.whole(a, name, qi, wi, ki, dev, W, combos)
        if name.endswith("trained"):
            r["profile"] = kernel_profile(
                lambda: indexer_topk_cand(qi, wi, ki, a.k, sink=a.sink, window=a.window), dev, top=20)
            log(f"profile {r['profile']}")
            idx[name] = (qi, wi, ki)
        res["shapes"][name] = r
        save()
        del qi, wi, ki
        torch.cuda.empty_cache()
    for name, L in (("L32 trained", 32768), ("L128 trained", 131072)):
        if name in idx and time.time() - t0 < a.budget - (25 if L == 32768 else 45):
            if a.call == 2:
                res.setdefault("prefill", {})[name] = prefill_budgets(a, idx[name], dev, W, L)
            else:
                pair = {"default": {}, "skip": SKIP} if a.call == 3 else {"loaded": LOADED, "default": {}}
                res.setdefault("prefill", {})[name] = s18.prefill(a, idx[name], dev, W, pair, L)
            save()
        idx.pop(name, None)
        torch.cuda.empty_cache()
    res["wall_s"] = time.time() - t0
    save()
    log(f"done in {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
