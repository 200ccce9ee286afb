"""Issue 15 item 1, session 9: the prefill row top-k (one histogram pass, `bin_topk.py`) against the radix
select (`radix_topk.py`) on the H200, one device call of ~150 s.

Phases, highest value first, each gated on the time LEFT of --budget (partial JSON after each):
0. every variant (radix launches, bin_topk launches) proven in child processes on small inputs with the
   timed calls' Triton specialisation (equal to the torch reference `select_topk`), compiling into the
   on-disk cache while the parent trains the indexer (bench/patterns.py, as sessions 6-8);
1. 32K token level, trained input: the `[1, 32K, 32K]` causal scores materialised once; every proven
   variant's rows equal to radix's (exactness on the real shape) and its time; the score sweeps alone
   (streamed row max: the 1.5x target's baseline; materialising); bin_topk's per-row paths;
2. 128K g64 then g32 block-score rows (trained): the same comparison;
3. 32K random input: radix and the bin variants;
4. end to end: token level 32K (scores + top-k) bin vs radix vs the stream default; prefill g64 / g32 at
   128K (bin vs radix) and kb1 at 32K (bin) against dense cuDNN SDPA.

    PYTHONPATH=$PWD python benchmarks/gpu_topk_session9.py --budget 140 --call 2 --commit <sha>
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/gpu_topk_session9.py --cpu-smoke --budget 1400 --warm-s 300

--call 1 / 2: the variant lists of the session's two device calls (results/2026-12-02-h200-topk-session9.md);
the token-level impls timed end to end are call 2's ("auto", since then the bin select).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.bin_topk import bin_hist, bin_threshold, row_span
from sparse_rl.sparse.ops.indexer_topk.radix_topk import collect_row, row_bases

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from granular_harness import Run, dense_times, log, parallel_warmup, trained_indexer  # noqa: E402

# per device call: radix (BLOCK, num_warps), first = the default and the reference rows; bin (NB, CAP, BLOCK,
# num_warps[, long_first]), first = the default
RADIX = {1: [(2048, 8), (1024, 4), (2048, 4), (512, 2), (4096, 16)], 2: [(2048, 8), (1024, 4)]}
BIN = {1: [(128, 1024, 1024, 4), (128, 1024, 2048, 8), (128, 1024, 512, 2), (64, 2048, 1024, 4),
           (256, 512, 1024, 4), (128, 512, 1024, 4), (64, 1024, 1024, 4), (256, 1024, 2048, 8)],
       2: [(128, 1024, 1024, 4), (128, 1024, 1024, 4, True), (128, 512, 1024, 4), (128, 2048, 1024, 4),
           (256, 1024, 1024, 4), (128, 1024, 2048, 4), (128, 1024, 512, 2)]}


@triton.jit
def _stage_kernel(SC, OUT, BUFV, Tc, S_c, q_lim, srb, srt, sob, sot, K, STAGE: tl.constexpr, NB: tl.constexpr,
                  CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Per-pass cost of `bin_row` (a benchmark, rows are not written): STAGE 1 the span pass, 2 + the
    histogram, 3 `bin_threshold` (+ the second level where a bin overflows, the compaction and the buffer's
    select), 0 the collect pass alone (nothing selected)."""
    row, base, obase, n = row_bases(SC, OUT, Tc, S_c, q_lim, srb, srt, sob, sot)
    if STAGE == 0:
        collect_row(base, obase, n, K, 0xFFFFFFFF, 0, 0, BLOCK)
    elif STAGE == 3:
        path, cstar, tau, need, n_eq = bin_threshold(base, n, K, BUFV + row.to(tl.int64) * CAP, NB, CAP, BLOCK)
        tl.store(obase, path + cstar + tau.to(tl.int32) + need + n_eq)
    else:
        lo, hi, acc = row_span(base, n, BLOCK)
        if STAGE >= 2:
            if acc > K:
                span = hi - lo
                scale = tl.where(span > 0.0, NB / span, 0.0)
                dstar, kk, cstar = bin_hist(base, n, K, lo, scale, acc, lo, scale, 0, False, NB, BLOCK)
                acc += dstar + kk + cstar
        tl.store(obase, acc)


def stage_fn(stage: int, launch):
    """x `[B, Tc, Sc]` -> runs `_stage_kernel` (launch: bin_topk's (NB, CAP, BLOCK, warps))."""
    nb, cap, block, warps = launch

    def fn(x, K, q_lim=None, stats=None):
        B, Tc, Sc = x.shape
        out = torch.empty(B, Tc, K, dtype=torch.int32, device=x.device)
        buf = torch.empty(B * Tc, cap, dtype=torch.float32, device=x.device)
        _stage_kernel[(B * Tc,)](x, out, buf, Tc, Sc, Sc if q_lim is None else q_lim, x.stride(0), x.stride(1),
                                 out.stride(0), out.stride(1), K, STAGE=stage, NB=nb, CAP=cap, BLOCK=block,
                                 num_warps=warps)
        return out
    return fn


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tok9"))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--budget", type=float, default=140.0, help="seconds of script time; phases gate on time left")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU through the interpreter")
    ap.add_argument("--shape", type=int, nargs=5, default=[1, 32, 8, 128, 2048], metavar=("B", "H", "H_KV", "D", "K"))
    ap.add_argument("--index", type=int, nargs=2, default=[4, 64], metavar=("H_I", "D_I"))
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--rep-ms", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=13, help="warm-up child processes (0: none)")
    ap.add_argument("--call", type=int, default=2, choices=(1, 2), help="which device call's variant lists")
    ap.add_argument("--warm-s", type=float, default=60.0, help="the warm-up children's time limit")
    ap.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prove-dir", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.L32, a.L128, a.groups = (64, 128, (8, 4)) if a.cpu_smoke else (32768, 131072, (64, 32))
    a.short = (32, 48) if a.cpu_smoke else (8192, 16384)
    if a.cpu_smoke:
        a.shape, a.index, a.train_steps, a.rep_ms = [1, 4, 1, 32, 32], [2, 16], 3, 1
        a.sink, a.window = 2, 4
    return a


def variants(a) -> list[tuple[str, tuple]]:
    """(label, (kind, launch)) of every variant; the CPU smoke keeps two of each, at interpreter sizes."""
    if a.cpu_smoke:
        return [("radix-64-1", ("radix", (64, 1))), ("radix-32-1", ("radix", (32, 1))),
                ("bin-32-64-64-1", ("bin", (32, 64, 64, 1))), ("bin-32-64-64-1-lf", ("bin", (32, 64, 64, 1, True))),
                ("bin-64-128-32-1", ("bin", (64, 128, 32, 1)))]
    return ([(f"radix-{b}-{w}", ("radix", (b, w))) for b, w in RADIX[a.call]]
            + [("bin-" + "-".join(map(str, x[:4])) + ("-lf" if x[4:] == (True,) else ""), ("bin", x))
               for x in BIN[a.call]])


def stages(a) -> list[tuple[str, tuple]]:
    """(label, (stage, launch)) of the per-pass timings, at bin_topk's default launch."""
    from sparse_rl.sparse.ops.indexer_topk.bin_topk import bin_launch

    launch = bin_launch(not a.cpu_smoke)
    return [(f"stage-{s}", (s, launch)) for s in (1, 2, 3, 0)]


def select_fn(kind: str, launch):
    from sparse_rl.sparse.ops.indexer_topk.bin_topk import bin_topk
    from sparse_rl.sparse.ops.indexer_topk.radix_topk import radix_topk

    if kind == "radix":
        return lambda x, K, q_lim=None, stats=None: radix_topk(x, K, q_lim=q_lim, launch=launch)
    lf = len(launch) > 4 and launch[4]
    return lambda x, K, q_lim=None, stats=None: bin_topk(x, K, q_lim=q_lim, launch=launch[:4], stats=stats,
                                                          long_first=lf)


def prove(a, dev, part: str) -> None:
    """Child: the variant named in `part` on small inputs with both timed specialisations (K a multiple of
    16 and not, all other integers multiples of 16), against the torch reference rows."""
    from sparse_rl.sparse.ops.indexer_topk.naive import select_topk

    label = part.split(":", 1)[1]
    res = {"label": label, "ok": False}
    if label.startswith("stage-"):  # compile only (the stage kernels write no rows)
        stage, launch = dict(stages(a))[label]
        x = torch.randn(1, 64, 1024, device=dev)
        try:
            for K, q_lim in ((48, 0), (45, None)):
                stage_fn(stage, launch)(x, K, q_lim)
            res["ok"] = True
        except Exception as e:  # noqa: BLE001
            res["err"] = f"{type(e).__name__}: {str(e)[:300]}"
        with open(os.path.join(a.prove_dir, f"prove.{label}.json"), "w") as f:
            json.dump(res, f)
        return
    kind, launch = dict(variants(a))[label]
    try:
        g = torch.Generator(device=dev).manual_seed(1)
        T, S = (64, 1024) if dev.type == "cuda" else (16, 256)
        x = torch.randn(1, T, S, device=dev, generator=g)
        x[0, 1] = 2.0  # one value everywhere: the bin form's radix fallback
        x[0, 2] = x[0, 2].round()  # masses of ties
        x[0, 3, :S - 100] = float("-inf")
        x[0, 4, :7] = float("inf")
        odd = x[..., :S - 15].contiguous()  # a chunk of granular rows whose width is no multiple of 16
        for xx, K, q_lim in ((x, 48, 0), (x, 45, None), (odd, 45, None), (x, 2048, 0)):
            Sx = xx.shape[2]
            fin = xx > float("-inf")
            if q_lim is not None:
                fin &= torch.arange(Sx, device=dev)[None, None] <= q_lim + torch.arange(T, device=dev)[None, :, None]
            ref = select_topk(xx, fin, fin & (xx == float("inf")), K)
            fn = select_fn(kind, launch)
            got = fn(xx, K, q_lim=q_lim)
            if kind == "bin" and xx is x:  # the stats specialisation too (compiled here, not in the parent)
                st = torch.empty(T, 2, dtype=torch.int32, device=dev)
                if not torch.equal(fn(xx, K, q_lim=q_lim, stats=st), ref):
                    raise AssertionError(f"rows with stats differ at K={K}")
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if not torch.equal(got, ref):
                raise AssertionError(f"rows differ at K={K}, width {Sx}: {int((got != ref).sum())} entries")
        res["ok"] = True
    except Exception as e:  # noqa: BLE001 -- reported to the parent
        res["err"] = f"{type(e).__name__}: {str(e)[:300]}"
    with open(os.path.join(a.prove_dir, f"prove.{label}.json"), "w") as f:
        json.dump(res, f)


def warm_async(a, run: Run, box: dict) -> threading.Thread:
    import tempfile

    a.prove_dir = tempfile.mkdtemp(prefix="tok9-prove-")
    args = [x for x in sys.argv[1:]] + ["--prove-dir", a.prove_dir]
    labels = [lab for lab, _ in variants(a) + stages(a)]

    def go():
        box["info"] = parallel_warmup(os.path.abspath(__file__), args, len(labels), min(a.warm_s, run.left() - 60),
                                      parts=labels)
    th = threading.Thread(target=go)
    th.start()
    return th


def read_proven(a) -> dict:
    done = {}
    for f in os.listdir(a.prove_dir):
        if f.startswith("prove."):
            r = json.load(open(os.path.join(a.prove_dir, f)))
            done[r["label"]] = r
    return done


def compare(run: Run, name: str, x, K: int, q_lim, ok: list, dev, W: dict, ref=None, stats_for=None,
            stage_list=()) -> dict:
    """Every proven variant on one score tensor x: rows equal to the first's (radix default), time."""
    from sparse_rl.bench.timing import bench_ms

    out = {"name": name, "rows": int(x.shape[1]), "cols": int(x.shape[2]), "K": K, "times": {}, "equal": {}}
    for lab, (kind, launch) in ok:
        if not run.gate(6, f"{name} {lab}"):
            break
        fn = select_fn(kind, launch)
        got = run.guarded(f"{name} {lab}", fn, x, K, q_lim)
        if got is None:
            continue
        if ref is None:
            ref = got
        out["equal"][lab] = bool(torch.equal(got, ref))
        del got
        out["times"][lab] = run.guarded(f"{name} {lab} time", bench_ms, lambda: fn(x, K, q_lim), dev, **W)
        log(f"{name} {lab}: {out['times'][lab]} ms, equal {out['equal'][lab]}")
    if stage_list and run.left() > 10:
        out["stage_ms"] = {}
        for lab, (stage, launch) in stage_list:
            fn = stage_fn(stage, launch)
            out["stage_ms"][lab] = run.guarded(f"{name} {lab}", bench_ms, lambda: fn(x, K, q_lim), dev, **W)
        log(f"{name} stages (1 span, 2 + histogram, 3 + compaction and select, 0 collect alone) {out['stage_ms']}")
    if stats_for is not None and run.left() > 8:
        st = torch.empty(x.shape[0] * x.shape[1], 2, dtype=torch.int32, device=x.device)
        select_fn(*stats_for)(x, K, q_lim, stats=st)
        path, cst = st[:, 0].long(), st[:, 1].double()
        out["bin_paths"] = {str(p): float((path == p).double().mean()) for p in range(4)}
        c1 = cst[path == 1]
        if c1.numel():
            q = torch.tensor([.5, .9, .99, 1.0], dtype=torch.float64, device=x.device)
            out["bin_cstar_p50_p90_p99_max"] = [float(v) for v in torch.quantile(c1, q).tolist()]
        log(f"{name} bin paths {out['bin_paths']} c* {out.get('bin_cstar_p50_p90_p99_max')}")
    return out


def block_rows(index, G: int, a):
    """g-G block scores `[1, L/G, L]` fp32 of the trained input (key_block 1), and the blocks kept."""
    from sparse_rl.sparse.ops.indexer_topk import granular as gr
    from sparse_rl.sparse.ops.indexer_topk.naive import group_plan, rep_queries

    qi, wi, ki = index
    L = qi.shape[1]
    start, _, ev_pos, ev_rep, _, q_all, w_all, j = group_plan(qi, wi, 0, None, G, None)
    qr, wr = rep_queries(q_all, w_all, j)
    x = gr.block_keys(qr, wr, ki, ev_rep, start, L, keys=False, key_block=1, sink=a.sink, window=a.window,
                      block_score="max")
    return x, a.shape[4] - (G - 1) - a.sink - a.window


def explore(a, dev, run: Run, ok: list, ctx: dict) -> None:
    """Phases 1-3: the select variants on materialised scores."""
    from sparse_rl.bench import patterns
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk import stream as st
    from sparse_rl.sparse.ops.indexer_topk.triton import indexer_scores_chunk

    res, K, W = run.res, a.shape[4], dict(warmup_ms=5, rep_ms=a.rep_ms)
    bins = [v for v in ok if v[1][0] == "bin"]
    gen = ctx["gen"]
    index = patterns.trained_index(ctx["ix"], a.L32, dev, gen)
    qi, wi, ki = index
    kvs = torch.zeros(1, dtype=torch.int32, device=dev)
    L = a.L32
    mat = lambda: indexer_scores_chunk(qi, wi, ki, kvs, 0, L, L, 0, a.sink, a.window)  # noqa: E731
    x = mat()
    res["sweeps"] = {"L32_rowmax_ms": bench_ms(lambda: st.indexer_row_max(qi, wi, ki), dev, **W),
                     "L32_materialise_ms": bench_ms(mat, dev, **W)}
    log(f"sweeps {res['sweeps']}")
    res["compare"] = [compare(run, "L32 token trained", x, K, 0, ok, dev, W, stats_for=bins[0][1] if bins else None,
                              stage_list=ctx["stages"])]
    run.save()
    del x
    for G in a.groups:
        if not run.gate(25, f"128K g{G}"):
            continue
        if "index128" not in ctx:
            ctx["index128"] = patterns.trained_index(ctx["ix"], a.L128, dev, gen)
            q1, w1, k1 = ctx["index128"]
            res["sweeps"]["L128_rowmax_ms"] = bench_ms(lambda: st.indexer_row_max(q1, w1, k1), dev, **W)
        x, nb = block_rows(ctx["index128"], G, a)
        pick = ok if G == a.groups[0] else ok[:1] + bins[:4]
        res["compare"].append(compare(run, f"L128 g{G} trained", x, nb, None, pick, dev, W,
                                      stats_for=bins[0][1] if bins else None,
                                      stage_list=ctx["stages"] if G == a.groups[0] else ()))
        run.save()
        del x
    if run.gate(20, "32K random"):
        HI, DI = a.index
        rnd = (torch.randn(1, L, HI, DI, device=dev, generator=gen).to(qi.dtype),
               torch.rand(1, L, HI, device=dev, generator=gen).to(qi.dtype),
               torch.randn(1, L, DI, device=dev, generator=gen).to(qi.dtype))
        x = indexer_scores_chunk(*rnd, kvs, 0, L, L, 0, a.sink, a.window)
        res["compare"].append(compare(run, "L32 token random", x, K, 0, ok[:1] + bins[:4], dev, W,
                                      stats_for=bins[0][1] if bins else None))
        run.save()
        del x, rnd
    ctx["index32"] = index


def end_to_end(a, dev, run: Run, ctx: dict) -> None:
    """Phase 4: token level (scores + top-k) and prefill against dense SDPA."""
    from sparse_rl.bench.granular import granular_rows
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import sparse_attention
    from sparse_rl.sparse.ops.indexer_topk import triton as tri

    res, W = run.res, dict(warmup_ms=5, rep_ms=a.rep_ms)
    B, H, Hkv, D, K = a.shape
    gen = ctx["gen"]
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dt)  # noqa: E731
    res["e2e"], res["dense"] = [], {}
    qi, wi, ki = ctx["index32"]
    tok = {}
    for impl in ("auto", "radix", "stream"):  # auto: the materialising path with bin_topk (since session 9)
        if run.gate(10, f"token 32K {impl}"):
            f = lambda impl=impl: tri.indexer_topk(qi, wi, ki, K, sink=a.sink, window=a.window, topk_impl=impl)  # noqa: E731
            tok[impl] = run.guarded(f"token {impl}", bench_ms, f, dev, **W)
    rows_bin = tri.indexer_topk(qi, wi, ki, K, sink=a.sink, window=a.window, topk_impl="auto")
    rows_radix = tri.indexer_topk(qi, wi, ki, K, sink=a.sink, window=a.window, topk_impl="radix")
    tok["auto_equals_radix_rows"] = bool(torch.equal(rows_bin, rows_radix))
    tok["stream_rows_differing_from_radix"] = int((tri.indexer_topk(qi, wi, ki, K, sink=a.sink, window=a.window,
                                                                   topk_impl="stream") != rows_radix).any(-1).sum())
    del rows_radix
    res["token32"] = tok
    log(f"token 32K select (scores + top-k) {tok}")
    run.save()
    for L in (a.L128, a.L32):
        if not run.gate(30 if L == a.L128 else 15, f"prefill L={L}"):
            continue
        q, k, v = rnd(B, L, H, D), rnd(B, L, Hkv, D), rnd(B, L, Hkv, D)
        dn = run.guarded(f"dense {L}", dense_times, q, k, v, dev, W, False)
        if dn is None:
            continue
        res["dense"][str(L)] = dn
        log(f"dense L={L} {dn}")
        if L == a.L32:
            sel = lambda: tri.indexer_topk(qi, wi, ki, K, sink=a.sink, window=a.window, topk_impl="auto")  # noqa: E731
            r = {"seqlen": L, "granularity": "kb1", "topk_impl": "auto (bin)", "dense_ms": dn["dense_ms"],
                 "select_ms": tok.get("auto"),
                 "attn_ms": bench_ms(lambda: sparse_attention(q, k, v, rows_bin, backend="triton"), dev, **W),
                 "prefill_ms": bench_ms(lambda: sparse_attention(q, k, v, sel(), backend="triton"), dev, **W)}
            r["prefill_speedup"] = dn["dense_ms"] / r["prefill_ms"]
            res["e2e"].append(r)
            log(str(r))
        else:
            if "index128" not in ctx:
                continue
            for spec in (f"g{G}" for G in a.groups):
                for impl in ("auto", "radix"):
                    if not run.gate(8, f"L={L} {spec} {impl}"):
                        continue
                    got = run.guarded(f"L={L} {spec} {impl}", granular_rows, q, k, v, {"trained": ctx["index128"]},
                                      [spec], K, a.sink, a.window, dev, W, dn["dense_ms"], topk_impl=impl)
                    for r in got or []:
                        log(", ".join(f"{x}={y:.4g}" if isinstance(y, float) else f"{x}={y}" for x, y in r.items()))
                        res["e2e"].append(r)
                    run.save()
        del q, k, v
        run.save()


def token_short(a, dev, run: Run, ctx: dict) -> None:
    """Token level (scores + top-k) at 8K and 16K, trained input: auto (bin) against radix and stream."""
    from sparse_rl.bench import patterns
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk import triton as tri

    K, W = a.shape[4], dict(warmup_ms=5, rep_ms=a.rep_ms)
    for L in a.short:
        if not run.gate(10, f"token {L}"):
            continue
        qi, wi, ki = patterns.trained_index(ctx["ix"], L, dev, ctx["gen"])
        res = run.res.setdefault("token_short", {}).setdefault(str(L), {})
        for impl in ("auto", "radix", "stream"):
            f = lambda impl=impl: tri.indexer_topk(qi, wi, ki, K, sink=a.sink, window=a.window, topk_impl=impl)  # noqa: E731
            res[impl] = run.guarded(f"token {L} {impl}", bench_ms, f, dev, **W)
        res["auto_equals_radix_rows"] = bool(torch.equal(
            tri.indexer_topk(qi, wi, ki, K, sink=a.sink, window=a.window, topk_impl="auto"),
            tri.indexer_topk(qi, wi, ki, K, sink=a.sink, window=a.window, topk_impl="radix")))
        log(f"token {L} select (scores + top-k) {res}")
        run.save()


def token128(a, dev, run: Run, ctx: dict) -> None:
    """Token level at 128K, scores + top-k: materialising chunks with bin_topk against the stream default."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk import triton as tri

    if "index128" not in ctx:
        return
    qi, wi, ki = ctx["index128"]
    K, W = a.shape[4], dict(warmup_ms=1, rep_ms=a.rep_ms)
    res = run.res.setdefault("token128", {})
    for impl in ("auto", "stream"):
        if run.gate(12, f"token 128K {impl}"):
            f = lambda impl=impl: tri.indexer_topk(qi, wi, ki, K, sink=a.sink, window=a.window, topk_impl=impl)  # noqa: E731
            res[impl] = run.guarded(f"token128 {impl}", bench_ms, f, dev, **W)
            run.save()
    if run.gate(10, "token 128K rows"):  # call 1: bin and stream rows differed here; which one is off?
        rows = {impl: tri.indexer_topk(qi, wi, ki, K, sink=a.sink, window=a.window, topk_impl=impl)
                for impl in ("auto", "stream", "radix")}
        for impl in ("auto", "stream"):
            bad = (rows[impl] != rows["radix"]).any(-1)[0]
            res[f"{impl}_rows_differing_from_radix"] = int(bad.sum())
            res[f"{impl}_first_differing_rows"] = bad.nonzero().flatten()[:8].tolist()
        del rows
    log(f"token 128K select (scores + top-k) {res}")


def summary(res: dict) -> None:
    print("== tok9 summary ==")
    print("sweeps:", res.get("sweeps"))
    for c in res.get("compare", []):
        t = {k: round(v, 3) for k, v in c["times"].items() if v}
        print(c["name"], "times", t, "all equal", all(c["equal"].values()), "paths", c.get("bin_paths"),
              "c*", c.get("bin_cstar_p50_p90_p99_max"))
    print("token32:", res.get("token32"), "token128:", res.get("token128"), "short:", res.get("token_short"))
    for c in res.get("compare", []):
        if c.get("stage_ms"):
            print(c["name"], "stages", {k: round(v, 3) for k, v in c["stage_ms"].items() if v})
    for r in res.get("e2e", []):
        print({k: r.get(k) for k in ("seqlen", "granularity", "topk_impl", "select_ms", "attn_ms", "prefill_ms",
                                      "prefill_speedup")})
    print("skipped:", res.get("skipped"), "errors:", res.get("errors"))


def main(argv=None):
    a = parse_args(argv)
    dev = torch.device("cpu" if a.cpu_smoke else "cuda")
    if a.warm_part:
        prove(a, dev, a.warm_part)
        return
    import triton

    from sparse_rl.bench.timing import device_name

    if dev.type == "cuda":
        torch.zeros(1, device=dev)
    run = Run(a.out, f"tok9-call{a.call}.json", a.budget, {"device": device_name(dev), "torch": torch.__version__,
                                             "triton": triton.__version__, "commit": a.commit, "args": vars(a)})
    box = {}
    th = warm_async(a, run, box) if a.jobs else None
    log("trained indexer (variants proven in child processes meanwhile)")
    ix, kl, gen = trained_indexer(dev, 0, a.index[0], a.index[1], a.train_steps)
    run.res["trained_indexer_kl"] = kl
    ctx = {"ix": ix, "gen": gen}
    if th is not None:
        th.join()
        done = read_proven(a)
        run.res["prove"] = {"info": box.get("info"), "results": done}
        ok = [v for v in variants(a) if done.get(v[0], {}).get("ok")]
        ctx["stages"] = [v for v in stages(a) if done.get(v[0], {}).get("ok")]
    else:
        ok, ctx["stages"] = variants(a), stages(a)
    failed = [x for x, r in run.res.get("prove", {}).get("results", {}).items() if not r.get("ok")]
    log(f"proven: {[v[0] for v in ok]}; failed: {failed}")
    run.save()
    if ok and ok[0][1][0] == "radix":
        run.guarded("explore", explore, a, dev, run, ok, ctx)
        run.save()
        if "index32" in ctx:
            run.guarded("end to end", end_to_end, a, dev, run, ctx)
            run.guarded("token 128K", token128, a, dev, run, ctx)
            run.guarded("token 8K / 16K", token_short, a, dev, run, ctx)
    run.save()
    summary(run.res)


if __name__ == "__main__":
    main()
