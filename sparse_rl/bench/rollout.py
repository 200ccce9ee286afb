"""`sparse-rl bench rollout`: the rollout engine against HF `generate` and against its memory floor,
sparse against dense mode, on a model shape built in code with random weights (no download).

Shapes (`--shape`, `bench.floor.SHAPES`): qwen3-4b (36 layers, hidden 2560, 32 heads, 8 KV heads,
head dim 128, intermediate 9728, tied embeddings), qwen3-8b, qwen2-0.5b (the earlier default: its
K/V is 512 B per token and layer, so the weights dominate every step), and tiny CPU smoke shapes.
Sparse mode attaches freshly initialised indexers (what `sparse-rl convert` does): top-k 2048,
4 x 64 index heads, layers 0 and 1 dense. Every run samples (temperature 1) and ignores EOS, so
every sequence generates exactly the requested tokens.

Rows:
- `hf_generate` / `engine` / `engine_eager` (optional, `--hf`): tokens/s of a whole generation at
  `--batch`, dense, HF's own loop against the engine's.
- `step`: one decode step with every sequence at a fixed context (CUDA-graph replay, median of 20,
  caches filled with random K/V and index keys), at `--step-batch` over `--step-contexts` and at
  batch 1 over `--latency-contexts`, with the memory floor beside it (`bench.floor`: weights + K/V or
  index keys + selected rows, over the device-copy bandwidth measured at the start of the run).
- `long`: whole generations of `--long-new-tokens` after `--long-prompt-len`-token prompts, batch
  `--long-batches` (one per length), dense and sparse, tokens/s and ms per step, with the floor's
  tokens/s. `how` says how the row was obtained: "measured" (a timed `generate`, prefill included)
  or "integrated" (where a whole generation would outlast `--whole-budget-s`: step times measured at
  contexts spanning the generation, summed piecewise linearly over every step's context, plus a
  1-token generation's time (prefill, once) and the per-step host time a short measured generation
  pays beyond that and its own integrated steps).
  `--whole measure|integrate|auto` forces either; auto decides on the integrated estimate.
Tokens/s = generated tokens / seconds, synchronised; engine runs are timed after a warm-up that
compiles kernels and captures the CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from sparse_rl.bench.floor import SHAPES, build_model as _build, copy_bandwidth, generation_floor_s, \
    integrate_steps, step_bytes, weight_bytes
from sparse_rl.errors import UsageError
from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT

WHOLE = ("auto", "measure", "integrate")
STEP_TIMINGS = ("synced", "queued")  # RolloutEngine.time_step: each step on an idle device (median) | back to back (mean)
DENSE_LAYERS = (0, 1)


def _sig(seconds: float) -> float:
    """A run's seconds to 6 significant figures: a fixed 3 decimals put up to ~2% of rounding into the
    seconds of a CPU-sized run (~0.03 s) beside its tokens/s."""
    return float(f"{seconds:.6g}")


@dataclass
class BenchRolloutConfig:
    shape: str = "qwen2-0.5b"
    batch: int = 64
    prompt_len: int = 128
    new_tokens: int = 512
    hf: bool = True
    hf_new_tokens: int = 0  # 0 = new_tokens; HF's time per step barely depends on the step count
    eager: bool = True  # also time the engine without CUDA graphs
    step_batch: int = 32
    step_contexts: list[int] = field(default_factory=list)  # fixed-context step rows at step_batch
    latency_contexts: list[int] = field(default_factory=list)  # fixed-context step rows at batch 1
    long_new_tokens: list[int] = field(default_factory=lambda: [8192, 16384])
    long_batch: int = 16
    long_batches: list[int] = field(default_factory=list)  # one per long_new_tokens; empty = long_batch for all
    long_prompt_len: int = 128
    whole: str = "measure"
    whole_budget_s: float = 90.0  # auto: measure a whole generation only when its estimate is under this
    topk: int = 2048
    index_heads: int = 4
    index_dim: int = 64
    index_dtype: str = "bf16"  # the decode cache's index keys (SparseConfig.index_dtype): bf16 | fp8
    dtype: str = "bfloat16"
    device: str = "auto"
    seed: int = 0
    compile: bool | None = None  # torch.compile the engine's decode step; None = the engine's default (off; SPARSE_RL_COMPILE)
    decode_select: str = ENGINE_SELECT.impl  # the indexer's decode select after the score pass (DecodeSelect.impl)
    decode_long: str = ENGINE_SELECT.long  # what auto runs past 8192 keys (DecodeSelect.long)
    score_block: int = ENGINE_SELECT.score_block  # the score pass's keys a step (DecodeSelect.score_block; 0: its own)
    sync_min_batch: int = ENGINE_SELECT.sync_min_batch  # batches of at least this many rows take the sync select (0: never)
    qkv_pad: int = 64  # the fused q/k/v(+indexer) weight padded with zero rows to a multiple of this
    pdl: int | None = None  # PDL in the step (ModelRunner.pdl: 0-2 or a bool; None: its default)
    select_streams: int = 1  # row groups, one CUDA stream each, for the sparse layers' select + attention
    step_timing: str = "synced"  # step rows: "synced" (each step on an idle device, median) | "queued" (back to back)

    def __post_init__(self):
        if self.shape not in SHAPES:
            raise UsageError(f"--shape {self.shape}: expected one of {', '.join(SHAPES)}")
        for name in ("batch", "prompt_len", "new_tokens", "long_batch", "long_prompt_len", "topk", "step_batch"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
        if self.whole not in WHOLE:
            raise UsageError(f"--whole {self.whole}: expected one of {', '.join(WHOLE)}")
        if self.long_batches and len(self.long_batches) != len(self.long_new_tokens):
            raise UsageError(f"--long-batches: {len(self.long_batches)} batches for {len(self.long_new_tokens)} "
                             "--long-new-tokens lengths (give one per length)")
        try:
            self.select()
        except ValueError as e:  # DecodeSelect's own check (auto is not a --decode-long)
            raise UsageError(f"--decode-select / --decode-long / --score-block / --sync-min-batch: {e}") from None
        if self.qkv_pad < 1:
            raise UsageError("--qkv-pad must be >= 1")
        from sparse_rl.sparse.config import INDEX_DTYPES

        if self.index_dtype not in INDEX_DTYPES:
            raise UsageError(f"--index-dtype {self.index_dtype}: expected one of {', '.join(INDEX_DTYPES)}")
        if self.select_streams < 1:
            raise UsageError("--select-streams must be >= 1")
        if self.step_timing not in STEP_TIMINGS:
            raise UsageError(f"--step-timing {self.step_timing}: expected one of {', '.join(STEP_TIMINGS)}")
        if any(b < 1 for b in self.long_batches) or any(c < 2 for c in self.step_contexts + self.latency_contexts):
            raise UsageError("--long-batches must be >= 1 and --step-contexts/--latency-contexts >= 2")

    def select(self):
        """The engine's decode select of these options (`DecodeSelect`; ValueError for a bad choice)."""
        from sparse_rl.sparse.ops.indexer_topk.decode_select import DecodeSelect

        return DecodeSelect(self.decode_select, long=self.decode_long, score_block=self.score_block,
                            sync_min_batch=self.sync_min_batch)

    def long_runs(self) -> list[tuple[int, int]]:
        """(new tokens, batch) of every long run."""
        return list(zip(self.long_new_tokens, self.long_batches or [self.long_batch] * len(self.long_new_tokens)))


def build_model(cfg: BenchRolloutConfig, device, dtype):
    longest = cfg.long_prompt_len + max(cfg.long_new_tokens or [0]) + 1
    return _build(SHAPES[cfg.shape], max(longest, *(cfg.step_contexts or [0]), *(cfg.latency_contexts or [0])),
                  device, dtype, cfg.seed)


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Bench:
    """One benchmark run: the model, the floor's inputs, and the rows recorded so far."""

    def __init__(self, cfg: BenchRolloutConfig, log, on_result):
        import torch

        from sparse_rl.bench.timing import device_name
        from sparse_rl.devices import resolve_device, resolve_dtype
        from sparse_rl.sparse.ops import kernel

        self.cfg, self.log, self.on_result = cfg, log, on_result
        self.dev = torch.device(resolve_device(cfg.device))
        self.dtype = resolve_dtype(cfg.dtype, self.dev.type)
        self.shape = SHAPES[cfg.shape]
        self.bw = copy_bandwidth(self.dev)
        self.model = build_model(cfg, self.dev, self.dtype)
        self.vocab = self.model.config.vocab_size
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.sparse_attached = False
        self.res: dict = {"config": dataclasses.asdict(cfg), "device": device_name(self.dev), "torch": torch.__version__,
                          "copy_bw_tb_s": round(self.bw / 1e12, 3),
                          "triton_decode_kernel": kernel("sparse_attention", "sparse_decode") is not None
                          and self.dev.type == "cuda", "rows": [], "errors": []}

    def record(self, row):
        self.res["rows"].append(row)
        self.log(" ".join(f"{k}={v}" for k, v in row.items()))
        if self.on_result:
            self.on_result(self.res)

    def error(self, what, e):
        self.res["errors"].append(f"{what}: {type(e).__name__}: {str(e)[:300]}")
        self.log(self.res["errors"][-1])

    def prompts(self, B, L):
        import torch

        return torch.randint(10, self.vocab, (B, L), generator=self.gen)

    def attach_sparse(self):
        from sparse_rl.sparse.config import SparseConfig
        from sparse_rl.sparse.patch import attach_sparse

        if not self.sparse_attached:
            c = self.cfg
            attach_sparse(self.model, SparseConfig(topk=c.topk, index_heads=c.index_heads, index_dim=c.index_dim,
                                                   rope_dim=min(32, c.index_dim), dense_layers=list(DENSE_LAYERS),
                                                   sink=min(4, c.topk // 4), window=min(64, c.topk // 4),
                                                   index_dtype=c.index_dtype))
            self.model.to(self.dtype)
            self.sparse_attached = True

    def floor_bytes(self, B, ctx, mode) -> int:
        return step_bytes(self.shape, weight_bytes(self.model, mode), B, ctx, mode, **self._floor_kw())["total"]

    def floor_gen_s(self, B, prompt, new, mode) -> float:
        return generation_floor_s(self.shape, weight_bytes(self.model, mode), B, prompt, new, mode, self.bw,
                                  **self._floor_kw())

    def _floor_kw(self) -> dict:
        """The floor's selection and index-key terms (fp8 keys: the e4m3 values and an fp32 scale a key)."""
        c = self.cfg
        return dict(topk=c.topk, index_dim=c.index_dim, dense_layers=DENSE_LAYERS,
                    index_bytes_per_key=c.index_dim + 4 if c.index_dtype == "fp8" else None)

    def engine(self, B, max_len, **kw):
        from sparse_rl.rl.rollout import RolloutEngine

        c = self.cfg
        opts = kw.pop("runner_options", None) or {"decode_select": c.select(), "qkv_pad": c.qkv_pad, "pdl": c.pdl,
                                                      "select_streams": c.select_streams}
        return RolloutEngine(self.model, None, max_batch=B, max_seq_len=max_len, device=self.dev, eos_token_ids=[],
                             compile=c.compile, runner_options=opts, **kw)

    def fill(self, eng, max_len):
        """The cache with random K/V and index keys (never time on zeros), whatever the engine's mode: with the
        sparse layers attached the cache is made in sparse mode, which gives it index keys (a cache allocated in dense
        mode has none, and sparse steps on it then read all-zero keys: session 13), and the mode is restored."""
        import torch

        mode = eng.mode
        with torch.inference_mode():  # a cache made by `generate` is an inference tensor
            if self.sparse_attached:
                eng.set_attention("sparse")
            try:
                cache = eng._ensure_cache(max_len)
            finally:
                eng.set_attention(mode)
            g = torch.Generator(device=self.dev).manual_seed(self.cfg.seed)
            for t in (cache.k, cache.v):
                t.normal_(generator=g)
            if cache.idx is not None and cache.idx_scale is None:
                cache.idx.normal_(generator=g)
            elif cache.idx is not None:  # fp8 keys: random keys quantized as the engine stores them, with scales
                from sparse_rl.sparse.ops import quantize_index_keys

                for i in range(cache.idx.shape[0]):  # a layer at a time: no fp32 copy of the whole cache
                    k8, sc = quantize_index_keys(torch.randn(cache.idx[i].shape, device=self.dev, generator=g))
                    cache.idx[i].copy_(k8)
                    cache.idx_scale[i].copy_(sc)

    def time_generate(self, eng, ids, new, mode, warm=True) -> tuple[float, int]:
        from sparse_rl.rl.rollout import SamplingParams

        eng.set_attention(mode)
        p = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=self.cfg.seed)
        toks = ids.tolist()
        if warm:  # compile kernels (the prefill's for these prompts too) and capture every graph bucket
            eng.warmup(max(len(t) for t in toks) + new, prompts=toks)
        _sync(self.dev)
        t0 = time.perf_counter()
        outs = eng.generate(toks, p)
        _sync(self.dev)
        return time.perf_counter() - t0, sum(len(c.tokens) for c in outs)

    def step_row(self, eng, B, ctx, mode, run="step") -> dict:
        eng.set_attention(mode)
        ms = eng.time_step(ctx - 1, queued=self.cfg.step_timing == "queued")
        fb = self.floor_bytes(B, ctx, mode)
        fl = 1e3 * fb / self.bw
        return {"run": run, "mode": mode, "batch": B, "context": ctx, "ms": round(ms, 3), "floor_ms": float(f"{fl:.4g}"),
                "x_floor": round(ms / fl, 2), "floor_gb": round(fb / 1e9, 2)}


def run_rollout_bench(cfg: BenchRolloutConfig, log=print, on_result=None) -> dict:
    b = _Bench(cfg, log, on_result)
    if cfg.hf:
        _hf_rows(b)
    if cfg.step_contexts or cfg.latency_contexts or cfg.long_new_tokens:
        b.attach_sparse()
    for B, ctxs in ((cfg.step_batch, cfg.step_contexts), (1, cfg.latency_contexts)):
        if ctxs:
            _step_rows(b, B, ctxs)
    for new, B in cfg.long_runs():
        _long_rows(b, new, B)
    b.res["summary"] = summarize(b.res["rows"])
    return b.res


def _hf_rows(b: _Bench) -> None:
    """Engine vs HF generate, dense, same model and batch."""
    import torch

    cfg, dev, model = b.cfg, b.dev, b.model
    ids = b.prompts(cfg.batch, cfg.prompt_len)
    hf_new = cfg.hf_new_tokens or cfg.new_tokens
    try:
        x = ids.to(dev)
        with torch.inference_mode():
            model.generate(x[:, :8], attention_mask=torch.ones_like(x[:, :8]), do_sample=True, max_new_tokens=4,
                           top_k=0, top_p=1.0, temperature=1.0)
            _sync(dev)
            t0 = time.perf_counter()
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, max_new_tokens=hf_new,
                                 top_k=0, top_p=1.0, temperature=1.0)
            _sync(dev)
        dt = time.perf_counter() - t0
        n = (out.shape[1] - x.shape[1]) * x.shape[0]
        b.record({"run": "hf_generate", "mode": "dense", "batch": cfg.batch, "prompt": cfg.prompt_len,
                  "new_tokens": hf_new, "seconds": _sig(dt), "tokens_per_s": round(n / dt, 1),
                  "ms_per_step": round(1000 * dt / hf_new, 3), "cuda_graphs": False})
    except Exception as e:  # keep the other measurements
        b.error("hf_generate", e)
    for graphs in ([True, False] if (cfg.eager and dev.type == "cuda") else [dev.type == "cuda"]):
        try:
            eng = b.engine(cfg.batch, cfg.prompt_len + cfg.new_tokens, use_cuda_graphs=graphs)
            dt, n = b.time_generate(eng, ids, cfg.new_tokens, "dense")
            r = eng.runner
            b.record({"run": "engine" if graphs or dev.type != "cuda" else "engine_eager", "mode": "dense",
                      "batch": cfg.batch, "prompt": cfg.prompt_len, "new_tokens": cfg.new_tokens,
                      "seconds": _sig(dt), "tokens_per_s": round(n / dt, 1),
                      "ms_per_step": round(1000 * dt / cfg.new_tokens, 3), "cuda_graphs": r.use_graphs,
                      "compiled": r.compile, **({"graph_error": r.graph_error} if r.graph_error else {}),
                      **({"compile_error": r.compile_error} if r.compile_error else {})})
            del eng
        except Exception as e:
            b.error(f"engine (graphs={graphs})", e)
    _free(b.dev)


def _free(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _step_rows(b: _Bench, B: int, ctxs: list[int]) -> None:
    try:
        eng = b.engine(B, max(ctxs))
        b.fill(eng, max(ctxs))
        for ctx in ctxs:
            for mode in ("dense", "sparse"):
                b.record(b.step_row(eng, B, ctx, mode))
        del eng
    except Exception as e:
        b.error(f"step rows batch {B}", e)
    _free(b.dev)


def _span_contexts(c0: int, c1: int, topk: int, bucket: int) -> list[int]:
    """Contexts at which to time steps for integrating a generation over contexts c0+1..c1: both ends,
    both sides of every power of two between and both sides of top-k (below it the sparse step keeps
    every key). Both sides of a power of two because the step is not linear across one: the decode
    select's launch constants (its chunk count's power of two, `PMAX`) double there, a measured +0.64 ms
    at 32 x 16,512 against 16,384 (session 12), so a line from 2^n to 2^(n+1) alone would miss the jump."""
    pts = {c0 + 1, c1, topk, topk + bucket}
    p = 256
    while p < c1:
        pts.update((p, p + bucket))
        p *= 2
    return sorted(c for c in pts if c0 < c <= c1)


def _long_rows(b: _Bench, new: int, B: int) -> None:
    cfg = b.cfg
    P = cfg.long_prompt_len
    ids = b.prompts(B, P)
    try:
        eng = b.engine(B, P + new)
    except Exception as e:
        b.error(f"long {new} batch {B}", e)
        return
    for mode in ("dense", "sparse"):
        try:
            row = {"run": "long", "mode": mode, "batch": B, "prompt": P, "new_tokens": new}
            floor_s = b.floor_gen_s(B, P, new, mode)
            how = cfg.whole
            if how != "measure":
                secs, extra = _integrated(b, eng, ids, new, mode)
                how = "integrated" if how == "integrate" or secs > cfg.whole_budget_s else "measure"
                row.update(extra)
            if how == "measure":
                secs, n = b.time_generate(eng, ids, new, mode)
                row["step_ms_at_full_context"] = round(eng.time_step(P + new - 1), 3)
            row.update({"how": "measured" if how == "measure" else "integrated", "seconds": _sig(secs),
                        "tokens_per_s": round(B * new / secs, 1), "ms_per_step": round(1000 * secs / new, 3),
                        "floor_tokens_per_s": round(B * new / floor_s, 1), "x_floor": round(secs / floor_s, 2),
                        "cuda_graphs": eng.runner.use_graphs, "compiled": eng.runner.compile})
            b.record(row)
        except Exception as e:
            b.error(f"long {new} {mode}", e)
    del eng
    _free(b.dev)


def _integrated(b: _Bench, eng, ids, new: int, mode: str) -> tuple[float, dict]:
    """Seconds of a whole generation from step times: steps timed at contexts spanning it (random
    caches), summed piecewise linearly, plus the one-time cost of a generation (a timed 1-token
    generation: prefill, first sample, setup) and what a short real generation pays per step beyond
    that and its own integrated steps (sampling, host work; after a throwaway generation that takes the
    first-use costs: allocations, cuBLAS heuristics), never below zero. `seconds_amortized_prefill`
    is the earlier model (through session 7), which spread the short run's prefill over its steps and
    so charged it again at every step of the long generation."""
    P = ids.shape[1]
    n = min(256, new)
    eng.set_attention(mode)
    eng.warmup(P + n)  # every graph bucket the timed run uses
    b.time_generate(eng, ids, min(8, n), mode, warm=False)  # one-time costs out of the timed run
    one = b.time_generate(eng, ids, 1, mode, warm=False)[0]  # prefill + first token, no decode step
    short = b.time_generate(eng, ids, n, mode, warm=False)[0]
    b.fill(eng, P + new)
    ctxs = sorted(set(_span_contexts(P, P + new, b.cfg.topk, eng.bucket)) | {P + 1, P + n})
    pts = [(c, b.step_row(eng, ids.shape[0], c, mode)["ms"]) for c in ctxs]
    short_steps = integrate_steps(pts, P, P + n) / 1e3
    per_step = max(0.0, short - one - short_steps) / n
    old_per_step = max(0.0, short - short_steps) / n
    steps_s = integrate_steps(pts, P, P + new) / 1e3
    return one + steps_s + per_step * new, {"step_points": [[x, round(y, 3)] for x, y in pts],
                                            "steps_s": round(steps_s, 3), "prefill_s": round(one, 4),
                                            "overhead_ms_per_step": round(1e3 * per_step, 3),
                                            "seconds_amortized_prefill": round(steps_s + old_per_step * new, 3),
                                            "step_ms_at_full_context": pts[-1][1]}


def summarize(rows: list[dict]) -> dict:
    """engine_vs_hf; per long length: sparse_vs_dense (tokens/s), the floors' ratio, and the first over
    the second; per step context: dense step / sparse step."""
    out = {}
    hf = next((r for r in rows if r["run"] == "hf_generate"), None)
    eng = next((r for r in rows if r["run"] == "engine"), None)
    if hf and eng:
        out["engine_vs_hf"] = round(eng["tokens_per_s"] / hf["tokens_per_s"], 1)
    longs = {(r["mode"], r["new_tokens"]): r for r in rows if r["run"] == "long"}
    for (mode, new), r in longs.items():
        d = longs.get(("dense", new))
        if mode != "sparse" or d is None:
            continue
        out[f"sparse_vs_dense_{new}"] = round(r["tokens_per_s"] / d["tokens_per_s"], 2)
        if "floor_tokens_per_s" in r:
            fr = r["floor_tokens_per_s"] / d["floor_tokens_per_s"]
            out[f"floor_ratio_{new}"] = round(fr, 2)
            out[f"ratio_over_floor_ratio_{new}"] = round(out[f"sparse_vs_dense_{new}"] / fr, 2)
        if r.get("step_ms_at_full_context") and d.get("step_ms_at_full_context"):
            out[f"step_sparse_vs_dense_at_{new}"] = round(d["step_ms_at_full_context"] / r["step_ms_at_full_context"], 2)
    steps = {(r["batch"], r["context"], r["mode"]): r for r in rows if r["run"] == "step"}
    for (B, ctx, mode), r in steps.items():
        if mode == "sparse" and (B, ctx, "dense") in steps:
            out[f"step_dense_over_sparse_b{B}_{ctx}"] = round(steps[(B, ctx, "dense")]["ms"] / r["ms"], 2)
    return out


def markdown_rollout(res: dict) -> str:
    cfg = res["config"]
    lines = [f"rollout engine on {res['device']} (torch {res['torch']}; {cfg['shape']} shape, random weights, "
             f"{cfg['dtype']}; sparse: top-k {cfg['topk']}, indexer {cfg['index_heads']}x{cfg['index_dim']}, layers "
             f"{', '.join(map(str, DENSE_LAYERS))} dense; Triton decode kernel: "
             f"{'yes' if res['triton_decode_kernel'] else 'no, reference path'}; device copy "
             f"{res.get('copy_bw_tb_s', '-')} TB/s, the floors' bandwidth)"]
    gens = [r for r in res["rows"] if r["run"] != "step"]
    if gens:
        lines += ["", "| run | attention | batch | prompt | new tokens | how | seconds | tokens/s | floor tokens/s | "
                      "x floor | ms/step | step ms at full context | CUDA graphs | compiled |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in gens:
            lines.append(f"| {r['run']} | {r['mode']} | {r['batch']} | {r['prompt']} | {r['new_tokens']} | "
                         f"{r.get('how', 'measured')} | {r['seconds']} | {r['tokens_per_s']} | "
                         f"{r.get('floor_tokens_per_s', '-')} | {r.get('x_floor', '-')} | {r['ms_per_step']} | "
                         f"{r.get('step_ms_at_full_context', '-')} | {'yes' if r['cuda_graphs'] else 'no'} | "
                         f"{'yes' if r.get('compiled') else 'no'} |")
    steps = [r for r in res["rows"] if r["run"] == "step"]
    if steps:
        lines += ["", "one decode step, every sequence at the given context (CUDA-graph replay, median of 20):", "",
                  "| attention | batch | context | ms | floor ms | x floor | floor GB |", "|---|---|---|---|---|---|---|"]
        for r in steps:
            lines.append(f"| {r['mode']} | {r['batch']} | {r['context']} | {r['ms']} | {r['floor_ms']} | "
                         f"{r['x_floor']} | {r['floor_gb']} |")
    if res.get("summary"):
        lines += ["", "ratios: " + ", ".join(f"{k} = {v}x" for k, v in res["summary"].items())]
    for e in res.get("errors", []):
        lines.append(f"error: {e}")
    for r in res["rows"]:
        for k in ("graph_error", "compile_error"):
            if r.get(k):
                lines.append(f"{r['run']} {r['mode']}: {k}: {r[k]}")
    return "\n".join(lines)


def consistency_checks(device: str = "cuda", seed: int = 0) -> dict:
    """On the benchmark's device, float32, a small Qwen2-shaped model: (a) a CUDA-graph decode step
    equals the eager step; (b) greedy engine tokens vs HF `generate` greedy (dense, and sparse with
    top-k above the length). Reports agreement instead of asserting: fp32 matmuls may use TF32 on a GPU."""
    import torch

    from sparse_rl.rl.rollout import RolloutEngine, SamplingParams
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.patch import attach_sparse

    dev = torch.device(device)
    cfg = BenchRolloutConfig(shape="tiny", long_new_tokens=[])
    model = build_model(cfg, dev, torch.float32)
    attach_sparse(model, SparseConfig(topk=4096, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2,
                                      dense_layers=[0]))
    model.to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 500, (n,), generator=gen).tolist() for n in (5, 17, 33, 9)]
    out: dict = {}
    from sparse_rl.sparse.layer import set_attention, set_topk

    for name, mode, topk in (("dense", "dense", 4096), ("sparse_full_topk", "sparse", 4096),
                             ("sparse_topk64", "sparse", 64)):
        set_topk(model, topk)
        set_attention(model, mode)  # the HF reference runs the same attention
        eng = RolloutEngine(model, None, max_batch=4, max_seq_len=512, device=dev, eos_token_ids=[])
        eng.set_attention(mode)
        got = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=300))
        same, first_diff = 0, []
        for p, c in zip(prompts, got):
            with torch.inference_mode():
                ref = model.generate(torch.tensor([p], device=dev), max_new_tokens=300, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            same += ref == c.tokens
            first_diff.append(next((i for i, (a, b) in enumerate(zip(ref, c.tokens)) if a != b), None))
        # graph replay vs eager, same inputs
        cache = eng.cache
        tok = torch.randint(10, 500, (4,), device=dev)
        pos = torch.tensor([300, 100, 7, 450], device=dev)
        with torch.inference_mode():
            a = eng.runner.decode_eager(cache, tok, pos, 512, mode).clone()
            b = eng.runner.decode(cache, tok, pos, 512, mode).clone()
        out[name] = {"greedy_equal_hf": f"{same}/{len(prompts)}", "first_divergence": first_diff,
                     "graph_vs_eager_max_abs": float((a - b).abs().max()), "graphs": eng.runner.use_graphs,
                     "graph_error": eng.runner.graph_error}
    return out


def compile_step_bench(shape: str = "qwen2-0.5b", batches=(16, 64), contexts=(1024, 8192, 16384),
                       modes=("dense", "sparse"), topk: int = 2048, index_heads: int = 4, index_dim: int = 64,
                       dtype: str = "bfloat16", device: str = "auto", reps: int = 20, seed: int = 0,
                       compile_backend="inductor", log=print, on_result=None) -> dict:
    """Decode step eager vs compiled, both captured in CUDA graphs (on a GPU): for every batch, one
    engine of each kind over the same model; caches filled with the same random K/V/index keys;
    then per (mode, context): "step ms at full context" (`time_step`, every slot at position
    context-1, median of `reps`) and the compiled step's logits against the eager step's on the
    same inputs. The first timed call of a mode compiles: `compile_s` is that call's compile time
    (the first call of each variant: S <= top-k and S > top-k are two variants in sparse mode)."""
    import torch

    from sparse_rl.bench.timing import device_name
    from sparse_rl.devices import resolve_device, resolve_dtype
    from sparse_rl.rl.rollout import RolloutEngine
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.ops import kernel
    from sparse_rl.sparse.patch import attach_sparse

    dev = torch.device(resolve_device(device))
    cfg = BenchRolloutConfig(shape=shape, long_new_tokens=[max(contexts)], long_prompt_len=1, topk=topk,
                             index_heads=index_heads, index_dim=index_dim, dtype=dtype, device=device, seed=seed)
    dt = resolve_dtype(dtype, dev.type)
    model = build_model(cfg, dev, dt)
    attach_sparse(model, SparseConfig(topk=topk, index_heads=index_heads, index_dim=index_dim,
                                      rope_dim=min(32, index_dim), dense_layers=[0, 1], sink=min(4, topk // 4),
                                      window=min(64, topk // 4)))
    model.to(dt)
    res: dict = {"shape": shape, "device": device_name(dev), "torch": torch.__version__, "dtype": dtype,
                 "topk": topk, "compile_backend": str(compile_backend), "reps": reps,
                 "triton": {"sparse_decode": kernel("sparse_attention", "sparse_decode") is not None and dev.type == "cuda",
                            "indexer_topk_decode": kernel("indexer_topk", "indexer_topk_decode") is not None
                            and dev.type == "cuda"},
                 "rows": [], "compile": [], "errors": []}
    s_max = max(contexts)
    engines: dict = {}
    # every batch's two engines live together, so the loop can run mode by mode (all dense rows
    # first): what a time limit cuts off is then the last mode, not the last batch
    for B in batches:
        try:
            for compiled in (False, True):
                eng = RolloutEngine(model, None, max_batch=B, max_seq_len=s_max, device=dev, eos_token_ids=[],
                                    compile=compiled, compile_backend=compile_backend)
                eng.set_attention("sparse")  # allocates the index-key cache too
                cache = eng._ensure_cache(s_max)
                g = torch.Generator(device=dev).manual_seed(seed)
                for t in (cache.k, cache.v, cache.idx):
                    t.normal_(generator=g)
                engines[(B, compiled)] = eng
        except Exception as e:
            res["errors"].append(f"batch {B}: {type(e).__name__}: {str(e)[:300]}")
            log(res["errors"][-1])
    for mode in modes:
        for B in batches:
            if (B, True) not in engines:
                continue
            pair = {c: engines[(B, c)] for c in (False, True)}
            try:
                with torch.inference_mode():  # as in generate: no recompilation for a new kind of tensor
                    tok = torch.randint(10, model.config.vocab_size, (B,), device=dev,
                                        generator=torch.Generator(device=dev).manual_seed(seed + 1))
                for ctx in contexts:
                    row = {"batch": B, "mode": mode, "context": ctx}
                    for compiled, eng in pair.items():
                        eng.set_attention(mode)
                        r = eng.runner
                        before = r.compile_stats["seconds"]
                        row["compiled_ms" if compiled else "eager_ms"] = round(eng.time_step(ctx - 1, reps), 3)
                        if compiled:
                            if r.compile_stats["seconds"] > before:
                                res["compile"].append({"batch": B, "mode": mode, "first_context": ctx,
                                                       "compile_s": round(r.compile_stats["seconds"] - before, 1)})
                            row["graphs_compiled"] = r.compile_stats["graphs"]
                            row["compiled_ok"] = r.compile
                            if r.compile_error:
                                row["compile_error"] = r.compile_error
                        if r.graph_error:
                            row["graph_error" + ("_compiled" if compiled else "")] = r.graph_error
                    row["speedup"] = round(row["eager_ms"] / row["compiled_ms"], 2)
                    S = pair[True]._bucket(ctx, s_max)
                    with torch.inference_mode():
                        pos = torch.full((B,), ctx - 1, device=dev)
                        a = pair[False].runner.decode(pair[False].cache, tok, pos, S, mode).clone()
                        b = pair[True].runner.decode(pair[True].cache, tok, pos, S, mode).clone()
                    row["logits_max_abs_diff"] = round(float((a - b).abs().max()), 4)
                    row["logits_max_abs"] = round(float(a.abs().max()), 3)
                    row["argmax_agree"] = round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 3)
                    res["rows"].append(row)
                    log(" ".join(f"{k}={v}" for k, v in row.items()))
                    if on_result:
                        on_result(res)
            except Exception as e:  # keep the other measurements
                res["errors"].append(f"batch {B} {mode}: {type(e).__name__}: {str(e)[:300]}")
                log(res["errors"][-1])
    if on_result:
        on_result(res)
    return res


def markdown_compile(res: dict) -> str:
    t = res["triton"]
    lines = [f"decode step eager vs compiled on {res['device']} (torch {res['torch']}, {res['shape']} shape, "
             f"{res['dtype']}, top-k {res['topk']}, backend {res['compile_backend']}; Triton sparse_decode: "
             f"{'yes' if t['sparse_decode'] else 'no'}, indexer_topk_decode: {'yes' if t['indexer_topk_decode'] else 'no'})",
             "", "| batch | attention | context | eager ms | compiled ms | speedup | logits max abs diff "
             "(max abs logit) | argmax agree |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(res["rows"], key=lambda r: (r["batch"], r["mode"], r["context"])):
        lines.append(f"| {r['batch']} | {r['mode']} | {r['context']} | {r['eager_ms']} | {r['compiled_ms']} | "
                     f"{r['speedup']}x | {r['logits_max_abs_diff']} ({r['logits_max_abs']}) | {r['argmax_agree']} |")
    if res["compile"]:
        lines += ["", "compile time (first call of each compiled variant): " + ", ".join(
            f"batch {c['batch']} {c['mode']} (first at {c['first_context']}): {c['compile_s']} s" for c in res["compile"])]
    for r in res["rows"]:
        for k in ("compile_error", "graph_error", "graph_error_compiled"):
            if r.get(k):
                lines.append(f"batch {r['batch']} {r['mode']} {r['context']}: {k}: {r[k]}")
    for e in res["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)
