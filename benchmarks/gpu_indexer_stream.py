"""One device call for the streaming prefill indexer top-k (issue 15, item 1): exactness checks on the
GPU, then timings against the materialising path, the score sweep alone and dense SDPA.

    PYTHONPATH=. python benchmarks/gpu_indexer_stream.py --out $OUT [--seqlens 8192 32768 131072]

Checks: odd shapes (fp32 and bf16, left padding, q_offset, sinks/window) against the reference
(`indexer_topk_naive`, exact keys in fp32; in bf16 the chosen scores, since the reference sums in
another order) and against the materialising radix path (same score arithmetic: exact keys); at each
timed length, the stream's keys against the radix path's. Timings (bf16, B = 1, 4 x 64 index heads,
k = 2048, positive head weights as in `sparse-rl bench attention`, plus mixed-sign weights): the default
stream path and variants, its two kernels alone, the streamed score sweep alone (row maxima, no
selection), the materialising path and its score kernel alone, cuDNN/flash SDPA dense prefill.
Writes $OUT/indexer_stream.json and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from sparse_rl.bench.timing import bench_ms
from sparse_rl.sparse.ops.indexer_topk import stream as st
from sparse_rl.sparse.ops.indexer_topk import triton as it
from sparse_rl.sparse.ops.indexer_topk.naive import indexer_scores_naive, indexer_topk_naive

DEV = torch.device("cuda")


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def inputs(B, T, S, HI, DI, dtype, seed, mixed=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, T, HI, DI, device=DEV, dtype=dtype, generator=g)
    w = (torch.randn if mixed else torch.rand)(B, T, HI, device=DEV, dtype=dtype, generator=g)
    return q, w, torch.randn(B, S, DI, device=DEV, dtype=dtype, generator=g)


def chosen_scores(q, w, k, idx, q_off, kvs, sink, window):
    """The fp64 reference scores at the chosen keys (forced = +inf), sorted: equal for two valid choices."""
    sc = indexer_scores_naive(q.double(), w.double(), k.double(), q_offset=q_off, kv_start=kvs)
    B, T, S = sc.shape
    pos = torch.arange(T, device=DEV)[None, :, None] + q_off
    s = torch.arange(S, device=DEV)[None, None]
    stt = (torch.zeros(B, device=DEV) if kvs is None else kvs.to(DEV)).view(B, 1, 1)
    forced = (s >= stt) & (s <= pos) & ((s < stt + sink) | (s > pos - window))
    sc = sc.masked_fill(forced, float("inf"))
    got = torch.gather(sc, 2, idx.clamp(min=0).long())
    return torch.where(idx >= 0, got, torch.full_like(got, -1e30)).sort(-1).values


def odd_checks() -> list[dict]:
    res = []
    cases = [  # B, T, S, HI, DI, K, sink, window, kv_start, dtype, mixed
        (2, 333, 1111, 3, 20, 100, 2, 5, [0, 217], torch.float32, True),
        (2, 3000, 5000, 4, 64, 512, 4, 64, [0, 999], torch.bfloat16, True),
    ]
    for B, T, S, HI, DI, K, sink, window, kvs, dtype, mixed in cases:
        q, w, k = inputs(B, T, S, HI, DI, dtype, seed=K, mixed=mixed)
        kv = None if kvs is None else torch.tensor(kvs, device=DEV)
        q_off = S - T
        info = {}
        got = st.indexer_topk_stream(q, w, k, K, q_offset=q_off, sink=sink, window=window, kv_start=kv, info=info)
        ref = indexer_topk_naive(q.float(), w.float(), k.float(), K, q_offset=q_off, sink=sink, window=window,
                                 kv_start=kv)
        rad = it.indexer_topk(q, w, k, K, q_offset=q_off, sink=sink, window=window, kv_start=kv, topk_impl="radix")
        r = {"shape": f"B={B} T={T} S={S} HI={HI} DI={DI} K={K} sink={sink} win={window} kvs={kvs}",
             "dtype": str(dtype).split(".")[1], "mixed_w": mixed, **info,
             "rows_equal_ref": float((got == ref).all(-1).float().mean()),
             "rows_equal_radix": float((got == rad).all(-1).float().mean()),
             "chosen_scores_equal_ref": bool(torch.allclose(chosen_scores(q, w, k, got, q_off, kv, sink, window),
                                                            chosen_scores(q, w, k, ref, q_off, kv, sink, window),
                                                            rtol=1e-3 if dtype != torch.float32 else 1e-6,
                                                            atol=1e-3 if dtype != torch.float32 else 1e-6))}
        log(f"check {r}")
        res.append(r)
    return res


def dense_ms(L, W):
    from sparse_rl.bench.attention import best_dense

    g = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(1, 32, L, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 8, L, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, 8, L, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    label, _, _, _, alls = best_dense(q, k, v, lambda f: bench_ms(f, DEV, **W))
    return label, alls[label]


def timed(L: int, mixed: bool, variants: bool, K=2048) -> dict:
    HI, DI = 4, 64
    long = L > 40000
    W = dict(warmup_ms=50, rep_ms=300 if long else 200)
    Wslow = dict(warmup_ms=1, rep_ms=400 if long else 150)
    q, w, k = inputs(1, L, L, HI, DI, torch.bfloat16, seed=L + mixed, mixed=mixed)
    row: dict = {"seqlen": L, "mixed_w": mixed}
    info = {}
    sel = st.indexer_topk_stream(q, w, k, K, info=info)
    row.update({f"stream_{a}": b for a, b in info.items()})
    rad = it.indexer_topk(q, w, k, K, topk_impl="radix")
    row["rows_equal_radix"] = float((sel == rad).all(-1).float().mean())
    del rad
    row["stream_ms"] = bench_ms(lambda: st.indexer_topk_stream(q, w, k, K), DEV, **W)
    row["rowmax_ms"] = bench_ms(lambda: st.indexer_row_max(q, w, k), DEV, **W)
    row["stream_over_rowmax"] = row["stream_ms"] / row["rowmax_ms"]
    row["score_tflops_rowmax"] = 2.0 * L * L / 2 * HI * DI / row["rowmax_ms"] / 1e9
    if mixed:
        return row
    # the sweeps and the select alone
    C = st.stream_buffer_slots(K)
    cfg = st.StreamConfig()
    chunk = max(64, min(L, st.BUFFER_BUDGET_BYTES // (8 * C)) // 64 * 64)
    val = torch.empty(1, min(L, chunk), C, device=DEV)
    idx = torch.empty(1, min(L, chunk), C, device=DEV, dtype=torch.int32)
    nrow = torch.empty(1, min(L, chunk), device=DEV, dtype=torch.int32)
    th = torch.empty(1, min(L, chunk), device=DEV)
    kvs = torch.zeros(1, device=DEV, dtype=torch.int32)
    out = torch.empty(1, L, K, device=DEV, dtype=torch.int32)
    bounds = [(t0, min(L, t0 + chunk)) for t0 in range(0, L, chunk)]

    def sweeps():
        for t0, t1 in bounds:
            st._sweeps(q, w, k, kvs, t0, t1, 0, 0, 0, K, val, idx, nrow, th, cfg)

    def select():
        for t0, t1 in bounds:
            st._select(val, idx, nrow, out[:, t0:t1], K, cfg)

    row["sweeps_ms"] = bench_ms(sweeps, DEV, **W)
    row["select_ms"] = bench_ms(select, DEV, **W)
    for sw in (4, 16):
        c2 = dataclasses.replace(cfg, select_warps=sw)
        row[f"select_w{sw}_ms"] = bench_ms(lambda: [st._select(val, idx, nrow, out[:, t0:t1], K, c2)
                                                    for t0, t1 in bounds], DEV, **W)
    del val, idx
    if variants:
        for name, kw in (("dot_scan", dict(dot_scan=True)), ("R16", dict(sample_stride=16)),
                         ("target1.3", dict(target=1.3)), ("BN128", dict(block_n=128)),
                         ("statsBN128", dict(stats_block_n=128)), ("sel16", dict(select_warps=16))):
            c2 = dataclasses.replace(cfg, **kw)
            try:
                row[f"stream_{name}_ms"] = bench_ms(lambda: st.indexer_topk_stream(q, w, k, K, config=c2), DEV, **W)
            except Exception as e:  # a config that does not compile (registers, shared memory) is reported
                row[f"stream_{name}_ms"] = None
                row[f"stream_{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            log(f"L={L} {name}: {row[f'stream_{name}_ms']}")
    if not long:  # measured at 128K in run 1 (142.8 ms); it costs ~10 s of device time there
        row["materialise_ms"] = bench_ms(lambda: it.indexer_topk(q, w, k, K, topk_impl="materialise"), DEV,
                                         **Wslow)
    S_c = L
    budget_chunk = max(1, min(L, it.SCORE_BUDGET_BYTES // (4 * S_c)))
    buf = torch.empty(1, budget_chunk, L, device=DEV)

    def scores_written():
        for t0 in range(0, L, budget_chunk):
            t1 = min(L, t0 + budget_chunk)
            it.indexer_scores_chunk(q, w, k, kvs, t0, t1, t1, 0, 0, 0, out=buf[:, :t1 - t0, :t1])

    row["scores_written_ms"] = bench_ms(scores_written, DEV, **W)
    del buf
    row["dense_label"], row["dense_ms"] = dense_ms(L, Wslow)
    row["stream_vs_dense"] = row["stream_ms"] / row["dense_ms"]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--no-variants", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": [], "rows": []}
    path = os.path.join(a.out, "indexer_stream.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    res["checks"] = odd_checks()
    save()
    for L in a.seqlens:
        for mixed in (False, True):
            if mixed and L > 40000:
                continue
            log(f"L={L} mixed={mixed}")
            res["rows"].append(timed(L, mixed, variants=not a.no_variants and L == 32768))
            log(json.dumps(res["rows"][-1]))
            save()
    keys = ["seqlen", "mixed_w", "rows_equal_radix", "stream_mean_entries", "stream_redone_rows", "stream_ms",
            "sweeps_ms", "select_ms", "rowmax_ms", "stream_over_rowmax", "scores_written_ms", "materialise_ms",
            "dense_ms"]
    print("| " + " | ".join(keys) + " |")
    for r in res["rows"]:
        cells = (f"{r[k]:.3g}" if isinstance(r.get(k), float) else str(r.get(k, "-")) for k in keys)
        print("| " + " | ".join(cells) + " |")
    for r in res["rows"]:
        print({k: v for k, v in r.items() if k.startswith("stream_") and k.endswith("_ms")})
    for c in res["checks"]:
        print(c)


if __name__ == "__main__":
    main()
