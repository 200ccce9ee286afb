"""Session 29 (lead), issue 15: the union-tile sparse attention forward in Gluon (`union_gluon.tile_fwd_gluon`:
the key rows cp.async-gathered into a ring of shared-memory stages, QK^T and PV on warpgroup MMAs) against the
Triton tile forward (`union.tile_fwd`, its default 64-row launch: 32 keys, 4 warps, 2 stages, AND test, cap 128) on
the same tiles of a trained indexer's selections, B 1, 32 / 8 heads, D 128, k 2048, bf16.

Rows: outputs against the Triton tile forward (max abs diff, lse diff), ms of each form, TFLOP/s on the tiles'
MMA work (4 * rows * |U| * D a tile) and on the selected pairs, the whole `sparse_attention` forward (what the CLI
times: union build + tile forward) and dense cuDNN SDPA in the same run; the backward's two passes (tile dq,
key-major dk/dv on prebuilt lists), Triton against Gluon; forward + backward with every kernel of either kind
against dense's.

Predictions (before the first call, H100): Triton 6.4-6.5 ms at 32K (session 28's 7.22 for the CLI's whole
attention); Gluon (64 keys, 2-3 stages) 4.0-5.0 ms (~380-470 TF/s on the tiles' work: the gathers in flight a
block or two ahead, 2 programs an SM at 80-112 KB of shared memory and ~160 registers); 128K 36 -> ~25 ms.
Session 25's lesson (occupancy beat a register prefetch) is why the launches span 2-4 programs an SM: 64 keys x 2
stages 165 registers / 80 KB (2 an SM), 32 x 2 48 KB (4), 32 x 3 121 registers / 64 KB (3); cp.async holds no
registers. Tile dq 8.2 -> 5-6 ms; keyq dk/dv 15.2 -> 9-12 ms (still one program an SM, 192 KB shared, but the
next chunk's gathers in flight); fwd + bwd 34 -> ~25-28 ms (1.6x -> ~2x dense).

    PYTHONPATH=$PWD python3 benchmarks/gpu_gluon_fwd_session29.py --budget 300 --out $OUT/gf29
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run, log, trained_indexer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gf29"))
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--seqlens", default="32768,131072")
    ap.add_argument("--tunes", default="64x2,64x3,32x2,32x3,32x4,64x3x1,32x4x1", help="BKxSTAGES[xPIPE],...")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--keyq-tunes", default="", help="keyq_gluon tunes STAGESxHEADS_TOGETHER,... beside its default "
                    "(session 30: the default alone was timed)")
    ap.add_argument("--dq-tunes", default="64x2,32x3,64x3", help="tile_dq_gluon tunes BKxSTAGES,...")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from sparse_rl.bench import patterns
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import sparse_attention
    from sparse_rl.sparse.ops.sparse_attention import triton as sa
    from sparse_rl.sparse.ops.sparse_attention import keyq, keyq_gluon, union, union_gluon
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    K, H, H_kv, D = 2048, 32, 8, 128
    run = Run(a.out, "gf29.json", a.budget, {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()})
    ix, _, gen = trained_indexer(dev, 0, 4, 64, 150)
    W = dict(rep_ms=200)
    tunes = [tuple(int(x) for x in t.split("x")) for t in a.tunes.split(",")]
    for L in [int(x) for x in a.seqlens.split(",")]:
        if not run.gate(40 if L <= 32768 else 150, f"trained {L}"):
            continue
        row = {"L": L}
        try:
            idx = patterns.trained_selection(ix, L, K, dev, gen)
            g = torch.Generator(device=dev).manual_seed(7)
            q, k, v = (torch.randn(1, L, h, D, device=dev, generator=g).bfloat16() for h in (H, H_kv, H_kv))
            scale, prec = 1 / math.sqrt(D), dot_precision(q.dtype)
            sel = union.build_union(idx, L, 16)
            ulen = int(sel.ulen.sum())
            pairs = int((idx >= 0).sum())
            tile_tf = 4 * 64 * ulen * H_kv * D  # FLOPs of the tiles' MMA work (QK and PV, 64 rows a tile)
            pair_tf = 4 * pairs * H * D
            row.update(union_over_pairs=ulen * 16 / max(pairs, 1), tile_flop=tile_tf, pair_flop=pair_tf)
            fns = {"triton": lambda: union.tile_fwd(q, k, v, sel, scale, prec)}
            for tn in tunes:
                fns["gluon_" + "x".join(map(str, tn))] = lambda tn=tn: union_gluon.tile_fwd_gluon(q, k, v, sel, scale,
                                                                                                 tune=tn)
            ref_o, ref_l = fns["triton"]()
            for lab, fn in fns.items():
                o, lse = fn()
                torch.cuda.synchronize()
                fin = torch.isfinite(ref_l)
                row[f"{lab}_maxdiff"] = float((o.float() - ref_o.float()).abs().max())
                row[f"{lab}_lsediff"] = float((lse[fin] - ref_l[fin]).abs().max())
                row[f"{lab}_lse_inf_equal"] = bool(torch.equal(fin, torch.isfinite(lse)))
            for rep in range(a.reps):
                for lab, fn in fns.items():
                    row.setdefault(f"{lab}_ms", []).append(bench_ms(fn, dev, **W))
            for lab in fns:
                ms = min(row[f"{lab}_ms"])
                row[f"{lab}_tile_tflops"] = tile_tf / ms * 1e-9
                row[f"{lab}_pair_tflops"] = pair_tf / ms * 1e-9
            row["build_union_ms"] = bench_ms(lambda: union.build_union(idx, L, 16), dev, **W)
            row["sparse_attention_ms"] = bench_ms(lambda: sparse_attention(q, k, v, idx, backend="triton")[0], dev,
                                                  **W)
            best = min((lab for lab in fns if lab != "triton"), key=lambda lab: min(row[f"{lab}_ms"]))
            row["best_gluon"] = best
            tn = {"fwd_impl": "gluon", "fwd_gluon": tuple(int(x) for x in best.split("_")[1].split("x"))}
            row["sparse_attention_gluon_ms"] = bench_ms(lambda: sa.sparse_attention_forward(q, k, v, idx, tune=tn)[0],
                                                        dev, **W)
            # the tile dq pass (the backward's query-major half), Triton's default launch against the Gluon kernel
            o, lse = ref_o, ref_l
            do = torch.randn(o.shape, device=dev, generator=g).bfloat16()
            delta = (o.float() * do.float()).sum(-1).contiguous()
            dq_ref = union.tile_dq(q, k, v, sel, do, lse, delta, scale, prec)
            dqs = {"dq_triton": lambda: union.tile_dq(q, k, v, sel, do, lse, delta, scale, prec)}
            for tn in [tuple(int(x) for x in t.split("x")) for t in a.dq_tunes.split(",") if t]:
                dqs["dq_gluon_" + "x".join(map(str, tn))] = lambda tn=tn: union_gluon.tile_dq_gluon(
                    q, k, v, sel, do, lse, delta, scale, tune=tn)
            for lab, fn in dqs.items():
                row[f"{lab}_maxdiff"] = float((fn().float() - dq_ref.float()).abs().max())
                row[f"{lab}_ms"] = bench_ms(fn, dev, **W)
            # the key-major dk/dv pass on prebuilt lists, Triton's default launch against the Gluon kernel
            lists = keyq.key_query_lists(idx, L, 64)
            dk_ref, dv_ref = keyq.keyq_dkdv(q, k, v, idx, do, lse, delta, scale, prec, lists=lists)
            kqs = {"keyq_triton": lambda: keyq.keyq_dkdv(q, k, v, idx, do, lse, delta, scale, prec, lists=lists),
                   "keyq_gluon": lambda: keyq_gluon.keyq_dkdv_gluon(q, k, v, idx, do, lse, delta, scale, lists=lists)}
            lists32 = keyq.key_query_lists(idx, L, 32)  # session 31: 32-key tiles (tune's 5th entry)
            for tn in [tuple(int(x) for x in t.split("x")) for t in a.keyq_tunes.split(",") if t]:
                kqs["keyq_gluon_" + "x".join(map(str, tn))] = lambda tn=tn: keyq_gluon.keyq_dkdv_gluon(
                    q, k, v, idx, do, lse, delta, scale, tune=tn, lists=lists32 if tn[4:5] == (32,) else lists)
            for lab, fn in kqs.items():
                dk_, dv_ = fn()
                row[f"{lab}_maxdiff"] = max(float((dk_.float() - dk_ref.float()).abs().max()),
                                            float((dv_.float() - dv_ref.float()).abs().max()))
                row[f"{lab}_ms"] = bench_ms(fn, dev, **W)
            del lists, lists32
            # forward + backward through the autograd function, every kernel Triton (default) or Gluon
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            pf = {"fwd_impl": "gluon", "bwd_impl": "gluon", "fwd_gluon": (32, 2, 0, 1), "dq_gluon": (64, 2, 1),
                  "keyq_gluon": (2, None, 1)}  # session 31: every Gluon kernel with its lists read ahead
            for lab, tn in (("fwdbwd_triton", None), ("fwdbwd_gluon", {"fwd_impl": "gluon", "bwd_impl": "gluon"}),
                            ("fwdbwd_gluon_prefetch", pf)):
                fb = lambda tn=tn: sa.sparse_attention(qg, kg, vg, idx, tune=tn)[0].backward(do)  # noqa: E731
                row[f"{lab}_ms"] = bench_ms(fb, dev, grad_to_none=[qg, kg, vg], **W)
            qd, kd, vd = (t.transpose(1, 2) for t in (q, k, v))
            row["dense_ms"] = bench_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True,
                                                                              enable_gqa=True), dev, **W)
            qd2, kd2, vd2 = (x.detach().requires_grad_() for x in (qd, kd, vd))
            dod = do.transpose(1, 2)
            row["dense_fwdbwd_ms"] = bench_ms(lambda: F.scaled_dot_product_attention(
                qd2, kd2, vd2, is_causal=True, enable_gqa=True).backward(dod), dev, grad_to_none=[qd2, kd2, vd2], **W)
        except Exception as e:  # noqa: BLE001 (a failure is a result)
            row["error"] = repr(e)[:600]
        log(f"trained {L}: {row}")
        run.res.setdefault("rows", []).append(row)
        run.save()
        torch.cuda.empty_cache()
    run.save()
    print(json.dumps(run.res.get("rows")))


if __name__ == "__main__":
    main()
