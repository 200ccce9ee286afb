"""The Gluon kernels (`union_gluon`'s tile forward and dq, `keyq_gluon`'s dk/dv) compiled for sm_90a on a CPU host:
registers, spills, shared memory and the SASS of its key loop by kind (`sm90_tile_fwd.sass_counts`), at the
launch's specialisations (pointers and the strides of K / V / Q 16-divisible; G = 4, D = 128, bf16).

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/sm90_tile_fwd_gluon.py     # the GPU machine's Triton (3.6.0)
"""

from __future__ import annotations

import argparse
import inspect
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from sparse_rl.sparse.ops.sparse_attention import keyq_gluon, keyq_gluon_ws, union_gluon

PTR = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "UKEY": "*i32", "QMASK": "*i32",
       "ULEN": "*i32", "DO": "*bf16", "DELTA": "*fp32", "DQ": "*bf16", "OFF": "*i32", "LIST": "*i32", "MSK": "*i64",
       "DK": "*bf16", "DV": "*bf16"}
INTS = ("G", "T", "NT", "slh", "S", "NKT")  # not multiples of 16 at the bench's shapes


def compile_ws(D: int = 128):
    """The warp-specialized dk/dv (`keyq_gluon_ws`) for sm_90a, at its launch's options."""
    fn = keyq_gluon_ws._kq_dkdv_ws_kernel
    cx = dict(BQ=32, D=D, STAGES=keyq_gluon_ws.STAGES, GH=2, CR=keyq_gluon_ws.CONSUMER_REGS)
    sig, attrs = _signature(fn, cx)
    return triton.compile(GluonASTSource(fn, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, maxnreg=keyq_gluon_ws.MAXNREG))


def _signature(fn, cx: dict):
    sig, attrs = {}, {}
    for i, n in enumerate(inspect.signature(fn.fn).parameters):
        if n in cx:
            sig[n] = "constexpr"
        elif n in PTR:
            sig[n], attrs[(i,)] = PTR[n], [["tt.divisibility", 16]]
            if n == "MSK" and cx.get("BN") == 32:  # 32-key tiles: int32 key bits
                sig[n] = "*i32"
        elif n in ("qk_scale", "scale"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n not in INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_fwd(BK: int = 64, stages: int = 2, pipe: int = 0, D: int = 128, dq: bool = False, kq: bool = False,
                prefetch: int = 0):
    """The forward kernel (with dq the tile dq kernel, with kq the key-major dk/dv: BK its rows, pipe its keys a tile)
    for sm_90a."""
    if kq:
        rows = BK if BK in (64, 128) else 128  # kq: BK is the chunk's rows, pipe its keys a tile (0: 64)
        fn, cx = keyq_gluon._kq_dkdv_gluon_kernel, dict(BQ=rows // 4, D=D, STAGES=stages, GH=2, PREFETCH=bool(prefetch),
                                                        ROWS=rows, BN=pipe or 64)
    else:
        fn = union_gluon._tile_dq_gluon_kernel if dq else union_gluon._tile_fwd_gluon_kernel
        cx = dict(BT=16, BK=BK, D=D, STAGES=stages, PREFETCH=bool(prefetch), **({} if dq else {"PIPE": bool(pipe)}))
    sig, attrs = _signature(fn, cx)
    return triton.compile(GluonASTSource(fn, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cx["ROWS"] // 16 if kq else union_gluon.WARPS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tunes", default="64x2,64x3,32x3,32x4,64x3x1,32x4x1,dq64x2,dq64x3,dq32x3,kq64x2",
                    help="[dq|kq]BKxSTAGES[xPIPE[xPREFETCH]],... (kq: BK its chunk's rows, PIPE its keys a tile)")
    a = ap.parse_args()
    from sm90_tile_fwd import cuobjdump, sass_counts
    for tn in a.tunes.split(","):
        if tn == "ws":  # the warp-specialized dk/dv: one launch form
            k = compile_ws()
            m = re.search(r"REG:(\d+).*?STACK:(\d+)", cuobjdump(k, "-res-usage"))
            print(f"triton {triton.__version__} ws: regs {m.group(1)} stack {m.group(2)} shared {k.metadata.shared} B",
                  flush=True)
            continue
        kind = tn[:2] if tn[:2] in ("dq", "kq") else "fwd"
        bk, st, pipe, pf = (*(int(x) for x in tn.removeprefix(kind).split("x")), 0, 0)[:4]
        k = compile_fwd(bk, st, pipe, dq=kind == "dq", kq=kind == "kq", prefetch=pf)
        m = re.search(r"REG:(\d+).*?STACK:(\d+)", cuobjdump(k, "-res-usage"))
        counts = sass_counts(cuobjdump(k, "-sass"))
        print(f"triton {triton.__version__} {kind} BK {bk} stages {st} pipe {pipe} prefetch {pf}: regs {m.group(1)} "
              f"stack {m.group(2)} shared {k.metadata.shared} B; {counts}", flush=True)


if __name__ == "__main__":
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
