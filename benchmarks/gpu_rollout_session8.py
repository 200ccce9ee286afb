"""Session 8 device run (issue 14): where the decode step's time goes at 32 x 16K (per-kernel profile of one
graph-less sparse and one dense step on a filled cache, by class), the select and the index score alone
against their byte floors, and the variants of this session timed inside the real step against the
current default: the `fine` decode select (two levels of bins, the threshold resolved among a handful of
keys: ops/indexer_topk/decode_fine.py), the fused q/k/v(+indexer) weight padded to 64 output columns
(`ModelRunner.set_qkv_pad`), and the opt-in W @ x^T form of that GEMM (`qkv_weight_left`, session 7).

    PYTHONPATH=$PWD python benchmarks/gpu_rollout_session8.py --budget 190 --call 1     (H200)
    PYTHONPATH=$PWD python benchmarks/gpu_rollout_session8.py --budget 190 --call 2     (final defaults)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_rollout_session8.py --cpu-smoke --budget 900
    PYTHONPATH=$PWD python benchmarks/gpu_rollout_session8.py --plan --budget 190      (the gates, no run)

Every phase has an estimate of its device seconds (PHASES) and runs only while that much of --budget is
left; inside a phase every row checks the budget again, and the JSON is rewritten after each row, so a
cut-off run keeps what it measured. Writes $OUT/roll8/session8.json and session8.log (or --out).

Call 1 (decides the design): correctness (tiny Qwen3, fp32: engine greedy == HF generate and log-probs
vs a teacher-forced forward with the default select, `fine`, and `fine` + the padded GEMM; the select
alone with integer inputs == the reference for chunked / row / fine / fine with cap 2 (its radix
fallback), and a random bf16 8 x 20,000 row set); then at Qwen3-4B's shape, batch 32, caches filled at
random: (1) the profile, (2) the select alone and the score alone vs their bytes, the attention alone on
three index lists, (3) step ms (graph replay) of every variant at 129 / 2048 / 2304 / 4096 / 8192 /
16384, (4) the q/k/v GEMM at M = 32 with padding 8 / 64 / 128, (5) whole generations if budget is left.
Call 2 (final defaults): correctness, the step rows of the old and the new default, the profile of the
new sparse step, whole generations 16K batch 32 and 32K batch 16 (integrated).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch

T0 = time.time()
RES: dict = {"errors": [], "skipped": [], "gates": []}
OUT: list = []
LOG: list = []
# estimated device seconds of each phase on the H200 (the gate: run while this much budget is left)
PHASES = {"correctness": 40, "setup": 12, "profile": 25, "alone": 25, "steps": 45, "gemm": 5, "whole_16k_b32": 45,
          "whole_32k_b16": 35, "alone_final": 18, "steps_final": 22, "profile_final": 10}
CALLS = {1: ["correctness", "setup", "profile", "alone", "steps", "gemm", "whole_16k_b32", "whole_32k_b16"],
         2: ["correctness", "setup", "steps_final", "alone_final", "profile_final", "whole_16k_b32", "whole_32k_b16"]}
# call 2's estimates (call 1 measured: correctness 51 s, profile 10, alone 36, steps 14, whole 16K 24, 32K 17)
PHASES2 = {"correctness": 42, "setup": 4, "steps_final": 16, "alone_final": 14, "profile_final": 8, "whole_16k_b32": 30,
           "whole_32k_b16": 24}
# the variants timed in a step: the decode select's impl (and what "auto" runs past ROW_MAX_KEYS keys), the
# q/k/v(+indexer) weight's padding, W @ x^T
VARIANTS = {"base": dict(impl="auto", long="chunked", pad=1, wl=False),
            "fine": dict(impl="fine", long="chunked", pad=1, wl=False),
            "pad": dict(impl="auto", long="chunked", pad=64, wl=False),
            "fine_pad": dict(impl="fine", long="chunked", pad=64, wl=False),
            "fine_wl": dict(impl="fine", long="chunked", pad=1, wl=True),
            "autofine_pad": dict(impl="auto", long="fine", pad=64, wl=False)}
CLASSES = (("gemm", ("gemm", "nvjet", "cutlass", "xmma", "splitk", "gemv", "sm90_", "addmm", "aten::mm",
                     "aten::linear")),
           ("attention", ("_fwd_kernel", "_merge_kernel")),
           ("index_score", ("_score_max",)),
           ("select", ("_hist", "_count", "_gather", "_select", "_write", "_row_select", "_thresh_write",
                       "_sub_gather", "_resolve_write", "fillfunctor", "memset", "aten::zeros", "aten::fill_")),
           ("norm_rope_cache", ("_add_rmsnorm", "_qk_rope", "_indexer_decode", "_silu_mul")),
           ("copies_elementwise", ("copy", "memcpy", "elementwise", "index_put", "scatter", "cat", "gather",
                                   "arange", "aten::")))


def log(msg):
    line = f"[{time.time() - T0:6.1f}s] {msg}"
    print(line, flush=True)
    LOG.append(line)


def save():
    RES["elapsed_s"] = round(time.time() - T0, 1)
    if OUT:
        json.dump(RES, open(f"{OUT[0]}/session8.json", "w"), indent=1)
        open(f"{OUT[0]}/session8.log", "w").write("\n".join(LOG) + "\n")


def left(budget):
    return budget - (time.time() - T0)


def free():
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def apply(eng, name):
    """Make variant `name` what the engine's next steps (and graphs captured after) run."""
    from sparse_rl.sparse.ops.indexer_topk import decode as itd

    v = VARIANTS[name]
    itd.DECODE_IMPL = v["impl"]
    itd.AUTO_LONG = v["long"]
    r = eng.runner
    if r.qkv_pad != v["pad"]:
        r.set_qkv_pad(v["pad"])
    r.qkv_weight_left = v["wl"]
    r.drop_graphs()


# ------------------------------------------------------------------------------------------ correctness
def correctness(dev, smoke, names=("base", "fine", "fine_pad")):
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
    new = 6 if smoke else 40  # 47 + 40 keys: past top-k 32, so the select runs
    hf = []
    with torch.inference_mode():  # the reference path (HF generate over the model's sparse attention)
        for p in prompts:
            hf.append(model.generate(torch.tensor([p], device=dev), max_new_tokens=new, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(p):].tolist())
    out = {}
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=7)
    for name in names:
        if smoke:  # the engine on the Triton kernels (interpreter), the reference on PyTorch
            os.environ["SPARSE_RL_BACKEND"] = "triton"
        try:
            eng = RolloutEngine(model, None, max_batch=3, max_seq_len=256, device=dev, eos_token_ids=[],
                                **({"fuse_projections": True} if smoke else {}))
            apply(eng, name)
            greedy = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=new))
            samples = eng.generate(prompts, params)
            lp = 0.0
            for c in samples:
                with torch.inference_mode():
                    ids = torch.tensor([c.prompt_tokens + c.tokens], device=dev)
                    logits = model(input_ids=ids).logits[0, len(c.prompt_tokens) - 1:-1].float()
                    ref = process_logits(logits, params).gather(-1, torch.tensor(c.tokens, device=dev)[:, None])[:, 0]
                lp = max(lp, float((torch.tensor(c.logprobs, device=dev) - ref).abs().max()))
            out[name] = {"greedy_equal_hf": f"{sum(r == c.tokens for r, c in zip(hf, greedy))}/{len(prompts)}",
                         "logprobs_max_abs_diff": lp, "graphs": eng.runner.use_graphs,
                         "graph_error": eng.runner.graph_error, "qkv_pad": eng.runner.qkv_pad}
            apply(eng, "base")
            del eng
        except Exception as e:
            RES["errors"].append(f"correctness {name}: {type(e).__name__}: {str(e)[:300]}")
        finally:
            os.environ.pop("SPARSE_RL_BACKEND", None)
            itd.DECODE_IMPL, itd.AUTO_LONG = "auto", "chunked"
        log(f"correctness {name}: {out.get(name)}")
    dt = torch.float32 if smoke else torch.bfloat16
    gi = torch.Generator(device=dev).manual_seed(10)
    B, S, K = (3, 200, 24) if smoke else (4, 3000, 512)
    q = torch.randint(-2, 3, (B, 4, 64), device=dev, generator=gi).to(dt)
    w = torch.randint(-1, 3, (B, 4), device=dev, generator=gi).to(dt)
    k = torch.randint(-2, 3, (B, S, 64), device=dev, generator=gi).to(dt)
    pos = torch.tensor([S - 1, S // 2, K // 2, S - 7][:B], device=dev)
    kw = dict(sink=2, window=4)
    ref = indexer_topk_decode_naive(q.float(), w.float(), k.float(), pos, K, **kw)
    cases = {"chunked": {}, "row": {}, "fine": {}, "fine_cap2": dict(fine_cap=2)}
    out["select_ints_equal_reference"] = {
        n: bool(torch.equal(itd.indexer_topk_decode(q, w, k, pos, K, impl=n.split("_")[0], **x, **kw), ref))
        for n, x in cases.items()}
    B, S, K = (2, 300, 40) if smoke else (8, 20000, 2048)
    q, w = torch.randn(B, 4, 64, device=dev, generator=gi).to(dt), torch.randn(B, 4, device=dev, generator=gi).to(dt)
    k = torch.randn(B, S, 64, device=dev, generator=gi).to(dt)
    pos = torch.randint(K, S, (B,), device=dev, generator=gi)
    pos[0] = S - 1
    ref = indexer_topk_decode_naive(q.float(), w.float(), k.float(), pos, K, sink=4, window=64 if not smoke else 8)
    got, n2 = itd.indexer_topk_decode(q, w, k, pos, K, impl="fine", candidates=True, sink=4,
                                      window=64 if not smoke else 8)
    out["select_random_fine_equal_reference"] = bool(torch.equal(got, ref))
    out["select_random_fine_sub_bin_keys"] = n2.tolist()
    log(f"select == reference: {out['select_ints_equal_reference']}, random fine "
        f"{out['select_random_fine_equal_reference']} (sub-bin keys {out['select_random_fine_sub_bin_keys']})")
    return out


# ------------------------------------------------------------------------------------------ profile
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
    return {"mode": mode, "context": ctx, "graph": graph,
            "kernel_us_total": round(sum(v[0] for v in by_name.values()), 1),
            "kernels": sum(v[1] for v in by_name.values()),
            "classes_us": {k: round(v[0], 1) for k, v in sorted(cls.items(), key=lambda kv: -kv[1][0])},
            "classes_launches": {k: v[1] for k, v in cls.items()},
            "all": [{"kernel": n, "us": round(v[0], 1), "calls": v[1], "class": classify(n)} for n, v in rows[:50]]}


def profiles(b, eng, ctx, keys) -> dict:
    out = {}
    for key, mode, variant, graph in keys:
        try:
            apply(eng, variant)
            p = out[key] = profile_step(eng, ctx, mode, graph)
            p["variant"] = variant
            p["step_ms_graph"] = b.step_row(eng, eng.max_batch, ctx, mode)["ms"]
            log(f"profile {key}: {p['kernel_us_total']} us in {p['kernels']} kernels, graph step "
                f"{p['step_ms_graph']} ms, {p['classes_us']}")
        except Exception as e:
            RES["errors"].append(f"profile {key}: {type(e).__name__}: {str(e)[:300]}")
        save()
    apply(eng, "base")
    return out


# ------------------------------------------------------------------------------------------ alone
def _rand(shape, dev, dt, seed):
    return torch.randn(*shape, device=dev, generator=torch.Generator(device=dev).manual_seed(seed)).to(dt)


def score_only(qi, wi, keys, pos, CH, sink, window):
    """The score pass alone (`decode._score_max` with per-chunk spans), as the row / split / fine selects
    launch it."""
    import triton

    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

    B, HI, DI = qi.shape
    S = keys.shape[1]
    P = triton.cdiv(S, CH)
    sc = torch.empty(B, S, device=qi.device, dtype=torch.float32)
    span = torch.empty(B, P, 2, device=qi.device, dtype=torch.float32)
    kvs = torch.zeros(B, dtype=torch.int32, device=qi.device)
    itd._score_max[(P, B)](qi, wi, keys, sc, pos, kvs, sc, span, *qi.stride(), *wi.stride(), *keys.stride(), 0, S,
                           sink, window, HI, DI, P, HB=16, BD=max(16, triton.next_power_of_2(DI)), CH=CH,
                           BN=min(CH, 256), PREC=dot_precision(qi.dtype), FP8=False, PER_CHUNK=True,
                           num_warps=4 if qi.is_cuda else 1)
    return sc


def select_alone(b, eng, ctxs, smoke, budget, extra_forms: bool = True) -> dict:
    """The select (score included) and the score pass alone on the engine's index cache of layer 2
    ([:, :ctx] view of the longer buffer, as the engine passes it), all rows at ctx - 1, graph-timed, with
    their bytes' floor; every form checked equal to the chunked one."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.decode_fine import fine_chunk

    cache = eng._ensure_cache(max(ctxs))
    dev, K, B = eng.device, b.cfg.topk, eng.max_batch
    HI, DI = b.cfg.index_heads, b.cfg.index_dim
    kw = dict(sink=min(4, K // 4), window=min(64, K // 4))
    out = {}
    big = max(ctxs)
    for ctx in ctxs:
        if left(budget) < 8:
            RES["skipped"].append(f"alone {ctx}")
            break
        view = cache.idx[2][:, :ctx]
        dt = view.dtype
        qi, wi = _rand((B, HI, DI), dev, dt, 3), _rand((B, HI), dev, dt, 4)
        pos = torch.full((B,), ctx - 1, device=dev, dtype=torch.int32)
        row = out[str(ctx)] = {"batch": B, "context": ctx, "floor_ms": round(1e3 * B * ctx * DI * view.element_size()
                                                                          / b.bw, 4), "forms": {}}
        forms = {"chunked": dict(impl="chunked"), "row": dict(impl="row"), "fine": dict(impl="fine")}
        if ctx == big and extra_forms:
            forms.update({"split": dict(impl="split"), "fine_chunk512": dict(impl="fine", chunk=512),
                          "fine_chunk2048": dict(impl="fine", chunk=2048), "fine_warps8": dict(impl="fine", num_warps=8)})
        if smoke:
            forms = {"chunked": dict(impl="chunked", chunk=32), "fine": dict(impl="fine", chunk=32),
                     "row": dict(impl="row", chunk=32)}
        with torch.inference_mode():
            base = itd.indexer_topk_decode(qi, wi, view, pos, K, impl="chunked", **({"chunk": 32} if smoke else {}),
                                           **kw)
            for name, extra in forms.items():
                got, n_c = itd.indexer_topk_decode(qi, wi, view, pos, K, candidates=True, **extra, **kw)
                fn = (lambda: itd.indexer_topk_decode(qi, wi, view, pos, K, **extra, **kw))
                ms = bench_ms(fn, dev, graph=not smoke)
                row["forms"][name] = {"ms_graph": round(ms, 4), "x_floor": round(ms / row["floor_ms"], 2),
                                      "equal_chunked": bool(torch.equal(got, base)),
                                      "candidates_mean": round(float(n_c.float().mean()), 1),
                                      "candidates_max": int(n_c.max())}
            for ch in sorted({itd._chunk(B, ctx, smoke), fine_chunk(B, ctx, smoke)}):
                ms = bench_ms(lambda: score_only(qi, wi, view, pos, ch, **kw), dev, graph=not smoke)
                row["forms"][f"score_only_chunk{ch}"] = {"ms_graph": round(ms, 4), "x_floor": round(ms / row["floor_ms"], 2)}
        log(f"alone {ctx}: floor {row['floor_ms']} ms, " + ", ".join(
            f"{n} {f['ms_graph']}" + ("" if f.get("equal_chunked", True) else " (DIFFERS)") for n, f in row["forms"].items()))
        save()
    return out


def attention_alone(b, eng, ctx, smoke) -> dict:
    """The sparse attention of one layer on the engine's filled cache (layer 2), graph-timed, with three
    index lists of top-k keys a row (all rows at ctx - 1): contiguous, uniform random, the select's own."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import sparse_decode
    from sparse_rl.sparse.ops.indexer_topk import decode as itd

    cache = eng._ensure_cache(ctx)
    dev, K = eng.device, b.cfg.topk
    kc, vc, ic = cache.k[2], cache.v[2], cache.idx[2]
    B, H, D = eng.max_batch, eng.runner.H, eng.runner.D
    q = _rand((B, H, D), dev, kc.dtype, 1)
    g = torch.Generator(device=dev).manual_seed(2)
    lists = {"contiguous_last": torch.arange(ctx - K, ctx, device=dev, dtype=torch.int32)[None].expand(B, K).contiguous(),
             "uniform_random": torch.rand(B, ctx, device=dev, generator=g).topk(K, -1).indices.sort(-1).values
             .to(torch.int32)}
    pos = torch.full((B,), ctx - 1, device=dev)
    qi, wi = _rand((B, b.cfg.index_heads, b.cfg.index_dim), dev, kc.dtype, 3), _rand((B, b.cfg.index_heads), dev, kc.dtype, 4)
    with torch.inference_mode():
        lists["select_output"] = itd.indexer_topk_decode(qi, wi, ic[:, :ctx], pos, K, sink=min(4, K // 4),
                                                         window=min(64, K // 4))
    kv_bytes = B * K * 2 * kc.shape[2] * D * kc.element_size()
    out = {"batch": B, "context": ctx, "topk": K, "floor_ms": round(1e3 * kv_bytes / b.bw, 4), "lists": {}}
    for name, idx in lists.items():
        with torch.inference_mode():
            fn = (lambda: sparse_decode(q, kc, vc, idx, 0.088))
            out["lists"][name] = round(bench_ms(fn, dev, graph=not smoke), 4)
    log(f"attention alone: {out}")
    return out


# ------------------------------------------------------------------------------------------ steps
def steps(b, eng, ctxs, variants, budget, dense_wl_ctxs) -> list:
    """Step ms (graph replay, median of 20) of dense and of every sparse variant at each context."""
    rows = RES.setdefault("steps_rows", [])
    for ctx in ctxs:
        plan = [("dense", "base")] + [("dense", "fine_wl")] * (ctx in dense_wl_ctxs) + [("sparse", v) for v in variants]
        for mode, v in plan:
            if left(budget) < 3:
                RES["skipped"].append(f"step {mode} {v} {ctx}")
                continue
            try:
                apply(eng, v)
                r = b.step_row(eng, eng.max_batch, ctx, mode)
                r["variant"] = v if mode == "sparse" else ("W@x^T" if VARIANTS[v]["wl"] else "base")
                rows.append(r)
                log(r)
            except Exception as e:
                RES["errors"].append(f"step {mode} {v} {ctx}: {type(e).__name__}: {str(e)[:300]}")
            save()
    apply(eng, "base")
    return rows


def best_variant(rows, variants) -> str:
    """The sparse variant with the smallest summed step time over the contexts where every variant ran."""
    by = defaultdict(dict)
    for r in rows:
        if r["mode"] == "sparse":
            by[r["variant"]][r["context"]] = r["ms"]
    common = set.intersection(*(set(by[v]) for v in variants if v in by)) if by else set()
    if not common:
        return "base"
    return min((v for v in variants if v in by), key=lambda v: sum(by[v][c] for c in common))


def gemm_pad(b, smoke) -> dict:
    """The q/k/v + indexer GEMM of one layer at M = 32: F.linear with the output N padded to a multiple of
    1 / 8 / 64 / 128, and W @ x^T, against the weight's bytes."""
    from sparse_rl.bench.timing import bench_ms

    layer = b.model.model.layers[2]
    at, ix = layer.self_attn, layer.self_attn.indexer
    w0 = torch.cat([m.weight.detach() for m in (at.q_proj, at.k_proj, at.v_proj, ix.wq, ix.wk, ix.ww)])
    x = torch.randn(32, w0.shape[1], device=b.dev, dtype=w0.dtype)
    out = {"N": w0.shape[0], "K": w0.shape[1], "floor_ms": round(1e3 * w0.numel() * w0.element_size() / b.bw, 4)}
    with torch.inference_mode():
        for pad in (1, 8, 64, 128):
            w = torch.cat([w0, w0.new_zeros(-w0.shape[0] % pad, w0.shape[1])])
            out[f"pad{pad}_ms"] = round(bench_ms(lambda: torch.nn.functional.linear(x, w), b.dev, graph=not smoke), 4)
        out["w_xT_ms"] = round(bench_ms(lambda: torch.mm(w0, x.t()), b.dev, graph=not smoke), 4)
        out["w_xT_copy_ms"] = round(bench_ms(lambda: torch.mm(w0, x.t()).t().contiguous(), b.dev, graph=not smoke), 4)
    log(f"gemm q/k/v+indexer M=32: {out}")
    return out


# ------------------------------------------------------------------------------------------ whole
def whole(b, new, B, P, budget, plan, name) -> list:
    from sparse_rl.bench.rollout import _integrated

    ids = b.prompts(B, P)
    eng = b.engine(B, P + new)
    rows = RES[name] = []
    per_mode = max(8.0, PHASES[name] / (len(plan) + 1))
    try:
        for mode, v in plan:
            if left(budget) < per_mode:
                RES["skipped"].append(f"{name} {mode} {v}")
                continue
            apply(eng, v)
            t = time.time()
            try:
                secs, extra = _integrated(b, eng, ids, new, mode)
            except Exception as e:
                RES["errors"].append(f"{name} {mode} {v}: {type(e).__name__}: {str(e)[:300]}")
                continue
            floor_s = b.floor_gen_s(B, P, new, mode)
            rows.append({"mode": mode, "variant": v, "batch": B, "prompt": P, "new_tokens": new, "how": "integrated",
                         "seconds": round(secs, 3), "tokens_per_s": round(B * new / secs, 1),
                         "ms_per_step": round(1e3 * secs / new, 3), "floor_tokens_per_s": round(B * new / floor_s, 1),
                         "x_floor": round(secs / floor_s, 2), "wall_s": round(time.time() - t, 1), **extra})
            log({k: x for k, x in rows[-1].items() if k != "step_points"})
            save()
    finally:
        apply(eng, "base")
        del eng
        free()
    d = next((r for r in rows if r["mode"] == "dense"), None)
    for r in rows:
        if d is not None and r["mode"] == "sparse":
            r["sparse_over_dense"] = round(r["tokens_per_s"] / d["tokens_per_s"], 3)
            r["sparse_over_dense_amortized_prefill"] = round(d["seconds_amortized_prefill"]
                                                             / r["seconds_amortized_prefill"], 3)
            r["floors_ratio"] = round(r["floor_tokens_per_s"] / d["floor_tokens_per_s"], 3)
    return rows


# ------------------------------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="default: $OUT/roll8")
    ap.add_argument("--budget", type=float, default=190)
    ap.add_argument("--call", type=int, default=1, choices=(1, 2))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--cpu-smoke", action="store_true", help="a CPU run of the script itself at tiny sizes")
    ap.add_argument("--plan", action="store_true", help="print the phases and their gates at --budget; run nothing")
    a = ap.parse_args()
    phases = CALLS[a.call]
    if a.call == 2:
        PHASES.update(PHASES2)
    if a.plan:
        t = 0.0
        for ph in phases:
            ok = a.budget - t >= PHASES[ph]
            print(f"{ph:16s} est {PHASES[ph]:3d} s, starts at ~{t:5.0f} s with {a.budget - t:5.0f} s left: "
                  f"{'runs' if ok else 'SKIPPED'}")
            t += PHASES[ph] if ok else 0
        return
    out = a.out or os.path.join(os.environ.get("OUT", "/tmp"), "roll8")
    os.makedirs(out, exist_ok=True)
    OUT.append(out)
    from sparse_rl.bench.rollout import BenchRolloutConfig, _Bench

    smoke = a.cpu_smoke
    dev = torch.device("cpu" if smoke else "cuda")
    RES.update({"commit": a.commit, "torch": torch.__version__, "budget_s": a.budget, "call": a.call,
                "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "variants": VARIANTS})

    def phase(name, fn):
        if left(a.budget) < PHASES[name]:
            RES["skipped"].append(name)
            log(f"skip {name}: {left(a.budget):.0f} s left, needs ~{PHASES[name]}")
            return None
        RES["gates"].append(f"{name} at {time.time() - T0:.0f} s, {left(a.budget):.0f} s left")
        try:
            RES[name] = fn()
        except Exception as e:  # keep the later phases
            import traceback

            RES["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
            log(RES["errors"][-1] + "\n" + traceback.format_exc()[-1500:])
        save()
        return RES.get(name)

    phase("correctness", lambda: correctness(dev, smoke, ("base", "fine", "fine_pad") if a.call == 1
                                             else ("pad", "fine_pad", "autofine_pad")))
    if smoke:
        cfg = BenchRolloutConfig(shape="tiny-qwen3", hf=False, long_new_tokens=[160, 200], long_batches=[3, 2],
                                 long_prompt_len=16, whole="integrate", topk=48, index_heads=2, index_dim=16,
                                 device="cpu", dtype="float32")
        B, top, ctxs, big = 4, 176, [40, 64, 96, 160], 160
    else:
        cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, long_new_tokens=[16384, 32768], long_batches=[32, 16],
                                 long_prompt_len=128, whole="integrate", topk=2048, index_heads=4, index_dim=64)
        B, top, ctxs, big = 32, 16384 + 128, [129, 2048, 2304, 4096, 8192, 16384], 16384
    state: dict = {}

    def setup():
        b = _Bench(cfg, log, None)
        b.attach_sparse()
        eng = b.engine(B, top)
        eng.set_attention("sparse")  # the index-key cache exists before the fill
        b.fill(eng, top)
        state.update(b=b, eng=eng)
        log(f"model built, copy {b.bw / 1e12:.3f} TB/s, engine batch {B} x {top} filled")
        return {"copy_bw_tb_s": round(b.bw / 1e12, 3)}

    phase("setup", setup)
    if "eng" not in state:
        log("setup failed: nothing else can run")
        save()
        return
    b, eng = state["b"], state["eng"]
    if a.call == 1:
        phase("profile", lambda: profiles(b, eng, big, [("sparse_eager", "sparse", "base", False),
                                                        ("dense_eager", "dense", "base", False),
                                                        ("sparse_graph", "sparse", "base", True),
                                                        ("sparse_eager_fine_pad", "sparse", "fine_pad", False)]))
        phase("alone", lambda: {"select": select_alone(b, eng, [c for c in ctxs if c > cfg.topk], smoke, a.budget),
                                "attention": attention_alone(b, eng, big, smoke)})
        variants = ["base", "fine", "pad", "fine_pad", "fine_wl"]
        phase("steps", lambda: steps(b, eng, ctxs, variants, a.budget, {ctxs[1], big}))
        best = best_variant(RES.get("steps_rows") or [], variants)
        phase("gemm", lambda: gemm_pad(b, smoke))
    else:
        variants = ["base", "pad", "fine_pad", "autofine_pad"]
        phase("steps_final", lambda: steps(b, eng, ctxs, variants, a.budget, set()))
        best = best_variant(RES.get("steps_rows") or [], variants[1:])
        log(f"best sparse variant by summed step ms: {best}")
        phase("alone_final", lambda: {"select": select_alone(b, eng, [c for c in ctxs if c > cfg.topk], smoke, a.budget,
                                                             extra_forms=False)})
        phase("profile_final", lambda: profiles(b, eng, big, [("sparse_eager_final", "sparse", best, False),
                                                              ("sparse_graph_final", "sparse", best, True)]))
    RES["best_variant"] = best
    del eng
    state.clear()
    free()
    (new16, B16), (new32, B32) = cfg.long_runs()
    P = cfg.long_prompt_len
    if a.call == 1:
        plan = [("dense", "base"), ("sparse", "base")] + ([("sparse", best)] if best != "base" else [])
    else:  # call 1 measured the old default whole: dense, the padded default, and the best select with it
        plan = [("dense", "pad"), ("sparse", "pad")] + ([("sparse", best)] if best != "pad" else [])
    for name, new, Bw in (("whole_16k_b32", new16, B16), ("whole_32k_b16", new32, B32)):
        phase(name, lambda: whole(b, new, Bw, P, a.budget, plan, name))
    save()
    print("\n| row | mode | variant | ms / tokens/s | floor | x floor |\n|---|---|---|---|---|---|")
    for r in RES.get("steps_rows") or []:
        print(f"| step b{r['batch']} {r['context']} | {r['mode']} | {r['variant']} | {r['ms']} ms | {r['floor_ms']} | "
              f"{r['x_floor']} |")
    for k in ("whole_16k_b32", "whole_32k_b16"):
        for r in RES.get(k) or []:
            print(f"| {k} | {r['mode']} | {r['variant']} | {r['tokens_per_s']} tok/s "
                  f"({r.get('sparse_over_dense', '-')}x) | {r['floor_tokens_per_s']} | {r['x_floor']} |")
    for k, p in {**(RES.get("profile") or {}), **(RES.get("profile_final") or {})}.items():
        print(f"| profile {k} | {p['mode']} | {p['variant']} | {p['kernel_us_total']} us, graph {p['step_ms_graph']} ms "
              f"| - | {p['classes_us']} |")
    log(f"done; best {best}; skipped {RES['skipped']}; errors {RES['errors']}")
    save()


if __name__ == "__main__":
    main()
