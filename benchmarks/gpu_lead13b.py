"""Session 13 (lead, issue 14), a probe: does the decode attention's early PDL trigger cost time?

Why: at PDL level 2 (the default with the swap-AB GEMMs) every kernel triggers its dependents right after its own
`gdc_wait`, so o_proj's swap-AB GEMM launches while the attention still runs and prefetches its first weight tiles
(shared memory, HBM bandwidth) on SMs the attention shares. Call 3's in-launch merge (which put o_proj right after
the attention at batch 1 and 16) was slower most where the attention is long (+9% at batch 16 x 32K dense). This
probe launches only the attention at level 1 (it waits, it does not trigger early) and leaves every other kernel
at the step's level; a benchmark-only patch of `ModelRunner._attend` (graphs recaptured), no engine change.

Predictions (before the call): attention at level 1 within +-1% of the default where the attention is short (b32
2K dense, 2304 sparse, b1 2K) and 0-5% faster where it is long (b32 16K dense, b16 32K dense), sparse 16K within
+-2%.

    PYTHONPATH=$PWD python benchmarks/gpu_lead13b.py --budget 90
    PYTHONPATH=$PWD python benchmarks/gpu_lead13b.py --cpu-smoke --budget 300
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run, log  # noqa: E402

import rollout_harness as rh  # noqa: E402


def set_attention_pdl1(on: bool, eng) -> None:
    from sparse_rl.rl.rollout.forward import ModelRunner

    orig = set_attention_pdl1.__dict__.setdefault("orig", ModelRunner.__dict__["_attend"])
    if on:
        fn = orig.__func__

        def capped(q, kc, vc, sel, scale, backend, compiled, pdl=False):
            return fn(q, kc, vc, sel, scale, backend, compiled, min(int(pdl), 1))

        ModelRunner._attend = staticmethod(capped)
    else:
        ModelRunner._attend = orig
    eng.runner.drop_graphs()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "lead13b"))
    ap.add_argument("--budget", type=float, default=90.0)
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    import torch

    from sparse_rl.bench.rollout import BenchRolloutConfig, _Bench

    if a.cpu_smoke:
        cfg = BenchRolloutConfig(shape="tiny-qwen3", hf=False, topk=24, index_heads=2, index_dim=16, device="cpu",
                                 dtype="float32")
        plan = {3: (64, [("dense", 20), ("sparse", 60)]), 1: (64, [("dense", 40)])}
    else:
        cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, topk=2048, index_heads=4, index_dim=64)
        plan = {32: (16640, [("dense", 2048), ("sparse", 2304), ("sparse", 16384), ("dense", 16384)]),
                16: (32896, [("dense", 32768), ("sparse", 32768)]),
                1: (16640, [("dense", 2048), ("dense", 16384)])}
    run = Run(a.out, "lead13b.json", a.budget, {"commit": a.commit, "torch": torch.__version__})
    b = _Bench(cfg, log, None)
    b.attach_sparse()
    rows = run.res.setdefault("steps", [])
    for B, (top, items) in plan.items():
        if not run.gate(25, f"engine b{B}"):
            break
        eng = b.engine(B, top)
        eng.set_attention("sparse")
        b.fill(eng, top)
        log(f"b{B}: pdl level {eng.runner.pdl}")
        for mode, ctx in items:
            if not run.gate(8, f"b{B} {mode} {ctx}"):
                break
            row = {"batch": B, "mode": mode, "context": ctx, "pdl": eng.runner.pdl}
            for on in (False, True, False, True):
                set_attention_pdl1(on, eng)
                row.setdefault("attn_pdl1" if on else "default", []).append(b.step_row(eng, B, ctx, mode)["ms"])
            set_attention_pdl1(False, eng)
            row["delta_ms"] = round((sum(row["attn_pdl1"]) - sum(row["default"])) / 2, 4)
            rows.append(row)
            log(f"b{B} {mode} {ctx}: default {row['default']} attn_pdl1 {row['attn_pdl1']} delta {row['delta_ms']}")
            run.save()
        del eng
        rh.free()
    run.save()
    print("| batch | mode | context | default ms | attention at PDL 1 ms | delta ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['mode']} | {r['context']} | {r['default']} | {r['attn_pdl1']} | {r['delta_ms']} |")


if __name__ == "__main__":
    main()
