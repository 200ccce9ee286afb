"""Session 12 device run 2 (issue 14, helper gap12, --budget 60): the swap-AB skinny GEMM after call 1
(results/2026-12-02-h200-gap12-session12.md), on call 1's script's pieces (gpu_gap12_session12.py).

    PYTHONPATH=$PWD python benchmarks/gpu_gap12_session12_call2.py --budget 60 --commit SHA                (H200)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_gap12_session12_call2.py --cpu-smoke --budget 600

What call 1 showed: alone at M = 32 swapab lost wherever it split K (o_proj 9.5-14.8 us vs cuBLAS 8.0, down
16.3-23.2 vs 16.0, q/k/v 9.9-12.0 vs 9.4) and won where it did not (gate/up 27.9 vs 29.4); in the step all four
as swapab +0.55-0.75 ms, gate/up alone -0.01 to -0.13; swapab at PDL level 2 -0.48 ms against swapab at level 1
(sparse 16K: 9.13 vs 9.61; the weight prefetch before the wait then overlaps the previous kernel). Changed since:
the tile's last program loads the SPLIT partials unrolled (SPLIT a constexpr), all in flight, where call 1's
runtime loop took one L2 round trip after another; `ModelRunner(skinny_tiles=)` gives each site its tile.

Phases (gated on the time left, JSON + log after every row, $OUT/gap12/gap12_call2.json):
1. proof child (call 1's `prove`, these tiles): "sw" (128 x 64, <= 264 programs) at PDL 0 / 1 / 2, "sw64"
   (64 x 128, 3 stages, 264) at PDL 0 / 2; M = 1, 16, 32 (sw64: 1, 32); the padded and unpadded q/k/v, o_proj,
   gate/up, down: each twice against fp32, bitwise-equal repeats, counters zero. Unproved: no swapab row.
2. setup (36 layers, 32 x 16,512); meanwhile the default's first rows beside the proof ("base#0").
3. alone M = 32: F.linear vs sw / sw64 per GEMM; each site's faster tile, and whether it beats F.linear.
4. steps, batch 32, dense 2048 / sparse 16384 / sparse 2304, interleaved twice on one engine: base (PDL 1, the
   default), base_pdl2, best_pdl2 (swapab with its best tile at the sites where it beat F.linear alone, PDL 2),
   all_pdl2 (all four sites as swapab, best tiles, PDL 2), best (as best_pdl2 at PDL 1).
5. batch 1 dense 2048: base vs all_pdl2 (tiles of the M = 32 choice), if time is left.

Predictions (before call 2):
- Proof passes. Alone M = 32 with the unrolled reduce: o_proj sw ~7.5 (call 1 14.8; cuBLAS 8.0), sw64 ~8.0
  (9.5); down sw ~15 (23.2; 16.0); q/k/v sw ~9.5 (12.0; 9.4); gate/up unchanged (no split): 27.9 vs 29.4.
- Steps: base_pdl2 +0.05 to +0.15 ms over base (session 11: +0.13 at sparse 16K); best_pdl2 -0.1 to -0.3 ms
  against base at each row (the PDL-2 prefetch is worth more to the GEMMs than level 2 costs the rest);
  all_pdl2 within +-0.2 of best_pdl2; best (PDL 1) -0.0 to -0.1 (call 1's gate/up-only row).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import gpu_gap12_session12 as c1  # noqa: E402
import rollout_harness as rh  # noqa: E402
from granular_harness import T0, Run, log  # noqa: E402

V = rh.Variant
TILES = {"sw": {"impl": "swapab", "backend": "triton"},
         "sw64": {"impl": "swapab", "backend": "triton", "bw": 64, "bk": 128, "programs": 264, "num_stages": 3}}
PROOF_PDL = {"sw": (0, 1, 2), "sw64": (0, 2)}
NEED = {"setup": 16, "alone32": 6, "steps": 6, "batch1": 8}
PROOF_WAIT_S = 30


def prove(smoke: bool, path: str) -> None:
    """(child) swapab == x @ Wᵀ in fp32 at call 1's shapes with these tiles and PDL levels (capped at what the
    device supports); the verdict written after every shape, as call 1's (`c1.proof_result` reads it)."""
    import json

    from sparse_rl.sparse.ops import skinny_linear
    from sparse_rl.sparse.ops._backend import resolve_pdl
    from sparse_rl.sparse.ops.skinny_gemm.triton import counters

    dev = torch.device("cpu" if smoke else "cuda")
    dt = torch.float32 if smoke else torch.bfloat16
    shapes = {"small": (70, 96), "odd": (37, 61)} if smoke else c1.SHAPES
    top = resolve_pdl(2, dev, 2)
    res = {"ok": False, "cases": {}, "pdl_top": top}
    t = time.time()
    g = torch.Generator(device=dev).manual_seed(13)

    def dump():
        with open(path + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(path + ".tmp", path)

    for name, (N, K) in shapes.items():
        w = (torch.randn(N, K, device=dev, generator=g) / K ** 0.5).to(dt)
        cnt = counters(N, dev)
        for M in (1, 16, 32):
            x = torch.randn(M, K, device=dev, generator=g).to(dt)
            ref = x.float() @ w.float().t()
            for tname, kw in TILES.items():
                if tname != "sw" and (M == 16 or name == "qkv_unpadded"):
                    continue
                for pdl in sorted({min(p, top) for p in PROOF_PDL[tname]}):
                    y1 = skinny_linear(x, w, cnt, pdl=pdl, **kw)
                    y2 = skinny_linear(x, w, cnt, pdl=pdl, **kw)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    err = float((y1.float() - ref).abs().max())
                    same, zero = bool(torch.equal(y1, y2)), int(cnt.abs().sum()) == 0
                    res["cases"][f"{name}_M{M}_{tname}_pdl{pdl}"] = {
                        "max_abs_err": err, "ref_max": float(ref.abs().max()), "repeat_equal": same,
                        "counters_zero": zero, "ok": err <= 0.02 * float(ref.abs().max()) + 0.01 and same and zero}
        res["seconds"] = round(time.time() - t, 1)
        res["ok"] = all(c["ok"] for c in res["cases"].values())
        dump()
    res["complete"] = True
    dump()


def start_proof(smoke: bool, path: str):
    import subprocess

    err = open(path + ".stderr", "w")
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--prove", "--proof-file", path]
                            + (["--cpu-smoke"] if smoke else []), stdout=err, stderr=err, text=True)


def best_tiles(alone: dict) -> tuple[tuple, tuple]:
    """(all four sites' faster tile, as Variant.skinny_tiles pairs; the sites where that tile beat F.linear)."""
    pairs, wins = [], []
    for k, site in c1.SITES.items():
        row = alone.get(f"{k}_M32") or {}
        t = {n[7:]: v["ms"] for n, v in row.items() if n.startswith("skinny_")}
        if not t:
            continue
        name = min(t, key=t.get)
        kw = tuple((a, b) for a, b in TILES[name].items() if a not in ("impl", "backend"))
        pairs.append((site, kw))
        if t[name] < row["linear_ms"]:
            wins.append(site)
    return tuple(pairs), tuple(wins)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="default: $OUT/gap12")
    ap.add_argument("--budget", type=float, default=60)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--prove", action="store_true")
    ap.add_argument("--proof-file", default=None)
    a = ap.parse_args()
    smoke = a.cpu_smoke
    if a.prove:
        prove(smoke, a.proof_file)
        return
    out_dir = a.out or os.path.join(os.environ.get("OUT", "/tmp"), "gap12")
    os.makedirs(out_dir, exist_ok=True)
    proof_path = os.path.join(out_dir, "proof_call2.json")
    proc = start_proof(smoke, proof_path)
    from sparse_rl.bench.rollout import _Bench

    dev = torch.device("cpu" if smoke else "cuda")
    run = Run(out_dir, "gap12_call2.json", a.budget,
              {"commit": a.commit, "budget_s": a.budget, "torch": torch.__version__, "call": 2,
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "tiles": TILES, "need_s": NEED})
    cfg = c1._cfg(smoke)
    B, big, d2k, s2k, b1 = (4, 160, 64, 96, 64) if smoke else (32, 16384, 2048, 2304, 2048)
    st: dict = {}

    def setup():
        b = _Bench(cfg, log, None)
        b.attach_sparse()
        eng = b.engine(B, big + 128, runner_options=V().runner_options())
        eng.set_attention("sparse")
        b.fill(eng, big + 128)
        st.update(b=b, eng=eng)
        log(f"model built, copy {b.bw / 1e12:.3f} TB/s, engine batch {B} x {big + 128} filled")
        return {"copy_bw_tb_s": round(b.bw / 1e12, 3)}

    if run.gate(NEED["setup"], "setup"):
        run.res["setup"] = run.guarded("setup", setup)
        run.save()
    cases = (("dense", d2k), ("sparse", big), ("sparse", s2k))
    if "eng" in st and proc.poll() is None:
        for mode, ctx in cases[:2]:
            if proc.poll() is None and time.time() - T0 < PROOF_WAIT_S - 2:
                rh.step_rows(run, st["b"], st["eng"], [ctx], {"base#0": V()}, modes=(mode,), key="steps")
        for r in run.res.get("steps") or []:
            r["beside_proof"] = True
    proof = c1.proof_result(proc, proof_path, PROOF_WAIT_S - (time.time() - T0))
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
    if ok and run.gate(NEED["alone32"], "alone32"):
        run.res["alone_m32"] = run.guarded("alone32", rh.gemm_alone, run, dev, b.bw, rh.gemm_shapes(b.model), (32,),
                                           TILES, smoke)
        run.save()
    tiles, wins = best_tiles(run.res.get("alone_m32") or {})
    run.res["best_tiles"], run.res["wins_m32"] = {s: dict(kw) for s, kw in tiles}, list(wins)
    log(f"best tiles {run.res['best_tiles']}; swapab faster alone at M = 32: {wins}")
    variants = {"base": V(), "base_pdl2": V(pdl=2)}
    if ok and tiles:
        sw = dict(skinny_impl="swapab", skinny_tiles=tiles)
        if wins:
            variants["best_pdl2"] = V(skinny_gemm=wins, pdl=2, **sw)
        variants["all_pdl2"] = V(skinny_gemm=True, pdl=2, **sw)
        if wins:
            variants["best"] = V(skinny_gemm=wins, **sw)
    run.res["variants"] = {k: v.describe() for k, v in variants.items()}
    if run.gate(NEED["steps"], "steps"):
        plan = {**variants, **{f"{n}#2": v for n, v in variants.items()}}
        for mode, ctx in cases:
            rh.step_rows(run, b, eng, [ctx], plan, modes=(mode,), key="steps", all_dense=True, need_s=2.0)
    run.res["graphs_after_steps"] = {"use_graphs": eng.runner.use_graphs, "graph_error": eng.runner.graph_error}
    run.save()
    if "all_pdl2" in variants and run.gate(NEED["batch1"], "batch1"):
        del eng
        st.pop("eng")
        rh.free()
        e1 = b.engine(1, b1 + 128, runner_options=V().runner_options())
        e1.set_attention("sparse")
        b.fill(e1, b1 + 128)
        pl = {"base": variants["base"], "all_pdl2": variants["all_pdl2"]}
        rh.step_rows(run, b, e1, [b1], {**pl, **{f"{n}#2": v for n, v in pl.items()}}, modes=("dense",),
                     key="batch1", all_dense=True)
        del e1
        rh.free()
    run.save()
    log(f"done: skipped {run.res['skipped']}; errors {run.res['errors']}")
    for case, r in (run.res.get("alone_m32") or {}).items():
        print(f"| {case} | floor {r['floor_ms'] * 1e3:.1f} us | cuBLAS {r['linear_ms'] * 1e3:.1f} | " + " | ".join(
            f"{n[7:]} {v['ms'] * 1e3:.1f} (err {v['max_abs_err']:.3g})" for n, v in r.items()
            if n.startswith("skinny_")) + " |")
    for k in ("steps", "batch1"):
        for r in run.res.get(k) or []:
            print(f"| {k} | {r['mode']} | {r['variant']} | b{r['batch']} {r['context']} | {r['ms']} ms | {r['x_floor']}x |")


if __name__ == "__main__":
    main()
