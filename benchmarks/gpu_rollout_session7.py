"""Session 7 device run (issue 14): where the sparse decode step's time goes at 32 x 16K (a profile of
one graph-less step on a filled cache, every kernel named and grouped), why the step is ~2 ms above the
terms the session-6 profile named, the decode select's `auto` default A/B, the weight GEMMs against
their floor at M = 32 and 1, batch-1 steps, and whole-generation ratios, in one call.

    PYTHONPATH=. python benchmarks/gpu_rollout_session7.py --out $OUT/roll7 --budget-s 222 --commit HASH
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/gpu_rollout_session7.py --out /tmp/r7 --smoke   (CPU)

What session 6 left open: its profile (GEMMs 2.90 ms, attention 3.25, index score 0.81, norms etc. 0.37)
ran on an all-zero index cache (every key a tie), and a random-cache step (9.72 ms) was read as ~2.0 ms
of select after the score, while the select alone (score included) takes 0.054 ms a layer (1.8 ms for
34 layers). Two terms differ between that profile and a random-cache step and are timed here apart:
the sparse attention's gather (all ties select the last 2048 keys, contiguous; a real select scatters
them over the row: 256-byte rows of one KV head at a 2 KB stride) and the select's own work (all rows at
the full context, as in the engine, vs the standalone's half-shorter rows; the engine's index cache is a
[:, :S] view of a longer buffer).
Phases (JSON rewritten after each; a phase that does not fit the budget left is skipped and named):
1. correctness, tiny Qwen3 shape, fp32, sparse (top-k 32 over ~150-token sequences), impl chunked and
   auto: engine greedy tokens == HF generate on the reference path, log-probs vs a teacher-forced
   forward; the select alone with integer inputs (exact scores, ties) == the PyTorch reference
   (chunked, row, auto).
2. Qwen3-4B shape, batch 32, caches filled at random (K/V, index keys): step ms (graph replay) dense,
   sparse auto and chunked at 4096 and 16384; torch.profiler of ONE graph-less step (sparse at 16384,
   auto = chunked there; sparse at 4096 auto = row and chunked; dense at 16384) and of one graph replay
   at 16384, per kernel and per class; the sparse attention alone on the engine's layer cache with
   three index lists (contiguous last 2048, uniform random 2048, the select's own output) and its
   split counts; the select alone on the engine's index cache (all rows full vs half shorter; the chunked
   form at other chunk sizes and warp counts).
3. Whole generations, 128-token prompts: 16K new tokens at batch 32 and 32K at batch 16, dense, sparse
   auto, sparse chunked (integrated from step times plus a short real generation's per-step overhead,
   `bench.rollout._integrated`).
4. Weight GEMMs of one layer and the LM head at M = 32 and 1: fused (one buffer, as the engine runs
   them) vs separate vs the transposed product W @ x^T, against their bytes at the device-copy bandwidth.
5. Batch 1: one step at 2K and 16K, dense and sparse.
Writes $OUT/results.json; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch

T0 = time.time()
RES: dict = {"errors": [], "skipped": []}
OUT: list = []
CLASSES = (("gemm", ("gemm", "nvjet", "cutlass", "xmma", "splitk", "gemv", "sm90_", "addmm", "aten::mm",
                     "aten::linear")),
           ("attention", ("_fwd_kernel", "_merge_kernel")),
           ("index_score", ("_score_max",)),
           ("select", ("_hist", "_count", "_gather", "_select", "_write", "_row_select", "_thresh_write",
                       "fillfunctor", "memset", "aten::zeros", "aten::fill_")),
           ("norm_rope_cache", ("_add_rmsnorm", "_qk_rope", "_indexer_decode", "_silu_mul", "index_put",
                                "scatter")))


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def save():
    RES["elapsed_s"] = round(time.time() - T0, 1)
    if OUT:
        json.dump(RES, open(f"{OUT[0]}/results.json", "w"), indent=1)


def left(budget):
    return budget - (time.time() - T0)


def use(impl):
    """Make `impl` the decode select every later call (and every graph captured after) runs."""
    from sparse_rl.sparse.ops.indexer_topk import decode as itd

    itd.DECODE_IMPL = impl


def free():
    """Return the memory of engines deleted just before (their caches: ~78 GB at 32 x 16K) to the device."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def correctness(dev, smoke):
    from sparse_rl.bench.floor import SHAPES, build_model
    from sparse_rl.rl.rollout import RolloutEngine, SamplingParams, process_logits
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.layer import set_attention
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive
    from sparse_rl.sparse.patch import attach_sparse

    model = build_model(SHAPES["tiny-qwen3"], 512, dev, torch.float32)
    attach_sparse(model, SparseConfig(topk=32, index_heads=2, index_dim=16, rope_dim=8, sink=2, window=4,
                                      dense_layers=[0]))
    model.to(torch.float32)
    set_attention(model, "sparse")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (21, 47, 9)]
    new = 12 if smoke else 48
    hf = []
    with torch.inference_mode():  # the reference path (HF generate over the model's sparse attention)
        for p in prompts:
            hf.append(model.generate(torch.tensor([p], device=dev), max_new_tokens=new, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(p):].tolist())
    out = {}
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=7)
    for impl in ("chunked", "auto"):
        use(impl)
        if smoke and impl == "auto":  # the engine on the Triton kernels (interpreter), the reference on PyTorch
            os.environ["SPARSE_RL_BACKEND"] = "triton"
        try:
            eng = RolloutEngine(model, None, max_batch=3, max_seq_len=256, device=dev, eos_token_ids=[])
            greedy = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=new))
            samples = eng.generate(prompts, params)
            lp = 0.0
            for c in samples:
                with torch.inference_mode():
                    ids = torch.tensor([c.prompt_tokens + c.tokens], device=dev)
                    logits = model(input_ids=ids).logits[0, len(c.prompt_tokens) - 1:-1].float()
                    ref = process_logits(logits, params).gather(-1, torch.tensor(c.tokens, device=dev)[:, None])[:, 0]
                lp = max(lp, float((torch.tensor(c.logprobs, device=dev) - ref).abs().max()))
            out[impl] = {"greedy_equal_hf": f"{sum(r == c.tokens for r, c in zip(hf, greedy))}/{len(prompts)}",
                         "logprobs_max_abs_diff": lp, "graphs": eng.runner.use_graphs,
                         "graph_error": eng.runner.graph_error}
        except Exception as e:
            RES["errors"].append(f"correctness {impl}: {type(e).__name__}: {str(e)[:300]}")
        finally:
            os.environ.pop("SPARSE_RL_BACKEND", None)
        log(f"correctness {impl}: {out.get(impl)}")
    use("auto")
    dt = torch.float32 if smoke else torch.bfloat16
    gi = torch.Generator(device=dev).manual_seed(10)
    B, S, K = (3, 200, 24) if smoke else (4, 3000, 512)
    q = torch.randint(-2, 3, (B, 4, 64), device=dev, generator=gi).to(dt)
    w = torch.randint(-1, 3, (B, 4), device=dev, generator=gi).to(dt)
    k = torch.randint(-2, 3, (B, S, 64), device=dev, generator=gi).to(dt)
    pos = torch.tensor([S - 1, S // 2, K // 2, S - 7][:B], device=dev)
    kw = dict(sink=2, window=4)
    ref = indexer_topk_decode_naive(q.float(), w.float(), k.float(), pos, K, **kw)
    out["select_ints_equal_reference"] = {impl: bool(torch.equal(itd.indexer_topk_decode(q, w, k, pos, K, impl=impl,
                                                                                          **kw), ref))
                                          for impl in ("chunked", "row", "auto")}
    log(f"select, integer inputs == reference: {out['select_ints_equal_reference']}")
    return out


def classify(name: str) -> str:
    n = name.lower()
    for cls, keys in CLASSES:
        if any(x.lower() in n for x in keys):
            return cls
    return "other"


def profile_step(eng, ctx, mode, graph: bool) -> dict:
    """Kernel time of ONE decode step with every slot at position ctx-1: every kernel (name, us, calls,
    class) and the sums by class. On a CPU (the smoke run) the profiled ops are the CPU ones."""
    from torch.profiler import ProfilerActivity, profile

    cuda = eng.device.type == "cuda"
    cache = eng._ensure_cache(ctx)
    tok = torch.zeros(eng.max_batch, dtype=torch.long, device=eng.device)
    pos = torch.full_like(tok, ctx - 1)
    S = eng._bucket(ctx, cache.s_max)
    eng.set_attention(mode)
    step = (lambda: eng.runner.decode(cache, tok, pos, S, mode)) if graph else \
        (lambda: eng.runner.decode_eager(cache, tok, pos, S, mode))
    with torch.inference_mode():
        for _ in range(2):
            step()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
    by_name: dict = defaultdict(lambda: [0.0, 0])
    want = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    for e in prof.events():
        if e.device_type == want and (cuda or e.name.startswith("aten::")):
            a = by_name[e.name[:100]]
            a[0] += e.device_time if cuda else e.cpu_time
            a[1] += 1
    cls: dict = defaultdict(lambda: [0.0, 0])
    for n, (us, c) in by_name.items():
        cls[classify(n)][0] += us
        cls[classify(n)][1] += c
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {"mode": mode, "context": ctx, "graph": graph, "select_impl": _impl(),
            "kernel_us_total": round(sum(v[0] for v in by_name.values()), 1),
            "kernels": sum(v[1] for v in by_name.values()),
            "classes_us": {k: round(v[0], 1) for k, v in sorted(cls.items(), key=lambda kv: -kv[1][0])},
            "classes_launches": {k: v[1] for k, v in cls.items()},
            "all": [{"kernel": n, "us": round(v[0], 1), "calls": v[1], "class": classify(n)} for n, v in rows[:60]]}


def _impl():
    from sparse_rl.sparse.ops.indexer_topk import decode as itd

    return itd.DECODE_IMPL


def steps_and_profile(b, smoke, budget) -> dict:
    """Phase 2 (see the module docstring)."""
    B = 4 if smoke else 32
    ctxs = (96, 160) if smoke else (4096, 16384)
    eng = b.engine(B, 176 if smoke else 16384 + 128)
    eng.set_attention("sparse")  # the index-key cache exists before the fill
    b.fill(eng, 176 if smoke else 16384 + 128)
    out: dict = {"rows": [], "profiles": {}}
    try:
        for ctx in ctxs:
            out["rows"].append(b.step_row(eng, B, ctx, "dense"))
            for impl in ("auto", "chunked"):
                use(impl)
                eng.runner.drop_graphs()
                r = b.step_row(eng, B, ctx, "sparse")
                r["select_impl"] = impl
                out["rows"].append(r)
                log(r)
            save()
        use("auto")
        eng.runner.drop_graphs()
        big, small = ctxs[1], ctxs[0]
        for key, mode, ctx, graph, impl in (("sparse_eager_16k", "sparse", big, False, "auto"),
                                            ("sparse_graph_16k", "sparse", big, True, "auto"),
                                            ("sparse_eager_4k_auto", "sparse", small, False, "auto"),
                                            ("sparse_eager_4k_chunked", "sparse", small, False, "chunked"),
                                            ("dense_eager_16k", "dense", big, False, "auto")):
            use(impl)
            eng.runner.drop_graphs()
            try:
                p = out["profiles"][key] = profile_step(eng, ctx, mode, graph)
                log(f"profile {key}: {p['kernel_us_total']} us, {p['kernels']} kernels, {p['classes_us']}")
            except Exception as e:
                RES["errors"].append(f"profile {key}: {type(e).__name__}: {str(e)[:300]}")
            save()
        use("auto")
        out["attention_alone"] = attention_alone(b, eng, big, smoke)
        save()
        out["select_alone"] = select_alone(b, eng, big, smoke)
    finally:
        use("auto")
        eng.runner.drop_graphs()
        del eng
        free()
    return out


def _rand_q(B, H, D, dev, dt, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(B, H, D, device=dev, generator=g).to(dt)


def attention_alone(b, eng, ctx, smoke) -> dict:
    """The sparse attention of one layer on the engine's filled cache (layer 2, a sparse one), graph-timed,
    with three index lists of top-k keys a row (all rows at ctx - 1) and the split counts."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import sparse_decode
    from sparse_rl.sparse.ops.indexer_topk import decode as itd

    cache = eng._ensure_cache(ctx)
    dev, K = eng.device, b.cfg.topk
    kc, vc, ic = cache.k[2], cache.v[2], cache.idx[2]
    B, H, D = eng.max_batch, eng.runner.H, eng.runner.D
    q = _rand_q(B, H, D, dev, kc.dtype, 1)
    g = torch.Generator(device=dev).manual_seed(2)
    lists = {"contiguous_last": torch.arange(ctx - K, ctx, device=dev, dtype=torch.int32)[None].expand(B, K)
             .contiguous(),
             "uniform_random": torch.rand(B, ctx, device=dev, generator=g).topk(K, -1).indices.sort(-1).values
             .to(torch.int32)}
    pos = torch.full((B,), ctx - 1, device=dev)
    HI = b.cfg.index_heads
    qi, wi = _rand_q(B, HI, b.cfg.index_dim, dev, kc.dtype, 3), _rand_q(B, HI, 1, dev, kc.dtype, 4)[..., 0]
    with torch.inference_mode():
        lists["select_output"] = itd.indexer_topk_decode(qi, wi, ic[:, :ctx], pos, K, sink=min(4, K // 4),
                                                         window=min(64, K // 4))
    kv_bytes = B * K * 2 * kc.shape[2] * D * kc.element_size()
    out = {"batch": B, "context": ctx, "topk": K, "floor_ms": round(1e3 * kv_bytes / b.bw, 4), "lists": {}}
    splits = (None,) if smoke else (None, 1, 2, 4, 8)
    for name, idx in lists.items():
        row = out["lists"][name] = {}
        for ns in splits:  # None: the kernel's own split heuristic, as the engine runs it
            fn = ((lambda: sparse_decode(q, kc, vc, idx, 0.088)) if ns is None
                  else (lambda: _decode_ns(q, kc, vc, idx, ns)))
            with torch.inference_mode():
                fn()  # runs on the CPU too (the reference), so the smoke run exercises the lists
                row[f"nsplit_{ns or 'auto'}"] = round(-1.0 if smoke else bench_ms(fn, dev, graph=True), 4)
        log(f"attention alone {name}: {row}")
    return out


def _decode_ns(q, kc, vc, idx, ns):
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_decode as tri

    return tri(q, kc, vc, idx, 0.088, nsplit=ns)


def select_alone(b, eng, ctx, smoke) -> dict:
    """The select (score included) on the engine's index cache of layer 2 ([:, :ctx] view of the longer
    buffer, as the engine passes it) and on a contiguous copy; all rows at ctx - 1 (the engine's profile
    case) and half the rows shorter (the session-6 standalone case): chunked and row, graph-timed; then
    the chunked form at other chunk sizes and warp counts (engine view, all rows full)."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk import decode as itd

    cache = eng._ensure_cache(ctx)
    dev, K, B = eng.device, b.cfg.topk, eng.max_batch
    view = cache.idx[2][:, :ctx]
    dt = view.dtype
    HI = b.cfg.index_heads
    qi, wi = _rand_q(B, HI, b.cfg.index_dim, dev, dt, 3), _rand_q(B, HI, 1, dev, dt, 4)[..., 0]
    full = torch.full((B,), ctx - 1, device=dev)
    half = full.clone()
    half[1::2] = torch.randint(ctx // 4, ctx, (B // 2,), device=dev, generator=torch.Generator(device=dev)
                               .manual_seed(9))
    kw = dict(sink=min(4, K // 4), window=min(64, K // 4))
    out = {"batch": B, "context": ctx, "floor_ms": round(1e3 * B * ctx * view.shape[-1] * view.element_size()
                                                       / b.bw, 4), "cases": {}}
    with torch.inference_mode():
        contig = view.contiguous()
        for kname, keys in (("engine_view", view), ("contiguous", contig)):
            for pname, pos in (("all_full", full), ("half_shorter", half)):
                for impl in ("chunked", "row"):
                    got, n_c = itd.indexer_topk_decode(qi, wi, keys, pos, K, impl=impl, candidates=True, **kw)
                    ms = -1.0 if smoke else bench_ms(lambda: itd.indexer_topk_decode(qi, wi, keys, pos, K, impl=impl,
                                                                                     **kw), dev, graph=True)
                    out["cases"][f"{kname}/{pname}/{impl}"] = {
                        "ms_graph": round(ms, 4), "candidates_mean": round(float(n_c.float().mean()), 1),
                        "candidates_max": int(n_c.max())}
        base = itd.indexer_topk_decode(qi, wi, view, full, K, impl="chunked", **kw)
        for name, extra in ((("chunk64", dict(chunk=64)),) if smoke else (
                ("chunk512", dict(chunk=512)), ("chunk2048", dict(chunk=2048)), ("warps8", dict(num_warps=8)),
                ("warps2", dict(num_warps=2)))):
            # the chunked form's launch shape (the score pass shares it): keys per program, warps
            fn = (lambda: itd.indexer_topk_decode(qi, wi, view, full, K, impl="chunked", **extra, **kw))
            out["cases"][f"engine_view/all_full/chunked_{name}"] = {
                "ms_graph": round(-1.0 if smoke else bench_ms(fn, dev, graph=True), 4),
                "equal_default": bool(torch.equal(fn(), base))}
        log(f"select alone: {out['cases']}")
    return out


def gemms(b, smoke) -> dict:
    """One layer's projections and the LM head as the engine runs them (F.linear on the concatenated
    weights), the separate members, and W @ x^T, at M = 32 and 1, graph-timed, against weight bytes."""
    from sparse_rl.bench.timing import bench_ms

    layer = b.model.model.layers[2]
    at, mlp, ix = layer.self_attn, layer.mlp, layer.self_attn.indexer
    groups = {"qkv_indexer": [at.q_proj, at.k_proj, at.v_proj, ix.wq, ix.wk, ix.ww], "o_proj": [at.o_proj],
              "gate_up": [mlp.gate_proj, mlp.up_proj], "down_proj": [mlp.down_proj],
              "lm_head": [b.model.get_output_embeddings()]}
    out = {}
    for M in (32, 1):
        for name, mods in groups.items():
            w = torch.cat([m.weight.detach() for m in mods])
            x = torch.randn(M, w.shape[1], device=b.dev, dtype=w.dtype)
            ws = [m.weight.detach() for m in mods]
            floor = 1e3 * w.numel() * w.element_size() / b.bw
            with torch.inference_mode():
                fns = {"fused": lambda: torch.nn.functional.linear(x, w),
                       "w_xT": lambda: torch.mm(w, x.t())}
                if len(ws) > 1:
                    fns["separate"] = lambda: [torch.nn.functional.linear(x, wi) for wi in ws]
                r = {"M": M, "N": w.shape[0], "K": w.shape[1], "floor_ms": round(floor, 4)}
                for v, fn in fns.items():
                    r[f"{v}_ms"] = round(-1.0 if smoke else bench_ms(fn, b.dev, graph=True), 4)
                r["fused_x_floor"] = round(r["fused_ms"] / floor, 2)
            out[f"{name}_m{M}"] = r
            log(f"gemm {name} M={M}: {r}")
    return out


def batch1(b, smoke) -> list:
    rows = []
    eng = b.engine(1, 192 if smoke else 16384 + 128)
    eng.set_attention("sparse")
    b.fill(eng, 192 if smoke else 16384 + 128)
    try:
        for ctx in ((64, 160) if smoke else (2048, 16384)):
            for mode in ("dense", "sparse"):
                eng.runner.drop_graphs()
                rows.append(b.step_row(eng, 1, ctx, mode))
                log(rows[-1])
    finally:
        eng.runner.drop_graphs()
        del eng
        free()
    return rows


def whole(b, new, B, P, budget, per_mode_s, name) -> list:
    from sparse_rl.bench.rollout import _integrated

    ids = b.prompts(B, P)
    eng = b.engine(B, P + new)
    rows = RES[name] = []  # saved row by row: a timeout mid-phase keeps what was measured
    for mode, impl in (("dense", None), ("sparse", "auto"), ("sparse", "chunked")):
        if left(budget) < per_mode_s:
            RES["skipped"].append(f"{name} {mode} {impl or ''}")
            continue
        use(impl or "auto")
        eng.runner.drop_graphs()
        t = time.time()
        try:
            secs, extra = _integrated(b, eng, ids, new, mode)
        except Exception as e:
            RES["errors"].append(f"{name} {mode} {impl}: {type(e).__name__}: {str(e)[:300]}")
            continue
        floor_s = b.floor_gen_s(B, P, new, mode)
        rows.append({"mode": mode, "select_impl": impl, "batch": B, "prompt": P, "new_tokens": new,
                     "how": "integrated", "seconds": round(secs, 3), "tokens_per_s": round(B * new / secs, 1),
                     "ms_per_step": round(1e3 * secs / new, 3), "floor_tokens_per_s": round(B * new / floor_s, 1),
                     "x_floor": round(secs / floor_s, 2), "wall_s": round(time.time() - t, 1), **extra})
        log({k: x for k, x in rows[-1].items() if k != "step_points"})
        save()
    use("auto")
    eng.runner.drop_graphs()
    del eng
    free()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=222)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--smoke", action="store_true", help="a CPU run of the script itself at tiny sizes")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    OUT.append(a.out)
    from sparse_rl.bench.rollout import BenchRolloutConfig, _Bench

    dev = torch.device("cpu" if a.smoke else "cuda")
    RES.update({"commit": a.commit, "torch": torch.__version__, "budget_s": a.budget_s,
                "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"})

    def phase(name, fn, need_s):
        if left(a.budget_s) < need_s:
            RES["skipped"].append(name)
            log(f"skip {name}: {left(a.budget_s):.0f} s left")
            return None
        try:
            RES[name] = fn()
        except Exception as e:  # keep the later phases
            RES["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
            log(RES["errors"][-1])
        save()
        return RES.get(name)

    phase("correctness", lambda: correctness(dev, a.smoke), 150)
    if a.smoke:
        cfg = BenchRolloutConfig(shape="tiny-qwen3", hf=False, long_new_tokens=[160, 200], long_batches=[3, 2],
                                 long_prompt_len=16, whole="integrate", topk=48, index_heads=2, index_dim=16,
                                 device="cpu", dtype="float32")
    else:
        cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, long_new_tokens=[16384, 32768], long_batches=[32, 16],
                                 long_prompt_len=128, whole="integrate", topk=2048, index_heads=4, index_dim=64)
    b = _Bench(cfg, log, None)
    RES["copy_bw"] = b.bw
    RES["copy_bw_tb_s"] = round(b.bw / 1e12, 3)
    b.attach_sparse()
    log(f"model built, copy {RES['copy_bw_tb_s']} TB/s")
    phase("steps_profile_b32", lambda: steps_and_profile(b, a.smoke, a.budget_s), 140)
    (new16, B16), (new32, B32) = cfg.long_runs()
    P = cfg.long_prompt_len
    for name, new, B, need, per_mode in (("whole_16k_b32", new16, B16, 30, 10), ("whole_32k_b16", new32, B32, 32, 11)):
        phase(name, lambda: whole(b, new, B, P, a.budget_s, per_mode, name), need)
    phase("gemms", lambda: gemms(b, a.smoke), 12)
    phase("batch1", lambda: batch1(b, a.smoke), 15)
    save()
    print("\n| phase | mode | select | ms / tokens/s | floor | x floor |\n|---|---|---|---|---|---|")
    for r in (RES.get("steps_profile_b32") or {}).get("rows", []) + (RES.get("batch1") or []):
        print(f"| step b{r['batch']} {r['context']} | {r['mode']} | {r.get('select_impl', '-')} | {r['ms']} ms | "
              f"{r['floor_ms']} | {r['x_floor']} |")
    for k in ("whole_16k_b32", "whole_32k_b16"):
        for r in RES.get(k) or []:
            print(f"| {k} | {r['mode']} | {r['select_impl'] or '-'} | {r['tokens_per_s']} tok/s | "
                  f"{r['floor_tokens_per_s']} | {r['x_floor']} |")
    for k, p in ((RES.get("steps_profile_b32") or {}).get("profiles") or {}).items():
        print(f"| profile {k} | {p['mode']} | {p['select_impl']} | {p['kernel_us_total']} us | - | "
              f"{p['classes_us']} |")
    log(f"done; skipped {RES['skipped']}; errors {RES['errors']}")


if __name__ == "__main__":
    main()
