"""One device call: GPU correctness checks at odd and realistic sizes, then `sparse-rl bench attention`
(in-process, one length at a time so a time-out keeps what was measured), a launch-config sweep of
the tile kernels, and optionally `sparse-rl bench decode`.

    PYTHONPATH=. python benchmarks/gpu_kernels.py --out $OUT [--seqlens 32768,131072] [--decode]

Writes $OUT/gpu_checks.json, $OUT/attention-<L>.json/.md, $OUT/sweep.json (and decode.json/.md) and
prints the markdown tables last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

from sparse_rl.bench.timing import bench_ms, rel_err
from sparse_rl.sparse.ops import block_select, indexer_topk, shared_to_per_query, sparse_attention
from sparse_rl.sparse.ops.block_select.naive import block_select_naive
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_scores_naive
from sparse_rl.sparse.ops.sparse_attention import triton as sa
from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _grads(q, k, v, idx, go, gl, **kw):
    """out, lse and (dq, dk, dv) of the public op with an upstream grad on out and lse."""
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = sparse_attention(qs, ks, vs, idx, backend="triton", **kw)
    ((out.float() * go.float()).sum() + (lse.masked_fill(torch.isinf(lse), 0) * gl).sum()).backward()
    return out, lse, (qs.grad, ks.grad, vs.grad)


def shared_check(g) -> dict:
    """A selection shared by 64 queries `[B, ceil(T/64), K]` with a prefix (q_offset) and a left-padded
    row, against the reference on the per-query selection it means; and k >= L equals dense."""
    from sparse_rl.sparse.ops import dense_attention_naive, visible_mask

    dev, dtype = "cuda", torch.bfloat16
    B, T, H, Hkv, D, K, group, q_off = 2, 999, 32, 8, 128, 300, 64, 77
    S = T + q_off
    q = torch.randn(B, T, H, D, device=dev, dtype=dtype, generator=g)
    k, v = (torch.randn(B, S, Hkv, D, device=dev, dtype=dtype, generator=g) for _ in range(2))
    NG = -(-T // group)
    sc = torch.rand(B, NG, S, device=dev, generator=g)
    last = (torch.arange(NG, device=dev) * group + group - 1).clamp(max=T - 1) + q_off
    sc = sc.masked_fill(torch.arange(S, device=dev) > last[:, None], -1.0)
    sc[1, :, :50] = -1.0  # left padding: the selector never names pad keys
    vals, sh = sc.topk(K, -1)
    sh = torch.where(vals >= 0, sh, -1).int()
    per = shared_to_per_query(sh, group, T, q_off)
    go = torch.randn(B, T, H, D, device=dev, dtype=dtype, generator=g)
    gl = torch.zeros(B, T, H, device=dev)
    out, lse, gr = _grads(q, k, v, sh, go, gl, query_group=group, q_offset=q_off)
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    ro, rl = sparse_attention_naive(qr, kr, vr, per)
    (ro * go.float()).sum().backward()
    r = {"op": "sparse_attention shared rows (group 64, q_offset 77, left pad)", "out": rel_err(out, ro),
         **{n: rel_err(a, b.grad) for n, a, b in zip(("dq", "dk", "dv"), gr, (qr, kr, vr))}}
    L = 700  # k >= L equals dense, tile path
    q, k, v = q[:1, :L], k[:1, :L], v[:1, :L]
    full = torch.arange(L + 5, device=dev).expand(L, L + 5)
    full = torch.where(full <= torch.arange(L, device=dev)[:, None], full, -1)[None].int()
    o2, _ = sparse_attention(q, k, v, full, backend="triton", fwd_path="tile")
    d2, _ = dense_attention_naive(q.float(), k.float(), v.float(), visible_mask(1, L, L, device=dev))
    r["k_ge_L_vs_dense"] = rel_err(o2, d2)
    return r


def odd_shape_checks(other_ops: bool = False) -> list[dict]:
    """Forward + gradients vs the fp32 reference on odd shapes, bf16/fp32, GQA 1/4/7, D 16/64/128, both
    paths; shared rows; with `other_ops` the indexer and block selector too."""
    dev = "cuda"
    res = []
    g = torch.Generator(device=dev).manual_seed(0)
    # every shape in bf16; fp16/fp32 on two shapes (each config costs Triton compiles of device time)
    combos = [(torch.bfloat16, s) for s in ((8, 8, 64), (32, 8, 128), (7, 1, 64))]
    combos += [(torch.float32, (4, 2, 16))]
    for dtype, (H, Hkv, D) in combos:
        if True:
            B, T, S, K = 2, 333, 1111, 517
            q = torch.randn(B, H, T, D, device=dev, dtype=dtype, generator=g).transpose(1, 2)  # non-contiguous
            k = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype, generator=g)
            v = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype, generator=g)
            idx = torch.rand(B, T, S, device=dev, generator=g).topk(K, -1).indices.int()
            idx[torch.rand(B, T, K, device=dev, generator=g) < 0.2] = -1
            idx[0, 7] = -1
            go = torch.randn(B, T, H, D, device=dev, dtype=dtype, generator=g)
            gl = torch.randn(B, T, H, device=dev, generator=g)
            qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
            ro, rl = sparse_attention_naive(qr, kr, vr, idx)
            gl = gl.masked_fill(torch.isinf(rl), 0)
            ((ro * go.float()).sum() + (rl.masked_fill(torch.isinf(rl), 0) * gl).sum()).backward()
            fin = torch.isfinite(rl)
            r = {"op": "sparse_attention", "dtype": str(dtype).split(".")[1], "H": H, "H_kv": Hkv, "D": D}
            for fp, bp in (("query", "atomic"), ("tile", "tile")):
                out, lse, gr = _grads(q, k, v, idx, go, gl, fwd_path=fp, bwd_path=bp)
                r.update({f"{fp}_out": rel_err(out, ro), f"{fp}_lse_abs": float((lse[fin] - rl[fin]).abs().max()),
                          f"{fp}_empty_row_ok": bool((out[0, 7] == 0).all() and torch.isneginf(lse[0, 7]).all()),
                          **{f"{bp}_{n}": rel_err(a, b.grad) for n, a, b in zip(("dq", "dk", "dv"), gr, (qr, kr, vr))}})
            for path in ("query", "tile"):  # both forward paths, poisoned outputs
                o = torch.full_like(out, float("nan"))
                ls = torch.full_like(lse, float("nan"))
                sa.sparse_attention_forward(q, k, v, idx, out=(o, ls), fwd_path=path)
                r[f"fwd_{path}_nan_free"] = bool(torch.isfinite(o).all() and not torch.isnan(ls).any())
            qd = torch.randn(B, H, D, device=dev, dtype=dtype, generator=g)
            for ns in (None, 1, 3):
                od, ld = sa.sparse_decode(qd, k, v, idx[:, 11], nsplit=ns)
                rd, rld = sparse_attention_naive(qd[:, None].float(), k.float(), v.float(), idx[:, 11:12])
                r[f"decode_split{ns}"] = rel_err(od, rd[:, 0])
            res.append(r)
    try:
        res.append(shared_check(g))
    except Exception as e:  # keep the other numbers of the call
        res.append({"op": "shared rows", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    if not other_ops:
        return res
    # indexer and block selector: kernel vs reference, identical up to ties
    for dtype in (torch.bfloat16, torch.float32):
        B, T, S, HI, DI = 2, 777, 1500, 4, 64
        qi = torch.randn(B, T, HI, DI, device=dev, dtype=dtype, generator=g)
        wi = torch.rand(B, T, HI, device=dev, dtype=dtype, generator=g)
        ki = torch.randn(B, S, DI, device=dev, dtype=dtype, generator=g)
        kvs = torch.tensor([0, 100], device=dev)
        sel = indexer_topk(qi, wi, ki, 300, q_offset=S - T, sink=4, window=16, kv_start=kvs, backend="triton")
        ref = indexer_topk(qi, wi, ki, 300, q_offset=S - T, sink=4, window=16, kv_start=kvs, backend="torch")
        sc = indexer_scores_naive(qi.float(), wi.float(), ki.float(), q_offset=S - T, kv_start=kvs)
        val = lambda ix: torch.where(ix >= 0, torch.gather(sc, 2, ix.clamp(min=0).long()), 0.0).sort(-1).values  # noqa
        a, b = val(sel), val(ref)
        fin = torch.isfinite(a) & torch.isfinite(b)
        res.append({"op": "indexer_topk", "dtype": str(dtype).split(".")[1], "identical_frac": float((sel == ref).float().mean()),
                    "same_valid": bool(((sel >= 0) == (ref >= 0)).all()),
                    "score_rel_err": rel_err(a[fin], b[fin]), "inf_match": bool((torch.isinf(a) == torch.isinf(b)).all())})
        q = torch.randn(B, T, 28, 128, device=dev, dtype=dtype, generator=g)
        k = torch.randn(B, S, 4, 128, device=dev, dtype=dtype, generator=g)
        bs = block_select(q, k, 64, 8, q_offset=S - T, kv_start=kvs, backend="triton")
        br = block_select_naive(q, k, 64, 8, q_offset=S - T, kv_start=kvs)
        res.append({"op": "block_select", "dtype": str(dtype).split(".")[1], "identical_frac": float((bs == br).float().mean())})
    return res


def sweep(L: int = 32768) -> list[dict]:
    """Launch configs of the tile kernels at L on the block pattern: forward (BLOCK_K, warps, stages),
    dq and key-major dk/dv (BLOCK_N, warps, stages)."""
    from sparse_rl.bench.attention import block_pattern, block_pattern_indices
    from sparse_rl.sparse.ops.sparse_attention import keymajor, union
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(1, L, 32, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, L, 8, 128, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    fb, cnt = block_pattern(L, 128, 16, dev, g)
    idx = block_pattern_indices(fb, cnt, L, 128, 2048)
    sel = union.build_union(idx, L, union.tile_queries(4))
    scale, prec = 1 / math.sqrt(128), dot_precision(q.dtype)
    o, lse = union.tile_fwd(q, k, v, sel, scale, prec)
    do = torch.randn_like(q)
    delta = (o.float() * do.float()).sum(-1).contiguous()
    out = []
    # fwd (BLOCK_K, warps, stages[, 1 = K gathered transposed, run 1's layout])
    runs = [("fwd", t, lambda t=t: union.tile_fwd(q, k, v, sel, scale, prec, tune=t))
            for t in ((64, 8, 2), (64, 8, 2, 1), (32, 8, 2), (64, 8, 3), (128, 8, 2), (32, 4, 2))]
    runs += [("dq", t, lambda t=t: union.tile_dq(q, k, v, sel, do, lse, delta, scale, prec, tune=t))
             for t in ((32, 4, 2), (64, 4, 2), (32, 4, 3), (16, 4, 2))]
    runs += [("dkdv", t, lambda t=t: keymajor.key_major_dkdv(q, k, v, sel, do, lse, delta, scale, prec, tune=t))
             for t in ((32, 4, 2), (32, 4, 3), (32, 8, 2), (32, 2, 2), (32, 4, 1))]
    for name, tune, fn in runs:
        try:
            out.append({"pass": name, "tune": tune, "ms": bench_ms(fn, dev, rep_ms=60)})
        except Exception as e:
            out.append({"pass": name, "tune": tune, "error": f"{type(e).__name__}: {str(e)[:120]}"})
        log(f"sweep {out[-1]}")
    off, lst, nnz = keymajor.key_tile_lists(sel, L, L, 32)
    out.append({"key_tile_pairs_touched_per_kv_head": nnz, "key_tile": 32, "lists_ms": bench_ms(
        lambda: keymajor.key_tile_lists(sel, L, L, 32), dev, rep_ms=30)})
    return out


def model_level_check() -> dict:
    """Sparse model with k >= L equals the dense model, Triton backend on the GPU (tiny llama, fp32)."""
    import tempfile
    from pathlib import Path

    from sparse_rl.modelinit import ModelInitConfig, init_model
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.convert import ConvertConfig, convert
    from sparse_rl.sparse.loader import load_model, set_attention

    L = 300
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        init_model(tmp / "dense", ModelInitConfig(arch="llama", size="tiny", seed=1))
        sc = SparseConfig(topk=L + 5, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
        convert(tmp / "dense", tmp / "sparse", ConvertConfig(sparse=sc, seed=3))
        model = load_model(tmp / "sparse", attention="sparse").cuda()
        set_attention(model, "sparse", backend="triton")
        ids = torch.randint(5, 500, (2, L), generator=torch.Generator().manual_seed(0)).cuda()
        mask = torch.ones_like(ids)
        mask[1, :37] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            sparse = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            set_attention(model, "dense")
            dense = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        valid = mask.bool()
        return {"check": "model k>=L equals dense (triton, cuda, fp32)", "L": L,
                "max_abs_diff": float((sparse[valid] - dense[valid]).abs().max()),
                "rel_err": rel_err(sparse[valid], dense[valid])}


def main():
    from sparse_rl.bench.attention import BenchAttentionConfig, markdown_attention, run_attention_bench

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--seqlens", default="32768,131072")
    ap.add_argument("--backward-seqlens", default="32768")
    ap.add_argument("--rep-ms", type=int, default=60)
    ap.add_argument("--decode", action="store_true", help="also run `sparse-rl bench decode`")
    ap.add_argument("--other-ops", action="store_true", help="also check the indexer and block selector")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-model-check", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    try:
        checks = odd_shape_checks(args.other_ops)
    except Exception as e:
        import traceback

        traceback.print_exc()
        checks = [{"check": "odd shapes", "error": f"{type(e).__name__}: {str(e)[:300]}"}]
    try:
        if not args.no_model_check:
            checks.append(model_level_check())
    except Exception as e:  # other stages' code; report, do not lose the kernel numbers
        checks.append({"check": "model-level", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    with open(os.path.join(args.out, "gpu_checks.json"), "w") as f:
        json.dump(checks, f, indent=1)
    for c in checks:
        log(json.dumps(c))
    mds = []
    bwd = [int(x) for x in args.backward_seqlens.split(",") if x]
    for i, L in enumerate(int(x) for x in args.seqlens.split(",")):
        cfg = BenchAttentionConfig(seqlens=[L], backward_seqlens=bwd, rep_ms=args.rep_ms, seed=i)
        try:
            res = run_attention_bench(cfg, log=log)
        except Exception:
            import traceback

            traceback.print_exc()
            continue
        md = markdown_attention(res)
        res["markdown"] = md
        with open(os.path.join(args.out, f"attention-{L}.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        mds.append(md)
        print(md, flush=True)
        if i == 0 and not args.no_sweep:
            try:
                sw = sweep(L)
            except Exception as e:
                sw = [{"error": f"{type(e).__name__}: {str(e)[:300]}"}]
                log(sw)
            with open(os.path.join(args.out, "sweep.json"), "w") as f:
                json.dump(sw, f, indent=1)
    if args.decode:
        cli = [sys.executable, "-m", "sparse_rl.cli.main", "bench"]
        subprocess.run(cli + ["decode", "--splits", "1,2,4,8", "--out", f"{args.out}/decode.json"], check=True,
                       stdout=open(f"{args.out}/decode.md", "w"))
        mds.append(open(os.path.join(args.out, "decode.md")).read())
    for md in mds:
        print(md)


if __name__ == "__main__":
    main()
