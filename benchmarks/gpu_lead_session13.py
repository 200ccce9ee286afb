"""Session 13 (lead, issue 14): where the default decode step's time goes now (swap-AB GEMMs at PDL level 2, the
fused RoPE + indexer launch), per kernel, in graph replay, at the rows the issue's targets name.

Why: session 12's last profile (32 x 16K) predates the swap-AB default, and no profile was ever taken at the
context where the sparse step jumps (b32: 5.39 ms at 2,048 -> 6.29 at 2,304, where the select chain switches on)
or at batch 1 (dense 1.55x its floor against the <= 1.5x target). The helpers working on the select chain and on
the fixed per-layer cost need the per-kernel split of those rows.

What: Qwen3-4B shape (random weights, bf16), one engine per batch (32, 1), caches filled as `bench rollout`
does; for each (batch, mode, context) row: the step (graph replay, median of 20) and one graph-replayed step
under torch.profiler (`granular_harness.timeline_profile`): kernel count, busy / span / gaps, and the summed
time of every kernel name (top 40) and of each class (`rollout_harness.classify`).

Predictions (before the call): b32 sparse 2304: select classes (score + three fine passes) ~0.8-0.9 ms of busy
time in 136 launches (~6 us each: latency, not bytes), GEMMs ~2.1-2.3 ms; b32 sparse 16384: score ~0.65 ms,
select ~1.2 ms; b1 dense 2048: ~500 kernels, gaps 0.3-0.5 ms, GEMMs ~2.2 ms against 1.86 ms of weight bytes.

    PYTHONPATH=$PWD python benchmarks/gpu_lead_session13.py --budget 100
    PYTHONPATH=$PWD python benchmarks/gpu_lead_session13.py --cpu-smoke --budget 300
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run, log, timeline_profile  # noqa: E402

import rollout_harness as rh  # noqa: E402


def by_class(top: dict) -> dict:
    """{class: ms} from timeline_profile's {"name xN": ms}."""
    out: dict = defaultdict(float)
    for name, ms in top.items():
        out[rh.classify(name.rsplit(" x", 1)[0])] += ms
    return {k: round(v, 4) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def profile_row(run, b, eng, B: int, ctx: int, mode: str) -> dict:
    import torch

    step = b.step_row(eng, B, ctx, mode)["ms"]
    cache = eng._ensure_cache(ctx)
    tok = torch.randint(0, eng.runner.vocab, (B,), device=eng.device)
    pos = torch.full((B,), ctx - 1, device=eng.device)
    S = eng._bucket(ctx, cache.s_max)
    eng.set_attention(mode)
    with torch.inference_mode():
        p = timeline_profile(lambda: eng.runner.decode(cache, tok, pos, S, mode), eng.device, top=40) or {}
    p = {k: (round(x, 4) if isinstance(x, float) else x) for k, x in p.items()}
    p["classes_ms"] = by_class(p.get("top", {}))
    row = {"batch": B, "mode": mode, "context": ctx, "step_ms": step, **p}
    log(f"b{B} {mode} {ctx}: step {step} ms, {p.get('kernels')} kernels, busy {p.get('busy_ms')} span "
        f"{p.get('span_ms')} gaps {p.get('gaps_ms')}; {p['classes_ms']}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "lead"))
    ap.add_argument("--budget", type=float, default=100.0)
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    import torch

    from sparse_rl.bench.rollout import BenchRolloutConfig, _Bench

    if a.cpu_smoke:
        cfg = BenchRolloutConfig(shape="tiny-qwen3", hf=False, topk=24, index_heads=2, index_dim=16, device="cpu",
                                 dtype="float32")
        plan = {3: [("dense", 20), ("sparse", 30), ("sparse", 60)], 1: [("dense", 20), ("sparse", 60)]}
        top = 64
    else:
        cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, topk=2048, index_heads=4, index_dim=64)
        plan = {32: [("dense", 2048), ("sparse", 2304), ("sparse", 16384), ("dense", 16384)],
                1: [("dense", 2048), ("sparse", 16384), ("dense", 16384)]}
        top = 16640
    run = Run(a.out, "lead_session13.json", a.budget, {"commit": a.commit, "torch": torch.__version__})
    b = _Bench(cfg, log, None)
    b.attach_sparse()
    rows = run.res.setdefault("profiles", [])
    for B, items in plan.items():
        if not run.gate(20, f"engine b{B}"):
            break
        eng = b.engine(B, top)
        eng.set_attention("sparse")  # the cache gets (random) index keys only when allocated in sparse mode
        b.fill(eng, top)
        for mode, ctx in items:
            if not run.gate(6, f"b{B} {mode} {ctx}"):
                break
            r = run.guarded(f"b{B} {mode} {ctx}", profile_row, run, b, eng, B, ctx, mode)
            if r:
                rows.append(r)
            run.save()
        del eng
        rh.free()
    run.save()
    print("| batch | mode | context | step ms | kernels | busy ms | gaps ms | classes ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['mode']} | {r['context']} | {r['step_ms']} | {r.get('kernels')} | "
              f"{r.get('busy_ms')} | {r.get('gaps_ms')} | {r['classes_ms']} |")


if __name__ == "__main__":
    main()
