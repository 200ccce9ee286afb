"""Session 14 (lead), one device call for issues 14 and 15: two A/Bs, each in the same run as its baseline.

1. Issue 14, engine step: SiLU(gate) * up formed in the swap-AB down GEMM's x loads (`ModelRunner.fuse_silu`,
   one launch and one [B, 9728] write + read fewer a layer: 36 launches a step) against `ops.silu_mul` then the
   GEMM (today's default). Qwen3-4B shape, random bf16 weights, caches filled as `bench rollout` does; per row the
   step (graph replay, median of 20, `_Bench.step_row`), the two variants interleaved twice; first a proof that
   one eager step's logits are bitwise equal either way (dense and sparse, b32).
2. Issue 15, attention fwd+bwd at 32K on the trained indexer's selection: `auto` now may take union tiles of
   16 queries for the forward AND the tile dq when dk/dv is keyq (paths.plan(grad=True)); against the same with
   small_tiles off (session 13's default), keyq at 32-query tiles forced, keyq at 16 forced, and dense cuDNN;
   keyq2 (two-level lists, the helper's three-loop and split forms) at 16-query tiles; interleaved three times; the plan `auto` takes with its estimates; the 16-query grads against the 32-query
   ones (bf16, rel. difference) and, at 1,024 queries, against the fp32 reference; the forward alone (auto,
   prefill) as a regression row.

Predictions (before the call): silu fused -0.05..-0.12 ms a step at b32 (36 x ~2-3 us launch + the 0.6 MB
round trip), -0.03..-0.08 at b1; attention: auto with halves ~33 ms vs ~36.2 (session 13 helper bwd13: keyq with
16-query tiles 33.22 vs auto 36.18), dq 7.9 vs 9.4 ms inside it.

Ran at b1fe184 (results/2026-12-03-h200-main-session14.md). Both losers were reverted after it (1b8e943 keyq2,
c3c6765 fuse_silu), so at later commits the engine part and the keyq2 variants fail (recorded as errors): check out
b1fe184 to rerun them.

    PYTHONPATH=$PWD python benchmarks/gpu_lead_session14.py --budget 420
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_lead_session14.py --cpu-smoke --budget 600
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run, dense_times, log, trained_indexer  # noqa: E402

import rollout_harness as rh  # noqa: E402


def silu_proof(run, eng, B: int, ctx: int) -> None:
    import torch

    cache = eng._ensure_cache(ctx)
    tok = torch.randint(0, eng.runner.vocab, (B,), device=eng.device)
    pos = torch.full((B,), ctx - 1, device=eng.device)
    S = eng._bucket(ctx, cache.s_max)
    for mode in ("dense", "sparse"):
        eng.set_attention(mode)
        out = {}
        with torch.inference_mode():
            for on in (False, True):
                eng.runner.set_fuse_silu(on)
                out[on] = eng.runner.decode_eager(cache, tok, pos, S, mode).float()
        eng.runner.set_fuse_silu(False)
        eq = bool(torch.equal(out[True], out[False]))
        run.res.setdefault("silu_proof", {})[mode] = {"bitwise": eq,
                                                      "max_abs": float((out[True] - out[False]).abs().max())}
        log(f"silu proof b{B} {mode} {ctx}: bitwise {eq}")


def engine_part(run, a) -> None:
    from sparse_rl.bench.rollout import BenchRolloutConfig, _Bench

    if a.cpu_smoke:
        cfg = BenchRolloutConfig(shape="tiny-qwen3", hf=False, topk=24, index_heads=2, index_dim=16, device="cpu",
                                 dtype="float32")
        plan = {3: (64, [("dense", 20), ("sparse", 60)]), 1: (64, [("dense", 40)])}
    else:
        cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, topk=2048, index_heads=4, index_dim=64)
        plan = {32: (16640, [("dense", 2048), ("sparse", 2304), ("sparse", 16384), ("dense", 16384)]),
                1: (16640, [("dense", 2048), ("dense", 16384), ("sparse", 16384)])}
    b = _Bench(cfg, log, None)
    b.attach_sparse()
    rows = run.res.setdefault("silu_steps", [])
    for B, (top, items) in plan.items():
        if not run.gate(40, f"engine b{B}"):
            break
        eng = b.engine(B, top)
        eng.set_attention("sparse")  # the cache gets (random) index keys only when allocated in sparse mode
        b.fill(eng, top)
        eng.runner.set_skinny_gemm(True, "swapab")  # on the CPU smoke (the H200's default already)
        log(f"b{B}: pdl {eng.runner.pdl} skinny {sorted(eng.runner.skinny_gemm)} {eng.runner.skinny_impl}")
        if B == max(plan):
            run.guarded("silu proof", silu_proof, run, eng, B, items[1][1])
        for mode, ctx in items:
            if not run.gate(10, f"b{B} {mode} {ctx}"):
                break
            row = {"batch": B, "mode": mode, "context": ctx}
            for on in (False, True, False, True):
                eng.runner.set_fuse_silu(on)
                r = b.step_row(eng, B, ctx, mode)
                row.setdefault("fused" if on else "default", []).append(r["ms"])
                row["floor_ms"] = r["floor_ms"]
            eng.runner.set_fuse_silu(False)
            row["delta_ms"] = round((sum(row["fused"]) - sum(row["default"])) / 2, 4)
            rows.append(row)
            log(f"b{B} {mode} {ctx}: default {row['default']} fused {row['fused']} delta {row['delta_ms']} "
                f"(floor {row['floor_ms']})")
            run.save()
        del eng
        rh.free()


def attention_part(run, a) -> None:
    import torch

    from sparse_rl.bench import patterns
    from sparse_rl.bench.timing import bench_ms, rel_err
    from sparse_rl.sparse.ops.sparse_attention import paths
    from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention, sparse_attention_forward

    dev = torch.device("cpu" if a.cpu_smoke else "cuda")
    B, H, Hkv, D = 1, 32, 8, 128
    L, K = (512, 64) if a.cpu_smoke else (32768, 2048)
    if a.cpu_smoke:
        H, Hkv, D = 8, 2, 32
    dt = torch.float32 if a.cpu_smoke else torch.bfloat16
    W = dict(warmup_ms=1 if a.cpu_smoke else 10, rep_ms=1 if a.cpu_smoke else 200)
    ix, kl, gen = trained_indexer(dev, 0, 4, 64, 2 if a.cpu_smoke else 200)
    trained = patterns.trained_selection(ix, L, K, dev, gen)
    run.res["trained_indexer_kl"] = kl
    q, k, v = (torch.randn(B, L, h, D, device=dev, generator=gen).to(dt) for h in (H, Hkv, Hkv))
    g_out = torch.randn(B, L, H, D, device=dev, generator=gen).to(dt)
    pl = paths.plan(trained, L, Hkv, 32, is_cuda=True, small_tiles=True, grad=True)
    run.res["auto_plan"] = {"fwd": pl.fwd, "bwd": pl.bwd, "dq": pl.dq, "bt": pl.bt,
                            "estimate_ms": {n: round(x, 3) for n, x in pl.estimate_ms.items()}}
    log(f"auto plan (grad): {run.res['auto_plan']}")
    # proofs: 16-query keyq grads vs the fp32 reference at 1,024 queries, and vs the 32-query ones at L
    n = 256 if a.cpu_smoke else 1024
    sub = trained[:, :n].clone()
    sub[sub >= n] = -1

    def grads(qq, kk, vv, idx, go, fn):
        qs, ks, vs = (x.detach().clone().requires_grad_() for x in (qq, kk, vv))
        o, _ = fn(qs, ks, vs, idx)
        o.backward(go)
        return o, qs.grad, ks.grad, vs.grad

    small = dict(fwd_path="tile", bwd_path="keyq", tune={"bt": 16})
    got = grads(q[:, :n], k[:, :n], v[:, :n], sub, g_out[:, :n], lambda x, y, z, i: sparse_attention(x, y, z, i, **small))
    ref = grads(q[:, :n].float(), k[:, :n].float(), v[:, :n].float(), sub, g_out[:, :n].float(),
                lambda x, y, z, i: sparse_attention_naive(x, y, z, i))
    run.res["proof_bt16_vs_fp32"] = {nm: rel_err(x, y) for nm, x, y in zip(("o", "dq", "dk", "dv"), got, ref)}
    g16 = grads(q, k, v, trained, g_out, lambda x, y, z, i: sparse_attention(x, y, z, i, **small))
    g32 = grads(q, k, v, trained, g_out, lambda x, y, z, i: sparse_attention(x, y, z, i, fwd_path="tile",
                                                                             bwd_path="keyq",
                                                                             tune={"small_tiles": False}))
    run.res["proof_bt16_vs_bt32"] = {nm: rel_err(x, y) for nm, x, y in zip(("o", "dq", "dk", "dv"), g16, g32)}
    log(f"proofs: vs fp32 {run.res['proof_bt16_vs_fp32']}; 16 vs 32 at L {run.res['proof_bt16_vs_bt32']}")
    del g16, g32
    run.save()
    if not a.cpu_smoke and run.gate(25, "dense"):
        run.res["dense"] = run.guarded("dense", dense_times, q, k, v, dev, W, True)
        log(f"dense {run.res['dense']}")
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    variants = {"auto": dict(),
                "auto_no_small": dict(tune={"small_tiles": False}),
                "keyq_bt32": dict(fwd_path="tile", bwd_path="keyq", tune={"small_tiles": False}),
                "keyq_bt16": dict(fwd_path="tile", bwd_path="keyq", tune={"bt": 16}),
                "keyq2_bt16": dict(fwd_path="tile", bwd_path="keyq2", tune={"bt": 16}),
                "keyq2_split_bt16": dict(fwd_path="tile", bwd_path="keyq2", tune={"bt": 16, "keyq2": (64, 128, 8, 3, 1)})}
    rows = run.res.setdefault("fwdbwd_ms", {})
    for rep in range(3):
        for name, kw in variants.items():
            if not run.gate(8, f"fwdbwd {name} {rep}"):
                break
            fn = (lambda kw=kw: sparse_attention(qg, kg, vg, trained, **kw)[0].backward(g_out))
            ms = run.guarded(name, bench_ms, fn, dev, grad_to_none=[qg, kg, vg], **W)
            rows.setdefault(name, []).append(ms)
            log(f"fwdbwd {name} rep {rep}: {ms} ms")
            run.save()
    if run.gate(6, "forward auto"):
        run.res["fwd_auto_ms"] = run.guarded("fwd", bench_ms, lambda: sparse_attention_forward(q, k, v, trained),
                                             dev, **W)
        run.res["fwd_auto_plan_bt"] = sparse_attention_forward(q, k, v, trained)[2].bt
        log(f"forward auto {run.res['fwd_auto_ms']} ms, bt {run.res['fwd_auto_plan_bt']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "lead14"))
    ap.add_argument("--budget", type=float, default=420.0)
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--parts", default="engine,attention")
    a = ap.parse_args()
    import torch

    run = Run(a.out, "lead14.json", a.budget, {"commit": a.commit, "torch": torch.__version__})
    if "attention" in a.parts:
        run.guarded("attention", attention_part, run, a)
        run.save()
        rh.free()
    if "engine" in a.parts:
        run.guarded("engine", engine_part, run, a)
    run.save()
    for r in run.res.get("silu_steps", []):
        print(f"| {r['batch']} | {r['mode']} | {r['context']} | {r['default']} | {r['fused']} | {r['delta_ms']} |")
    print(run.res.get("fwdbwd_ms"))


if __name__ == "__main__":
    main()
