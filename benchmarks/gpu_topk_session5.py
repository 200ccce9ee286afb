"""One device call for the binned streaming prefill top-k (issue 15 item 1, session 5): exactness on
the GPU first, then timings against the streamed score dots alone and the buffered stream path.

    PYTHONPATH=. python benchmarks/gpu_topk_session5.py --out $OUT [--budget 160]
    PYTHONPATH=. python benchmarks/gpu_topk_session5.py --report $OUT/topk_session5.json  # markdown tables

Checks (fresh random inputs): odd shapes against the fp32 reference (`indexer_topk_naive`, exact keys)
and, in bf16, against the materialising radix path (same score arithmetic) with the reference's scores
at the chosen keys compared as well (equal up to the reference's own rounding); a 4K prefill and the
timed 32K prefill against the radix path and the buffered stream path, row by row. Timings (bf16,
B = 1, 4 x 64 index heads, k = 2048, positive head weights as in `sparse-rl bench attention`; mixed-sign
weights at 32K): the streamed score sweep alone (`indexer_row_max`), the buffered stream path, the
binned path and its variants, per-kernel times from the torch profiler, and at 32K the sparse attention
on the binned selection against dense SDPA (the prefill row). Every step checks the time left in
`--budget` seconds and is skipped when it would not fit. Writes $OUT/topk_session5.json, prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpu_indexer_stream  # noqa: E402
from gpu_indexer_stream import chosen_scores, dense_ms, inputs  # noqa: E402

from sparse_rl.bench.timing import bench_ms  # noqa: E402
from sparse_rl.sparse.ops.indexer_topk import stream as st  # noqa: E402
from sparse_rl.sparse.ops.indexer_topk import stream_binned as sb  # noqa: E402
from sparse_rl.sparse.ops.indexer_topk import triton as it  # noqa: E402
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_naive  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
T_START = time.time()
SMOKE = DEV.type == "cpu"  # a CPU dry run of the script's logic (TRITON_INTERPRET=1, tiny sizes)
K = 16 if SMOKE else 2048
gpu_indexer_stream.DEV = DEV  # its input helpers draw on this device


def log(msg):
    print(f"[{time.time() - T_START:6.1f}s] {msg}", flush=True)


def rows_equal(a, b):
    return float((a == b).all(-1).float().mean())


def odd_checks() -> list[dict]:
    res = []
    cases = [  # B, T, S, HI, DI, K, sink, window, kv_start, dtype, mixed
        (2, 333, 1111, 3, 20, 100, 2, 5, [0, 217], torch.float32, True),
        (2, 3000, 5000, 4, 64, 512, 4, 64, [0, 999], torch.bfloat16, False),
        (1, 4096, 4096, 4, 64, 2048, 0, 0, None, torch.bfloat16, False),
    ]
    for i, (B, T, S, HI, DI, k_, sink, window, kvs, dtype, mixed) in enumerate(cases):
        q, w, k = inputs(B, T, S, HI, DI, dtype, seed=1000 + i, mixed=mixed)
        kv = None if kvs is None else torch.tensor(kvs, device=DEV)
        q_off = S - T
        info = {}
        got = sb.indexer_topk_binned(q, w, k, k_, q_offset=q_off, sink=sink, window=window, kv_start=kv, info=info)
        rad = it.indexer_topk(q, w, k, k_, q_offset=q_off, sink=sink, window=window, kv_start=kv, topk_impl="radix")
        r = {"shape": f"B={B} T={T} S={S} HI={HI} DI={DI} K={k_} sink={sink} win={window} kvs={kvs}",
             "dtype": str(dtype).split(".")[1], "mixed_w": mixed, **info, "rows_equal_radix": rows_equal(got, rad)}
        if B * T * S <= 2 * 3000 * 5000:
            ref = indexer_topk_naive(q.float(), w.float(), k.float(), k_, q_offset=q_off, sink=sink, window=window,
                                     kv_start=kv)
            tol = 1e-6 if dtype == torch.float32 else 1e-3
            r["rows_equal_ref"] = rows_equal(got, ref)
            r["chosen_scores_equal_ref"] = bool(torch.allclose(
                chosen_scores(q, w, k, got, q_off, kv, sink, window),
                chosen_scores(q, w, k, ref, q_off, kv, sink, window), rtol=tol, atol=tol))
        log(f"check {r}")
        res.append(r)
    return res


def profile(fn, n=3) -> list[dict]:
    """Per-kernel CUDA time (ms per call) of fn, from the torch profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            out.append({"name": e.key[:60], "ms_per_call": t / 1e3 / n, "calls_per_call": e.count / n})
    return sorted(out, key=lambda r: -r["ms_per_call"])[:8]


VARIANTS = {  # name: BinnedConfig changes (run at 32K, in this order, as the budget allows)
    "R8": dict(sample_stride=8),
    "BN64": dict(block_n=64),
    "sel2048w8": dict(select_block=2048, select_warps=8),
    "warps4": dict(warps=4),
    "R32": dict(sample_stride=32),
    "sel512w4": dict(select_block=512),
}


def left(budget):
    return budget - (time.time() - T_START)


def weights(L):
    long = L > (128 if SMOKE else 40000)
    return dict(warmup_ms=20, rep_ms=200 if long else 100)


def core(L: int, res: dict, budget: float, save, mixed=False):
    """Exactness at the timed shape, then scores alone / binned / stream timings and the binned path's
    per-kernel profile. Returns (row, (q, w, k), the binned selection)."""
    HI, DI = 4, 64
    long = L > (128 if SMOKE else 40000)
    W = weights(L)
    q, w, k = inputs(1, L, L, HI, DI, torch.bfloat16, seed=7 * L + mixed, mixed=mixed)
    row: dict = {"seqlen": L, "mixed_w": mixed}
    res["rows"].append(row)
    info = {}
    sel = sb.indexer_topk_binned(q, w, k, K, info=info)
    row.update({f"binned_{a}": b for a, b in info.items()})
    old = st.indexer_topk_stream(q, w, k, K)
    row["rows_equal_stream"] = rows_equal(sel, old)
    del old
    if not long:
        rad = it.indexer_topk(q, w, k, K, topk_impl="radix")
        row["rows_equal_radix"] = rows_equal(sel, rad)
        diff = (sel != rad).any(-1)
        if bool(diff.any()):  # differing rows: do the reference's scores at the chosen keys agree?
            close = []
            for t in diff.nonzero()[:8, 1].tolist():
                cs = lambda ix: chosen_scores(q[:, t:t + 1], w[:, t:t + 1], k, ix[:, t:t + 1], t, None, 0, 0)  # noqa: E731,B023
                close.append(bool(torch.allclose(cs(sel), cs(rad), rtol=1e-3, atol=1e-3)))
            row["differing_rows_chosen_scores_close"] = close
        del rad
    log(f"L={L} mixed={mixed} checks {row}")
    save()
    row["rowmax_ms"] = bench_ms(lambda: st.indexer_row_max(q, w, k), DEV, **W)
    row["binned_ms"] = bench_ms(lambda: sb.indexer_topk_binned(q, w, k, K), DEV, **W)
    row["binned_over_rowmax"] = row["binned_ms"] / row["rowmax_ms"]
    log(f"L={L} rowmax {row['rowmax_ms']:.3f} binned {row['binned_ms']:.3f}")
    save()
    row["stream_ms"] = bench_ms(lambda: st.indexer_topk_stream(q, w, k, K), DEV, **W)
    row["stream_over_rowmax"] = row["stream_ms"] / row["rowmax_ms"]
    log(f"L={L} stream {row['stream_ms']:.3f}")
    save()
    if not mixed and not SMOKE and left(budget) > 15:
        row["profile_binned"] = profile(lambda: sb.indexer_topk_binned(q, w, k, K), n=2)
        log(f"profile binned {row['profile_binned']}")
        save()
    return row, (q, w, k), sel


def variants(row, qwk, sel, budget, save):
    q, w, k = qwk
    for name, kw in VARIANTS.items():
        if left(budget) < 12:
            row["variants_skipped_from"] = name
            break
        c2 = dataclasses.replace(sb.BinnedConfig(), **kw)
        try:
            row[f"binned_{name}_same"] = torch.equal(sb.indexer_topk_binned(q, w, k, K, config=c2), sel)
            row[f"binned_{name}_ms"] = bench_ms(lambda: sb.indexer_topk_binned(q, w, k, K, config=c2), DEV,  # noqa: B023
                                                **weights(row["seqlen"]))
        except Exception as e:  # a config that does not compile (registers, shared memory) is reported
            row[f"binned_{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        log(f"variant {name}: {row.get(f'binned_{name}_ms')}")
        save()


def prefill(row, qi, wi, ki, sel, L, W):
    """Sparse attention (the default path) on the binned selection and dense SDPA, the bench's shapes."""
    from sparse_rl.sparse.ops import sparse_attention

    g = torch.Generator(device=DEV).manual_seed(3)
    q = torch.randn(1, L, 32, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, L, 8, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, L, 8, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    row["sparse_attn_ms"] = bench_ms(lambda: sparse_attention(q, k, v, sel, backend="triton"), DEV, **W)
    row["dense_label"], row["dense_ms"] = dense_ms(L, W)
    row["prefill_sum_ms"] = row["binned_ms"] + row["sparse_attn_ms"]
    row["prefill_speedup"] = row["dense_ms"] / row["prefill_sum_ms"]
    log(f"L={L} attention {row['sparse_attn_ms']:.2f} dense {row['dense_ms']:.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--budget", type=float, default=160.0, help="seconds: steps that would not fit are skipped")
    ap.add_argument("--report", help="print the markdown tables of a JSON this script wrote, and exit")
    a = ap.parse_args()
    if a.report:
        with open(a.report) as f:
            print(markdown(json.load(f)))
        return
    os.makedirs(a.out, exist_ok=True)
    res = {"device": "cpu" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__, "checks": [], "rows": []}
    path = os.path.join(a.out, "topk_session5.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    short, long = (96, 160) if SMOKE else (32768, 131072)

    def step(name, fn, *args):
        """One step; a failure is recorded and the later steps still run."""
        try:
            return fn(*args)
        except Exception:
            import traceback

            res.setdefault("errors", {})[name] = traceback.format_exc()[-2000:]
            log(f"error in {name}: {traceback.format_exc()[-400:]}")
            save()

    if not SMOKE:
        res["checks"] = step("checks", odd_checks) or []
        save()
    first = step("core32k", core, short, res, a.budget, save)
    if left(a.budget) > 45:
        step("core128k", core, long, res, a.budget, save)
    if first is not None:
        row32, qwk32, sel32 = first
        if left(a.budget) > 25 and not SMOKE:
            step("prefill", prefill, row32, *qwk32, sel32, short, weights(short))
            save()
        step("variants", variants, row32, qwk32, sel32, a.budget, save)
    if left(a.budget) > 15:
        step("mixed32k", core, short, res, a.budget, save, True)
    save()
    print(markdown(res))
    print(f"total {time.time() - T_START:.0f}s")


def _cell(v):
    return f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))


def _table(keys, rows):
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return lines + ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]


def markdown(res: dict) -> str:
    """The measured numbers as the markdown tables of a results file (also `--report JSON`)."""
    out = [f"Device: {res['device']}, torch {res['torch']}.", "", "Checks (odd shapes):", ""]
    out += _table(["shape", "dtype", "mixed_w", "rows_equal_ref", "chosen_scores_equal_ref", "rows_equal_radix",
                   "redone_rows", "boundary_rows"], res["checks"])
    out += ["", "Timed shapes (B = 1, 4 x 64 index heads, k = 2048, bf16, causal; ms, do_bench medians):", ""]
    out += _table(["seqlen", "mixed_w", "rows_equal_radix", "rows_equal_stream", "binned_redone_rows",
                   "binned_boundary_rows", "rowmax_ms", "binned_ms", "binned_over_rowmax", "stream_ms",
                   "stream_over_rowmax", "sparse_attn_ms", "dense_ms", "prefill_sum_ms", "prefill_speedup"], res["rows"])
    for r in res["rows"]:
        var = {k: v for k, v in r.items() if k.startswith("binned_") and (k.endswith("_ms") or "error" in k)
               and k != "binned_ms"}
        if var:
            out += ["", f"Variants at {r['seqlen']} (default binned {_cell(r.get('binned_ms'))} ms): "
                    + ", ".join(f"{k[7:]} {_cell(v)}" for k, v in var.items())]
        if r.get("profile_binned"):
            out += ["", f"Per-kernel CUDA time of one binned call at {r['seqlen']} (torch profiler):", ""]
            out += _table(["name", "ms_per_call", "calls_per_call"], r["profile_binned"])
    for name, err in res.get("errors", {}).items():
        out += ["", f"Error in {name}:", "", "```", err[-1500:], "```"]
    return "\n".join(out)


if __name__ == "__main__":
    main()
