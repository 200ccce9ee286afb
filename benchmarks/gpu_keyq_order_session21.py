"""Session 21 (lead), issue 15: the key-major dk/dv pass (`keyq.keyq_dkdv`) in another program order, on the H200,
32K token-level selection of a trained indexer (B 1, 32 / 8 heads, D 128, k 2048, bf16), in one call.

Why: session 20's ncu of the trained backward put keyq's dk/dv at 15.6 ms of 33.0 (fwd+bwd), one program an SM,
DRAM 34%, L2 hits 26%, its bytes the q / dO row gathers (~40 GB: each query's rows fetched by every key tile it
selected from, ~76 64-key tiles). The programs run KV head fastest (`_tile_of`, heads_together = 8), so a wave of
132 programs spans ~16 consecutive key tiles of each head; a query whose selection has runs of neighbouring tiles
is fetched by programs that run at different times. With fewer heads interleaved a wave spans more consecutive tiles
of one head (heads_together 1: ~132 tiles, 8.4K keys) and the rows of such a query come from L2 more often.
The program order changes no program's arithmetic (bitwise, CPU test).

1. proof: dk / dv for heads_together 8 / 4 / 2 / 1 bitwise equal (prebuilt lists, one backward's inputs).
2. alone: `keyq_dkdv` on the prebuilt lists, each order, interleaved 3 times (ms, median of do_bench).
3. fwd+bwd: the kernels' `sparse_attention` forward + backward through `auto`, the keyq tune's sixth entry
   = the best order against the default, interleaved 3 times; dense cuDNN SDPA fwd+bwd in the same run.

Predictions (before the call): bitwise equal. Alone: 8 ~15.5 ms; 4 ~14.5-15.5; 2 ~13-15; 1 ~12-15 (L2 hits 26% ->
40-55% would take the gathers' DRAM share down by a fifth to two fifths; the wave's tail unchanged: the sink tile's
list starts first in every order). fwd+bwd 33.0 -> 30-32.5 ms (1.67x -> 1.7-1.8x dense; the 2x needs 27.6).

    PYTHONPATH=$PWD python benchmarks/gpu_keyq_order_session21.py --budget 300 --out $OUT/keyq21
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run, log, trained_indexer  # noqa: E402


def inputs(dev, L: int, smoke: bool):
    """(q, k, v, rows, do, o, lse, delta): the trained indexer's token rows and one backward's inputs."""
    import torch

    from sparse_rl.bench import patterns
    from sparse_rl.sparse.ops import indexer_topk, sparse_attention

    K, H, H_kv, D = (16, 8, 2, 16) if smoke else (2048, 32, 8, 128)
    ix, _, gen = trained_indexer(dev, 0, 4, 16 if smoke else 64, 5 if smoke else 150)
    qi, wi, ki = patterns.trained_index(ix, L, dev, gen)
    rows = indexer_topk(qi, wi, ki, K, sink=4, window=8 if smoke else 64, backend="triton")
    g = torch.Generator(device=dev).manual_seed(7)
    dt = torch.float32 if smoke else torch.bfloat16
    q, k, v = (torch.randn(1, L, h, D, device=dev, generator=g).to(dt) for h in (H, H_kv, H_kv))
    do = torch.randn(q.shape, device=dev, generator=g).to(dt)
    with torch.no_grad():
        o, lse = sparse_attention(q, k, v, rows, backend="triton")
    delta = (o.float() * do.float()).sum(-1)
    return q, k, v, rows, do, o, lse, delta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "keyq21"))
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--orders", default="8,4,2,1")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (TRITON_INTERPRET=1)")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.sparse_attention import keyq
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention as sa_triton
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

    dev = torch.device("cpu" if a.smoke else "cuda")
    L = 300 if a.smoke else 32768
    orders = [int(x) for x in a.orders.split(",")]
    if a.smoke:
        orders = [o for o in orders if 2 % o == 0]  # the smoke's 2 KV heads
    run = Run(a.out, "keyq21.json", a.budget, {"torch": torch.__version__, "seqlen": L, "orders": orders})
    q, k, v, rows, do, o, lse, delta = inputs(dev, L, a.smoke)
    base_tune = keyq.default_tune(dev.type == "cuda")
    BN = base_tune[0]
    lists = keyq.key_query_lists(rows, k.shape[1], BN)
    scale, prec = q.shape[-1] ** -0.5, dot_precision(q.dtype)
    W = dict(rep_ms=200) if not a.smoke else {}

    def dkdv(gh):
        return keyq.keyq_dkdv(q, k, v, rows, do, lse, delta, scale, prec, tune=(*base_tune[:4], 0, gh), lists=lists)

    ref = dkdv(orders[0])
    eq = {gh: bool(all(torch.equal(x, y) for x, y in zip(dkdv(gh), ref))) for gh in orders}
    run.res["proof_equal"] = eq
    log(f"proof: {eq}")
    run.save()
    if not all(eq.values()):
        return
    alone = run.res.setdefault("alone", [])
    for rep in range(a.reps):
        if not run.gate(20, f"alone rep {rep}"):
            break
        for gh in orders:
            ms = bench_ms(lambda: dkdv(gh), dev, **W)
            alone.append({"rep": rep, "heads_together": gh, "ms": ms})
            log(f"alone rep {rep} heads_together {gh}: {ms:.3f} ms")
        run.save()
    def median(gh):
        ms = sorted(r["ms"] for r in alone if r["heads_together"] == gh)
        return ms[len(ms) // 2] if ms else float("inf")

    best = min(orders, key=median)  # the fastest order alone, against the default in the whole fwd+bwd
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

    def fwd_bwd(gh):
        tune = None if gh is None else {"keyq": (*base_tune[:4], 0, gh)}
        out = sa_triton(qg, kg, vg, rows, tune=tune)[0]  # the kernels' entry (takes `tune`); paths auto
        out.backward(do)

    def dense():
        out = F.scaled_dot_product_attention(qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), is_causal=True,
                                             enable_gqa=True)
        out.backward(do.transpose(1, 2))

    fb = run.res.setdefault("fwd_bwd", [])
    for rep in range(a.reps):
        if not run.gate(30, f"fwd_bwd rep {rep}"):
            break
        for name, fn in (("default", lambda: fwd_bwd(None)), (f"heads_together {best}", lambda: fwd_bwd(best)),
                         ("dense", dense)):
            ms = bench_ms(fn, dev, grad_to_none=[qg, kg, vg], **W)
            fb.append({"rep": rep, "variant": name, "ms": ms})
            log(f"fwd_bwd rep {rep} {name}: {ms:.3f} ms")
        run.save()
    run.save()
    print(json.dumps({k: run.res.get(k) for k in ("proof_equal", "alone", "fwd_bwd", "errors", "skipped")}))


if __name__ == "__main__":
    main()
