"""Session 12 (lead, issue 14): does a whole generation integrated from step times agree with the generation
itself, with steps timed synced (each launched on an idle device and waited for: `time_step`'s method through
session 11) or queued (back to back, as the generation's loop runs them)?

Why: `bench rollout --whole integrate` sums step times over the contexts of a generation that would not fit a
benchmark call. Its step rows wait for every step, so each starts on an idle device, and its per-step
correction (a short real generation minus its own integral) is clamped at zero: when the real steps run
faster than the timed ones the integral keeps the difference. Session 5's one check had a measured sparse 16K
generation 4% faster than its integral; session 12's call 2 timed one engine's default step 6-9% apart in
two phases of one script. If synced steps overstate every step by a fixed launch / ramp cost, the integral
overstates the SHORTER (sparse) generation relatively more.

What: Qwen3-4B shape (random weights, bf16), batch 32, 128-token prompts: one engine of 16,640 tokens; per mode
(dense, sparse): a real 3,072-token generation timed end to end (`time_generate`, warmed up), then the same
generation integrated with synced and with queued step points; then steps at 2,304 and 16,384 context both
ways (the README's rows).

Predictions (before the call): queued steps 0.1-0.3 ms shorter than synced at every context in both modes
(a 590-kernel graph's launch and the first kernels' ramp on an idle device); the real 3K generation within 2%
of the queued integral and 2-5% faster than the synced one; so 16K sparse/dense with queued steps ~1.71-1.73x
instead of 1.69x.

    PYTHONPATH=$PWD python benchmarks/gpu_timing_session12.py --budget 110
    PYTHONPATH=$PWD python benchmarks/gpu_timing_session12.py --cpu-smoke --budget 300
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run, log  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "timing"))
    ap.add_argument("--budget", type=float, default=110.0)
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    import torch

    from sparse_rl.bench.rollout import BenchRolloutConfig, _Bench, _integrated

    smoke = a.cpu_smoke
    if smoke:
        cfg = BenchRolloutConfig(shape="tiny-qwen3", hf=False, long_new_tokens=[40], long_batches=[3],
                                 long_prompt_len=16, whole="integrate", topk=24, index_heads=2, index_dim=16,
                                 device="cpu", dtype="float32")
        B, P, N, top, ctxs = 3, 16, 40, 64, [30, 60]
    else:
        cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, long_new_tokens=[3072], long_batches=[32],
                                 long_prompt_len=128, whole="integrate", topk=2048, index_heads=4, index_dim=64)
        B, P, N, top, ctxs = 32, 128, 3072, 16640, [2304, 16384]
    run = Run(a.out, "timing_session12.json", a.budget, {"commit": a.commit, "torch": torch.__version__,
                                                         "batch": B, "prompt": P, "new_tokens": N})
    b = _Bench(cfg, log, None)
    b.attach_sparse()
    eng = b.engine(B, top)
    ids = b.prompts(B, P)
    rows = run.res.setdefault("whole", [])
    for mode in ("dense", "sparse"):
        if not run.gate(35, f"whole {mode}"):
            continue
        secs, n = b.time_generate(eng, ids, N, mode)
        row = {"mode": mode, "measured_s": round(secs, 3), "tokens": n}
        for timing in ("synced", "queued"):
            b.cfg.step_timing = timing
            isecs, extra = _integrated(b, eng, ids, N, mode)
            row[f"{timing}_s"] = round(isecs, 3)
            row[f"{timing}_over_measured"] = round(isecs / secs, 4)
            row[f"{timing}_points"] = extra["step_points"]
            row[f"{timing}_overhead_ms_per_step"] = extra["overhead_ms_per_step"]
        rows.append(row)
        log(" ".join(f"{k}={v}" for k, v in row.items() if not k.endswith("points")))
        run.save()
    steps = run.res.setdefault("steps", [])
    b.fill(eng, top)
    for ctx in ctxs:
        for mode in ("dense", "sparse"):
            if not run.gate(4, f"step {mode} {ctx}"):
                continue
            r = {"mode": mode, "context": ctx}
            for timing in ("synced", "queued", "synced", "queued"):  # twice each, interleaved
                b.cfg.step_timing = timing
                r.setdefault(timing, []).append(b.step_row(eng, B, ctx, mode)["ms"])
            steps.append(r)
            log(f"step {mode} {ctx}: synced {r['synced']} queued {r['queued']}")
            run.save()
    run.save()
    print("| mode | measured s | synced integral (ratio) | queued integral (ratio) |")
    for r in rows:
        print(f"| {r['mode']} | {r['measured_s']} | {r['synced_s']} ({r['synced_over_measured']}) | "
              f"{r['queued_s']} ({r['queued_over_measured']}) |")
    for r in steps:
        print(f"| step {r['mode']} {r['context']} | synced {r['synced']} | queued {r['queued']} |")


if __name__ == "__main__":
    main()
