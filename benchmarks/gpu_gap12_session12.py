"""Session 12 device run (issue 14, helper gap12): the decode step's weight GEMMs as a swap-AB wgmma skinny GEMM
(`ops.skinny_linear(impl="swapab")`, skinny_gemm/swapab.py: yᵀ = W xᵀ, the weight's 128 rows the MMA's M, the
batch padded to 16 / 32 its N; split-K in one launch, the tile's last program reducing; PDL: the first weight
tile loaded before `gdc_wait`) against cuBLAS (F.linear, the default), alone and in the step.

    PYTHONPATH=$PWD python benchmarks/gpu_gap12_session12.py --budget 130 --commit SHA                (H200)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_gap12_session12.py --cpu-smoke --budget 600

Phases, each gated on the time LEFT of --budget (compiles and model building included), the JSON + log rewritten
after every row ($OUT/gap12/gap12.json, .log):
1. proof (child process `--prove`, started first beside the parent's setup: a bad launch poisons only its
   context): swapab at Qwen3-4B's decode GEMM shapes (o_proj, down, q/k/v+indexer padded to 6528, gate/up;
   the unpadded 6468 too) x M = 1, 16, 32: the default tile "sw" (what the engine runs) at PDL 0 and 1, the
   alternative tiles "sw_bk128" / "sw64" (timed alone only) at M = 1 and 32 without PDL; each twice against
   x @ Wᵀ in fp32 (bf16 rounding: max |err| <= 0.02 max |ref| + 0.01), the two calls bitwise equal, the
   counters back at zero. Unproved: swapab is not timed.
2. setup: the 36-layer Qwen3-4B-shaped model (random bf16 weights), an engine of 32 x 16,512, filled; while
   the proof still runs, a first default step row per case ("base#0", beside the child: not used to decide).
3. step check: one graph-replayed step, dense 2048 and sparse 2304, base vs swapab logits (relative max
   |diff|, argmax agreement, swapab's replays bitwise equal). A sanity guard, recorded.
4. alone M = 32 (graph-timed, `rollout_harness.gemm_alone`): F.linear vs the three tiles per GEMM, floor.
5. steps, batch 32 (graph replay, median of 20): base, swapab, base, swapab on the same engine at dense 2048,
   sparse 16384, sparse 2304. Variants: "swapab" (all four GEMMs), "swapab_win" (only the GEMMs whose "sw"
   beat F.linear alone at M = 32, when that is some but not all).
6. sparse 16384, swapab at PDL level 2 (the step's launches trigger their dependents: the weight prefetch
   before the wait then overlaps the previous kernel), only if the phases after it still fit; 7. alone M = 1;
   8. batch 1 dense 2048 steps (base / swapab interleaved); 9. LM head alone at M = 32.

Predictions (written before the call; cuBLAS alone at M = 32 / 1 from session 10, us, floor in brackets):
- Proof: all cases within bf16 rounding, repeat calls bitwise equal, counters zero.
- On sm_90a (Triton 3.6, CPU-host compile, benchmarks/sm90_swapab.py) "sw" at 32 rows is 16 HGMMA (wgmma) +
  40 LDGSTS (cp.async, 4 stages) a loop, 101 registers, no stack, 100 KB shared: two programs an SM;
  session 9's split-K kernel was mma.sync at 168 registers.
- Alone M = 32, sw: o_proj ~6.0 (4.9; cuBLAS 7.5), down ~13.5 (11.7; 15.9), q/k/v ~8.8 (7.8; 8.9), gate/up
  ~27 (23.3; 30.6). sw_bk128 (one program an SM: q/k/v 102 programs, gate/up 152 in two waves) 5-15% slower
  than sw at q/k/v and gate/up, within 5% at o_proj / down; sw64 within +-10% of sw.
- Alone M = 1: o_proj ~6.5 (cuBLAS 8.4), down ~13 (14.8): the same kernel, padded to 16 rows.
- LM head M = 32: sw ~190 (cuBLAS 194, floor 182; 1187 tiles, no split): within 3%.
- Step check: relative max |diff| ~1e-2 (bf16 rounding through 36 layers), argmax agreement >= 0.9, replays equal.
- Steps: swapab -0.15 to -0.35 ms at batch 32 (36 layers x ~5-8 us, the 72 split-K reduce launches gone):
  dense 2K 5.66 -> ~5.40, sparse 16K 8.85 -> ~8.60, sparse 2304 ~-0.25; batch-1 dense 2K 3.41 -> ~3.25.
  PDL 2 with swapab: within +-0.1 ms of level 1. Uncertain: whether a 5-13-step K slice's cp.async pipeline
  reaches the stream rate, and the last program's reduce latency (13 partials of 16 KB from L2 at o_proj / down).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import rollout_harness as rh  # noqa: E402
from granular_harness import T0, Run, log  # noqa: E402

V = rh.Variant
SITES = {"qkv": "qkv", "o_proj": "o_proj", "gate_up": "gate_up", "down": "down_proj"}  # gemm_shapes -> SKINNY
VARIANTS = {"base": V(), "swapab": V(skinny_gemm=True, skinny_impl="swapab"),
            "swapab_pdl2": V(skinny_gemm=True, skinny_impl="swapab", pdl=2)}
# swapab tiles (swapab_linear's keywords). sw: the default (what the engine runs), 128 x 64 K steps, 4 stages
# (~100 KB shared: two programs an SM, at most 264): gate/up's 152 tiles all at once; sw_bk128: 128 x 128,
# 4 stages (~200 KB: one an SM, 132: gate/up's last 20 tiles a second wave); sw64: 64-row tiles, 128 K steps,
# 3 stages (~96 KB: two an SM, 264)
TILES = {"sw": {"impl": "swapab", "backend": "triton"},  # backend: the kernel (the interpreter in --cpu-smoke)
         "sw_bk128": {"impl": "swapab", "backend": "triton", "bw": 128, "bk": 128, "programs": 132, "num_stages": 4},
         "sw64": {"impl": "swapab", "backend": "triton", "bw": 64, "bk": 128, "programs": 264, "num_stages": 3}}
# device seconds of each phase, estimated (session 9-11: setup ~14 s, a step row ~2 s with its graph capture,
# a graph-timed GEMM ~0.5 s + a compile ~1.5 s per new specialization)
NEED = {"setup": 16, "step_check": 6, "alone32": 14, "steps": 10, "alone1": 8, "batch1": 10, "lm_head": 5, "pdl2": 4}
PROOF_WAIT_S = 50  # from the start; the default's first step rows run beside the proof meanwhile
SHAPES = {"o_proj": (2560, 4096), "down": (2560, 9728), "qkv": (6528, 2560), "gate_up": (19456, 2560),
          "qkv_unpadded": (6468, 2560)}  # the proof's order: the split-K shapes first


def prove(smoke: bool, path: str) -> None:
    """(child) swapab == x @ Wᵀ in fp32 at the step's shapes, tiles and PDL levels; writes the verdict to path
    after every case (a killed child leaves what it proved)."""
    from sparse_rl.sparse.ops import skinny_linear
    from sparse_rl.sparse.ops._backend import resolve_pdl
    from sparse_rl.sparse.ops.skinny_gemm.triton import counters

    dev = torch.device("cpu" if smoke else "cuda")
    dt = torch.float32 if smoke else torch.bfloat16
    shapes = {"small": (70, 96), "odd": (37, 61)} if smoke else SHAPES
    res = {"ok": False, "cases": {}, "pdl_level": resolve_pdl(1, dev, 1)}
    t = time.time()
    g = torch.Generator(device=dev).manual_seed(12)
    for name, (N, K) in shapes.items():
        w = (torch.randn(N, K, device=dev, generator=g) / K ** 0.5).to(dt)
        cnt = counters(N, dev)
        for M in (1, 16, 32):
            x = torch.randn(M, K, device=dev, generator=g).to(dt)
            ref = x.float() @ w.float().t()
            for tname, kw in TILES.items():
                # the engine's tile ("sw") at every row count and PDL level; the other tiles (timed alone only,
                # without PDL) at 1 and 32 rows; the unpadded q/k/v (odd N) with "sw" only: fewer compiles
                if tname != "sw" and (M == 16 or name == "qkv_unpadded"):
                    continue
                for pdl in sorted({0, res["pdl_level"]} if tname == "sw" else {0}):
                    a = skinny_linear(x, w, cnt, pdl=pdl, **kw)
                    b = skinny_linear(x, w, cnt, pdl=pdl, **kw)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    err = float((a.float() - ref).abs().max())
                    res["cases"][f"{name}_M{M}_{tname}_pdl{pdl}"] = {
                        "max_abs_err": err, "ref_max": float(ref.abs().max()), "repeat_equal": bool(torch.equal(a, b)),
                        "counters_zero": int(cnt.abs().sum()) == 0,
                        "ok": err <= 0.02 * float(ref.abs().max()) + 0.01 and bool(torch.equal(a, b))
                        and int(cnt.abs().sum()) == 0}
        res["seconds"] = round(time.time() - t, 1)
        res["ok"] = all(c["ok"] for c in res["cases"].values())
        with open(path + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(path + ".tmp", path)
    res["complete"] = True
    with open(path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(path + ".tmp", path)


def start_proof(smoke: bool, path: str):
    err = open(path + ".stderr", "w")
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--prove", "--proof-file", path]
                            + (["--cpu-smoke"] if smoke else []), stdout=err, stderr=err, text=True)


def proof_result(proc, path: str, timeout_s: float) -> dict:
    """The child's verdict; killed at the deadline, ok only if every shape it reached passed and o_proj / down /
    gate_up / qkv are among them."""
    try:
        proc.wait(timeout=max(1.0, timeout_s))
    except Exception:  # noqa: BLE001 -- past the deadline: keep what it proved
        proc.kill()
        proc.wait()
    try:
        with open(path) as f:
            res = json.load(f)
    except Exception as e:  # noqa: BLE001 -- no verdict at all
        res = {"ok": False, "error": f"no proof file: {type(e).__name__}"}
    with open(path + ".stderr") as f:
        res["stderr_tail"] = f.read()[-1200:]
    have = {k.split("_M")[0] for k in res.get("cases", {})}
    if not res.get("complete") and not {"qkv", "o_proj", "gate_up", "down"} <= have:
        res["ok"] = False
    return res


def _cfg(smoke: bool):
    from sparse_rl.bench.rollout import BenchRolloutConfig

    if smoke:
        return BenchRolloutConfig(shape="tiny-qwen3", hf=False, long_new_tokens=[160], long_batches=[4],
                                  long_prompt_len=16, whole="integrate", topk=48, index_heads=2, index_dim=16,
                                  device="cpu", dtype="float32")
    return BenchRolloutConfig(shape="qwen3-4b", hf=False, long_new_tokens=[16384], long_batches=[32],
                              long_prompt_len=128, whole="integrate", topk=2048, index_heads=4, index_dim=64)


def step_check(eng, cases) -> dict:
    """One graph-replayed decode step per (mode, context), base vs swapab on the same engine: the logits' max
    |diff| over max |logit|, the rows whose argmax agrees, swapab's two replays bitwise equal (its counters
    reset in the graph). Not bitwise against base: the GEMMs sum in another order."""
    out = {}
    B = eng.max_batch
    for mode, ctx in cases:
        cache = eng._ensure_cache(ctx)
        tok = torch.randint(10, 500, (B,), device=eng.device, generator=torch.Generator(device=eng.device).manual_seed(9))
        pos = torch.full((B,), ctx - 1, device=eng.device, dtype=torch.long)
        S = eng._bucket(ctx, cache.s_max)
        eng.set_attention(mode)
        got = {}
        with torch.inference_mode():
            for name in ("base", "swapab"):
                rh.apply(eng, VARIANTS[name])
                got[name] = [eng.runner.decode(cache, tok, pos, S, mode).float().clone() for _ in range(3)][1:]
        a, (c, d) = got["base"][0], got["swapab"]
        r = out[f"{mode}_{ctx}"] = {
            "rel_max_diff": float((a - c).abs().max() / a.abs().max().clamp_min(1e-30)),
            "argmax_agree": float((a.argmax(-1) == c.argmax(-1)).float().mean()),
            "swapab_replays_equal": bool(torch.equal(c, d)), "base_replays_equal": bool(torch.equal(*got["base"])),
            "finite": bool(torch.isfinite(c).all()), "graphs": eng.runner.use_graphs}
        log(f"step check {mode} {ctx}: {r}")
    rh.apply(eng, VARIANTS["base"])
    return out


def winners(alone: dict) -> tuple:
    """The SKINNY names whose GEMM ran faster alone at M = 32 with swapab's default tile than with F.linear."""
    out = []
    for k, site in SITES.items():  # the engine runs the default tile, sw: only its time counts
        row = alone.get(f"{k}_M32")
        if row and "skinny_sw" in row and row["skinny_sw"]["ms"] < row["linear_ms"]:
            out.append(site)
    return tuple(out)


def interleaved(names: list) -> dict:
    """base, v1, ..., base, v1, ... (the repeats as name#2) for `rh.step_rows`: every variant beside the default."""
    return {**{n: VARIANTS[n] for n in names}, **{f"{n}#2": VARIANTS[n] for n in names}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="default: $OUT/gap12")
    ap.add_argument("--budget", type=float, default=130)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--cpu-smoke", action="store_true", help="a CPU run of the script itself at tiny sizes")
    ap.add_argument("--prove", action="store_true", help="(child) prove swapab at the step's shapes")
    ap.add_argument("--proof-file", default=None)
    a = ap.parse_args()
    smoke = a.cpu_smoke
    if a.prove:
        prove(smoke, a.proof_file)
        return
    out_dir = a.out or os.path.join(os.environ.get("OUT", "/tmp"), "gap12")
    os.makedirs(out_dir, exist_ok=True)
    proof_path = os.path.join(out_dir, "proof.json")
    proc = start_proof(smoke, proof_path)
    from sparse_rl.bench.rollout import _Bench

    dev = torch.device("cpu" if smoke else "cuda")
    run = Run(out_dir, "gap12.json", a.budget,
              {"commit": a.commit, "budget_s": a.budget, "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "variants": {k: v.describe() for k, v in VARIANTS.items()}, "tiles": TILES, "need_s": NEED})
    cfg = _cfg(smoke)
    B, big, d2k, s2k, b1 = (4, 160, 64, 96, 64) if smoke else (32, 16384, 2048, 2304, 2048)
    st: dict = {}

    def setup():
        b = _Bench(cfg, log, None)
        b.attach_sparse()
        eng = b.engine(B, big + 128, runner_options=VARIANTS["base"].runner_options())
        eng.set_attention("sparse")
        b.fill(eng, big + 128)
        st.update(b=b, eng=eng)
        log(f"model built, copy {b.bw / 1e12:.3f} TB/s, engine batch {B} x {big + 128} filled")
        return {"copy_bw_tb_s": round(b.bw / 1e12, 3)}

    if run.gate(NEED["setup"], "setup"):
        run.res["setup"] = run.guarded("setup", setup)
        run.save()
    cases = (("dense", d2k), ("sparse", big), ("sparse", s2k))
    if "eng" in st and proc.poll() is None:  # the proof still runs: default rows meanwhile (flagged: beside it)
        for mode, ctx in cases:
            if proc.poll() is None and time.time() - T0 < PROOF_WAIT_S - 3:
                rh.step_rows(run, st["b"], st["eng"], [ctx], {"base#0": VARIANTS["base"]}, modes=(mode,), key="steps")
        for r in run.res.get("steps") or []:
            r["beside_proof"] = True
    proof = proof_result(proc, proof_path, PROOF_WAIT_S - (time.time() - T0))
    run.res["proof"] = proof
    bad = [k for k, c in (proof.get("cases") or {}).items() if not c["ok"]]
    log(f"proof: ok {proof.get('ok')} complete {proof.get('complete')} in {proof.get('seconds')} s, "
        f"{len(proof.get('cases') or {})} cases, failing {bad[:6]} {proof.get('error', '')}")
    run.save()
    if "eng" not in st:
        log("setup failed: nothing else runs")
        return
    b, eng = st["b"], st["eng"]
    ok = bool(proof.get("ok"))
    if ok and run.gate(NEED["step_check"], "step_check"):
        chk = run.res["step_check"] = run.guarded("step_check", step_check, eng, [("dense", d2k), ("sparse", s2k)])
        run.save()
        # a sanity guard, not the proof (the child's is): a swapab step that is not finite, or whose logits pick
        # other tokens in most rows, is not timed
        if chk is not None and not all(c["finite"] and c["argmax_agree"] >= 0.5 for c in chk.values()):
            ok = False
            log("step check failed: swapab is not timed")
    shapes = rh.gemm_shapes(b.model)
    run.res["gemm_shapes"] = shapes
    if ok and run.gate(NEED["alone32"], "alone32"):
        run.res["alone_m32"] = run.guarded("alone32", rh.gemm_alone, run, dev, b.bw, shapes, (32,), TILES, smoke)
        run.save()
    win = winners(run.res.get("alone_m32") or {})
    run.res["winners_m32"] = list(win)
    log(f"swapab faster alone at M = 32: {win}")
    names = ["base"] + (["swapab"] if ok else [])
    if ok and win and set(win) != set(SITES.values()):
        VARIANTS["swapab_win"] = V(skinny_gemm=win, skinny_impl="swapab")
        names.append("swapab_win")
    if run.gate(NEED["steps"], "steps"):
        plan = interleaved(names)
        for mode, ctx in cases:
            rh.step_rows(run, b, eng, [ctx], plan, modes=(mode,), key="steps", all_dense=True, need_s=3.0)
    # a capture that failed leaves the runner eager for every later row (both variants): visible here
    run.res["graphs_after_steps"] = {"use_graphs": eng.runner.use_graphs, "graph_error": eng.runner.graph_error}
    run.save()
    later = NEED["alone1"] + NEED["batch1"] + NEED["lm_head"]  # what the rest needs: pdl2 only on top of it
    if ok and run.gate(NEED["pdl2"] + later, "pdl2"):
        rh.step_rows(run, b, eng, [big], {"swapab": VARIANTS["swapab"], "swapab_pdl2": VARIANTS["swapab_pdl2"]},
                     modes=("sparse",), key="pdl2_steps")
    rh.apply(eng, VARIANTS["base"])
    if ok and run.gate(NEED["alone1"], "alone1"):
        run.res["alone_m1"] = run.guarded("alone1", rh.gemm_alone, run, dev, b.bw, shapes, (1,), TILES, smoke)
        run.save()
    if run.gate(NEED["batch1"], "batch1"):
        del eng
        st.pop("eng")
        rh.free()
        e1 = b.engine(1, b1 + 128, runner_options=VARIANTS["base"].runner_options())
        e1.set_attention("sparse")
        b.fill(e1, b1 + 128)
        rh.step_rows(run, b, e1, [b1], interleaved(names[:2]), modes=("dense",), key="batch1", all_dense=True)
        del e1
        rh.free()
    if ok and run.gate(NEED["lm_head"], "lm_head"):
        lm = b.model.get_output_embeddings().weight.shape
        run.res["alone_lm_head"] = run.guarded("lm_head", rh.gemm_alone, run, dev, b.bw, {"lm_head": tuple(lm)},
                                               (32,), {"sw": TILES["sw"]}, smoke)
        run.save()
    run.save()
    log(f"done: skipped {run.res['skipped']}; errors {run.res['errors']}")
    for k in ("alone_m32", "alone_m1", "alone_lm_head"):
        for case, r in (run.res.get(k) or {}).items():
            print(f"| {case} | floor {r['floor_ms'] * 1e3:.1f} us | cuBLAS {r['linear_ms'] * 1e3:.1f} | " + " | ".join(
                f"{n[7:]} {v['ms'] * 1e3:.1f} (err {v['max_abs_err']:.3g})" for n, v in r.items()
                if n.startswith("skinny_")) + " |")
    for k in ("steps", "batch1", "pdl2_steps"):
        for r in run.res.get(k) or []:
            print(f"| {k} | {r['mode']} | {r['variant']} | b{r['batch']} {r['context']} | {r['ms']} ms | {r['x_floor']}x |")


if __name__ == "__main__":
    main()
