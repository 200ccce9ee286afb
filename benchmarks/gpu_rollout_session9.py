"""Session 9 device run (issue 14), on the shared harness (granular_harness.Run + rollout_harness): the `fine`
decode select with its sub-bin compaction over only the chunks that hold the sub-bin's keys (decode_fine.py),
alone against the chunked / row forms and in the step; fp8 index keys (time and selection overlap vs bf16);
batch-1 steps vs their floor; the profile's kernel count; whole generations with the best variant.

    PYTHONPATH=$PWD python benchmarks/gpu_rollout_session9.py --budget 140 --call 1 --commit SHA     (H200)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_rollout_session9.py --cpu-smoke --budget 900

Every phase is gated on the time LEFT of --budget (its estimate in NEED), every row inside on a few seconds,
and the JSON is rewritten after each row: a cut-off run keeps what it measured. Writes
$OUT/roll9/session9_call<N>.json and .log. Variants are `rollout_harness.Variant`s (the runner's
`decode_select` / `qkv_pad` arguments; no module globals).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import rollout_harness as rh  # noqa: E402
from granular_harness import Run, log  # noqa: E402
from sparse_rl.sparse.ops.indexer_topk.decode_select import DecodeSelect  # noqa: E402

V = rh.Variant
VARIANTS = {"base": V(), "autofine": V(DecodeSelect(long="fine")), "fine": V(DecodeSelect("fine")),
            "fine4k": V(DecodeSelect(row_max_keys=4096, long="fine"))}
# estimated device seconds of each phase (session 8's measured costs, scaled to this call's rows)
NEED = {"setup": 14, "select_check": 6, "alone": 14, "steps": 16, "profile": 8, "batch1": 14, "fp8": 16,
        "whole_16k_b32": 30, "whole_32k_b16": 24}


def select_check(dev, smoke) -> dict:
    """The select alone == the reference: integer inputs (exact scores, heavy ties) for chunked / fine / fine
    cap 2 (its radix fallback), and random bf16 rows (fine), in the sizes the step never reaches on a CPU."""
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive

    dt = torch.float32 if smoke else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(10)
    B, S, K = (3, 200, 24) if smoke else (4, 3000, 512)
    q = torch.randint(-2, 3, (B, 4, 64), device=dev, generator=g).to(dt)
    w = torch.randint(-1, 3, (B, 4), device=dev, generator=g).to(dt)
    k = torch.randint(-2, 3, (B, S, 64), device=dev, generator=g).to(dt)
    pos = torch.tensor([S - 1, S // 2, K // 2, S - 7][:B], device=dev)
    ref = indexer_topk_decode_naive(q.float(), w.float(), k.float(), pos, K, sink=2, window=4)
    out = {"ints": {n: bool(torch.equal(itd.indexer_topk_decode(q, w, k, pos, K, impl=i, sink=2, window=4, **x), ref))
                    for n, i, x in (("chunked", "chunked", {}), ("fine", "fine", {}),
                                    ("fine_cap2", "fine", {"fine_cap": 2}))}}
    B, S, K, win = (2, 300, 40, 8) if smoke else (8, 20000, 2048, 64)
    q, w = torch.randn(B, 4, 64, device=dev, generator=g).to(dt), torch.randn(B, 4, device=dev, generator=g).to(dt)
    k = torch.randn(B, S, 64, device=dev, generator=g).to(dt)
    pos = torch.randint(K, S, (B,), device=dev, generator=g)
    pos[0] = S - 1
    ref = indexer_topk_decode_naive(q.float(), w.float(), k.float(), pos, K, sink=4, window=win)
    got, n2 = itd.indexer_topk_decode(q, w, k, pos, K, impl="fine", candidates=True, sink=4, window=win)
    out["random_fine"] = bool(torch.equal(got, ref))
    out["random_fine_sub_bin_keys"] = n2.tolist()
    for cb in (32, 64):
        out[f"random_fine_cb{cb}"] = bool(torch.equal(rh.fine_with(q, w, k, pos.to(torch.int32), K, 4, win, cb=cb), ref))
    log(f"select == reference: {out}")
    return out


def alone(run, b, eng, ctxs, smoke) -> dict:
    """Score + select alone on the engine's layer-2 index cache (`[:, :ctx]`, all rows at ctx - 1), graph-timed,
    against the index keys' bytes: chunked / row / fine, fine with 32- and 64-slot compaction steps, the score
    pass alone, and fp8 keys (the same keys quantized: time, and the selection's overlap with bf16's)."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import quantize_index_keys
    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk.decode_fine import fine_chunk

    cache = eng._ensure_cache(max(ctxs))
    dev, K, B = eng.device, b.cfg.topk, eng.max_batch
    HI, DI = b.cfg.index_heads, b.cfg.index_dim
    sink, win = min(4, K // 4), min(64, K // 4)
    res = {}
    g = torch.Generator(device=dev).manual_seed(3)
    for ctx in ctxs:
        if not run.gate(4, f"alone {ctx}"):
            break
        view = cache.idx[2][:, :ctx]
        qi = torch.randn(B, HI, DI, device=dev, generator=g).to(view.dtype)
        wi = torch.randn(B, HI, device=dev, generator=g).to(view.dtype)
        pos = torch.full((B,), ctx - 1, device=dev, dtype=torch.int32)
        floor = 1e3 * B * ctx * DI * view.element_size() / b.bw
        row = res[str(ctx)] = {"context": ctx, "batch": B, "floor_ms": round(floor, 4), "forms": {}}
        ch = {"chunk": 32} if smoke else {}
        base = itd.indexer_topk_decode(qi, wi, view, pos, K, impl="chunked", sink=sink, window=win, **ch)
        forms = {"chunked": lambda: itd.indexer_topk_decode(qi, wi, view, pos, K, impl="chunked", sink=sink,
                                                            window=win, **ch),
                 "row": lambda: itd.indexer_topk_decode(qi, wi, view, pos, K, impl="row", sink=sink, window=win, **ch),
                 "fine": lambda: itd.indexer_topk_decode(qi, wi, view, pos, K, impl="fine", sink=sink, window=win,
                                                         **ch)}
        if ctx == max(ctxs):
            for cb in (32, 64):
                forms[f"fine_cb{cb}"] = (lambda cb=cb: rh.fine_with(qi, wi, view, pos, K, sink, win, cb=cb,
                                                                     **({"chunk": 32} if smoke else {})))
            CH = fine_chunk(B, ctx, smoke)
            forms["score_only"] = lambda: rh.score_pass(qi, wi, view, pos, CH, sink, win)
            k8, ks = quantize_index_keys(view)
            forms["fp8_chunked"] = lambda: itd.indexer_topk_decode(qi, wi, k8, pos, K, impl="chunked", sink=sink,
                                                                   window=win, k_scale=ks, **ch)
            forms["fp8_fine"] = lambda: itd.indexer_topk_decode(qi, wi, k8, pos, K, impl="fine", sink=sink,
                                                                window=win, k_scale=ks, **ch)
            forms["fp8_score_only"] = lambda: rh.score_pass(qi, wi, k8, pos, CH, sink, win, k_scale=ks)
        with torch.inference_mode():
            for name, fn in forms.items():
                if not run.gate(2, f"alone {ctx} {name}"):
                    break
                got = fn()
                ms = bench_ms(fn, dev, graph=not smoke)
                f = row["forms"][name] = {"ms_graph": round(ms, 4), "x_floor": round(ms / floor, 2)}
                if isinstance(got, torch.Tensor) and not name.startswith("fp8"):
                    f["equal_chunked"] = bool(torch.equal(got, base))
                elif isinstance(got, torch.Tensor):
                    f["overlap_with_bf16"] = round(rh.overlap(got, base), 4)
                    f["floor_ms_fp8_keys"] = round(1e3 * B * ctx * (DI + 4) / b.bw, 4)
        log(f"alone {ctx}: floor {row['floor_ms']} ms: " + ", ".join(
            f"{n} {f['ms_graph']}" + ("" if f.get("equal_chunked", True) else " DIFFERS")
            + (f" (overlap {f['overlap_with_bf16']})" if "overlap_with_bf16" in f else "") for n, f in row["forms"].items()))
        run.save()
    return res


def fill_fp8(b, eng, max_len):
    """The engine's cache filled at random as `_Bench.fill`, fp8 index keys quantized from N(0, 1) ones."""
    from sparse_rl.sparse.ops import quantize_index_keys

    with torch.inference_mode():
        cache = eng._ensure_cache(max_len)
        g = torch.Generator(device=b.dev).manual_seed(b.cfg.seed)
        cache.k.normal_(generator=g)
        cache.v.normal_(generator=g)
        for i in range(cache.idx.shape[0]):
            k8, sc = quantize_index_keys(torch.randn(cache.idx.shape[1:], device=b.dev, generator=g, dtype=torch.bfloat16))
            cache.idx[i].copy_(k8)
            cache.idx_scale[i].copy_(sc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="default: $OUT/roll9")
    ap.add_argument("--budget", type=float, default=140)
    ap.add_argument("--call", type=int, default=1, choices=(1, 2))
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--best", default=None, help="call 2: the sparse variant for the whole generations")
    ap.add_argument("--cpu-smoke", action="store_true", help="a CPU run of the script itself at tiny sizes")
    a = ap.parse_args()
    smoke = a.cpu_smoke
    dev = torch.device("cpu" if smoke else "cuda")
    run = Run(a.out or os.path.join(os.environ.get("OUT", "/tmp"), "roll9"), f"session9_call{a.call}.json", a.budget,
              {"commit": a.commit, "call": a.call, "budget_s": a.budget, "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "variants": {k: v.describe() for k, v in VARIANTS.items()}})
    from sparse_rl.bench.rollout import BenchRolloutConfig, _Bench
    from sparse_rl.sparse.layer import sparse_config

    if smoke:
        cfg = BenchRolloutConfig(shape="tiny-qwen3", hf=False, long_new_tokens=[160, 200], long_batches=[3, 2],
                                 long_prompt_len=16, whole="integrate", topk=48, index_heads=2, index_dim=16,
                                 device="cpu", dtype="float32")
        B, ctxs, big, b1 = 4, [64, 96, 160], 160, [64, 160]
    else:
        cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, long_new_tokens=[16384, 32768], long_batches=[32, 16],
                                 long_prompt_len=128, whole="integrate", topk=2048, index_heads=4, index_dim=64)
        B, ctxs, big, b1 = 32, [2304, 4096, 8192, 16384], 16384, [2048, 16384]
    top = big + 128
    st: dict = {}
    if run.gate(NEED["select_check"], "select_check"):
        run.res["select_check"] = run.guarded("select_check", select_check, dev, smoke)
        run.save()

    def setup():
        bb = _Bench(cfg, log, None)
        bb.attach_sparse()
        eng = bb.engine(B, top)
        eng.set_attention("sparse")  # the index-key cache exists before the fill
        bb.fill(eng, top)
        st.update(b=bb, eng=eng)
        log(f"model built, copy {bb.bw / 1e12:.3f} TB/s, engine batch {B} x {top} filled")
        return {"copy_bw_tb_s": round(bb.bw / 1e12, 3)}

    if run.gate(NEED["setup"], "setup"):
        run.res["setup"] = run.guarded("setup", setup)
        run.save()
    if "eng" not in st:
        log("setup failed: nothing else runs")
        return
    b, eng = st["b"], st["eng"]
    if run.gate(NEED["alone"], "alone"):
        run.res["alone"] = run.guarded("alone", alone, run, b, eng, ctxs, smoke)
        run.save()
    if a.call == 1:
        steps_plan = {"base": VARIANTS["base"], "autofine": VARIANTS["autofine"], "fine": VARIANTS["fine"]}
    else:
        steps_plan = {"base": VARIANTS["base"], "autofine": VARIANTS["autofine"], "fine4k": VARIANTS["fine4k"]}
    if run.gate(NEED["steps"], "steps"):
        rh.step_rows(run, b, eng, ctxs, steps_plan, modes=("sparse",))
        rh.step_rows(run, b, eng, [ctxs[0], big], steps_plan, modes=("dense",))
    if run.gate(NEED["profile"], "profile"):
        prof = run.res.setdefault("profile", {})
        for name in ("base", "autofine"):
            if not run.gate(4, f"profile {name}"):
                break
            rh.apply(eng, VARIANTS[name])
            p = run.guarded(f"profile {name}", rh.profile_step, eng, big, "sparse")
            if p is not None:
                prof[name] = p
                log(f"profile {name} sparse {big}: {p['kernel_us_total']} us in {p['kernels']} kernels: {p['classes_us']}")
            run.save()
        rh.apply(eng, VARIANTS["base"])
    del eng
    st.clear()
    rh.free()
    if run.gate(NEED["batch1"], "batch1"):  # the batch-1 rows: dense and sparse steps vs the floor
        e1 = b.engine(1, top)
        e1.set_attention("sparse")
        b.fill(e1, top)
        rh.step_rows(run, b, e1, b1, {"base": VARIANTS["base"], "autofine": VARIANTS["autofine"]},
                     modes=("dense", "sparse"), key="batch1")
        del e1
        rh.free()
    if run.gate(NEED["fp8"], "fp8"):  # fp8 index keys in the step (the engine's cache as index_dtype fp8)
        sc = sparse_config(b.model)
        sc.index_dtype = "fp8"
        try:
            e8 = b.engine(B, top)
            e8.set_attention("sparse")
            run.res["fp8_index_dtype"] = e8.runner.index_dtype
            fill_fp8(b, e8, top)
            rh.step_rows(run, b, e8, [ctxs[0], big], {"base": VARIANTS["base"], "autofine": VARIANTS["autofine"]},
                         modes=("sparse",), key="fp8_steps")
            del e8
        finally:
            sc.index_dtype = "bf16"
            rh.free()
    best = a.best or "autofine"
    (new16, B16), (new32, B32) = cfg.long_runs()
    plan = [("dense", "base", VARIANTS["base"]), ("sparse", "base", VARIANTS["base"])]
    if best != "base":
        plan.append(("sparse", best, VARIANTS[best]))
    for name, new, Bw in (("whole_16k_b32", new16, B16), ("whole_32k_b16", new32, B32)):
        if run.gate(NEED[name], name):
            rh.whole(run, b, new, Bw, cfg.long_prompt_len, plan, name, need_s=NEED[name] / 3)
    run.save()
    log(f"done: skipped {run.res['skipped']}; errors {run.res['errors']}")
    for k in ("steps", "batch1", "fp8_steps"):
        for r in run.res.get(k) or []:
            print(f"| {k} | {r['mode']} | {r['variant']} | b{r['batch']} {r['context']} | {r['ms']} ms | {r['x_floor']}x |")
    for k in ("whole_16k_b32", "whole_32k_b16"):
        for r in run.res.get(k) or []:
            print(f"| {k} | {r['mode']} | {r['variant']} | {r['tokens_per_s']} tok/s | {r.get('sparse_over_dense', '-')} |")


if __name__ == "__main__":
    main()
