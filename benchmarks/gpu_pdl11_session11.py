"""Session 11 device run (issue 14, helper pdl11): programmatic dependent launch (PDL) through the decode step.

Every Triton kernel of the eager decode step (add + RMSNorm, q/k norm + RoPE + cache, SiLU * up, the indexer's
per-token kernel, the score pass, the fine select's three passes, the decode attention and its merge) takes a
`PDL` level (ops/_backend.PDL_LEVELS): 0 plain launches (the old default), 1 launched with PDL and waiting in
`gdc_wait` first, 2 as 1 and then `gdc_launch_dependents` right after the wait. `ModelRunner(pdl=)` owns it
(`rollout_harness.Variant(pdl=)` here).

    PYTHONPATH=$PWD python benchmarks/gpu_pdl11_session11.py --budget 140 --commit SHA          (H200)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_pdl11_session11.py --cpu-smoke --budget 900

Phases, each gated on the time LEFT of --budget (compiles included), the JSON + log rewritten after every row
($OUT/pdl11/pdl11.json, .log):
1. child proof (`--prove`, its own process: a bad launch poisons only its CUDA context), started first and run
   beside the parent's setup: a 4-layer model of Qwen3-4B's widths (layers 0-1 dense, 2-3 sparse, the
   engine's cache of 32 x 16,512), one decode step at 2304 and 16384 keys, dense and sparse, levels 1 and 2
   against level 0: logits bitwise equal, eager and graph-replayed (so PDL under stream capture is proved by
   the replayed logits), then 8 greedy tokens of a 32-prompt generation equal; batch 1 at 2304 / 16384 sparse.
   It compiles the very specializations the parent then loads from Triton's disk cache.
2. setup: the 36-layer model, an engine of 32 x 16,512 filled with random K/V and index keys.
3. steps, batch 32: dense and sparse at 2304 and 16384, levels 0 / 1 / 2 interleaved per context (graph
   replay, median of 20), the floor beside each.
4. profile: one graph-replayed sparse 16K step per level under torch.profiler: kernels, busy (union of kernel
   intervals), span, gaps = span - busy.
5. batch 1: dense and sparse at 2048 / 16384, levels 0 / 1 / 2.
6. whole 16K batch-32 generation, integrated (`bench rollout --whole integrate`): dense 0, sparse 0, sparse with
   the fastest level (then dense with it if budget is left).

Predictions (written before the call; the session-10 profile at 32 x 16K: 8,357 us of kernels in 588, ~0.45 ms
of graph gaps):
- Proof: every level bitwise equal to level 0, eager and graphed (the same kernels in the same order; only
  when they start changes), greedy tokens equal.
- Of the 588 kernels of a sparse 32 x 16K step ~351 are ours (10 a sparse layer, 5 a dense one, the final
  norm), the rest cuBLAS GEMMs / reduces and copies. Level 1 (wait first, no trigger) lets a kernel launch as
  the previous one's programs exit, saving the launch latency at each of those ~351 boundaries (~0.5-1 us in
  a graph): sparse 16K b32 8.71 -> ~8.50 ms (-0.2), sparse 2304 6.52 -> ~6.33 (-0.2), dense 2K b32 5.70 ->
  ~5.60 (-0.1, ~181 of our kernels), dense 16K ~-0.1 of ~20 ms; batch 1 (kernels of 2-5 us, so the boundaries
  weigh more): dense 2K 3.58 -> ~3.45, sparse 16K 4.85 -> ~4.65. Level 2 (trigger after the wait) also
  overlaps a kernel's last wave with the next one's launch along the Triton-to-Triton chains (q/k RoPE ->
  indexer -> score -> 3 select passes -> attention: 6 boundaries a sparse layer): a further -0.05 to -0.1 ms
  sparse, ~0 dense. Profile: the same kernel count, gaps 0.45 -> ~0.25 ms. Whole 16K b32: sparse/dense
  1.65x -> ~1.68x (sparse gains more than dense). Uncertain: how cuBLAS's kernels before our PDL kernels
  trigger (if they never do, those boundaries gain only the launch), and whether waiting programs hold SM
  slots the previous grid's tail needs (level 2 only).

Outcome (call 1, commit c49f408; benchmarks/results/2026-12-02-h200-pdl-session11.md): proof bitwise equal at both
levels, eager and graphed, greedy tokens equal. Level 1: -0.054 / -0.108 ms sparse b32 at 2304 / 16384, -0.046 /
-0.055 dense, batch 1 0.000 / -0.071 / -0.131 / -0.032 (predicted -0.2 sparse, -0.1 dense: the direction right,
half to a quarter of the size); profile gaps 1.028 -> 1.005 ms (predicted -0.2); whole 16K b32 4,327 -> 4,350 tok/s
sparse, 2,599 -> 2,620 dense. Level 2: mixed, +0.133 sparse 16K, busy +0.32 ms. Level 1 is now the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import rollout_harness as rh  # noqa: E402
from granular_harness import T0, Run, log, timeline_profile  # noqa: E402
from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT  # noqa: E402

V = rh.Variant
VARIANTS = {"off": V(ENGINE_SELECT, pdl=0), "pdl": V(ENGINE_SELECT, pdl=1), "trig": V(ENGINE_SELECT, pdl=2)}
# estimated device seconds of each phase (session 10: setup 13-16 s, a step row ~1 s after its compiles, whole
# 16K b32 ~31-34 s for 3 runs); the steps' compiles come from the child's warm cache
NEED = {"setup": 18, "steps": 16, "profile": 6, "batch1": 12, "whole_16k_b32": 34}
WHOLE_RUN_S = {"dense": 12, "sparse": 16}
# the parent waits for the child's verdict at most until this many seconds after the start; past it, the cases
# proved so far decide (the batch-32 step cases must be among them)
PROOF_WAIT_S = 72


def _cfg(smoke: bool):
    from sparse_rl.bench.rollout import BenchRolloutConfig

    if smoke:
        return BenchRolloutConfig(shape="tiny-qwen3", hf=False, long_new_tokens=[160], long_batches=[4],
                                  long_prompt_len=16, whole="integrate", topk=48, index_heads=2, index_dim=16,
                                  device="cpu", dtype="float32")
    return BenchRolloutConfig(shape="qwen3-4b", hf=False, long_new_tokens=[16384], long_batches=[32],
                              long_prompt_len=128, whole="integrate", topk=2048, index_heads=4, index_dim=64)


def _sizes(smoke: bool) -> dict:
    if smoke:
        return {"B": 4, "ctxs": [64, 160], "big": 160, "b1": [64, 160]}
    return {"B": 32, "ctxs": [2304, 16384], "big": 16384, "b1": [2048, 16384]}


def _step_inputs(eng, ctx: int, spread: bool, seed: int):
    """(cache, tokens, positions, S) for one step with the longest row at ctx - 1 (spread: the others at random
    positions in [ctx / 2, ctx - 1], so rows differ in length as in a generation)."""
    cache = eng._ensure_cache(ctx)
    g = torch.Generator(device=eng.device).manual_seed(seed)
    B = eng.max_batch
    tok = torch.randint(10, 500, (B,), device=eng.device, generator=g)
    pos = torch.full((B,), ctx - 1, device=eng.device, dtype=torch.long)
    if spread and B > 1:
        pos[1:] = torch.randint(ctx // 2, ctx, (B - 1,), device=eng.device, generator=g)
    return cache, tok, pos, eng._bucket(ctx, cache.s_max)


def prove(smoke: bool, path: str) -> dict:
    """Child process: levels 1 and 2 against 0 on a short model of the step's widths (see the module docstring),
    its verdict so far rewritten to `path` after every case (the parent reads it when it stops waiting)."""
    from sparse_rl.bench.floor import SHAPES, build_model
    from sparse_rl.rl.rollout import RolloutEngine, SamplingParams
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.ops._backend import pdl_supported
    from sparse_rl.sparse.patch import attach_sparse

    t0 = time.time()
    cfg, sz = _cfg(smoke), _sizes(smoke)
    dev = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    out: dict = {"pdl_supported": pdl_supported(dev), "cases": {}}
    if not smoke:
        out["capability"] = list(torch.cuda.get_device_capability())
    import triton

    out["triton"] = triton.__version__
    top = sz["big"] + 128
    model = build_model(dataclasses.replace(SHAPES[cfg.shape], layers=4), top + 64, dev, dtype)
    attach_sparse(model, SparseConfig(topk=cfg.topk, index_heads=cfg.index_heads, index_dim=cfg.index_dim,
                                      rope_dim=min(32, cfg.index_dim), dense_layers=[0, 1], sink=min(4, cfg.topk // 4),
                                      window=min(64, cfg.topk // 4)))
    model.to(dtype)
    ok = True

    def save(done: bool = False):
        out.update(ok=bool(ok), done=done, seconds=round(time.time() - t0, 1))
        with open(path + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(path + ".tmp", path)

    def engine(B, pdl):
        return RolloutEngine(model, None, max_batch=B, max_seq_len=top, device=dev, eos_token_ids=[],
                             runner_options=VARIANTS["off"].runner_options() | {"pdl": pdl})

    def fill(eng):
        with torch.inference_mode():
            cache = eng._ensure_cache(top)
            g = torch.Generator(device=dev).manual_seed(1)
            for t in (cache.k, cache.v, cache.idx):
                if t is not None:
                    t.normal_(generator=g)

    for B, ctxs, modes in ((sz["B"], sz["ctxs"], ("sparse", "dense")), (1, sz["b1"], ("sparse",))):
        eng = engine(B, 0)
        eng.set_attention("sparse")
        fill(eng)
        r = eng.runner
        for mode in modes:
            eng.set_attention(mode)
            for ctx in ctxs:
                cache, tok, pos, S = _step_inputs(eng, ctx, spread=True, seed=ctx)
                with torch.inference_mode():
                    r.set_pdl(0)
                    ref = r.decode_eager(cache, tok, pos, S, mode).clone()
                    ref_g = r.decode(cache, tok, pos, S, mode).clone() if r.use_graphs else ref
                    for lvl in (1, 2):
                        r.set_pdl(lvl)
                        e = r.decode_eager(cache, tok, pos, S, mode)
                        gr = r.decode(cache, tok, pos, S, mode) if r.use_graphs else e
                        case = {"level": r.pdl, "eager_equal": bool(torch.equal(e, ref)),
                                "graph_equal": bool(torch.equal(gr, ref_g)),
                                "graph_vs_eager_max_abs": float((gr - ref).abs().max()),
                                "argmax_equal": bool(torch.equal(gr.argmax(-1), ref.argmax(-1))),
                                "graph_error": r.graph_error}
                        out["cases"][f"b{B}_{mode}_{ctx}_l{lvl}"] = case
                        ok &= case["eager_equal"] and case["graph_equal"]
                        save()
                if not smoke:
                    torch.cuda.synchronize()
                print(f"[{time.time() - t0:5.1f}s] proof b{B} {mode} {ctx} done", file=sys.stderr, flush=True)
        del eng, r
    # a short generation through the engine's whole path (prefill, graph capture per bucket): greedy tokens
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(10, 500, (sz["B"], 64 if not smoke else 16), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=8 if not smoke else 3, ignore_eos=True)
    toks = {}
    for lvl in (0, 1, 2):
        eng = engine(sz["B"], lvl)
        eng.set_attention("sparse")
        toks[lvl] = [c.tokens for c in eng.generate(prompts, params)]
        del eng
        print(f"[{time.time() - t0:5.1f}s] proof generate level {lvl} done", file=sys.stderr, flush=True)
    out["generate_equal"] = toks[1] == toks[0] and toks[2] == toks[0]
    ok &= out["generate_equal"]
    save(done=True)
    return out


def start_proof(smoke: bool, path: str):
    args = [sys.executable, os.path.abspath(__file__), "--prove", "--proof-file", path] + (["--cpu-smoke"] if smoke
                                                                                         else [])
    err = open(path + ".stderr", "w")
    return subprocess.Popen(args, stdout=err, stderr=err, text=True)


def proof_result(proc, path: str, timeout_s: float, need: list[str]) -> dict:
    """The child's verdict: complete if it ended in time; else (killed at the deadline) what it proved so far,
    ok only if every case in `need` (key prefixes) is there and every case so far is equal."""
    try:
        proc.wait(timeout=max(1.0, timeout_s))
        late = False
    except Exception:  # noqa: BLE001 -- past the deadline: keep what it proved
        proc.kill()
        proc.wait()
        late = True
    try:
        with open(path) as f:
            res = json.load(f)
    except Exception as e:  # noqa: BLE001 -- no verdict at all
        res = {"ok": False, "error": f"no proof file: {type(e).__name__}"}
    with open(path + ".stderr") as f:
        res["stderr_tail"] = f.read()[-1500:]
    res["rc"], res["late"] = proc.returncode, late
    cases = res.get("cases") or {}
    if late or proc.returncode:
        res["ok"] = bool(res.get("ok")) and all(any(k.startswith(n) for k in cases) for n in need)
    return res


def step_rows(run, b, eng, ctxs, modes, key, need_s=2.5) -> list:
    """Step ms (graph replay, median of 20) of every (mode, level) at each context, levels interleaved, each row
    saved as it comes, with the level the runner really ran (0 where PDL was not possible)."""
    rows = run.res.setdefault(key, [])
    for ctx in ctxs:
        for mode in modes:
            for name, v in VARIANTS.items():
                if not run.gate(need_s, f"{key} {mode} {name} {ctx}"):
                    continue
                rh.apply(eng, v)
                r = run.guarded(f"{key} {mode} {name} {ctx}", b.step_row, eng, eng.max_batch, ctx, mode)
                if r is not None:
                    r.update(variant=name, pdl_level=eng.runner.pdl, graph_error=eng.runner.graph_error)
                    rows.append(r)
                    log(f"{key}: {mode} {name} (level {r['pdl_level']}) b{r['batch']} {ctx}: {r['ms']} ms "
                        f"(floor {r['floor_ms']}, {r['x_floor']}x)")
                run.save()
    rh.apply(eng, VARIANTS["off"])
    return rows


def graphed_profile(run, eng, ctx: int, mode: str) -> dict:
    """One graph-replayed step per level under torch.profiler (`granular_harness.timeline_profile`)."""
    out = {}
    eng.set_attention(mode)
    for name, v in VARIANTS.items():
        if not run.gate(2, f"profile {name}"):
            break
        rh.apply(eng, v)
        cache, tok, pos, S = _step_inputs(eng, ctx, spread=False, seed=0)
        with torch.inference_mode():
            p = run.guarded(f"profile {name}", timeline_profile, lambda: eng.runner.decode(cache, tok, pos, S, mode),
                            eng.device)
        if p:
            p = {k: (round(x, 4) if isinstance(x, float) else x) for k, x in p.items()}
            p["pdl_level"] = eng.runner.pdl
            out[name] = p
            log(f"profile {mode} {ctx} {name}: {p.get('kernels')} kernels, busy {p.get('busy_ms')} ms, span "
                f"{p.get('span_ms')}, gaps {p.get('gaps_ms')}")
        run.save()
    rh.apply(eng, VARIANTS["off"])
    return out


def fastest(rows, names=("pdl", "trig")) -> str:
    """The level (variant name) with the smallest summed sparse step ms over the contexts where all of off and
    it ran; "off" if none beats it."""
    by: dict = {}
    for r in rows:
        if r["mode"] == "sparse":
            by.setdefault(r["variant"], {})[r["context"]] = r["ms"]
    best, best_ms = "off", None
    for n in ("off",) + tuple(names):
        common = set(by.get("off", {})) & set(by.get(n, {}))
        if not common or n not in by:
            continue
        ms = sum(by[n][c] for c in common) - sum(by["off"][c] for c in common)
        if best_ms is None or ms < best_ms:
            best, best_ms = n, ms
    return best


def table(rows) -> list[str]:
    """| mode | batch | context | floor | off | pdl | trig | pdl - off | trig - off |"""
    by: dict = {}
    for r in rows:
        by.setdefault((r["mode"], r["batch"], r["context"]), {})[r["variant"]] = r
    lines = []
    for (mode, B, ctx), vs in by.items():
        ms = {n: vs[n]["ms"] for n in VARIANTS if n in vs}
        fl = next(iter(vs.values()))["floor_ms"]
        d = {n: (f"{ms[n] - ms['off']:+.3f}" if n in ms and "off" in ms else "-") for n in ("pdl", "trig")}
        lines.append(f"| {mode} | b{B} | {ctx} | {fl} | " + " | ".join(
            f"{ms[n]} ({vs[n]['x_floor']}x)" if n in ms else "-" for n in VARIANTS) + f" | {d['pdl']} | {d['trig']} |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="default: $OUT/pdl11")
    ap.add_argument("--budget", type=float, default=140)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--cpu-smoke", action="store_true", help="a CPU run of the script itself at tiny sizes")
    ap.add_argument("--prove", action="store_true", help="(child) prove PDL levels 1 and 2 against 0")
    ap.add_argument("--proof-file", default=None, help="(child) where the proof's verdict is written")
    a = ap.parse_args()
    smoke = a.cpu_smoke
    if a.prove:
        prove(smoke, a.proof_file)
        return
    out_dir = a.out or os.path.join(os.environ.get("OUT", "/tmp"), "pdl11")
    os.makedirs(out_dir, exist_ok=True)
    proof_path = os.path.join(out_dir, "proof.json")
    proc = start_proof(smoke, proof_path)
    from sparse_rl.bench.rollout import _Bench
    from sparse_rl.sparse.ops._backend import pdl_supported

    dev = torch.device("cpu" if smoke else "cuda")
    run = Run(out_dir, "pdl11.json", a.budget,
              {"commit": a.commit, "budget_s": a.budget, "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "variants": {k: v.describe() for k, v in VARIANTS.items()}, "need_s": NEED})
    cfg, sz = _cfg(smoke), _sizes(smoke)
    B, ctxs, big, b1 = sz["B"], sz["ctxs"], sz["big"], sz["b1"]
    st: dict = {}

    def setup():
        b = _Bench(cfg, log, None)
        b.attach_sparse()
        eng = b.engine(B, big + 128, runner_options=VARIANTS["off"].runner_options())
        eng.set_attention("sparse")
        b.fill(eng, big + 128)
        st.update(b=b, eng=eng)
        log(f"model built, copy {b.bw / 1e12:.3f} TB/s, engine batch {B} x {big + 128} filled")
        return {"copy_bw_tb_s": round(b.bw / 1e12, 3), "pdl_supported": pdl_supported(dev)}

    if run.gate(NEED["setup"], "setup"):
        run.res["setup"] = run.guarded("setup", setup)
        run.save()
    need = [f"b{B}_{m}_{c}" for m in ("sparse", "dense") for c in ctxs]  # the batch-32 step cases at least
    proof = proof_result(proc, proof_path, PROOF_WAIT_S - (time.time() - T0), need)
    run.res["proof"] = proof
    log(f"proof: ok {proof.get('ok')} in {proof.get('seconds')} s; supported {proof.get('pdl_supported')}; "
        f"generate_equal {proof.get('generate_equal')}; failing "
        f"{[k for k, c in (proof.get('cases') or {}).items() if not (c['eager_equal'] and c['graph_equal'])]} "
        f"{proof.get('error', '')[-300:]}")
    run.save()
    if "eng" not in st:
        log("setup failed: nothing else runs")
        return
    b, eng = st["b"], st["eng"]
    if not proof.get("ok"):  # unproved levels are not timed; the baseline still is
        for n in ("pdl", "trig"):
            VARIANTS.pop(n)
    if run.gate(NEED["steps"], "steps"):
        step_rows(run, b, eng, ctxs, ("sparse", "dense"), "steps")
    if run.gate(NEED["profile"], "profile"):
        run.res["profile"] = graphed_profile(run, eng, big, "sparse")
        run.save()
    del eng
    st.pop("eng")
    rh.free()
    if run.gate(NEED["batch1"], "batch1"):
        e1 = b.engine(1, b1[-1] + 128, runner_options=VARIANTS["off"].runner_options())
        e1.set_attention("sparse")
        b.fill(e1, b1[-1] + 128)
        step_rows(run, b, e1, b1, ("dense", "sparse"), "batch1", need_s=2)
        del e1
        rh.free()
    best = fastest(run.res.get("steps") or [], tuple(n for n in VARIANTS if n != "off"))
    run.res["chosen"] = best
    log(f"fastest sparse level at batch 32: {best}")
    if run.gate(NEED["whole_16k_b32"], "whole_16k_b32"):
        (new, Bw), = cfg.long_runs()
        plan = [("dense", "off", VARIANTS["off"]), ("sparse", "off", VARIANTS["off"])]
        if best != "off":
            plan += [("sparse", best, VARIANTS[best]), ("dense", best, VARIANTS[best])]
        rh.whole(run, b, new, Bw, cfg.long_prompt_len, plan, "whole_16k_b32", need_s=WHOLE_RUN_S,
                 runner_options=VARIANTS["off"].runner_options())
        run.save()
    run.save()
    log(f"done: skipped {run.res['skipped']}; errors {run.res['errors']}")
    print("| mode | batch | context | floor ms | off | pdl | trig | pdl - off | trig - off |")
    for line in table((run.res.get("steps") or []) + (run.res.get("batch1") or [])):
        print(line)
    for name, p in (run.res.get("profile") or {}).items():
        print(f"| profile | {name} | {p.get('kernels')} kernels | busy {p.get('busy_ms')} | span {p.get('span_ms')} "
              f"| gaps {p.get('gaps_ms')} |")
    for r in run.res.get("whole_16k_b32") or []:
        print(f"| whole_16k_b32 | {r['mode']} | {r['variant']} | {r['tokens_per_s']} tok/s | "
              f"{r.get('sparse_over_dense', '-')} |")


if __name__ == "__main__":
    main()
