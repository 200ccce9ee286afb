"""Session 20 (lead), issue 14: SiLU(gate) * up in the swap-AB gate/up GEMM's epilogue (`ModelRunner(fuse_silu=True)`,
`ops.skinny_silu_mul`), on the H200, Qwen3-4B shape, in one call.

Why: the decode step runs `silu_mul` as its own launch after every gate/up GEMM (36 a step); at batch 32 it moves 1.9
MB, so its cost is the launch and the dependency edge, ~2-4 us under PDL. The gate/up kernel's program now takes the
gate's and the up's rows of the same 64 output columns (one K slice a program, as before: no split at these shapes)
and writes SiLU(gate) * up with `silu_mul`'s roundings: bitwise the two launches (CPU interpreter test), the same
registers and shared memory on sm_90a (80 / 100 KB, Triton 3.6), half the stores.

1. proof: logits with fuse_silu bitwise those without, eager and graph-replayed: sparse 32 x 16384, dense 32 x 2048.
2. steps (graph replay, median of 20, interleaved 3 times): batch 32 sparse 16384 / 2304 and dense 16384 / 2048;
   batch 1 dense 2048 / 16384 and sparse 16384 (the dense targets: <= 1.3x the floor at batch 32, <= 1.5x at 1).
3. gen: the whole 16K generation at batch 32 (integrated), dense and sparse, with and without.

Predictions (before the call): bitwise equal; -0.05 to -0.15 ms a step in every row (36 launches fewer): dense b32
2K ~5.45 -> ~5.35 (1.29x floor), batch 1 dense 2K ~3.04 -> ~2.95 (1.50x); whole 16K b32 ratio +0.01 to +0.02.

    PYTHONPATH=$PWD python benchmarks/gpu_silu_session20.py --budget 420 --out $OUT/silu20

Call 7 measured (results/2026-12-04-h200-session20.md): bitwise; -0.02 to -0.14 ms in all 14 rows; the fused SiLU is
the default since. Next call (written in session 20 after the device time was spent): `--variants base,norm --tol
0.02`: the residual adds + RMSNorms inside the swap-AB GEMMs, `ModelRunner(fuse_norm=True)`: o_proj's and down's
epilogues write h = residual + y and each tile's per-row sum of h^2, the fused gate/up's and the next layer's q/k/v
prologues read RMSNorm(h) from those sums; `add_rmsnorm` then runs twice a step (layer 0's input, the final norm)
instead of 73 times. Not bitwise (the norm's fp32 sum in another order). Predictions: logits within bf16 rounding
(relative max |diff| <= 2e-2, argmax >= 0.9 of rows); -0.08 to -0.25 ms a step (~1 us more on each side of a boundary
that cost ~3-4 us, 71 boundaries); batch 1 dense 2K 3.02 -> ~2.85-2.95 ms (the <= 1.5x target at 2.95). sm_90a under
Triton 3.6 (CPU host, `benchmarks/sm90_swapab.py`): o_proj / down with the residual 119 registers (plain 87-91),
gate/up with the norm 100 (80), q/k/v with the norm 122, 74-98 KB shared (the normalized x tile passes through
registers: a few plain loads beside the cp.async ones).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run  # noqa: E402
from gpu_streams_session20 import _bench, _variants, proof_part  # noqa: E402

NAMES = ["base", "silu"]  # call 7's; `--variants` for the next


def steps_part(run, b, plan, reps: int) -> None:
    import rollout_harness as rh

    variants = _variants(NAMES)
    for B, (top, ctxs, modes) in plan.items():
        if not run.gate(20, f"steps b{B}"):
            break
        eng = b.engine(B, top)
        b.fill(eng, top)
        for rep in range(reps):
            for mode, cs in modes.items():
                for r in rh.step_rows(run, b, eng, [c for c in ctxs if c in cs], variants, modes=(mode,),
                                      need_s=4.0, all_dense=True):
                    r.setdefault("rep", rep)
        del eng
        rh.free()


def call(a, names: list, gen_names: list, json_name: str) -> None:
    """One device call's parts (a: the parsed arguments: out, budget, reps, parts, smoke, tol, batch): proof of every
    variant of names against the first, interleaved steps, the whole 16K generation of gen_names; printed at the end.
    Session 21's `gpu_norm_session21.py` runs its variants through it too. a.batch (default 32): the large batch of
    every part (16 on an 80 GB H100, where 32 x 16K of the Qwen3-4B shape's K/V, 77 GB, does not fit)."""
    import torch

    import gpu_streams_session20 as g20
    import rollout_harness as rh

    NAMES[:] = names
    run = Run(a.out, json_name, a.budget, {"torch": torch.__version__, "variants": names})
    b = _bench(a.smoke)
    if a.smoke:  # no swapab GEMMs off sm_90: ask for them, so the fused path runs under the interpreter
        for n in names:
            g20.VARIANTS[n] = {**g20.VARIANTS[n], "skinny_gemm": True, "skinny_impl": "swapab"}
    ok, BB = True, a.batch
    run.res["batch"] = BB
    if "proof" in a.parts:
        ok = bool(run.guarded("proof sparse", proof_part, run, b, [(3, 40)] if a.smoke else [(BB, 16384)], names,
                              "sparse", a.tol))
        ok &= bool(run.guarded("proof dense", proof_part, run, b, [(3, 40)] if a.smoke else [(BB, 2048)], names,
                               "dense", a.tol))
        run.res["proof_equal"] = ok
        run.save()
    if ok and "steps" in a.parts:
        plan = ({3: (64, [40], {"sparse": [40], "dense": [40]})} if a.smoke else
                {BB: (16640, [16384, 2304, 2048], {"sparse": [16384, 2304], "dense": [16384, 2048]}),
                 1: (16640, [2048, 16384], {"dense": [2048, 16384], "sparse": [16384]})})
        run.guarded("steps", steps_part, run, b, plan, a.reps)
        run.save()
    if ok and "gen" in a.parts:
        new, batch, prompt = (24, 2, 8) if a.smoke else (16384, BB, 128)
        v = _variants(gen_names)
        plan = [(m, n, v[n]) for n in gen_names for m in ("dense", "sparse")]
        run.guarded("gen", rh.whole, run, b, new, batch, prompt, plan, "gen", {"dense": 40, "sparse": 40})
    run.save()
    for r in run.res.get("steps", []):
        print(r["rep"], r["mode"], r["batch"], r["context"], r["variant"], r["ms"], r["floor_ms"], r["x_floor"])
    print(json.dumps([{k: r.get(k) for k in ("mode", "variant", "tokens_per_s", "sparse_over_dense", "floors_ratio")}
                      for r in run.res.get("gen", [])]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "silu20"))
    ap.add_argument("--budget", type=float, default=420.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", default="proof,steps,gen")
    ap.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU (checks the parts run)")
    ap.add_argument("--variants", default=",".join(NAMES))
    ap.add_argument("--tol", type=float, default=0.0, help="proof: logits within tol x the largest (0: bitwise)")
    ap.add_argument("--batch", type=int, default=32, help="the large batch (16 on an 80 GB H100)")
    a = ap.parse_args()
    names = a.variants.split(",")
    call(a, names, names, "silu20.json")


if __name__ == "__main__":
    main()
