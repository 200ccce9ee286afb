"""Session 19 (issue 15): where the 32K token-level prefill's kernels spend their time, by hardware counters.

The attention (`auto`: 16-query union tiles, ~8.9 ms of 12.8 at 32K on the trained indexer) runs at ~120 TF/s on
selected pairs, ~215 TF/s of the union MMA work; a back-of-envelope bound reads it near L2 bandwidth (1.87 M
32-key blocks x 16 KB of gathered K/V rows = ~31 GB in 8.9 ms = 3.4 TB/s) or issue-bound on the softmax's
elementwise work (903 SASS a block, session 12). The counters decide: `--profile` prints the kernels' CUDA times
(torch profiler, no ncu); under ncu the script marks one top-k + one attention call as the profiled range.

    PYTHONPATH=$PWD python benchmarks/gpu_ncu_session19.py --profile
    ncu --clock-control none --profile-from-start off -k regex:'_tile_fwd_kernel|_gather_words|_select_packed' \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats ... \
        python benchmarks/gpu_ncu_session19.py
    # session 20: the backward's kernels (`--backward`; -k regex:'_kq_dkdv_kernel|_tile_dq_kernel')
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from granular_harness import kernel_profile, trained_indexer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--backward", action="store_true",
                    help="profile one backward through `auto` (keyq dk/dv + the tile dq) instead of top-k + forward")
    a = ap.parse_args()
    from sparse_rl.bench import patterns
    from sparse_rl.sparse.ops import sparse_attention
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import indexer_topk_cand

    dev = torch.device("cuda")
    L, K = a.seqlen, 2048
    ix, kl, gen = trained_indexer(dev, 0, 4, 64, 150)
    qi, wi, ki = patterns.trained_index(ix, L, dev, gen)
    g = torch.Generator(device=dev).manual_seed(7)
    q, k, v = (torch.randn(1, L, h, 128, device=dev, generator=g).to(torch.bfloat16) for h in (32, 8, 8))

    def sel():
        return indexer_topk_cand(qi, wi, ki, K, sink=4, window=64)

    rows = sel()
    for _ in range(2):
        sparse_attention(q, k, v, rows, backend="triton")
    torch.cuda.synchronize()
    if a.backward:  # session 20: the trained fwd+bwd's two backward kernels (keyq dk/dv ~15 ms, dq ~9 of 33)
        for t in (q, k, v):
            t.requires_grad_(True)
        dout = torch.randn_like(q)
        if a.profile:
            print("backward", kernel_profile(
                lambda: sparse_attention(q, k, v, rows, backend="triton")[0].backward(dout), dev, top=12))
            return
        sparse_attention(q, k, v, rows, backend="triton")[0].backward(dout)  # compiles outside the range
        o = sparse_attention(q, k, v, rows, backend="triton")[0]
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        o.backward(dout)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    if a.profile:
        print("kl", kl)
        print("top-k", kernel_profile(sel, dev, top=12))
        print("attention", kernel_profile(lambda: sparse_attention(q, k, v, rows, backend="triton"), dev, top=12))
        return
    torch.cuda.cudart().cudaProfilerStart()
    sel()
    sparse_attention(q, k, v, rows, backend="triton")
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
