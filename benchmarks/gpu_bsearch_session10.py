"""Session 10, the lead's device run (issue 14): the register bitwise-search decode select (`impl="bsearch"`,
decode_bsearch.py) against the engine's default (fine, 64-key score step), on the shared harness and the
pieces of session 10's rollout script (gpu_rollout_session10: build, engine_check, whole_run): exactness on
real shapes first, the select alone, steps at 2304 / 8192 / 16384 (batch 32), the engine check (greedy == HF,
log-probs == teacher-forced), the profile, whole 16K batch-32 and 32K batch-16 generations (integrated).

    PYTHONPATH=$PWD python benchmarks/gpu_bsearch_session10.py --budget 200 --commit SHA          (H200)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_bsearch_session10.py --cpu-smoke --budget 900
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import gpu_rollout_session10 as S10  # noqa: E402
import rollout_harness as rh  # noqa: E402
from granular_harness import Run, log  # noqa: E402
from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT, DecodeSelect  # noqa: E402

BSEARCH = DecodeSelect("bsearch", score_block=64)
S10.VARIANTS["bsearch"] = rh.Variant(BSEARCH)
S10.NEED["whole_32k_b16"] = S10.NEED["whole_16k_b32"] = 46  # three runs each here


def alone(run, b, eng, ctxs, smoke) -> dict:
    """Score + select alone, graph-timed: fine (the default) vs bsearch on the engine's layer-2 index cache
    (batch 32) and on random keys at 16 x 32768; bsearch's rows == fine's."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk import decode as itd

    dev, K = eng.device, b.cfg.topk
    HI, DI = b.cfg.index_heads, b.cfg.index_dim
    sink, win = min(4, K // 4), min(64, K // 4)
    cache = eng._ensure_cache(max(ctxs))
    g = torch.Generator(device=dev).manual_seed(5)
    shapes = [(eng.max_batch, c, None) for c in ctxs] + ([] if smoke else [(16, 32768, "random")])
    res = {}
    for B, ctx, src in shapes:
        if not run.gate(5, f"alone {B}x{ctx}"):
            break
        if src is None:
            view = cache.idx[2][:B, :ctx]
        else:
            view = torch.randn(B, ctx, DI, device=dev, generator=g).to(torch.bfloat16)
        qi = torch.randn(B, HI, DI, device=dev, generator=g).to(view.dtype)
        wi = torch.randn(B, HI, device=dev, generator=g).to(view.dtype)
        pos = torch.full((B,), ctx - 1, device=dev, dtype=torch.int32)
        pos[1::3] = torch.randint(K, ctx, (len(range(1, B, 3)),), device=dev, generator=g).to(torch.int32)
        row = res[f"{B}x{ctx}"] = {"batch": B, "context": ctx, "keys": src or "engine layer 2",
                                   "floor_ms": round(1e3 * B * ctx * DI * view.element_size() / b.bw, 4)}
        forms = {n: (lambda s=s: itd.indexer_topk_decode(qi, wi, view, pos, K, sink=sink, window=win, **s.as_kwargs()))
                 for n, s in (("fine", ENGINE_SELECT), ("bsearch", BSEARCH))}
        with torch.inference_mode():
            ref = forms["fine"]()
            got = forms["bsearch"]()
            row["equal"] = bool(torch.equal(got, ref))
            for name, fn in forms.items():
                row[f"{name}_ms"] = round(bench_ms(fn, dev, graph=not smoke), 4)
            row["score_only_ms"] = round(bench_ms(lambda: rh.score_pass(qi, wi, view, pos, 1024 if not smoke else 32,
                                                                        sink, win, bn=16 if smoke else 64),
                                                  dev, graph=not smoke), 4)
        log(f"alone {B}x{ctx}: equal {row['equal']} fine {row['fine_ms']} bsearch {row['bsearch_ms']} "
            f"score {row['score_only_ms']} floor {row['floor_ms']}")
        run.save()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="default: $OUT/lead10")
    ap.add_argument("--budget", type=float, default=200)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    smoke = a.cpu_smoke
    dev = torch.device("cpu" if smoke else "cuda")
    run = Run(a.out or os.path.join(os.environ.get("OUT", "/tmp"), "lead10"), "bsearch10.json", a.budget,
              {"commit": a.commit, "budget_s": a.budget, "torch": torch.__version__,
               "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "variants": {k: S10.VARIANTS[k].describe() for k in ("base", "bsearch")}})
    from sparse_rl.bench.rollout import BenchRolloutConfig

    if smoke:
        cfg = BenchRolloutConfig(shape="tiny-qwen3", hf=False, long_new_tokens=[160, 200], long_batches=[3, 2],
                                 long_prompt_len=16, whole="integrate", topk=48, index_heads=2, index_dim=16,
                                 device="cpu", dtype="float32")
        B, ctxs, big = 4, [64, 100, 160], 160
    else:
        cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, long_new_tokens=[16384, 32768], long_batches=[32, 16],
                                 long_prompt_len=128, whole="integrate", topk=2048, index_heads=4, index_dim=64)
        B, ctxs, big = 32, [2304, 8192, 16384], 16384
    st: dict = {}
    if run.gate(16, "setup"):
        run.res["setup"] = run.guarded("setup", S10.build, cfg, B, big + 128, st)
        run.save()
    if "eng" not in st:
        log("setup failed")
        return
    b, eng = st["b"], st["eng"]
    if run.gate(20, "alone"):
        run.res["alone"] = run.guarded("alone", alone, run, b, eng, ctxs, smoke)
        run.save()
    ok = all(r.get("equal") for r in (run.res.get("alone") or {}).values()) and run.res.get("alone")
    if not ok:
        log("bsearch not equal to fine (or not checked): nothing else runs")
        return
    cands = {"base": S10.VARIANTS["base"], "bsearch": S10.VARIANTS["bsearch"]}
    if run.gate(14, "steps"):
        rh.step_rows(run, b, eng, ctxs, cands, modes=("sparse",))
    S10.profile(run, eng, big, ["bsearch"])
    del eng
    st.pop("eng")
    rh.free()
    if run.gate(14, "engine_check"):
        run.res["engine_check"] = run.guarded("engine_check", S10.engine_check, b.dev, smoke,
                                              {"bsearch": S10.VARIANTS["bsearch"]})
        run.save()
    plan = [("dense", "base", S10.VARIANTS["base"]), ("sparse", "base", S10.VARIANTS["base"]),
            ("sparse", "bsearch", S10.VARIANTS["bsearch"])]
    S10.whole_run(run, b, cfg, "whole_16k_b32", plan)
    S10.whole_run(run, b, cfg, "whole_32k_b16", plan)
    run.save()
    log(f"done: skipped {run.res['skipped']}; errors {run.res['errors']}")
    for r in run.res.get("steps") or []:
        print(f"| steps | {r['variant']} | b{r['batch']} {r['context']} | {r['ms']} ms | {r['x_floor']}x |")
    for k in ("whole_16k_b32", "whole_32k_b16"):
        for r in run.res.get(k) or []:
            print(f"| {k} | {r['mode']} | {r['variant']} | {r['tokens_per_s']} tok/s | {r.get('sparse_over_dense', '-')} |")


if __name__ == "__main__":
    main()
