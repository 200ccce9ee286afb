"""One device call (<= 200 s of script time) for issue 15, session 8: the tile backward of the shared-rows
(query-group) sparse attention, its key-major dk/dv pass in two forms, and the forward tile's launch.

    PYTHONPATH=$PWD python benchmarks/gpu_granular_session8.py --budget 200            # call 1 (--part 1)
    PYTHONPATH=$PWD python benchmarks/gpu_granular_session8.py --budget 200 --part 2   # call 2
    PYTHONPATH=$PWD python benchmarks/gpu_granular_session8.py --cpu-smoke             # CPU rehearsal

Why (benchmarks/NOTES.md items 9, 14; session 7): fwd+bwd at 32K is 32.8-35.8 ms against a 4.4 ms forward.
Compiling the kernels for sm_90a with Triton 3.6 on the CPU host shows why the key-major dk/dv pass is
the slow term: with 32 keys in the MMA's M dimension Triton cannot use wgmma, so it runs mma.sync with
every operand in registers (255 registers, spills at 64 and 128 rows), while the forward and dq passes
use wgmma. keymajor.py's "dt" form accumulates dk^T / dv^T `[D, BN]` so every MMA has M >= 64.

Part 1 (call 1), each phase gated on the time left of --budget:
1. parallel warm-up: the variants below compiled in child processes on 1024-query inputs (same Triton
   specialisation as 32K), while the parent checks;
2. checks (bf16, 32/8 heads, D 128): out, lse and q/k/v gradients of each dk/dv form against the fp32
   reference over the per-query rows, query groups 16 and 32 on run-shaped selections (1024 queries),
   and 1000 queries (partial tiles), and a per-query selection through the union tiles; the delta kernel
   against the torch form;
3. 32K trained-indexer input (bench/patterns.py, as sessions 6-7), rows for g16 / g32 / g64, dense cuDNN;
4. per spec (g16: 64-row tiles, g32: 128-row tiles): the backward's parts alone (delta torch / kernel,
   key-tile lists per BN, dq launches, dk/dv forms and launches, each checked against the session-7
   form), then fwd+bwd end to end with the default and with the fastest parts, and a per-kernel
   CUDA profile of both;
5. forward launch sweep per tile height; g64 fwd+bwd with the fastest parts.
Part 2 (call 2): the final defaults end to end (prefill and fwd+bwd, 32K and 128K as the budget allows).
Writes $OUT/gran8/granular8.json and prints a short summary.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

if "--cpu-smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from granular_harness import Run, dense_times, kernel_profile, log, parallel_warmup, trained_indexer  # noqa: E402

import torch  # noqa: E402

# dk/dv (BLOCK_N, warps, stages, form), dq (BLOCK_K, warps, stages), fwd (BLOCK_K, warps, stages) per tile rows
DKDV = {64: [(32, 4, 2, "rows"), (32, 4, 2, "dt"), (16, 4, 2, "dt"), (32, 8, 2, "dt"), (64, 8, 2, "dt"),
             (32, 8, 2, "dt2"), (16, 8, 2, "dt"), (32, 4, 3, "dt"), (16, 4, 3, "dt"), (64, 4, 2, "dt")],
        128: [(32, 4, 2, "rows"), (32, 8, 2, "dt"), (16, 4, 2, "dt"), (16, 8, 2, "dt"), (32, 4, 2, "dt"),
              (64, 8, 2, "dt"), (32, 8, 2, "dt2"), (16, 4, 3, "dt")]}
DQ = {64: [(32, 4, 2), (64, 4, 2), (64, 8, 2), (32, 4, 3), (16, 4, 2)],
      128: [(32, 4, 2), (64, 8, 2), (32, 8, 2), (16, 4, 2)]}
FWD = {64: [(64, 4, 2), (64, 4, 3), (32, 4, 2), (128, 4, 2), (64, 8, 2), (32, 4, 3), (128, 8, 3)],
       128: [(32, 4, 2), (64, 8, 2), (32, 8, 2), (64, 4, 2), (32, 4, 3), (128, 8, 2)]}
CHECK_FORMS = [(32, 4, 2, "rows"), (32, 4, 2, "dt"), (16, 4, 2, "dt"), (64, 8, 2, "dt"), (32, 8, 2, "dt2")]
SPEC_ROWS = {"g16": 64, "g32": 128, "g64": 128}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gran8"))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--budget", type=float, default=200.0, help="seconds of script time; phases gate on time left")
    ap.add_argument("--part", type=int, default=1, choices=[1, 2])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU through the interpreter")
    ap.add_argument("--seqlen", type=int, default=32768, help="part 1's length")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072], help="part 2's lengths")
    ap.add_argument("--shape", type=int, nargs=5, default=[1, 32, 8, 128, 2048], metavar=("B", "H", "H_KV", "D", "K"))
    ap.add_argument("--index", type=int, nargs=2, default=[4, 64], metavar=("H_I", "D_I"))
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--check-T", type=int, default=1024, help="a multiple of 16 x 64: the timed specialisation")
    ap.add_argument("--check-topk", type=int, default=256)
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--rep-ms", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=8, help="warm-up child processes (0: none)")
    ap.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        a.seqlen, a.shape, a.index, a.check_T, a.check_topk = 256, [1, 8, 2, 16, 64], [2, 16], 128, 48
        a.seqlens = [256]
        a.train_steps, a.rep_ms, a.window, a.jobs = 3, 1, 16, min(a.jobs, 1)
    return a


def run_rows(NG: int, G: int, S: int, K: int, sink: int, window: int, gen, dev, q_off: int = 0):
    """Shared rows `[1, NG, K]` shaped like a trained selection: the sink, the window, then random runs of
    ~12 keys (each run one score) among the keys the group's last query sees; ascending, -1 padded."""
    brk = torch.rand(S, device=dev, generator=gen) < 1 / 12
    run_id = torch.cumsum(brk.long(), 0)
    score = torch.rand(NG, int(run_id[-1]) + 1, device=dev, generator=gen)[:, run_id]
    keys = torch.arange(S, device=dev)
    last = (torch.arange(NG, device=dev) * G + G - 1 + q_off)[:, None]
    score = score + 2.0 * ((keys < sink) | (keys > last - window))
    score = score.masked_fill(keys > last, -1.0)
    vals, idx = score.topk(min(K, S), -1)
    idx = torch.where(vals >= 0, idx, S).sort(-1).values  # ascending, the unused slots last
    return torch.where(idx == S, -1, idx).to(torch.int32)[None]


def pieces(q, k, v, rows, G: int, scale: float):
    """(sel with bits, o, lse, prec) of the shared-rows forward for the backward's parts."""
    from sparse_rl.sparse.ops.sparse_attention import union
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

    BT = min(union.tile_queries(q.shape[2] // k.shape[2]), G)
    sel = union.shared_tiles(rows, k.shape[1], G, BT, 0, bits=True)
    prec = dot_precision(q.dtype)
    o, lse = union.tile_fwd(q, k, v, sel, scale, prec)
    return sel, o, lse, prec


def warm_items(a) -> list[tuple]:
    items = []
    for spec, BM in (("g16", 64), ("g32", 128)):
        items += [(spec, "dkdv", t) for t in DKDV[BM]] + [(spec, "dq", t) for t in DQ[BM]]
        items += [(spec, "fwd", t) for t in FWD[BM]]
    items += [("kb1", "dkdv", t) for t in ((32, 4, 2, "rows"), (32, 4, 2, "dt"))]
    return sorted(items, key=lambda x: x[1] != "dkdv")  # the dk/dv variants first: they decide the design


def warm(a, dev, part: str) -> None:
    """Child process: run this part's (spec, pass, tune) items on 1024-query inputs (compiles only)."""
    from sparse_rl.sparse.ops.sparse_attention import keymajor, union

    i, n = (int(x) for x in part.split("/"))
    B, H, Hkv, D, _ = a.shape
    T, K = a.check_T, a.check_topk
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(torch.bfloat16)  # noqa: E731
    q, k, v, do = rnd(B, T, H, D), rnd(B, T, Hkv, D), rnd(B, T, Hkv, D), rnd(B, T, H, D)
    scale = 1 / math.sqrt(D)
    cache = {}
    items = warm_items(a)[i::n]
    for spec, what, tune in items[:3] if a.cpu_smoke else items:
        if spec not in cache:
            if spec == "kb1":
                from sparse_rl.sparse.ops import shared_to_per_query
                per = shared_to_per_query(run_rows(T // 16, 16, T, K, a.sink, a.window, gen, dev), 16, T)
                sel = union.build_union(per, T, union.tile_queries(H // Hkv))
                o, lse = union.tile_fwd(q, k, v, sel, scale, 0)
                cache[spec] = (sel, o, lse, 0)
            else:
                G = int(spec[1:])
                cache[spec] = pieces(q, k, v, run_rows(T // G, G, T, K, a.sink, a.window, gen, dev), G, scale)
        sel, o, lse, prec = cache[spec]
        delta = keymajor.bwd_delta(o, do, torch.zeros_like(lse))
        if what == "fwd":
            union.tile_fwd(q, k, v, sel, scale, prec, tune=tune)
        elif what == "dq":
            union.tile_dq(q, k, v, sel, do, lse, delta, scale, prec, tune=tune)
        else:
            keymajor.key_major_dkdv(q, k, v, sel, do, lse, delta, scale, prec, tune=tune)
    if dev.type == "cuda":
        torch.cuda.synchronize()


def grad_check(q, k, v, rows, G: int, go, tune, per=None) -> dict:
    """sparse_attention (shared rows when G > 1, else per-query rows through the union tiles) with the dk/dv
    launch `tune` against the fp32 reference over the per-query rows: relative errors of out, dq, dk, dv."""
    from sparse_rl.bench.timing import rel_err
    from sparse_rl.sparse.ops import shared_to_per_query
    from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention

    T = q.shape[1]
    per = shared_to_per_query(rows, G, T) if G > 1 else rows
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    kw = {"query_group": G} if G > 1 else {"fwd_path": "tile", "bwd_path": "tile"}
    o, lse = sparse_attention(qs, ks, vs, rows, tune={"dkdv": tune}, **kw)
    (o.float() * go.float()).sum().backward()
    qr, kr, vr = (x.detach().float().clone().requires_grad_() for x in (q, k, v))
    ro, rl = sparse_attention_naive(qr, kr, vr, per)
    (ro * go.float()).sum().backward()
    fin = torch.isfinite(rl)
    r = {"out": rel_err(o.detach(), ro.detach()), "dq": rel_err(qs.grad, qr.grad), "dk": rel_err(ks.grad, kr.grad),
         "dv": rel_err(vs.grad, vr.grad), "lse_max_abs": float((lse.detach()[fin] - rl.detach()[fin]).abs().max()),
         "finite": bool(torch.isfinite(ks.grad).all() and torch.isfinite(vs.grad).all() and torch.isfinite(qs.grad).all())}
    r["ok"] = r["finite"] and max(r[x] for x in ("out", "dq", "dk", "dv")) < 2e-2 and r["lse_max_abs"] < 2e-2
    return r


def checks(a, dev, run: Run) -> list[dict]:
    from sparse_rl.bench.timing import rel_err
    from sparse_rl.sparse.ops import shared_to_per_query
    from sparse_rl.sparse.ops.sparse_attention import keymajor

    B, H, Hkv, D, _ = a.shape
    K = a.check_topk
    gen = torch.Generator(device=dev).manual_seed(1)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out = []
    for T, specs, forms in ((a.check_T, ("g16", "g32"), CHECK_FORMS), (a.check_T - 24, ("g16",), CHECK_FORMS[2:3])):
        rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dt)  # noqa: E731
        q, k, v, go = rnd(B, T, H, D), rnd(B, T, Hkv, D), rnd(B, T, Hkv, D), rnd(B, T, H, D)
        for spec in specs:
            G = int(spec[1:])
            rows = run_rows(-(-T // G), G, T, K, a.sink, a.window, gen, dev)
            for tune in forms:
                if not run.gate(20, f"check {spec} T={T} {tune}"):
                    return out
                r = {"T": T, "spec": spec, "tune": list(tune), **grad_check(q, k, v, rows, G, go, tune)}
                out.append(r)
                log(str(r))
        if T == a.check_T:  # per-query rows (session 7's kb16-like path: union tiles, not shared)
            per = shared_to_per_query(run_rows(T // 16, 16, T, K, a.sink, a.window, gen, dev), 16, T)
            for tune in ((32, 4, 2, "rows"), (32, 4, 2, "dt")):
                if run.gate(20, f"check per-query {tune}"):
                    r = {"T": T, "spec": "per-query", "tune": list(tune), **grad_check(q, k, v, per, 1, go, tune)}
                    out.append(r)
                    log(str(r))
            o, dlse = rnd(B, T, H, D), torch.randn(B, T, H, device=dev, generator=gen)
            ref = (o.float() * go.float()).sum(-1) - dlse
            e = rel_err(keymajor.bwd_delta(o, go, dlse), ref)
            out.append({"T": T, "spec": "delta", "rel_err": e, "ok": e < 1e-5})
    return out


def bwd_parts(a, dev, run: Run, spec: str, q, k, v, rows, pairs: int, W: dict) -> dict:
    """The backward's parts alone for one spec (module doc, part 1 phase 4)."""
    from sparse_rl.bench.timing import bench_ms, rel_err
    from sparse_rl.sparse.ops.sparse_attention import keymajor, union

    B, H, Hkv, D, _ = a.shape
    L = q.shape[1]
    G = int(spec[1:])
    BM = SPEC_ROWS[spec]
    scale = 1 / math.sqrt(D)
    sel, o, lse, prec = pieces(q, k, v, rows, G, scale)
    do = torch.randn_like(q)
    dlse = torch.zeros_like(lse)
    res = {"spec": spec, "tile_rows": BM, "pairs": pairs}
    res["delta_torch_ms"] = bench_ms(lambda: ((o.float() * do.float()).sum(-1) - dlse).contiguous(), dev, **W)
    res["delta_kernel_ms"] = bench_ms(lambda: keymajor.bwd_delta(o, do, dlse), dev, **W)
    delta = keymajor.bwd_delta(o, do, dlse)
    res["delta_rel_err"] = rel_err(delta, (o.float() * do.float()).sum(-1))
    res["lists"] = {}
    for BN in (16, 32, 64):
        nnz = keymajor.key_tile_lists(sel, L, L, BN)[2]
        res["lists"][BN] = {"touched_pairs": nnz, "ms": bench_ms(lambda: keymajor.key_tile_lists(sel, L, L, BN), dev, **W)}
    run.save()
    fwd_flop = 4.0 * pairs * H * D
    res["dq"] = []
    for tune in DQ[BM]:
        if not run.gate(25, f"{spec} dq {tune}"):
            break
        ms = bench_ms(lambda: union.tile_dq(q, k, v, sel, do, lse, delta, scale, prec, tune=tune), dev, **W)
        res["dq"].append({"tune": list(tune), "ms": ms, "tflops_selected": 1.5 * fwd_flop / ms / 1e9})
        log(f"{spec} dq {tune}: {ms:.3f} ms")
    base = None
    res["dkdv"] = []
    for tune in DKDV[BM]:
        if not run.gate(25, f"{spec} dkdv {tune}"):
            break
        fn = lambda: keymajor.key_major_dkdv(q, k, v, sel, do, lse, delta, scale, prec, tune=tune)  # noqa: E731
        got = fn()
        if base is None:
            base = got
        span = tune[0] * (2 if tune[3] == "dt2" else 1)  # keys per program; dt2 multiplies on 32-key halves
        lists = {bn: res["lists"].get(bn) or {"touched_pairs": keymajor.key_tile_lists(sel, L, L, bn)[2], "ms": 0.0}
                 for bn in {span, tune[0]}}
        ms = bench_ms(fn, dev, **W)
        kern = max(1e-6, ms - lists[span]["ms"])
        r = {"tune": list(tune), "ms": ms, "kernel_ms_est": kern, "touched_pairs": lists[span]["touched_pairs"],
             "dk_vs_first": rel_err(got[0], base[0]), "dv_vs_first": rel_err(got[1], base[1]),
             "mma_tflops_touched": 8.0 * lists[tune[0]]["touched_pairs"] * Hkv * tune[0] * BM * D / kern / 1e9,
             "tflops_selected": 2.0 * fwd_flop / kern / 1e9,
             "q_do_gbytes": lists[span]["touched_pairs"] * Hkv * BM * D * 4 / 1e9}
        r["q_do_tbps"] = r["q_do_gbytes"] / kern
        res["dkdv"].append(r)
        log(f"{spec} dkdv {tune}: {ms:.3f} ms (lists {lists[span]['ms']:.3f}), dk err vs first {r['dk_vs_first']:.2e}")
        del got
        run.save()
    ok = [r for r in res["dkdv"] if max(r["dk_vs_first"], r["dv_vs_first"]) < 1e-2]
    res["best_dkdv"] = min(ok, key=lambda r: r["ms"])["tune"] if ok else list(DKDV[BM][0])
    res["best_dq"] = min(res["dq"], key=lambda r: r["ms"])["tune"] if res["dq"] else list(DQ[BM][0])
    return res


def fwdbwd(q, k, v, rows, G: int, grad, dev, W: dict, tune: dict | None, profile: bool) -> dict:
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention

    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    fn = lambda: sparse_attention(qg, kg, vg, rows, query_group=G, tune=tune)[0].backward(grad)  # noqa: E731
    r = {"tune": {x: list(y) for x, y in (tune or {}).items()}, "fwdbwd_ms": bench_ms(fn, dev, grad_to_none=[qg, kg, vg], **W)}
    if profile:
        r["profile_ms"] = kernel_profile(fn, dev)
    return r


def fwd_sweep(q, k, v, rows, G: int, BM: int, dev, W: dict, run: Run, pairs: int) -> list[dict]:
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention_forward

    out = []
    for tune in FWD[BM]:
        if not run.gate(15, f"fwd g{G} {tune}"):
            break
        ms = bench_ms(lambda: sparse_attention_forward(q, k, v, rows, query_group=G, tune={"fwd": tune}), dev, **W)
        out.append({"tune": list(tune), "ms": ms, "tflops_selected": 4.0 * pairs * q.shape[2] * q.shape[3] / ms / 1e9})
        log(f"fwd g{G} {tune}: {ms:.3f} ms")
    return out


def part1(a, dev, run: Run) -> None:
    from sparse_rl.bench import patterns
    from sparse_rl.sparse.ops import granular_topk, shared_to_per_query

    res = run.res
    warm_proc = None
    if a.jobs:
        import threading

        box = {}
        warm_proc = threading.Thread(target=lambda: box.update(parallel_warmup(
            os.path.abspath(__file__), sys.argv[1:], a.jobs, min(90.0, run.left() - 60))))
        warm_proc.start()
    log("checks: the dk/dv forms' gradients vs the fp32 reference")
    res["checks"] = run.guarded("checks", checks, a, dev, run) or []
    res["checks_ok"] = bool(res["checks"]) and all(c["ok"] for c in res["checks"])
    run.save()
    if warm_proc is not None:
        warm_proc.join()
        res["warmup"] = box
        log(f"warm-up {box}")
    B, H, Hkv, D, K = a.shape
    HI, DI = a.index
    L = a.seqlen
    W = dict(warmup_ms=5, rep_ms=a.rep_ms)
    if not run.gate(60, "32K phases"):
        return
    log("trained indexer + 32K inputs + dense")
    ix, res["trained_indexer_kl"], gen = trained_indexer(dev, 0, HI, DI, a.train_steps)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dt)  # noqa: E731
    q, k, v = rnd(B, L, H, D), rnd(B, L, Hkv, D), rnd(B, L, Hkv, D)
    grad = torch.randn_like(q)
    index = patterns.trained_index(ix, L, dev, gen)
    rows = {s: granular_topk(*index, K, sink=a.sink, window=a.window, query_group=int(s[1:]), shared=True,
                             backend="triton") for s in SPEC_ROWS}
    pairs = {s: int((shared_to_per_query(r, int(s[1:]), L) >= 0).sum()) for s, r in rows.items()}
    res["pairs"] = pairs
    res["dense"] = dense_times(q, k, v, dev, W, backward=True)
    log(f"dense {res['dense']}")
    run.save()
    res["parts"], res["fwdbwd"], res["fwd"] = {}, {}, {}
    for spec in ("g16", "g32"):
        if not run.gate(45, f"{spec} backward parts"):
            continue
        p = run.guarded(f"{spec} parts", bwd_parts, a, dev, run, spec, q, k, v, rows[spec], pairs[spec], W)
        if p is None:
            continue
        res["parts"][spec] = p
        run.save()
        G = int(spec[1:])
        fb = {}
        for name, tune in (("default", None), ("best", {"dq": tuple(p["best_dq"]), "dkdv": tuple(p["best_dkdv"])})):
            if run.gate(12, f"{spec} fwd+bwd {name}"):
                fb[name] = run.guarded(f"{spec} fwdbwd {name}", fwdbwd, q, k, v, rows[spec], G, grad, dev, W, tune,
                                       profile=True)
                if fb[name]:
                    fb[name]["speedup"] = res["dense"]["dense_fwdbwd_ms"] / fb[name]["fwdbwd_ms"]
                    log(f"{spec} fwd+bwd {name}: {fb[name]['fwdbwd_ms']:.2f} ms ({fb[name]['speedup']:.2f}x)")
        res["fwdbwd"][spec] = fb
        run.save()
    for spec in ("g16", "g32"):
        if run.gate(20, f"{spec} fwd sweep"):
            res["fwd"][spec] = run.guarded(f"{spec} fwd", fwd_sweep, q, k, v, rows[spec], int(spec[1:]),
                                           SPEC_ROWS[spec], dev, W, run, pairs[spec])
            run.save()
    best = res["parts"].get("g32")
    if best and run.gate(10, "g64 fwd+bwd best"):
        tune = {"dq": tuple(best["best_dq"]), "dkdv": tuple(best["best_dkdv"])}
        for name, t in (("default", None), ("best", tune)):
            r = run.guarded("g64 fwdbwd", fwdbwd, q, k, v, rows["g64"], 64, grad, dev, W, t, profile=False)
            if r:
                r["speedup"] = res["dense"]["dense_fwdbwd_ms"] / r["fwdbwd_ms"]
                res["fwdbwd"].setdefault("g64", {})[name] = r
        run.save()


SPECS2 = ("g16", "g32", "g64", "kb1", "kb16")


def warm2(a, dev, part: str) -> None:
    """Child process of part 2: the default selection and attention fwd+bwd of each spec on 1024 positions."""
    from sparse_rl.sparse.ops import granular_topk, indexer_topk
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention

    i, n = (int(x) for x in part.split("/"))
    B, H, Hkv, D, _ = a.shape
    HI, DI = a.index
    T, K = a.check_T, a.check_topk
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(torch.bfloat16)  # noqa: E731
    index = (rnd(B, T, HI, DI), torch.rand(B, T, HI, device=dev, generator=gen).to(torch.bfloat16), rnd(B, T, DI))
    for spec in SPECS2[i::n]:
        kb, G = (int(spec[2:]), 1) if spec.startswith("kb") else (1, int(spec[1:]))
        kw = dict(sink=a.sink, window=a.window)
        if kb == G == 1:
            rows = indexer_topk(*index, K, backend="triton", **kw)
        else:
            rows = granular_topk(*index, K, key_block=kb, query_group=G, shared=G > 1, backend="triton", **kw)
        qs, ks, vs = (x.requires_grad_() for x in (rnd(B, T, H, D), rnd(B, T, Hkv, D), rnd(B, T, Hkv, D)))
        o, _ = sparse_attention(qs, ks, vs, rows, **({"query_group": G} if G > 1 else {}))
        o.float().sum().backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()


def sampled_stats(index, K: int, a, dev, G: int = 16) -> dict:
    """The sampled block top-k's per-row path (sampled_topk's stats) on one input's g-G block scores: the
    share of rows per path, by decile of the visible prefix, and for the rows that fell back the number of
    block scores tied with the row's k-th best (the tie hypothesis of NOTES item 14)."""
    from sparse_rl.sparse.ops.indexer_topk import granular as gr
    from sparse_rl.sparse.ops.indexer_topk.naive import group_plan, rep_queries
    from sparse_rl.sparse.ops.indexer_topk.sampled_topk import sampled_topk

    qi, wi, ki = index
    L = qi.shape[1]
    start, _, ev_pos, ev_rep, _, q_all, w_all, j = group_plan(qi, wi, 0, None, G, None)
    qr, wr = rep_queries(q_all, w_all, j)
    nb = K - (G - 1) - a.sink - a.window
    x = gr.block_keys(qr, wr, ki, ev_rep, start, L, keys=False, key_block=1, sink=a.sink, window=a.window,
                      block_score="max")
    R = x.shape[0] * x.shape[1]
    st = torch.empty(R, 2, dtype=torch.int32, device=dev)
    got = sampled_topk(x, nb, stats=st)
    same = bool(torch.equal(got.long(), gr.top_blocks(x, nb, "radix")))
    code, cnt = st[:, 0].long(), st[:, 1].long()
    live = (x > float("-inf")).sum(-1).flatten()
    dec = (torch.arange(R, device=dev) * 10 // R)
    res = {"rows": R, "blocks_kept": nb, "rows_equal_radix": same,
           "path_share": {str(c): float((code == c).double().mean()) for c in range(4)},
           "path_share_by_decile": [[float((code[dec == d] == c).double().mean()) for c in range(4)] for d in range(10)],
           "count_quantiles": [int(v) for v in torch.quantile(cnt.double(), torch.tensor([.1, .5, .9], dtype=torch.float64,
                                                                                           device=dev)).tolist()],
           "live_quantiles": [int(v) for v in torch.quantile(live.double(), torch.tensor([.1, .5, .9], dtype=torch.float64,
                                                                                           device=dev)).tolist()]}
    fb = (code >= 2).nonzero().flatten()[:256]
    if fb.numel():
        xs = x.reshape(R, -1)[fb]
        kth = xs.topk(nb, -1).values[:, -1:]
        full = kth[:, 0] > float("-inf")  # rows with >= k live blocks (else the k-th is -inf: no tie to count)
        ties = ((xs == kth) & full[:, None]).sum(-1).double()[full]
        res["fallback_rows_with_k_live"] = float(full.double().mean())
        if ties.numel():
            res["fallback_ties_at_kth"] = {"median": float(ties.median()), "max": float(ties.max()),
                                           "kth_zero_share": float((kth[full] == 0).double().mean())}
    return res


def part2(a, dev, run: Run) -> None:
    from sparse_rl.bench import patterns
    from sparse_rl.bench.granular import granular_rows

    res = run.res
    box, th = {}, None
    if a.jobs:
        import threading

        th = threading.Thread(target=lambda: box.update(parallel_warmup(
            os.path.abspath(__file__), sys.argv[1:], min(a.jobs, len(SPECS2)), min(60.0, run.left() - 60))))
        th.start()
    log("checks: the default backward's gradients vs the fp32 reference")
    res["checks"] = []
    B, H, Hkv, D, K = a.shape
    gen = torch.Generator(device=dev).manual_seed(1)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for T, spec in ((a.check_T, "g16"), (a.check_T, "g32"), (a.check_T - 24, "g16")):
        if run.gate(40, f"check {spec} T={T}"):
            rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dt)  # noqa: E731
            q, k, v, go = rnd(B, T, H, D), rnd(B, T, Hkv, D), rnd(B, T, Hkv, D), rnd(B, T, H, D)
            G = int(spec[1:])
            rows = run_rows(-(-T // G), G, T, a.check_topk, a.sink, a.window, gen, dev)
            r = run.guarded("check", grad_check, q, k, v, rows, G, go, None)
            if r:
                res["checks"].append({"T": T, "spec": spec, **r})
                log(str(res["checks"][-1]))
    res["checks_ok"] = bool(res["checks"]) and all(c["ok"] for c in res["checks"])
    if th is not None:
        th.join()
        res["warmup"] = box
    run.save()
    HI, DI = a.index
    W = dict(warmup_ms=5, rep_ms=a.rep_ms)
    ix, res["trained_indexer_kl"], gen = trained_indexer(dev, 0, HI, DI, a.train_steps)
    res["rows"], res["dense"], res["sampled_stats"] = [], {}, []
    for li, L in enumerate(a.seqlens):
        specs = SPECS2 if li == 0 else ("g64", "g32", "g16", "kb1")
        if not run.gate(40 if li == 0 else 30, f"L={L}"):
            continue
        log(f"L={L}: inputs + dense")
        rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dt)  # noqa: E731
        q, k, v = rnd(B, L, H, D), rnd(B, L, Hkv, D), rnd(B, L, Hkv, D)
        grad = torch.randn_like(q)
        index = patterns.trained_index(ix, L, dev, gen)
        bwd = li == 0 or run.left() > 75
        dn = run.guarded(f"dense {L}", dense_times, q, k, v, dev, W, bwd)
        if dn is None:
            continue
        res["dense"][str(L)] = dn
        log(f"dense {dn}")
        run.save()
        for spec in specs:
            if not run.gate(25 if li == 0 else 20, f"L={L} {spec}"):
                continue
            kw = dict(dense_fwdbwd_ms=dn["dense_fwdbwd_ms"], grad=grad) if "dense_fwdbwd_ms" in dn else {}
            got = run.guarded(f"L={L} {spec}", granular_rows, q, k, v, {"trained": index}, [spec], K, a.sink, a.window,
                              dev, W, dn["dense_ms"], check_n=64, select_fwdbwd=False, **kw)
            for r in got or []:
                log(", ".join(f"{x}={y:.4g}" if isinstance(y, float) else f"{x}={y}" for x, y in r.items()))
                res["rows"].append(r)
            run.save()
        if run.gate(15, f"L={L} sampled stats"):
            st = run.guarded("sampled stats", sampled_stats, index, K, a, dev)
            if st:
                res["sampled_stats"].append({"seqlen": L, "input": "trained", **st})
                log(str(res["sampled_stats"][-1]))
            if li == 0 and run.gate(12, "sampled stats random"):
                HI_, DI_ = a.index
                rand = (rnd(B, L, HI_, DI_), torch.rand(B, L, HI_, device=dev, generator=gen).to(dt), rnd(B, L, DI_))
                st = run.guarded("sampled stats random", sampled_stats, rand, K, a, dev)
                if st:
                    res["sampled_stats"].append({"seqlen": L, "input": "random", **st})
                    log(str(res["sampled_stats"][-1]))
            run.save()
        del q, k, v, grad, index


def summary2(res: dict) -> None:
    print(f"checks ok: {res.get('checks_ok')}  skipped: {res['skipped']}  errors: {res['errors']}")
    print("| L | spec | select ms | attn ms | attn TF/s | prefill ms | speed-up | fwd+bwd ms | fwd+bwd speed-up | rows eq |")
    for r in res.get("rows", []):
        g = r.get
        print(f"| {g('seqlen')} | {g('granularity')} | " + " | ".join(
            f"{g(x):.3g}" if isinstance(g(x), float) else str(g(x)) for x in
            ("select_ms", "attn_ms", "attn_tflops", "prefill_ms", "prefill_speedup", "fwdbwd_ms", "fwdbwd_speedup",
             "select_rows_equal")) + " |")
    for st in res.get("sampled_stats", []):
        print({x: y for x, y in st.items() if x != "path_share_by_decile"})


def summary(res: dict) -> None:
    print(f"checks ok: {res.get('checks_ok')}  skipped: {res['skipped']}  errors: {res['errors']}")
    dn = res.get("dense", {})
    print(f"dense fwd {dn.get('dense_ms')}  fwd+bwd {dn.get('dense_fwdbwd_ms')}")
    for spec, p in res.get("parts", {}).items():
        print(f"{spec}: delta torch {p['delta_torch_ms']:.3f} kernel {p['delta_kernel_ms']:.3f} ms; lists "
              + ", ".join(f"BN{b}: {x['ms']:.3f} ms / {x['touched_pairs']} pairs" for b, x in p["lists"].items()))
        for r in p["dq"]:
            print(f"  dq {r['tune']}: {r['ms']:.3f} ms")
        for r in p["dkdv"]:
            print(f"  dkdv {r['tune']}: {r['ms']:.3f} ms, {r['mma_tflops_touched']:.0f} TF/s touched, "
                  f"q/dO {r['q_do_tbps']:.2f} TB/s, err {r['dk_vs_first']:.1e}")
    for spec, fb in res.get("fwdbwd", {}).items():
        for name, r in fb.items():
            if r:
                print(f"{spec} fwd+bwd {name}: {r['fwdbwd_ms']:.2f} ms ({r.get('speedup', 0):.2f}x) {r['tune']}")
    for spec, f in res.get("fwd", {}).items():
        for r in f or []:
            print(f"{spec} fwd {r['tune']}: {r['ms']:.3f} ms ({r['tflops_selected']:.0f} TF/s)")


def main(argv=None):
    a = parse_args(argv)
    dev = torch.device("cpu" if a.cpu_smoke else "cuda")
    if a.warm_part:
        (warm if a.part == 1 else warm2)(a, dev, a.warm_part)
        return
    import triton

    from sparse_rl.bench.timing import device_name

    if dev.type == "cuda":
        torch.zeros(1, device=dev)  # the parent's context first (children start after it)
    run = Run(a.out, "granular8.json", a.budget, {"device": device_name(dev), "torch": torch.__version__,
                                                  "triton": triton.__version__, "commit": a.commit, "args": vars(a)})
    (part1 if a.part == 1 else part2)(a, dev, run)
    run.save()
    (summary if a.part == 1 else summary2)(run.res)


if __name__ == "__main__":
    main()
