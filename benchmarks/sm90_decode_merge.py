"""The decode attention (`sparse_attention/triton.py:_fwd_kernel`) compiled for sm_90a on a CPU host (no GPU), with
and without the fused merge (MERGE: the last program of each (row, kv head) merges the split partials): registers
/ stack (cuobjdump), shared memory, the atomics. Qwen3-4B's decode shape: G = 4 heads a KV head (BLOCK_H 16), D 128,
128-key blocks, 4 warps, 2 stages; NSPLIT 8 (batch 1 at 2K keys: 8 splits).

    PYTHONPATH=$PWD /tmp/t36/bin/python benchmarks/sm90_decode_merge.py        (Triton 3.6.0, the H200's)
"""

from __future__ import annotations

import inspect
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparse_rl.sparse.ops.sparse_attention import triton as SA

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_swapab import cubin_usage  # noqa: E402

PTRS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "IDX": "*i32", "O": "*fp32", "LSE": "*fp32", "CNT": "*i32",
        "OF": "*bf16", "LF": "*fp32"}
UNIT = ("sqd", "skd", "svd", "sik", "sod")  # unit strides: specialized to 1 by a real launch


def compile_fwd(merge: bool, nsplit: int = 8) -> dict:
    names = list(inspect.signature(SA._fwd_kernel.fn).parameters)
    cx = dict(NSPLIT=nsplit, BLOCK_H=16, BLOCK_K=128, BLOCK_D=128, PREC=0, PDL=1, MERGE=merge,
              NSP2=max(2, triton.next_power_of_2(nsplit)), **{n: 1 for n in UNIT})
    if not merge:
        cx.update(CNT=None, OF=None, LF=None)
    sig = {n: "constexpr" if n in cx else PTRS.get(n, "fp32" if n == "qk_scale" else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n not in cx and n not in ("qk_scale",)}
    k = triton.compile(ASTSource(SA._fwd_kernel, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=2))
    regs, stack, sass = cubin_usage(k)
    return {"regs": regs, "stack": stack, "smem": k.metadata.shared,
            "ATOM": len(re.findall(r"\bATOM", sass)) + len(re.findall(r"\bRED\b", sass)),
            "LDG": len(re.findall(r"LDG\.", sass))}


def main():
    for merge in (False, True):
        print(f"triton {triton.__version__} _fwd_kernel MERGE {merge:d}: {compile_fwd(merge)}", flush=True)


if __name__ == "__main__":
    main()
