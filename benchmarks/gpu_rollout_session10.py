"""Session 10 device run (issue 14), on the shared harness (granular_harness.Run + rollout_harness): the decode
GEMMs' BLAS library (torch's default vs cuBLASLt vs cuBLAS, and bf16 reduced-precision split-K off) alone and in
the step, the fine select's chunk size alone, the profile's kernel count, and the baselines the issue asks for
with the engine's current default (fine select, 64-key score step): whole 32K batch-16 and 16K batch-32
generations and batch 1.

    PYTHONPATH=$PWD python benchmarks/gpu_rollout_session10.py --budget 140 --call 1 --commit SHA     (H200)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_rollout_session10.py --cpu-smoke --budget 900

Every phase is gated on the time LEFT of --budget (its estimate in NEED, compiles of new specializations
included), every row inside on a few seconds, and the JSON is rewritten after each row: a cut-off run keeps
what it measured. Writes $OUT/roll10/session10_call<N>.json and .log. Variants are `rollout_harness.Variant`s
(the runner's `decode_select` / `blas` arguments; no module globals).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import rollout_harness as rh  # noqa: E402
from granular_harness import T0, Run, log  # noqa: E402
from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT, DecodeSelect  # noqa: E402

V = rh.Variant
BITS = DecodeSelect("bits", score_block=64)
VARIANTS = {"base": V(ENGINE_SELECT), "lt": V(ENGINE_SELECT, blas="cublaslt"), "cublas": V(ENGINE_SELECT, blas="cublas"),
            "auto": V(DecodeSelect()), "bits": V(BITS), "bits_lt": V(BITS, blas="cublaslt"),
            "bits_w2": V(DecodeSelect("bits", score_block=64, num_warps=2)),
            "fine_w2": V(DecodeSelect("fine", score_block=64, num_warps=2))}
# estimated device seconds of each phase (session 9's measured costs: setup 13, select check 22 with the CUDA
# start, steps ~1 s a row after its first compile, profile 1, batch 1 11, whole 16K 31 for 3 runs, 32K ~24 for 2)
NEED = {"setup": 16, "gemm": 8, "steps": 14, "alone": 8, "profile": 5, "whole_32k_b16": 34, "batch1": 13,
        "engine_check": 14, "whole_16k_b32": 34}
# one whole run's gate by mode: session 9 measured dense 7-10 s (engine build included), sparse 8-14 s, and a
# sparse run at a batch not compiled yet ran past 13 s (killed)
WHOLE_RUN_S = {"dense": 12, "sparse": 22}


@contextlib.contextmanager
def blas_mode(lib: str | None, reduced: bool = True):
    """torch's preferred BLAS library and bf16 reduced-precision reduction for the block, restored after."""
    m = torch.backends.cuda.matmul
    old_lib, old_red = torch.backends.cuda.preferred_blas_library(), m.allow_bf16_reduced_precision_reduction
    try:
        if lib is not None:
            torch.backends.cuda.preferred_blas_library(lib)
        m.allow_bf16_reduced_precision_reduction = reduced
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(old_lib)
        m.allow_bf16_reduced_precision_reduction = old_red


def gemm_blas(run, b, smoke) -> dict:
    """F.linear (graph-timed) of each decode GEMM shape at M = 32 and 1 under each BLAS setting, against the
    weight's bytes, and each result's max |diff| from the default's."""
    from sparse_rl.bench.timing import bench_ms

    shapes = rh.gemm_shapes(b.model)
    lm = b.model.get_output_embeddings().weight
    shapes["lm_head"] = tuple(lm.shape)
    modes = {"default": (None, True), "cublaslt": ("cublaslt", True), "cublas": ("cublas", True),
             "no_reduced": (None, False)}
    dev, dt = b.dev, (torch.float32 if smoke else torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(5)
    out = {}
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=dev, generator=g).to(dt) / K ** 0.5
        for M in ((32,) if name == "lm_head" else (32, 1)):
            if not run.gate(2, f"gemm {name} M{M}"):
                return out
            x = torch.randn(M, K, device=dev, generator=g).to(dt)
            ref = torch.nn.functional.linear(x, w).float()
            row = out[f"{name}_M{M}"] = {"N": N, "K": K, "M": M,
                                         "floor_ms": round(1e3 * N * K * w.element_size() / b.bw, 4)}
            for mname, (lib, red) in modes.items():
                with blas_mode(None if smoke else lib, red):
                    y = torch.nn.functional.linear(x, w).float()
                    ms = bench_ms(lambda: torch.nn.functional.linear(x, w), dev, graph=not smoke)
                row[mname] = {"ms": round(ms, 4), "x_floor": round(ms / row["floor_ms"], 2),
                              "max_abs_diff_default": float((y - ref).abs().max())}
            log(f"gemm {name} M={M}: floor {row['floor_ms']} " + " ".join(
                f"{m} {row[m]['ms']}" for m in modes))
            run.save()
    return out


def alone(run, b, eng, ctxs, smoke, bits: bool, call: int = 1) -> dict:
    """Score + fine select alone on the engine's layer-2 index cache (`[:, :ctx]`, all rows at ctx - 1), graph
    timed, at several chunk sizes (keys a program), each checked == the engine default's selection."""
    from sparse_rl.bench.timing import bench_ms
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
        ch0 = fine_chunk(B, ctx, smoke)
        row = res[str(ctx)] = {"context": ctx, "batch": B, "floor_ms": round(floor, 4), "default_chunk": ch0,
                               "forms": {}}
        kw = dict(sink=sink, window=win, **ENGINE_SELECT.as_kwargs())
        base = itd.indexer_topk_decode(qi, wi, view, pos, K, **kw)
        chunks = [32, 64] if smoke else [c for c in (512, 1024, 2048, 4096) if c <= ctx]
        if call == 1:
            forms = {f"fine_ch{c}": (lambda c=c: itd.indexer_topk_decode(qi, wi, view, pos, K, chunk=c, **kw))
                     for c in chunks}
        else:  # call 1 timed the chunks: the default itself here, beside the new select
            forms = {"fine": lambda: itd.indexer_topk_decode(qi, wi, view, pos, K, **kw)}
        for nw in ((2,) if smoke else (2, 8) if call == 1 else ()):  # the fine kernels' warps (4 by default)
            forms[f"fine_w{nw}"] = lambda nw=nw: itd.indexer_topk_decode(qi, wi, view, pos, K, **{**kw, "num_warps": nw})
        if bits:
            bk = dict(sink=sink, window=win, **BITS.as_kwargs())
            forms["bits"] = lambda: itd.indexer_topk_decode(qi, wi, view, pos, K, **bk)
            for nw in ((2,) if smoke else (2, 8) if ctx > 4096 else (2,)):
                forms[f"bits_w{nw}"] = lambda nw=nw: itd.indexer_topk_decode(qi, wi, view, pos, K, **{**bk, "num_warps": nw})
            if call == 2 and not smoke and ctx > 4096:
                forms["bits_ch2048"] = lambda: itd.indexer_topk_decode(qi, wi, view, pos, K, chunk=2048, **bk)
        forms["score_only"] = lambda: rh.score_pass(qi, wi, view, pos, ch0, sink, win, bn=16 if smoke else 64)
        with torch.inference_mode():
            for name, fn in forms.items():
                if not run.gate(2, f"alone {ctx} {name}"):
                    break
                got = fn()
                ms = bench_ms(fn, dev, graph=not smoke)
                f = row["forms"][name] = {"ms_graph": round(ms, 4), "x_floor": round(ms / floor, 2)}
                if isinstance(got, torch.Tensor):
                    f["equal_default"] = bool(torch.equal(got, base))
        log(f"alone {ctx}: floor {row['floor_ms']} ms (default chunk {ch0}): " + ", ".join(
            f"{n} {f['ms_graph']}" + ("" if f.get("equal_default", True) else " DIFFERS") for n, f in row["forms"].items()))
        run.save()
    return res


def engine_check(dev, smoke, variants: dict) -> dict:
    """Tiny Qwen3 (fp32, sparse: top-k 32, prompts of 21 / 47 / 9 tokens + 40 new): the engine's greedy tokens ==
    HF generate and its sampled log-probs vs a teacher-forced forward, per variant (CUDA graphs on)."""
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
                            runner_options=v.runner_options())
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


def prove_bits() -> dict:
    """Child process (`--prove-bits`): the bits select (decode_bits.py: global atomics, the row's last program
    resolving) on the GPU == the reference on integer ties, and == the fine select on random bf16 rows at the
    step's sizes, twice each; a faulting kernel poisons only this process."""
    import json

    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive

    out = {}
    g = torch.Generator(device="cuda").manual_seed(10)
    B, S, K = 4, 3000, 512
    q = torch.randint(-2, 3, (B, 4, 64), device="cuda", generator=g).bfloat16()
    w = torch.randint(-1, 3, (B, 4), device="cuda", generator=g).bfloat16()
    k = torch.randint(-2, 3, (B, S, 64), device="cuda", generator=g).bfloat16()
    pos = torch.tensor([S - 1, S // 2, K // 2, S - 7], device="cuda")
    ref = indexer_topk_decode_naive(q.float(), w.float(), k.float(), pos, K, sink=2, window=4)
    out["ints"] = all(torch.equal(itd.indexer_topk_decode(q, w, k, pos, K, sink=2, window=4, **BITS.as_kwargs()), ref)
                      for _ in range(2))
    for B, S in ((32, 16384), (16, 32768)):
        q = torch.randn(B, 4, 64, device="cuda", generator=g).bfloat16()
        w = torch.randn(B, 4, device="cuda", generator=g).bfloat16()
        k = torch.randn(B, S, 64, device="cuda", generator=g).bfloat16()
        pos = torch.randint(S // 2, S, (B,), device="cuda", generator=g)
        pos[0] = S - 1
        kw = dict(sink=4, window=64)
        base = itd.indexer_topk_decode(q, w, k, pos, 2048, **kw, **ENGINE_SELECT.as_kwargs())
        out[f"b{B}_s{S}"] = all(torch.equal(itd.indexer_topk_decode(q, w, k, pos, 2048, **kw, **BITS.as_kwargs()), base)
                                for _ in range(2))
        out[f"b{B}_s{S}_w2"] = torch.equal(itd.indexer_topk_decode(q, w, k, pos, 2048, **kw,
                                                                   **VARIANTS["bits_w2"].select.as_kwargs()), base)
        torch.cuda.synchronize()
    print("PROVE " + json.dumps({"ok": all(out.values()), "cases": out}), flush=True)
    return out


def start_proof(script: str):
    import subprocess

    return subprocess.Popen([sys.executable, script, "--prove-bits"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


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


def build(cfg, B, top, st) -> dict:
    from sparse_rl.bench.rollout import _Bench

    bb = _Bench(cfg, log, None)
    bb.attach_sparse()
    eng = bb.engine(B, top, runner_options=VARIANTS["base"].runner_options())
    eng.set_attention("sparse")  # the index-key cache exists before the fill
    bb.fill(eng, top)
    st.update(b=bb, eng=eng)
    log(f"model built, copy {bb.bw / 1e12:.3f} TB/s, engine batch {B} x {top} filled")
    return {"copy_bw_tb_s": round(bb.bw / 1e12, 3)}


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


def profile(run, eng, big, names) -> None:
    if not run.gate(NEED["profile"], "profile"):
        return
    prof = run.res.setdefault("profile", {})
    for name in names:
        if not run.gate(2.5, f"profile {name}"):
            break
        rh.apply(eng, VARIANTS[name])
        p = run.guarded(f"profile {name}", rh.profile_step, eng, big, "sparse")
        if p is not None:
            prof[name] = p
            log(f"profile {name} sparse {big}: {p['kernel_us_total']} us in {p['kernels']} kernels: {p['classes_us']}")
        run.save()
    rh.apply(eng, VARIANTS["base"])


def whole_run(run, b, cfg, which: str, plan) -> None:
    (new16, B16), (new32, B32) = cfg.long_runs()
    new, Bw = (new16, B16) if which == "whole_16k_b32" else (new32, B32)
    if run.gate(NEED[which], which):
        # each run's gate a share of the phase: a new batch compiles new select specializations (session 9's
        # last run, ungated for that, was killed)
        rh.whole(run, b, new, Bw, cfg.long_prompt_len, plan, which, need_s=WHOLE_RUN_S,
                 runner_options=VARIANTS["base"].runner_options())


def call1(run, a, cfg, B, ctxs, big, b1, st, smoke, bits: bool) -> None:
    b, eng = st["b"], st["eng"]
    if run.gate(NEED["gemm"], "gemm"):
        run.res["gemm"] = run.guarded("gemm", gemm_blas, run, b, smoke)
        run.save()
    steps = {n: VARIANTS[n] for n in ("base", "lt", "cublas") + (("bits",) if bits else ())}
    if run.gate(NEED["steps"], "steps"):
        rh.step_rows(run, b, eng, [ctxs[0], big], steps, modes=("sparse",))
        rh.step_rows(run, b, eng, [b1[0]], {n: v for n, v in steps.items() if n != "bits"}, modes=("dense",),
                     key="dense_steps", all_dense=True)
    best = best_of(run.res.get("steps") or [], list(steps))
    dense = best_of(run.res.get("dense_steps") or [], [n for n in steps if n != "bits"])
    run.res["chosen"] = {"sparse": best, "dense": dense}
    log(f"chosen: sparse {best}, dense {dense}")
    if run.gate(NEED["alone"], "alone"):
        run.res["alone"] = run.guarded("alone", alone, run, b, eng, [ctxs[0], big], smoke, bits)
        run.save()
    profile(run, eng, big, ["base"] + ([best] if best != "base" else []))
    del eng
    st.pop("eng")
    rh.free()
    plan = [("dense", "base", VARIANTS["base"]), ("sparse", "base", VARIANTS["base"])]
    plan += [("sparse", best, VARIANTS[best])] if best != "base" else []
    if bits and best != "bits":  # the new select's whole generation beside the default's, even if not fastest
        plan.append(("sparse", "bits", VARIANTS["bits"]))
    whole_run(run, b, cfg, "whole_32k_b16", plan)
    if run.gate(NEED["batch1"], "batch1"):  # the batch-1 rows with the current default
        e1 = b.engine(1, b1[-1] + 128, runner_options=VARIANTS["base"].runner_options())
        e1.set_attention("sparse")
        b.fill(e1, b1[-1] + 128)
        names = ["base"] + ([best] if best != "base" else [])
        rh.step_rows(run, b, e1, b1, {n: VARIANTS[n] for n in names}, modes=("dense", "sparse"), key="batch1",
                     all_dense=True)
        del e1
        rh.free()
    if best != "base" and run.gate(NEED["engine_check"], "engine_check"):
        run.res["engine_check"] = run.guarded("engine_check", engine_check, b.dev, smoke, {best: VARIANTS[best]})
        run.save()
    whole_run(run, b, cfg, "whole_16k_b32", plan)


def call2(run, a, cfg, B, ctxs, big, b1, st, smoke, bits: bool) -> None:
    """The bits select (proved in a child first; 4 and 2 warps) and the fine select at 2 warps against the
    default: steps at 2304 / 8192 / 16384, the fastest's profile, whole 16K batch 32 (dense, default, the
    fastest or bits), the engine check (greedy == HF), alone (warps, chunk), batch 1, whole 32K batch 16
    (dense, the fastest; the default's was call 1's)."""
    b, eng = st["b"], st["eng"]
    if not bits:
        log("bits not proved: the call times the default only")
    cands = {n: VARIANTS[n] for n in ("base",) + (("bits", "bits_w2") if bits else ()) + ("fine_w2",)}
    if run.gate(NEED["steps"], "steps"):
        rh.step_rows(run, b, eng, [ctxs[0], 8192 if not smoke else ctxs[0] + 32, big], cands, modes=("sparse",))
    best = best_of(run.res.get("steps") or [], list(cands))
    new = best if best != "base" else ("bits" if bits else "fine_w2")
    run.res["chosen"] = {"sparse": best, "whole": new}
    log(f"chosen: sparse {best}; whole runs with {new}")
    profile(run, eng, big, [new])
    cands = {"base": VARIANTS["base"], new: VARIANTS[new]}
    plan = [("dense", "base", VARIANTS["base"]), *(("sparse", n, v) for n, v in cands.items())]
    if run.gate(NEED["whole_16k_b32"] + 8, "whole_16k_b32 (with the step engine freed)"):
        del eng
        st.pop("eng")
        rh.free()
        whole_run(run, b, cfg, "whole_16k_b32", plan)
        eng = None
    if run.gate(NEED["engine_check"], "engine_check"):
        run.res["engine_check"] = run.guarded("engine_check", engine_check, b.dev, smoke, {new: VARIANTS[new]})
        run.save()
    if run.gate(NEED["alone"] + 12, "alone"):
        if eng is None:
            eng = b.engine(B, big + 128, runner_options=VARIANTS["base"].runner_options())
            eng.set_attention("sparse")
            b.fill(eng, big + 128)
        run.res["alone"] = run.guarded("alone", alone, run, b, eng, [ctxs[0], big], smoke, bits, 2)
        run.save()
    del eng
    st.pop("eng", None)
    rh.free()
    if run.gate(NEED["batch1"], "batch1"):
        e1 = b.engine(1, b1[-1] + 128, runner_options=VARIANTS["base"].runner_options())
        e1.set_attention("sparse")
        b.fill(e1, b1[-1] + 128)
        rh.step_rows(run, b, e1, b1, cands, modes=("sparse",), key="batch1")
        del e1
        rh.free()
    whole_run(run, b, cfg, "whole_32k_b16", [("dense", "base", VARIANTS["base"]), ("sparse", new, VARIANTS[new])])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="default: $OUT/roll10")
    ap.add_argument("--budget", type=float, default=140)
    ap.add_argument("--call", type=int, default=1, choices=(1, 2))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--cpu-smoke", action="store_true", help="a CPU run of the script itself at tiny sizes")
    ap.add_argument("--prove-bits", action="store_true", help="(child) prove the bits select on the GPU")
    a = ap.parse_args()
    if a.prove_bits:
        prove_bits()
        return
    smoke = a.cpu_smoke
    dev = torch.device("cpu" if smoke else "cuda")
    proc = None if smoke else start_proof(os.path.abspath(__file__))
    run = Run(a.out or os.path.join(os.environ.get("OUT", "/tmp"), "roll10"), f"session10_call{a.call}.json",
              a.budget, {"commit": a.commit, "call": a.call, "budget_s": a.budget, "torch": torch.__version__,
                         "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                         "variants": {k: v.describe() for k, v in VARIANTS.items()}, "need_s": NEED})
    from sparse_rl.bench.rollout import BenchRolloutConfig

    if smoke:
        cfg = BenchRolloutConfig(shape="tiny-qwen3", hf=False, long_new_tokens=[160, 200], long_batches=[3, 2],
                                 long_prompt_len=16, whole="integrate", topk=48, index_heads=2, index_dim=16,
                                 device="cpu", dtype="float32")
        B, ctxs, big, b1 = 4, [64, 160], 160, [64, 160]
    else:
        cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, long_new_tokens=[16384, 32768], long_batches=[32, 16],
                                 long_prompt_len=128, whole="integrate", topk=2048, index_heads=4, index_dim=64)
        B, ctxs, big, b1 = 32, [2304, 16384], 16384, [2048, 16384]
    st: dict = {}
    if run.gate(NEED["setup"], "setup"):
        run.res["setup"] = run.guarded("setup", build, cfg, B, big + 128, st)
        run.save()
    if "eng" not in st:
        log("setup failed: nothing else runs")
        return
    proof = proof_result(proc, 75 - (time.time() - T0)) if proc is not None else {"ok": True}
    run.res["bits_proof"] = proof
    log(f"bits proof: {proof.get('ok')} {proof.get('cases', '')} {proof.get('error', '')}")
    (call1 if a.call == 1 else call2)(run, a, cfg, B, ctxs, big, b1, st, smoke, bool(proof.get("ok")))
    run.save()
    log(f"done: skipped {run.res['skipped']}; errors {run.res['errors']}")
    for k in ("steps", "dense_steps", "batch1"):
        for r in run.res.get(k) or []:
            print(f"| {k} | {r['mode']} | {r['variant']} | b{r['batch']} {r['context']} | {r['ms']} ms | {r['x_floor']}x |")
    for k in ("whole_32k_b16", "whole_16k_b32"):
        for r in run.res.get(k) or []:
            print(f"| {k} | {r['mode']} | {r['variant']} | {r['tokens_per_s']} tok/s | {r.get('sparse_over_dense', '-')} |")


if __name__ == "__main__":
    main()
