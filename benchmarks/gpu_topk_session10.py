"""Issue 15 item 1, session 10: the prefill indexer top-k from a sampled quantile threshold and one compacting
score sweep (`cand_topk.py`, `topk_impl="cand"`) against the materialising `auto` (bin_topk) and the score sweep
alone, on the H200, one device call of <= 150 s.

Phases, highest value first, each gated on the time LEFT of --budget (partial JSON after each):
0. every variant proven in child processes on 64 real-length rows (the timed Triton specialisations: S = 32K /
   128K, K = 2048, every integer a multiple of 16) against the torch reference, compiling into the on-disk cache
   while the parent trains the indexer (bench/patterns.py, as sessions 6-9);
1. 32K trained: the sweep alone (streamed row max), auto (bin) rows and time, each cand variant's rows == auto's,
   time, phases (threshold = sample + quantile, gather, select), buffer entries and rows redone;
2. 32K random: the same;
3. 128K random (trained if time): sweep alone, cand default, auto;
4. end to end: token-level prefill at 32K (cand default + sparse attention) against dense cuDNN SDPA;
5. extras: the old stream path at 32K trained.

    PYTHONPATH=$PWD python benchmarks/gpu_topk_session10.py --budget 140 --commit <sha>
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/gpu_topk_session10.py --cpu-smoke --budget 900 --jobs 2
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

# (label, CandConfig overrides); the first is the default
OLD = {"redo": "tiles", "target": 1.3}  # CandConfig's defaults in calls 1 and 2 (labels keep their meaning)
CAND = {1: [("cand", {}), ("cand-zgrid", {"threshold": "zgrid", "target": 1.5}), ("cand-E1.15", {"target": 1.15}),
            ("cand-sel4w", {"select_warps": 4})],
        2: [("cand", {}), ("cand-dec", {"redo": "decode"}), ("cand-dec-E1.5", {"redo": "decode", "target": 1.5}),
            ("cand-pk", {"redo": "decode", "packed": True}),
            ("cand-pkdot", {"redo": "decode", "packed": True, "dot_scan": True}),
            ("cand-dot", {"redo": "decode", "dot_scan": True}),
            ("cand-pk-4w", {"redo": "decode", "packed": True, "select_warps": 4}),
            ("cand-pk-s8k", {"redo": "decode", "packed": True, "sample_lanes": 8192, "quantile_warps": 8}),
            ("cand-pk-q16", {"redo": "decode", "packed": True, "quantile_bits": 16})]}
CAND128 = {1: ["cand"], 2: ["cand-pk", "cand-pk-q16", "cand-pk-s8k", "cand-dec", "cand-pkdot", "cand-dec-E1.5"]}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tok10"))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--budget", type=float, default=140.0, help="seconds of script time; phases gate on time left")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU through the interpreter")
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--rep-ms", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=8, help="warm-up child processes (0: none)")
    ap.add_argument("--warm-s", type=float, default=45.0)
    ap.add_argument("--call", type=int, default=2, choices=(1, 2), help="which device call's variant lists")
    ap.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prove-dir", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.cand = CAND[a.call]
    a.shape, a.index, a.sink, a.window = [1, 32, 8, 128, 2048], [4, 64], 4, 64
    a.L32, a.L128 = 32768, 131072
    if a.cpu_smoke:
        a.shape, a.index, a.sink, a.window, a.train_steps, a.rep_ms = [1, 4, 1, 32, 16], [2, 16], 2, 4, 3, 1
        a.L32, a.L128 = 96, 160
    return a


def cand_cfg(a, over: dict):
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import INTERPRET_CAND, CandConfig

    return dataclasses.replace(INTERPRET_CAND if a.cpu_smoke else CandConfig(), **{**OLD, **over})


def cand_fn(a, over: dict, info=None):
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import indexer_topk_cand

    cfg = cand_cfg(a, over)
    K = a.shape[4]
    return lambda qi, wi, ki: indexer_topk_cand(qi, wi, ki, K, sink=a.sink, window=a.window, config=cfg, info=info)


def impl_fn(a, impl: str):
    from sparse_rl.sparse.ops.indexer_topk import triton as tri

    return lambda qi, wi, ki: tri.indexer_topk(qi, wi, ki, a.shape[4], sink=a.sink, window=a.window, topk_impl=impl)


def parts(a) -> list[str]:
    return [f"{lab}@{L}" for lab, _ in a.cand for L in (a.L32, a.L128)] + [f"auto@{a.L32}", f"stream@{a.L32}"]


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
        if name.startswith("cand"):
            got = indexer_topk_cand(q, w, k, K, config=cand_cfg(a, dict(a.cand)[name]), **kw)
        else:
            got = tri.indexer_topk(q, w, k, K, topk_impl=name, **kw)
        # the same score kernel's rows (radix select on materialised scores): bf16 scores tie-break as theirs
        ref = tri.indexer_topk(q, w, k, K, topk_impl="radix", **kw)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        res["rows_differing"] = int((got != ref).any(-1).sum())
        res["ok"] = res["rows_differing"] == 0 or name == "stream"  # stream: timed for reference only
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


def cand_phases(a, qi, wi, ki, over: dict, dev, W: dict) -> dict:
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
    return r


def token_phase(a, run: Run, name: str, index, dev, W: dict, labels: list[str], ok: set, with_auto=True) -> dict:
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk.stream import indexer_row_max

    qi, wi, ki = index
    res = {"name": name, "times": {}, "equal_auto": {}, "info": {}, "phases": {}}
    res["sweep_ms"] = bench_ms(lambda: indexer_row_max(qi, wi, ki), dev, **W)
    log(f"{name} sweep alone {res['sweep_ms']:.3f} ms")
    ref = None
    if with_auto and run.gate(12, f"{name} auto"):
        ref = impl_fn(a, "auto")(qi, wi, ki)
        res["times"]["auto"] = bench_ms(lambda: impl_fn(a, "auto")(qi, wi, ki), dev, **W)
        log(f"{name} auto (bin) {res['times']['auto']:.3f} ms")
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
        if ref is not None:
            res["equal_auto"][lab] = bool(torch.equal(got, ref))
            res.setdefault("rows_differing", {})[lab] = int((got != ref).any(-1).sum())
        del got
        res["times"][lab] = run.guarded(f"{name} {lab} time", bench_ms, lambda: cand_fn(a, over)(qi, wi, ki), dev, **W)
        if run.left() > 8:
            res["phases"][lab] = run.guarded(f"{name} {lab} phases", cand_phases, a, qi, wi, ki, over, dev, W)
        log(f"{name} {lab}: {res['times'][lab]} ms, equal auto {res['equal_auto'].get(lab)}, info {info}, "
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
    sel = ((lambda: cand_fn(a, dict(a.cand)[impl])(qi, wi, ki)) if impl.startswith("cand")
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
    ok = [(t, lab) for lab, t in tok["times"].items() if lab != "auto" and t and tok["equal_auto"].get(lab)]
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
    run = Run(a.out, "tok10.json", a.budget, {"device": device_name(dev), "torch": torch.__version__,
                                              "triton": triton.__version__, "commit": a.commit, "args": vars(a)})
    box, labels = {}, parts(a)
    th = None
    if a.jobs:
        a.prove_dir = tempfile.mkdtemp(prefix="tok10-prove-")
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
        res["token"].append(run.guarded("32K trained", token_phase, a, run, "L32 trained", idx32, dev, W, labs, ok32))
        run.save()
    if run.gate(20, "32K random"):
        rnd = random_index(a, a.L32, dev, gen)
        res["token"].append(run.guarded("32K random", token_phase, a, run, "L32 random", rnd, dev, W,
                                        labs[:2] if a.call == 1 else labs[1:], ok32))
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
    if run.gate(30, "128K trained"):
        idx128 = patterns.trained_index(ix, a.L128, dev, gen)
        res["token"].append(run.guarded("128K trained", token_phase, a, run, "L128 trained", idx128, dev,
                                        dict(warmup_ms=1, rep_ms=a.rep_ms), CAND128[a.call][:2], ok128,
                                        with_auto=a.call == 2))
        del idx128
        run.save()
    if run.gate(12, "stream 32K trained"):
        from sparse_rl.bench.timing import bench_ms

        res["stream32_trained_ms"] = run.guarded("stream", bench_ms, lambda: impl_fn(a, "stream")(*idx32), dev, **W)
        run.save()
    run.save()
    print("== tok10 summary ==")
    for t in res["token"]:
        if t:
            print(t["name"], "sweep", round(t["sweep_ms"], 3), "times", {k: round(v, 3) for k, v in t["times"].items()
                                                                       if v}, "equal", t["equal_auto"])
            for k, v in t["phases"].items():
                print("  ", k, v, t["info"].get(k))
    print("prefill:", res.get("prefill"))
    print("stream32 trained:", res.get("stream32_trained_ms"))
    print("skipped:", res.get("skipped"), "errors:", res.get("errors"))


if __name__ == "__main__":
    main()
