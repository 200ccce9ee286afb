"""Issue 15 item 1, session 11 (tok11): the prefill cand top-k's compacting gather without per-score scans
(`cand_topk._gather_words_kernel`, `CandConfig(gather="words")`) against session 10's gather (`gather="scan"`,
the current default), the score sweep alone and `bin_topk`, on the H200, one device call of <= 150 s.

What changed (all in the gather; threshold and select as session 10, the packed select makes the key):
- slots from 32-key words: the row's candidate mask OR-reduced to BN/32 words, POPC a word, an exclusive prefix
  over the 4 word counts, popc(word & lanes below) a key, instead of `tl.cumsum` over the [64, 128] tile;
- the whole, unforced key tiles of a row tile in a loop of their own (candidate test: one compare a score);
- the predicated scattered stores as inline PTX `st.global` in the accumulator's register layout: `tl.store`
  made Triton's coalescing pass convert value, index, mask and pointers through shared memory first.

Phases, highest value first, each gated on the time LEFT of --budget (JSON + log rewritten after every row):
0. every variant proven in child processes (a bad launch or inline asm cannot poison the parent's context) on
   64 real-length rows (S = 32K / 128K, K = 2048; random bf16, mixed-sign weights, a run of 64 equal keys)
   against `bin_topk` on the same materialised scores, compiling the timed specialisations meanwhile;
1. 32K trained: sweep alone, bin (reference rows and time), each variant: rows == bin's, time, phases
   (threshold, gather, select, buffer entries, rows flagged for the redo);
2. 32K random: the same;  3. 128K random: sweep, bin, the 128K variants;
4. end to end: token-level prefill at 32K (the fastest exact variant + sparse attention) vs dense cuDNN SDPA;
5. 128K trained if time is left.

Predictions (written before the call; B = 1, k = 2048, indexer 4 x 64 bf16; from the sm_90a SASS of the
[64, 128] tile loop, compiled on the CPU host with the launch's stride-1 / 16-divisible specialisations):
the sweep alone (`_row_max_kernel`) is 642 instructions a tile and 0.77 ms at 32K (10.9 at 128K); session
10's gather 2,016 (3.1x; it measured 4.0 ms, 5.2x: the shared-memory round trips of the store conversion add
latency beyond issue); the words gather 1,036-1,065 in the whole-tile loop (1.6-1.7x the sweep), 1,459-1,538
in the diagonal tiles, no spills (session 10's words-free form at 255 registers), no store conversion.
- gather at 32K: **1.4-2.2 ms** (target <= 2), from 4.0; the attribution rows: word-compact alone (w-scan:
  split + asm with tl.cumsum) ~2.5-3, no split ~1.8-2.6, no asm ~3-3.8 (the store conversion is the largest
  single term); packed (one 8-byte store) -0.1 to -0.3 ms.
- 32K whole (threshold 0.5-0.7, gather ~1.8, select 1.7-2.1, redo ~1 ms for 110-250 trained rows):
  trained **~4.5-5.5 ms** against 7.2 (pk-q16) / 7.9 (bin); random ~4-4.5 against 7.1. Target <= 5 ms: at
  the edge; the select becomes the largest phase.
- 128K random: gather 45 -> ~17-28 ms; whole **~35-45 ms** against 71.7 (target <= 50).
- token-level prefill at 32K: 18.5 -> ~15.5-16.5 ms, ~0.9-0.97x dense (0.81x in session 10).

Call 1 (`2c441f3`, 42 s of 140; results/call1/tok11): rows equal to bin's everywhere but w-pk-q16 at 128K random
(1 row of 131K). 32K trained gather 4.22 -> 1.87 ms (w), 1.56 (w-pk), 1.35 (w-pk-n64: 64-key tiles, 4 warps);
attribution: tl.cumsum kept (w-scan) 2.19, no split 2.19, tl.store kept (w-noasm) 3.87. Whole 32K trained 8.27
(cand default) -> 5.06 (w-pk-q16) / 5.51 (w-pk), bin 7.93; random 6.91 -> 4.75 / 5.00, bin 7.12. 128K random
72.5 -> 44.5 (w-pk), gather 45.0 -> 22.2; 128K trained 84.9 -> 54.1 (3,166 rows redone). The select (2.0 / 8.3
ms) is now the largest phase after the gather; the redo the largest at 128K trained.

Call 2 (`2452f14`, below) was NOT run: the session's device time was spent. Its predictions stay unchecked.
Call 2 predictions (written before the call):
- w-pk-n64 at 128K: gather 22.2 -> ~19-20 ms (the 32K ratio 0.87); whole random ~41-43 ms.
- the 2-bit k-th key search (s2: half the dependent count / reduce / barrier rounds, ~1.3x the instructions a
  searched bit): select 2.05 -> 1.6-1.9 ms at 32K, 8.3 -> 6.5-7.5 at 128K; quantile a little faster.
- 7 GB buffer budget (b7g: the 128K rows in one chunk instead of 3): -2 to -5 ms at 128K (two fewer causal-tail
  waves and host syncs); no change at 32K (already one chunk).
- cand-pk-q16 at 128K random (scan gather, same 16-bit threshold): if it also differs from bin on a row, the
  difference is in the threshold / decode-redo path, not the words gather (diff_rows records the row's count).
- 128K trained: E 1.7 fewer rows redone than 1.5's 3,166 (most are short, p99 entries 3,451 of 4,096): ~45-50 ms;
  E 1.3 more rows, slower.
- 16K: w-pk-n64 ~1.6-2.0 ms against bin ~2.3 (session 9: 2.35), so auto's cand boundary moves to >= 16K.
- token-level prefill at 32K (fastest exact variant): ~16-17 ms, 0.88-0.94x dense (session 10: 0.81x).

Call 3 (planned, session 16's tie path: `CandConfig.ties`, cand_ties.py; `--call 3`). A CPU replay of the trained
indexer (benchmarks/cpu_cand_flags.py) found every flagged row an overflow through exact zeros at a threshold of 0
(216 of 32K at E 1.5; ~2.7% of 128K), so: rows redone 252 -> 0 at 32K trained and 3,166 -> ~0 at 128K trained;
whole 32K trained 5.5 -> ~4.3-4.6 ms (the redo's ~1.2 ms less the regather of ~5 row tiles and a sort a row, <
0.2 ms); 128K trained 54 -> ~35-40 ms; random rows unchanged (no tie rows: cand == cand-ties within noise). The
tie path is off by default on the GPU (CandConfig.ties) until this call: cand-ties is it; if its rows equal bin's
and it is faster, it becomes the default.
Call 3 measured (session 17): rows equal to bin everywhere, but SLOWER: 32K trained 8.38 vs 6.04 ms, 128K trained
66.8 vs 56.1: the flagged rows of a chunk fill one or a few 64-row tiles, and one program walked a row's whole
key range alone (a few programs on 132 SMs).
Call 4 (planned, `--call 4`): cand_ties.py splits the rows' keys into P spans (two passes: count, then store at
the prefix), P for ~2 programs an SM (`cand-ties`), or forced (`cand-ties-p8`, `cand-ties-p1` = one span, the
call-3 walk in two passes). Predictions: 32K trained 6.04 -> ~4.9-5.1 ms (the redo's ~1.2 ms replaced by two
passes of ~60 us each and the tie select); 128K trained 56 -> ~38-42; cand-ties-p1 slower than call 3's (two
walks); random rows unchanged.
Call 4 measured (session 17): 32K trained 5.68 vs 5.51; 128K trained 53.2 vs 56.6; the profile
(gpu_ties_profile_session17.py) put 0.29 ms of 32K's tie path in the select's sort: merged by binary search instead,
call 4 again: 32K trained 5.64 vs 5.72, 128K trained 50.4 vs 56.2, 128K random 51.6 vs 47.9 (~25 flagged rows a
chunk: ~1.3 ms of launches and syncs a chunk). Call 5 (`--call 5`): the default with the rule (tie path where a
chunk's flagged rows x keys >= 2^26) against the redo alone and the tie path everywhere; predictions: cand =
cand-redo at 32K and 128K random, = cand-ties-all (~50.4) at 128K trained where its chunks pass the rule.

    PYTHONPATH=$PWD python benchmarks/gpu_tok11_session11.py --budget 140 --commit <sha>
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/gpu_tok11_session11.py --cpu-smoke --budget 900 --jobs 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from granular_harness import Run, dense_times, log, parallel_warmup, trained_indexer  # noqa: E402

W_ = {"gather": "words"}
P64 = {"gather": "words", "packed": True, "block_n": 64, "warps": 4}  # call 1's fastest gather
# (label, CandConfig overrides on CandConfig()); the first is the current default (session 10's scan gather)
CAND = {1: [("cand", {}), ("cand-pk-q16", {"packed": True, "quantile_bits": 16}),
            ("w", W_), ("w-pk", {**W_, "packed": True}), ("w-scan", {**W_, "word_compact": False}),
            ("w-nosplit", {**W_, "split": False}), ("w-noasm", {**W_, "asm_store": False}),
            ("w-pk-q16", {**W_, "packed": True, "quantile_bits": 16}), ("w-E1.3", {**W_, "target": 1.3}),
            ("w-pk-4w", {**W_, "packed": True, "select_warps": 4}),
            ("w-pk-n64", {**W_, "packed": True, "block_n": 64, "warps": 4})],
        2: [("cand", {}), ("w-pk", {**W_, "packed": True}), ("w-pk-n64", P64),
            ("w-pk-n64-s2", {**P64, "search_bits": 2}),
            ("w-pk-s2", {**W_, "packed": True, "search_bits": 2}), ("w-pk-n64-q16", {**P64, "quantile_bits": 16}),
            ("cand-pk-q16", {"packed": True, "quantile_bits": 16}), ("w-pk-n64-b7g", {**P64, "budget": 7 << 30}),
            ("w-pk-n64-E1.7", {**P64, "target": 1.7}), ("w-pk-n64-E1.3", {**P64, "target": 1.3})],
        # call 3 (session 16's tie path, cand_ties.py; the default CandConfig is words + packed since c95823e)
        3: [("cand", {}), ("cand-ties", {"ties": True}), ("cand-ties-s2", {"ties": True, "search_bits": 2}),
            ("cand-ties-n64", {"ties": True, "block_n": 64, "warps": 4}),
            ("cand-ties-b7g", {"ties": True, "budget": 7 << 30})],
        # call 4 (session 17: the tie path's keys split into spans, cand_ties.py)
        4: [("cand", {}), ("cand-ties", {"ties": True}), ("cand-ties-p8", {"ties": True, "tie_splits": 8}),
            ("cand-ties-p1", {"ties": True, "tie_splits": 1})],
        # call 5 (session 17: CandConfig's default is the tie path where a chunk's flagged rows x keys >= 2^26)
        5: [("cand", {}), ("cand-redo", {"ties": False}), ("cand-ties-all", {"tie_min_work": 0})]}
CAND128 = {1: ["cand", "w", "w-pk", "w-pk-q16"],
           2: ["cand", "w-pk", "w-pk-n64", "w-pk-n64-s2", "w-pk-n64-b7g", "w-pk-n64-q16", "cand-pk-q16"],
           3: ["cand", "cand-ties", "cand-ties-n64", "cand-ties-b7g"], 4: ["cand", "cand-ties"],
           5: ["cand", "cand-redo", "cand-ties-all"]}
RANDOM32 = {1: {"cand", "cand-pk-q16", "w", "w-pk", "w-pk-q16"},
            2: {"cand", "w-pk", "w-pk-n64", "w-pk-n64-s2", "w-pk-n64-q16"}, 3: {"cand", "cand-ties"},
            4: {"cand", "cand-ties"}, 5: {"cand", "cand-redo"}}
TRAINED32 = {1: None, 2: ["cand", "w-pk", "w-pk-n64", "w-pk-n64-s2", "w-pk-s2", "w-pk-n64-q16", "w-pk-n64-E1.3"],
             3: ["cand", "cand-ties", "cand-ties-s2", "cand-ties-n64"],
             4: ["cand", "cand-ties", "cand-ties-p8", "cand-ties-p1"], 5: ["cand", "cand-redo", "cand-ties-all"]}
TRAINED128 = {1: ["cand", "w", "w-pk"], 2: ["cand", "w-pk-n64", "w-pk-n64-E1.7", "w-pk-n64-E1.3"],
              3: ["cand", "cand-ties", "cand-ties-n64"], 4: ["cand", "cand-ties", "cand-ties-p8"],
              5: ["cand", "cand-redo", "cand-ties-all"]}
L16 = {1: [], 2: ["w-pk", "w-pk-n64"], 3: [], 4: [], 5: []}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tok11"))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--budget", type=float, default=140.0, help="seconds of script time; phases gate on time left")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU through the interpreter")
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--rep-ms", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=8, help="warm-up child processes (0: none)")
    ap.add_argument("--warm-s", type=float, default=45.0)
    ap.add_argument("--call", type=int, default=5, choices=(1, 2, 3, 4, 5), help="which device call's variant lists")
    ap.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prove-dir", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.cand = CAND[a.call]
    if a.cpu_smoke:  # every phase and code path once, few variants (the interpreter takes ~1 min a variant)
        keep = {"cand", "w-pk", "w-pk-n64", "w-pk-n64-s2", "w-pk-n64-b7g", "cand-ties", "cand-ties-n64",
                "cand-ties-b7g", "cand-ties-p1"}
        a.cand = [x for x in a.cand if x[0] in keep]
        for d in (CAND128, RANDOM32, TRAINED32, TRAINED128, L16):
            if d[a.call] is not None:
                d[a.call] = type(d[a.call])(x for x in d[a.call] if x in keep)
    a.shape, a.index, a.sink, a.window = [1, 32, 8, 128, 2048], [4, 64], 4, 64
    a.L16, a.L32, a.L128 = 16384, 32768, 131072
    if a.cpu_smoke:
        a.shape, a.index, a.sink, a.window, a.train_steps, a.rep_ms = [1, 4, 1, 32, 16], [2, 16], 2, 4, 3, 1
        a.L16, a.L32, a.L128 = 64, 96, 160
    return a


def cand_cfg(a, over: dict):
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import INTERPRET_CAND, CandConfig

    over = {k: v for k, v in over.items() if k != "budget"}

    if a.cpu_smoke and over.get("gather") == "words":
        over = {"block_n": 32, **over}  # the word compaction packs 32-key words
    return dataclasses.replace(INTERPRET_CAND if a.cpu_smoke else CandConfig(), **over)


def cand_fn(a, over: dict, info=None):
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import indexer_topk_cand

    over = dict(over)
    budget = over.pop("budget", None)  # an argument of indexer_topk_cand, not a config field
    cfg = cand_cfg(a, over)
    K = a.shape[4]
    return lambda qi, wi, ki: indexer_topk_cand(qi, wi, ki, K, sink=a.sink, window=a.window, config=cfg, info=info,
                                                budget_bytes=budget)


def impl_fn(a, impl: str):
    from sparse_rl.sparse.ops.indexer_topk import triton as tri

    return lambda qi, wi, ki: tri.indexer_topk(qi, wi, ki, a.shape[4], sink=a.sink, window=a.window, topk_impl=impl)


def parts(a) -> list[str]:
    l128 = dict.fromkeys(CAND128[a.call] + TRAINED128[a.call])
    return ([f"{lab}@{a.L32}" for lab, _ in a.cand] + [f"{lab}@{a.L128}" for lab in l128]
            + [f"{lab}@{a.L16}" for lab in L16[a.call]] + [f"bin@{a.L32}"])


def prove(a, dev, part: str) -> None:
    """Child: one variant on the last 64 rows of a real-length row set (random bf16, mixed-sign weights, and a
    run of equal keys), against the radix select on the same materialised scores."""
    label = part.split(":", 1)[1]
    name, L = label.split("@")
    L = int(L)
    res = {"label": label, "ok": False}
    try:
        g = torch.Generator(device=dev).manual_seed(3)
        HI, DI = a.index
        T = 64 if dev.type == "cuda" else 16
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
        q = torch.randn(1, T, HI, DI, device=dev, generator=g).to(dt)
        w = torch.randn(1, T, HI, device=dev, generator=g).to(dt)
        k = torch.randn(1, L, DI, device=dev, generator=g).to(dt)
        k[0, L // 2:L // 2 + 64] = k[0, L // 2 - 1]  # equal scores across sampled keys and their neighbours
        from sparse_rl.sparse.ops.indexer_topk import triton as tri
        from sparse_rl.sparse.ops.indexer_topk.cand_topk import indexer_topk_cand

        K = a.shape[4]
        kw = dict(q_offset=L - T, sink=a.sink, window=a.window)
        if name != "bin":
            got = indexer_topk_cand(q, w, k, K, config=cand_cfg(a, dict(a.cand)[name]), **kw)
        else:
            got = tri.indexer_topk(q, w, k, K, topk_impl=name, **kw)
        # the same score kernel's rows (bin_topk on materialised scores): bf16 scores tie-break as theirs
        ref = tri.indexer_topk(q, w, k, K, topk_impl="bin" if name != "bin" else "radix", **kw)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        res["rows_differing"] = int((got != ref).any(-1).sum())
        res["ok"] = res["rows_differing"] == 0
    except Exception as e:  # noqa: BLE001 -- reported to the parent
        res["err"] = f"{type(e).__name__}: {str(e)[:300]}"
    with open(os.path.join(a.prove_dir, f"prove.{label}.json"), "w") as f:
        json.dump(res, f)


def read_proven(a) -> dict:
    done = {}
    for f in os.listdir(a.prove_dir):
        if f.startswith("prove."):
            r = json.load(open(os.path.join(a.prove_dir, f)))
            done[r["label"]] = r
    return done


def cand_phases(a, qi, wi, ki, over: dict, dev, W: dict, rows=()) -> dict:
    """Per-phase times of one cand variant over all rows in one chunk: threshold (sample + quantile), gather,
    select; buffer entries and the rows flagged for the exact redo."""
    import triton

    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk import cand_topk as ct
    from sparse_rl.sparse.ops.indexer_topk.stream import _kv_start, stream_buffer_slots

    cfg = cand_cfg(a, over)
    B, T = qi.shape[:2]
    S, K = ki.shape[1], a.shape[4]
    C = stream_buffer_slots(K)
    kvs = _kv_start(None, B, dev)
    SW = triton.cdiv(S, ct.sample_stride(cfg, S))
    val = torch.empty(B, T, C, device=dev, dtype=torch.int64 if cfg.packed else torch.float32)
    idx = val if cfg.packed else torch.empty(B, T, C, device=dev, dtype=torch.int32)
    smp = torch.empty(B, T, SW, device=dev)
    th = torch.empty(B, T, device=dev)
    nrow = torch.empty(B, T, device=dev, dtype=torch.int32)
    out = torch.empty(B, T, K, device=dev, dtype=torch.int32)
    thr = lambda: ct.cand_threshold(qi, wi, ki, kvs, 0, T, 0, a.sink, a.window, K, C, th, smp, cfg)  # noqa: E731
    gat = lambda: ct.cand_gather(qi, wi, ki, kvs, 0, T, 0, a.sink, a.window, K, th, val, idx, nrow, cfg)  # noqa: E731
    sel = lambda: ct.cand_select(val, idx, nrow, out, K, cfg)  # noqa: E731
    r = {"threshold_ms": bench_ms(thr, dev, **W)}
    thr()
    r["gather_ms"] = bench_ms(gat, dev, **W)
    gat()
    r["select_ms"] = bench_ms(sel, dev, **W)
    n = nrow[0].long()
    big = torch.arange(T, device=dev) > C  # rows that needed a threshold
    r["rows_flagged"] = int((n < 0).sum())
    r["entries_mean_threshold_rows"] = float(n[big & (n >= 0)].double().mean()) if bool((big & (n >= 0)).any()) else 0.0
    q = torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64, device=dev)
    r["entries_p01_p50_p99"] = [float(v) for v in torch.quantile(n[big & (n >= 0)].double(), q)] if bool(
        (big & (n >= 0)).any()) else []
    r["rows_short"] = int(((n < 0) & big).sum())
    if r["rows_flagged"] and dev.type == "cuda" and T * 2 * C * 8 <= 9 << 30:
        # why rows were flagged: the same thresholds into a 2C-slot buffer: C < entries <= 2C (an overflow), or
        # still -1 there (short of K, or more than 2C)
        v2 = torch.empty(B, T, 2 * C, device=dev, dtype=val.dtype)
        i2 = v2 if cfg.packed else torch.empty(B, T, 2 * C, device=dev, dtype=torch.int32)
        n2 = torch.empty(B, T, device=dev, dtype=torch.int32)
        ct.cand_gather(qi, wi, ki, kvs, 0, T, 0, a.sink, a.window, K, th, v2, i2, n2, cfg)
        f = (n < 0) & big
        m = n2[0].long()
        r["flagged_over_c_within_2c"] = int((f & (m > C)).sum())
        r["flagged_short_or_over_2c"] = int((f & (m < 0)).sum())
        del v2, i2
    if rows:  # rows that differed from the reference: their buffer count (-1: redone) and threshold
        r["diff_rows"] = {int(i): [int(n[i]), float(th[0, i])] for i in rows}
    return r


def token_phase(a, run: Run, name: str, index, dev, W: dict, labels: list[str], ok: set, with_auto=True) -> dict:
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk.stream import indexer_row_max

    qi, wi, ki = index
    res = {"name": name, "times": {}, "equal_bin": {}, "info": {}, "phases": {}, "ref": "bin"}
    res["sweep_ms"] = bench_ms(lambda: indexer_row_max(qi, wi, ki), dev, **W)
    log(f"{name} sweep alone {res['sweep_ms']:.3f} ms")
    ref = None
    if with_auto and run.gate(12, f"{name} bin"):  # the reference rows (auto is cand above 32K keys)
        ref = impl_fn(a, "bin")(qi, wi, ki)
        res["times"]["bin"] = bench_ms(lambda: impl_fn(a, "bin")(qi, wi, ki), dev, **W)
        log(f"{name} bin {res['times']['bin']:.3f} ms")
        run.save()
    for lab in labels:
        if lab not in ok or not run.gate(10, f"{name} {lab}"):
            continue
        over = dict(a.cand)[lab]
        info = {}
        got = run.guarded(f"{name} {lab}", cand_fn(a, over, info), qi, wi, ki)
        if got is None:
            continue
        res["info"][lab] = info
        if ref is None:  # no bin rows (128K trained): the first label's rows (the default) are the reference
            ref, res["ref"] = got, lab
        else:
            res["equal_bin"][lab] = bool(torch.equal(got, ref))
            res.setdefault("rows_differing", {})[lab] = int((got != ref).any(-1).sum())
            bad = (got != ref).any(-1)[0].nonzero().flatten()[:4]
            # row -> (positions differing, keys not in the reference's set)
            diff = {int(i): [int((got[0, i] != ref[0, i]).sum()),
                             int(((got[0, i] >= 0) & ~torch.isin(got[0, i], ref[0, i])).sum())] for i in bad.tolist()}
            if diff:
                res.setdefault("diff_rows", {})[lab] = diff
        del got
        res["times"][lab] = run.guarded(f"{name} {lab} time", bench_ms, lambda: cand_fn(a, over)(qi, wi, ki), dev, **W)
        if run.left() > 8:
            res["phases"][lab] = run.guarded(f"{name} {lab} phases", cand_phases, a, qi, wi, ki, over, dev, W,
                                             list(res.get("diff_rows", {}).get(lab, {})))
        log(f"{name} {lab}: {res['times'][lab]} ms, equal bin {res['equal_bin'].get(lab)}, info {info}, "
            f"phases {res['phases'].get(lab)}")
        run.save()
    return res


def random_index(a, L, dev, gen):
    HI, DI = a.index
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return (torch.randn(1, L, HI, DI, device=dev, generator=gen).to(dt),
            torch.rand(1, L, HI, device=dev, generator=gen).to(dt),
            torch.randn(1, L, DI, device=dev, generator=gen).to(dt))


def prefill(a, run: Run, index, dev, W: dict, impl: str) -> dict:
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import sparse_attention

    B, H, Hkv, D, K = a.shape
    L = a.L32
    gen = torch.Generator(device=dev).manual_seed(7)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q, k, v = (torch.randn(B, L, h, D, device=dev, generator=gen).to(dt) for h in (H, Hkv, Hkv))
    dn = dense_times(q, k, v, dev, W, False)
    qi, wi, ki = index
    sel = ((lambda: cand_fn(a, dict(a.cand)[impl])(qi, wi, ki)) if impl in dict(a.cand)
           else (lambda: impl_fn(a, impl)(qi, wi, ki)))
    rows = sel()
    r = {"seqlen": L, "topk_impl": impl, **dn, "select_ms": bench_ms(sel, dev, **W),
         "attn_ms": bench_ms(lambda: sparse_attention(q, k, v, rows, backend="triton"), dev, **W),
         "prefill_ms": bench_ms(lambda: sparse_attention(q, k, v, sel(), backend="triton"), dev, **W)}
    r["prefill_speedup"] = r["dense_ms"] / r["prefill_ms"]
    log(str(r))
    return r


def best_label(tok: dict | None) -> str | None:
    """The fastest cand variant whose rows equalled auto's in this run's 32K trained phase."""
    if not tok:
        return None
    ok = [(t, lab) for lab, t in tok["times"].items() if lab != "bin" and t and tok["equal_bin"].get(lab)]
    return min(ok)[1] if ok else None


def main(argv=None):
    a = parse_args(argv)
    dev = torch.device("cpu" if a.cpu_smoke else "cuda")
    if a.warm_part:
        prove(a, dev, a.warm_part)
        return
    import triton

    from sparse_rl.bench import patterns
    from sparse_rl.bench.timing import device_name

    if dev.type == "cuda":
        torch.zeros(1, device=dev)
    run = Run(a.out, "tok11.json", a.budget, {"device": device_name(dev), "torch": torch.__version__,
                                              "triton": triton.__version__, "commit": a.commit, "args": vars(a)})
    box, labels = {}, parts(a)
    th = None
    if a.jobs:
        a.prove_dir = tempfile.mkdtemp(prefix="tok11-prove-")
        args = list(sys.argv[1:]) + ["--prove-dir", a.prove_dir]

        def go():
            box["info"] = parallel_warmup(os.path.abspath(__file__), args, a.jobs, min(a.warm_s, run.left() - 60),
                                          parts=labels)
        th = threading.Thread(target=go)
        th.start()
    log("trained indexer (variants proven in child processes meanwhile)")
    ix, kl, gen = trained_indexer(dev, 0, a.index[0], a.index[1], a.train_steps)
    run.res["trained_indexer_kl"] = kl
    if th is not None:
        th.join()
        done = read_proven(a)
        run.res["prove"] = {"info": box.get("info"), "results": done}
        ok32 = {lab for lab, _ in a.cand if done.get(f"{lab}@{a.L32}", {}).get("ok")}
        ok128 = {lab for lab, _ in a.cand if done.get(f"{lab}@{a.L128}", {}).get("ok")}
    else:
        ok32 = ok128 = {lab for lab, _ in a.cand}
    log(f"proven 32K {sorted(ok32)} 128K {sorted(ok128)}; prove results "
        f"{ {k: (v.get('ok'), v.get('rows_differing'), v.get('err')) for k, v in run.res.get('prove', {}).get('results', {}).items()} }")
    run.save()
    W = dict(warmup_ms=5, rep_ms=a.rep_ms)
    labs = [lab for lab, _ in a.cand]
    res = run.res
    res["token"] = []
    idx32 = patterns.trained_index(ix, a.L32, dev, gen)
    if run.gate(20, "32K trained"):
        res["token"].append(run.guarded("32K trained", token_phase, a, run, "L32 trained", idx32, dev, W,
                                        TRAINED32[a.call] or labs, ok32))
        run.save()
    if run.gate(20, "32K random"):
        rnd = random_index(a, a.L32, dev, gen)
        res["token"].append(run.guarded("32K random", token_phase, a, run, "L32 random", rnd, dev, W,
                                        [x for x in labs if x in RANDOM32[a.call]], ok32))
        del rnd
        run.save()
    if run.gate(30, "128K random"):
        rnd = random_index(a, a.L128, dev, gen)
        W128 = dict(warmup_ms=1, rep_ms=a.rep_ms)
        res["token"].append(run.guarded("128K random", token_phase, a, run, "L128 random", rnd, dev, W128,
                                        CAND128[a.call], ok128))
        del rnd
        run.save()
    best = best_label(res["token"][0] if res["token"] else None)
    if best and run.gate(20, "prefill 32K"):
        res["prefill"] = run.guarded("prefill", prefill, a, run, idx32, dev, W, best)
        run.save()
    if L16[a.call] and run.gate(15, "16K"):  # where auto's cand / bin boundary goes
        for kind in ("trained", "random"):
            ix16 = (patterns.trained_index(ix, a.L16, dev, gen) if kind == "trained"
                    else random_index(a, a.L16, dev, gen))
            res["token"].append(run.guarded(f"16K {kind}", token_phase, a, run, f"L16 {kind}", ix16, dev, W,
                                            L16[a.call], ok32))
            del ix16
            run.save()
    if run.gate(25, "128K trained"):  # no bin here (132 ms a call in session 10): rows against the default's
        idx128 = patterns.trained_index(ix, a.L128, dev, gen)
        res["token"].append(run.guarded("128K trained", token_phase, a, run, "L128 trained", idx128, dev,
                                        dict(warmup_ms=1, rep_ms=a.rep_ms), TRAINED128[a.call], ok128,
                                        with_auto=False))
        del idx128
        run.save()
    run.save()
    print("== tok11 summary ==")
    for t in res["token"]:
        if t:
            print(t["name"], "sweep", round(t["sweep_ms"], 3), "times", {k: round(v, 3) for k, v in t["times"].items()
                                                                       if v}, "equal", t["equal_bin"])
            for k, v in t["phases"].items():
                print("  ", k, v, t["info"].get(k))
    print("prefill:", res.get("prefill"))
    print("skipped:", res.get("skipped"), "errors:", res.get("errors"))


if __name__ == "__main__":
    main()
