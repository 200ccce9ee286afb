"""One device call (<= 150 s of script time) for issue 15, session 10 (helper gran10): the coarse sparse prefill at
32K without host syncs (the granular selection's arithmetic rows, the backward's key-tile lists on the device), the
block forward kernel's launch sweep with tensor-descriptor (TMA) loads, and 128K kb64g64 once.

    PYTHONPATH=$PWD python benchmarks/gpu_granular_session10.py --budget 140 --commit <sha>
    PYTHONPATH=$PWD python benchmarks/gpu_granular_session10.py --cpu-smoke        # CPU rehearsal

Phases, each gated on the time LEFT of --budget, partial JSON after each:
1. child processes prove every launch timed below (bf16 out/dq/dk/dv of `sparse_attention(fwd_path="block")`
   against fp32 on 1024 / 984 queries, the 32K Triton specialisation; the new and the session-9 selection equal
   on 1024 queries) while the parent trains the indexer (bench/patterns.py, 150 steps) and builds the 32K inputs;
2. checks at 32K: the new selection equal to the session-9 one ("legacy": group_plan + its host check, gathered
   representatives, int64 block rows) and to the reference on the last 64 queries; attention output vs fp32;
3. dense cuDNN SDPA at 32K (fwd, fwd+bwd);
4. per spec (kb64g64, kb32g32) and input (trained, random): selection alone and prefill (selection + attention),
   legacy vs new, the attention alone, a timeline profile of each prefill (kernels, busy, gaps, host); fwd+bwd
   (selection given) with the torch key-tile lists (nonzero: the session-9 path) vs the device lists, "dt" and "dts";
5. the block forward launch sweep on the trained rows, pointer vs tensor-descriptor loads;
6. 128K kb64g64 (trained): dense fwd, selection / attention / prefill legacy vs new (regression check).
Writes $OUT/gran10/granular10.{json,log} and prints a short summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

if "--cpu-smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from granular_harness import Run, dense_times, log, parallel_warmup, timeline_profile  # noqa: E402

import torch  # noqa: E402

SPECS = ["kb64g64", "kb32g32"]
# block forward launches (BLOCK_N, warps, stages[, loads]) on 128-row tiles; the first of each is the default
FWD = {"kb64g64": [(32, 4, 3), (32, 4, 3, "tma"), (64, 8, 3), (64, 8, 3, "tma"), (64, 4, 3, "tma"), (32, 4, 4),
                   (32, 4, 4, "tma"), (64, 8, 4, "tma")],
       "kb32g32": [(32, 4, 3), (32, 4, 3, "tma"), (32, 4, 4, "tma"), (32, 8, 3, "tma")]}
# dk/dv (BLOCK_N, warps, stages, form, lists): the first is session 9's path (torch lists), then the device lists
DKDV = [(64, 8, 2, "dt", "torch"), (64, 8, 2, "dt", "device"), (64, 8, 2, "dts", "device")]
# call 2: block dq launches (the first: the default) and the block pattern's forward launches (128-key blocks)
DQ = {"kb64g64": [(64, 8, 2), (64, 8, 2, "tma"), (32, 4, 2, "tma"), (64, 4, 2, "tma"), (64, 8, 3, "tma")],
      "kb32g32": [(32, 4, 2), (32, 4, 2, "tma"), (32, 4, 3, "tma"), (32, 8, 2, "tma")]}
PATTERN = [(128, 8, 3), (128, 8, 3, "tma"), (64, 4, 3, "tma"), (32, 4, 3, "tma"), (64, 8, 3, "tma")]
SESSION9 = {"fwd": (32, 4, 3), "dkdv": (64, 8, 2, "dt", "torch")}  # the session-9 launches of key-block rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gran10"))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--budget", type=float, default=140.0, help="seconds of script time; phases gate on time left")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU through the interpreter")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--long", type=int, default=131072, help="the regression length (kb64g64 once)")
    ap.add_argument("--shape", type=int, nargs=5, default=[1, 32, 8, 128, 2048], metavar=("B", "H", "H_KV", "D", "K"))
    ap.add_argument("--index", type=int, nargs=2, default=[4, 64], metavar=("H_I", "D_I"))
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--check-T", type=int, default=1024)
    ap.add_argument("--check-topk", type=int, default=512)
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--rep-ms", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--call", type=int, default=1, help="2: the new defaults end to end, dq sweep, block pattern vs Flex")
    ap.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prove-dir", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        a.seqlen, a.long, a.shape, a.index, a.check_T, a.check_topk = 256, 512, [1, 8, 2, 16, 192], [2, 16], 128, 192
        a.train_steps, a.rep_ms, a.window, a.jobs, a.sink = 3, 1, 16, min(a.jobs, 2), 4
    return a


def legacy_select(qi, wi, ki, K: int, kb: int, G: int, sink: int, window: int):
    """The session-9 granular selection of shared rows (granular_topk before this session, one chunk as at 32K /
    128K): group_plan's tensors and its host check (`bool(any)`: a sync), the representatives gathered, the
    block top-k's int64 copy, the assembly reading pos / rep / start tensors."""
    import triton

    from sparse_rl.sparse.ops.indexer_topk import granular as gr
    from sparse_rl.sparse.ops.indexer_topk.naive import group_plan, rep_queries

    B, T = qi.shape[:2]
    start, pos, ev_pos, ev_rep, inv, q_all, w_all, j = group_plan(qi, wi, 0, None, G, None)
    N = ev_pos.shape[1]
    nb = max(0, (K - (G - 1) - sink - window) // kb)
    nbc = min(triton.cdiv(ki.shape[1], kb), ((N - 1) * G) // kb + 1)
    rows = torch.empty(B, N, K, dtype=torch.int32, device=qi.device)
    with torch.no_grad():
        qr, wr = rep_queries(q_all, w_all, j)
        x = gr.block_keys(qr, wr, ki, ev_rep, start, nbc, key_block=kb, sink=sink, window=window, block_score="max",
                          keys=False)
        blocks = gr.top_blocks(x, min(nb, nbc), "bin")
        gr.assemble_rows_triton(blocks, ev_pos, ev_rep, start, K, key_block=kb, query_group=G, sink=sink,
                                window=window, out=rows)
    return rows


def new_select(qi, wi, ki, K: int, kb: int, G: int, sink: int, window: int):
    from sparse_rl.sparse.ops import granular_topk

    return granular_topk(qi, wi, ki, K, sink=sink, window=window, key_block=kb, query_group=G, shared=True,
                         backend="triton")


def rows_like(NG: int, G: int, S: int, K: int, kb: int, sink: int, window: int, gen, dev):
    """Shared rows `[1, NG, K]` shaped like a kb-block selection (sink, window, the group's own keys, random whole
    kb-aligned blocks the group's last query sees), ascending, -1 padded."""
    keys = torch.arange(S, device=dev)
    score = torch.rand(NG, -(-S // kb), device=dev, generator=gen)[:, keys // kb]
    last = (torch.arange(NG, device=dev) * G + G - 1)[:, None]
    score = score + 2.0 * ((keys < sink) | ((keys >= last - G + 1 - window) & (keys <= last)))
    score = score.masked_fill(keys > last, -1.0)
    vals, idx = score.topk(min(K, S), -1)
    idx = torch.where(vals >= 0, idx, S).sort(-1).values
    return torch.where(idx == S, -1, idx).to(torch.int32)[None]


def prove_items2() -> list[dict]:
    """Call 2: the defaults end to end (no tune) on 1024 / 984 queries, each dq launch, the block pattern's
    forward launches (kb128g128 rows), the selection."""
    items = []
    for spec in SPECS:  # what the later phases need most first
        items += [{"spec": spec, "default": True}, {"spec": spec, "session9": True},
                  {"spec": spec, "default": True, "odd": True}, {"spec": spec, "select": True}]
    for spec in SPECS:
        items += [{"spec": spec, "dq_tune": list(t)} for t in DQ[spec]]
    items += [{"spec": "kb128g128", "fwd_tune": list(t)} for t in PATTERN]
    items.sort(key=lambda it: "tma" in it.get("fwd_tune", []) + it.get("dq_tune", []))
    for i, it in enumerate(items):
        it["id"] = i
    return items


def item_tune(it: dict):
    """The `tune` of a proof item (None: the defaults)."""
    if it.get("default"):
        return None
    if it.get("session9"):
        return dict(SESSION9)
    t = {}
    for x in ("fwd", "dq", "dkdv"):
        if f"{x}_tune" in it:
            t[x] = tuple(it[f"{x}_tune"])
    return t


def prove_items() -> list[dict]:
    """Per spec: each dk/dv launch with the default forward (and the device lists on 984 queries: partial tiles),
    each other forward launch with the default dk/dv, and the selection; so a failing (e.g. TMA) forward does not
    take a dk/dv launch down with it."""
    items = []
    for spec in SPECS:
        f0 = list(FWD[spec][0])
        items += [{"spec": spec, "fwd_tune": f0, "dkdv_tune": list(d)} for d in DKDV]
        items += [{"spec": spec, "odd": True, "fwd_tune": f0, "dkdv_tune": list(d)} for d in DKDV[1:]]
        items += [{"spec": spec, "fwd_tune": list(f), "dkdv_tune": list(DKDV[1])} for f in FWD[spec][1:]]
        items.append({"spec": spec, "select": True})
    # TMA launches last: each child takes every n-th item, so a faulting one (a sticky CUDA error) ends a child
    # only after its other items
    items.sort(key=lambda it: "tma" in it.get("fwd_tune", []))
    for i, it in enumerate(items):
        it["id"] = i
    return items


def grad_check(q, k, v, rows, G: int, kb: int, go, tune: dict) -> dict:
    from sparse_rl.bench.timing import rel_err
    from sparse_rl.sparse.ops import shared_to_per_query
    from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention

    per = shared_to_per_query(rows, G, q.shape[1])
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    o, lse = sparse_attention(qs, ks, vs, rows, query_group=G, key_block=kb, fwd_path="block", tune=tune)
    (o.float() * go.float()).sum().backward()
    qr, kr, vr = (x.detach().float().clone().requires_grad_() for x in (q, k, v))
    ro, rl = sparse_attention_naive(qr, kr, vr, per)
    (ro * go.float()).sum().backward()
    fin = torch.isfinite(rl)
    r = {"out": rel_err(o.detach(), ro.detach()), "dq": rel_err(qs.grad, qr.grad), "dk": rel_err(ks.grad, kr.grad),
         "dv": rel_err(vs.grad, vr.grad), "lse_max_abs": float((lse.detach()[fin] - rl.detach()[fin]).abs().max()),
         "finite": bool(torch.isfinite(qs.grad).all() and torch.isfinite(ks.grad).all())}
    r["ok"] = r["finite"] and max(r[x] for x in ("out", "dq", "dk", "dv")) < 2e-2 and r["lse_max_abs"] < 2e-2
    return r


def prove(a, dev, part: str) -> None:
    """Child process: this part's items, one JSON line each after a synchronise."""
    from sparse_rl.bench.granular import parse_granularity

    head, _, _ = part.partition(":")
    i, n = (int(x) for x in head.split("/"))
    items = (prove_items2() if a.call == 2 else prove_items())[i::n]
    if a.cpu_smoke and not os.environ.get("GRAN10_SMOKE_ALL"):
        items = items[:3]
    B, H, Hkv, D, _ = a.shape
    HI, DI = a.index
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(1)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dt)  # noqa: E731
    for it in items:
        kb, G = parse_granularity(it["spec"])
        r = dict(it)
        if it.get("select"):  # the new selection == the session-9 one; 4x the check length and the run's top-k:
            # the 32K specialisations (the block top-k's and the assembly's block counts) compile here
            T = 4 * a.check_T
            qi, ki, wi = rnd(B, T, HI, DI), rnd(B, T, DI), torch.rand(B, T, HI, device=dev, generator=gen).to(dt)
            K = a.shape[4]
            r["ok"] = bool(torch.equal(new_select(qi, wi, ki, K, kb, G, a.sink, a.window),
                                       legacy_select(qi, wi, ki, K, kb, G, a.sink, a.window)))
        else:
            T = a.check_T - 40 if it.get("odd") else a.check_T
            q, k, v, go = rnd(B, T, H, D), rnd(B, T, Hkv, D), rnd(B, T, Hkv, D), rnd(B, T, H, D)
            rows = rows_like(-(-T // G), G, T, a.check_topk, kb, a.sink, a.window, gen, dev)
            r.update(grad_check(q, k, v, rows, G, kb, go, item_tune(it)))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        with open(os.path.join(a.prove_dir, f"prove.{i}.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")


def proven(a, run: Run, timeout_s: float) -> dict:
    import shutil
    import tempfile

    a.prove_dir = tempfile.mkdtemp(prefix="gran10-prove-")
    info = parallel_warmup(os.path.abspath(__file__), sys.argv[1:] + ["--prove-dir", a.prove_dir], max(1, a.jobs),
                           timeout_s)
    done = {}
    for f in sorted(os.listdir(a.prove_dir)):
        for line in open(os.path.join(a.prove_dir, f)):
            if line.strip():
                r = json.loads(line)
                done[r["id"]] = r
    shutil.rmtree(a.prove_dir, ignore_errors=True)
    info["not_run"] = [it["id"] for it in (prove_items2() if a.call == 2 else prove_items()) if it["id"] not in done]
    run.res["prove"] = info
    return done


def ok_launches(done: dict) -> tuple[dict, set]:
    """Forward launches per spec and dk/dv launches proven ok (by every item that ran them; a dk/dv launch is
    judged by the items with the default forward only)."""
    bad_f, bad_k, seen_f, seen_k = set(), set(), set(), set()
    for r in done.values():
        if "fwd_tune" in r:
            (seen_f if r["ok"] else bad_f).add((r["spec"], tuple(r["fwd_tune"])))
            if tuple(r["fwd_tune"]) == FWD[r["spec"]][0]:
                (seen_k if r["ok"] else bad_k).add(tuple(r["dkdv_tune"]))
    fwd = {s: [t for t in FWD[s] if (s, t) in seen_f and (s, t) not in bad_f] for s in SPECS}
    return fwd, {t for t in DKDV if t in seen_k and t not in bad_k}


def prefill_phase(a, dev, run: Run, W: dict, spec: str, src: str, q, k, v, index, dense_ms: float,
                  before: dict | None = None) -> dict:
    """Selection alone and selection + attention, legacy vs new, the attention alone, timeline profiles; before:
    the attention's `tune` with the legacy selection (call 2: session 9's launches), else the defaults."""
    from sparse_rl.bench.granular import parse_granularity
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention

    kb, G = parse_granularity(spec)
    K = a.shape[4]
    sel = {"legacy": lambda: legacy_select(*index, K, kb, G, a.sink, a.window),
           "new": lambda: new_select(*index, K, kb, G, a.sink, a.window)}
    rows = sel["new"]()
    akw = dict(query_group=G, key_block=kb)
    r = {"spec": spec, "input": src, "L": q.shape[1], "dense_ms": dense_ms, "before_tune": before}
    r["attn_ms"] = bench_ms(lambda: sparse_attention(q, k, v, rows, **akw), dev, **W)
    if before:
        r["attn_before_ms"] = bench_ms(lambda: sparse_attention(q, k, v, rows, tune=before, **akw), dev, **W)
    for name, fn in sel.items():
        r[f"select_{name}_ms"] = bench_ms(fn, dev, **W)
        tune = before if name == "legacy" else None
        pre = lambda fn=fn, tune=tune: sparse_attention(q, k, v, fn(), tune=tune, **akw)  # noqa: E731
        r[f"prefill_{name}_ms"] = bench_ms(pre, dev, **W)
        r[f"prefill_{name}_speedup"] = dense_ms / r[f"prefill_{name}_ms"]
        r[f"profile_{name}"] = timeline_profile(pre, dev)
        r[f"select_profile_{name}"] = timeline_profile(fn, dev)
    log(f"{spec} {src} L={q.shape[1]}: attn {r['attn_ms']:.3f}; select legacy {r['select_legacy_ms']:.3f} new "
        f"{r['select_new_ms']:.3f}; prefill legacy {r['prefill_legacy_ms']:.3f} ({r['prefill_legacy_speedup']:.2f}x) new "
        f"{r['prefill_new_ms']:.3f} ({r['prefill_new_speedup']:.2f}x)")
    return r


def fwdbwd_phase(a, dev, run: Run, W: dict, spec: str, q, k, v, rows, grad, dense_fb: float, ok_k: set,
                 variants: list | None = None) -> dict:
    from sparse_rl.bench.granular import parse_granularity
    from sparse_rl.bench.timing import bench_ms, rel_err
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention

    kb, G = parse_granularity(spec)
    res = {"spec": spec, "dense_fwdbwd_ms": dense_fb, "variants": []}
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    base = None
    for t in variants or DKDV:
        if (variants is None and t not in ok_k) or not run.gate(8, f"{spec} fwd+bwd {t}"):
            continue
        tune = (t[1] if variants else {"dkdv": t})
        fn = lambda tune=tune: sparse_attention(qg, kg, vg, rows, query_group=G, key_block=kb,  # noqa: E731
                                                tune=tune)[0].backward(grad)
        for x in (qg, kg, vg):
            x.grad = None
        fn()
        got = (kg.grad.clone(), vg.grad.clone())
        base = base or got
        r = {"dkdv": list(t) if variants is None else t[0], "tune": {x: list(y) for x, y in (tune or {}).items()},
             "ms": bench_ms(fn, dev, grad_to_none=[qg, kg, vg], **W),
             "dk_vs_first": rel_err(got[0], base[0]), "dv_vs_first": rel_err(got[1], base[1])}
        r["speedup"] = dense_fb / r["ms"]
        for x in (qg, kg, vg):
            x.grad = None
        r["profile"] = timeline_profile(fn, dev)  # two calls: the second accumulates into the first's grads
        res["variants"].append(r)
        log(f"{spec} fwd+bwd dkdv {t}: {r['ms']:.3f} ms ({r['speedup']:.2f}x), gaps {r['profile'].get('gaps_ms')}")
    return res


def dq_sweep(a, dev, run: Run, W: dict, spec: str, q, k, v, rows, launches: list, pairs: int, grad) -> dict:
    """The block dq pass alone per launch (pointer vs tensor-descriptor loads) on the run's rows."""
    from sparse_rl.bench.granular import parse_granularity
    from sparse_rl.bench.timing import bench_ms, rel_err
    from sparse_rl.sparse.ops.sparse_attention import blocks, keymajor, union
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

    kb, G = parse_granularity(spec)
    D, L = q.shape[-1], q.shape[1]
    scale, prec = 1 / math.sqrt(D), dot_precision(q.dtype)
    sel = union.shared_tiles(rows, L, G, min(union.tile_queries(q.shape[2] // k.shape[2]), G), 0, bits=True)
    o, lse = blocks.block_fwd(q, k, v, sel, scale, prec, key_block=kb)
    delta = keymajor.bwd_delta(o, grad, torch.zeros_like(lse))
    flop = 1.5 * 4.0 * pairs * q.shape[2] * D
    res = {"spec": spec, "launches": []}
    ref = None
    for t in launches:
        if not run.gate(5, f"{spec} dq {t}"):
            break
        cache = {}
        got = blocks.block_dq(q, k, v, sel, grad, lse, delta, scale, prec, tune=t, cache=cache)
        ref = got if ref is None else ref
        ms = bench_ms(lambda t=t, cache=cache: blocks.block_dq(q, k, v, sel, grad, lse, delta, scale, prec, tune=t,
                                                               cache=cache), dev, **W)
        res["launches"].append({"tune": list(t), "ms": ms, "tflops_selected": flop / ms / 1e9, "vs_first": rel_err(got, ref)})
        log(f"{spec} block dq {t}: {ms:.3f} ms, vs first {res['launches'][-1]['vs_first']:.1e}")
    return res


def pattern_vs_flex(a, dev, run: Run, W: dict, launches: list) -> dict:
    """The block pattern (bench/attention.py: 128-key blocks, K/128 per query block incl. the diagonal) as shared
    rows g128: the block forward per launch and FlexAttention's block-sparse kernel (compiled) on the same input."""
    from sparse_rl.bench.attention import block_pattern, block_pattern_indices, flex_block_mask
    from sparse_rl.bench.timing import bench_ms, rel_err
    from sparse_rl.sparse.ops.sparse_attention import blocks, union
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

    B, H, Hkv, D, K = a.shape
    L, blk = a.seqlen, 128
    gen = torch.Generator(device=dev).manual_seed(3)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q, k, v = (torch.randn(B, L, h, D, device=dev, generator=gen).to(dt) for h in (H, Hkv, Hkv))
    fb, cnt = block_pattern(L, blk, max(1, K // blk), dev, gen)
    per = block_pattern_indices(fb, cnt, L, blk, K)
    rows = per[:, blk - 1::blk].contiguous()
    pairs = int((per >= 0).sum())
    scale, prec = 1 / math.sqrt(D), dot_precision(q.dtype)
    sel = union.shared_tiles(rows, L, blk, 32, 0, bits=True)
    res = {"pairs": pairs, "block": blk, "launches": []}
    ref = None
    for t in launches:
        if not run.gate(5, f"pattern {t}"):
            break
        cache = {}
        got = blocks.block_fwd(q, k, v, sel, scale, prec, tune=t, cache=cache)[0]
        ref = got if ref is None else ref
        ms = bench_ms(lambda t=t, cache=cache: blocks.block_fwd(q, k, v, sel, scale, prec, tune=t, cache=cache), dev, **W)
        res["launches"].append({"tune": list(t), "ms": ms, "tflops": 4.0 * pairs * H * D / ms / 1e9,
                                "vs_first": rel_err(got, ref)})
        log(f"block pattern: block fwd {t} {ms:.3f} ms")
    run.save()
    if dev.type == "cuda" and run.gate(30, "flex"):
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        qd, kd, vd = (x.transpose(1, 2) for x in (q, k, v))
        bm = flex_block_mask(fb, cnt, L, blk)
        fo = flex(qd, kd, vd, block_mask=bm, enable_gqa=True)
        res["flex_ms"] = bench_ms(lambda: flex(qd, kd, vd, block_mask=bm, enable_gqa=True), dev, **W)
        res["flex_tflops"] = 4.0 * pairs * H * D / res["flex_ms"] / 1e9
        res["flex_vs_first"] = rel_err(fo.transpose(1, 2), ref)
        for r in res["launches"]:
            r["vs_flex_speed"] = res["flex_ms"] / r["ms"]
        log(f"block pattern: flex {res['flex_ms']:.3f} ms ({res['flex_tflops']:.0f} TF/s)")
    return res


def sweep_phase(a, dev, run: Run, W: dict, spec: str, q, k, v, rows, launches: list, pairs: int) -> dict:
    from sparse_rl.bench.granular import parse_granularity
    from sparse_rl.bench.timing import bench_ms, rel_err
    from sparse_rl.sparse.ops.sparse_attention import blocks, union
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

    kb, G = parse_granularity(spec)
    D = q.shape[-1]
    L = q.shape[1]
    scale, prec = 1 / math.sqrt(D), dot_precision(q.dtype)
    sel = union.shared_tiles(rows, L, G, min(union.tile_queries(q.shape[2] // k.shape[2]), G), 0, bits=True)
    flop = 4.0 * pairs * q.shape[2] * D
    res = {"spec": spec, "pairs": pairs, "launches": []}
    ref = None
    for t in launches:
        if not run.gate(5, f"{spec} sweep {t}"):
            break
        cache = {}
        got = blocks.block_fwd(q, k, v, sel, scale, prec, tune=t, cache=cache)[0]
        ref = got if ref is None else ref
        ms = bench_ms(lambda t=t, cache=cache: blocks.block_fwd(q, k, v, sel, scale, prec, tune=t, cache=cache), dev, **W)
        res["launches"].append({"tune": list(t), "ms": ms, "tflops_selected": flop / ms / 1e9, "vs_first": rel_err(got, ref)})
        log(f"{spec} block fwd {t}: {ms:.3f} ms ({flop / ms / 1e9:.0f} TF/s), vs first {res['launches'][-1]['vs_first']:.1e}")
    return res


def main(argv=None):
    import threading

    import triton

    a = parse_args(argv)
    dev = torch.device("cpu" if a.cpu_smoke else "cuda")
    if a.warm_part:
        prove(a, dev, a.warm_part)
        return
    if a.call == 2:
        main2(a, dev)
        return
    from sparse_rl.bench import patterns
    from sparse_rl.bench.granular import check_output, check_selection, parse_granularity
    from sparse_rl.bench.timing import bench_ms, device_name
    from sparse_rl.sparse.ops import shared_to_per_query

    if dev.type == "cuda":
        torch.zeros(1, device=dev)
    run = Run(a.out, "granular10.json", a.budget, {"device": device_name(dev), "torch": torch.__version__,
                                                   "triton": triton.__version__, "commit": a.commit, "args": vars(a)})
    res = run.res
    box = {}
    th = threading.Thread(target=lambda: box.update(done=proven(a, run, min(60.0, run.left() - 75))))
    th.start()
    B, H, Hkv, D, K = a.shape
    HI, DI = a.index
    L = a.seqlen
    log("trained indexer + 32K inputs (launches proven in child processes meanwhile)")
    gen = torch.Generator(device=dev).manual_seed(0)
    ix, res["trained_indexer_kl"] = patterns.train_indexer(dev, gen, index_heads=HI, index_dim=DI, steps=a.train_steps,
                                                           crop=1024 if dev.type == "cuda" else 64)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dt)  # noqa: E731
    q, k, v = rnd(B, L, H, D), rnd(B, L, Hkv, D), rnd(B, L, Hkv, D)
    grad = torch.randn_like(q)
    inputs = {"trained": patterns.trained_index(ix, L, dev, gen),
              "random": (rnd(B, L, HI, DI), torch.rand(B, L, HI, device=dev, generator=gen).to(dt), rnd(B, L, DI))}
    th.join()
    done = box.get("done", {})
    res["checks"] = list(done.values())
    res["checks_ok"] = bool(done) and all(r["ok"] for r in done.values())
    ok_f, ok_k = ok_launches(done)
    res["proven_fwd"] = {s: [list(t) for t in x] for s, x in ok_f.items()}
    res["proven_dkdv"] = [list(t) for t in ok_k]
    log(f"proven fwd {res['proven_fwd']} dkdv {res['proven_dkdv']}; not run {res['prove']['not_run']}; "
        f"checks ok {res['checks_ok']}")
    run.save()
    # 2. checks at 32K
    res["select_checks"], rows = [], {}
    for spec in SPECS:
        kb, G = parse_granularity(spec)
        for src, index in inputs.items():
            if not run.gate(30, f"check {spec} {src}"):
                continue
            new = new_select(*index, K, kb, G, a.sink, a.window)
            c = {"spec": spec, "input": src,
                 "equal_legacy": bool(torch.equal(new, legacy_select(*index, K, kb, G, a.sink, a.window)))}
            kw = dict(sink=a.sink, window=a.window, key_block=kb, query_group=G, block_score="max")
            c.update(check_selection(new, *index, K, kw, min(L // G * G, max(G, 64 // G * G))))
            c.update(check_output(q, k, v, new, G, min(L, 64)))
            rows[(spec, src)] = new
            res["select_checks"].append(c)
            log(f"check {c}")
    run.save()
    # 3. dense
    W = dict(warmup_ms=5, rep_ms=a.rep_ms)
    dn = dense_times(q, k, v, dev, W, backward=True)
    res["dense"] = {str(L): dn}
    log(f"dense {dn}")
    run.save()
    # 4. prefill legacy vs new, then fwd+bwd with the lists
    res["prefill"], res["fwdbwd"] = [], []
    for spec in SPECS:
        for src in inputs:
            if (spec, src) in rows and run.gate(15, f"prefill {spec} {src}"):
                got = run.guarded(f"prefill {spec} {src}", prefill_phase, a, dev, run, W, spec, src, q, k, v,
                                  inputs[src], dn["dense_ms"])
                if got:
                    res["prefill"].append(got)
                run.save()
        if (spec, "trained") in rows and run.gate(15, f"fwd+bwd {spec}"):
            got = run.guarded(f"fwd+bwd {spec}", fwdbwd_phase, a, dev, run, W, spec, q, k, v, rows[(spec, "trained")],
                              grad, dn["dense_fwdbwd_ms"], ok_k)
            if got:
                res["fwdbwd"].append(got)
            run.save()
    # 5. forward launch sweep
    res["sweep"] = []
    for spec in SPECS:
        if (spec, "trained") in rows and ok_f[spec] and run.gate(12, f"sweep {spec}"):
            kb, G = parse_granularity(spec)
            r = rows[(spec, "trained")]
            pairs = int((shared_to_per_query(r, G, L) >= 0).sum())
            got = run.guarded(f"sweep {spec}", sweep_phase, a, dev, run, W, spec, q, k, v, r, ok_f[spec], pairs)
            if got:
                res["sweep"].append(got)
            run.save()
    # 6. 128K kb64g64 once
    if run.gate(25, f"L={a.long} kb64g64"):
        del q, k, v, grad, inputs, rows
        Ln = a.long
        q, k, v = rnd(B, Ln, H, D), rnd(B, Ln, Hkv, D), rnd(B, Ln, Hkv, D)
        index = patterns.trained_index(ix, Ln, dev, gen)
        dl = run.guarded(f"dense {Ln}", dense_times, q, k, v, dev, dict(warmup_ms=1, rep_ms=1), False)
        if dl:
            res["dense"][str(Ln)] = dl
            got = run.guarded("prefill 128K", prefill_phase, a, dev, run, W, "kb64g64", "trained", q, k, v, index,
                              dl["dense_ms"])
            if got:
                kb, G = parse_granularity("kb64g64")
                got["equal_legacy"] = bool(torch.equal(new_select(*index, K, kb, G, a.sink, a.window),
                                                       legacy_select(*index, K, kb, G, a.sink, a.window)))
                res["prefill"].append(got)
        run.save()
    run.save()
    summary(res)


def main2(a, dev) -> None:
    """Call 2: proofs, checks, dense, the defaults end to end (`bench.granular.granular_rows`: what `sparse-rl bench
    attention --granular` reports), session 9's path vs the defaults (prefill, fwd+bwd), the dq sweep, the block
    pattern vs Flex, 128K kb64g64."""
    import threading

    import triton

    from sparse_rl.bench import patterns
    from sparse_rl.bench.granular import check_output, check_selection, granular_rows, parse_granularity
    from sparse_rl.bench.timing import device_name
    from sparse_rl.sparse.ops import shared_to_per_query

    if dev.type == "cuda":
        torch.zeros(1, device=dev)
    run = Run(a.out, "granular10-call2.json", a.budget, {"device": device_name(dev), "torch": torch.__version__,
                                                         "triton": triton.__version__, "commit": a.commit, "args": vars(a)})
    res = run.res
    box = {}
    cap = 1e9 if os.environ.get("GRAN10_SMOKE_ALL") else 50.0  # the CPU rehearsal of every phase proves everything
    th = threading.Thread(target=lambda: box.update(done=proven(a, run, min(cap, run.left() - 85))))
    th.start()
    B, H, Hkv, D, K = a.shape
    HI, DI = a.index
    L = a.seqlen
    gen = torch.Generator(device=dev).manual_seed(0)
    ix, res["trained_indexer_kl"] = patterns.train_indexer(dev, gen, index_heads=HI, index_dim=DI, steps=a.train_steps,
                                                           crop=1024 if dev.type == "cuda" else 64)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dt)  # noqa: E731
    q, k, v = rnd(B, L, H, D), rnd(B, L, Hkv, D), rnd(B, L, Hkv, D)
    grad = torch.randn_like(q)
    inputs = {"trained": patterns.trained_index(ix, L, dev, gen),
              "random": (rnd(B, L, HI, DI), torch.rand(B, L, HI, device=dev, generator=gen).to(dt), rnd(B, L, DI))}
    th.join()
    done = box.get("done", {})
    res["checks"] = list(done.values())
    res["checks_ok"] = bool(done) and all(r["ok"] for r in done.values())
    ok = {(r["spec"], json.dumps(r.get("dq_tune") or r.get("fwd_tune"))) for r in done.values() if r["ok"]}
    defaults_ok = all(any(r["ok"] and r["spec"] == s and r.get("default") for r in done.values()) for s in SPECS) and \
        not any(not r["ok"] and r.get("default") for r in done.values())
    s9_ok = all(any(r["ok"] and r["spec"] == s and r.get("session9") for r in done.values()) for s in SPECS)
    log(f"checks ok {res['checks_ok']}, defaults ok {defaults_ok}, session-9 launches ok {s9_ok}, not run "
        f"{res['prove']['not_run']}")
    run.save()
    res["select_checks"], rows = [], {}
    for spec in SPECS:
        kb, G = parse_granularity(spec)
        for src, index in inputs.items():
            new = new_select(*index, K, kb, G, a.sink, a.window)
            c = {"spec": spec, "input": src,
                 "equal_legacy": bool(torch.equal(new, legacy_select(*index, K, kb, G, a.sink, a.window)))}
            kw = dict(sink=a.sink, window=a.window, key_block=kb, query_group=G, block_score="max")
            c.update(check_selection(new, *index, K, kw, min(L // G * G, max(G, 64 // G * G))))
            if defaults_ok:
                c.update(check_output(q, k, v, new, G, min(L, 64)))
            rows[(spec, src)] = new
            res["select_checks"].append(c)
            log(f"check {c}")
    run.save()
    W = dict(warmup_ms=5, rep_ms=a.rep_ms)
    dn = dense_times(q, k, v, dev, W, backward=True)
    res["dense"] = {str(L): dn}
    log(f"dense {dn}")
    run.save()
    res["rows"], res["prefill"], res["fwdbwd"], res["dq_sweep"] = [], [], [], []
    if defaults_ok:
        for spec in SPECS:  # the defaults end to end, as the bench reports them
            if not run.gate(20, f"end to end {spec}"):
                continue
            got = run.guarded(f"end to end {spec}", granular_rows, q, k, v, inputs, [spec], K, a.sink, a.window, dev, W,
                              dn["dense_ms"], dense_fwdbwd_ms=dn["dense_fwdbwd_ms"], grad=grad, check_n=64)
            for r in got or []:
                log(", ".join(f"{x}={y:.4g}" if isinstance(y, float) else f"{x}={y}" for x, y in r.items()))
                res["rows"].append(r)
            run.save()
    if defaults_ok and s9_ok:
        for spec in SPECS:  # session 9's path vs the defaults in the same run
            if run.gate(15, f"before/after prefill {spec}"):
                got = run.guarded(f"prefill {spec}", prefill_phase, a, dev, run, W, spec, "trained", q, k, v,
                                  inputs["trained"], dn["dense_ms"], before={"fwd": SESSION9["fwd"]})
                if got:
                    res["prefill"].append(got)
            if run.gate(15, f"before/after fwd+bwd {spec}"):
                got = run.guarded(f"fwd+bwd {spec}", fwdbwd_phase, a, dev, run, W, spec, q, k, v,
                                  rows[(spec, "trained")], grad, dn["dense_fwdbwd_ms"], set(),
                                  variants=[("session9", dict(SESSION9)), ("default", None)])
                if got:
                    res["fwdbwd"].append(got)
            run.save()
    for spec in SPECS:
        launches = [t for t in DQ[spec] if (spec, json.dumps(list(t))) in ok]
        if launches and run.gate(12, f"dq sweep {spec}"):
            kb, G = parse_granularity(spec)
            r = rows[(spec, "trained")]
            pairs = int((shared_to_per_query(r, G, L) >= 0).sum())
            got = run.guarded(f"dq sweep {spec}", dq_sweep, a, dev, run, W, spec, q, k, v, r, launches, pairs, grad)
            if got:
                res["dq_sweep"].append(got)
            run.save()
    if run.gate(20, f"L={a.long} kb64g64") and defaults_ok:
        del q, k, v, grad, inputs, rows
        Ln = a.long
        q, k, v = rnd(B, Ln, H, D), rnd(B, Ln, Hkv, D), rnd(B, Ln, Hkv, D)
        index = patterns.trained_index(ix, Ln, dev, gen)
        dl = run.guarded(f"dense {Ln}", dense_times, q, k, v, dev, dict(warmup_ms=1, rep_ms=1), False)
        if dl:
            res["dense"][str(Ln)] = dl
            got = run.guarded("128K", granular_rows, q, k, v, {"trained": index}, ["kb64g64"], K, a.sink, a.window,
                              dev, W, dl["dense_ms"], check_n=64)
            for r in got or []:
                log(", ".join(f"{x}={y:.4g}" if isinstance(y, float) else f"{x}={y}" for x, y in r.items()))
                res["rows"].append(r)
        del q, k, v, index
        run.save()
    launches = [t for t in PATTERN if ("kb128g128", json.dumps(list(t))) in ok]
    if launches and run.gate(15, "block pattern vs flex"):
        res["pattern"] = run.guarded("pattern", pattern_vs_flex, a, dev, run, W, launches)
    run.save()
    summary2(res)


def summary2(res: dict) -> None:
    print(f"checks ok: {res.get('checks_ok')}  skipped: {res['skipped']}  errors: {res['errors']}")
    for c in res.get("select_checks", []):
        print(f"select check {c}")
    print(f"dense: {res.get('dense')}")
    for r in res.get("rows", []):
        print({x: (round(y, 4) if isinstance(y, float) else y) for x, y in r.items()})
    for r in res.get("prefill", []):
        print(f"{r['spec']} before/after: attn {r.get('attn_before_ms', 0):.3f} -> {r['attn_ms']:.3f}, prefill "
              f"{r['prefill_legacy_ms']:.3f} ({r['prefill_legacy_speedup']:.2f}x) -> {r['prefill_new_ms']:.3f} "
              f"({r['prefill_new_speedup']:.2f}x)")
    for f in res.get("fwdbwd", []):
        for r in f["variants"]:
            print(f"{f['spec']} fwd+bwd {r['dkdv']}: {r['ms']:.3f} ms ({r['speedup']:.2f}x)")
    for s in res.get("dq_sweep", []):
        for r in s["launches"]:
            print(f"{s['spec']} dq {r['tune']}: {r['ms']:.3f} ms ({r['tflops_selected']:.0f} TF/s)")
    p = res.get("pattern") or {}
    for r in p.get("launches", []):
        print(f"pattern fwd {r['tune']}: {r['ms']:.3f} ms ({r['tflops']:.0f} TF/s)")
    print(f"pattern flex: {p.get('flex_ms')}")


def summary(res: dict) -> None:
    print(f"checks ok: {res.get('checks_ok')}  skipped: {res['skipped']}  errors: {res['errors']}")
    for c in res.get("select_checks", []):
        print(f"select check {c}")
    print(f"dense: {res.get('dense')}")
    for r in res.get("prefill", []):
        print(f"{r['spec']} {r['input']} L={r['L']}: attn {r['attn_ms']:.3f}, select {r['select_legacy_ms']:.3f} -> "
              f"{r['select_new_ms']:.3f}, prefill {r['prefill_legacy_ms']:.3f} ({r['prefill_legacy_speedup']:.2f}x) -> "
              f"{r['prefill_new_ms']:.3f} ({r['prefill_new_speedup']:.2f}x); gaps "
              f"{r['profile_legacy'].get('gaps_ms')} -> {r['profile_new'].get('gaps_ms')}")
    for f in res.get("fwdbwd", []):
        for r in f["variants"]:
            print(f"{f['spec']} fwd+bwd {r['dkdv']}: {r['ms']:.3f} ms ({r['speedup']:.2f}x)")
    for s in res.get("sweep", []):
        for r in s["launches"]:
            print(f"{s['spec']} fwd {r['tune']}: {r['ms']:.3f} ms ({r['tflops_selected']:.0f} TF/s)")


if __name__ == "__main__":
    main()
