"""Session 6 device run (issue 14): the decode step's measured split, the one-program-per-row decode
select A/B, and whole-generation sparse/dense ratios with the current step, in one call.

    PYTHONPATH=. python benchmarks/gpu_rollout_session6.py --out $OUT/roll6 --budget-s 178 --commit HASH
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/gpu_rollout_session6.py --out /tmp/r6 --smoke   (CPU)

Select variants (`ops.indexer_topk.decode`, set through its module defaults so the engine's graphs
capture them): chunked (the default before this run: score + five (chunk, row) passes + a memset), row
(score + one program per row: `decode_row.py`), split (score + three (chunk, row) passes, no memset:
`decode_split.py`); *_sort: the threshold by one in-register sort of <= 1024 candidates, not radix levels.
Phases (JSON rewritten after each; a phase that does not fit the budget left is skipped and named):
1. correctness, tiny Qwen3 shape, fp32, sparse (top-k 32 over ~150-token sequences), every variant:
   engine greedy tokens == HF generate on the reference path; engine log-probs (temperature 1) vs a
   teacher-forced forward; then the select alone at 32 x 16K (bf16, random keys, mixed-sign weights):
   every variant's keys == the chunked kernel's (same scores), and at 4 x 3000 with integer inputs
   (exact scores, ties) == the PyTorch reference; the select alone timed (CUDA-graph replay).
2. Qwen3-4B shape, batch 32, 16K context: step ms (graph replay, median of 20) dense and per variant,
   with the floor; a torch.profiler split of ONE sparse step per kernel class (graph replay: chunked
   and the fastest new variant; eager: chunked), and of one dense step if the budget allows.
3. Whole generations, 128-token prompts: 16K new tokens at batch 32 and 32K at batch 16, dense and
   sparse (the fastest new variant, chunked, the fastest of the other design): integrated from step
   times over the context plus
   the per-step overhead a short real generation pays (`bench.rollout._integrated`), not timed end to end.
Writes $OUT/results.json; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch

T0 = time.time()
RES: dict = {"errors": [], "skipped": []}
OUT: list = []  # the output dir, once known
VARIANTS = {"chunked": ("chunked", 0), "row": ("row", 0), "row_sort": ("row", 1024), "split": ("split", 0),
            "split_sort": ("split", 1024)}
CLASSES = (("gemm", ("gemm", "nvjet", "cutlass", "xmma", "splitk", "gemv")),
           ("attention", ("_fwd_kernel", "_merge_kernel")),
           ("indexer_score", ("_score_max",)),
           ("select", ("_hist", "_count", "_gather_cands", "_select", "_write", "_row_select", "fill", "memset")),
           ("norm_rope_cache", ("_add_rmsnorm", "_qk_rope", "_indexer_decode", "_silu_mul", "index_put", "scatter")))


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def save():
    RES["elapsed_s"] = round(time.time() - T0, 1)
    if OUT:
        json.dump(RES, open(f"{OUT[0]}/results.json", "w"), indent=1)


def left(budget):
    return budget - (time.time() - T0)


def use(variant):
    """Make `variant` the decode select every later call (and every graph captured after) runs."""
    from sparse_rl.sparse.ops.indexer_topk import decode as itd

    itd.DECODE_IMPL, itd.SORT_CANDIDATES = VARIANTS[variant]


def correctness(dev, smoke):
    from sparse_rl.bench.floor import SHAPES, build_model
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.layer import set_attention
    from sparse_rl.sparse.patch import attach_sparse

    model = build_model(SHAPES["tiny-qwen3"], 512, dev, torch.float32)
    attach_sparse(model, SparseConfig(topk=32, index_heads=2, index_dim=16, rope_dim=8, sink=2, window=4,
                                      dense_layers=[0]))
    model.to(torch.float32)
    set_attention(model, "sparse")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (21, 47, 9)]
    new = 12 if smoke else 48
    out = {}
    hf = []
    for p in prompts:  # the reference path (HF generate over the model's sparse attention): no decode select
        with torch.inference_mode():
            hf.append(model.generate(torch.tensor([p], device=dev), max_new_tokens=new, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(p):].tolist())
    for v in ("chunked", "row", "split"):  # the *_sort variants' keys are checked by `select_alone`
        try:
            out[v] = _tiny_check(model, prompts, hf, new, v, dev, smoke)
        except Exception as e:
            RES["errors"].append(f"correctness {v}: {type(e).__name__}: {str(e)[:300]}")
        log(f"correctness {v}: {out.get(v)}")
    use("chunked")
    return out


def _tiny_check(model, prompts, hf, new, v, dev, smoke) -> dict:
    """Greedy tokens vs HF generate (hf), sampled log-probs vs a teacher-forced forward, select variant v."""
    from sparse_rl.rl.rollout import RolloutEngine, SamplingParams, process_logits

    use(v)
    if smoke and v == "row":  # the engine on the Triton kernels (interpreter: slow), the reference on PyTorch ops
        os.environ["SPARSE_RL_BACKEND"] = "triton"
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=7)
    try:
        eng = RolloutEngine(model, None, max_batch=3, max_seq_len=256, device=dev, eos_token_ids=[])
        greedy = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=new))
        samples = eng.generate(prompts, params)
    finally:
        os.environ.pop("SPARSE_RL_BACKEND", None)
        use("chunked")
    lp_diff = 0.0
    for c in samples:
        with torch.inference_mode():
            ids = torch.tensor([c.prompt_tokens + c.tokens], device=dev)
            logits = model(input_ids=ids).logits[0, len(c.prompt_tokens) - 1:-1].float()
            ref = process_logits(logits, params).gather(-1, torch.tensor(c.tokens, device=dev)[:, None])[:, 0]
        lp_diff = max(lp_diff, float((torch.tensor(c.logprobs, device=dev) - ref).abs().max()))
    return {"greedy_equal_hf": f"{sum(r == c.tokens for r, c in zip(hf, greedy))}/{len(prompts)}",
            "logprobs_max_abs_diff": lp_diff, "graphs": eng.runner.use_graphs, "graph_error": eng.runner.graph_error}


def select_alone(dev, smoke, shapes, more: bool):
    """The select alone (CUDA-graph replay) at each (batch, context) of `shapes` (bf16 keys, random,
    LayerNorm'd; mixed-sign head weights): every variant, its keys against the chunked kernel's (same
    scores); first (more=False) at 4 x 3000 with integer inputs (exact scores, ties) against the PyTorch
    reference. more=True: at the first shape only row and its block / warps / chunk choices."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive

    K, sink, window = (40, 2, 4) if smoke else (2048, 4, 64)
    dt = torch.float32 if smoke else torch.bfloat16
    kw = dict(sink=sink, window=window)
    gi = torch.Generator(device=dev).manual_seed(10)
    Bi, Si, Ki = (3, 200, 24) if smoke else (4, 3000, 512)
    qi = torch.randint(-2, 3, (Bi, 4, 64), device=dev, generator=gi).to(dt)
    wi = torch.randint(-1, 3, (Bi, 4), device=dev, generator=gi).to(dt)
    ki = torch.randint(-2, 3, (Bi, Si, 64), device=dev, generator=gi).to(dt)
    pi = torch.tensor([Si - 1, Si // 2, Ki // 2, Si - 7][:Bi], device=dev)
    refi = indexer_topk_decode_naive(qi.float(), wi.float(), ki.float(), pi, Ki, **kw)
    out = {"ints_equal_reference": {}, "shapes": []}
    for v, (impl, sort) in (() if more else VARIANTS.items()):
        out["ints_equal_reference"][v] = bool(torch.equal(itd.indexer_topk_decode(qi, wi, ki, pi, Ki, impl=impl,
                                                                                  sort=sort, **kw), refi))
    log(f"select, integer inputs == reference: {out['ints_equal_reference']}")
    extras = {} if smoke or not more else {"row_b2048_w8": dict(impl="row", row_block=2048, row_warps=8),
                              "row_b8192_w16": dict(impl="row", row_block=8192, row_warps=16),
                                          "row_chunk512": dict(impl="row", chunk=512),
                                          "row_chunk2048": dict(impl="row", chunk=2048)}
    for si, (B, S) in enumerate([(3, 300)] if smoke else shapes):
        g = torch.Generator(device=dev).manual_seed(9 + si)
        k = torch.nn.functional.layer_norm(torch.randn(B, S, 64, device=dev, generator=g), (64,)).to(dt)
        q = torch.randn(B, 4, 64, device=dev, generator=g).to(dt)
        w = torch.randn(B, 4, device=dev, generator=g).to(dt)  # mixed signs, as a converted model's
        pos = torch.full((B,), S - 1, device=dev)
        pos[1::2] = torch.randint(S // 4, S, (B // 2,), device=dev, generator=g)
        base = itd.indexer_topk_decode(q, w, k, pos, K, impl="chunked", sort=0, **kw)
        row = {"batch": B, "context": S, "floor_ms": round(1e3 * B * S * 128 / RES.get("copy_bw", 4.27e12), 4),
               "variants": {}}
        vs = ({"row": dict(impl="row")} if more and si == 0
              else {v: dict(impl=i, sort=s) for v, (i, s) in VARIANTS.items()})
        vs.update(extras if si == 0 else {})
        for v, args in vs.items():
            try:
                got, n_c = itd.indexer_topk_decode(q, w, k, pos, K, candidates=True, **args, **kw)
            except Exception as e:
                RES["errors"].append(f"select {v} {B}x{S}: {type(e).__name__}: {str(e)[:300]}")
                continue
            ms = -1.0 if smoke else bench_ms(lambda: itd.indexer_topk_decode(q, w, k, pos, K, **args, **kw), dev,
                                             graph=True)  # -1: not timed (the interpreter)
            row["variants"][v] = {"ms_graph": round(ms, 4), "equal_chunked": bool(torch.equal(got, base)),
                                  "candidates_mean": round(float(n_c.float().mean()), 1),
                                  "candidates_max": int(n_c.max())}
        log(f"select alone {B} x {S}: {row}")
        out["shapes"].append(row)
    return out


def classify(name: str) -> str:
    n = name.lower()
    for cls, keys in CLASSES:
        if any(x.lower() in n for x in keys):
            return cls
    return "other"


def profile_step(eng, ctx, mode, graph: bool) -> dict:
    """GPU kernel time of ONE decode step at every slot's position ctx-1, by kernel class and by name."""
    from torch.profiler import ProfilerActivity, profile

    cache = eng._ensure_cache(ctx)
    B = eng.max_batch
    tok = torch.zeros(B, dtype=torch.long, device=eng.device)
    pos = torch.full_like(tok, ctx - 1)
    S = eng._bucket(ctx, cache.s_max)
    eng.set_attention(mode)
    step = (lambda: eng.runner.decode(cache, tok, pos, S, mode)) if graph else \
        (lambda: eng.runner.decode_eager(cache, tok, pos, S, mode))
    with torch.inference_mode():
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    by_name: dict = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = by_name[e.name[:90]]
            a[0] += e.device_time
            a[1] += 1
    cls: dict = defaultdict(lambda: [0.0, 0])
    for n, (us, c) in by_name.items():
        x = cls[classify(n)]
        x[0] += us
        x[1] += c
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:30]
    return {"graph": graph, "kernel_us_total": round(sum(v[0] for v in by_name.values()), 1),
            "kernels": sum(v[1] for v in by_name.values()),
            "classes_us": {k: round(v[0], 1) for k, v in sorted(cls.items(), key=lambda kv: -kv[1][0])},
            "classes_launches": {k: v[1] for k, v in cls.items()},
            "top": [{"kernel": n, "us": round(v[0], 1), "calls": v[1]} for n, v in top]}


def step_ab(b, eng, ctx, smoke, budget) -> dict:
    out = {"rows": [], "profiles": {}}
    eng.set_attention("sparse")  # the index-key cache exists before the fill (the 2026-12-01 run filled none)
    b.fill(eng, ctx)
    B = eng.max_batch
    out["rows"].append(b.step_row(eng, B, ctx, "dense"))
    log(out["rows"][-1])
    for v in VARIANTS:
        use(v)
        eng.runner.drop_graphs()
        try:
            r = b.step_row(eng, B, ctx, "sparse")
        except Exception as e:  # one variant failing (a compile error) keeps the others
            RES["errors"].append(f"step {v}: {type(e).__name__}: {str(e)[:300]}")
            continue
        r["variant"] = v
        out["rows"].append(r)
        log(r)
    sp = {r["variant"]: r["ms"] for r in out["rows"] if r.get("variant")}
    out["best"] = min((v for v in sp if v != "chunked"), key=sp.get)
    if not smoke:
        for v in ("chunked", out["best"]):
            use(v)
            eng.runner.drop_graphs()
            for graph in ((False, True) if v == "chunked" else (True,)):
                try:
                    p = profile_step(eng, ctx, "sparse", graph)
                    out["profiles"][f"{v}_{'graph' if graph else 'eager'}"] = p
                    log(f"profile {v} graph={graph}: {p['kernel_us_total']} us, {p['kernels']} kernels, "
                        f"{p['classes_us']}")
                except Exception as e:
                    RES["errors"].append(f"profile {v} graph={graph}: {type(e).__name__}: {str(e)[:300]}")
        if left(budget) > 125:  # the whole generations come first
            out["profiles"]["dense_graph"] = profile_step(eng, ctx, "dense", True)
    use("chunked")
    eng.runner.drop_graphs()
    return out


def whole(b, new, B, variants, P, budget, per_mode_s, name, dense: bool = True) -> list:
    from sparse_rl.bench.rollout import _integrated

    ids = b.prompts(B, P)
    eng = b.engine(B, P + new)
    rows = RES[name] = []  # saved row by row: a timeout mid-phase keeps what was measured
    for mode, v in [("dense", None)] * dense + [("sparse", v) for v in variants]:
        if left(budget) < per_mode_s:
            RES["skipped"].append(f"whole {new} batch {B} {mode} {v or ''}")
            continue
        if v:
            use(v)
        eng.runner.drop_graphs()
        t = time.time()
        try:
            secs, extra = _integrated(b, eng, ids, new, mode)
        except Exception as e:
            RES["errors"].append(f"whole {new} {mode} {v}: {type(e).__name__}: {str(e)[:300]}")
            continue
        floor_s = b.floor_gen_s(B, P, new, mode)
        rows.append({"mode": mode, "variant": v, "batch": B, "prompt": P, "new_tokens": new, "how": "integrated",
                     "seconds": round(secs, 3), "tokens_per_s": round(B * new / secs, 1),
                     "ms_per_step": round(1e3 * secs / new, 3), "floor_tokens_per_s": round(B * new / floor_s, 1),
                     "x_floor": round(secs / floor_s, 2), "wall_s": round(time.time() - t, 1), **extra})
        log({k: x for k, x in rows[-1].items() if k != "step_points"})
        save()
    use("chunked")
    del eng
    if b.dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=178)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--smoke", action="store_true", help="a CPU run of the script itself at tiny sizes")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    OUT.append(a.out)
    from sparse_rl.bench.rollout import BenchRolloutConfig, _Bench

    dev = torch.device("cpu" if a.smoke else "cuda")
    if a.smoke:  # the interpreter's sort of 1024 keys in every program takes minutes
        VARIANTS.update({v: (i, min(srt, 64)) for v, (i, srt) in VARIANTS.items()})
    RES.update({"commit": a.commit, "torch": torch.__version__, "budget_s": a.budget_s,
                "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"})

    def phase(name, fn, need_s):
        if left(a.budget_s) < need_s:
            RES["skipped"].append(name)
            log(f"skip {name}: {left(a.budget_s):.0f} s left")
            return None
        try:
            RES[name] = fn()
        except Exception as e:  # keep the later phases
            RES["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
            log(RES["errors"][-1])
        save()
        return RES.get(name)

    phase("correctness", lambda: correctness(dev, a.smoke), 150)
    if a.smoke:
        cfg = BenchRolloutConfig(shape="tiny-qwen3", hf=False, long_new_tokens=[160, 200], long_batches=[3, 2],
                                 long_prompt_len=16, whole="integrate", topk=48, index_heads=2, index_dim=16,
                                 device="cpu", dtype="float32")
    else:
        cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, long_new_tokens=[16384, 32768], long_batches=[32, 16],
                                 long_prompt_len=128, whole="integrate", topk=2048, index_heads=4, index_dim=64)
    b = _Bench(cfg, log, None)
    RES["copy_bw"] = b.bw
    RES["copy_bw_tb_s"] = round(b.bw / 1e12, 3)
    b.attach_sparse()
    log(f"model built, copy {RES['copy_bw_tb_s']} TB/s")
    phase("select_alone", lambda: select_alone(dev, a.smoke, [(32, 16384)], False), 120)
    (new16, B16), (new32, B32) = cfg.long_runs()
    P = cfg.long_prompt_len
    ctx = 160 if a.smoke else 16384

    def steps():
        eng = b.engine(B16, P + new16)
        try:
            return step_ab(b, eng, ctx, a.smoke, a.budget_s)
        finally:
            del eng
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    st = phase("steps_16k_b32", steps, 100)
    best, second = "row", "split"
    if st:
        sp = {r["variant"]: r["ms"] for r in st["rows"] if r.get("variant")}
        best = st["best"]
        second = min((v for v in sp if v not in ("chunked", best) and v.split("_")[0] != best.split("_")[0]),
                     key=sp.get)
    # the fastest new variant first: if the budget runs out, the later ones are what is lost
    # (phase, new tokens, batch, sparse variants, with dense, seconds needed to start, seconds a mode needs)
    for name, new, B, vs, dense, need, per_mode in (("whole_16k_b32", new16, B16, [best, "chunked"], True, 40, 14),
                                                   ("whole_32k_b16", new32, B32, [best, "chunked"], True, 45, 16),
                                                   ("whole_16k_b32_second", new16, B16, [second], False, 16, 14),
                                                   ("whole_32k_b16_second", new32, B32, [second], False, 18, 16)):
        phase(name, lambda: whole(b, new, B, vs, P, a.budget_s, per_mode, name, dense), need)
    # what is left: the select alone at other sizes, and the row program's block / warps / chunk choices
    phase("select_alone_more", lambda: select_alone(dev, a.smoke, [(32, 16384), (16, 32768), (32, 4096)], True), 20)
    save()
    print("\n| phase | mode | variant | ms / tokens/s | floor | x floor |\n|---|---|---|---|---|---|")
    for r in (RES.get("steps_16k_b32") or {}).get("rows", []):
        print(f"| step b{r['batch']} {r['context']} | {r['mode']} | {r.get('variant', '-')} | {r['ms']} ms | "
              f"{r['floor_ms']} | {r['x_floor']} |")
    for k in ("whole_16k_b32", "whole_32k_b16", "whole_16k_b32_second", "whole_32k_b16_second"):
        for r in RES.get(k) or []:
            print(f"| {k} | {r['mode']} | {r['variant'] or '-'} | {r['tokens_per_s']} tok/s | "
                  f"{r['floor_tokens_per_s']} | "
                  f"{r['x_floor']} |")
    for sh in [x for k in ("select_alone", "select_alone_more") for x in (RES.get(k) or {}).get("shapes", [])]:
        for v, r in sh["variants"].items():
            print(f"| select {sh['batch']} x {sh['context']} | sparse | {v} | {r['ms_graph']} ms | {sh['floor_ms']} | "
                  f"same keys {r['equal_chunked']} |")
    log(f"done; skipped {RES['skipped']}; errors {RES['errors']}")


if __name__ == "__main__":
    main()
