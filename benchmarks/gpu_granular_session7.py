"""One device slot (<= 230 s of script time) for issue 15, session 7: the granular block top-k by a sampled
threshold (`ops/indexer_topk/sampled_topk.py`, `topk_impl="sampled"`) against the radix select (the
default), end to end in prefill against dense cuDNN SDPA in the same run, at 32K and 128K.

    PYTHONPATH=. timeout 230 python benchmarks/gpu_granular_session7.py --out $OUT/gran7 --commit <hash> --budget-s 215

Why: in session 6 (benchmarks/NOTES.md item 13) the radix block top-k was the largest term of the
query-group selection (g16: 1.42 of 2.09 ms at 32K; 22.5 ms in one launch at 128K, against 2.5 ms of
block scores) and g16 / g32 at 128K were timed with the slower threshold form; with radix (the default
since) they were never timed end to end. This run times both, old (radix) and new (sampled).

Phases (one JSON, granular.json, rewritten atomically after each, so an outer timeout loses nothing):
1. checks: session 6's `select_rows` + `attend` against the fp32 reference (bf16, timed head shape,
   1008 queries, integer-valued index inputs: exact scores, ties everywhere) for each spec, and the
   granular selection with topk_impl "sampled" and "radix" against `granular_topk_naive` (rows equal);
2. the trained-pattern indexer (bench/patterns.py, 150 steps);
3. per length (32K, then 128K): dense cuDNN SDPA (fwd+bwd at 32K), then on the trained input for each
   spec and top-k form `bench.granular.granular_rows`: select, attention, prefill in one call, fwd+bwd
   of the attention (32K, first form only: the attention does not depend on the form), the selection
   and output checked on the last 64 queries;
4. per length, `granular_stages` with the forms radix and sampled (block scores, block top-k alone,
   assembly, whole selection; the forms' rows must be equal) on the trained input, and on the random
   input at 32K for g16.
Each step starts only below its share of --budget-s. Prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_granular_session6 import attention_checks, dense_times  # noqa: E402  (the same checks and dense)

T0 = time.time()
IMPLS = ("radix", "sampled")


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--budget-s", type=float, default=215.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--backward-max", type=int, default=32768, help="fwd+bwd timed at lengths <= this")
    ap.add_argument("--specs", nargs="+", default=["g16", "g32", "g64", "kb16"])
    ap.add_argument("--stage-specs", nargs="+", default=["g16", "g32", "kb16"])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--shape", type=int, nargs=5, default=[1, 32, 8, 128, 2048], metavar=("B", "H", "H_KV", "D", "K"))
    ap.add_argument("--index", type=int, nargs=2, default=[4, 64], metavar=("H_I", "D_I"))
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--check-T", type=int, default=1008)
    ap.add_argument("--check-topk", type=int, default=256, help="a multiple of every key block")
    ap.add_argument("--train-steps", type=int, default=150)
    ap.add_argument("--rep-ms", type=int, default=40)
    a = ap.parse_args(argv)
    from sparse_rl.bench.granular import parse_granularity

    for s in a.specs + a.stage_specs:
        if parse_granularity(s) == (1, 1):
            ap.error(f"spec {s}: token level has no block top-k form to compare")
    return a


def sampled_checks(a, dev) -> list[dict]:
    """The granular selection with each top-k form against the reference rule (integer-valued inputs:
    exact scores, ties everywhere) at the check shape; with top-k 256 a row keeps ~190 tokens, so rows of
    more than 512 visible blocks take the sampled path, shorter ones the register path."""
    from sparse_rl.bench.granular import parse_granularity
    from sparse_rl.sparse.ops import granular_topk
    from sparse_rl.sparse.ops.indexer_topk.naive import granular_topk_naive

    B, _, _, _, _ = a.shape
    HI, DI = a.index
    T, K = a.check_T, a.check_topk
    g = torch.Generator(device=dev).manual_seed(2)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ints = lambda *s: torch.randint(-2, 3, s, device=dev, generator=g).to(dt)  # noqa: E731
    rnd = lambda *s: torch.randn(*s, device=dev, generator=g).to(dt)  # noqa: E731
    out = []
    for kind, index in (("integer", (ints(B, T, HI, DI), ints(B, T, HI), ints(B, T, DI))),
                        ("float", (rnd(B, T, HI, DI), torch.rand(B, T, HI, device=dev, generator=g).to(dt),
                                   rnd(B, T, DI)))):
        for spec in a.specs:
            kb, G = parse_granularity(spec)
            kw = dict(sink=a.sink, window=a.window, key_block=kb, query_group=G)
            ref = granular_topk_naive(*(x.float() for x in index), K, **kw)
            r = {"input": kind, "spec": spec}
            for impl in a.impls:
                got = granular_topk(*index, K, backend="triton", topk_impl=impl, **kw)
                r[f"{impl}_rows_equal_ref"] = float((got == ref).all(-1).double().mean())
            # integer inputs: exact in any summation order, so equal rows are required; float inputs:
            # fp32 vs bf16 dots may split near-ties, so only the forms must agree with each other
            r["ok"] = (all(r[f"{i}_rows_equal_ref"] == 1.0 for i in a.impls) if kind == "integer" else
                       len({r[f"{i}_rows_equal_ref"] for i in a.impls}) == 1)
            out.append(r)
            log(str(r))
    return out


def main(argv=None):
    a = parse_args(argv)
    from sparse_rl.bench import patterns
    from sparse_rl.bench.granular import granular_rows, granular_stages, markdown_granular
    from sparse_rl.bench.timing import device_name

    dev = torch.device(a.device)
    B, H, Hkv, D, K = a.shape
    HI, DI = a.index
    res = {"device": device_name(dev), "torch": torch.__version__, "commit": a.commit, "args": vars(a),
           "checks_ok": None, "rows": [], "stages": [], "dense": {}, "skipped": []}
    import triton
    res["triton"] = triton.__version__
    os.makedirs(a.out, exist_ok=True)

    def save():
        res["wall_s"] = time.time() - T0
        tmp = os.path.join(a.out, "granular.json.tmp")
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, os.path.join(a.out, "granular.json"))

    def over(frac, what):
        if time.time() - T0 > a.budget_s * frac:
            res["skipped"].append(f"{what}: over budget at {time.time() - T0:.0f} s")
            log(f"skip {what}")
            return True
        return False

    log("checks: select_rows + attend vs the fp32 reference; the top-k forms vs the reference rule")
    res["checks"] = attention_checks(a, dev)
    res["sampled_checks"] = sampled_checks(a, dev)
    res["checks_ok"] = all(c["ok"] for c in res["checks"] + res["sampled_checks"])
    save()
    W = dict(warmup_ms=10, rep_ms=a.rep_ms)
    gen = torch.Generator(device=dev).manual_seed(0)
    log("training the trained-pattern indexer")
    ix, res["trained_indexer_kl"] = patterns.train_indexer(dev, gen, index_heads=HI, index_dim=DI,
                                                           steps=a.train_steps, crop=1024 if dev.type == "cuda" else 64)
    save()
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    lim_rows, lim_st = (0.42, 0.72), (0.80, 0.95)  # start limits (fractions of --budget-s) per length
    made = {}
    for li, L in enumerate(a.seqlens):
        lim = lim_rows[min(li, 1)]
        if over(lim - 0.1, f"L={L}"):
            continue
        log(f"L={L}: inputs + dense")
        rnd = lambda *s: torch.randn(*s, device=dev, generator=gen).to(dt)  # noqa: E731
        q, k, v = rnd(B, L, H, D), rnd(B, L, Hkv, D), rnd(B, L, Hkv, D)
        inputs = {"trained": patterns.trained_index(ix, L, dev, gen)}
        if li == 0:
            inputs["random"] = (rnd(B, L, HI, DI), torch.rand(B, L, HI, device=dev, generator=gen).to(dt), rnd(B, L, DI))
        bwd = L <= a.backward_max
        dn = dense_times(q, k, v, dev, W, bwd)
        res["dense"][str(L)] = dn
        log(f"dense {dn}")
        save()
        for spec in a.specs:
            for ii, impl in enumerate(a.impls):
                if over(lim, f"L={L} trained {spec} {impl}"):
                    continue
                kw = dict(dense_fwdbwd_ms=dn["dense_fwdbwd_ms"], grad=torch.randn_like(q)) if bwd and ii == 0 else {}
                try:
                    got = granular_rows(q, k, v, {"trained": inputs["trained"]}, [spec], K, a.sink, a.window, dev, W,
                                        dn["dense_ms"], check_n=64, select_fwdbwd=False, topk_impl=impl, **kw)
                except Exception as e:  # noqa: BLE001 -- one row's failure is reported; the others still run
                    got = [{"seqlen": L, "input": "trained", "granularity": spec, "topk_impl": impl,
                            "error": f"{type(e).__name__}: {e}"}]
                for r in got:
                    r["dense_label"] = dn["dense_label"]
                    log(", ".join(f"{x}={y:.4g}" if isinstance(y, float) else f"{x}={y}" for x, y in r.items()))
                res["rows"] += got
                save()
        made[L] = inputs
    for li, (L, inputs) in enumerate(made.items()):
        todo = [("trained", s) for s in a.stage_specs] + ([("random", "g16")] if "random" in inputs else [])
        for src, spec in todo:
            if over(lim_st[min(li, 1)], f"L={L} stages {spec} {src}"):
                continue
            log(f"L={L}: selection stages {spec} ({src} input)")
            try:
                st = granular_stages(*inputs[src], K, spec, a.sink, a.window, dev, W, impls=tuple(a.impls))
            except Exception as e:  # noqa: BLE001 -- reported, the run goes on
                st = {"seqlen": L, "granularity": spec, "error": f"{type(e).__name__}: {e}"}
            st["input"] = src
            res["stages"].append(st)
            log(str(st))
            save()
    del made
    res["markdown"] = "\n".join(markdown_granular(res["rows"]))
    save()
    print(f"checks ok: {res['checks_ok']}  skipped: {res['skipped']}  wall {time.time() - T0:.0f} s")
    print("| L | spec | top-k | select ms | attn ms | prefill ms | dense ms | speed-up | fwd+bwd speed-up | rows eq |")
    for r in res["rows"]:
        g = r.get
        print(f"| {g('seqlen')} | {g('granularity')} | {g('topk_impl')} | " + " | ".join(
            f"{g(x):.3g}" if isinstance(g(x), float) else str(g(x)) for x in
            ("select_ms", "attn_ms", "prefill_ms", "dense_ms", "prefill_speedup", "fwdbwd_speedup",
             "select_rows_equal")) + (f" | {g('error')}" if g("error") else "") + " |")
    for st in res["stages"]:
        print({x: (round(y, 3) if isinstance(y, float) else y) for x, y in st.items()
               if x.startswith(("seqlen", "gran", "input", "block_scores_ms", "top_", "select_"))})


if __name__ == "__main__":
    main()
