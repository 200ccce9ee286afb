"""One device call: where the decode step's time goes on Qwen3-4B's shape, at the engine's HEAD.

    PYTHONPATH=. python benchmarks/gpu_rollout_qwen3_profile.py --out $OUT [--budget-s 200]

Qwen3-4B shape (random weights, bf16), indexers as in `sparse-rl bench rollout` (top-k 2048, 4 x 64,
sink 4, window 64, layers 0-1 dense). Caches filled with random K/V/index keys.
1. the device-copy bandwidth (the floor's ceiling);
2. step ms (CUDA-graph replay, `time_step`, median of 20) at batch 32 and 1, dense and sparse, with
   the memory floor beside each;
3. one eager step profiled (kernel time summed by name) at batch 32, 2K and 16K, dense and sparse;
4. the decode select alone at 32 x 16K; the sampler, PyTorch vs fused Triton, at batch 32;
5. two short whole generations per mode (host overhead per step of the queued-ahead loop), with the
   PyTorch and the fused sampler;
6. the compiled step vs eager at batch 32 (while the time budget lasts; compilation is the slow part).
Writes results.json (row by row) and profile_*.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--smax", type=int, default=16384)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from gpu_rollout_eager import kernel_breakdown

    from sparse_rl.bench.floor import SHAPES, build_model, copy_bandwidth, integrate_steps, step_bytes, weight_bytes
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.rl.rollout import RolloutEngine, SamplingParams
    from sparse_rl.rl.rollout.sampler import Sampler
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.patch import attach_sparse

    dev = torch.device(a.device)
    res: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__, "shape": a.shape,
                 "steps": [], "profiles": {}, "generate": [], "compile": [], "errors": []}

    def save():
        json.dump(res, open(f"{a.out}/results.json", "w"), indent=1)

    bw = copy_bandwidth(dev)
    res["copy_bw_tb_s"] = round(bw / 1e12, 3)
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    shape = SHAPES[a.shape]
    model = build_model(shape, a.smax + 1, dev, torch.bfloat16)
    attach_sparse(model, SparseConfig(topk=2048, index_heads=4, index_dim=64, rope_dim=32, dense_layers=[0, 1],
                                      sink=4, window=64))
    model.to(torch.bfloat16)
    wb = {m: weight_bytes(model, m) for m in ("dense", "sparse")}
    res["weight_bytes"] = wb

    def floor_ms(B, ctx, mode):
        return 1e3 * step_bytes(shape, wb[mode], B, ctx, mode)["total"] / bw

    engines = {}
    for B in (32, 1):
        eng = RolloutEngine(model, None, max_batch=B, max_seq_len=a.smax, device=dev, eos_token_ids=[], compile=False)
        eng.set_attention("sparse")
        cache = eng._ensure_cache(a.smax)
        g = torch.Generator(device=dev).manual_seed(0)
        for t in (cache.k, cache.v, cache.idx):
            t.normal_(generator=g)
        engines[B] = eng
    log(f"engines ready, {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    for B, ctxs in ((32, (2048, 2304, 4096, 8192, 16384)), (1, (2048, 16384))):
        eng = engines[B]
        for ctx in [c for c in ctxs if c <= a.smax] or [a.smax]:
            for mode in ("dense", "sparse"):
                eng.set_attention(mode)
                ms = eng.time_step(ctx - 1, 20)
                fl = floor_ms(B, ctx, mode)
                res["steps"].append({"batch": B, "context": ctx, "mode": mode, "ms": round(ms, 3),
                                     "floor_ms": round(fl, 3), "over_floor": round(ms / fl, 2)})
                log(res["steps"][-1])
                save()
    eng = engines[32]
    for ctx in ((2048, 16384) if dev.type == "cuda" else ()):
        for mode in ("dense", "sparse"):
            eng.set_attention(mode)
            k = kernel_breakdown(eng, ctx, mode)
            res["profiles"][f"B32_{mode}_{ctx}"] = {"total_us": round(sum(x["us"] for x in k), 1), "kernels": k[:40]}
            log(f"profile B32 {mode} {ctx}: total {res['profiles'][f'B32_{mode}_{ctx}']['total_us']} us; "
                + "; ".join(f"{x['kernel'][:60]} {x['us']}us x{x['calls']}" for x in k[:12]))
            save()
    # the decode select alone, on the engine's own layer-2 index keys
    cache = eng.cache
    gq = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(32, 4, 64, device=dev, generator=gq).to(torch.bfloat16)
    w = torch.randn(32, 4, device=dev, generator=gq).to(torch.bfloat16)
    pos = torch.full((32,), a.smax - 1, device=dev, dtype=torch.long)
    kk = cache.idx[2][:, :a.smax]
    res["select_ms_32x16k"] = round(bench_ms(lambda: itd.indexer_topk_decode(q, w, kk, pos, 2048, sink=4, window=64),
                                             dev, graph=True), 4)
    log(f"select alone 32x16K: {res['select_ms_32x16k']} ms (floor {32 * 16384 * 128 / bw * 1e3:.4f} ms)")
    s = Sampler(shape.vocab, dev)
    x = torch.randn(32, shape.vocab, device=dev) * 3
    p = SamplingParams(temperature=1.0, seed=1)
    for be in ("torch", "triton"):
        res[f"sampler_{be}_ms_b32"] = round(bench_ms(lambda: s.sample(x, p, list(range(32)), [7] * 32, backend=be),
                                                     dev), 4)
    res["sampler_same_tokens"] = bool(torch.equal(s.sample(x, p, list(range(32)), [7] * 32, backend="torch")[0],
                                                  s.sample(x, p, list(range(32)), [7] * 32, backend="triton")[0]))
    log({k: v for k, v in res.items() if k.startswith("sampler")})
    save()
    # short whole generations: wall vs the integrated graph step times -> host overhead per step
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, shape.vocab, (32, 128), generator=gen).tolist()
    for sampler in ("torch", "auto"):
        os.environ["SPARSE_RL_SAMPLER"] = sampler
        for mode in ("dense", "sparse"):
            eng.set_attention(mode)
            pts = [(r["context"], r["ms"]) for r in res["steps"] if r["batch"] == 32 and r["mode"] == mode]
            eng.warmup(128 + 320)
            for new in (64, 320):
                torch.cuda.synchronize() if dev.type == "cuda" else None
                t0 = time.perf_counter()
                eng.generate(ids, SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=0))
                torch.cuda.synchronize() if dev.type == "cuda" else None
                wall = time.perf_counter() - t0
                steps_ms = integrate_steps(pts, 128, 128 + new)
                res["generate"].append({"sampler": sampler, "mode": mode, "new": new, "wall_s": round(wall, 3),
                                        "integrated_steps_s": round(steps_ms / 1e3, 3),
                                        "ms_per_step": round(1e3 * wall / new, 3)})
                log(res["generate"][-1])
                save()
    os.environ.pop("SPARSE_RL_SAMPLER")
    # compiled vs eager (graphs both), sharing the batch-32 cache
    try:
        ec = RolloutEngine(model, None, max_batch=32, max_seq_len=a.smax, device=dev, eos_token_ids=[], compile=True)
        ec.mode = "sparse"
        ec.cache = eng.cache
        for mode, ctx in (("dense", a.smax), ("dense", min(2048, a.smax)), ("sparse", a.smax)):
            if time.time() - T0 > a.budget_s:
                log("compile: time budget spent")
                break
            ec.set_attention(mode)
            t0 = time.time()
            ms = ec.time_step(ctx - 1, 20)
            res["compile"].append({"mode": mode, "context": ctx, "compiled_ms": round(ms, 3),
                                   "first_call_s": round(time.time() - t0, 1), "compiled": ec.runner.compile,
                                   "error": ec.runner.compile_error})
            log(res["compile"][-1])
            save()
    except Exception as e:
        res["errors"].append(f"compile: {type(e).__name__}: {str(e)[:300]}")
    save()
    print("\n| batch | context | mode | ms | floor ms | x floor |\n|---|---|---|---|---|---|")
    for r in res["steps"]:
        print(f"| {r['batch']} | {r['context']} | {r['mode']} | {r['ms']} | {r['floor_ms']} | {r['over_floor']} |")


if __name__ == "__main__":
    main()
