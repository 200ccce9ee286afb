"""The one-launch decode select (`decode_sync._sync_select`) compiled for sm_90a on a CPU host (no GPU needed): its
registers and stack (they set how many programs an SM holds, and so the chunks a row gets) and the PTX of its
barrier, to check that each arrival is one atomic per program (Triton runs a scalar atomic in one thread), with
the installed Triton (the H200 runs 3.6; see sm90_regs.py for the separate environment).

    PYTHONPATH=$PWD /tmp/t36/bin/python benchmarks/sm90_sync.py [--warps 4] [--bn 64]
"""

from __future__ import annotations

import argparse
import inspect
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparse_rl.sparse.ops.indexer_topk import decode as _decode  # noqa: F401 (the package's import order)
from sparse_rl.sparse.ops.indexer_topk import decode_sync as DS

from sm90_regs import compile_kernel  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--bn", type=int, default=64)
    ap.add_argument("--cmax", type=int, default=DS.MAX_CHUNKS)
    a = ap.parse_args()
    cx = dict(HB=16, BD=64, BN=a.bn, CMAX=a.cmax, PREC=0, FP8=False, HAS_START=False, PHASE=0, PDL=2)
    ints = ("sqb", "sqh", "sqd", "swb", "swh", "skb", "sks", "skd", "ssb", "sob", "S", "K", "sink", "window", "HI",
            "DI", "CH", "NROW")
    sig = {}
    for n in inspect.signature(DS._sync_select.fn).parameters:
        sig[n] = "constexpr" if n in cx else "i32" if n in ints else (
            "*bf16" if n in ("Q", "W", "KI") else "*fp32" if n in ("KS", "SC") else "*i32")
    k = triton.compile(ASTSource(DS._sync_select, sig, cx), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=a.warps))
    ptx = k.asm["ptx"]
    atoms = [ln.strip() for ln in ptx.splitlines() if "atom." in ln or "red." in ln]
    print("atomics in PTX:", len(atoms))
    for ln in atoms:
        print("  ", ln)
    # the predicate guarding each atomic: the lines just before
    for m in re.finditer(r"(@%p\d+ )?atom\.[^\n]*", ptx):
        print("  guarded:", bool(m.group(1)), m.group(0)[:80])
    print(compile_kernel(DS._sync_select, cx, num_warps=a.warps) if False else "")
    import os
    import subprocess
    cubin = "/tmp/_sm90_sync.cubin"
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    out = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True).stdout
    print(re.findall(r"REG:\d+ STACK:\d+ SHARED:\d+", out) or out[-300:])


if __name__ == "__main__":
    main()
