"""One device call: the engine's fused eager decode step (the default) against the module path
(`runner.fused = False`, the step as it was), then `bench rollout` with the Qwen3-4B recipe.

    PYTHONPATH=. python benchmarks/gpu_rollout_final.py --out $OUT

1. Batch 32, Qwen3-4B shape, random caches: step ms (CUDA-graph replay, median of 20) at 2K and 16K,
   dense and sparse, fused vs module path, and the two steps' logits on the same inputs.
2. `sparse-rl bench rollout --config recipes/rollout_bench_qwen3_4b.yaml --whole integrate`: step rows
   beside their floor, batch-1 rows, and 16K (batch 32) / 32K (batch 16) generations integrated from
   step times. Writes ab.json, bench.json, bench.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from sparse_rl.bench.floor import SHAPES, build_model
    from sparse_rl.bench.rollout import BenchRolloutConfig, markdown_rollout, run_rollout_bench
    from sparse_rl.config import load_config
    from sparse_rl.rl.rollout import RolloutEngine
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.patch import attach_sparse

    dev = torch.device("cuda")
    shape = SHAPES["qwen3-4b"]
    model = build_model(shape, 16385, dev, torch.bfloat16)
    attach_sparse(model, SparseConfig(topk=2048, index_heads=4, index_dim=64, rope_dim=32, dense_layers=[0, 1],
                                      sink=4, window=64))
    model.to(torch.bfloat16)
    eng = RolloutEngine(model, None, max_batch=32, max_seq_len=16384, device=dev, eos_token_ids=[], compile=False)
    eng.set_attention("sparse")
    cache = eng._ensure_cache(16384)
    g = torch.Generator(device=dev).manual_seed(0)
    for t in (cache.k, cache.v, cache.idx):
        t.normal_(generator=g)
    ab = {"steps": [], "logits": [], "fused_default": eng.runner.fused}
    r = eng.runner
    for fused in (False, True):
        r.fused = fused
        r.drop_graphs()
        for ctx in (2048, 16384):
            for mode in ("dense", "sparse"):
                eng.set_attention(mode)
                ab["steps"].append({"fused": fused, "context": ctx, "mode": mode, "ms": round(eng.time_step(ctx - 1), 3)})
                log(ab["steps"][-1])
    tok = torch.randint(10, shape.vocab, (32,), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    for ctx, mode in ((2048, "dense"), (16384, "sparse")):
        pos = torch.full((32,), ctx - 1, device=dev)
        S = eng._bucket(ctx, cache.s_max)
        out = {}
        for fused in (False, True):
            r.fused = fused
            with torch.inference_mode():
                out[fused] = r.decode_eager(cache, tok, pos, S, mode).float()
        la, lb = out[False], out[True]
        ab["logits"].append({"context": ctx, "mode": mode, "max_abs_diff": round(float((la - lb).abs().max()), 4),
                             "max_abs": round(float(la.abs().max()), 3),
                             "argmax_agree": round(float((la.argmax(-1) == lb.argmax(-1)).float().mean()), 3)})
        log(ab["logits"][-1])
    json.dump(ab, open(f"{a.out}/ab.json", "w"), indent=1)
    del eng, cache, r, model
    torch.cuda.empty_cache()
    cfg = load_config(BenchRolloutConfig, Path("recipes/rollout_bench_qwen3_4b.yaml"), {"whole": "integrate"})

    def on(res):
        json.dump(res, open(f"{a.out}/bench.json", "w"), indent=1)

    res = run_rollout_bench(cfg, log=log, on_result=on)
    res["markdown"] = markdown_rollout(res)
    on(res)
    open(f"{a.out}/bench.md", "w").write(res["markdown"])
    print(res["markdown"])


if __name__ == "__main__":
    main()
