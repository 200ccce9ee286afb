"""One device call (issue 14, session 5): fused projections and fp8 index keys in the engine's decode step.

    PYTHONPATH=. python benchmarks/gpu_rollout_session5.py --out $OUT --budget-s 230

Qwen3-4B shape (random weights, bf16), sparse k = 2048, 4 x 64 indexer, layers 0-1 dense; caches filled
with random values. Sections, each skipped once the budget is spent (results.json is rewritten after each):
1. correctness: logits of the default step (fused ops + fused projections) vs the module step on the
   same cache and tokens (batch 32: dense 2K, sparse 16K); the decode select on fp8 keys (Triton) vs its
   PyTorch reference; selection overlap of fp8 vs bf16 index keys (32 x 16K, LayerNorm'd random keys).
2. A/B, batch 32, step ms (CUDA-graph replay, median of 20) beside the floor: fused ops (the default
   before this session) / fused ops + fused projections, at 2K and 16K, dense and sparse; the select's radix-only threshold
   (sort=0, as before) in the step; then sparse with fp8 index keys.
3. The decode select alone (32 x 16K): bf16 vs fp8 keys, sort vs radix threshold.
4. Batch 1 steps (fused projections on / off).
5. `sparse-rl bench rollout --config recipes/rollout_bench_qwen3_4b.yaml` step rows (no whole generations).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

T0 = time.time()
RES: dict = {"sections": {}, "skipped": [], "errors": []}


OUTDIR = [None]


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def save(out):
    json.dump(RES, open(f"{out}/results.json", "w"), indent=1)


def floor_ms(model, shape, bw, B, ctx, mode, topk, index_dim, fp8=False):
    from sparse_rl.bench.floor import step_bytes, weight_bytes

    fb = step_bytes(shape, weight_bytes(model, mode), B, ctx, mode, topk=topk, index_dim=index_dim, dense_layers=(0, 1),
                    index_bytes_per_key=(index_dim + 4) if fp8 else None)["total"]
    return 1e3 * fb / bw


def fill(cache, seed=0):
    g = torch.Generator(device=cache.k.device).manual_seed(seed)
    with torch.inference_mode():
        cache.k.normal_(generator=g)
        cache.v.normal_(generator=g)
        if cache.idx is not None and cache.idx_scale is None:
            cache.idx.normal_(generator=g)


def fill_fp8(cache, seed=0):
    from sparse_rl.sparse.ops import quantize_index_keys

    g = torch.Generator(device=cache.k.device).manual_seed(seed + 1)
    with torch.inference_mode():
        for i in range(cache.idx.shape[0]):
            k = torch.randn(cache.idx.shape[1:], device=cache.k.device, generator=g, dtype=torch.bfloat16)
            cache.idx[i], cache.idx_scale[i] = quantize_index_keys(k)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=230)
    # a CPU smoke run of the script itself: --device cpu --shape tiny --batch 4 --contexts 96,300 --topk 64
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--contexts", default="2048,16384")
    ap.add_argument("--topk", type=int, default=2048)
    a = ap.parse_args()
    OUTDIR[0] = a.out
    ctxs = [int(c) for c in a.contexts.split(",")]
    B, S, TOPK = a.batch, ctxs[-1], a.topk
    os.makedirs(a.out, exist_ok=True)
    left = lambda: a.budget_s - (time.time() - T0)  # noqa: E731
    from sparse_rl.bench.floor import SHAPES, build_model, copy_bandwidth
    from sparse_rl.rl.rollout import RolloutEngine
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.ops import quantize_index_keys
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive
    from sparse_rl.sparse.patch import attach_sparse

    from sparse_rl.bench.timing import bench_ms

    dev = torch.device(a.device)
    RES["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    RES["torch"] = torch.__version__
    bw = copy_bandwidth(dev)
    RES["copy_bandwidth_tb_s"] = round(bw / 1e12, 3)
    shape = SHAPES[a.shape]
    DI = 64 if shape.head_dim >= 64 else shape.head_dim
    model = build_model(shape, S + 1, dev, torch.bfloat16)
    attach_sparse(model, SparseConfig(topk=TOPK, index_heads=4, index_dim=DI, rope_dim=min(32, DI), dense_layers=[0, 1],
                                      sink=4, window=64))
    model.to(torch.bfloat16)
    eng = RolloutEngine(model, None, max_batch=B, max_seq_len=S, device=dev, eos_token_ids=[], compile=False)
    r = eng.runner
    log(f"built; fuse_projections={r.fuse_projections}, fused={r.fused}, bw {bw / 1e12:.3f} TB/s")
    eng.set_attention("sparse")
    cache = eng._ensure_cache(S)
    fill(cache)
    fused_layers = r.fused_layers

    def step_row(e, name, mode, batch, ctx, fp8=False):
        """One timed step (CUDA-graph replay, median of 20) beside its floor."""
        e.set_attention(mode)
        ms = e.time_step(ctx - 1)
        fl = floor_ms(model, shape, bw, batch, ctx, mode, TOPK, DI, fp8=fp8)
        row = {"variant": name, "mode": mode, "batch": batch, "context": ctx, "ms": round(ms, 3),
               "floor_ms": round(fl, 3), "x_floor": round(ms / fl, 2)}
        log(row)
        return row

    def variant(name):
        r.fused = name != "modules"
        r.fused_layers = fused_layers if name == "fused+proj" else None
        r.drop_graphs()

    # 0. the new kernel paths compile and run (else: fall back for the rest of the run, and say so)
    qs, ws = torch.randn(2, 4, 64, device=dev).bfloat16(), torch.randn(2, 4, device=dev).bfloat16()
    ks = torch.randn(2, 4096, 64, device=dev).bfloat16()
    ps = torch.tensor([4095, 3000], device=dev)
    try:
        itd.indexer_topk_decode(qs, ws, ks, ps, 512, sink=4, window=64, sort=1024)
    except Exception as e:
        RES["errors"].append(f"sort select: {type(e).__name__}: {str(e)[:300]}")
        itd.SORT_CANDIDATES = 0
    try:
        k8s, scs = quantize_index_keys(ks)
        itd.indexer_topk_decode(qs, ws, k8s, ps, 512, sink=4, window=64, k_scale=scs)
        fp8_ok = True
    except Exception as e:
        RES["errors"].append(f"fp8 select: {type(e).__name__}: {str(e)[:300]}")
        fp8_ok = False
    log(f"prechecks: errors {RES['errors']}")

    # 1. correctness
    tok = torch.randint(10, shape.vocab, (B,), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    checks = []
    for ctx, mode in ((ctxs[0], "dense"), (S, "sparse")):
        pos = torch.full((B,), ctx - 1, device=dev)
        Sb = eng._bucket(ctx, cache.s_max)
        out = {}
        for name in ("modules", "fused+proj"):
            variant(name)
            with torch.inference_mode():
                out[name] = r.decode_eager(cache, tok, pos, Sb, mode).float()
        la, lb = out["modules"], out["fused+proj"]
        checks.append({"context": ctx, "mode": mode, "max_abs_diff": round(float((la - lb).abs().max()), 4),
                       "max_abs": round(float(la.abs().max()), 3),
                       "argmax_agree": round(float((la.argmax(-1) == lb.argmax(-1)).float().mean()), 3)})
        log(checks[-1])
    # fp8 select vs its reference, and overlap vs bf16 keys (LayerNorm'd random keys, mixed-sign weights)
    g = torch.Generator(device=dev).manual_seed(5)
    q = (torch.randn(B, 4, 64, device=dev, generator=g) * 0.125).bfloat16()
    w = torch.randn(B, 4, device=dev, generator=g).bfloat16()
    k = torch.nn.functional.layer_norm(torch.randn(B, S, 64, device=dev, generator=g), (64,)).bfloat16()
    pos = torch.randint(S // 2, S, (B,), device=dev, generator=g)
    pos[0] = S - 1
    k8, sc = quantize_index_keys(k)
    if not fp8_ok:  # keep the rest of the run: the bf16 path stands in (and the errors say why)
        k8, sc = k, None
    sel16, cand16 = itd.indexer_topk_decode(q, w, k, pos, TOPK, sink=4, window=64, candidates=True)
    radix16 = itd.indexer_topk_decode(q, w, k, pos, TOPK, sink=4, window=64, sort=0)
    ref16 = indexer_topk_decode_naive(q, w, k, pos, TOPK, sink=4, window=64)
    sel8, cand8 = itd.indexer_topk_decode(q, w, k8, pos, TOPK, sink=4, window=64, k_scale=sc, candidates=True)
    ref8 = indexer_topk_decode_naive(q, w, k8, pos, TOPK, sink=4, window=64, k_scale=sc)
    same = [len(set(x.tolist()) & set(y.tolist())) / TOPK for x, y in zip(sel8, ref8)]
    ov = [len(set(x[x >= 0].tolist()) & set(y[y >= 0].tolist())) / max(1, int((x >= 0).sum()))
          for x, y in zip(sel16, sel8)]
    RES["sections"]["correctness"] = {
        "logits_default_vs_modules": checks,
        "sort_equals_radix": bool(torch.equal(sel16, radix16)),
        "bf16_select_vs_reference_min": min(len(set(x.tolist()) & set(y.tolist())) / TOPK for x, y in zip(sel16, ref16)),
        "candidates_bf16_mean_max": [round(float(cand16.float().mean()), 1), int(cand16.max())],
        "candidates_fp8_mean_max": [round(float(cand8.float().mean()), 1), int(cand8.max())],
        "fp8_select_equals_reference_rows": int(sum(s == 1.0 for s in same)), "fp8_select_vs_reference_min": min(same),
        "fp8_vs_bf16_overlap_mean": round(sum(ov) / len(ov), 4), "fp8_vs_bf16_overlap_min": round(min(ov), 4)}
    log(RES["sections"]["correctness"])
    save(a.out)

    # 2. A/B at batch 32
    rows = []
    for name in ("fused", "fused+proj"):  # the module path's times are in the earlier run (10.05 / 13.92 ms)
        variant(name)
        for ctx in ctxs:
            for mode in ("dense", "sparse"):
                if left() < 40:
                    RES["skipped"].append(f"ab {name} {ctx} {mode}")
                    continue
                rows.append(step_row(eng, name, mode, B, ctx))
    # the select's threshold by radix passes only (sort=0: the select as before this session), in the step
    variant("fused+proj")
    itd.SORT_CANDIDATES = 0
    r.drop_graphs()
    eng.set_attention("sparse")
    for ctx in ctxs:
        if left() < 35:
            RES["skipped"].append(f"ab radix-select {ctx}")
            continue
        rows.append(step_row(eng, "fused+proj, radix select", "sparse", B, ctx))
    itd.SORT_CANDIDATES = 1024
    r.drop_graphs()
    RES["sections"]["ab_batch32"] = rows
    save(a.out)

    # 3. fp8 index keys: the select alone, then the step
    pos_full = torch.full((B,), S - 1, device=dev)

    def sel_ms(kk, scale, sort):
        return round(bench_ms(lambda: itd.indexer_topk_decode(q, w, kk, pos_full, TOPK, sink=4, window=64,
                                                              k_scale=scale, sort=sort), dev, rep_ms=100), 4)

    RES["sections"]["select_alone_ms"] = {"batch": B, "keys": S, "bf16_radix": sel_ms(k, None, 0),
                                          "bf16_sort": sel_ms(k, None, 1024), "fp8_sort": sel_ms(k8, sc, 1024),
                                          "fp8_radix": sel_ms(k8, sc, 0)}
    log(RES["sections"]["select_alone_ms"])
    del k, k8, sc
    fp8_rows = []
    if left() > 25 and fp8_ok:
        variant("fused+proj")
        with torch.inference_mode():
            cache.add_index(DI, torch.bfloat16, "fp8")
        fill_fp8(cache)
        r.drop_graphs()
        eng.set_attention("sparse")
        for ctx in ctxs:
            fp8_rows.append(step_row(eng, "fused+proj, fp8 index keys", "sparse", B, ctx, fp8=True))
    else:
        RES["skipped"].append("fp8 steps")
    RES["sections"]["fp8_batch32"] = fp8_rows
    save(a.out)
    del eng, cache
    r.drop_graphs()
    torch.cuda.empty_cache()

    # 4. batch 1
    b1 = []
    if left() > 30:
        eng1 = RolloutEngine(model, None, max_batch=1, max_seq_len=S, device=dev, eos_token_ids=[], compile=False)
        r1 = eng1.runner
        eng1.set_attention("sparse")
        fill(eng1._ensure_cache(S))
        fl1 = r1.fused_layers
        for proj in (False, True):
            r1.fused_layers = fl1 if proj else None
            r1.drop_graphs()
            for ctx in ctxs:
                for mode in ("dense", "sparse"):
                    if left() < 15:
                        RES["skipped"].append(f"b1 {proj} {ctx} {mode}")
                        continue
                    b1.append(step_row(eng1, "fused+proj" if proj else "fused", mode, 1, ctx))
        del eng1
    else:
        RES["skipped"].append("batch 1")
    RES["sections"]["batch1"] = b1
    save(a.out)
    del model
    torch.cuda.empty_cache()

    # 5. the bench's own step rows
    if left() > 70 and a.shape == "qwen3-4b":
        from sparse_rl.bench.rollout import BenchRolloutConfig, markdown_rollout, run_rollout_bench
        from sparse_rl.config import load_config

        cfg = load_config(BenchRolloutConfig, Path("recipes/rollout_bench_qwen3_4b.yaml"),
                          {"long_new_tokens": [], "long_batches": []})
        def partial(part):
            RES["sections"]["bench_rollout_steps"] = part
            save(a.out)

        res = run_rollout_bench(cfg, log=log, on_result=partial)
        res["markdown"] = markdown_rollout(res)
        RES["sections"]["bench_rollout_steps"] = res
        print(res["markdown"])
    else:
        RES["skipped"].append("bench rollout steps")
    RES["elapsed_s"] = round(time.time() - T0, 1)
    save(a.out)
    log(f"done; skipped: {RES['skipped']}")


if __name__ == "__main__":
    try:
        main()
    except Exception:  # keep what was measured, with the reason the rest was not
        import traceback

        RES["errors"].append(traceback.format_exc()[-3000:])
        print(RES["errors"][-1], flush=True)
        if OUTDIR[0]:
            save(OUTDIR[0])
        raise
