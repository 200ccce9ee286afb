"""Session 26 (lead), issue 14: the decode select after the score pass as one CUDA block per row
(`DecodeSelect("cuda")`, decode_cuda.py), against the engine's default (fine below batch 32, sync from it), in one call.

Why: the select is the largest term of the sparse step above its floor (session 20's ncu at 32 x 16K, layer 2:
`_sync_select` 48 us against the index keys' 15.7 us at the copy rate; 34 layers). What the Triton forms pay after
the ~16 us score stage is a chain of dependent block-wide steps (radix levels), each an L2 round trip between
programs (sync, ~4 us a level) or a launch (fine). In CUDA one block of 1024 threads holds the row's keys in shared
memory and runs a level as shared atomics + one 32-warp scan.

1. kernel: at (B, S) in SHAPES (Qwen3-4B indexer 4 x 64, bf16, k 2048, sink 4, window 64), every variant's keys equal
   to fine_only's; us a layer (one CUDA graph of 34 calls at PDL 2); the CUDA select alone on the same scores.
2. proof / steps / gen: `gpu_silu_session20.call` with the variants base (ENGINE_SELECT) and cuda: logits bitwise
   (the same scores, the same rule: the same keys), step ms interleaved, the whole 16K generation (integrated) at
   --batch (16 on an 80 GB H100).

Predictions (before the call): the CUDA select alone 4-8 us a row-batch at 32 x 16K (three levels of ~1 us, the
load and the write), 2-4 at 32 x 2304; with the score pass (~16 us at 32 x 16K) the whole cuda select ~22-26 us
against sync's ~46 and fine's ~58 alone; the step at 16 x 16K -0.4 to -0.8 ms, at 32 x 2304 -0.1 to -0.3; batch 1
16K -0.2 to -0.4 (fine's ~30 us a layer -> ~20); the whole 16K generation ratio +0.05 to +0.1 at batch 16.

    PYTHONPATH=$PWD python3 benchmarks/gpu_cuda_select_session26.py --budget 540 --batch 16 --out $OUT/cuda26
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run, log  # noqa: E402
from gpu_sync_session15 import K, SINK, WINDOW, _graph_us, _inputs  # noqa: E402

SHAPES = [(32, 2304), (32, 8192), (32, 16384), (16, 16384), (16, 32768), (1, 16384)]


def _selects() -> dict:
    from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT, DecodeSelect

    return {"fine_only": dataclasses.replace(ENGINE_SELECT, sync_min_batch=0), "engine": ENGINE_SELECT,
            "cuda": DecodeSelect("cuda", score_block=64), "cuda_sb0": DecodeSelect("cuda")}


def kernel_part(run, names) -> bool:
    import torch

    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk import decode_cuda as dc

    sel = {n: s for n, s in _selects().items() if n in names}
    ok = True
    rows = run.res.setdefault("kernel_us", [])
    for B, S in SHAPES:
        if not run.gate(10, f"kernel {B}x{S}"):
            break
        row = {"batch": B, "context": S, "equal_fine": {}}
        for ints in (True, False):  # integer inputs: heavy exact ties
            a = _inputs(B, S, 3 + ints, torch.device("cuda"), ints=ints)
            ref = itd.indexer_topk_decode(*a, K, sink=SINK, window=WINDOW, **{**sel["fine_only"].as_kwargs(), "pdl": 2})
            for n, s in sel.items():
                eq = run.guarded(f"equal {n} {B}x{S}", lambda s=s: bool(torch.equal(
                    itd.indexer_topk_decode(*a, K, sink=SINK, window=WINDOW, **{**s.as_kwargs(), "pdl": 2}), ref)))
                row["equal_fine"][n] = bool(eq) and row["equal_fine"].get(n, True)
        ok &= all(row["equal_fine"].values())
        a = _inputs(B, S, 3, torch.device("cuda"))
        for n, s in sel.items():
            row[n] = run.guarded(f"kernel {n} {B}x{S}", _graph_us, lambda s=s: itd.indexer_topk_decode(
                *a, K, sink=SINK, window=WINDOW, **{**s.as_kwargs(), "pdl": 2}))
        # the CUDA select alone, on the score pass's scores of a row set like the engine's (+inf forced, -inf unseen)
        sc = torch.randn(B, S, device="cuda")
        pos = a[3].to(torch.int32)
        sc[:, :SINK] = float("inf")
        cols = torch.arange(S, device="cuda")
        sc = torch.where((cols[None] > pos[:, None] - WINDOW) & (cols[None] <= pos[:, None]), float("inf"), sc)
        row["select_alone_equal"] = bool(torch.equal(dc.row_select(sc, pos, K), dc.row_select_naive(sc, pos, K)))
        ok &= row["select_alone_equal"]
        row["select_alone"] = run.guarded(f"select alone {B}x{S}", _graph_us, lambda: dc.row_select(sc, pos, K, pdl=2))
        # the same on the scores of the engine's inputs (the reference's formula, forced / unseen keys as the
        # score pass writes them), alone, without PDL, and the split of the cuda path's kernels (profiler)
        q, w, k = (t.float() for t in a[:3])
        se = (torch.relu(torch.einsum("bhd,bsd->bhs", q, k)) * w[:, :, None]).sum(1)
        vis = cols[None] <= pos[:, None]
        se = torch.where((cols[None] < SINK) | ((cols[None] > pos[:, None] - WINDOW) & vis), float("inf"), se)
        se = torch.where(vis, se, float("-inf")).contiguous()
        row["engine_scores_equal"] = bool(torch.equal(dc.row_select(se, pos, K), dc.row_select_naive(se, pos, K)))
        row["select_engine_scores"] = run.guarded(f"select eng {B}x{S}", _graph_us, lambda: dc.row_select(se, pos, K, pdl=2))
        row["select_engine_scores_nopdl"] = run.guarded(f"select eng0 {B}x{S}", _graph_us,
                                                        lambda: dc.row_select(se, pos, K, pdl=0))
        from granular_harness import kernel_profile

        row["cuda_profile"] = run.guarded(f"profile {B}x{S}", kernel_profile, lambda: itd.indexer_topk_decode(
            *a, K, sink=SINK, window=WINDOW, **{**sel["cuda"].as_kwargs(), "pdl": 2}), torch.device("cuda"), 4)
        rows.append(row)
        log(f"kernel {B}x{S}: equal {row['equal_fine']} alone-eq {row['select_alone_equal']} "
            + ", ".join(f"{n} {row.get(n)}" for n in list(sel) + ["select_alone", "select_engine_scores",
                                                                 "select_engine_scores_nopdl", "cuda_profile"]))
        run.save()
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cuda26"))
    ap.add_argument("--budget", type=float, default=540.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--parts", default="kernel,proof,steps,gen")
    ap.add_argument("--batch", type=int, default=16, help="the large batch of proof / steps / gen (32 on an H200)")
    ap.add_argument("--tol", type=float, default=0.0)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    import time

    import torch

    t0 = time.time()
    names = list(_selects())
    if "kernel" in a.parts:
        run = Run(a.out, "kernel26.json", min(a.budget * 0.3, 170), {"torch": torch.__version__, "variants": names})
        ok = bool(run.guarded("kernel", kernel_part, run, names))
        run.res["equal_everywhere"] = ok
        run.save()
        if not ok:
            log("kernel part: not equal everywhere (or failed): no engine parts")
            return
    import gpu_silu_session20 as s20
    import gpu_streams_session20 as g20
    from sparse_rl.sparse.ops.indexer_topk.decode_select import DecodeSelect

    g20.VARIANTS.update({"base": {}, "cuda": {"select": DecodeSelect("cuda", score_block=64)},
                         "cuda_sb0": {"select": DecodeSelect("cuda")}})
    gen = "gen" in a.parts
    a.parts = ",".join(p for p in a.parts.split(",") if p not in ("kernel", "gen"))
    a.budget = a.budget - (time.time() - t0)
    if a.parts:
        s20.call(a, ["base", "cuda", "cuda_sb0"], [], "engine26.json")
    if gen:  # dense once, sparse with each select, on one engine
        import rollout_harness as rh

        run = Run(a.out, "gen26.json", a.budget - (time.time() - t0), {"torch": torch.__version__})
        b = s20._bench(a.smoke)
        v = g20._variants(["base", "cuda"])
        new, batch, prompt = (24, 2, 8) if a.smoke else (16384, a.batch, 128)
        plan = [("dense", "base", v["base"]), ("sparse", "base", v["base"]), ("sparse", "cuda", v["cuda"])]
        run.guarded("gen", rh.whole, run, b, new, batch, prompt, plan, "gen", {"dense": 60, "sparse": 45})
        run.save()
        print(json.dumps([{k: r.get(k) for k in ("mode", "variant", "tokens_per_s", "sparse_over_dense", "floors_ratio")}
                          for r in run.res.get("gen", [])]))


if __name__ == "__main__":
    main()
