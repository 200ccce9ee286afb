"""GPU evidence for `sparse-rl indexer train` (issue 5). Run from the repo root:

    PYTHONPATH=. python benchmarks/results/indexer_bench.py --out OUTDIR          # H200
    PYTHONPATH=. python benchmarks/results/indexer_bench.py --out /tmp/x --quick  # CPU smoke test
    PYTHONPATH=. python benchmarks/results/indexer_bench.py --out OUTDIR --parts A --kl-impls torch,triton
        # part A for both warm-up loss implementations, with an agreement check at the first length
    PYTHONPATH=. python benchmarks/results/indexer_bench.py --out OUTDIR --parts AK --kl-impls torch,triton \
        --time-impls torch@8192,triton   # agreement, then time torch at 8K only; then the kernel sweep

Part A: warm-up step time and peak memory on a Qwen2-0.5B-shaped model (random bf16 weights, built
in code) at 8K and 32K tokens, against a plain dense forward of the same batch (the decoder stack,
which is what the warm-up runs too; the LM head is not needed by either). The warm-up step is timed
twice: as a training run executes it between log steps (no top-k: attn_recall is not measured) and as
on a logged step (top-k selection + sparse-attention lse per layer for attn_recall).
Part K: the fused warm-up KL kernels alone on one layer's random bf16 inputs (Qwen2-0.5B shape) at the
last length: (BLOCK_M, BLOCK_N, num_warps, num_stages) configurations, each checked against the
default one; the dense attention with and without its log-sum-exp; the top-k of a logged step.
Part B: a small qwen2 model pretrained (dense) on the synthetic retrieval source for a fixed wall
time, converted with k = L/8, indexer warm-up, then the sparse stage; attn_recall / KL / oracle
recall and LM loss dense vs sparse on held-out synthetic rows, before and after each stage.
Every number is written to OUTDIR/indexer_bench.json as soon as it exists.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

RESULTS: dict = {}
T0 = time.perf_counter()


def dump(out: Path) -> None:
    (out / "indexer_bench.json").write_text(json.dumps(RESULTS, indent=2))


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> tuple[float, list[float]]:
    fn()  # warm-up: Triton compilation, allocator, cuBLAS handles
    ts = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), ts


def peak_gb(fn) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    sync()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return torch.cuda.max_memory_allocated() / 2**30


def part_a(out: Path, quick: bool, device: str, impls: list[str], time_impls: list[str]) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.patch import attach_sparse
    from sparse_rl.sparse.train.hooks import StepStats, capture_dense, indexed_attention, warmup_forward

    def timed_here(impl: str, L: int) -> bool:  # "--time-impls torch@8192,triton": torch at 8192 only
        return any(x == impl or x == f"{impl}@{L}" for x in time_impls)

    if quick:
        shape = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2)
        lengths, sc = [256, 512], SparseConfig(topk=64, index_heads=2, index_dim=16, rope_dim=8, sink=4, window=16)
        dtype = torch.float32
    else:  # Qwen2-0.5B
        shape = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2)
        lengths, sc = [8192, 32768], SparseConfig(topk=2048, index_heads=4, index_dim=64, rope_dim=32, sink=4,
                                                  window=64, dense_layers=[0, 1])
        dtype = torch.bfloat16
    cfg = Qwen2Config(**shape, max_position_embeddings=max(lengths), tie_word_embeddings=True,
                      use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    if device == "cuda":
        # as `indexer train` does (trainer.run): the KL target's fp32 matmuls in tf32. The 2026-11-29
        # numbers were measured before this line existed, i.e. with full-fp32 matmuls.
        torch.set_float32_matmul_precision("high")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    attach_sparse(model, sc)
    model.requires_grad_(False)
    idx_params = [p for m in indexed_attention(model) for p in m.indexer.parameters()]
    for p in idx_params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(idx_params, lr=1e-3)
    n_layers = len(indexed_attention(model))
    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    RESULTS["A"] = {"model": "Qwen2-0.5B shape" if not quick else "quick", "params_M": sum(
        p.numel() for p in model.parameters()) / 1e6, "indexer_params_M": sum(p.numel() for p in idx_params) / 1e6,
        "weights_gb": weights_gb, "sparse": sc.__dict__, "dtype": str(dtype), "rows": []}
    for L in lengths:
        ids = torch.randint(0, shape["vocab_size"], (1, L), device=device)

        def dense():
            with torch.no_grad():
                model.model(input_ids=ids, use_cache=False)

        def warm(impl, recall):
            st = StepStats(ids.device)
            warmup_forward(model, ids, st, 1.0 / (n_layers * L), impl=impl, measure_recall=recall)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return st

        if len(impls) > 1 and L == lengths[0]:  # the implementations agree here, on the GPU (no step taken)
            chk = {}
            for impl in impls:
                st = StepStats(ids.device)
                warmup_forward(model, ids, st, 1.0 / (n_layers * L), impl=impl)
                chk[impl] = {"kl": float(st.v[0] / st.v[1]), "recall": float(st.v[2] / st.v[3]),
                             "grads": [p.grad.float().clone() for p in idx_params]}
                opt.zero_grad(set_to_none=True)
            a, b = chk[impls[0]], chk[impls[1]]
            rel = max(float((x - y).norm() / y.norm().clamp_min(1e-30)) for x, y in zip(b["grads"], a["grads"]))
            # the forward itself is unchanged when the attention runs through flash to hand out its lse
            with torch.no_grad():
                plain = model.model(input_ids=ids, use_cache=False).last_hidden_state
                with capture_dense(model, lambda *a: None, lse=True):
                    capt = model.model(input_ids=ids, use_cache=False).last_hidden_state
            RESULTS["A"]["agreement"] = {"L": L, "impls": impls[:2], "kl": [a["kl"], b["kl"]],
                                         "recall": [a["recall"], b["recall"]], "max_rel_grad_diff": rel,
                                         "capture_lse_forward_max_abs_diff": float((plain - capt).abs().max()),
                                         "forward_max_abs": float(plain.abs().max())}
            from sparse_rl.sparse.ops.indexer_kl import triton as kl_triton
            # the lse kernel choice is no longer a module global (train/hooks.AttentionWithLse, per run)
            RESULTS["A"]["kl_triton_configs"] = {"fused": kl_triton.FUSED_CONFIG, "index_lse": kl_triton.INDEX_LSE_CONFIG}
            print(f"[A] agreement at L={L}: {RESULTS['A']['agreement']}", flush=True)
        reps = 3 if L <= 8192 else 2
        t_dense, ts_d = timed(dense, reps + 2)
        m_dense = peak_gb(dense)
        for impl in impls:
            if not timed_here(impl, L):
                continue
            for recall in (False, True):
                t_warm, ts_w = timed(lambda: warm(impl, recall), reps)
                m_warm = peak_gb(lambda: warm(impl, recall))
                row = {"L": L, "kl_impl": impl, "logged_step": recall, "dense_forward_s": t_dense,
                       "warmup_step_s": t_warm, "ratio": t_warm / t_dense, "dense_peak_gb": m_dense,
                       "warmup_peak_gb": m_warm, "dense_times": ts_d, "warmup_times": ts_w}
                RESULTS["A"]["rows"].append(row)
                dump(out)
                print(f"[A] L={L} {impl} {'logged' if recall else 'unlogged'} step: dense {t_dense * 1e3:.1f} ms, "
                      f"warm-up step {t_warm * 1e3:.1f} ms ({t_warm / t_dense:.2f}x), peak {m_dense:.2f} / "
                      f"{m_warm:.2f} GiB", flush=True)
    del model, opt
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def part_k(out: Path, quick: bool, device: str, deadline: float) -> None:
    import triton

    from sparse_rl.sparse.ops import indexer_topk
    from sparse_rl.sparse.ops.indexer_kl import triton as kl_triton
    from sparse_rl.sparse.ops.indexer_kl.triton import warmup_kl_fused

    L = 64 if quick else 32768
    H, HKV, D, HI, DI = (4, 2, 16, 2, 16) if quick else (14, 2, 64, 4, 64)
    dt = torch.float32 if quick else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=device) * s).to(dt)

    q, k, v = rnd(1, H, L, D, s=2.0), rnd(1, HKV, L, D, s=2.0), rnd(1, HKV, L, D)
    qi, w, ki = rnd(1, L, HI, DI), rnd(1, L, HI, s=0.5), rnd(1, L, DI)
    scale = D ** -0.5
    K = RESULTS["K"] = {"L": L, "H": H, "H_kv": HKV, "D": D, "H_I": HI, "D_I": DI, "dtype": str(dt),
                        "default_config": kl_triton.FUSED_CONFIG, "default_index_config": kl_triton.INDEX_LSE_CONFIG}

    def bench(fn):
        fn()
        sync()
        if quick:
            return timed(fn, 2)[0] * 1e3
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    lse = None
    if device == "cuda":
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        K["sdpa_ms"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True))
        K["flash_with_lse_ms"] = bench(lambda: flash(q, k, v, 0.0, True, False, scale=scale))
        try:
            from sparse_rl.sparse.train.hooks import _cudnn
            K["cudnn_with_lse_ms"] = bench(lambda: _cudnn(q, k, v, scale))
            fo, fl = flash(q, k, v, 0.0, True, False, scale=scale)[:2]
            co, cl = _cudnn(q, k, v, scale)
            K["cudnn_vs_flash"] = {"out_max_abs": float((co.float() - fo.float()).abs().max()),
                                   "lse_max_abs": float((cl.float() - fl[:, :, :L].float()).abs().max()),
                                   "lse_shapes": [list(cl.shape), list(fl.shape)]}
        except Exception as e:
            K["cudnn_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"[K] cudnn: {K.get('cudnn_with_lse_ms')} ms {K.get('cudnn_vs_flash')} {K.get('cudnn_error', '')}",
              flush=True)
        lse = flash(q, k, v, 0.0, True, False, scale=scale)[1][:, :, :L].contiguous()
        print(f"[K] attention at L={L}: sdpa {K['sdpa_ms']:.2f} ms, flash with lse {K['flash_with_lse_ms']:.2f} ms",
              flush=True)
    ref = warmup_kl_fused(q, k, qi, w, ki, scale=scale, grad_scale=1.0, lse=lse)
    if lse is not None:
        own = warmup_kl_fused(q, k, qi, w, ki, scale=scale, grad_scale=1.0)[1]
        K["flash_lse_vs_kernel_lse_max_abs"] = float((own - lse).abs().max())
        K["dense_lse_pass_ms"] = bench(lambda: warmup_kl_fused(q, k, qi, w, ki, scale=scale, grad_scale=1.0)) - \
            bench(lambda: warmup_kl_fused(q, k, qi, w, ki, scale=scale, grad_scale=1.0, lse=lse))
    K["topk_ms"] = bench(lambda: indexer_topk(qi, w, ki, 2048 if not quick else 32, sink=4, window=64 if not quick else 8))
    dump(out)
    K["configs"] = []
    cfgs = [kl_triton.FUSED_CONFIG, (64, 64, 8, 1), (32, 64, 4, 1), (64, 32, 4, 1)]
    idx_cfgs = [kl_triton.INDEX_LSE_CONFIG, (128, 64, 8, 2)]
    if quick:  # the interpreter: two small configurations are enough to exercise the code
        cfgs, idx_cfgs = [(16, 16, 4, 1), (16, 32, 4, 1)], [(32, 16, 4, 1)]
    runs = [("fused", c) for c in cfgs] + [("index_lse", c) for c in idx_cfgs]
    for kind, c in runs:
        if time.perf_counter() - T0 > deadline:
            K["configs"].append({"skipped_from": [kind, c], "reason": "deadline"})
            break
        kw = {"config": c} if kind == "fused" else {"index_config": c}
        try:
            kl, _, gr = warmup_kl_fused(q, k, qi, w, ki, scale=scale, grad_scale=1.0, lse=lse, **kw)
            diff = max([float((kl.sum() - ref[0].sum()).abs() / ref[0].sum().abs())] +
                       [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(gr, ref[2])])
            ms = bench(lambda: warmup_kl_fused(q, k, qi, w, ki, scale=scale, grad_scale=1.0, lse=lse, **kw))
            row = {"pass": kind, "config": c, "ms": ms, "max_rel_diff_vs_default": diff}
        except Exception as e:  # a config the compiler rejects (shared memory, registers): recorded, not fatal
            row = {"pass": kind, "config": c, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        K["configs"].append(row)
        dump(out)
        print(f"[K] {row}", flush=True)
    # the fastest configurations become the defaults for the rest of this run (part A)
    for kind, name in (("fused", "FUSED_CONFIG"), ("index_lse", "INDEX_LSE_CONFIG")):
        ok = [r for r in K["configs"] if r.get("pass") == kind and "ms" in r and r["max_rel_diff_vs_default"] < 1e-2]
        if ok:
            setattr(kl_triton, name, tuple(min(ok, key=lambda r: r["ms"])["config"]))
    K["chosen"] = {"fused": kl_triton.FUSED_CONFIG, "index_lse": kl_triton.INDEX_LSE_CONFIG}
    K["chosen_ms"] = bench(lambda: warmup_kl_fused(q, k, qi, w, ki, scale=scale, grad_scale=1.0, lse=lse))
    print(f"[K] chosen {K['chosen']}: {K['chosen_ms']:.2f} ms per layer (with lse given)", flush=True)
    dump(out)


def pretrain(model, data, batch: int, seconds: float, max_steps: int, lr: float, device: str) -> dict:
    """Plain dense LM training for a fixed wall time (setup for part B, not the stage under test)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    t0, step, losses = time.perf_counter(), 0, []
    while step < max_steps and time.perf_counter() - t0 < seconds:
        ids = data.rows(step * batch, batch).to(device)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 50)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
    model.eval()
    return {"steps": step, "seconds": time.perf_counter() - t0, "first_loss": losses[0],
            "last_loss": statistics.mean(losses[-10:])}


def part_b(out: Path, quick: bool, device: str, pre_seconds: float, over: dict | None = None) -> None:
    """`over` (from --b-* flags) replaces the defaults: size, seq_len, batch, rows, lr, warmup_steps, sparse."""
    from transformers import AutoModelForCausalLM

    from sparse_rl.modelinit import ModelInitConfig, init_model
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.convert import ConvertConfig, convert
    from sparse_rl.sparse.loader import load_model, load_tokenizer
    from sparse_rl.sparse.train.data import build_data, synthetic_rows
    from sparse_rl.sparse.train.hooks import evaluate
    from sparse_rl.sparse.train.trainer import IndexerTrainConfig, run

    root = Path("/tmp/indexer_bench_b")
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    over = {k: v for k, v in (over or {}).items() if v is not None}
    L = over.get("seq_len", 256 if quick else 2048)
    k = L // 8
    size = over.get("size", "tiny" if quick else "small")
    batch = over.get("batch", 2 if quick else 16)
    init_model(root / "dense", ModelInitConfig(arch="qwen2", size=size, seed=0, max_position_embeddings=4 * L))
    tok = load_tokenizer(root / "dense")
    data = build_data("synthetic", tok, L, seed=0, synthetic_n=over.get("rows", 64 if quick else 1024))
    held = synthetic_rows(tok, 2 if quick else 8, L, seed=4242)
    R = RESULTS["B"] = {"model": size, "L": L, "k": k}
    model = AutoModelForCausalLM.from_pretrained(root / "dense", dtype=torch.float32).to(device)
    R["settings"] = {"size": size, "seq_len": L, "batch": batch, "rows": len(data),
                     "pretrain_seconds": pre_seconds, "pretrain_lr": over.get("lr", 1e-3), "threads": torch.get_num_threads()}
    R["pretrain"] = pretrain(model, data, batch, pre_seconds, 20 if quick and "seq_len" not in over else 10**6,
                             over.get("lr", 1e-3), device)
    model.save_pretrained(root / "pre")
    tok.save_pretrained(root / "pre")
    dump(out)
    print(f"[B] pretrain: {R['pretrain']}", flush=True)
    sc = SparseConfig(topk=k, index_heads=4, index_dim=32 if not quick else 16, rope_dim=16 if not quick else 8,
                      sink=4, window=8 if quick else 32, dense_layers=[0])
    convert(root / "pre", root / "sparse", ConvertConfig(sparse=sc, seed=0))

    def ev(path, tag):
        m = load_model(path, device=device, dtype="float32")
        r = evaluate(m, held.to(device))
        R[tag] = r
        dump(out)
        print(f"[B] {tag}: kl {r['kl']:.4f} recall {r['attn_recall']:.4f} oracle {r['oracle_recall']:.4f} "
              f"lm dense {r['lm_loss_dense']:.4f} sparse {r['lm_loss_sparse']:.4f}", flush=True)
        del m

    ev(root / "sparse", "before_warmup")
    steps_w = over.get("warmup_steps", 10 if quick else 300)
    t = time.perf_counter()
    s = run(IndexerTrainConfig(model=str(root / "sparse"), out=str(root / "warm"), data="synthetic", stage="warmup",
                               seq_len=L, batch_size=batch // 2, steps=steps_w, lr=2e-3, lr_warmup=10,
                               synthetic_rows=64 if quick else 1024, device=device, dtype="float32",
                               save_every=10**6, log_every=25))
    R["warmup_run"] = {"steps": steps_w, "seconds": time.perf_counter() - t, "last": s["last"]}
    ev(root / "warm", "after_warmup")
    if over.get("sparse", 1) == 0:
        return
    steps_s = 10 if quick else 150
    t = time.perf_counter()
    s = run(IndexerTrainConfig(model=str(root / "warm"), out=str(root / "sparse_ft"), data="synthetic",
                               stage="sparse", finetune="full", seq_len=L, batch_size=batch // 2, steps=steps_s,
                               lr=1e-3, model_lr=3e-4, lr_warmup=10, synthetic_rows=64 if quick else 1024,
                               device=device, dtype="float32", save_every=10**6, log_every=25))
    R["sparse_run"] = {"steps": steps_s, "seconds": time.perf_counter() - t, "last": s["last"]}
    ev(root / "sparse_ft", "after_sparse")
    # control: the same sparse stage (code, data, LR schedule, steps) with k = L, i.e. dense attention
    t = time.perf_counter()
    s = run(IndexerTrainConfig(model=str(root / "warm"), out=str(root / "dense_ft"), data="synthetic",
                               stage="sparse", finetune="full", seq_len=L, batch_size=batch // 2, steps=steps_s,
                               lr=1e-3, model_lr=3e-4, lr_warmup=10, synthetic_rows=64 if quick else 1024, topk=L,
                               device=device, dtype="float32", save_every=10**6, log_every=25))
    R["dense_control_run"] = {"steps": steps_s, "seconds": time.perf_counter() - t, "last": s["last"]}
    m = load_model(root / "dense_ft", device=device, dtype="float32")
    with torch.no_grad():
        hl = held.to(device)
        R["dense_control_heldout_lm_loss"] = statistics.mean(
            float(m(input_ids=hl[i:i + 1], labels=hl[i:i + 1], use_cache=False).loss) for i in range(len(hl)))
    dump(out)
    print(f"[B] k=L control: held-out LM loss {R['dense_control_heldout_lm_loss']:.4f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="AB")
    ap.add_argument("--pretrain-seconds", type=float, default=35.0)
    ap.add_argument("--kl-impls", default="torch", help="part A: comma-separated warm-up loss implementations")
    ap.add_argument("--time-impls", default="", help="part A: the ones to time (IMPL or IMPL@LENGTH); "
                    "default: all of --kl-impls")
    ap.add_argument("--deadline", type=float, default=1e9, help="part K starts no configuration after this many "
                    "seconds of the run")
    ap.add_argument("--b-size", default=None, help="part B: model preset (default small; tiny with --quick)")
    ap.add_argument("--b-seq-len", type=int, default=None)
    ap.add_argument("--b-batch", type=int, default=None)
    ap.add_argument("--b-rows", type=int, default=None, help="part B: distinct synthetic training rows")
    ap.add_argument("--b-lr", type=float, default=None, help="part B: pretraining learning rate")
    ap.add_argument("--b-warmup-steps", type=int, default=None)
    ap.add_argument("--b-sparse", type=int, default=None, help="part B: 0 skips the sparse stage and its control")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    RESULTS["env"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    import transformers
    RESULTS["env"]["transformers"] = transformers.__version__
    impls = args.kl_impls.split(",")
    time_impls = args.time_impls.split(",") if args.time_impls else impls
    for name, fn in (("K", lambda: part_k(out, args.quick, device, args.deadline)),
                     ("A", lambda: part_a(out, args.quick, device, impls, time_impls)),
                     ("B", lambda: part_b(out, args.quick, device, args.pretrain_seconds,
                                          {"size": args.b_size, "seq_len": args.b_seq_len, "batch": args.b_batch,
                                           "rows": args.b_rows, "lr": args.b_lr,
                                           "warmup_steps": args.b_warmup_steps, "sparse": args.b_sparse}))):
        if name not in args.parts:
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception:
            RESULTS[f"{name}_error"] = traceback.format_exc()
            print(RESULTS[f"{name}_error"], flush=True)
        RESULTS[f"{name}_seconds"] = time.perf_counter() - t
        dump(out)
    print(json.dumps({k: v for k, v in RESULTS.items() if not k.endswith("error")}, indent=1)[:6000])


if __name__ == "__main__":
    main()
