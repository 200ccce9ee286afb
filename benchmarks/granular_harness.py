"""Shared pieces of the issue-15 device scripts (session 8 on): a budget on time LEFT, one JSON rewritten
atomically after each phase, a log, dense cuDNN SDPA times, the trained-indexer input, per-kernel CUDA
profiles, and a parallel Triton warm-up in child processes.

    from granular_harness import Run, log
    run = Run(out_dir, "granular8.json", budget_s, meta)
    if run.gate(30, "phase x"):  # starts only with >= 30 s of the budget left
        ...
        run.save()

Why a parallel warm-up: a device slot is ~200 s and each Triton variant costs ~2 s to compile on the
device host (session 7: ~26 s of compiles for four checks); the warm-up runs the same Python calls on
small inputs in a few child processes first, so the variants compile side by side into Triton's on-disk
cache and the timed calls load them. The small inputs are chosen to give the same Triton
specialisation (every integer argument a multiple of 16) as the timed lengths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

T0 = time.time()
_LOG = []  # the open log file of the Run, if any


def log(msg: str) -> None:
    line = f"[{time.time() - T0:6.1f}s] {msg}"
    print(line, flush=True)
    for f in _LOG:
        f.write(line + "\n")
        f.flush()


class Run:
    """Results of one device call: `res` (JSON-serialisable), saved atomically; phases gated on the time
    left of `budget_s` (counted from the harness import)."""

    def __init__(self, out: str, name: str, budget_s: float, meta: dict):
        self.out, self.name, self.budget_s = out, name, budget_s
        self.res = dict(meta, skipped=[], errors=[])
        os.makedirs(out, exist_ok=True)
        _LOG.append(open(os.path.join(out, name.rsplit(".", 1)[0] + ".log"), "a"))

    def left(self) -> float:
        return self.budget_s - (time.time() - T0)

    def gate(self, need_s: float, what: str) -> bool:
        """True when at least need_s seconds of the budget are left; otherwise the skip is recorded."""
        if self.left() >= need_s:
            return True
        self.res["skipped"].append(f"{what}: {self.left():.0f} s left, needs {need_s:.0f}")
        log(f"skip {what} ({self.left():.0f} s left, needs {need_s:.0f})")
        return False

    def guarded(self, what: str, fn, *args, **kw):
        """fn(*args, **kw), or None with the error recorded (one phase's failure does not end the run)."""
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 -- reported in the JSON, the run goes on
            msg = f"{what}: {type(e).__name__}: {str(e)[:300]}"
            self.res["errors"].append(msg)
            log(f"ERROR {msg}")
            return None

    def save(self) -> None:
        self.res["wall_s"] = time.time() - T0
        path = os.path.join(self.out, self.name)
        with open(path + ".tmp", "w") as f:
            json.dump(self.res, f, indent=1, default=str)
        os.replace(path + ".tmp", path)


def dense_times(q, k, v, dev, W: dict, backward: bool) -> dict:
    """cuDNN SDPA (the fastest backend of every earlier run; all backends where cuDNN does not run), GQA,
    q `[B, L, H, D]`, k/v `[B, L, H_kv, D]`: forward, and with `backward` forward + backward."""
    import torch

    from sparse_rl.bench.attention import dense_variants
    from sparse_rl.bench.timing import bench_ms

    qd, kd, vd = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    variants = [x for x in dense_variants(qd, kd, vd) if x[0].endswith("-gqa") or k.shape[2] == q.shape[2]]
    cudnn = [x for x in variants if x[0].startswith("sdpa-cudnn")]
    lab, fn, kk, vv = (cudnn or variants)[0]
    res = {"dense_label": lab, "dense_ms": bench_ms(lambda: fn(qd, kk, vv), dev, **W)}
    if backward:
        gd = torch.randn_like(qd)
        qq, k2, v2 = (x.detach().requires_grad_() for x in (qd, kk, vv))
        res["dense_fwdbwd_ms"] = bench_ms(lambda: fn(qq, k2, v2).backward(gd), dev, grad_to_none=[qq, k2, v2], **W)
    return res


def trained_indexer(dev, seed: int, index_heads: int, index_dim: int, steps: int):
    """The trained-pattern indexer of bench/patterns.py (as sessions 6-7) -> (indexer, held-out KL, generator)."""
    import torch

    from sparse_rl.bench import patterns

    gen = torch.Generator(device=dev).manual_seed(seed)
    ix, kl = patterns.train_indexer(dev, gen, index_heads=index_heads, index_dim=index_dim, steps=steps,
                                    crop=1024 if dev.type == "cuda" else 64)
    return ix, kl, gen


def kernel_profile(fn, dev, top: int = 14) -> dict:
    """CUDA time per kernel name (ms, summed over one call of fn, after a warm call), largest first."""
    import torch

    if dev.type != "cuda":
        return {}
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ker = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            ker[f"{e.key[:60]} x{e.count}"] = t / 1e3
    return dict(sorted(ker.items(), key=lambda x: -x[1])[:top])


def parallel_warmup(script: str, args: list[str], jobs: int, timeout_s: float, parts: list[str] | None = None) -> dict:
    """Run `python script *args --warm-part P` in child processes (same environment), P = "i/jobs" for
    i < jobs or each string of `parts`, and wait up to timeout_s; returns {"jobs", "rc", "wall_s", "errors"}.
    A child that fails costs only its time: the parent runs nothing it did not prove."""
    t = time.time()
    parts = parts or [f"{i}/{jobs}" for i in range(jobs)]
    parts = [p if "/" in p else f"{i}/{len(parts)}:{p}" for i, p in enumerate(parts)]
    procs = [subprocess.Popen([sys.executable, script, *args, "--warm-part", p],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for p in parts]
    rcs, errs = [], []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, timeout_s - (time.time() - t)))
            rcs.append(p.returncode)
            if p.returncode:
                errs.append(err[-400:])
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            rcs.append("timeout")
    return {"jobs": len(parts), "rc": rcs, "wall_s": time.time() - t, "errors": errs[:3]}


def timeline_profile(fn, dev, top: int = 12) -> dict:
    """One call of fn (after a warm call) under torch.profiler, CPU and CUDA: the kernels' count, their summed
    time (busy_ms), the span from the first kernel's start to the last one's end (span_ms), the idle time
    inside it (gaps_ms = span - busy: the GPU waiting for the host), the host's wall time of the call until
    its last kernel was queued (host_ms) and the largest kernels {name xcount: ms}."""
    import torch

    if dev.type != "cuda":
        return {}
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
    ker = [e for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    if not ker:
        return {"kernels": 0, "host_ms": host * 1e3}
    ker.sort(key=lambda e: e.time_range.start)
    busy, end = 0.0, ker[0].time_range.start
    for e in ker:  # union of the kernels' intervals (one stream: they do not overlap)
        s = max(e.time_range.start, end)
        busy += max(0.0, e.time_range.end - s)
        end = max(end, e.time_range.end)
    names = {}
    for e in ker:
        names.setdefault(e.name[:60], []).append(e.time_range.end - e.time_range.start)
    tops = sorted(((f"{n} x{len(v)}", sum(v) / 1e3) for n, v in names.items()), key=lambda x: -x[1])[:top]
    return {"kernels": len(ker), "busy_ms": busy / 1e3, "span_ms": (end - ker[0].time_range.start) / 1e3,
            "gaps_ms": (end - ker[0].time_range.start - busy) / 1e3, "host_ms": host * 1e3, "top": dict(tops)}
