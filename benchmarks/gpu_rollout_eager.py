"""The engine's decode step without torch.compile (CUDA graphs of the eager step), dense vs sparse, by
batch and context, and where a step's GPU time goes (kernel times summed by name, one profiled step).

    PYTHONPATH=. python benchmarks/gpu_rollout_eager.py --out $OUT [--batches 64,128] [--contexts 2048,...]

Qwen2-0.5B shape, random weights, bf16, indexers attached as in `sparse-rl bench rollout` (top-k 2048,
4 x 64, sink 4, window 64, layers 0-1 dense). Caches are filled with random K/V/index keys; "step ms"
is `RolloutEngine.time_step` (every slot at position context-1, CUDA-graph replay, median of 20).
Writes eager_steps.json and step_profile.json, row by row.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def kernel_breakdown(eng, ctx: int, mode: str) -> list[dict]:
    """GPU time of one eager (uncaptured) decode step, summed by kernel name, largest first."""
    from torch.profiler import ProfilerActivity, profile

    cache = eng._ensure_cache(ctx)
    B = eng.max_batch
    tok = torch.zeros(B, dtype=torch.long, device=eng.device)
    pos = torch.full_like(tok, ctx - 1)
    S = eng._bucket(ctx, cache.s_max)
    with torch.inference_mode():
        for _ in range(2):
            eng.runner.decode_eager(cache, tok, pos, S, mode)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.runner.decode_eager(cache, tok, pos, S, mode)
            torch.cuda.synchronize()
    agg: dict = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:90]]
            a[0] += e.device_time
            a[1] += 1
    rows = [{"kernel": k, "us": round(v[0], 1), "calls": v[1]} for k, v in agg.items()]
    return sorted(rows, key=lambda r: -r["us"])


def backend_check(eng, ctx: int) -> dict:
    """One uncaptured sparse decode step on the Triton ops against the same step on the PyTorch
    reference ops (SPARSE_RL_BACKEND=torch), same cache and inputs: logits agreement."""
    cache = eng._ensure_cache(ctx)
    B = eng.max_batch
    tok = torch.randint(10, eng.runner.vocab, (B,), device=eng.device)
    pos = torch.full_like(tok, ctx - 1)
    S = eng._bucket(ctx, cache.s_max)
    out = {}
    with torch.inference_mode():
        for backend in ("triton", "torch"):
            os.environ["SPARSE_RL_BACKEND"] = backend
            out[backend] = eng.runner.decode_eager(cache, tok, pos, S, "sparse").float()
    os.environ.pop("SPARSE_RL_BACKEND")
    a, b = out["triton"], out["torch"]
    return {"context": ctx, "logits_max_abs_diff": round(float((a - b).abs().max()), 4),
            "logits_max_abs": round(float(b.abs().max()), 3),
            "argmax_agree": round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--contexts", default="2048,4096,8192,12288,16384")
    ap.add_argument("--profile-context", type=int, default=16384)
    ap.add_argument("--shape", default="qwen2-0.5b")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from sparse_rl.bench.rollout import BenchRolloutConfig, build_model
    from sparse_rl.rl.rollout import RolloutEngine
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.patch import attach_sparse

    dev = torch.device(a.device)
    contexts = [int(c) for c in a.contexts.split(",")]
    s_max = max(contexts)
    cfg = BenchRolloutConfig(shape=a.shape, long_new_tokens=[s_max], long_prompt_len=1)
    model = build_model(cfg, dev, torch.bfloat16)
    attach_sparse(model, SparseConfig(topk=2048, index_heads=4, index_dim=64, rope_dim=32, dense_layers=[0, 1],
                                      sink=4, window=64))
    model.to(torch.bfloat16)
    rows, prof = [], {}
    for B in (int(b) for b in a.batches.split(",")):
        eng = RolloutEngine(model, None, max_batch=B, max_seq_len=s_max, device=dev, eos_token_ids=[], compile=False)
        eng.set_attention("sparse")
        cache = eng._ensure_cache(s_max)
        g = torch.Generator(device=dev).manual_seed(0)
        for t in (cache.k, cache.v, cache.idx):
            t.normal_(generator=g)
        for ctx in contexts:
            r = {"batch": B, "context": ctx}
            for mode in ("dense", "sparse"):
                eng.set_attention(mode)
                r[f"{mode}_ms"] = round(eng.time_step(ctx - 1, 20), 3)
            r["dense_over_sparse"] = round(r["dense_ms"] / r["sparse_ms"], 2)
            rows.append(r)
            log(r)
            json.dump(rows, open(f"{a.out}/eager_steps.json", "w"), indent=1)
        prof[f"B{B}_check"] = backend_check(eng, contexts[-1])
        log(f"check B{B}: {prof[f'B{B}_check']}")
        for mode in ("dense", "sparse") if dev.type == "cuda" else ():
            eng.set_attention(mode)
            k = kernel_breakdown(eng, a.profile_context, mode)
            prof[f"B{B}_{mode}_{a.profile_context}"] = {"total_us": round(sum(x["us"] for x in k), 1),
                                                       "kernels": k[:25]}
            log(f"profile B{B} {mode}: total {prof[f'B{B}_{mode}_{a.profile_context}']['total_us']} us; top: "
                + "; ".join(f"{x['kernel'][:50]} {x['us']}us x{x['calls']}" for x in k[:8]))
            json.dump(prof, open(f"{a.out}/step_profile.json", "w"), indent=1)
        del eng, cache
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
