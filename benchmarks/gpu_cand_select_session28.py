"""Session 28 (lead), issue 15: the prefill top-k's buffer select as one CUDA block a row (`cand_cuda.buffer_topk`,
`CandConfig(select_impl="cuda")`) against the Triton select (`_select_packed_kernel`, the default), in one call.

Why: at 32K the token-level prefill spends ~3.5 ms in indexer + top-k against a 0.77 ms score sweep; the buffer
select was 1.21 ms of it (H200, session 19): a bit search of ~28 dependent block-wide `tl.sum`s a row at ~2
programs an SM. The CUDA form's steps are a compare per register slot, a `redux.sync` and one barrier, the last 32
open keys ranked by shuffles, and one ballot scan for the write.

1. select alone on the default's buffers (threshold + gather of the whole 32K rows at once), trained and random
   inputs: rows equal (served rows), ms of each;
2. whole top-k (`indexer_topk_cand`), default vs select_impl="cuda": rows equal, ms;
3. prefill (top-k + `sparse_attention`), both, and dense cuDNN SDPA in the same run.

Predictions (before call 1, H100): the select alone ~0.2-0.4 ms at 32K (from 1.0-1.3), the whole top-k -0.8 to
-1.0 ms, the 32K prefill 10.7 -> ~9.8 ms (1.35x -> ~1.47x dense); at 128K random the select ~1.5 ms from ~4.8.
Call 1 (bit steps, H100): select 1.22 -> 0.87 ms at 32K trained, 4.84 -> 3.56 at 128K; rows equal everywhere;
whole top-k 3.90 -> 3.50. Wrong by ~2.5x: ~25 dependent bit steps a row (one barrier each), 4 blocks an SM.
Call 2: 4-bit digits a step (16 bins counted in per-thread byte counters, summed as 16-bit pairs by `redux.sync`)
and 8 entries a thread (512-thread blocks) beside 16. Measured: SLOWER, 1.24 ms at 32K trained (bit steps 0.87),
8 entries a thread 1.87; 128K 5.07 / 7.66. Predicted 0.4-0.5: wrong. So the kernel is bound by instructions a key
(each step visits all 16 slots of every thread), not by its barriers; more threads a row only add per-row work.
Call 3: every key visited a fixed number of times: one 2048-bin shared histogram of the 11 bits below the row's
highest differing bit (one atomic a key), a block suffix scan over per-thread runs of bins for the K-th's bin,
bit steps only where that bin holds more than 32 keys, then the rank and the write. Predicted: select ~0.35-0.5
ms at 32K (from 0.87 / 1.22), ~1.5-2 at 128K. Measured: 0.755 ms at 32K trained (Triton 1.22), 3.11 at 128K
trained (4.84); rows equal; whole top-k 3.45-3.66 -> 2.96-2.98 ms at 32K. Its DRAM floor: the buffer's 786 MB
(int64 entries, ~2.9K a row) + 268 MB of output, ~0.35 ms at the H100's copy rate.
Call 4: the keys in shared memory (32 registers: 8 blocks of 256 an SM instead of 4, so one block's loads overlap
another's compute), at 16 and 8 entries a thread. Predicted: 0.45-0.55 ms at 32K. Measured 0.732 (16) / 0.926 (8)
against 0.754 in registers; the CLI's 32K prefill 1.40x (idx + top-k 3.09 ms).
Call 5 (branch cuda-quantile, not yet run): the same k-th search for the sampled quantile (`sample_kth`,
`CandConfig.quantile_impl`), the threshold phase timed with either quantile (the thresholds bitwise equal). Predicted: threshold phase -0.25 to -0.35 ms at
32K (the Triton quantile ~0.47 of it, session 19).

    PYTHONPATH=$PWD python3 benchmarks/gpu_cand_select_session28.py --budget 300 --out $OUT/cs28
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run, log, trained_indexer  # noqa: E402
from gpu_select_session18 import buffers  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cs28"))
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--seqlens", default="32768,131072")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from sparse_rl.bench import patterns
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops import sparse_attention
    from sparse_rl.sparse.ops.indexer_topk import cand_cuda
    from sparse_rl.sparse.ops.indexer_topk import cand_topk as ct

    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    K, H, H_kv, D, sink, window = 2048, 32, 8, 128, 4, 64
    run = Run(a.out, "cs28.json", a.budget, {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()})
    ix, _, gen = trained_indexer(dev, 0, 4, 64, 150)
    W = dict(rep_ms=200)
    cuda_cfg = dataclasses.replace(ct.CandConfig(), select_impl="cuda", quantile_impl="cuda")
    # main's default before this branch: the CUDA select, the Triton quantile
    sel_cfg = dataclasses.replace(ct.CandConfig(), select_impl="cuda", quantile_impl="triton")
    for L in [int(x) for x in a.seqlens.split(",")]:
        for kind in ("trained", "random"):
            if not run.gate(60 if L <= 32768 else 120, f"{kind} {L}"):
                continue
            if kind == "trained":
                qi, wi, ki = patterns.trained_index(ix, L, dev, gen)
            else:
                g = torch.Generator(device=dev).manual_seed(L)
                qi = torch.randn(1, L, 4, 64, device=dev, generator=g).bfloat16()
                wi = torch.randn(1, L, 4, device=dev, generator=g).bfloat16()
                ki = torch.randn(1, L, 64, device=dev, generator=g).bfloat16()
            row = {"L": L, "kind": kind}
            try:
                th, smp, val, nrow, kvs, C = buffers(qi, wi, ki, K, sink, window, dev)
                served = (nrow >= 0)[..., None]
                outs = {}
                tri_cfg = dataclasses.replace(ct.CandConfig(), select_impl="triton", quantile_impl="triton")
                sels = {"triton": lambda o: ct.cand_select(val, val, nrow, o, K, tri_cfg),
                        "cuda": lambda o: ct.cand_select(val, val, nrow, o, K, cuda_cfg),
                        "cuda8": lambda o: cand_cuda.buffer_select(val, nrow, o, K, lpt=8)}
                for lab, sel in sels.items():
                    out = torch.full((1, L, K), -7, device=dev, dtype=torch.int32)
                    sel(out)
                    torch.cuda.synchronize()
                    outs[lab] = out
                    row[f"select_{lab}_ms"] = [bench_ms(lambda: sel(out), dev, **W) for _ in range(a.reps)]
                for lab in ("cuda", "cuda8"):
                    row[f"select_{lab}_equal"] = bool(torch.equal(torch.where(served, outs[lab], 0),
                                                                  torch.where(served, outs["triton"], 0)))
                for lab in ("triton", "cuda"):  # the threshold phase (sample + quantile), each quantile kernel
                    qcfg = dataclasses.replace(ct.CandConfig(), quantile_impl=lab)
                    th2 = torch.empty_like(th)
                    qfn = lambda: ct.cand_threshold(qi, wi, ki, kvs, 0, L, 0, sink, window, K, C, th2, smp, qcfg)  # noqa: E731
                    qfn()
                    torch.cuda.synchronize()
                    row[f"threshold_{lab}_equal"] = bool(torch.equal(th2.view(torch.int32), th.view(torch.int32)))
                    row[f"threshold_{lab}_ms"] = [bench_ms(qfn, dev, **W) for _ in range(a.reps)]
                row["rows_flagged"] = int((nrow < 0).sum())
                row["mean_entries"] = float(nrow[nrow >= 0].float().mean())
                del val, smp, outs
                torch.cuda.empty_cache()
                tk = {lab: (lambda cfg=cfg: ct.indexer_topk_cand(qi, wi, ki, K, sink=sink, window=window, config=cfg))
                      for lab, cfg in (("triton", tri_cfg), ("cuda", cuda_cfg), ("selcuda", sel_cfg))}
                r_t, r_c, r_s = tk["triton"](), tk["cuda"](), tk["selcuda"]()
                row["topk_equal"] = bool(torch.equal(r_t, r_c)) and bool(torch.equal(r_t, r_s))
                for lab, fn in tk.items():
                    row[f"topk_{lab}_ms"] = [bench_ms(fn, dev, **W) for _ in range(a.reps)]
                log(f"{kind} {L}: {row}")
                if kind == "trained":
                    gq = torch.Generator(device=dev).manual_seed(7)
                    q, k, v = (torch.randn(1, L, h, D, device=dev, generator=gq).bfloat16() for h in (H, H_kv, H_kv))
                    qd, kd, vd = (t.transpose(1, 2) for t in (q, k, v))
                    pf = {lab: (lambda fn=fn: sparse_attention(q, k, v, fn(), backend="triton")[0])
                          for lab, fn in tk.items()}
                    pf["dense"] = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
                    for rep in range(a.reps):
                        for lab, fn in pf.items():
                            row.setdefault(f"prefill_{lab}_ms", []).append(bench_ms(fn, dev, **W))
                    del q, k, v, qd, kd, vd
            except Exception as e:  # noqa: BLE001 (a failure is a result)
                row["error"] = repr(e)[:400]
            log(f"{kind} {L}: {row}")
            run.res.setdefault("rows", []).append(row)
            run.save()
            torch.cuda.empty_cache()
    run.save()
    print(json.dumps(run.res.get("rows")))


if __name__ == "__main__":
    main()
