"""Follow-up device call (--budget 60) for helper bwd12, session 12: the keyq backward as `auto` takes it now
(paths.py: keyq when its dk/dv estimate < 0.85 of the key-major pass's; keyq's default launch (64, 128, 8, 3)),
checked end to end, plus two more keyq launches and three tile-dq launches. Reuses gpu_bwd12_session12.py's pieces.

    PYTHONPATH=$PWD python benchmarks/gpu_bwd12_session12b.py --budget 60 --commit <sha>
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_bwd12_session12b.py --cpu-smoke --budget 600

Phases (gated on time left; $OUT/bwd12/bwd12b.{json,log} after every row):
1. two children prove: `auto` (no tune) and the new launches, bf16 grads vs fp32 (1024 / 1000 queries, G 4 / 7),
   the new keyq launches == keymajor's dk/dv at 32K local rows; the parent trains the indexer meanwhile;
2. 32K trained: dense cuDNN fwd+bwd, fwd+bwd auto (its plan recorded) / "tile" / "keyq";
3. keyq dk/dv kernel: (64, 128, 8, 3) default vs (64, 128, 8, 4), (32, 64, 4, 3); tile dq (64, 8, 2) default vs
   (32, 4, 2), (64, 8, 3), (128, 8, 2);
4. per-query block rows and local+spans+noise: fwd+bwd auto vs "tile" (auto's plan recorded).

Predictions (before the call; call 1: dense 54.9, tile 50.4, keyq 38.3 at (64, 128, 8, 2), its kernel 16.79 ->
15.44 ms at (64, 128, 8, 3)): trained fwd+bwd auto = keyq ~37.0 ms (1.48x dense; 2x missed), tile ~50.4; auto takes
keyq on trained and local rows, the key-major pass on block rows (block auto == tile within 2%: 18.7 ms); local
auto ~111 ms (tile ~119); keyq (64, 128, 8, 4) within 3% of stage 3 (the gathered loads barely pipeline: 183 KB of
shared memory at both), (32, 64, 4, 3) ~16.3 (its stage-2 form 16.47); tile dq launches within +-5% of 10.28 ms
(session 8's sweep on shared rows: 4.77 / 4.81 at (64, 8, 2) / (32, 4, 2)).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bwd12_session12 as c1  # noqa: E402  (sets TRITON_INTERPRET for --cpu-smoke before triton loads)
from granular_harness import Run, dense_times, log, trained_indexer  # noqa: E402

import torch  # noqa: E402

KEYQ = [(64, 128, 8, 3), (64, 128, 8, 4), (32, 64, 4, 3)]
DQ = [(64, 8, 2), (32, 4, 2), (64, 8, 3), (128, 8, 2)]


def prove_items() -> list[dict]:
    items = [{"kind": "auto", "T": 0, "H": 0}, {"kind": "auto", "T": -24, "H": 0}, {"kind": "auto", "T": 0, "H": 7}]
    items += [{"kind": "grad", "tune": {"keyq": list(t)}, "T": 0, "H": 0} for t in KEYQ[1:]]
    items += [{"kind": "grad", "tune": {"dq": list(t)}, "T": 0, "H": 0} for t in DQ[1:]]
    items += [{"kind": "vs_keymajor", "tune": list(t)} for t in KEYQ[1:]]
    for i, it in enumerate(items):
        it["id"] = i
    return items


def grad_item(q, k, v, idx, go, kw) -> dict:
    from sparse_rl.bench.timing import rel_err
    from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive

    o, lse, dq, dk, dv = c1._grads(q, k, v, idx, go, **kw)
    qr, kr, vr = (x.detach().float().clone().requires_grad_() for x in (q, k, v))
    ro, _ = sparse_attention_naive(qr, kr, vr, idx)
    (ro * go.float()).sum().backward()
    r = {"out": rel_err(o, ro.detach()), "dq": rel_err(dq, qr.grad), "dk": rel_err(dk, kr.grad),
         "dv": rel_err(dv, vr.grad), "finite": bool(torch.isfinite(dq).all() and torch.isfinite(dk).all())}
    r["ok"] = r["finite"] and max(r[x] for x in ("out", "dq", "dk", "dv")) < 2e-2
    return r


def prove(a, dev) -> None:
    from sparse_rl.bench import patterns

    i, n = (int(x) for x in a.prove_part.split("/"))
    items = prove_items()[i::n]
    if a.cpu_smoke:
        items = items[:3]
    B, H, Hkv, D, K = a.shape
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(1)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dt)  # noqa: E731
    big = None
    for it in items:
        r = dict(it)
        try:
            if it["kind"] in ("auto", "grad"):
                T = a.check_T + it["T"]
                h, hk = (H, Hkv) if not it["H"] else (it["H"] * (Hkv // 2), Hkv // 2)
                q, k, v, go = rnd(B, T, h, D), rnd(B, T, hk, D), rnd(B, T, hk, D), rnd(B, T, h, D)
                idx = patterns.local_retrieval(T, min(a.check_topk, T), dev, gen, window=64, span_len=32)
                kw = {} if it["kind"] == "auto" else {"fwd_path": "tile", "bwd_path": "keyq",
                                                      "tune": {x: tuple(y) for x, y in it["tune"].items()}}
                r.update(grad_item(q, k, v, idx, go, kw))
            else:
                if big is None:
                    L = a.seqlen
                    big = (rnd(B, L, H, D), rnd(B, L, Hkv, D), rnd(B, L, Hkv, D), patterns.local_retrieval(L, K, dev, gen))
                r.update(c1.vs_keymajor(*big, gen, it["tune"]))
            if dev.type == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            r.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        with open(os.path.join(a.prove_dir, f"prove.{i}.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")
        if "error" in r and "CUDA" in r["error"]:
            break


def start_proofs(a):
    """c1.start_proofs for this script (its children run this file's `prove`)."""
    import subprocess
    import tempfile

    d = tempfile.mkdtemp(prefix="bwd12b-prove-")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--prove-part",
                               f"{i}/{a.jobs}", "--prove-dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for i in range(a.jobs)]
    return procs, d


def main():
    a = c1.parse_args()
    dev = torch.device("cpu" if a.cpu_smoke else "cuda")
    if a.prove_part:
        prove(a, dev)
        return
    from sparse_rl.bench import patterns
    from sparse_rl.bench.attention import block_pattern, block_pattern_indices
    from sparse_rl.bench.timing import bench_ms, device_name
    from sparse_rl.sparse.ops.sparse_attention import keyq, union
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention, sparse_attention_forward

    run = Run(a.out, "bwd12b.json", a.budget, {"commit": a.commit, "device": device_name(dev), "argv": sys.argv[1:]})
    c1.prove_items = prove_items  # collect_proofs lists what did not run from this call's items
    procs, pdir = start_proofs(a)
    B, H, Hkv, D, K = a.shape
    L = a.seqlen
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    W = dict(warmup_ms=10 if dev.type == "cuda" else 1, rep_ms=a.rep_ms)
    log(f"bwd12b: {run.res['device']} commit {a.commit} L {L} shape {a.shape}")
    ix, kl, gen = trained_indexer(dev, 0, 4, 64, a.train_steps)
    trained = patterns.trained_selection(ix, L, K, dev, gen)
    run.res["trained_indexer_kl"] = kl
    q, k, v = (torch.randn(B, L, h, D, device=dev, generator=gen).to(dt) for h in (H, Hkv, Hkv))
    g_out = torch.randn(B, L, H, D, device=dev, generator=gen).to(dt)
    log(f"inputs ready (indexer KL {kl:.3f}); waiting for the proofs")
    done = c1.collect_proofs(procs, pdir, run, max(5.0, run.left() - 30))
    for r in sorted(done.values(), key=lambda r: r["id"]):
        log(f"prove {r['id']} {r['kind']} {r.get('tune', '')} ok={r['ok']} " +
            " ".join(f"{x}={r[x]:.2e}" for x in ("out", "dq", "dk", "dv", "dk_vs_keymajor", "dv_vs_keymajor") if x in r)
            + (f" ERROR {r['error']}" if "error" in r else ""))
    auto_ok = all(r["ok"] for r in done.values() if r["kind"] == "auto") and any(r["kind"] == "auto" for r in done.values())
    good_kq = [KEYQ[0]] + [t for t in KEYQ[1:] if all(r["ok"] for r in done.values() if r.get("tune") in
                                                      ({"keyq": list(t)}, list(t))) and
                           any(r.get("tune") in ({"keyq": list(t)}, list(t)) for r in done.values())]
    good_dq = [DQ[0]] + [t for t in DQ[1:] if any(r.get("tune") == {"dq": list(t)} and r["ok"] for r in done.values())]
    run.res.update(auto_proven=auto_ok, keyq_proven=[list(t) for t in good_kq], dq_proven=[list(t) for t in good_dq])
    run.save()
    rows = run.res.setdefault("rows", {})

    def row(name, fn, **kw):
        ms = run.guarded(name, bench_ms, fn, dev, **W, **kw)
        rows[name] = ms
        log(f"{name}: {ms if ms is None else round(ms, 3)} ms")
        run.save()
        return ms

    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

    def fwdbwd(idx, **kw):
        return lambda: sparse_attention(qg, kg, vg, idx, **kw)[0].backward(g_out)

    def plan_of(name, idx):
        p = sparse_attention_forward(q, k, v, idx)[2]
        run.res[f"{name}_auto_plan"] = {"fwd": p.fwd, "bwd": p.bwd, "dq": p.dq,
                                        "estimate_ms": {x: round(y, 3) for x, y in p.estimate_ms.items()}}
        log(f"{name} auto plan {run.res[f'{name}_auto_plan']}")

    if run.gate(20, "dense"):
        d = run.guarded("dense", dense_times, q, k, v, dev, W, True)
        if d:
            run.res["dense"] = d
            log(f"dense {d}")
            run.save()
    if auto_ok and run.gate(8, "trained auto"):
        plan_of("trained", trained)
        row("trained_fwdbwd_auto", fwdbwd(trained), grad_to_none=[qg, kg, vg])
    if run.gate(8, "trained tile"):
        row("trained_fwdbwd_tile", fwdbwd(trained, fwd_path="tile", bwd_path="tile"), grad_to_none=[qg, kg, vg])
    if run.gate(8, "trained keyq"):
        row("trained_fwdbwd_keyq", fwdbwd(trained, fwd_path="tile", bwd_path="keyq"), grad_to_none=[qg, kg, vg])
    if run.gate(10, "pieces"):
        sel, o, lse, do, delta, scale, prec = c1.bwd_inputs(q, k, v, trained, gen)
        lists = keyq.key_query_lists(trained, L, 64)
        for t in good_kq:
            if t[0] == 64 and run.gate(4, f"keyq {t}"):
                row(f"trained_keyq_dkdv_{'_'.join(map(str, t))}",
                    lambda t=t: keyq.keyq_dkdv(q, k, v, trained, do, lse, delta, scale, prec, tune=t, lists=lists))
        for t in good_kq:
            if t[0] != 64 and run.gate(4, f"keyq {t}"):
                row(f"trained_keyq_dkdv_{'_'.join(map(str, t))}_with_lists",
                    lambda t=t: keyq.keyq_dkdv(q, k, v, trained, do, lse, delta, scale, prec, tune=t))
        for t in good_dq:
            if run.gate(4, f"dq {t}"):
                row(f"trained_tile_dq_{'_'.join(map(str, t))}",
                    lambda t=t: union.tile_dq(q, k, v, sel, do, lse, delta, scale, prec, tune=t))
        del sel, o, lse, do, delta, lists
    if auto_ok and run.gate(10, "block pattern"):
        blk = 128 if L >= 4096 else 16
        fb, cnt = block_pattern(L, blk, max(1, K // blk), dev, gen)
        bidx = block_pattern_indices(fb, cnt, L, blk, K)
        plan_of("block", bidx)
        row("block_fwdbwd_auto", fwdbwd(bidx), grad_to_none=[qg, kg, vg])
        row("block_fwdbwd_tile", fwdbwd(bidx, fwd_path="tile", bwd_path="tile"), grad_to_none=[qg, kg, vg])
        del bidx
    if auto_ok and run.gate(10, "local pattern"):
        lidx = patterns.local_retrieval(L, K, dev, gen)
        plan_of("local", lidx)
        row("local_fwdbwd_auto", fwdbwd(lidx), grad_to_none=[qg, kg, vg])
        row("local_fwdbwd_tile", fwdbwd(lidx, fwd_path="tile", bwd_path="tile"), grad_to_none=[qg, kg, vg])
    dense = (run.res.get("dense") or {}).get("dense_fwdbwd_ms")
    log("summary (ms; x = dense fwd+bwd / this):")
    for name, ms in rows.items():
        ratio = f"{dense / ms:.2f}x" if dense and ms and "fwdbwd" in name else ""
        log(f"  {name:44s} {ms if ms is None else f'{ms:8.3f}'} {ratio}")
    log(f"  dense fwd+bwd {dense}; skipped {run.res['skipped']}; errors {len(run.res['errors'])}")
    run.save()


if __name__ == "__main__":
    main()
