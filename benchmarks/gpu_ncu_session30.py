"""Session 30 (lead), issue 15: why the Gluon tile forward (`union_gluon.tile_fwd_gluon`, cp.async ring + warpgroup
MMAs, fewer SASS instructions a key than Triton's loop) is no faster than the Triton tile forward (call 1: 6.42 ms
at its best tune, 32 keys x 2 stages, against 6.34; more stages and the PIPE form slower), why its tile dq is 16 %
faster, and (session 31) whether the keyq dk / dv (the backward's largest term, 14.8 ms) is held by its q / dO
gathers' DRAM bytes (38 GB, 2.6 TB/s if none hit L2) or by its MMAs. Under ncu the profiled range holds one call
of each form on the bench's trained 32K selection (B 1, 32 / 8 heads, D 128, k 2048, bf16, 16-query tiles):
Triton forward, Gluon forward 32x2 and 64x2, Triton dq, Gluon dq 64x2, Triton keyq dk / dv, Gluon keyq dk / dv,
then the three Gluon kernels with PREFETCH (forward 32x2, dq 64x2, dk / dv on 128 and on 64 rows, and on 64 rows x 32 keys).

    ncu --clock-control none --profile-from-start off -k regex:'_tile_(fwd|dq)|_kq_dkdv' --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis python3 benchmarks/gpu_ncu_session30.py
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from granular_harness import trained_indexer  # noqa: E402


def main():
    from sparse_rl.bench import patterns
    from sparse_rl.sparse.ops.sparse_attention import keyq, keyq_gluon, union, union_gluon
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

    dev = torch.device("cuda")
    L, K, D = 32768, 2048, 128
    ix, _, gen = trained_indexer(dev, 0, 4, 64, 150)
    idx = patterns.trained_selection(ix, L, K, dev, gen)
    g = torch.Generator(device=dev).manual_seed(7)
    q, k, v = (torch.randn(1, L, h, D, device=dev, generator=g).bfloat16() for h in (32, 8, 8))
    scale, prec = 1 / math.sqrt(D), dot_precision(q.dtype)
    sel = union.build_union(idx, L, 16)
    o, lse = union.tile_fwd(q, k, v, sel, scale, prec)
    do = torch.randn(o.shape, device=dev, generator=g).bfloat16()
    delta = (o.float() * do.float()).sum(-1).contiguous()
    lists = keyq.key_query_lists(idx, L, 64)
    lists32 = keyq.key_query_lists(idx, L, 32)
    calls = [lambda: union.tile_fwd(q, k, v, sel, scale, prec),
             lambda: union_gluon.tile_fwd_gluon(q, k, v, sel, scale, tune=(32, 2)),
             lambda: union_gluon.tile_fwd_gluon(q, k, v, sel, scale, tune=(64, 2)),
             lambda: union.tile_dq(q, k, v, sel, do, lse, delta, scale, prec),
             lambda: union_gluon.tile_dq_gluon(q, k, v, sel, do, lse, delta, scale, tune=(64, 2)),
             lambda: keyq.keyq_dkdv(q, k, v, idx, do, lse, delta, scale, prec, lists=lists),
             lambda: keyq_gluon.keyq_dkdv_gluon(q, k, v, idx, do, lse, delta, scale, lists=lists),
             # session 31: the same Gluon kernels with their lists read ahead (PREFETCH)
             lambda: union_gluon.tile_fwd_gluon(q, k, v, sel, scale, tune=(32, 2, 0, 1)),
             lambda: union_gluon.tile_dq_gluon(q, k, v, sel, do, lse, delta, scale, tune=(64, 2, 1)),
             lambda: keyq_gluon.keyq_dkdv_gluon(q, k, v, idx, do, lse, delta, scale, tune=(2, None, 1), lists=lists),
             lambda: keyq_gluon.keyq_dkdv_gluon(q, k, v, idx, do, lse, delta, scale, tune=(2, None, 1, 64),
                                                lists=lists),
             lambda: keyq_gluon.keyq_dkdv_gluon(q, k, v, idx, do, lse, delta, scale, tune=(2, None, 1, 64, 32),
                                                lists=lists32),
             lambda: keyq_gluon.keyq_dkdv_gluon(q, k, v, idx, do, lse, delta, scale, tune=(2, None, 1, 128, 64, 1),
                                                lists=lists)]  # the warp-specialized form (keyq_gluon_ws)
    for fn in calls:  # compiled outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled", len(calls), "calls")


if __name__ == "__main__":
    main()
