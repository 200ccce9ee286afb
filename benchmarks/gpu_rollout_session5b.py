"""Second device run of session 5 (issue 14), inside the lead's combined call: chunked prefill on the GPU,
then the whole-generation rows of `bench rollout` with this session's step (fused projections).

    PYTHONPATH=. python benchmarks/gpu_rollout_session5b.py --out $OUT/rollout --budget-s 190   (--smoke: on a CPU)

1. Chunked prefill, Qwen3-4B shape (random weights, bf16), one 16K-token prompt, dense and sparse:
   the last-token logits of whole-prompt vs 2048-token-chunk prefill (max abs difference, argmax),
   and the time of the whole prefill (what a running batch waits for without chunking) against each
   chunk's (what it waits for with chunking) and their sum (median of 3, CUDA events).
2. `sparse-rl bench rollout --config recipes/rollout_bench_qwen3_4b.yaml --whole integrate`: step rows and
   16K (batch 32) / 32K (batch 16) generations integrated from step times (skipped when the budget left
   is under 100 s). Writes results.json (+ the bench's markdown in it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

T0 = time.time()
RES: dict = {"sections": {}, "errors": [], "skipped": []}


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def timed(fn, dev, reps=3):
    """(result of the last call, median ms over reps): CUDA events on a GPU, wall clock on a CPU."""
    ts, out = [], None
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            out = fn()
            ts.append(1e3 * (time.perf_counter() - t0))
    return out, sorted(ts)[len(ts) // 2]


def chunked_prefill(dev, shape_name="qwen3-4b", L=16384, chunk=2048, topk=2048):
    from sparse_rl.bench.floor import SHAPES, build_model
    from sparse_rl.rl.rollout import RolloutEngine
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.patch import attach_sparse

    shape = SHAPES[shape_name]
    di = min(64, shape.head_dim)
    model = build_model(shape, L + 1, dev, torch.bfloat16)
    attach_sparse(model, SparseConfig(topk=topk, index_heads=4, index_dim=di, rope_dim=min(32, di), dense_layers=[0, 1],
                                      sink=4, window=64))
    model.to(torch.bfloat16)
    eng = RolloutEngine(model, None, max_batch=2, max_seq_len=L + 1, device=dev, eos_token_ids=[], compile=False)
    r = eng.runner
    tok = torch.randint(10, shape.vocab, (1, L), device=dev, generator=torch.Generator(device=dev).manual_seed(3))
    rows = []
    for mode in ("dense", "sparse"):
        eng.set_attention(mode)
        cache = eng._ensure_cache(L + 1)
        with torch.inference_mode():
            whole, ms_whole = timed(lambda: r.prefill(cache, tok, [L], [0], mode), dev)
            parts, chunk_ms = None, []
            for s in range(0, L, chunk):
                parts, ms = timed(lambda: r.prefill(cache, tok[:, s:s + chunk], [min(chunk, L - s)], [1], mode,
                                                    start=s), dev)
                chunk_ms.append(round(ms, 2))
        rows.append({"mode": mode, "prompt": L, "chunk": chunk, "whole_ms": round(ms_whole, 2),
                     "chunk_ms": chunk_ms, "chunks_total_ms": round(sum(chunk_ms), 2),
                     "logits_max_abs_diff": round(float((whole - parts).abs().max()), 4),
                     "logits_max_abs": round(float(whole.abs().max()), 3),
                     "argmax_equal": bool(whole.argmax(-1).eq(parts.argmax(-1)).all())})
        log(rows[-1])
    del eng, r, model
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=190)
    ap.add_argument("--smoke", action="store_true", help="a CPU run of the script itself on a tiny shape")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cpu" if a.smoke else "cuda")
    shape, L, chunk, topk = ("tiny", 300, 64, 80) if a.smoke else ("qwen3-4b", 16384, 2048, 2048)
    RES["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    RES["torch"] = torch.__version__

    def save():
        json.dump(RES, open(f"{a.out}/results.json", "w"), indent=1)

    try:
        RES["sections"]["chunked_prefill"] = chunked_prefill(dev, shape, L, chunk, topk)
    except Exception as e:  # keep the bench below
        RES["errors"].append(f"chunked prefill: {type(e).__name__}: {str(e)[:400]}")
        log(RES["errors"][-1])
    save()
    if a.budget_s - (time.time() - T0) < 100 or a.smoke:
        RES["skipped"].append("bench rollout --whole integrate")
    else:
        from sparse_rl.bench.rollout import BenchRolloutConfig, markdown_rollout, run_rollout_bench
        from sparse_rl.config import load_config

        cfg = load_config(BenchRolloutConfig, Path("recipes/rollout_bench_qwen3_4b.yaml"), {"whole": "integrate"})

        def partial(res):
            RES["sections"]["bench_rollout"] = res
            save()

        res = run_rollout_bench(cfg, log=log, on_result=partial)
        res["markdown"] = markdown_rollout(res)
        partial(res)
        print(res["markdown"])
    RES["elapsed_s"] = round(time.time() - T0, 1)
    save()
    log(f"done; skipped {RES['skipped']}, errors {RES['errors']}")


if __name__ == "__main__":
    main()
