"""Shared pieces of the issue-14 rollout device scripts (session 9 on), beside granular_harness.py (whose
`Run` / `log` they use: a budget on time LEFT, one JSON rewritten after each phase): the engine's kernel
choices set per variant (`ModelRunner.decode_select` / `set_qkv_pad`, no module globals), one step's
per-kernel profile by class, the decode select alone on an engine's index cache, step rows and the
integrated whole generation of `bench rollout`.

    from granular_harness import Run, log
    import rollout_harness as rh
    rh.apply(eng, rh.Variant(select=DecodeSelect(long="fine")))
    rows = rh.step_rows(run, b, eng, [2304, 16384], {"base": rh.Variant()}, modes=("dense", "sparse"))
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field, fields

import torch

from granular_harness import log
from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT, DecodeSelect

# kernel name fragments -> class of a step's time (first match wins)
CLASSES = (("gemm", ("gemm", "nvjet", "cutlass", "xmma", "splitk", "gemv", "sm90_", "addmm", "aten::mm",
                     "aten::linear", "reduce_kernel")),
           ("attention", ("_fwd_kernel", "_merge_kernel", "_decode")),
           ("index_score", ("_score_max",)),
           ("select", ("_hist", "_count", "_gather", "_select", "_write", "_row_select", "_thresh_write",
                       "_sub_gather", "_resolve", "fillfunctor", "memset", "aten::zeros", "aten::fill_")),
           ("norm_rope_cache", ("_add_rmsnorm", "_qk_rope", "_indexer_decode", "_silu_mul")),
           ("sampling_copies", ("copy", "memcpy", "elementwise", "index_put", "scatter", "cat", "gather",
                                "arange", "aten::")))


@dataclass(frozen=True)
class Variant:
    """What the engine's next steps run: the decode select and the fused q/k/v(+indexer) weight's padding."""

    # the engine's own default (ENGINE_SELECT), as the other fields follow the runner's defaults; until session 20
    # this was DecodeSelect() (auto: row up to 8192 keys, chunked beyond), so a bare Variant() was not the engine
    # default (session 20's select_streams rows ran both arms on auto)
    select: DecodeSelect = field(default_factory=lambda: ENGINE_SELECT)
    qkv_pad: int = 64
    skinny_gemm: tuple | bool | None = None  # ModelRunner.skinny_gemm: True (all), names among forward.SKINNY, None its
    # default (forward.skinny_default: all four on sm_90+ since session 12; () is cuBLAS, the old default)
    blas: str | None = None  # ModelRunner.blas: the step's BLAS library (None: torch's default)
    pdl: bool | None = None  # ModelRunner.pdl: programmatic dependent launch (None: forward.PDL_DEFAULT)
    skinny_impl: str | None = None  # ModelRunner.skinny_impl: the kernel behind skinny_gemm (None: SKINNY_IMPL)
    skinny_tiles: tuple | None = None  # ModelRunner.skinny_tiles as pairs ((site, ((keyword, value), ...)), ...); None
    # its default (forward.SKINNY_TILES)
    fuse_indexer: bool = True  # ModelRunner.fuse_indexer: a sparse layer's q/k RoPE and indexer in one launch
    select_streams: int = 1  # ModelRunner.select_streams: row groups (CUDA streams) of the select + attention
    fuse_silu: bool = True  # ModelRunner.fuse_silu: SiLU(gate) * up in the swap-AB gate/up GEMM's epilogue (default)
    fuse_norm: bool = False  # ModelRunner.fuse_norm: the post-attention add + RMSNorm inside the swap-AB GEMMs
    fuse_merge: bool = False  # ModelRunner.fuse_merge: the split decode attention's merge inside its kernel

    def runner_options(self) -> dict:
        """The ModelRunner keywords of this variant: every field under its own name, the select as decode_select."""
        opts = {f.name: getattr(self, f.name) for f in fields(self)}
        opts["decode_select"] = opts.pop("select")
        return opts

    def describe(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["select"] = self.select.as_kwargs()
        d["skinny_tiles"] = None if self.skinny_tiles is None else {k: dict(v) for k, v in self.skinny_tiles}
        return d


def apply(eng, v: Variant) -> None:
    """Make variant v what the engine runs from its next step (graphs captured before are dropped)."""
    r = eng.runner
    if r.qkv_pad != v.qkv_pad:
        r.set_qkv_pad(v.qkv_pad)
    if r.decode_select != v.select:
        r.set_decode_select(v.select)
    if r._skinny_choice(v.skinny_gemm, v.skinny_impl, v.skinny_tiles) != (r.skinny_gemm, r.skinny_impl, r.skinny_tiles):
        r.set_skinny_gemm(v.skinny_gemm, v.skinny_impl, v.skinny_tiles)
    if r.blas != v.blas:
        r.set_blas(v.blas)
    r.set_pdl(v.pdl)  # drops the graphs only when the resolved choice changes
    r.set_fuse_indexer(v.fuse_indexer)  # likewise
    r.set_select_streams(v.select_streams)  # likewise
    r.set_fuse_silu(v.fuse_silu)  # likewise
    r.set_fuse_norm(v.fuse_norm)  # likewise
    r.set_fuse_merge(v.fuse_merge)  # likewise


def free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def classify(name: str) -> str:
    n = name.lower()
    for cls, keys in CLASSES:
        if any(x.lower() in n for x in keys):
            return cls
    return "other"


def profile_step(eng, ctx: int, mode: str, top: int = 40) -> dict:
    """Kernels of ONE eager decode step with every slot at position ctx - 1: per kernel (us, calls, class),
    sums and launch counts by class. On a CPU (smoke runs) the aten ops' CPU time stands in."""
    from torch.profiler import ProfilerActivity, profile

    cuda = eng.device.type == "cuda"
    cache = eng._ensure_cache(ctx)
    tok = torch.zeros(eng.max_batch, dtype=torch.long, device=eng.device)
    pos = torch.full_like(tok, ctx - 1)
    S = eng._bucket(ctx, cache.s_max)
    eng.set_attention(mode)
    with torch.inference_mode():
        for _ in range(2):
            eng.runner.decode_eager(cache, tok, pos, S, mode)
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            eng.runner.decode_eager(cache, tok, pos, S, mode)
            if cuda:
                torch.cuda.synchronize()
    want = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    by: dict = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == want and (cuda or e.name.startswith("aten::")):
            a = by[e.name[:100]]
            a[0] += e.device_time if cuda else e.cpu_time
            a[1] += 1
    cls: dict = defaultdict(lambda: [0.0, 0])
    for n, (us, c) in by.items():
        cls[classify(n)][0] += us
        cls[classify(n)][1] += c
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])
    return {"mode": mode, "context": ctx, "kernel_us_total": round(sum(v[0] for v in by.values()), 1),
            "kernels": sum(v[1] for v in by.values()),
            "classes_us": {k: round(v[0], 1) for k, v in sorted(cls.items(), key=lambda kv: -kv[1][0])},
            "classes_launches": {k: v[1] for k, v in cls.items()},
            "top": [{"kernel": n, "us": round(v[0], 1), "calls": v[1], "class": classify(n)} for n, v in rows[:top]]}


def step_rows(run, b, eng, ctxs, variants: dict, modes=("sparse",), need_s: float = 3.0, key: str = "steps",
              all_dense: bool = False) -> list:
    """Step ms (graph replay, median of 20; `_Bench.step_row`) of every (mode, variant) at each context,
    each row gated on the budget and saved as it comes (dense rows run the first variant only, unless
    all_dense)."""
    rows = run.res.setdefault(key, [])
    for ctx in ctxs:
        plan = [(m, n) for m in modes for n in (variants if m == "sparse" or all_dense else list(variants)[:1])]
        for mode, name in plan:
            if not run.gate(need_s, f"{key} {mode} {name} {ctx}"):
                continue
            apply(eng, variants[name])
            r = run.guarded(f"{key} {mode} {name} {ctx}", b.step_row, eng, eng.max_batch, ctx, mode)
            if r is not None:
                r["variant"] = name
                rows.append(r)
                log(f"{key}: {mode} {name} b{r['batch']} {ctx}: {r['ms']} ms (floor {r['floor_ms']}, {r['x_floor']}x)")
            run.save()
    return rows


def score_pass(qi, wi, keys, pos, CH, sink, window, k_scale=None, bn: int = 256):
    """The index score pass alone (`decode._score_max` with per-chunk spans, as the row / split / fine selects
    launch it) -> (scores `[B, S]` fp32, spans `[B, P, 2]`)."""
    import triton

    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

    B, HI, DI = qi.shape
    S = keys.shape[1]
    P = triton.cdiv(S, CH)
    sc = torch.empty(B, S, device=qi.device, dtype=torch.float32)
    span = torch.empty(B, P, 2, device=qi.device, dtype=torch.float32)
    fp8 = k_scale is not None
    itd._score_max[(P, B)](qi, wi, keys, k_scale if fp8 else sc, pos, pos, sc, span, *qi.stride(), *wi.stride(),
                           *keys.stride(), k_scale.stride(0) if fp8 else 0, S, sink, window, HI, DI, P, HB=16,
                           BD=max(16, triton.next_power_of_2(DI)), CH=CH, BN=min(CH, 16 if not qi.is_cuda else bn),
                           PREC=dot_precision(qi.dtype), FP8=fp8, PER_CHUNK=True, HAS_START=False,
                           num_warps=4 if qi.is_cuda else 1)
    return sc, span


def fine_with(qi, wi, keys, pos, K, sink, window, cb=None, chunk=None):
    """The fine select (score pass + `decode_fine.fine_select`) with its compaction step of cb slots."""
    from sparse_rl.sparse.ops.indexer_topk.decode_fine import fine_chunk, fine_select

    interp = not qi.is_cuda
    CH = chunk or fine_chunk(qi.shape[0], keys.shape[1], interp)
    sc, span = score_pass(qi, wi, keys, pos, CH, sink, window)
    return fine_select(sc, pos, span, K, CH, min(CH, 16 if interp else 256), num_warps=1 if interp else 4,
                       interpret=interp, cb=cb)[0]


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |a ∩ b| / |a| for `[B, K]` index lists (-1 = none)."""
    fr = []
    for x, y in zip(a.tolist(), b.tolist()):
        sx, sy = {i for i in x if i >= 0}, {i for i in y if i >= 0}
        fr.append(len(sx & sy) / max(1, len(sx)))
    return sum(fr) / len(fr)


def whole(run, b, new: int, B: int, P: int, plan: list, name: str, need_s, runner_options=None) -> list:
    """Integrated whole generations (`bench rollout --whole integrate`'s model) of every (mode, variant name,
    Variant) in plan on one engine of batch B, with sparse/dense and the floors' ratio. need_s: each run's
    gate, seconds, or a dict mode -> seconds (a sparse run at a new batch compiles new select kernels)."""
    from sparse_rl.bench.rollout import _integrated

    rows = run.res.setdefault(name, [])
    ids = b.prompts(B, P)
    eng = b.engine(B, P + new, runner_options=runner_options)
    try:
        for mode, vname, v in plan:
            if not run.gate(need_s[mode] if isinstance(need_s, dict) else need_s, f"{name} {mode} {vname}"):
                continue
            apply(eng, v)
            t = time.time()
            got = run.guarded(f"{name} {mode} {vname}", _integrated, b, eng, ids, new, mode)
            if got is None:
                continue
            secs, extra = got
            floor_s = b.floor_gen_s(B, P, new, mode)
            rows.append({"mode": mode, "variant": vname, "batch": B, "prompt": P, "new_tokens": new,
                         "seconds": round(secs, 3), "tokens_per_s": round(B * new / secs, 1),
                         "ms_per_step": round(1e3 * secs / new, 3), "floor_tokens_per_s": round(B * new / floor_s, 1),
                         "x_floor": round(secs / floor_s, 2), "wall_s": round(time.time() - t, 1), **extra})
            log(f"{name}: {mode} {vname}: {rows[-1]['tokens_per_s']} tok/s ({rows[-1]['x_floor']}x floor)")
            run.save()
    finally:
        del eng
        free()
    d = next((r for r in rows if r["mode"] == "dense"), None)
    for r in rows:
        if d is not None and r["mode"] == "sparse":
            r["sparse_over_dense"] = round(r["tokens_per_s"] / d["tokens_per_s"], 3)
            r["floors_ratio"] = round(r["floor_tokens_per_s"] / d["floor_tokens_per_s"], 3)
    return rows


def gemm_shapes(model) -> dict:
    """(N, K) of one layer's decode GEMMs: the fused q/k/v(+indexer) (padded to 64), gate/up, o_proj, down."""
    layer = model.model.layers[2]
    at, mlp = layer.self_attn, layer.mlp
    qkv = sum(m.weight.shape[0] for m in (at.q_proj, at.k_proj, at.v_proj))
    ix = getattr(at, "indexer", None)
    if ix is not None:
        qkv += sum(m.weight.shape[0] for m in (ix.wq, ix.wk, ix.ww))
    hid = at.o_proj.weight.shape[0]
    return {"o_proj": tuple(at.o_proj.weight.shape), "down": tuple(mlp.down_proj.weight.shape),
            "qkv": (-(-qkv // 64) * 64, hid), "gate_up": (2 * mlp.up_proj.weight.shape[0], hid)}


def gemm_alone(run, dev, bw, shapes: dict, rows=(32, 1), configs=None, smoke=False) -> dict:
    """F.linear vs `ops.skinny_linear` (tile configs: (bn, bk, programs) of the split-K kernel, or a dict of
    `ops.skinny_linear` keywords, impl included) per GEMM shape and row count, graph-timed, against the
    weight's bytes; every skinny result checked against F.linear's."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import skinny_linear
    from sparse_rl.sparse.ops.skinny_gemm.triton import counters

    configs = configs or {"d": (64, 64, 528)}
    out = {}
    g = torch.Generator(device=dev).manual_seed(5)
    dt = torch.float32 if smoke else torch.bfloat16
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=dev, generator=g).to(dt) / K ** 0.5
        for M in rows:
            if not run.gate(3, f"gemm {name} M{M}"):
                return out
            x = torch.randn(M, K, device=dev, generator=g).to(dt)
            ref = torch.nn.functional.linear(x, w)
            floor = 1e3 * N * K * w.element_size() / bw
            row = out[f"{name}_M{M}"] = {"N": N, "K": K, "M": M, "floor_ms": round(floor, 4),
                                         "linear_ms": round(bench_ms(lambda: torch.nn.functional.linear(x, w), dev,
                                                                     graph=not smoke), 4)}
            cnt = counters(N, dev)
            for cname, c in configs.items():
                # the kernel itself: on a CPU (smoke runs) the interpreter, not the op's torch fallback
                kw = {"backend": "triton", **(c if isinstance(c, dict) else dict(zip(("bn", "bk", "programs"), c)))}
                if not run.gate(1.5, f"gemm {name} M{M} {cname}"):
                    break
                y = skinny_linear(x, w, cnt, **kw)
                err = float((y.float() - ref.float()).abs().max())
                ms = bench_ms(lambda: skinny_linear(x, w, cnt, **kw), dev, graph=not smoke)
                row[f"skinny_{cname}"] = {"ms": round(ms, 4), "x_floor": round(ms / floor, 2), "max_abs_err": err,
                                          "counters_zero": int(cnt.abs().sum()) == 0}
            log(f"gemm {name} M={M}: floor {row['floor_ms']} linear {row['linear_ms']} " + " ".join(
                f"{k} {v['ms']}" for k, v in row.items() if k.startswith("skinny_")))
            run.save()
    return out
