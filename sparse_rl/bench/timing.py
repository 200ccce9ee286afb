"""Timing and reporting helpers shared by the `sparse-rl bench` benchmarks and `benchmarks/` scripts."""

from __future__ import annotations

import statistics
import time


def bench_ms(fn, device, warmup_ms: int = 25, rep_ms: int = 100, grad_to_none=None, graph: bool = False) -> float:
    """Median milliseconds of `fn()`: CUDA events through triton's do_bench on a GPU (with
    `graph=True`, replays of a captured CUDA graph, which removes Python/launch overhead: what a
    graph-captured decode loop pays), a few wall-clock repeats on a CPU (a smoke test only)."""
    import torch

    if device.type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if graph:
            fn()  # compile outside the capture
            torch.cuda.synchronize()
            try:
                return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
            except Exception as e:  # not capturable: say so, time it eagerly
                import sys

                print(f"warning: CUDA-graph timing failed ({type(e).__name__}: {e}); timing eagerly", file=sys.stderr)
                torch.cuda.synchronize()
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.manual_seed(torch.initial_seed())  # keep RNG use independent of repeats
    return statistics.median(times)


def rel_err(a, ref) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def device_name(dev) -> str:
    import torch

    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


def fmt(x, nd=2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if abs(x) >= 100:
            return f"{x:.0f}"
        return f"{x:.{nd}f}" if abs(x) >= 0.01 else f"{x:.2e}"
    return str(x)


def table_title(what: str, res: dict) -> str:
    """Markdown heading naming the device and the shapes of a kernel benchmark."""
    cfg = res["config"]
    return (f"### {what} — {res['device']}, B={cfg['batch']}, H={cfg['heads']}, H_kv={cfg['kv_heads']}, "
            f"D={cfg['head_dim']}, k={cfg['topk']}, indexer {cfg['index_heads']}x{cfg['index_dim']}, {cfg['dtype']}")
