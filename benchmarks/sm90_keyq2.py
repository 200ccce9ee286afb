"""Registers, stack and MMA kind of keyq2.py's kernels (keyq.py's default dk/dv launch beside them) compiled for
sm_90a under the installed Triton on a CPU host (no GPU): the check that they build under the H200's Triton 3.6 and
the static profile behind the session-14 predictions (benchmarks/gpu_keyq2_session14.py). The compile helper is
sm90_keyq.py's.

    PYTHONPATH=$PWD /tmp/t36/bin/python benchmarks/sm90_keyq2.py
"""

from __future__ import annotations

import os
import sys

import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_keyq import compile_kernel  # noqa: E402

from sparse_rl.sparse.ops.sparse_attention import keyq, keyq2  # noqa: E402

# (rows, num_warps, num_stages): the brief's two launches first, then neighbours the device script may time
LAUNCHES = ((128, 8, 3), (64, 4, 2), (128, 8, 2), (64, 4, 3))


def main():
    print("triton", triton.__version__)
    for rows, warps, stages in LAUNCHES:
        for split in (0, 1):
            cx = dict(BQ=rows // 4, BLOCK_M=rows, BLOCK_D=128, PREC=0, SPLIT=bool(split))
            print(f"keyq2 dkdv BN 64 rows {rows} warps {warps} stages {stages} split {split}: "
                  f"{compile_kernel(keyq2._kq2_dkdv_kernel, cx, warps, stages, '*i64')}")
        cx = dict(BQ=rows // 4, BLOCK_M=rows, BLOCK_D=128, PREC=0, BLOCK_N=64)
        print(f"keyq  dkdv BN 64 rows {rows} warps {warps} stages {stages}: "
              f"{compile_kernel(keyq._kq_dkdv_kernel, cx, warps, stages, '*i64')}")
    for name, kern in (("count2", keyq2._kq2_count_kernel), ("compact2", keyq2._kq2_compact_kernel)):
        print(f"{name}: {compile_kernel(kern, dict(CH=1024), 4, 1, '*i64')}")


if __name__ == "__main__":
    main()
