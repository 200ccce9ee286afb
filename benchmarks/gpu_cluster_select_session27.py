"""Session 27 (lead), issue 14: the CUDA decode select as a thread-block CLUSTER a row (`decode_cuda.row_select(
cluster=C)`, `DecodeSelect("cuda", cuda_cluster=C)`), against its one-block form (session 26's third form, never run
on a GPU before) and the engine's default (fine below batch 32, sync from it), in one call.

Why: one 1024-thread block a row is issue-bound on one SM (session 26: ~80 instructions a key over five passes,
14.7 us alone at 32 x 16K on randn rows) while a decode batch of 16-32 rows leaves 100+ of the 132 SMs idle. A
cluster of C blocks splits the row's keys C ways and exchanges counts, histograms, candidates and write offsets
through distributed shared memory at 5 cluster barriers.

Also found on the CPU before this call: session 26's launches never carried their PDL attribute (its value was
memmoved into a bytes copy of the struct field), so its "PDL" rows of the cuda select were plain launches.

1. kernel: at (B, S) in SHAPES (Qwen3-4B indexer 4 x 64, bf16, k 2048, sink 4, window 64): every variant's keys
   equal to fine_only's (bf16 and integer inputs); us a layer (one CUDA graph of 34 calls at PDL 2) of the whole
   select per variant; the CUDA select alone on the engine formula's scores for C in 1 / 2 / 4 / 8, with and
   without PDL.
2. proof / steps: `gpu_silu_session20.call` with base (ENGINE_SELECT), cuda (auto cluster), cuda1 (one block).
3. gen: the whole 16K generation at --batch: dense base, sparse base, sparse cuda.

Predictions (before the call): the one-block form alone on engine scores ~12-16 us at 32 x 16K (session 26's form 2
was 14.7 on randn rows; the ballot removes the zero-bin serialization); clusters of 4 ~5-7 us there (a quarter of
the passes' keys, plus five cluster barriers of ~1 us); C = 8 at 16 x 16K ~4-6; at 32 x 2304 every C within 1-2 us
(the barriers dominate). The whole cuda path (score pass ~16 us + select) at 32 x 16K ~22-26 us against the
engine's ~45; the step at 16 x 16K -0.4 to -0.7 ms, batch 1 16K -0.2 to -0.4; the whole 16K generation ratio
+0.03 to +0.08.

Call 3: one kernel for every cluster size, three passes instead of five (the row's extremes from the score pass's
per-chunk span, the histogram in the load pass, the candidates listed by a cluster-wide counter with rank / warp
tags so the write's offsets need no counting pass, 2 cluster barriers instead of 5); the previous kernel timed
beside it (benchmarks/old_decode_cuda_27b.py, carried untracked). Predicted: alone at 16 x 16K (C2) 15.7 -> 9-11 us,
32 x 2304 7.6 -> 5-6; the step at 16 x 16K -0.1 to -0.2 ms against call 2's cuda.

Call 1 (H100): every form exact, but the select alone on the engine formula's scores 50 us at 32 x 16K at every
cluster size: rows whose k-th largest score is an exact ReLU zero (head weights mostly negative) put ~900 equal
keys in the threshold's bin, ranked one a thread (c^2 / 32 warp iterations). Call 2: the zeros in a slot of their
own (resolved at once), lists over 128 keys by a bitonic sort, clusters only where a block keeps 8K keys.

    PYTHONPATH=$PWD python3 benchmarks/gpu_cluster_select_session27.py --budget 430 --batch 16 --out $OUT/cl27
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run, log  # noqa: E402
from gpu_sync_session15 import K, SINK, WINDOW, _graph_us, _inputs  # noqa: E402

SHAPES = [(32, 16384), (16, 16384), (1, 16384), (32, 2304), (32, 8192), (16, 32768)]
CLUSTERS = (1, 2, 4, 8)


def _selects() -> dict:
    from sparse_rl.sparse.ops.indexer_topk.decode_select import DecodeSelect

    # the engine's default of sessions 17-26, spelt out (ENGINE_SELECT is "cuda" since call 2 of this session:
    # call 4 read it here and timed the new default under these two names)
    old = DecodeSelect("fine", score_block=64, sync_min_batch=32)
    return {"fine_only": dataclasses.replace(old, sync_min_batch=0), "engine": old,
            "cuda": DecodeSelect("cuda", score_block=64), "cuda1": DecodeSelect("cuda", score_block=64, cuda_cluster=1)}


def _engine_scores(a):
    """The score pass's scores of inputs a, by the reference's formula: +inf on sink / window keys, -inf unseen."""
    import torch

    q, w, k = (t.float() for t in a[:3])
    pos = a[3].long()
    S = k.shape[1]
    cols = torch.arange(S, device=k.device)
    se = (torch.relu(torch.einsum("bhd,bsd->bhs", q, k)) * w[:, :, None]).sum(1)
    vis = cols[None] <= pos[:, None]
    se = torch.where((cols[None] < SINK) | ((cols[None] > pos[:, None] - WINDOW) & vis), float("inf"), se)
    return torch.where(vis, se, float("-inf")).contiguous()


def kernel_part(run, sel) -> bool:
    import torch

    from sparse_rl.sparse.ops.indexer_topk import decode as itd
    from sparse_rl.sparse.ops.indexer_topk import decode_cuda as dc

    ok = True
    rows = run.res.setdefault("kernel_us", [])
    for B, S in SHAPES:
        if not run.gate(10, f"kernel {B}x{S}"):
            break
        row = {"batch": B, "context": S, "equal_fine": {}, "auto_cluster": dc.auto_cluster(
            B, S, torch.cuda.get_device_properties(0).multi_processor_count, torch.cuda.get_device_capability())}
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
        se, pos = _engine_scores(a), a[3]
        ref = dc.row_select_naive(se, pos, K)
        # the span once, outside the timed calls (call 4 computed it inside: its "alone" rows hold ~30 us of
        # score_span's torch kernels and are not the select's time)
        sp = dc.score_span(se)
        try:  # call 3: the previous kernel (commit bdee591), carried untracked beside this script, for the baseline
            import old_decode_cuda_27b as old

            row["prev_alone_equal"] = bool(torch.equal(old.row_select(se, pos, K), ref))
            row["prev_alone_auto"] = run.guarded(f"prev {B}x{S}", _graph_us, lambda: old.row_select(se, pos, K, pdl=2))
            row["new_alone_auto"] = run.guarded(f"new {B}x{S}", _graph_us, lambda: dc.row_select(
                se, pos, K, span=sp, chunk=S, pdl=2))
        except ImportError:
            pass
        for c in CLUSTERS:
            eq = run.guarded(f"alone eq C{c} {B}x{S}", lambda c=c: bool(torch.equal(dc.row_select(se, pos, K, cluster=c), ref)))
            row[f"alone_equal_C{c}"] = bool(eq)
            ok &= bool(eq)
            row[f"alone_C{c}"] = run.guarded(f"alone C{c} {B}x{S}", _graph_us, lambda c=c: dc.row_select(
                se, pos, K, span=sp, chunk=S, pdl=2, cluster=c))
            row[f"alone_C{c}_nopdl"] = run.guarded(f"alone0 C{c} {B}x{S}", _graph_us, lambda c=c: dc.row_select(
                se, pos, K, span=sp, chunk=S, pdl=0, cluster=c))
        rows.append(row)
        log(f"kernel {B}x{S}: " + json.dumps(row))
        run.save()
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cl27"))
    ap.add_argument("--budget", type=float, default=430.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--parts", default="kernel,proof,steps,gen")
    ap.add_argument("--batch", type=int, default=16, help="the large batch of proof / steps / gen (32 on an H200)")
    ap.add_argument("--tol", type=float, default=0.0)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    import torch

    t0 = time.time()
    sel = _selects()
    if "kernel" in a.parts:
        run = Run(a.out, "kernel27.json", min(a.budget * 0.3, 150), {"torch": torch.__version__, "variants": list(sel)})
        ok = bool(run.guarded("kernel", kernel_part, run, sel))
        run.res["equal_everywhere"] = ok
        run.save()
        if not ok:
            log("kernel part: not equal everywhere (or failed): no engine parts")
            return
    import gpu_silu_session20 as s20
    import gpu_streams_session20 as g20

    g20.VARIANTS.update({"base": {"select": sel["engine"]}, "cuda": {"select": sel["cuda"]},
                         "cuda1": {"select": sel["cuda1"]}})
    gen = "gen" in a.parts
    a.parts = ",".join(p for p in a.parts.split(",") if p not in ("kernel", "gen"))
    a.budget = a.budget - (time.time() - t0)
    if a.parts:
        s20.call(a, ["base", "cuda", "cuda1"], [], "engine27.json")
    if gen:  # dense once, sparse with each select, on one engine
        import rollout_harness as rh

        run = Run(a.out, "gen27.json", a.budget - (time.time() - t0), {"torch": torch.__version__})
        b = s20._bench(a.smoke)
        v = g20._variants(["base", "cuda", "cuda1"])
        new, batch, prompt = (24, 2, 8) if a.smoke else (16384, a.batch, 128)
        plan = [("dense", "base", v["base"]), ("sparse", "base", v["base"]), ("sparse", "cuda", v["cuda"]),
                ("sparse", "cuda1", v["cuda1"])]
        run.guarded("gen", rh.whole, run, b, new, batch, prompt, plan, "gen", {"dense": 60, "sparse": 45})
        run.save()
        print(json.dumps([{k: r.get(k) for k in ("mode", "variant", "tokens_per_s", "sparse_over_dense", "floors_ratio")}
                          for r in run.res.get("gen", [])]))


if __name__ == "__main__":
    main()
