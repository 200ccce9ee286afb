"""The tile forward (`union._tile_fwd_kernel`, per-query unions) compiled for sm_90a on a CPU host (no GPU):
registers, stack, and the SASS of its key loop counted by kind (MMA, global gathers, shared-memory stores /
loads, async copies, barriers), for the default launch and the session-12 variants (V loaded early, the AND
bit test, 16-query tiles), with the launch's specialisations (unit head-dim strides as constants, the other
strides and the pointers 16-divisible; G = 4, D = 128, bf16).

    PYTHONPATH=$PWD /tmp/t36/bin/python benchmarks/sm90_tile_fwd.py     # the H200's Triton (3.6.0)

Why: the kernel runs at ~262 TF/s of MMA work on the trained pattern against dense's ~600; whether its loop is
bound by issue (instructions a key block), by the gathers' latency (how many loads are in flight: cp.async
stages) or by layout conversions through shared memory (STS/LDS beside the MMA operands) is visible here
before any device time is spent.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparse_rl.sparse.ops.sparse_attention import union

UNIT = ("sqd", "skd", "svd", "sod", "slh", "suk", "QG")  # 1 at the launch: specialised as constants
INTS = ("G",)  # not a multiple of 16 at the bench's shapes (G = 4; UMAX is, union.SLOT_PAD); the rest are
PTR = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32",
       "UKEY": "*i32", "QMASK": "*i32", "ULEN": "*i32"}


def compile_fwd(BT: int, BK: int, warps: int, stages: int, kt: int = 0, lz: int = 0, ma: int = 0, cap: int = 0,
                pf: int = 0):
    cx = dict(BT=BT, BLOCK_M=BT * 4, BLOCK_K=BK, BLOCK_D=128, SHARED=False, PREC=0, KT_LOAD=bool(kt),
              LAZY=bool(lz), MASK_AND=bool(ma), PREFETCH=bool(pf), **{n: 1 for n in UNIT})
    sig, attrs = {}, {}
    for i, n in enumerate(inspect.signature(union._tile_fwd_kernel.fn).parameters):
        if n in cx:
            sig[n] = "constexpr"
        elif n in PTR:
            sig[n], attrs[(i,)] = PTR[n], [["tt.divisibility", 16]]
        elif n == "qk_scale":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n not in INTS:  # the other strides: multiples of 16 at the bench's shapes
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(union._tile_fwd_kernel, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages, **({"maxnreg": cap} if cap else {})))


KINDS = {"mma": r"HGMMA|HMMA", "ldg": r"\bLDG", "ldgsts": r"LDGSTS", "sts": r"\bSTS", "lds": r"\bLDS",
         "ldsm": r"LDSM", "bar": r"\bBAR|SYNCS", "shfl": r"SHFL", "mufu": r"MUFU"}


def cuobjdump(k, flag: str) -> str:
    cubin = "/tmp/_sm90_tile.cubin"
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([tool, flag, cubin], capture_output=True, text=True).stdout


def key_loop(lines: list) -> list:
    """The SASS lines of the longest loop (a backward branch's range): the key loop."""
    offs = [int(re.match(r"\s*/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in lines]
    best = []
    for i, ln in enumerate(lines):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < offs[i]:
            body = [x for x, o in zip(lines, offs) if int(m.group(1), 16) <= o <= offs[i]]
            best = body if len(body) > len(best) else best
    return best


def sass_counts(sass: str) -> dict:
    """Instructions by kind, the whole kernel's and the key loop's (`loop`, a key block's work a warp)."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", ln)]
    res = {"instr": len(lines)}
    for name, pat in KINDS.items():
        res[name] = sum(1 for ln in lines if re.search(pat, ln))
    loop = key_loop(lines)
    res["loop"] = len(loop)
    res["loop_mma"] = sum(1 for ln in loop if re.search(KINDS["mma"], ln))
    res["loop_ldg"] = sum(1 for ln in loop if re.search(KINDS["ldg"], ln) and not re.search("LDGSTS", ln))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", default="", help="write the default launch's SASS to this file")
    a = ap.parse_args()
    cases = [("BT32 (32,4,3) default", 32, 32, 4, 3), ("BT32 (32,4,3) lazy", 32, 32, 4, 3, 0, 1, 0),
             ("BT32 (32,4,3) mask_and", 32, 32, 4, 3, 0, 0, 1), ("BT32 (32,4,3) lazy+and", 32, 32, 4, 3, 0, 1, 1),
             ("BT32 (32,8,3) lazy+and", 32, 32, 8, 3, 0, 1, 1), ("BT32 (64,8,2) lazy+and", 32, 64, 8, 2, 0, 1, 1),
             ("BT32 (64,8,2)", 32, 64, 8, 2), ("BT32 (64,4,2)", 32, 64, 4, 2), ("BT32 (32,8,3)", 32, 32, 8, 3),
             ("BT32 (16,4,4)", 32, 16, 4, 4), ("BT32 (32,4,4)", 32, 32, 4, 4),
             ("BT16 (64,4,2) default", 16, 64, 4, 2), ("BT16 (32,4,3)", 16, 32, 4, 3),
             ("BT16 (64,4,2) lazy+and", 16, 64, 4, 2, 0, 1, 1),
             ("BT16 (64,4,2) mask_and", 16, 64, 4, 2, 0, 0, 1),
             # session 22: the default of per-query tiles since session 19 (cap 128), and the prefetching loop
             ("BT16 (32,4,2) and cap128", 16, 32, 4, 2, 0, 0, 1, 128), ("BT16 (32,4,2) and", 16, 32, 4, 2, 0, 0, 1),
             ("BT16 pf 32 keys", 16, 32, 4, 1, 0, 0, 1, 0, 1), ("BT16 pf 32 keys cap168", 16, 32, 4, 1, 0, 0, 1, 168, 1),
             ("BT16 pf 16 keys", 16, 16, 4, 1, 0, 0, 1, 0, 1), ("BT16 pf 16 keys cap168", 16, 16, 4, 1, 0, 0, 1, 168, 1),
             ("BT32 pf 32 keys 8 warps", 32, 32, 8, 1, 0, 0, 1, 0, 1),
             ("BT32 pf 16 keys 8 warps", 32, 16, 8, 1, 0, 0, 1, 0, 1),
             ("BT32 pf 16 keys 8 warps cap128", 32, 16, 8, 1, 0, 0, 1, 128, 1),
             ("BT32 pf 32 keys 8 warps cap128", 32, 32, 8, 1, 0, 0, 1, 128, 1)]
    errors = 0
    for name, *args in cases:
        try:
            k = compile_fwd(*args)
            m = re.search(r"REG:(\d+).*?STACK:(\d+)", cuobjdump(k, "-res-usage"))
            sass = cuobjdump(k, "-sass")
            res = f"regs {m.group(1)} stack {m.group(2)} smem {k.metadata.shared} " + " ".join(
                f"{a}={b}" for a, b in sass_counts(sass).items())
            if a.sass:
                with open(f"{a.sass}.{name.split()[0]}.{'_'.join(name.split()[1:])}.sass", "w") as f:
                    f.write(sass)
        except Exception as e:  # noqa: BLE001 -- reported, the others still compile
            errors += 1
            res = f"ERROR {type(e).__name__}: {str(e)[-300:]}"
        print(f"triton {triton.__version__} {name:26s} {res}", flush=True)
    print(f"compile errors: {errors}")


if __name__ == "__main__":
    main()
