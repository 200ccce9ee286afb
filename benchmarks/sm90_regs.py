"""Registers and stack of the fine decode select's kernels compiled for sm_90a on a CPU host (no GPU needed):
the old form (`decode_split._hist_chunk`, `decode_fine._sub_gather`, `decode_fine._resolve_write`) and
decode_fine_once's, at 32 x 16K's constants (1024-key chunks, 16 of them), 4 warps, with the installed Triton.

Why: the register counts decide how many of a pass's (chunk, row) programs an SM holds (64K registers: <= 128 a
thread gives 4 programs of 4 warps, 129-168 three, 169-255 two), so whether 32 x 16K's 512 programs run in one
wave. They differ between Triton versions: the H200 runs Triton 3.6, this repository's CPU tests 3.9, and the
counts the session-9 notes quote (128 for `_resolve_write` at CB 32) are 3.9's; 3.6 gives 147 (session 11). To
see the device's numbers, run this under its Triton in a separate environment:

    python -m venv --system-site-packages /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    PYTHONPATH=$PWD /tmp/t36/bin/python benchmarks/sm90_regs.py [--pdl] [--maxnreg 128]

It also proves that every kernel compiles under that Triton (session 11's first device call failed at the
compile of `_resolve_write` on 3.6: a nested jit call's defaulted constexpr, which 3.9 accepts).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparse_rl.sparse.ops.indexer_topk import decode as _decode  # noqa: F401 (the package's import order)
from sparse_rl.sparse.ops.indexer_topk import decode_fine as F
from sparse_rl.sparse.ops.indexer_topk import decode_fine_once as O
from sparse_rl.sparse.ops.indexer_topk import decode_split as SP

CONST = dict(CH=1024, NB=128, NB2=128, PMAX=16, CAPB=32, CB=32, BLOCK=1024)
FP32 = ("SC", "SPAN")
INTS = ("S", "K", "P", "sob")


def compile_kernel(kern, constexprs: dict, num_warps: int = 4, **options) -> str:
    """`kern` compiled for sm_90a with these constexprs (the rest: int32 pointers / scalars) -> "regs N stack M"."""
    sig, cx = {}, {}
    for n in inspect.signature(kern.fn).parameters:
        if n in constexprs:
            cx[n], sig[n] = constexprs[n], "constexpr"
        else:
            sig[n] = "i32" if n in INTS else "*fp32" if n in FP32 else "*i32"
    k = triton.compile(ASTSource(kern, sig, cx), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, **options))
    return resources(k)


def resources(k) -> str:
    """A kernel compiled for sm_90a (`triton.compile`) -> "regs N stack M" (cuobjdump's resource usage)."""
    cubin = "/tmp/_sm90_regs.cubin"
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    return f"regs {m.group(1)} stack {m.group(2)}" if m else out.strip()[-200:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdl", action="store_true", help="compile the PDL=True forms")
    ap.add_argument("--maxnreg", type=int, default=0, help="a register cap for every kernel (0: none)")
    a = ap.parse_args()
    opts = {"maxnreg": a.maxnreg} if a.maxnreg else {}
    cases = []
    for bn in (256, 1024):
        cases += [("hist_chunk", SP._hist_chunk, {"BN": bn}), ("sub_gather", F._sub_gather, {"BN": bn}),
                  ("resolve_write", F._resolve_write, {"BN": bn}), ("resolve_rows", O._resolve_rows, {}),
                  ("write_once", O._write_once, {"BN": bn})]
        for t, pf in itertools.product((False, True), (False, True)):
            cases.append((f"hist_tick TICKS={t} PREFETCH={pf}", O._hist_tick, {"BN": bn, "TICKS": t, "PREFETCH": pf}))
            cases.append((f"gather_once ARRIVE={t} PREFETCH={pf}", O._gather_once,
                          {"BN": bn, "ARRIVE": t, "PREFETCH": pf}))
    errors = 0
    for name, kern, extra in cases:
        cx = dict(CONST, **extra)
        if "PDL" in inspect.signature(kern.fn).parameters:
            cx["PDL"] = a.pdl
        try:
            res = compile_kernel(kern, cx, **opts)
        except Exception as e:  # noqa: BLE001 -- reported, the others still compile
            errors += 1
            res = f"ERROR {type(e).__name__}: {str(e)[-300:]}"
        print(f"triton {triton.__version__} BN {extra.get('BN', '-'):>4} {name:38s} {res}", flush=True)
    print(f"compile errors: {errors}")


if __name__ == "__main__":
    main()
