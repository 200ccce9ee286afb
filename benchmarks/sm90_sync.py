"""The one-launch decode select (`decode_sync._sync_select`) compiled for sm_90a on a CPU host (no GPU needed): its
registers and stack (they set how many programs an SM holds, and so the chunks a row gets) and the PTX of its
barrier, to check that each arrival is one atomic per program (Triton runs a scalar atomic in one thread), with
the installed Triton (the H200 runs 3.6; see sm90_regs.py for the separate environment).

    PYTHONPATH=$PWD:$PWD/benchmarks /tmp/t36/bin/python benchmarks/sm90_sync.py [--warps 4] [--bn 128] [--br 256] \
        [--cmax 16] [--split 0] [--keep] [--maxnreg 128]
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

from sm90_regs import resources  # noqa: E402

INTS = ("sqb", "sqh", "sqd", "swb", "swh", "skb", "sks", "skd", "ssb", "sob", "S", "K", "sink", "window", "HI", "DI",
        "CH", "NROW")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--bn", type=int, default=128)
    ap.add_argument("--br", type=int, default=DS.RESCAN)
    ap.add_argument("--cmax", type=int, default=16)
    ap.add_argument("--split", type=int, default=0)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--maxnreg", type=int, default=DS.MAXNREG)
    a = ap.parse_args()
    cx = dict(HB=16, BD=64, BN=a.bn, BR=a.br, CMAX=a.cmax, PREC=0, FP8=False, HAS_START=False, PHASE=0, PDL=2,
              SPLIT=bool(a.split), M=max(1, a.split), KEEP=a.keep)
    sig = {n: "constexpr" if n in cx else "i32" if n in INTS else
           "*bf16" if n in ("Q", "W", "KI") else "*fp32" if n in ("KS", "SC") else "*i32"
           for n in inspect.signature(DS._sync_select.fn).parameters}
    opts = dict(num_warps=a.warps, **({"maxnreg": a.maxnreg} if a.maxnreg else {}))
    k = triton.compile(ASTSource(DS._sync_select, sig, cx), target=GPUTarget("cuda", 90, 32), options=opts)
    for m in re.finditer(r"(@%p\d+ )?atom\.global[^\n]*", k.asm["ptx"]):  # guarded: one thread of the program
        print("  guarded:", bool(m.group(1)), m.group(0)[:80])
    print(resources(k))


if __name__ == "__main__":
    main()
