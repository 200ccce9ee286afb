"""Session 16 (lead), issue 14: the one-launch decode select with its chunk's keys in registers ("sync", keep) at
most 16 chunks a row (`DecodeSelect.sync_max_chunks`), against the engine's fine select, on the H200, in one call.

Why: session 15's call 5 measured sync + keep at -0.28 ms a step at 32 x 16K but +0.17 at 16 x 32K and +0.29 at
batch 1, where a row has 32 chunks (its [32, 256] histogram load spills at the 128-register cap); with at most 16
chunks a row (what batch 32 gets anyway) the split form was the fastest alone at batch 1 (20.1 us vs fine 30.6).
If sync + keep + 16 chunks is faster in the step in every row of the plan it can be the engine's default.

1. kernel: at 32 x 2304, 32 x 16384, 16 x 32768, 1 x 16384 (Qwen3-4B indexer 4 x 64, bf16, k 2048) every variant's
   keys equal to the fine select's; then us a layer, one CUDA graph of 34 calls at PDL 2 (gpu_sync_session15).
2. engine: step ms (graph replay, median of 20, `_Bench.step_row`) for the variants, interleaved `--reps` times,
   the floor beside each.

3. gen (written after call 1, for the next call): the whole 16K generation at batch 32 (`bench rollout`'s
   integrated model: dense and sparse in the same engine) with ENGINE_SELECT and with the rule
   `sync_min_batch=32` (fine below batch 32, sync from it), ratio against the same run's dense.

Call 1 (session 16, a17ae0c): `--variants fine,one_keep_mc16,one_keep_mc8 --reps 3`, parts kernel + engine.
Call 2 (planned; after 1c4e4dd the sync select's defaults are keep + 16 chunks + 128-key step, its grid planned
from the compiled kernel's registers and shared memory): `--variants fine,sync,sync_coop,fine_sync32 --parts
kernel,engine,gen`. Predictions: `sync` = call 1's one_keep_mc16 (the planning reads 4 programs an SM on the
H200: `resident` in the JSON); `sync_coop` within 0.05 ms of `sync` in the step, or refused in a graph with PDL
(then the error is recorded); `fine_sync32` = sync at batch 32 and = fine at 16 and 1; the 16K b32 generation
~1.66x -> ~1.70-1.73x.

Call 2 measured (session 17; results/2026-12-03-h200-sync-session17.md): resident 4 an SM; sync_coop = sync in
the step; the 16K b32 generation 1.679x with fine_sync32 vs 1.640x fine. ENGINE_SELECT became fine + sync from
batch 32 (a cooperative launch). Call 3 (`--variants fine,fine_only --parts kernel,gen`): the new default against
fine alone (fine_only) in one run; prediction: fine ~1.68x, fine_only ~1.64x.

    PYTHONPATH=$PWD python benchmarks/gpu_sync_session16.py --budget 170 --out $OUT/sync16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run, log  # noqa: E402
from gpu_sync_session15 import K, SHAPES, SINK, WINDOW, _graph_us, _inputs  # noqa: E402


def _selects():
    from sparse_rl.sparse.ops.indexer_topk.decode_select import ENGINE_SELECT, DecodeSelect

    keep = dict(sync_block=128, sync_keep=True)
    return {"fine": ENGINE_SELECT, "one_keep": DecodeSelect("sync", **keep, sync_max_chunks=32),
            "one_keep_mc16": DecodeSelect("sync", **keep, sync_max_chunks=16),
            "one_keep_mc8": DecodeSelect("sync", **keep, sync_max_chunks=8),
            "sync": DecodeSelect("sync"), "sync_coop": DecodeSelect("sync", sync_coop=True),
            "fine_sync32": dataclasses.replace(ENGINE_SELECT, sync_min_batch=32),
            "fine_only": dataclasses.replace(ENGINE_SELECT, sync_min_batch=0)}


def kernel_part(run, names) -> bool:
    """Every variant equal to fine at every shape (returned), and its us a layer."""
    import torch

    from sparse_rl.sparse.ops.indexer_topk import decode as itd

    sel = {n: s for n, s in _selects().items() if n in names}
    ok = True
    rows = run.res.setdefault("kernel_us", [])
    for B, S in SHAPES:
        if not run.gate(10, f"kernel {B}x{S}"):
            break
        a = _inputs(B, S, 3, torch.device("cuda"))
        fns = {n: (lambda s: lambda: itd.indexer_topk_decode(*a, K, sink=SINK, window=WINDOW,
                                                              **{**s.as_kwargs(), "pdl": 2}))(s) for n, s in sel.items()}
        ref = fns["fine"]()
        row = {"batch": B, "context": S, "equal_fine": {}}
        for n, f in list(fns.items()):
            eq = run.guarded(f"equal {n} {B}x{S}", lambda f=f: bool(torch.equal(f(), ref)))
            if eq is None:  # the launch itself failed (recorded): the variant leaves the call
                del fns[n]
                names.remove(n)
            else:
                row["equal_fine"][n] = eq
        ok &= all(row["equal_fine"].values())
        for n, f in fns.items():
            row[n] = run.guarded(f"kernel {n} {B}x{S}", _graph_us, f)
        rows.append(row)
        log(f"kernel {B}x{S}: equal {row['equal_fine']} " + ", ".join(f"{n} {row[n]}" for n in fns))
        run.save()
    from sparse_rl.sparse.ops.indexer_topk import decode_sync as ds

    # what the planning read from each compiled barrier kernel: (CMAX, BR, KEEP, launch options) -> programs an SM
    run.res["resident"] = {repr(k[1:4]) + " " + repr(dict(k[4:]).get("launch_cooperative_grid", False)): v
                           for k, v in ds._RESIDENT.items()}
    log(f"resident: {run.res['resident']}")
    return ok


def engine_part(run, names, reps: int) -> None:
    import rollout_harness as rh
    from sparse_rl.bench.rollout import BenchRolloutConfig, _Bench

    cfg = BenchRolloutConfig(shape="qwen3-4b", hf=False, topk=2048, index_heads=4, index_dim=64)
    b = _Bench(cfg, log, None)
    b.attach_sparse()
    variants = {n: rh.Variant(select=s) for n, s in _selects().items() if n in names}
    plan = {32: (16640, [16384, 2304]), 16: (33024, [32768]), 1: (16640, [16384])}
    for B, (top, ctxs) in plan.items():
        if not run.gate(25, f"engine b{B}"):
            break
        eng = b.engine(B, top)
        eng.set_attention("sparse")
        b.fill(eng, top)
        for rep in range(reps):  # interleaved: every variant at every context, then again
            for r in rh.step_rows(run, b, eng, ctxs, variants, need_s=4.0):
                r.setdefault("rep", rep)
        rh.apply(eng, variants["fine"])
        del eng
        rh.free()


def gen_part(run, names, shape="qwen3-4b", new=16384, batch=32, **extra) -> None:
    """The whole generation of `new` tokens at `batch` (integrated), dense and sparse, once a select variant
    (extra: more BenchRolloutConfig fields, for a CPU smoke run on the tiny shape)."""
    from sparse_rl.bench import rollout as br

    sel = _selects()
    for name in (n for n in names if n in ("fine", "fine_sync32", "fine_only")):
        if not run.gate(120 if shape != "tiny" else 1, f"gen {name}"):
            break
        cfg = br.BenchRolloutConfig(shape=shape, hf=False, topk=2048, index_heads=4, index_dim=64,
                                    long_new_tokens=[new], long_batches=[batch], whole="integrate", **extra)
        b = br._Bench(cfg, log, None)
        b.cfg.select = lambda s=sel[name]: s  # the engine's select for this variant (runner_options from cfg)
        b.attach_sparse()
        run.guarded(f"gen {name}", br._long_rows, b, new, batch)
        rows = [r for r in b.res["rows"] if r.get("run") == "long"]
        run.res.setdefault("gen", {})[name] = rows
        tps = {r["mode"]: r["tokens_per_s"] for r in rows}
        if len(tps) == 2:
            log(f"gen {name}: dense {tps['dense']} sparse {tps['sparse']} tok/s = {tps['sparse'] / tps['dense']:.3f}x")
        run.save()
        del b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "sync16"))
    ap.add_argument("--budget", type=float, default=170.0)
    ap.add_argument("--variants", default="fine,one_keep,one_keep_mc16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", default="kernel,engine")
    ap.add_argument("--gen-smoke", action="store_true", help="gen on the tiny shape on the CPU (checks the part runs)")
    a = ap.parse_args()
    import torch

    names = a.variants.split(",")
    run = Run(a.out, "sync16.json", a.budget, {"torch": torch.__version__, "variants": names})
    ok = True
    if "kernel" in a.parts:
        ok = run.guarded("kernel", kernel_part, run, names)
        run.res["equal_everywhere"] = bool(ok)
        run.save()
    if ok and "engine" in a.parts:
        run.guarded("engine", engine_part, run, names, a.reps)
        run.save()
    if ok and "gen" in a.parts:
        smoke = dict(shape="tiny", new=24, batch=2, device="cpu", dtype="float32") if a.gen_smoke else {}
        run.guarded("gen", gen_part, run, names, **smoke)
    run.save()
    print(json.dumps(run.res.get("kernel_us"), indent=None))
    for r in run.res.get("steps", []):
        print(r["rep"], r["batch"], r["context"], r["variant"], r["ms"], r["floor_ms"])


if __name__ == "__main__":
    main()
