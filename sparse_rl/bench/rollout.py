"""`sparse-rl bench rollout`: tokens/s of the rollout engine against HF `generate`, and sparse
against dense mode for long generations.

The model is built in code with random weights (no download): by default Qwen2-0.5B's shape
(hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied embeddings).
Sparse mode attaches freshly initialised indexers (what `sparse-rl convert` does), top-k 2048,
layers 0 and 1 dense. All runs sample (temperature 1, no top-k/top-p) and ignore EOS, so every
sequence generates exactly the requested tokens. Tokens/s = generated tokens / wall time of the
whole call (prefill included), synchronised; engine runs are timed after a warm-up that compiles
kernels and captures the CUDA graphs.

Floor, dense decode step (memory bound): the weights (~1 GB in bf16 for 0.5B) plus the live K/V
(B * context * 24 layers * 2 KV heads * 64 dims * 2 (K and V) * 2 bytes) per step. The sparse step
replaces the K/V term of the 22 sparse layers by the index keys (context * d_I * 2 bytes) plus the
top-k selected K/V rows, so it can only win where the K/V term dominates the weights.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from sparse_rl.errors import UsageError

SHAPES = {
    # hidden, layers, heads, kv heads, intermediate, vocab
    "qwen2-0.5b": (896, 24, 14, 2, 4864, 151936),
    "tiny": (64, 3, 4, 2, 128, 512),  # CPU smoke test of the benchmark itself
}


@dataclass
class BenchRolloutConfig:
    shape: str = "qwen2-0.5b"
    batch: int = 64
    prompt_len: int = 128
    new_tokens: int = 512
    hf: bool = True
    hf_new_tokens: int = 0  # 0 = new_tokens; HF's time per step barely depends on the step count
    eager: bool = True  # also time the engine without CUDA graphs
    long_new_tokens: list[int] = field(default_factory=lambda: [8192, 16384])
    long_batch: int = 16
    long_prompt_len: int = 128
    topk: int = 2048
    index_heads: int = 4
    index_dim: int = 64
    dtype: str = "bfloat16"
    device: str = "auto"
    seed: int = 0
    compile: bool | None = None  # torch.compile the engine's decode step; None = the engine's default (off; SPARSE_RL_COMPILE)

    def __post_init__(self):
        if self.shape not in SHAPES:
            raise UsageError(f"--shape {self.shape}: expected one of {', '.join(SHAPES)}")
        for name in ("batch", "prompt_len", "new_tokens", "long_batch", "long_prompt_len", "topk"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1")


def build_model(cfg: BenchRolloutConfig, device, dtype):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, inter, vocab = SHAPES[cfg.shape]
    conf = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=True,
                       max_position_embeddings=max(32768, cfg.long_prompt_len + max(cfg.long_new_tokens or [0]) + 1),
                       rope_theta=1e6, use_sliding_window=False, eos_token_id=None, bos_token_id=None)
    conf._attn_implementation = "sdpa"
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(conf)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_rollout_bench(cfg: BenchRolloutConfig, log=print, on_result=None) -> dict:
    import torch

    from sparse_rl.bench.timing import device_name
    from sparse_rl.devices import resolve_device, resolve_dtype
    from sparse_rl.rl.rollout import RolloutEngine, SamplingParams
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.ops import kernel
    from sparse_rl.sparse.patch import attach_sparse

    dev = torch.device(resolve_device(cfg.device))
    dtype = resolve_dtype(cfg.dtype, dev.type)
    model = build_model(cfg, dev, dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(cfg.seed)
    res: dict = {"config": dataclasses.asdict(cfg), "device": device_name(dev), "torch": torch.__version__,
                 "triton_decode_kernel": kernel("sparse_attention", "sparse_decode") is not None and dev.type == "cuda",
                 "rows": [], "errors": []}

    def record(row):
        res["rows"].append(row)
        log(" ".join(f"{k}={v}" for k, v in row.items()))
        if on_result:
            on_result(res)

    def prompts(B, L):
        return torch.randint(10, vocab, (B, L), generator=gen)

    def time_engine(eng, ids, new, label, mode, warm=True):
        eng.set_attention(mode)
        p = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=cfg.seed)
        toks = ids.tolist()
        if warm:  # compile kernels and capture every graph bucket this run will use
            eng.warmup(max(len(t) for t in toks) + new)
        _sync(dev)
        t0 = time.perf_counter()
        outs = eng.generate(toks, p)
        _sync(dev)
        dt = time.perf_counter() - t0
        n = sum(len(c.tokens) for c in outs)
        r = eng.runner
        return {"run": label, "mode": mode, "batch": len(toks), "prompt": len(toks[0]), "new_tokens": new,
                "seconds": round(dt, 3), "tokens_per_s": round(n / dt, 1), "ms_per_step": round(1000 * dt / new, 3),
                "cuda_graphs": r.use_graphs, "compiled": r.compile,
                **({"compile_s": round(r.compile_stats["seconds"], 1)} if r.compile else {}),
                **({"graph_error": r.graph_error} if r.graph_error else {}),
                **({"compile_error": r.compile_error} if r.compile_error else {})}

    # 1) engine vs HF generate, dense, same model and batch
    ids = prompts(cfg.batch, cfg.prompt_len)
    hf_new = cfg.hf_new_tokens or cfg.new_tokens
    if cfg.hf:
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
            record({"run": "hf_generate", "mode": "dense", "batch": cfg.batch, "prompt": cfg.prompt_len,
                    "new_tokens": hf_new, "seconds": round(dt, 3), "tokens_per_s": round(n / dt, 1),
                    "ms_per_step": round(1000 * dt / hf_new, 3), "cuda_graphs": False})
        except Exception as e:  # keep the other measurements
            res["errors"].append(f"hf_generate: {type(e).__name__}: {e}")
            log(res["errors"][-1])
    for graphs in ([True, False] if (cfg.eager and dev.type == "cuda") else [dev.type == "cuda"]):
        try:
            eng = RolloutEngine(model, None, max_batch=cfg.batch, max_seq_len=cfg.prompt_len + cfg.new_tokens,
                                device=dev, use_cuda_graphs=graphs, eos_token_ids=[], compile=cfg.compile)
            record(time_engine(eng, ids, cfg.new_tokens, "engine" if graphs or dev.type != "cuda" else "engine_eager",
                                     "dense"))
            del eng
        except Exception as e:
            res["errors"].append(f"engine (graphs={graphs}): {type(e).__name__}: {e}")
            log(res["errors"][-1])
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    # 2) sparse vs dense mode, long generations
    if cfg.long_new_tokens:
        attach_sparse(model, SparseConfig(topk=cfg.topk, index_heads=cfg.index_heads, index_dim=cfg.index_dim,
                                          rope_dim=min(32, cfg.index_dim), dense_layers=[0, 1],
                                          sink=min(4, cfg.topk // 4), window=min(64, cfg.topk // 4)))
        model.to(dtype)
        for new in cfg.long_new_tokens:
            ids = prompts(cfg.long_batch, cfg.long_prompt_len)
            eng = RolloutEngine(model, None, max_batch=cfg.long_batch, max_seq_len=cfg.long_prompt_len + new,
                                device=dev, eos_token_ids=[], compile=cfg.compile)
            for mode in ("dense", "sparse"):
                try:
                    row = time_engine(eng, ids, new, "long", mode)
                    row["step_ms_at_full_context"] = round(eng.time_step(cfg.long_prompt_len + new - 1), 3)
                    record(row)
                except Exception as e:
                    res["errors"].append(f"long {new} {mode}: {type(e).__name__}: {e}")
                    log(res["errors"][-1])
            del eng
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    res["summary"] = summarize(res["rows"])
    return res


def summarize(rows: list[dict]) -> dict:
    out = {}
    by = {(r["run"], r["mode"], r["new_tokens"]): r for r in rows}
    hf = next((r for r in rows if r["run"] == "hf_generate"), None)
    eng = next((r for r in rows if r["run"] == "engine"), None)
    if hf and eng:
        out["engine_vs_hf"] = round(eng["tokens_per_s"] / hf["tokens_per_s"], 1)
    for (run, mode, new), r in by.items():
        if run == "long" and mode == "sparse" and ("long", "dense", new) in by:
            d = by[("long", "dense", new)]
            out[f"sparse_vs_dense_{new}"] = round(r["tokens_per_s"] / d["tokens_per_s"], 2)
            if r.get("step_ms_at_full_context") and d.get("step_ms_at_full_context"):
                out[f"step_sparse_vs_dense_at_{new}"] = round(d["step_ms_at_full_context"] / r["step_ms_at_full_context"], 2)
    return out


def markdown_rollout(res: dict) -> str:
    lines = [f"rollout engine on {res['device']} (torch {res['torch']}; Triton decode kernel: "
             f"{'yes' if res['triton_decode_kernel'] else 'no, reference path'})", "",
             "| run | attention | batch | prompt | new tokens | seconds | tokens/s | ms/step | step ms at full context | CUDA graphs | compiled |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['run']} | {r['mode']} | {r['batch']} | {r['prompt']} | {r['new_tokens']} | {r['seconds']} | "
                     f"{r['tokens_per_s']} | {r['ms_per_step']} | {r.get('step_ms_at_full_context', '-')} | "
                     f"{'yes' if r['cuda_graphs'] else 'no'} | {'yes' if r.get('compiled') else 'no'} |")
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
