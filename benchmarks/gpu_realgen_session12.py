"""Session 12 (lead, issue 14): why a real sparse generation ran 1.40x its integral (call 3 of the session,
`gpu_lead_session12.py`: batch 32, 128 + 3,072 tokens, Qwen3-4B shape, random weights: sparse measured 23.38 s
against 16.70 s integrated from graph-replayed step rows; dense 17.47 against 16.40, 1.07x).

Candidates, each checked here: (a) the real generation does not replay graphs for some buckets (captures or
eager steps during the timed run: counted by wrapping the runner's `_capture` and `decode_eager`); (b) the
select's time depends on the cache's data: a random-weight model sampled at temperature 1 may repeat tokens,
so its index keys cluster and the fine select's threshold bin fills (the step timed and profiled on the
generation's own cache, then on the random cache the step rows use, same context); (c) host work per step
(the generation's steps per second against the step rows').

Predictions (before the call): (a) no captures and no eager steps during the timed run (warm-up captured every
bucket); (b) the step on the generation's cache 1.5-2x the step on the random cache at the same context, the
difference in `_resolve_write` / `_sub_gather` (the sub-bin), the generated rows with few distinct tokens;
(c) not the cause (dense pays the same host work: 1.07x).

Call 1 (`68415d1`, session 12's fourth device call): (a) right: no captures, no eager steps; (b) wrong: the step
on the generation's own cache took 6.559 ms at 2,728 against 6.816 on a random one (kernels 6,262 vs 6,231 us),
and the generated rows held 2,559-2,581 distinct tokens of 2,600; (c) wrong as stated: the sparse generation
took 20.27 s (7.80 ms a step), the dense one 13.33 s (5.13), while sparse and dense steps are within 0.1 ms of
each other up to 2,048 context. Reading: the ~7 s is one-time, in the first sparse PREFILL of 32 x 128 tokens
(the warm-up prefills one 8-token prompt only; the sparse prefill's Triton kernels specialise on the batch and
the length, dense's prefill is SDPA). Call 2 (`--call 2`): per mode, two generations of the same prompts back
to back, the first after `warmup(P + N)` as before, the second warm; then `warmup(prompts=)` (the fix) and a
third with new prompts of the same shape. Predicted: sparse first - second ~6-8 s, dense < 1 s; the third
within 2% of the second.

    PYTHONPATH=$PWD python benchmarks/gpu_realgen_session12.py --budget 90
    PYTHONPATH=$PWD python benchmarks/gpu_realgen_session12.py --cpu-smoke --budget 300
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import rollout_harness as rh  # noqa: E402
from granular_harness import Run, log  # noqa: E402


def setup(smoke: bool, N: int):
    """(config, batch, prompt tokens, new tokens): the Qwen3-4B shape at batch 32, or a tiny CPU one."""
    from sparse_rl.bench.rollout import BenchRolloutConfig

    if smoke:
        return (BenchRolloutConfig(shape="tiny-qwen3", hf=False, long_new_tokens=[N], long_batches=[3],
                                   long_prompt_len=16, topk=24, index_heads=2, index_dim=16, device="cpu",
                                   dtype="float32"), 3, 16, N)
    return (BenchRolloutConfig(shape="qwen3-4b", hf=False, long_new_tokens=[N], long_batches=[32], long_prompt_len=128,
                               topk=2048, index_heads=4, index_dim=64), 32, 128, N)


def call2(a, smoke: bool) -> None:
    """First vs warm generation of the same prompts, then the warm-up with the prompts (see the docstring)."""
    import torch

    from sparse_rl.bench.rollout import _Bench
    from sparse_rl.rl.rollout import SamplingParams

    cfg, B, P, N = setup(smoke, 20 if smoke else 1200)
    run = Run(a.out, "realgen_session12_call2.json", a.budget, {"commit": a.commit, "batch": B, "prompt": P,
                                                                "new_tokens": N})
    b = _Bench(cfg, log, None)
    b.attach_sparse()
    eng = b.engine(B, P + N + 8)
    p = SamplingParams(temperature=1.0, max_new_tokens=N, ignore_eos=True, seed=cfg.seed)

    def timed(toks):
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.generate(toks, p)
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        return round(time.perf_counter() - t0, 3)

    for mode in ("sparse", "dense"):
        if not run.gate(25, f"generate {mode}"):
            continue
        eng.set_attention(mode)
        eng.warmup(P + N)
        ids = b.prompts(B, P).tolist()
        row = run.res.setdefault("generate", {})[mode] = {"first_s": timed(ids), "second_s": timed(ids)}
        ids2 = [[(t * 7 + 3) % eng.runner.vocab for t in r] for r in ids]  # other prompts, same shape
        eng.warmup(P + N, prompts=ids2)
        row["after_prompt_warmup_s"] = timed(ids2)
        log(f"generate {mode}: " + " ".join(f"{k}={v}" for k, v in row.items()))
        run.save()
    run.save()


def call3(a, smoke: bool) -> None:
    """A real sparse generation with every decode call's device time (CUDA events around the runner's decode,
    read after the run) and a profile of 8 of its steps past top-k, beside `time_step` on its cache."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sparse_rl.bench.rollout import _Bench
    from sparse_rl.rl.rollout import SamplingParams

    cfg, B, P, N = setup(smoke, 40 if smoke else 2400)
    run = Run(a.out, "realgen_session12_call3.json", a.budget, {"commit": a.commit, "batch": B, "prompt": P,
                                                                "new_tokens": N})
    b = _Bench(cfg, log, None)
    b.attach_sparse()
    eng = b.engine(B, P + N + 8)
    eng.set_attention("sparse")
    ids = b.prompts(B, P).tolist()
    eng.warmup(P + N, prompts=ids)
    r, cuda = eng.runner, eng.device.type == "cuda"
    real = r.decode
    marks: list = []
    prof_at = (N - 60, N - 52)  # 8 steps past top-k
    state: dict = {}

    def timed_decode(cache, tokens, pos, S, mode):
        i = len(marks)
        if i == prof_at[0]:
            state["prof"] = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
            state["prof"].__enter__()
        e0 = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            e0.record()
        out = real(cache, tokens, pos, S, mode)
        e1 = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            e1.record()
        marks.append((S, e0, e1, time.perf_counter()))
        if i == prof_at[1] and "prof" in state:
            if cuda:
                torch.cuda.synchronize()
            state["prof"].__exit__(None, None, None)
        return out

    r.decode = timed_decode
    p = SamplingParams(temperature=1.0, max_new_tokens=N, ignore_eos=True, seed=cfg.seed)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.generate(ids, p)
    if cuda:
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    r.decode = real
    by: dict = {}
    for S, e0, e1, _ in marks:
        ms = e0.elapsed_time(e1) if cuda else 0.0
        k = "above_topk" if S > cfg.topk else "up_to_topk"
        by.setdefault(k, []).append(ms)
    host = [marks[i + 1][3] - marks[i][3] for i in range(len(marks) - 1)]
    res = run.res["generate"] = {"seconds": round(secs, 3), "steps": len(marks),
                                 "decode_device_ms_mean": {k: round(sum(v) / len(v), 3) for k, v in by.items()},
                                 "decode_device_ms_max": {k: round(max(v), 3) for k, v in by.items()},
                                 "steps_by_kind": {k: len(v) for k, v in by.items()},
                                 "host_gap_ms_mean_last_200": round(1e3 * sum(host[-200:]) / max(1, len(host[-200:])), 3)}
    log("generate: " + " ".join(f"{k}={v}" for k, v in res.items()))
    if "prof" in state:
        agg: dict = {}
        want = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        for e in state["prof"].events():
            if e.device_type == want:
                a_ = agg.setdefault(e.name[:60], [0.0, 0])
                a_[0] += e.device_time if cuda else e.cpu_time
                a_[1] += 1
        top = sorted(agg.items(), key=lambda kv: -kv[1][0])[:16]
        run.res["profile_8_steps"] = [{"kernel": k, "us": round(v[0], 1), "calls": v[1]} for k, v in top]
        log("profile of 8 steps: " + "; ".join(f"{k[:30]} {v[0]:.0f} us x{v[1]}" for k, v in top[:10]))
    run.res["time_step_ms"] = b.step_row(eng, B, P + N, "sparse")["ms"]
    log(f"time_step at {P + N} on the generation's cache: {run.res['time_step_ms']} ms")
    run.save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "realgen"))
    ap.add_argument("--budget", type=float, default=90.0)
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--call", type=int, default=1, choices=(1, 2, 3))
    a = ap.parse_args()
    import torch

    from sparse_rl.bench.rollout import _Bench
    from sparse_rl.rl.rollout import SamplingParams

    smoke = a.cpu_smoke
    cfg, B, P, N = setup(smoke, 40 if smoke else 2600)
    if a.call == 2:
        return call2(a, smoke)
    if a.call == 3:
        return call3(a, smoke)
    run = Run(a.out, "realgen_session12.json", a.budget, {"commit": a.commit, "torch": torch.__version__,
                                                          "batch": B, "prompt": P, "new_tokens": N})
    b = _Bench(cfg, log, None)
    b.attach_sparse()
    eng = b.engine(B, P + N + 8)
    ids = b.prompts(B, P)
    r = eng.runner
    counts = {"capture": 0, "eager": 0}
    cap, eag = r._capture, r.decode_eager

    def counting_capture(*x, **k):
        counts["capture"] += 1
        return cap(*x, **k)

    def counting_eager(*x, **k):
        counts["eager"] += 1
        return eag(*x, **k)

    res = run.res
    for mode in ("sparse", "dense"):
        if not run.gate(30, f"generate {mode}"):
            continue
        eng.set_attention(mode)
        eng.warmup(P + N)
        r._capture, r.decode_eager = counting_capture, counting_eager
        counts.update(capture=0, eager=0)
        p = SamplingParams(temperature=1.0, max_new_tokens=N, ignore_eos=True, seed=cfg.seed)
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = eng.generate(ids.tolist(), p)
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        r._capture, r.decode_eager = cap, eag
        distinct = sorted(len(set(o.tokens)) for o in outs)
        row = res.setdefault("generate", {})[mode] = {
            "seconds": round(secs, 3), "ms_per_step": round(1e3 * secs / N, 3), "captures_during": counts["capture"],
            "eager_steps_during": counts["eager"], "use_graphs": r.use_graphs, "graph_error": r.graph_error,
            "distinct_tokens_min_median_max": [distinct[0], distinct[len(distinct) // 2], distinct[-1]]}
        log(f"generate {mode}: " + " ".join(f"{k}={v}" for k, v in row.items()))
        run.save()
        if mode != "sparse":
            continue
        ctx = P + N  # the generation's own cache, rows at its end
        for cache_kind in ("generated", "random"):
            if not run.gate(10, f"step {cache_kind}"):
                break
            if cache_kind == "random":
                b.fill(eng, P + N + 8)
            st = res.setdefault("step", {})[cache_kind] = {
                "synced_ms": b.step_row(eng, B, ctx, "sparse")["ms"]}
            prof = rh.profile_step(eng, ctx, "sparse", top=12)
            st["kernel_us_total"] = prof["kernel_us_total"]
            st["classes_us"] = prof["classes_us"]
            st["top"] = prof["top"]
            log(f"step sparse {ctx} on the {cache_kind} cache: {st['synced_ms']} ms, kernels {prof['kernel_us_total']} "
                f"us: {prof['classes_us']}")
            log("  top: " + "; ".join(f"{t['kernel'][:28]} {t['us']} us x{t['calls']}" for t in prof["top"][:8]))
            run.save()
    run.save()


if __name__ == "__main__":
    main()
