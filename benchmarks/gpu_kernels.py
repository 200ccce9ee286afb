"""One device call: GPU correctness checks at odd and realistic sizes, then `sparse-rl bench attention`
and `sparse-rl bench decode`, plus a launch-config sweep of the sparse attention forward.

    PYTHONPATH=. python benchmarks/gpu_kernels.py --out $OUT [--quick]

Writes $OUT/gpu_checks.json, $OUT/attention.json/.md, $OUT/decode.json/.md, $OUT/sweep.json and
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
from sparse_rl.sparse.ops import block_select, indexer_topk, sparse_attention
from sparse_rl.sparse.ops.block_select.naive import block_select_naive
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_scores_naive
from sparse_rl.sparse.ops.sparse_attention import triton as sa
from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def odd_shape_checks() -> list[dict]:
    """Forward + gradients vs the fp32 reference on odd shapes, every dtype, GQA 1/4/7, D 16/64/128."""
    dev = "cuda"
    res = []
    g = torch.Generator(device=dev).manual_seed(0)
    # every shape in bf16; fp16/fp32 on two shapes (each config costs Triton compiles of device time)
    combos = [(torch.bfloat16, s) for s in ((8, 8, 64), (32, 8, 128), (7, 1, 64))]
    combos += [(torch.float32, (4, 2, 16)), (torch.float16, (28, 4, 128))]
    for dtype, (H, Hkv, D) in combos:
        if True:
            B, T, S, K = 2, 333, 1111, 517
            q = torch.randn(B, H, T, D, device=dev, dtype=dtype, generator=g).transpose(1, 2)  # non-contiguous
            k = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype, generator=g)
            v = torch.randn(B, S, Hkv, D, device=dev, dtype=dtype, generator=g)
            idx = torch.rand(B, T, S, device=dev, generator=g).topk(K, -1).indices.int()
            idx[torch.rand(B, T, K, device=dev, generator=g) < 0.2] = -1
            idx[0, 7] = -1
            qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
            out, lse = sparse_attention(qs, ks, vs, idx, backend="triton")
            go = torch.randn(out.shape, device=dev, dtype=dtype, generator=g)
            gl = torch.randn(lse.shape, device=dev, generator=g).masked_fill(torch.isinf(lse), 0)
            ((out.float() * go.float()).sum() + (lse.masked_fill(torch.isinf(lse), 0) * gl).sum()).backward()
            qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
            ro, rl = sparse_attention_naive(qr, kr, vr, idx)
            ((ro * go.float()).sum() + (rl.masked_fill(torch.isinf(rl), 0) * gl).sum()).backward()
            fin = torch.isfinite(rl)
            r = {"op": "sparse_attention", "dtype": str(dtype).split(".")[1], "H": H, "H_kv": Hkv, "D": D,
                 "out": rel_err(out, ro), "lse_abs": float((lse[fin] - rl[fin]).abs().max()),
                 "empty_row_ok": bool((out[0, 7] == 0).all() and torch.isneginf(lse[0, 7]).all()),
                 "dq": rel_err(qs.grad, qr.grad), "dk": rel_err(ks.grad, kr.grad), "dv": rel_err(vs.grad, vr.grad)}
            sa.BWD_PATH = "union"  # the opt-in union-tile backward against the same reference grads
            qu, ku, vu = (x.detach().clone().requires_grad_() for x in (q, k, v))
            ou, lu = sparse_attention(qu, ku, vu, idx, backend="triton")
            ((ou.float() * go.float()).sum() + (lu.masked_fill(torch.isinf(lu), 0) * gl).sum()).backward()
            sa.BWD_PATH = "query"
            r.update({"dq_union": rel_err(qu.grad, qr.grad), "dk_union": rel_err(ku.grad, kr.grad),
                      "dv_union": rel_err(vu.grad, vr.grad)})
            for path in ("query", "union"):  # both forward paths, forced, poisoned outputs
                sa.FWD_PATH = path
                o = torch.full_like(out, float("nan"))
                ls = torch.full_like(lse, float("nan"))
                sa._fwd_auto(q, k, v, idx, 1 / math.sqrt(D), out=(o, ls))
                r[f"fwd_{path}"] = rel_err(o, ro)
                r[f"fwd_{path}_nan_free"] = bool(torch.isfinite(o).all() and not torch.isnan(ls).any())
            sa.FWD_PATH = "auto"
            qd = torch.randn(B, H, D, device=dev, dtype=dtype, generator=g)
            for ns in (None, 1, 3):
                od, ld = sa.sparse_decode(qd, k, v, idx[:, 11], nsplit=ns)
                rd, rld = sparse_attention_naive(qd[:, None].float(), k.float(), v.float(), idx[:, 11:12])
                r[f"decode_split{ns}"] = rel_err(od, rd[:, 0])
            res.append(r)
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
    """Launch configs of the sparse attention backward at L (indexer-pattern indices)."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(1, L, 32, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, L, 8, 128, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    idx = indexer_topk(torch.randn(1, L, 4, 64, device=dev, dtype=torch.bfloat16, generator=g),
                       torch.rand(1, L, 4, device=dev, dtype=torch.bfloat16, generator=g),
                       torch.randn(1, L, 64, device=dev, dtype=torch.bfloat16, generator=g), 2048, backend="triton")
    out = []
    # The forward launch config was swept in run 1 (7 configs; (128, 4, 2) won and is the default):
    # pass e.g. tune=(64, 4, 2) to sa._fwd here to sweep it again.
    d = torch.device(dev)
    go = torch.randn_like(q)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    o, _ = sparse_attention(qg, kg, vg, idx, backend="triton")
    for tune in ((32, 4, 2), (64, 4, 2)):
        sa.BWD_TUNE = tune
        try:
            ms = bench_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), go, retain_graph=True), d)
            out.append({"pass": "bwd", "tune": tune, "ms": ms})
        except Exception as e:
            out.append({"pass": "bwd", "tune": tune, "error": f"{type(e).__name__}: {str(e)[:120]}"})
        log(f"sweep {out[-1]}")
    sa.BWD_TUNE = None
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
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    checks = odd_shape_checks()
    try:
        checks.append(model_level_check())
    except Exception as e:  # other stages' code; report, do not lose the kernel numbers
        checks.append({"check": "model-level", "error": f"{type(e).__name__}: {str(e)[:300]}"})
    with open(os.path.join(args.out, "gpu_checks.json"), "w") as f:
        json.dump(checks, f, indent=1)
    for c in checks:
        log(json.dumps(c))
    sw = sweep()
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(sw, f, indent=1)
    cli = [sys.executable, "-m", "sparse_rl.cli.main", "bench"]
    seq = "8K,32K" if args.quick else "8K,32K,64K,128K"
    subprocess.run(cli + ["decode", "--splits", "1,2,4,8", "--out", f"{args.out}/decode.json"], check=True,
                   stdout=open(f"{args.out}/decode.md", "w"))
    subprocess.run(cli + ["attention", "--seqlens", seq, "--out", f"{args.out}/attention.json"], check=True,
                   stdout=open(f"{args.out}/attention.md", "w"))
    for name in ("decode.md", "attention.md"):
        print(open(os.path.join(args.out, name)).read())


if __name__ == "__main__":
    main()
