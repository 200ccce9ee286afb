"""Session 32 (lead), issue 15: keyq's query-list bits pass (`keyq._kq_bits_kernel`) with atomics at the ends of
each run of a row's keys in one 32-bit word (prefix sums: the run's end adds, its start subtracts) instead of one
atomic OR a key, against the previous kernel (kept below, verbatim, as the baseline) on the trained indexer's rows,
B 1, k 2048; then forward + backward through the autograd function (`auto`, the defaults) against dense cuDNN in the
same run.

Why: session 12 measured the keyq lists at 0.96 ms at 32K, 0.82 of it the bits pass (one atomic a selected pair: 67
M, a warp's lanes on a few words, since a row is ascending), against 0.26 ms for the union's qmask pass, whose 67 M
atomics go to distinct slots; session 30 put the lists at ~1.1 ms of the H100's 30.7 ms fwd + bwd. The new pass
issues about as many instructions as the old (sm_90a SASS, Triton 3.6: ~2.4 vs ~2.5 warp instructions a key) and
at most 2 atomics a run (`runs_w32`) instead of one a key (`pairs`): CPU replay of the trained 32K rows, 7.1 M
atomics against 65 M.

Predictions (before the first call, H100, 32K trained): bits 0.8-0.9 -> 0.2-0.3 ms; whole lists ~1.1 -> 0.4-0.6;
fwd + bwd -0.5 to -0.7 ms (28.3-28.8 -> ~27.7-28.3; 2x dense = ~27.6).

    PYTHONPATH=$PWD python3 benchmarks/gpu_lists_session32.py --budget 200 --out $OUT/ls32
    TRITON_INTERPRET=1 python benchmarks/gpu_lists_session32.py --device cpu --seqlens 512 --steps 2   # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from granular_harness import Run, log, trained_indexer  # noqa: E402


@triton.jit
def _old_kq_bits_kernel(IDX, M, T, NK, S, NKT, sib, sit, sik, BN: tl.constexpr, BQ: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """keyq's bits pass before this session (193effd): one atomic OR a selected key."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    for i in range(0, BQ):
        t = pid * BQ + i
        if t < T:
            for k0 in range(0, NK, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                idx = tl.load(IDX + b * sib + t * sit + offs * sik, mask=offs < NK, other=-1)
                ok = (idx >= 0) & (idx < S)
                j = tl.where(ok, idx // BN, 0).to(tl.int64)
                if BN == 64:
                    one = tl.full([BLOCK_K], 1, tl.int64) << (idx % BN).to(tl.int64)
                else:
                    one = tl.full([BLOCK_K], 1, tl.int32) << (idx % BN)
                tl.atomic_or(M + (b * NKT + j) * T + t, one, mask=ok, sem="relaxed")


def _old_bits(idx, S: int, BN: int, cuda: bool):
    """keyq's `[B, NKT, T]` words by the old kernel at its old launch (256 keys a block)."""
    import torch

    B, T, K = idx.shape
    NKT = triton.cdiv(S, BN)
    m = torch.zeros(B, NKT, T, dtype=torch.int64 if BN == 64 else torch.int32, device=idx.device)
    BQ, BK = (16, 256) if cuda else (4, 32)
    _old_kq_bits_kernel[(triton.cdiv(T, BQ), B)](idx, m, T, K, S, NKT, *idx.stride(), BN=BN, BQ=BQ, BLOCK_K=BK,
                                                 num_warps=4)
    return m


def _runs(idx, W: int) -> int:
    """Runs of equal W-key words among the rows' valid keys (block edges aside): the new pass takes at most two
    atomics a run."""
    ok = idx >= 0
    w = (idx // W).masked_fill(~ok, -1)
    new = ok.clone()
    new[..., 1:] &= w[..., 1:] != w[..., :-1]
    return int(new.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ls32"))
    ap.add_argument("--budget", type=float, default=200.0)
    ap.add_argument("--seqlens", default="32768,131072")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=150, help="indexer training steps (the bench's trained pattern)")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from sparse_rl.bench import patterns
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.sparse_attention import keyq
    from sparse_rl.sparse.ops.sparse_attention import triton as sa

    os.makedirs(a.out, exist_ok=True)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    H, H_kv, D = 32, 8, 128
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else "cpu"}
    run = Run(a.out, "ls32.json", a.budget, meta)
    ix, _, gen = trained_indexer(dev, 0, 4, 64, a.steps)
    W = dict(rep_ms=200)
    for L in [int(x) for x in a.seqlens.split(",")]:
        if not run.gate(30 if L <= 32768 else 120, f"trained {L}"):
            continue
        K = min(2048, L // 4)
        row = {"L": L, "K": K}
        try:
            idx = patterns.trained_selection(ix, L, K, dev, gen)
            row.update(pairs=int((idx >= 0).sum()), runs_w32=_runs(idx, 32),
                       ascending=bool((idx[..., 1:] >= idx[..., :-1]).logical_or(idx[..., 1:] < 0).all()))
            fns = {"kq_bits_old": lambda: _old_bits(idx, L, 64, cuda),
                   "kq_bits_new": lambda: keyq.query_bits(idx, L, 64),
                   "kq_bits32_old": lambda: _old_bits(idx, L, 32, cuda),
                   "kq_bits32_new": lambda: keyq.query_bits(idx, L, 32)}
            for bn in ("", "32"):
                row[f"kq_bits{bn}_equal"] = bool(torch.equal(fns[f"kq_bits{bn}_old"](), fns[f"kq_bits{bn}_new"]()))
            fns["kq_lists"] = lambda: keyq.key_query_lists(idx, L, 64)
            for _ in range(a.reps):
                for lab, fn in fns.items():
                    row.setdefault(f"{lab}_ms", []).append(bench_ms(fn, dev, **W))
            if cuda and L <= 32768:  # what the target counts: forward + backward through auto vs dense
                g = torch.Generator(device=dev).manual_seed(7)
                q, k, v = (torch.randn(1, L, h, D, device=dev, generator=g).bfloat16() for h in (H, H_kv, H_kv))
                do = torch.randn(q.shape, device=dev, generator=g).bfloat16()
                qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                qd, kd, vd = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                dod = do.transpose(1, 2)
                fb = {"fwdbwd_auto": (lambda: sa.sparse_attention(qg, kg, vg, idx)[0].backward(do), [qg, kg, vg]),
                      "dense_fwdbwd": (lambda: F.scaled_dot_product_attention(
                          qd, kd, vd, is_causal=True, enable_gqa=True).backward(dod), [qd, kd, vd])}
                for _ in range(a.reps):
                    for lab, (fn, gs) in fb.items():
                        row.setdefault(f"{lab}_ms", []).append(bench_ms(fn, dev, grad_to_none=gs, **W))
                row["fwdbwd_speedup"] = min(row["dense_fwdbwd_ms"]) / min(row["fwdbwd_auto_ms"])
                del q, k, v, do, qg, kg, vg, qd, kd, vd
        except Exception as e:  # noqa: BLE001 (a failure is a result)
            row["error"] = repr(e)[:600]
        log(f"trained {L}: {row}")
        run.res.setdefault("rows", []).append(row)
        run.save()
        if cuda:
            torch.cuda.empty_cache()
    run.save()
    print(json.dumps(run.res.get("rows")))


if __name__ == "__main__":
    main()
