"""Session 18, issue 15: the prefill cand top-k's per-row k-th key searches (the quantile and the select), on the
H200, one device call.

Why: at 32K trained the select is the largest phase of the exact top-k (2.05 of 5.5 ms; 8.3 of 48.6 at 128K), the
quantile the third (0.72 / 5.7). Both are one program a row running a 1-bit binary search: ~28 dependent block
reductions over all 4,096 lanes (sm_90a, Triton 3.6: 90-101 instructions a step at 8 warps, 111-125 registers,
so 2 programs an SM). Session 11 measured the 4-warp select equal to the 8-warp one and the 2-bit search
(`search_bits=2`) slower: neither the lanes a thread holds nor the reductions' count alone decides; the
row-programs in flight and the work per step do. Variants (CandConfig fields, all exact by construction):
- select_maxnreg 80 / 64: 3 / 4 programs of 8 warps an SM instead of 2 (compiled on the CPU host: 80 no spill
  without compaction; 64 spills 24-72 B);
- select_lean: only the keys in registers through the search, the positions loaded again for the kept lanes;
- select_compact / quantile_compact CM (`radix_topk.kth_key_compact`): the bit search stops once <= CM keys
  are still open (~6-10 of the ~28 bits), those are compacted to scratch and ranked all-pairs in one step.
Predictions (before the call): compact 64 cuts the select's steps ~3x -> select 2.05 -> ~0.9-1.3 ms at 32K
(8.3 -> ~3.5-5 at 128K), more with the register cap (3 programs an SM): ~0.7-1.0; the quantile 0.72 -> ~0.35-0.5
(at ~9 programs an SM it is issue-bound, so only the fewer steps count). End to end 32K trained 5.5 -> ~4.0-4.5
ms, 128K trained 48.6 -> ~38-42; prefill 32K 1.06x -> ~1.15-1.2x.

Per shape (32K trained, 128K trained, 32K random; B 1, k 2048, 4 x 64 bf16 indexer): the default's threshold /
gather buffers are made once, then every select variant on the same buffers (rows equal to the default's on
every served row) and every threshold variant (thresholds bitwise equal), then whole `indexer_topk_cand` calls
for the default and the fastest exact combinations (rows equal), then prefill at 32K.

Call 1 measured (fbd7f33, rows equal everywhere): select 32K trained 2.05 -> 1.42 ms (c64-lean-r64 / -w4-r128),
128K trained 8.27 -> 5.64 (w4-r128), 32K random 2.00 -> 1.28; the compaction alone (no cap) SLOWER (2.67: 152
registers, one program an SM), the cap alone 1.84-1.88, lean alone equal; threshold 0.72 -> 0.53 / 5.72 -> 3.81
(c64-r64); whole with both + 64-key gather tiles: 5.44 -> 4.26, 49.9 -> 43.0, 4.68 -> 3.51; prefill 32K 1.05 ->
1.13x. Below the predictions (select ~0.7-1.0 at 32K): ~23 us a row-program at 4 an SM, ~27% of issue.
Call 2 (the new default, CandConfig since this call): caps around it, old vs new whole at 32K / 128K trained and
random, prefill at 32K and 128K, the whole's kernel profile at 32K trained. Predictions: default = call 1's
both-n64 (4.26 / 43.0 / 3.51); 128K random ~46.5 -> ~38-40; prefill 32K ~1.13x, 128K ~2.6 -> ~2.8x; caps within
+-5%.

Call 2 measured (bfdecaf, rows equal everywhere), default vs old in the same run: whole 32K trained 5.46 -> 4.20 ms,
128K trained 48.4 -> 41.7, 32K random 4.69 -> 3.38, 128K random 45.9 -> 39.0; prefill 32K 1.12x (13.34 vs 14.91),
128K 3.11x (84.6 vs 263.4; old 2.94x); the select at compact 32 3-4% faster than 64 in all four shapes; other caps
slower or equal. Profile at 32K trained: select 1.44, gather 1.35, quantile 0.39, redo ~0.35, sample 0.09 of
4.2 ms (~0.5 ms between kernels).
Call 3 predictions: the select 1.36 -> ~1.15-1.25 ms at 32K trained (4 of ~18 reductions over the lanes gone),
5.39 -> ~4.6-5.0 at 128K; the quantile ~0.44-0.46 (one of ~14 gone); whole 32K trained ~4.0.

Call 3 measured (4c08ad8, rows equal everywhere): select 1.424 -> 1.238 ms at 32K trained, 5.64 -> 4.91 at 128K
trained, 1.28 -> 1.15 / 5.26 -> 4.78 random (right: ~1.15-1.25 predicted); compact 16 a little faster again (1.213 /
4.839); the quantile SLOWER at compact 64 (0.48 -> 0.54: more spills at the cap 64), compact 32 0.473 / 3.41.
Whole default vs old, same run: 32K trained 4.85 vs 5.89, 128K trained 42.7 vs 49.6, random 3.59 vs 4.96 / 40.2 vs
47.5 (this machine ~10% slower than call 2's in every whole row, old included); prefill 32K 1.00x (14.79 ms
although select 4.47 + attention 9.09 = 13.56: the top-k's host syncs hold the attention's launch back), 128K
3.01x (86.4 vs 260.3; old 2.81x).
Call 4 predictions (select_compact 16, quantile_compact 32): select ~1.21 / 4.84, quantile ~0.47 / 3.41; whole
32K trained ~4.1-4.8 (the machine's host decides); prefill 32K 1.0-1.15x, 128K ~3.0-3.1x.
Call 4 outcome: select 1.214 / 4.844, quantile 0.474 / 3.408 (as predicted); whole 32K trained 4.32 vs old 5.85,
128K trained 43.4 vs 49.0; prefill 32K 1.063-1.116x (old 1.012-1.019x), 128K 3.11-3.13x (old 2.85-2.87x); all rows equal
the old default's. The CLI's bench attention at d477bd9: 32K 1.04x, 128K 3.08x.

    PYTHONPATH=$PWD python benchmarks/gpu_select_session18.py --out $OUT/sel18 --budget 420 [--call 1|2|3|4]
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
from granular_harness import dense_times, kernel_profile, log, trained_indexer  # noqa: E402

# call 1 (fbd7f33): every form against the old default; call 2 (the new default, ND): caps around it, the old
# default (OLD) in the same run, prefill at 32K and 128K, a kernel profile of the whole at 32K trained
OLD = dict(block_n=128, warps=8, select_warps=8, quantile_maxnreg=0, select_maxnreg=0, select_lean=False,
           quantile_compact=0, select_compact=0)
SEL2 = {"base": {}, "w4-r96": dict(select_maxnreg=96), "w4-r80": dict(select_maxnreg=80),
        "w2-r128": dict(select_warps=2), "w2-r168": dict(select_warps=2, select_maxnreg=168),
        "w8-r56": dict(select_warps=8, select_maxnreg=56), "w4-c32": dict(select_compact=32),
        "old": {k: OLD[k] for k in ("select_warps", "select_maxnreg", "select_lean", "select_compact")}}
QUANT2 = {"base": {}, "r48": dict(quantile_maxnreg=48), "r40": dict(quantile_maxnreg=40),
          "w2-r64": dict(quantile_warps=2), "w2-r96": dict(quantile_warps=2, quantile_maxnreg=96),
          "r80": dict(quantile_maxnreg=80), "old": dict(quantile_maxnreg=0, quantile_compact=0)}
# call 3: kth_key_counts (the counts at the k-th from the all-pairs tile, the span's min / max in one reduction, no
# reduction for n) and select_compact 32 as the default; kernels alone compare with call 2's rows
SEL3 = {"base": {}, "c64": dict(select_compact=64), "r96": dict(select_maxnreg=96), "r168": dict(select_maxnreg=168),
        "w8-r64": dict(select_warps=8, select_maxnreg=64), "c16": dict(select_compact=16)}
QUANT3 = {"base": {}, "r80": dict(quantile_maxnreg=80), "r96": dict(quantile_maxnreg=96),
          "c32": dict(quantile_compact=32), "r56": dict(quantile_maxnreg=56)}
# call 4: the final defaults (select_compact 16, quantile_compact 32), the CLI's bench attention beside it; prefill
# three interleaved repetitions
SEL4 = {"base": {}, "c32": dict(select_compact=32)}
QUANT4 = {"base": {}, "c64": dict(quantile_compact=64)}
SEL = {"base": {}, "r80": dict(select_maxnreg=80), "lean": dict(select_lean=True),
       "lean-r80": dict(select_lean=True, select_maxnreg=80), "lean-r64": dict(select_lean=True, select_maxnreg=64),
       "c64": dict(select_compact=64), "c64-lean": dict(select_compact=64, select_lean=True),
       "c64-lean-r80": dict(select_compact=64, select_lean=True, select_maxnreg=80),
       "c64-lean-r64": dict(select_compact=64, select_lean=True, select_maxnreg=64),
       "c64-r80": dict(select_compact=64, select_maxnreg=80),
       "c32-lean-r80": dict(select_compact=32, select_lean=True, select_maxnreg=80),
       "c128-lean-r80": dict(select_compact=128, select_lean=True, select_maxnreg=80),
       "c64-lean-w16": dict(select_compact=64, select_lean=True, select_warps=16),
       "c64-lean-w16-r64": dict(select_compact=64, select_lean=True, select_warps=16, select_maxnreg=64),
       "c64-lean-w4": dict(select_compact=64, select_lean=True, select_warps=4),
       "c64-lean-w4-r128": dict(select_compact=64, select_lean=True, select_warps=4, select_maxnreg=128)}
QUANT = {"base": {}, "c64": dict(quantile_compact=64), "c32": dict(quantile_compact=32),
         "w8": dict(quantile_warps=8), "c64-w8": dict(quantile_compact=64, quantile_warps=8),
         "c64-w2": dict(quantile_compact=64, quantile_warps=2), "c64-r64": dict(quantile_compact=64, quantile_maxnreg=64)}
BASE: dict = {}  # call 1: OLD (its variants were relative to the default of then)
N64 = dict(block_n=64, warps=4)  # the 64-key gather tiles: faster alone (sessions 11 / 17), whole not re-timed


def buffers(qi, wi, ki, K, sink, window, dev):
    """The default config's threshold and gather over all rows at once (one chunk): (th, smp, val, nrow, kvs)."""
    import triton

    from sparse_rl.sparse.ops.indexer_topk import cand_topk as ct
    from sparse_rl.sparse.ops.indexer_topk.stream import _kv_start, stream_buffer_slots

    cfg = ct.CandConfig()
    B, T = qi.shape[:2]
    S = ki.shape[1]
    C = stream_buffer_slots(K)
    kvs = _kv_start(None, B, dev)
    SW = triton.cdiv(S, ct.sample_stride(cfg, S))
    val = torch.empty(B, T, C, device=dev, dtype=torch.int64)
    smp = torch.empty(B, T, SW, device=dev)
    th = torch.empty(B, T, device=dev)
    nrow = torch.empty(B, T, device=dev, dtype=torch.int32)
    ct.cand_threshold(qi, wi, ki, kvs, 0, T, 0, sink, window, K, C, th, smp, cfg)
    ct.cand_gather(qi, wi, ki, kvs, 0, T, 0, sink, window, K, th, val, val, nrow, cfg)
    return th, smp, val, nrow, kvs, C


def kernels(a, name, qi, wi, ki, dev, W, SEL, QUANT) -> dict:
    """Every select variant on the default's buffers and every threshold variant; equality to the default."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk import cand_topk as ct

    K = a.k
    th, smp, val, nrow, kvs, C = buffers(qi, wi, ki, K, a.sink, a.window, dev)
    B, T = qi.shape[:2]
    served = (nrow >= 0)[..., None]
    res = {"rows_flagged": int((nrow < 0).sum()), "select": {}, "quantile": {}}
    ref = None
    for lab, over in SEL.items():
        cfg = dataclasses.replace(ct.CandConfig(), **{**BASE, **over})
        out = torch.full((B, T, K), -7, device=dev, dtype=torch.int32)
        try:
            ct.cand_select(val, val, nrow, out, K, cfg)
            torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
            eq = bool(torch.equal(torch.where(served, out, 0), torch.where(served, ref, 0)))
            ms = bench_ms(lambda: ct.cand_select(val, val, nrow, out, K, cfg), dev, **W)
            res["select"][lab] = {"ms": ms, "equal": eq}
        except Exception as e:  # noqa: BLE001 (a variant that does not compile is a result)
            res["select"][lab] = {"error": repr(e)[:300]}
        log(f"{name} select {lab}: {res['select'][lab]}")
    th_ref = th.clone()
    for lab, over in QUANT.items():
        cfg = dataclasses.replace(ct.CandConfig(), **{**BASE, **over})
        th2 = torch.empty_like(th)
        fn = lambda: ct.cand_threshold(qi, wi, ki, kvs, 0, T, 0, a.sink, a.window, K, C, th2, smp, cfg)  # noqa: E731
        try:
            fn()
            torch.cuda.synchronize()
            eq = bool(torch.equal(th2.view(torch.int32), th_ref.view(torch.int32)))
            res["quantile"][lab] = {"ms": bench_ms(fn, dev, **W), "equal": eq}
        except Exception as e:  # noqa: BLE001
            res["quantile"][lab] = {"error": repr(e)[:300]}
        log(f"{name} threshold {lab}: {res['quantile'][lab]}")
    del val, smp
    torch.cuda.empty_cache()
    return res


def fastest(rows: dict) -> str:
    ok = {k: v["ms"] for k, v in rows.items() if v.get("equal") and "ms" in v}
    return min(ok, key=ok.get)


def whole(a, name, qi, wi, ki, dev, W, combos: dict) -> dict:
    """indexer_topk_cand per combination: ms, rows equal to the default's, info."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import CandConfig, indexer_topk_cand

    res, ref = {}, None
    for lab, over in combos.items():
        cfg = dataclasses.replace(CandConfig(), **{**BASE, **over})
        fn = lambda: indexer_topk_cand(qi, wi, ki, a.k, sink=a.sink, window=a.window, config=cfg)  # noqa: E731
        try:
            info = {}
            out = indexer_topk_cand(qi, wi, ki, a.k, sink=a.sink, window=a.window, config=cfg, info=info)
            if ref is None:
                ref = out
            res[lab] = {"ms": bench_ms(fn, dev, **W), "equal": bool(torch.equal(out, ref)), "info": info,
                        "config": over}
        except Exception as e:  # noqa: BLE001
            res[lab] = {"error": repr(e)[:300], "config": over}
        log(f"{name} whole {lab}: {res[lab]}")
    return res


def prefill(a, index, dev, W, pair: dict, L: int) -> dict:
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import sparse_attention
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import CandConfig, indexer_topk_cand

    gen = torch.Generator(device=dev).manual_seed(7)
    q, k, v = (torch.randn(1, L, h, 128, device=dev, generator=gen).to(torch.bfloat16) for h in (32, 8, 8))
    dn = dense_times(q, k, v, dev, W, False)
    qi, wi, ki = index
    r = {"seqlen": L, "configs": pair, **dn}
    for rep in range(a.reps):
        for lab, o in pair.items():
            cfg = dataclasses.replace(CandConfig(), **{**BASE, **o})
            sel = lambda: indexer_topk_cand(qi, wi, ki, a.k, sink=a.sink, window=a.window, config=cfg)  # noqa: E731
            rows = sel()
            t = {"select_ms": bench_ms(sel, dev, **W),
                 "attn_ms": bench_ms(lambda: sparse_attention(q, k, v, rows, backend="triton"), dev, **W),
                 "prefill_ms": bench_ms(lambda: sparse_attention(q, k, v, sel(), backend="triton"), dev, **W)}
            t["speedup"] = r["dense_ms"] / t["prefill_ms"]
            if a.reps == 1:
                r[lab] = t
            else:
                r.setdefault(lab, []).append(t)
    log(f"prefill {L}: {r}")
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "sel18"))
    ap.add_argument("--budget", type=float, default=420.0)
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--call", type=int, default=3, choices=(1, 2, 3, 4))
    a = ap.parse_args()
    a.reps = 3 if a.call == 4 else 1
    a.k, a.sink, a.window = 2048, 4, 64
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    from sparse_rl.bench import patterns

    dev = torch.device("cuda")
    W = dict(warmup_ms=25, rep_ms=60)
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "commit": a.commit,
           "shapes": {}}
    import triton
    res["triton"] = triton.__version__

    def save():
        with open(os.path.join(a.out, "sel18.json"), "w") as f:
            json.dump(res, f, indent=1)

    ix, kl, gen = trained_indexer(dev, 0, 4, 64, 150)
    res["trained_indexer_kl"] = kl
    log(f"trained indexer kl {kl:.3f} at {time.time() - t0:.0f} s")
    g2 = torch.Generator(device=dev).manual_seed(3)
    shapes = [("L32 trained", lambda: patterns.trained_index(ix, 32768, dev, gen)),
              ("L128 trained", lambda: patterns.trained_index(ix, 131072, dev, gen)),
              ("L32 random", lambda: (torch.randn(1, 32768, 4, 64, device=dev, generator=g2).bfloat16(),
                                      torch.rand(1, 32768, 4, device=dev, generator=g2).bfloat16(),
                                      torch.randn(1, 32768, 64, device=dev, generator=g2).bfloat16()))]
    if a.call >= 2:
        shapes.append(("L128 random", lambda: (torch.randn(1, 131072, 4, 64, device=dev, generator=g2).bfloat16(),
                                               torch.rand(1, 131072, 4, device=dev, generator=g2).bfloat16(),
                                               torch.randn(1, 131072, 64, device=dev, generator=g2).bfloat16())))
    sel_v, q_v = {1: (SEL, QUANT), 2: (SEL2, QUANT2), 3: (SEL3, QUANT3), 4: (SEL4, QUANT4)}[a.call]
    if a.call == 1:
        BASE.update(OLD)
    idx = {}
    for name, make in shapes:
        if time.time() - t0 > a.budget - 90:
            log(f"skip {name}: budget")
            continue
        qi, wi, ki = make()
        r = {"kernels": kernels(a, name, qi, wi, ki, dev, W, sel_v, q_v)}
        save()
        bs, bq = fastest(r["kernels"]["select"]), fastest(r["kernels"]["quantile"])
        r["fastest"] = {"select": bs, "quantile": bq}
        if a.call == 1:
            combos = {"default": {}, "sel": SEL[bs], "quant": QUANT[bq], "both": {**SEL[bs], **QUANT[bq]},
                      "both-n64": {**SEL[bs], **QUANT[bq], **N64}, "n64": N64,
                      "c64-lean-r80+c64": {**SEL["c64-lean-r80"], **QUANT["c64"]}}
        else:
            combos = {"default": {}, "old": OLD, "best": {**sel_v[bs], **q_v[bq]}}
        r["whole"] = whole(a, name, qi, wi, ki, dev, W, combos)
        if a.call >= 2 and name == "L32 trained":
            from sparse_rl.sparse.ops.indexer_topk.cand_topk import indexer_topk_cand
            r["profile"] = kernel_profile(
                lambda: indexer_topk_cand(qi, wi, ki, a.k, sink=a.sink, window=a.window), dev, top=20)
            log(f"profile {r['profile']}")
        res["shapes"][name] = r
        save()
        if name in ("L32 trained", "L128 trained"):
            idx[name] = (qi, wi, ki)
            w = {k: v for k, v in r["whole"].items() if v.get("equal") and "ms" in v}
            res.setdefault("best_whole", {})[name] = min(w, key=lambda k: w[k]["ms"])
        else:
            del qi, wi, ki
        torch.cuda.empty_cache()
    for name, L in (("L32 trained", 32768), ("L128 trained", 131072)):
        if name in idx and time.time() - t0 < a.budget - (25 if L == 32768 else 40):
            if a.call == 1:
                pair = {"default": {}, "new": res["shapes"][name]["whole"][res["best_whole"][name]]["config"]}
            else:
                pair = {"old": OLD, "default": {}}
            res.setdefault("prefill", {})[name] = prefill(a, idx[name], dev, W, pair, L)
            save()
        if L == 32768:
            idx.pop(name, None)
            torch.cuda.empty_cache()
    res["wall_s"] = time.time() - t0
    save()
    log(f"done in {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
