"""One device call (--budget 190 s of script time) for issue 15, session 14 (helper keyq2): dk/dv over two-level
key-tile query lists (`bwd_path="keyq2"`, ops/sparse_attention/keyq2.py) against keyq.py's one-level lists and
dense cuDNN, 32K, the trained indexer's selection. Reuses gpu_bwd12_session12.py's pieces.

    PYTHONPATH=$PWD python benchmarks/gpu_keyq2_session14.py --budget 190 --commit <sha>
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_keyq2_session14.py --cpu-smoke --budget 900

Phases, each gated on the time LEFT of --budget, JSON + log rewritten after every row ($OUT/keyq2/keyq2.{json,log}):
1. child processes prove every keyq2 launch timed below (a faulting launch cannot poison the parent's context):
   (a) at the start, bf16 out/dq/dk/dv of `sparse_attention(fwd_path="tile", bwd_path="keyq2")` vs the fp32
   reference (1024 queries, G 4; 1000 queries and G 7 for the default launch) while the parent trains the indexer;
   (b) once the 32K trained rows exist (saved to a temp file), keyq2's dk/dv == keyq's on them (within bf16
   rounding), one child;
2. 32K trained: dense cuDNN fwd+bwd; fwd+bwd with bwd_path "keyq" and "keyq2" (fwd_path "tile"), interleaved, two
   rounds (keyq2 at its default and the split form);
3. the pieces: keyq vs keyq2 lists, the dk/dv kernels on prebuilt lists (keyq default, keyq2 at each proven
   launch), the (query, tile) pairs per class (lo / both / hi) and 128-row chunks, `auto`'s estimates beside them;
4. regression: per-query block rows (128-key blocks) fwd+bwd "keyq" vs "keyq2".

Predictions (before the call; session 12: keyq dk/dv 15.44 ms at (64, 128, 8, 3) over 73 K chunks x 8 KV heads,
~27 of a pair's 64 keys selected, fwd+bwd 36.9 ms; the static profile, sm90_keyq2.py under Triton 3.6: the
three-loop form spills 272 B at (64, 128, 8, 3), the split form 240 registers and no spill):
- one-half pairs are a minority on the trained rows (27 of 64 keys a pair, mostly runs crossing the halves):
  a guess of 25-40% of pairs; keyq2 dk/dv then ~0.8-0.95x keyq's at best, and the three-loop form's spill can eat
  that: **keyq2 dk/dv 13-17 ms** (keyq ~15.4), fwd+bwd within +-2 ms of keyq's;
- lists: keyq2's count/compact do a little more (three classes): within +-0.3 ms of keyq's ~1.1 ms;
- block rows: every pair "both" -> keyq2 == keyq's work plus the per-tile empty half lists: within +-5%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bwd12_session12 as c1  # noqa: E402  (sets TRITON_INTERPRET for --cpu-smoke before triton loads)
from granular_harness import Run, dense_times, log, trained_indexer  # noqa: E402

import torch  # noqa: E402

KEYQ = (64, 128, 8, 3)  # keyq.default_tune
# keyq2 launches (BLOCK_N, rows, num_warps, num_stages, split); the first is keyq2.default_tune's
TUNES = [(64, 128, 8, 3, 0), (64, 128, 8, 3, 1), (64, 64, 4, 2, 1)]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "keyq2"))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--budget", type=float, default=190.0, help="seconds of script time; phases gate on time left")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU through the interpreter")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--shape", type=int, nargs=5, default=[1, 32, 8, 128, 2048], metavar=("B", "H", "H_KV", "D", "K"))
    ap.add_argument("--check-T", type=int, default=1024)
    ap.add_argument("--check-topk", type=int, default=256)
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--rep-ms", type=int, default=150)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--prove-part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prove-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trained-file", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        a.seqlen, a.shape, a.check_T, a.check_topk = 256, [1, 8, 2, 16, 48], 96, 24
        a.train_steps, a.rep_ms = 3, 1
    return a


def grad_items() -> list[dict]:
    items = [{"kind": "grad", "tune": list(t), "T": 0, "H": 0} for t in TUNES]
    items += [{"kind": "grad", "tune": list(TUNES[0]), "T": -24, "H": 0},  # odd length: partial chunks
              {"kind": "grad", "tune": list(TUNES[0]), "T": 0, "H": 7}]  # G 7
    for i, it in enumerate(items):
        it["id"] = i
    return items


def trained_items() -> list[dict]:
    return [{"kind": "vs_keyq", "tune": list(t), "id": 100 + i} for i, t in enumerate(TUNES)]


def grad_check(q, k, v, idx, go, tune) -> dict:
    from sparse_rl.bench.timing import rel_err
    from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive

    o, lse, dq, dk, dv = c1._grads(q, k, v, idx, go, fwd_path="tile", bwd_path="keyq2", tune={"keyq2": tuple(tune)})
    qr, kr, vr = (x.detach().float().clone().requires_grad_() for x in (q, k, v))
    ro, _ = sparse_attention_naive(qr, kr, vr, idx)
    (ro * go.float()).sum().backward()
    r = {"out": rel_err(o, ro.detach()), "dq": rel_err(dq, qr.grad), "dk": rel_err(dk, kr.grad),
         "dv": rel_err(dv, vr.grad), "finite": bool(torch.isfinite(dq).all() and torch.isfinite(dk).all()
                                                      and torch.isfinite(dv).all())}
    r["ok"] = r["finite"] and max(r[x] for x in ("out", "dq", "dk", "dv")) < 2e-2
    return r


def vs_keyq(q, k, v, idx, gen, tune) -> dict:
    """keyq2's dk/dv against keyq's on the same inputs (the tile forward's lse / delta)."""
    from sparse_rl.bench.timing import rel_err
    from sparse_rl.sparse.ops.sparse_attention import keyq, keyq2

    _, _, lse, do, delta, scale, prec = c1.bwd_inputs(q, k, v, idx, gen)
    dk0, dv0 = keyq.keyq_dkdv(q, k, v, idx, do, lse, delta, scale, prec, tune=KEYQ)
    dk1, dv1 = keyq2.keyq2_dkdv(q, k, v, idx, do, lse, delta, scale, prec, tune=tuple(tune))
    r = {"dk_vs_keyq": rel_err(dk1, dk0), "dv_vs_keyq": rel_err(dv1, dv0)}
    r["ok"] = bool(torch.isfinite(dk1.float()).all() and torch.isfinite(dv1.float()).all()) and max(r.values()) < 1e-2
    return r


def _inputs(a, dev, L, seed):
    B, H, Hkv, D, _ = a.shape
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(seed)
    return gen, [torch.randn(B, L, h, D, device=dev, generator=gen).to(dt) for h in (H, Hkv, Hkv)]


def prove(a, dev) -> None:
    """Child process: this part's items, one JSON line each after a synchronise."""
    from sparse_rl.bench import patterns

    i, n = (int(x) for x in a.prove_part.split("/"))
    trained = a.trained_file is not None
    items = (trained_items() if trained else grad_items())[i::n]
    if a.cpu_smoke:
        items = items[:2]
    B, H, Hkv, D, K = a.shape
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    big = None
    for it in items:
        r = dict(it)
        try:
            if it["kind"] == "grad":
                gen = torch.Generator(device=dev).manual_seed(1)
                rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dt)  # noqa: E731
                T = a.check_T + it["T"]
                h, hk = (H, Hkv) if not it["H"] else (it["H"] * (Hkv // 2), Hkv // 2)
                q, k, v, go = rnd(B, T, h, D), rnd(B, T, hk, D), rnd(B, T, hk, D), rnd(B, T, h, D)
                idx = patterns.local_retrieval(T, min(a.check_topk, T), dev, gen, window=64, span_len=32)
                r.update(grad_check(q, k, v, idx, go, it["tune"]))
            else:
                if big is None:
                    idx = torch.load(a.trained_file, map_location=dev)
                    gen, qkv = _inputs(a, dev, idx.shape[1], 2)
                    big = (*qkv, idx)
                r.update(vs_keyq(*big, gen, it["tune"]))
            if dev.type == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- a failing item is reported, the parent skips its launch
            r.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        with open(os.path.join(a.prove_dir, f"prove.{'t' if trained else 'g'}{i}.jsonl"), "a") as f:
            f.write(json.dumps(r) + "\n")
        if "error" in r and "CUDA" in r["error"]:
            break  # a sticky CUDA error: the rest of this child would fail too


def start_proofs(a, jobs: int, trained_file: str | None = None) -> tuple[list, str]:
    d = tempfile.mkdtemp(prefix="keyq2-prove-")
    extra = ["--trained-file", trained_file] if trained_file else []
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:], *extra, "--prove-part",
                               f"{i}/{jobs}", "--prove-dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for i in range(jobs)]
    return procs, d


def collect_proofs(procs, d, timeout_s: float, items: list[dict]) -> tuple[dict, dict]:
    t = time.time()
    rcs, errs = [], []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, timeout_s - (time.time() - t)))
            rcs.append(p.returncode)
            if p.returncode:
                errs.append(err[-400:])
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            rcs.append("timeout")
    done = {}
    for f in sorted(os.listdir(d)):
        for line in open(os.path.join(d, f)):
            if line.strip():
                r = json.loads(line)
                done[r["id"]] = r
    meta = {"rc": rcs, "errors": errs[:3], "wait_s": time.time() - t, "items": list(done.values()),
            "not_run": [it["id"] for it in items if it["id"] not in done]}
    return done, meta


def proven(done: dict, tunes) -> list[tuple]:
    """Launches whose every item ran and passed."""
    good = []
    for t in tunes:
        rs = [r for r in done.values() if tuple(r["tune"]) == tuple(t)]
        if rs and all(r["ok"] for r in rs):
            good.append(tuple(t))
    return good


def _log_proofs(done: dict) -> None:
    for r in sorted(done.values(), key=lambda r: r["id"]):
        log(f"prove {r['id']} {r['kind']} {r['tune']} ok={r['ok']} " +
            " ".join(f"{x}={r[x]:.2e}" for x in ("out", "dq", "dk", "dv", "dk_vs_keyq", "dv_vs_keyq") if x in r)
            + (f" ERROR {r['error']}" if "error" in r else ""))


def class_counts(off, B: int, NKT: int, BQ: int) -> dict:
    """(query, 64-key tile) pairs and BQ-query chunks per class of keyq2's lists (0 lo, 1 both, 2 hi)."""
    n = (off[1:] - off[:-1]).view(B, NKT, 3).long()
    ch = (n + BQ - 1) // BQ
    out = {}
    for c, name in enumerate(("lo", "both", "hi")):
        out[f"pairs_{name}"] = int(n[..., c].sum())
        out[f"chunks_{name}"] = int(ch[..., c].sum())
    return out


def main():
    a = parse_args()
    dev = torch.device("cpu" if a.cpu_smoke else "cuda")
    if a.prove_part:
        prove(a, dev)
        return
    from sparse_rl.bench import patterns
    from sparse_rl.bench.attention import block_pattern, block_pattern_indices
    from sparse_rl.bench.timing import bench_ms, device_name
    from sparse_rl.sparse.ops.sparse_attention import keyq, keyq2, paths
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention

    run = Run(a.out, "keyq2.json", a.budget, {"commit": a.commit, "device": device_name(dev), "argv": sys.argv[1:],
                                               "tunes": [list(t) for t in TUNES], "keyq_tune": list(KEYQ)})
    procs, pdir = start_proofs(a, a.jobs)
    B, H, Hkv, D, K = a.shape
    L = a.seqlen
    W = dict(warmup_ms=10 if dev.type == "cuda" else 1, rep_ms=a.rep_ms)
    log(f"keyq2: {run.res['device']} commit {a.commit} L {L} shape {a.shape}")
    ix, kl, gen = trained_indexer(dev, 0, 4, 64, a.train_steps)
    trained = patterns.trained_selection(ix, L, K, dev, gen)
    run.res["trained_indexer_kl"] = kl
    log(f"trained rows ready (indexer KL {kl:.3f}); waiting for the grad proofs")
    done, run.res["prove_grad"] = collect_proofs(procs, pdir, max(5.0, run.left() - 100), grad_items())
    _log_proofs(done)
    good = proven(done, TUNES)
    run.save()
    if good and run.gate(60, "trained proofs"):  # keyq2 == keyq on the 32K trained rows, in one child
        tf = os.path.join(tempfile.mkdtemp(prefix="keyq2-rows-"), "trained.pt")
        torch.save(trained.cpu(), tf)
        procs, pdir = start_proofs(a, 1, tf)
        done_t, run.res["prove_trained"] = collect_proofs(procs, pdir, max(5.0, run.left() - 60), trained_items())
        _log_proofs(done_t)
        good = [t for t in good if t in proven(done_t, TUNES)]
    else:
        good = []
    run.res["proven_tunes"] = [list(t) for t in good]
    run.save()
    if not good:
        log("no keyq2 launch is proven: only keyq and dense are timed")
    rows = run.res.setdefault("rows", {})

    def row(name, fn, **kw):
        ms = run.guarded(name, bench_ms, fn, dev, **W, **kw)
        rows.setdefault(name, []).append(ms)
        log(f"{name}: {ms if ms is None else round(ms, 3)} ms")
        run.save()
        return ms

    q, k, v = _inputs(a, dev, L, 3)[1]
    g_out = torch.randn(B, L, H, D, device=dev, generator=gen).to(q.dtype)
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

    def fwdbwd(idx, bwd, tune=None):
        return lambda: sparse_attention(qg, kg, vg, idx, fwd_path="tile", bwd_path=bwd, tune=tune)[0].backward(g_out)

    fb = [("keyq", "keyq", None)] + [(f"keyq2_{'_'.join(map(str, t))}", "keyq2", {"keyq2": t})
                                     for t in good if t[:4] == KEYQ]  # the 128-row launches in fwd+bwd
    # 2. the headline, interleaved: keyq, keyq2 (default, split) twice
    if run.gate(25, "dense"):
        d = run.guarded("dense", dense_times, q, k, v, dev, W, True)
        if d:
            run.res["dense"] = d
            log(f"dense {d}")
            run.save()
    for rep in range(2):
        for name, bwd, tune in fb:
            if run.gate(10, f"trained fwdbwd {name} #{rep}"):
                row(f"trained_fwdbwd_{name}", fwdbwd(trained, bwd, tune), grad_to_none=[qg, kg, vg])
    # 3. the pieces
    if run.gate(20, "pieces"):
        _, _, lse, do, delta, scale, prec = c1.bwd_inputs(q, k, v, trained, gen)
        row("trained_keyq_lists", lambda: keyq.key_query_lists(trained, L, 64))
        l1 = keyq.key_query_lists(trained, L, 64)
        row("trained_keyq_dkdv", lambda: keyq.keyq_dkdv(q, k, v, trained, do, lse, delta, scale, prec, tune=KEYQ,
                                                        lists=l1))
        run.res["trained_keyq_pairs"] = int(l1[0][-1])
        del l1
        row("trained_keyq2_lists", lambda: keyq2.key_query_lists2(trained, L))
        l2 = keyq2.key_query_lists2(trained, L)
        G = H // Hkv
        run.res["trained_keyq2_classes"] = cc = class_counts(l2[0], B, -(-L // 64), max(1, 128 // G))
        log(f"trained keyq2 classes (128-row chunks) {cc}")
        for t in good:
            if run.gate(8, f"keyq2 dkdv {t}"):
                row(f"trained_keyq2_dkdv_{'_'.join(map(str, t))}",
                    lambda t=t: keyq2.keyq2_dkdv(q, k, v, trained, do, lse, delta, scale, prec, tune=t, lists=l2))
        pl = run.guarded("plan", paths.plan, trained, L, Hkv, 32, is_cuda=dev.type == "cuda")
        if pl is not None:
            run.res["trained_plan"] = {"fwd": pl.fwd, "bwd": pl.bwd, "dq": pl.dq, "estimate_ms": pl.estimate_ms}
            log(f"auto's plan {run.res['trained_plan']}")
        run.save()
        del lse, do, delta, l2
    # 4. regression: per-query block rows
    if run.gate(15, "block pattern"):
        bl = 128 if L >= 4096 else 16
        fbk, cnt = block_pattern(L, bl, max(1, K // bl), dev, gen)
        bidx = block_pattern_indices(fbk, cnt, L, bl, K)
        for name, bwd, tune in fb:
            if run.gate(8, f"block fwdbwd {name}"):
                row(f"block_fwdbwd_{name}", fwdbwd(bidx, bwd, tune), grad_to_none=[qg, kg, vg])
        del bidx
    # summary
    dense = (run.res.get("dense") or {}).get("dense_fwdbwd_ms")
    log("summary (ms, each repetition; x = dense fwd+bwd / the best):")
    for name, ms in rows.items():
        best = min((m for m in ms if m is not None), default=None)
        ratio = f"{dense / best:.2f}x" if dense and best and "fwdbwd" in name else ""
        log(f"  {name:44s} {' '.join('None' if m is None else f'{m:8.3f}' for m in ms)} {ratio}")
    log(f"  dense fwd+bwd {dense}; skipped {run.res['skipped']}; errors {len(run.res['errors'])}")
    run.save()


if __name__ == "__main__":
    main()
