"""Session 9 device run (issue 14), on the shared harness (granular_harness.Run + rollout_harness): the `fine`
decode select with its sub-bin compaction over only the chunks that hold the sub-bin's keys (decode_fine.py),
alone against the chunked / row forms and in the step; fp8 index keys (time and selection overlap vs bf16);
batch-1 steps vs their floor; the profile's kernel count; whole generations with the best variant.

    PYTHONPATH=$PWD python benchmarks/gpu_rollout_session9.py --budget 140 --call 1 --commit SHA     (H200)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_rollout_session9.py --cpu-smoke --budget 900

Every phase is gated on the time LEFT of --budget (its estimate in NEED), every row inside on a few seconds,
and the JSON is rewritten after each row: a cut-off run keeps what it measured. Writes
$OUT/roll9/session9_call<N>.json and .log. Variants are `rollout_harness.Variant`s (the runner's
`decode_select` / `qkv_pad` arguments; no module globals).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import rollout_harness as rh  # noqa: E402
from granular_harness import T0, Run, log  # noqa: E402
from sparse_rl.sparse.ops.indexer_topk.decode_select import DecodeSelect  # noqa: E402

V = rh.Variant
OUT = ("o_proj", "down_proj")  # the two GEMMs cuBLAS runs as split-K + a reduce at M = 32
VARIANTS = {"base": V(), "autofine": V(DecodeSelect(long="fine")), "fine": V(DecodeSelect("fine")),
            "fine4k": V(DecodeSelect(row_max_keys=4096, long="fine")), "skinny": V(skinny_gemm=True),
            "autofine_skinny": V(DecodeSelect(long="fine"), skinny_gemm=True),
            "fine_skinny": V(DecodeSelect("fine"), skinny_gemm=True),
            "fine4k_skinny": V(DecodeSelect(row_max_keys=4096, long="fine"), skinny_gemm=True),
            "autofine_s64": V(DecodeSelect(long="fine", score_block=64)),
            "autofine_s64_skinny": V(DecodeSelect(long="fine", score_block=64), skinny_gemm=True),
            "fine_s64": V(DecodeSelect("fine", score_block=64)), "skout": V(skinny_gemm=OUT),
            "autofine_s64_skout": V(DecodeSelect(long="fine", score_block=64), skinny_gemm=OUT)}
# estimated device seconds of each phase (session 8's measured costs, scaled to this call's rows)
NEED = {"setup": 14, "select_check": 6, "alone": 14, "steps": 16, "profile": 8, "batch1": 14, "fp8": 16,
        "whole_16k_b32": 28, "whole_32k_b16": 24, "engine_check": 14, "gemm": 10}
# call 1 measured (H200): select check 22 s (CUDA start and compiles), setup 13, alone 33 (4 contexts, 17 forms),
# steps 8, profile 1, batch 1 11, fp8 3, whole 16K 31 (dense + 2 sparse)


def select_check(dev, smoke) -> dict:
    """The select alone == the reference: integer inputs (exact scores, heavy ties) for chunked / fine / fine
    cap 2 (its radix fallback), and random bf16 rows (fine), in the sizes the step never reaches on a CPU."""
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive

    dt = torch.float32 if smoke else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(10)
    B, S, K = (3, 200, 24) if smoke else (4, 3000, 512)
    q = torch.randint(-2, 3, (B, 4, 64), device=dev, generator=g).to(dt)
    w = torch.randint(-1, 3, (B, 4), device=dev, generator=g).to(dt)
    k = torch.randint(-2, 3, (B, S, 64), device=dev, generator=g).to(dt)
    pos = torch.tensor([S - 1, S // 2, K // 2, S - 7][:B], device=dev)
    ref = indexer_topk_decode_naive(q.float(), w.float(), k.float(), pos, K, sink=2, window=4)
    out = {"ints": {n: bool(torch.equal(itd.indexer_topk_decode(q, w, k, pos, K, impl=i, sink=2, window=4, **x), ref))
                    for n, i, x in (("chunked", "chunked", {}), ("fine", "fine", {}),
                                    ("fine_cap2", "fine", {"fine_cap": 2}))}}
    B, S, K, win = (2, 300, 40, 8) if smoke else (8, 20000, 2048, 64)
    q, w = torch.randn(B, 4, 64, device=dev, generator=g).to(dt), torch.randn(B, 4, device=dev, generator=g).to(dt)
    k = torch.randn(B, S, 64, device=dev, generator=g).to(dt)
    pos = torch.randint(K, S, (B,), device=dev, generator=g)
    pos[0] = S - 1
    ref = indexer_topk_decode_naive(q.float(), w.float(), k.float(), pos, K, sink=4, window=win)
    got, n2 = itd.indexer_topk_decode(q, w, k, pos, K, impl="fine", candidates=True, sink=4, window=win)
    out["random_fine"] = bool(torch.equal(got, ref))
    out["random_fine_sub_bin_keys"] = n2.tolist()
    for cb in (32, 64):
        out[f"random_fine_cb{cb}"] = bool(torch.equal(rh.fine_with(q, w, k, pos.to(torch.int32), K, 4, win, cb=cb), ref))
    log(f"select == reference: {out}")
    return out


def alone(run, b, eng, ctxs, smoke, call: int = 1) -> dict:
    """Score + select alone on the engine's layer-2 index cache (`[:, :ctx]`, all rows at ctx - 1), graph-timed,
    against the index keys' bytes: chunked / row / fine, fine with 32- and 64-slot compaction steps, the score
    pass alone, and fp8 keys (the same keys quantized: time, and the selection's overlap with bf16's)."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import quantize_index_keys
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.decode_fine import fine_chunk

    cache = eng._ensure_cache(max(ctxs))
    dev, K, B = eng.device, b.cfg.topk, eng.max_batch
    HI, DI = b.cfg.index_heads, b.cfg.index_dim
    sink, win = min(4, K // 4), min(64, K // 4)
    res = {}
    g = torch.Generator(device=dev).manual_seed(3)
    for ctx in ctxs:
        if not run.gate(4, f"alone {ctx}"):
            break
        view = cache.idx[2][:, :ctx]
        qi = torch.randn(B, HI, DI, device=dev, generator=g).to(view.dtype)
        wi = torch.randn(B, HI, device=dev, generator=g).to(view.dtype)
        pos = torch.full((B,), ctx - 1, device=dev, dtype=torch.int32)
        floor = 1e3 * B * ctx * DI * view.element_size() / b.bw
        row = res[str(ctx)] = {"context": ctx, "batch": B, "floor_ms": round(floor, 4), "forms": {}}
        ch = {"chunk": 32} if smoke else {}
        base = itd.indexer_topk_decode(qi, wi, view, pos, K, impl="chunked", sink=sink, window=win, **ch)
        forms = {"chunked": lambda: itd.indexer_topk_decode(qi, wi, view, pos, K, impl="chunked", sink=sink,
                                                            window=win, **ch),
                 "row": lambda: itd.indexer_topk_decode(qi, wi, view, pos, K, impl="row", sink=sink, window=win, **ch),
                 "fine": lambda: itd.indexer_topk_decode(qi, wi, view, pos, K, impl="fine", sink=sink, window=win,
                                                         **ch)}
        if call == 2:  # the score pass's key step (registers, programs resident an SM) in each form
            forms = {"chunked": forms["chunked"], "fine": forms["fine"], **({"row": forms["row"]} if ctx <= 8192 else {})}
            for sb in (64,):
                for impl in ("fine", "row", "chunked"):
                    if impl == "row" and ctx > 8192 or impl == "chunked" and ctx <= 8192:
                        continue
                    forms[f"{impl}_s{sb}"] = (lambda impl=impl, sb=sb: itd.indexer_topk_decode(
                        qi, wi, view, pos, K, impl=impl, sink=sink, window=win, score_block=sb, **ch))
            if ctx == max(ctxs):
                CH = fine_chunk(B, ctx, smoke)
                for sb in (64, 128, 256):
                    forms[f"score_only_s{sb}"] = lambda sb=sb: rh.score_pass(qi, wi, view, pos, CH, sink, win, bn=sb)
        elif ctx == max(ctxs):
            for cb in (32, 64):
                forms[f"fine_cb{cb}"] = (lambda cb=cb: rh.fine_with(qi, wi, view, pos, K, sink, win, cb=cb,
                                                                     **({"chunk": 32} if smoke else {})))
            CH = fine_chunk(B, ctx, smoke)
            forms["score_only"] = lambda: rh.score_pass(qi, wi, view, pos, CH, sink, win)
            k8, ks = quantize_index_keys(view)
            forms["fp8_chunked"] = lambda: itd.indexer_topk_decode(qi, wi, k8, pos, K, impl="chunked", sink=sink,
                                                                   window=win, k_scale=ks, **ch)
            forms["fp8_fine"] = lambda: itd.indexer_topk_decode(qi, wi, k8, pos, K, impl="fine", sink=sink,
                                                                window=win, k_scale=ks, **ch)
            forms["fp8_score_only"] = lambda: rh.score_pass(qi, wi, k8, pos, CH, sink, win, k_scale=ks)
        with torch.inference_mode():
            for name, fn in forms.items():
                if not run.gate(2, f"alone {ctx} {name}"):
                    break
                got = fn()
                ms = bench_ms(fn, dev, graph=not smoke)
                f = row["forms"][name] = {"ms_graph": round(ms, 4), "x_floor": round(ms / floor, 2)}
                if isinstance(got, torch.Tensor) and not name.startswith("fp8"):
                    f["equal_chunked"] = bool(torch.equal(got, base))
                elif isinstance(got, torch.Tensor):
                    f["overlap_with_bf16"] = round(rh.overlap(got, base), 4)
                    f["floor_ms_fp8_keys"] = round(1e3 * B * ctx * (DI + 4) / b.bw, 4)
        log(f"alone {ctx}: floor {row['floor_ms']} ms: " + ", ".join(
            f"{n} {f['ms_graph']}" + ("" if f.get("equal_chunked", True) else " DIFFERS")
            + (f" (overlap {f['overlap_with_bf16']})" if "overlap_with_bf16" in f else "") for n, f in row["forms"].items()))
        run.save()
    return res


def engine_check(dev, smoke, variants: dict) -> dict:
    """Tiny Qwen3 (fp32, sparse: top-k 32, 47-token prompt + 40 new keys past it): the engine's greedy tokens
    == HF generate and its sampled log-probs vs a teacher-forced forward, per variant (CUDA graphs on)."""
    from sparse_rl.bench.floor import SHAPES, build_model
    from sparse_rl.rl.rollout import RolloutEngine, SamplingParams, process_logits
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
    new = 6 if smoke else 40
    with torch.inference_mode():
        hf = [model.generate(torch.tensor([p], device=dev), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=7)
    out = {}
    for name, v in variants.items():
        eng = RolloutEngine(model, None, max_batch=3, max_seq_len=256, device=dev, eos_token_ids=[],
                            runner_options={"decode_select": v.select, "qkv_pad": v.qkv_pad,
                                            "skinny_gemm": v.skinny_gemm})
        greedy = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=new))
        lp = 0.0
        for c in eng.generate(prompts, params):
            with torch.inference_mode():
                ids = torch.tensor([c.prompt_tokens + c.tokens], device=dev)
                logits = model(input_ids=ids).logits[0, len(c.prompt_tokens) - 1:-1].float()
                ref = process_logits(logits, params).gather(-1, torch.tensor(c.tokens, device=dev)[:, None])[:, 0]
            lp = max(lp, float((torch.tensor(c.logprobs, device=dev) - ref).abs().max()))
        out[name] = {"greedy_equal_hf": f"{sum(r == c.tokens for r, c in zip(hf, greedy))}/{len(prompts)}",
                     "logprobs_max_abs_diff": lp, "graphs": eng.runner.use_graphs, "graph_error": eng.runner.graph_error}
        log(f"engine check {name}: {out[name]}")
        del eng
    return out


def prove_skinny() -> dict:
    """Child process (`--prove-skinny`): `ops.skinny_linear` on the GPU at Qwen3-4B's four decode GEMM shapes,
    M = 32 and 1, twice each, against F.linear; a faulting kernel poisons only this process."""
    import json

    from sparse_rl.sparse.ops.skinny_gemm.triton import counters, skinny_linear

    out = {}
    g = torch.Generator(device="cuda").manual_seed(1)
    for name, (N, K) in {"o_proj": (2560, 4096), "down": (2560, 9728), "qkv": (6528, 2560),
                         "gate_up": (19456, 2560)}.items():
        w = torch.randn(N, K, device="cuda", generator=g).bfloat16() / K ** 0.5
        cnt = counters(N, "cuda")
        for M in (32, 1):
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            ref = torch.nn.functional.linear(x, w).float()
            errs = [float((skinny_linear(x, w, cnt).float() - ref).abs().max()) for _ in range(2)]
            torch.cuda.synchronize()
            out[f"{name}_M{M}"] = {"max_abs_err": max(errs), "ref_max": float(ref.abs().max()),
                                   "counters_zero": int(cnt.abs().sum()) == 0}
    ok = all(v["max_abs_err"] <= 0.02 * v["ref_max"] + 1e-2 and v["counters_zero"] for v in out.values())
    print("PROVE " + json.dumps({"ok": ok, "cases": out}), flush=True)
    return out


def start_proof(script: str):
    import subprocess

    return subprocess.Popen([sys.executable, script, "--prove-skinny"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def proof_result(proc, timeout_s: float) -> dict:
    import json

    try:
        out, err = proc.communicate(timeout=max(1.0, timeout_s))
    except Exception as e:  # noqa: BLE001 -- a hung child counts as a failed proof
        proc.kill()
        proc.communicate()
        return {"ok": False, "error": f"{type(e).__name__}"}
    line = next((x for x in out.splitlines() if x.startswith("PROVE ")), None)
    if proc.returncode or line is None:
        return {"ok": False, "rc": proc.returncode, "error": err[-600:]}
    return json.loads(line[6:])


def fill_fp8(b, eng, max_len):
    """The engine's cache filled at random as `_Bench.fill`, fp8 index keys quantized from N(0, 1) ones."""
    from sparse_rl.sparse.ops import quantize_index_keys

    with torch.inference_mode():
        cache = eng._ensure_cache(max_len)
        g = torch.Generator(device=b.dev).manual_seed(b.cfg.seed)
        cache.k.normal_(generator=g)
        cache.v.normal_(generator=g)
        for i in range(cache.idx.shape[0]):
            k8, sc = quantize_index_keys(torch.randn(cache.idx.shape[1:], device=b.dev, generator=g, dtype=torch.bfloat16))
            cache.idx[i].copy_(k8)
            cache.idx_scale[i].copy_(sc)


def build(cfg, B, top, st) -> dict:
    from sparse_rl.bench.rollout import _Bench

    bb = _Bench(cfg, log, None)
    bb.attach_sparse()
    eng = bb.engine(B, top)
    eng.set_attention("sparse")  # the index-key cache exists before the fill
    bb.fill(eng, top)
    st.update(b=bb, eng=eng)
    log(f"model built, copy {bb.bw / 1e12:.3f} TB/s, engine batch {B} x {top} filled")
    return {"copy_bw_tb_s": round(bb.bw / 1e12, 3)}


def call1(run, a, cfg, B, ctxs, big, b1, st, smoke) -> None:
    """The design call: the select alone == the reference and timed; steps of base / autofine / fine; the
    profile; batch 1; fp8 index keys in the step; whole generations if budget is left."""
    from sparse_rl.sparse.layer import sparse_config

    b, eng = st["b"], st["eng"]
    if run.gate(NEED["alone"], "alone"):
        run.res["alone"] = run.guarded("alone", alone, run, b, eng, ctxs, smoke)
        run.save()
    plan = {"base": VARIANTS["base"], "autofine": VARIANTS["autofine"], "fine": VARIANTS["fine"]}
    if run.gate(NEED["steps"], "steps"):
        rh.step_rows(run, b, eng, ctxs, plan, modes=("sparse",))
        rh.step_rows(run, b, eng, [ctxs[0], big], plan, modes=("dense",))
    profile(run, eng, big, ("base", "autofine"))
    del eng
    st.pop("eng")
    rh.free()
    if run.gate(NEED["batch1"], "batch1"):  # the batch-1 rows: dense and sparse steps vs the floor
        e1 = b.engine(1, b1[-1] + 128)
        e1.set_attention("sparse")
        b.fill(e1, b1[-1] + 128)
        rh.step_rows(run, b, e1, b1, {"base": VARIANTS["base"], "autofine": VARIANTS["autofine"]},
                     modes=("dense", "sparse"), key="batch1")
        del e1
        rh.free()
    if run.gate(NEED["fp8"], "fp8"):  # fp8 index keys in the step (the engine's cache as index_dtype fp8)
        sc = sparse_config(b.model)
        sc.index_dtype = "fp8"
        try:
            e8 = b.engine(B, big + 128)
            e8.set_attention("sparse")
            run.res["fp8_index_dtype"] = e8.runner.index_dtype
            fill_fp8(b, e8, big + 128)
            rh.step_rows(run, b, e8, [ctxs[0], big], {"base": VARIANTS["base"], "autofine": VARIANTS["autofine"]},
                         modes=("sparse",), key="fp8_steps")
            del e8
        finally:
            sc.index_dtype = "bf16"
            rh.free()
    whole_runs(run, b, cfg, a.best or "autofine", dense="base")


def best_of(rows, names) -> str:
    """The variant with the smallest summed step ms over the contexts where every one of `names` ran."""
    by: dict = {}
    for r in rows:
        by.setdefault(r["variant"], {})[r["context"]] = r["ms"]
    have = [n for n in names if n in by]
    if not have:
        return names[0]
    common = set.intersection(*(set(by[n]) for n in have))
    return min(have, key=lambda n: sum(by[n][c] for c in common)) if common else names[0]


def call2(run, a, cfg, B, ctxs, big, b1, st, smoke, proof) -> None:
    """The final call: the engine check of the candidate default, the select alone with the score pass's key
    step, the skinny GEMM (proved in a child first) alone, steps of every candidate, whole generations with
    the fastest, batch 1, the profile."""
    b, eng = st["b"], st["eng"]
    ok = bool(proof.get("ok"))
    cands = ["base", "autofine", "autofine_s64", "fine_s64"] + (["autofine_s64_skout", "autofine_s64_skinny"] if ok else [])
    if run.gate(NEED["engine_check"], "engine_check"):
        run.res["engine_check"] = run.guarded("engine_check", engine_check, b.dev, smoke,
                                              {n: VARIANTS[n] for n in cands[-1:]})
        run.save()
    if run.gate(NEED["alone"], "alone"):
        run.res["alone"] = run.guarded("alone", alone, run, b, eng, [ctxs[1], big], smoke, 2)
        run.save()
    if ok and run.gate(NEED["gemm"], "gemm"):
        shapes = rh.gemm_shapes(b.model)
        cfgs = {"d": (64, 64, 528), "bk128": (64, 128, 528), "bn32": (32, 64, 528), "p1056": (64, 64, 1056)}
        run.res["gemm"] = run.guarded("gemm", rh.gemm_alone, run, b.dev, b.bw,
                                      {k: shapes[k] for k in ("o_proj", "down")}, (32, 1), cfgs, smoke)
        run.res["gemm_other"] = run.guarded("gemm other", rh.gemm_alone, run, b.dev, b.bw,
                                            {k: shapes[k] for k in ("qkv", "gate_up")}, (32,), None, smoke)
        run.save()
    if run.gate(NEED["steps"], "steps"):
        rh.step_rows(run, b, eng, [ctxs[0], ctxs[2], big], {n: VARIANTS[n] for n in cands}, modes=("sparse",))
        dplan = {"base": VARIANTS["base"], **({"skout": VARIANTS["skout"], "skinny": VARIANTS["skinny"]} if ok else {})}
        rh.step_rows(run, b, eng, b1, dplan, modes=("dense",), key="dense_steps", all_dense=True)
    best = a.best or best_of(run.res.get("steps") or [], cands[1:])
    dense = best_of(run.res.get("dense_steps") or [], ["base", "skout", "skinny"]) if ok else "base"
    run.res["chosen"] = {"sparse": best, "dense": dense}
    log(f"chosen: sparse {best}, dense {dense}")
    profile(run, eng, big, [best])
    del eng
    st.pop("eng")
    rh.free()
    whole_runs(run, b, cfg, best, dense=dense)
    if run.gate(NEED["batch1"], "batch1"):
        e1 = b.engine(1, b1[-1] + 128)
        e1.set_attention("sparse")
        b.fill(e1, b1[-1] + 128)
        bplan = {"base": VARIANTS["base"], **({"skout": VARIANTS["skout"], "skinny": VARIANTS["skinny"]} if ok else {}),
                 best: VARIANTS[best]}
        rh.step_rows(run, b, e1, b1, bplan, modes=("dense", "sparse"), key="batch1", all_dense=True)
        del e1
        rh.free()


def profile(run, eng, big, names) -> None:
    if not run.gate(NEED["profile"], "profile"):
        return
    prof = run.res.setdefault("profile", {})
    for name in names:
        if not run.gate(4, f"profile {name}"):
            break
        rh.apply(eng, VARIANTS[name])
        p = run.guarded(f"profile {name}", rh.profile_step, eng, big, "sparse")
        if p is not None:
            prof[name] = p
            log(f"profile {name} sparse {big}: {p['kernel_us_total']} us in {p['kernels']} kernels: {p['classes_us']}")
        run.save()
    rh.apply(eng, VARIANTS["base"])


def whole_runs(run, b, cfg, best, dense) -> None:
    (new16, B16), (new32, B32) = cfg.long_runs()
    plan = [("dense", dense, VARIANTS[dense]), ("sparse", "base", VARIANTS["base"])]
    if best != "base":
        plan.append(("sparse", best, VARIANTS[best]))
    for name, new, Bw in (("whole_16k_b32", new16, B16), ("whole_32k_b16", new32, B32)):
        if run.gate(NEED[name], name):
            rh.whole(run, b, new, Bw, cfg.long_prompt_len, plan, name, need_s=NEED[name] / 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="default: $OUT/roll9")
    ap.add_argument("--budget", type=float, default=140)
    ap.add_argument("--call", type=int, default=1, choices=(1, 2))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--best", default=None, choices=sorted(VARIANTS), help="the sparse variant of the whole runs")
    ap.add_argument("--cpu-smoke", action="store_true", help="a CPU run of the script itself at tiny sizes")
    ap.add_argument("--prove-skinny", action="store_true", help="(child) prove ops.skinny_linear on the GPU")
    a = ap.parse_args()
    if a.prove_skinny:
        prove_skinny()
        return
    smoke = a.cpu_smoke
    dev = torch.device("cpu" if smoke else "cuda")
    proc = start_proof(os.path.abspath(__file__)) if a.call == 2 and not smoke else None
    run = Run(a.out or os.path.join(os.environ.get("OUT", "/tmp"), "roll9"), f"session9_call{a.call}.json", a.budget,
              {"commit": a.commit, "call": a.call, "budget_s": a.budget, "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "variants": {k: v.describe() for k, v in VARIANTS.items()}})
    from sparse_rl.bench.rollout import BenchRolloutConfig

    if smoke:
        cfg = BenchRolloutConfig(shape="tiny-qwen3", hf=False, long_new_tokens=[160, 200], long_batches=[3, 2],
                                 long_prompt_len=16, whole="integrate", topk=48, index_heads=2, index_dim=16,
                                 device="cpu", dtype="float32")
        B, ctxs, big, b1 = 4, [64, 96, 128, 160], 160, [64, 160]
    else:
        cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, long_new_tokens=[16384, 32768], long_batches=[32, 16],
                                 long_prompt_len=128, whole="integrate", topk=2048, index_heads=4, index_dim=64)
        B, ctxs, big, b1 = 32, [2304, 4096, 8192, 16384], 16384, [2048, 16384]
    st: dict = {}
    if a.call == 1 and run.gate(NEED["select_check"], "select_check"):
        run.res["select_check"] = run.guarded("select_check", select_check, dev, smoke)
        run.save()
    if run.gate(NEED["setup"], "setup"):
        run.res["setup"] = run.guarded("setup", build, cfg, B, big + 128, st)
        run.save()
    if "eng" not in st:
        log("setup failed: nothing else runs")
        return
    if a.call == 1:
        call1(run, a, cfg, B, ctxs, big, b1, st, smoke)
    else:
        proof = proof_result(proc, 60 - (time.time() - T0)) if proc is not None else {"ok": smoke}
        run.res["skinny_proof"] = proof
        log(f"skinny proof: {proof.get('ok')} {proof.get('error', '')}")
        call2(run, a, cfg, B, ctxs, big, b1, st, smoke, proof)
    run.save()
    log(f"done: skipped {run.res['skipped']}; errors {run.res['errors']}")
    for k in ("steps", "dense_steps", "batch1", "fp8_steps"):
        for r in run.res.get(k) or []:
            print(f"| {k} | {r['mode']} | {r['variant']} | b{r['batch']} {r['context']} | {r['ms']} ms | {r['x_floor']}x |")
    for k in ("whole_16k_b32", "whole_32k_b16"):
        for r in run.res.get(k) or []:
            print(f"| {k} | {r['mode']} | {r['variant']} | {r['tokens_per_s']} tok/s | {r.get('sparse_over_dense', '-')} |")


if __name__ == "__main__":
    main()
