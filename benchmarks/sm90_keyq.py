"""Registers, stack and MMA kind of keyq.py's kernels (and keymajor.py's "dt" dk/dv kernel beside them) compiled
for sm_90a under the installed Triton on a CPU host (no GPU): the check that they build under the H200's Triton 3.6
and the static profile behind the session-12 predictions (benchmarks/gpu_bwd12_session12.py).

    PYTHONPATH=$PWD /tmp/t36/bin/python benchmarks/sm90_keyq.py
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparse_rl.sparse.ops.sparse_attention import keymajor, keyq

BF16 = ("Q", "K", "V", "DO", "DK", "DV")
FP32 = ("LSE", "DELTA")
FLOATS = ("scale", "qk_scale")


def compile_kernel(kern, constexprs: dict, num_warps: int, num_stages: int, msk: str = "*i32") -> str:
    sig, cx, attrs = {}, {}, {}
    for i, n in enumerate(inspect.signature(kern.fn).parameters):
        if n in constexprs:
            cx[n], sig[n] = constexprs[n], "constexpr"
            continue
        if n.startswith("s") and n.endswith("d") and len(n) <= 5:  # the head dim's stride: 1, specialised
            cx[n], sig[n] = 1, "constexpr"
            continue
        if n not in FLOATS and n not in ("G", "QG", "q_off", "T"):  # the launch's 16-divisible pointers and ints
            attrs[(i,)] = [["tt.divisibility", 16]]
        if False:
            pass
        elif n in BF16:
            sig[n] = "*bf16"
        elif n in FP32:
            sig[n] = "*fp32"
        elif n in FLOATS:
            sig[n] = "fp32"
        elif n in ("MSK", "M"):
            sig[n] = msk
        elif n in ("IDX", "OFF", "LIST", "CNT", "BITS", "PREF", "QMASK", "NFULL"):
            sig[n] = "*i32"
        else:
            sig[n] = "i32"
    k = triton.compile(ASTSource(kern, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    cubin = "/tmp/_sm90_keyq.cubin"
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    ptx = k.asm["ptx"]
    mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    cp = "cp.async" if "cp.async" in ptx else "no cp.async"
    return (f"regs {m.group(1)} stack {m.group(2)}" if m else out.strip()[-200:]) + \
        f" {mma} {cp} shared {k.metadata.shared} B"


def main():
    print("triton", triton.__version__)
    for BN in (16, 32, 64):
        msk = "*i64" if BN == 64 else "*i32"
        for name, kern, cx in (("bits", keyq._kq_bits_kernel, dict(BN=BN, BQ=16, BLOCK_K=256)),):
            print(f"{name} BN {BN}: {compile_kernel(kern, cx, 4, 1, msk)}")
        for rows, warps, stages in ((128, 8, 2), (128, 8, 3), (128, 4, 2), (64, 4, 2), (64, 4, 3)):
            cx = dict(BQ=rows // 4, BLOCK_M=rows, BLOCK_N=BN, BLOCK_D=128, PREC=0)
            print(f"keyq dkdv BN {BN} rows {rows} warps {warps} stages {stages}: "
                  f"{compile_kernel(keyq._kq_dkdv_kernel, cx, warps, stages, msk)}")
    for name, kern in (("count", keyq._kq_count_kernel), ("compact", keyq._kq_compact_kernel)):
        print(f"{name}: {compile_kernel(kern, dict(CH=1024), 4, 1, '*i64')}")
    cx = dict(BT=32, BLOCK_M=128, BLOCK_N=64, BLOCK_D=128, SHARED=False, PREC=0, TRANSPOSED=True, SPLIT=False,
              DENSE=False)
    print(f"keymajor dt (64, 8, 2) 128 rows: {compile_kernel(keymajor._dkdv_kernel, cx, 8, 2)}")


if __name__ == "__main__":
    main()
