"""One device call: the fused decode step and the counting select, checked and timed on Qwen3-4B's
shape, then `bench rollout` (recipes/rollout_bench_qwen3_4b.yaml) on the fused step.

    PYTHONPATH=. python benchmarks/gpu_rollout_fused.py --out $OUT [--no-bench] [--head-bench]

1. Checks on the GPU: the decode select's counting path (`rank_max` 1024) against its radix path
   (`rank_max` 0) on the same scores, exact, random and integer-valued (tied) keys, plus
   `gpu_decode_select.checks` against the reference; `ops.add_rmsnorm` / `ops.qk_norm_rope_cache`
   against their references (bf16: largest difference in units of the output's magnitude).
2. Timing (CUDA-graph replays, median): the select at 32 x 16K / 64 x 16K / 16 x 32K, counting vs
   radix; the fused ops vs their references at Qwen3-4B's sizes, batch 32.
3. The engine's step (HEAD `ModelRunner` vs `fused_step.FusedRunner`) at batch 32 (2K, 16K) and 1
   (2K, 16K), dense and sparse, with the floor, and the two steps' logits on the same cache.
4. One fused eager step profiled by kernel (batch 32, 2K dense and 16K sparse).
5. `bench rollout` with the recipe's rows, the engine's runner swapped for FusedRunner
   (`--head-bench`: the engine as it is).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def select_checks(dev) -> list[dict]:
    from sparse_rl.sparse.ops.indexer_topk import decode as itd

    out = []
    g = torch.Generator(device=dev).manual_seed(4)
    for B, S, kind in [(32, 16384, "randn"), (7, 20000, "randn"), (16, 9000, "integer"), (5, 3000, "integer")]:
        if kind == "randn":
            q, k = torch.randn(B, 4, 64, device=dev, generator=g), torch.randn(B, S, 64, device=dev, generator=g)
            w = torch.randn(B, 4, device=dev, generator=g)
        else:
            q = torch.randint(-2, 3, (B, 4, 64), device=dev, generator=g).float()
            k = torch.randint(-2, 3, (B, S, 64), device=dev, generator=g).float()
            w = torch.randint(0, 3, (B, 4), device=dev, generator=g).float()
        q, w, k = (t.to(torch.bfloat16) for t in (q, w, k))
        pos = torch.randint(S // 2, S, (B,), device=dev, generator=g)
        pos[0] = S - 1
        a, nc = itd.indexer_topk_decode(q, w, k, pos, 2048, sink=4, window=64, candidates=True)
        r = itd.indexer_topk_decode(q, w, k, pos, 2048, sink=4, window=64, rank_max=0)
        out.append({"check": "count_vs_radix", "kind": kind, "B": B, "S": S, "exact": bool(torch.equal(a, r)),
                    "rows_differ": int((a != r).any(-1).sum()), "cand_mean": round(float(nc.float().mean()), 1),
                    "cand_max": int(nc.max()), "rows_counting": int((nc <= 1024).sum())})
        log(out[-1])
    return out


def fused_checks(dev) -> list[dict]:
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import add_rmsnorm, qk_norm_rope_cache

    out = []
    g = torch.Generator(device=dev).manual_seed(5)
    B, N, H, Hkv, D, S = 32, 2560, 32, 8, 128, 4096
    bf = torch.bfloat16
    x, r = (torch.randn(B, N, device=dev, generator=g).to(bf) for _ in range(2))
    w = (1 + 0.3 * torch.randn(N, device=dev, generator=g)).to(bf)
    (y1, h1), (y2, h2) = (add_rmsnorm(x, r, w, 1e-6, backend=be) for be in ("triton", "torch"))
    row = {"op": "add_rmsnorm", "h_equal": bool(torch.equal(h1, h2)),
           "y_max_rel": round(float(((y1.float() - y2.float()).abs() / y2.float().abs().clamp_min(1e-3)).max()), 5),
           "y_equal_frac": round(float((y1 == y2).float().mean()), 4)}
    for be in ("triton", "torch"):
        row[f"{be}_us"] = round(1e3 * bench_ms(lambda: add_rmsnorm(x, r, w, 1e-6, backend=be), dev, graph=True), 2)
    out.append(row)
    log(row)
    q = torch.randn(B, H, D, device=dev, generator=g).to(bf)
    k, v = (torch.randn(B, Hkv, D, device=dev, generator=g).to(bf) for _ in range(2))
    qw, kw = ((1 + 0.3 * torch.randn(D, device=dev, generator=g)).to(bf) for _ in range(2))
    pos = torch.randint(0, S, (B,), device=dev, generator=g)
    ang = pos[:, None].float() * (1e6 ** (-torch.arange(0, D, 2, device=dev) / D))[None]
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().to(bf), ang.sin().to(bf)
    caches = {be: [torch.randn(B, S, Hkv, D, device=dev, generator=g).to(bf) for _ in range(2)] for be in ("triton",)}
    caches["torch"] = [t.clone() for t in caches["triton"]]
    o = {be: qk_norm_rope_cache(q, k, v, qw, kw, 1e-6, cos, sin, pos, *caches[be], backend=be)
         for be in ("triton", "torch")}
    ar = torch.arange(B, device=dev)
    kt, kr = caches["triton"][0][ar, pos].float(), caches["torch"][0][ar, pos].float()
    row = {"op": "qk_norm_rope_cache",
           "q_max_abs": round(float((o["triton"].float() - o["torch"].float()).abs().max()), 5),
           "k_max_abs": round(float((kt - kr).abs().max()), 5), "k_abs_max": round(float(kr.abs().max()), 3),
           "caches_equal_elsewhere": bool(torch.equal(caches["triton"][1], caches["torch"][1])),
           "q_equal_frac": round(float((o["triton"] == o["torch"]).float().mean()), 4)}
    for be in ("triton", "torch"):
        row[f"{be}_us"] = round(1e3 * bench_ms(lambda: qk_norm_rope_cache(q, k, v, qw, kw, 1e-6, cos, sin, pos,
                                                                          *caches[be], backend=be), dev, graph=True), 2)
    out.append(row)
    log(row)
    return out


def select_timing(dev) -> list[dict]:
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk import decode as itd

    rows = []
    g = torch.Generator(device=dev).manual_seed(3)
    for B, S in [(32, 16384), (64, 16384), (16, 32768)]:
        q = torch.randn(B, 4, 64, device=dev, generator=g).to(torch.bfloat16)
        k = torch.randn(B, S, 64, device=dev, generator=g).to(torch.bfloat16)
        w = torch.randn(B, 4, device=dev, generator=g).to(torch.bfloat16)
        pos = torch.full((B,), S - 1, device=dev, dtype=torch.long)
        r = {"B": B, "S": S, "floor_us": None}
        for name, rm in (("counting", None), ("radix", 0)):
            r[f"{name}_us"] = round(1e3 * bench_ms(lambda: itd.indexer_topk_decode(q, w, k, pos, 2048, sink=4, window=64,
                                                                                  rank_max=rm), dev, graph=True), 2)
        rows.append(r)
        log(r)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--head-bench", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from fused_step import FusedRunner, use_fused
    from gpu_decode_select import checks as ref_checks
    from gpu_rollout_eager import kernel_breakdown

    from sparse_rl.bench.floor import SHAPES, build_model, copy_bandwidth, step_bytes, weight_bytes
    from sparse_rl.rl.rollout import RolloutEngine
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.patch import attach_sparse

    dev = torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "errors": []}

    def save():
        json.dump(res, open(f"{a.out}/fused.json", "w"), indent=1)

    bw = copy_bandwidth(dev)
    res["copy_bw_tb_s"] = round(bw / 1e12, 3)
    res["select_checks"] = select_checks(dev) + ref_checks(dev)
    save()
    res["fused_checks"] = fused_checks(dev)
    res["select_timing"] = select_timing(dev)
    for r in res["select_timing"]:
        r["floor_us"] = round(1e6 * r["B"] * r["S"] * 128 / bw, 2)
    save()
    shape = SHAPES["qwen3-4b"]
    model = build_model(shape, 16385, dev, torch.bfloat16)
    attach_sparse(model, SparseConfig(topk=2048, index_heads=4, index_dim=64, rope_dim=32, dense_layers=[0, 1],
                                      sink=4, window=64))
    model.to(torch.bfloat16)
    wb = {m: weight_bytes(model, m) for m in ("dense", "sparse")}
    res["steps"], res["logits"], res["profiles"] = [], [], {}
    for B, ctxs in ((32, (2048, 16384)), (1, (2048, 16384))):
        eng = RolloutEngine(model, None, max_batch=B, max_seq_len=16384, device=dev, eos_token_ids=[], compile=False)
        eng.set_attention("sparse")
        cache = eng._ensure_cache(16384)
        g = torch.Generator(device=dev).manual_seed(0)
        for t in (cache.k, cache.v, cache.idx):
            t.normal_(generator=g)
        head = eng.runner
        use_fused(eng)
        fused = eng.runner
        for ctx in ctxs:
            for mode in ("dense", "sparse"):
                eng.set_attention(mode)
                row = {"batch": B, "context": ctx, "mode": mode}
                for name, runner in (("head", head), ("fused", fused)):
                    eng.runner = runner
                    row[f"{name}_ms"] = round(eng.time_step(ctx - 1, 20), 3)
                fl = 1e3 * step_bytes(shape, wb[mode], B, ctx, mode)["total"] / bw
                row.update(floor_ms=round(fl, 3), head_x_floor=round(row["head_ms"] / fl, 2),
                           fused_x_floor=round(row["fused_ms"] / fl, 2))
                res["steps"].append(row)
                log(row)
                save()
        if B == 32:  # the two steps' logits on the same inputs (the cache rows they write are the same)
            tok = torch.randint(10, shape.vocab, (B,), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
            for ctx, mode in ((2048, "dense"), (16384, "sparse")):
                pos = torch.full((B,), ctx - 1, device=dev)
                S = eng._bucket(ctx, cache.s_max)
                with torch.inference_mode():
                    la = head.decode_eager(cache, tok, pos, S, mode).float()
                    lb = fused.decode_eager(cache, tok, pos, S, mode).float()
                res["logits"].append({"context": ctx, "mode": mode, "max_abs_diff": round(float((la - lb).abs().max()), 4),
                                      "max_abs": round(float(la.abs().max()), 3),
                                      "argmax_agree": round(float((la.argmax(-1) == lb.argmax(-1)).float().mean()), 3)})
                log(res["logits"][-1])
                eng.runner = fused
                eng.set_attention(mode)
                k = kernel_breakdown(eng, ctx, mode)
                res["profiles"][f"fused_B32_{mode}_{ctx}"] = {"total_us": round(sum(x["us"] for x in k), 1),
                                                              "kernels": k[:30]}
                log(f"fused profile {mode} {ctx}: total {res['profiles'][f'fused_B32_{mode}_{ctx}']['total_us']} us; "
                    + "; ".join(f"{x['kernel'][:40]} {x['us']}us x{x['calls']}" for x in k[:10]))
                save()
        del eng, cache, head, fused
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    if not a.no_bench:
        from sparse_rl.bench.rollout import markdown_rollout, run_rollout_bench
        from sparse_rl.config import load_config
        from sparse_rl.bench.rollout import BenchRolloutConfig
        import sparse_rl.rl.rollout.engine as E

        if not a.head_bench:
            E.ModelRunner = FusedRunner
        cfg = load_config(BenchRolloutConfig, Path("recipes/rollout_bench_qwen3_4b.yaml"), {})

        def on(r):
            json.dump(r, open(f"{a.out}/bench.json", "w"), indent=1)

        r = run_rollout_bench(cfg, log=log, on_result=on)
        r["runner"] = "head" if a.head_bench else "FusedRunner"
        r["markdown"] = markdown_rollout(r)
        on(r)
        open(f"{a.out}/bench.md", "w").write(r["markdown"])
        print(r["markdown"])
    save()
    print("\n| batch | context | mode | head ms | fused ms | floor ms | head x | fused x |\n|---|---|---|---|---|---|---|---|")
    for r in res["steps"]:
        print(f"| {r['batch']} | {r['context']} | {r['mode']} | {r['head_ms']} | {r['fused_ms']} | {r['floor_ms']} | "
              f"{r['head_x_floor']} | {r['fused_x_floor']} |")


if __name__ == "__main__":
    main()
