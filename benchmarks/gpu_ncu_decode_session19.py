"""Issue 14, written in session 19 for the next device session (not run yet): hardware counters of the sparse decode
step's largest kernels, at the row the issue's sparse target names (Qwen3-4B shape, batch 32, 16K context).

Why: session 19's ncu of the prefill found its union-tile forward latency-bound with 3 programs an SM (register
file the limit) and a 128-register cap took 13% off. The decode select (`decode_sync._sync_select`, ~45 us a layer
against ~16 us of index-key bytes), the sparse decode attention (at its byte floor by the session-12 profile) and
the swap-AB GEMMs have never been read by counters. This script builds the engine as `bench rollout` does, runs
eager decode steps to warm every launch, then one step between cudaProfilerStart / Stop; under ncu only that step's
kernels are profiled.

    PYTHONPATH=$PWD python benchmarks/gpu_ncu_decode_session19.py --cpu-smoke       # the path, on the CPU
    ncu --clock-control none --profile-from-start off -k regex:'_sync_select|_fwd_kernel|swapab|_score' \
        --launch-count 8 --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        python benchmarks/gpu_ncu_decode_session19.py > $OUT/ncu_decode.txt
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import log  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=16384)
    a = ap.parse_args()
    import torch

    from sparse_rl.bench.rollout import BenchRolloutConfig, _Bench

    if a.cpu_smoke:
        cfg = BenchRolloutConfig(shape="tiny-qwen3", hf=False, topk=24, index_heads=2, index_dim=16, device="cpu",
                                 dtype="float32")
        B, ctx = 2, 60
    else:
        cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, topk=2048, index_heads=4, index_dim=64)
        B, ctx = a.batch, a.context
    b = _Bench(cfg, log, None)
    b.attach_sparse()
    eng = b.engine(B, ctx + 256)
    b.fill(eng, ctx + 256)
    cache = eng._ensure_cache(ctx)
    tok = torch.randint(0, eng.runner.vocab, (B,), device=eng.device)
    pos = torch.full((B,), ctx - 1, device=eng.device)
    S = eng._bucket(ctx, cache.s_max)
    with torch.inference_mode():
        for _ in range(3):  # compile and warm every launch of the eager step
            eng.runner.decode(cache, tok, pos, S, "sparse")
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
        logits = eng.runner.decode(cache, tok, pos, S, "sparse")
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
    log(f"one sparse step at batch {B}, context {ctx}: logits {tuple(logits.shape)}, finite "
        f"{bool(torch.isfinite(logits.float()).all())}")


if __name__ == "__main__":
    main()
