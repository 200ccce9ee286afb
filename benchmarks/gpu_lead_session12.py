"""Session 12 (lead, issue 14): (1) does a whole generation integrated from step times agree with the generation
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

(2) One launch for a sparse layer's q/k norm + RoPE + K/V cache write and its indexer's per-token work
(`ModelRunner(fuse_indexer=True)`, `ops.qk_rope_indexer_decode`; bitwise the values of the two launches under
the interpreter, tests/rl/test_rollout.py) against two: the logits of one step compared, then sparse steps at
2,304 and 16,384, interleaved, both timings. 34 launches fewer a step (588 -> 554 at 32 x 16K).

Predictions (before the call): fused == unfused logits bitwise on the GPU; the step -0.04 to -0.08 ms at both
contexts (34 boundaries at ~1-2 us, the indexer kernel's own ~2.3 us a layer mostly hidden in the RoPE
launch). Queued steps 0.1-0.3 ms shorter than synced at every context in both modes
(a 590-kernel graph's launch and the first kernels' ramp on an idle device); the real 3K generation within 2%
of the queued integral and 2-5% faster than the synced one; so 16K sparse/dense with queued steps ~1.71-1.73x
instead of 1.69x.

    PYTHONPATH=$PWD python benchmarks/gpu_lead_session12.py --budget 110
    PYTHONPATH=$PWD python benchmarks/gpu_lead_session12.py --cpu-smoke --budget 300
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run, log  # noqa: E402


def fuse_ab(run, b, eng, B, ctxs) -> None:
    """One launch vs two for the q/k RoPE + indexer: logits of one step equal, then interleaved step rows."""
    import torch

    r = eng.runner
    b.fill(eng, max(ctxs))
    with torch.inference_mode():
        eng.set_attention("sparse")
        cache = eng._ensure_cache(max(ctxs))
        tok = torch.randint(0, r.vocab, (B,), device=eng.device)
        pos = torch.full((B,), ctxs[0] - 1, device=eng.device)
        outs = []
        for on in (True, False):
            snap = [t[:, :, ctxs[0] - 1].clone() for t in (cache.k, cache.v, cache.idx)]
            r.set_fuse_indexer(on)
            outs.append(r.decode_eager(cache, tok, pos, eng._bucket(ctxs[0], cache.s_max), "sparse").clone())
            for t, s0 in zip((cache.k, cache.v, cache.idx), snap):
                t[:, :, ctxs[0] - 1] = s0
    res = run.res["fuse"] = {"logits_equal": bool(torch.equal(outs[0], outs[1])),
                             "max_abs_diff": float((outs[0] - outs[1]).abs().max()), "steps": []}
    log(f"fuse: logits equal {res['logits_equal']} (max |diff| {res['max_abs_diff']})")
    for ctx in ctxs:
        if not run.gate(8, f"fuse steps {ctx}"):
            continue
        row = {"context": ctx}
        for rep in range(2):
            for on in (True, False):
                r.set_fuse_indexer(on)
                for timing in ("synced", "queued"):
                    b.cfg.step_timing = timing
                    row.setdefault(f"{'fused' if on else 'two'}_{timing}", []).append(
                        b.step_row(eng, B, ctx, "sparse")["ms"])
        r.set_fuse_indexer(True)
        res["steps"].append(row)
        log(f"fuse steps {ctx}: " + " ".join(f"{k}={v}" for k, v in row.items()))
        run.save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "lead"))
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
    run = Run(a.out, "lead_session12.json", a.budget, {"commit": a.commit, "torch": torch.__version__,
                                                         "batch": B, "prompt": P, "new_tokens": N})
    b = _Bench(cfg, log, None)
    b.attach_sparse()
    eng = b.engine(B, top)
    ids = b.prompts(B, P)
    fuse_ab(run, b, eng, B, ctxs)
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
    fz = run.res.get("fuse") or {}
    print(f"fuse: logits equal {fz.get('logits_equal')}")
    for r in fz.get("steps", []):
        print("| fuse " + " | ".join(f"{k} {v}" for k, v in r.items()) + " |")


if __name__ == "__main__":
    main()
