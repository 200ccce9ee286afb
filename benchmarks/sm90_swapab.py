"""The swap-AB skinny GEMM (`skinny_gemm/swapab.py:_swapab_kernel`) compiled for sm_90a on a CPU host (no GPU
needed), in the specializations the decode step launches: per tile, registers / stack (cuobjdump), shared
memory, and the instructions that say whether the weight streams as intended: HGMMA (wgmma), LDGSTS (cp.async,
the software pipeline's copies), plain LDG, griddepcontrol (PDL).

    PYTHONPATH=$PWD /tmp/t36/bin/python benchmarks/sm90_swapab.py        (Triton 3.6.0, the H200's)

The pointers and the strides / K / KS get 16-divisibility, as a launch with the step's tensors specializes them
(x / W rows of 2560 / 4096 / 9728 elements): without it Triton cannot vectorize the loads to 16 bytes, emits no
cp.async, and the loop is not pipelined (255 registers and a stack: a compile artifact, not the device's).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparse_rl.sparse.ops.skinny_gemm import swapab as S

DIV = ("X", "W", "OUT", "PART", "CNT", "K", "sxm", "swn", "som", "KS", "RES", "PS", "srm", "HN", "SC", "shm", "PSIN")
SMEM_MAX = 232448  # bytes a program may take on an H100 / H200 (227 KB)


def cubin_usage(k, path: str = "/tmp/_sm90.cubin") -> tuple[int, int, str]:
    """(registers, stack bytes, SASS text) of a compiled Triton kernel k, by the cuobjdump Triton ships."""
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", res)
    return int(m.group(1)), int(m.group(2)), sass


def compile_swapab(BW, BX, BK, ONE, PDL, num_warps=4, num_stages=4, SPLIT=13, **forms) -> dict:
    """forms: GLU / RESID / NORM (session 20: SiLU * up, the residual-add epilogue, the RMSNorm prologue; session 21:
    SCALE, hn from the residual epilogue, NORM as the consumer's 1 / rms epilogue), PREFETCH (the L2 prefetch), TMA
    (the weight through a host tensor descriptor of [BW, BK] boxes)."""
    names = list(inspect.signature(S._swapab_kernel.fn).parameters)
    cx = dict(BW=BW, BX=BX, BK=BK, ONE=ONE, PDL=PDL, PREC=0, SPLIT=1 if ONE else SPLIT, GLU=False, RESID=False,
              SCALE=False, NORM=False, NPSB=64, PREFETCH=False, TMA=False)
    cx.update(forms)
    if not cx["TMA"]:
        cx["WD"] = None
    box = f"2, {BW // 2}, {BK}" if cx["GLU"] else f"{BW}, {BK}"
    sig = {n: "constexpr" if n in cx else f"tensordesc<bf16[{box}]>" if n == "WD"
           else "*bf16" if n in ("X", "W", "OUT", "RES", "HN", "SC")
           else "*fp32" if n in ("PART", "PS", "PSIN") else "*i32" if n == "CNT" else "fp32" if n == "eps" else "i32"
           for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIV}
    k = triton.compile(ASTSource(S._swapab_kernel, sig, cx, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    regs, stack, sass = cubin_usage(k)
    ptx = k.asm["ptx"]
    return {"regs": regs, "stack": stack, "smem": k.metadata.shared,
            "HGMMA": len(re.findall(r"HGMMA", sass)), "LDGSTS": len(re.findall(r"LDGSTS", sass)),
            "LDG": len(re.findall(r"LDG\.", sass)), "griddep": len(re.findall("griddepcontrol", ptx)),
            "prefetch": len(re.findall("prefetch.L2", ptx)), "UTMALDG": len(re.findall("UTMALDG", sass))}


def main():
    errors = 0
    # (BW, BX, BK, stages): the default tile (128 x 64, 4 stages) at 16 / 32 / 64 rows, split or not, PDL 0-2;
    # "sw_bk128" (128 x 128, 4 stages; at 64 rows 3, the swapab_linear clamp); "sw64" (64 x 128, 3 stages)
    for (bw, bx, bk, st), one, pdl in [((128, 16, 64, 4), True, 0), ((128, 16, 64, 4), False, 1),
                                       ((128, 32, 64, 4), False, 1), ((128, 32, 64, 4), True, 1),
                                       ((128, 32, 64, 4), False, 2), ((128, 64, 64, 4), False, 1),
                                       ((128, 32, 128, 4), False, 0), ((128, 64, 128, 3), False, 0),
                                       ((64, 32, 128, 3), False, 0), ((64, 16, 128, 3), True, 0)]:
        try:
            r = compile_swapab(bw, bx, bk, one, pdl, num_stages=st)
        except Exception as e:  # noqa: BLE001 -- reported, the others still compile
            r = e
        _report(f"BW {bw} BX {bx} BK {bk} stages {st} ONE {one:d} PDL {pdl}", r)
        errors += isinstance(r, Exception) or r["smem"] > SMEM_MAX
    # session 20's forms at the engine's tiles: gate/up with SiLU * up (and the RMSNorm prologue), o_proj / down with
    # the residual epilogue (6 K slices), q/k/v with the RMSNorm prologue (2 K slices)
    for lab, (bw, bx, bk, st, one, split), forms in [
            ("glu", (128, 32, 64, 4, True, 1), dict(GLU=True)),
            ("glu + norm", (128, 32, 64, 4, True, 1), dict(GLU=True, NORM=True)),
            ("resid", (64, 32, 128, 3, False, 6), dict(RESID=True)),
            ("resid + scale", (64, 32, 128, 3, False, 6), dict(RESID=True, SCALE=True)),
            ("prefetch", (64, 32, 128, 3, False, 6), dict(PREFETCH=True)),
            ("glu + prefetch", (128, 32, 64, 4, True, 1), dict(GLU=True, PREFETCH=True)),
            ("tma split", (64, 32, 128, 3, False, 6), dict(TMA=True)),
            ("tma split bk64 4 stages", (64, 32, 64, 4, False, 6), dict(TMA=True)),
            ("tma one", (128, 32, 64, 4, True, 1), dict(TMA=True)),
            ("glu + tma", (128, 32, 64, 4, True, 1), dict(GLU=True, TMA=True)),
            ("glu + tma bk128 3 stages", (128, 32, 128, 3, True, 1), dict(GLU=True, TMA=True)),
            ("norm", (64, 32, 128, 3, False, 2), dict(NORM=True))]:
        try:
            r = compile_swapab(bw, bx, bk, one, 2, num_stages=st, SPLIT=split, **forms)
        except Exception as e:  # noqa: BLE001
            r = e
        _report(f"{lab}: BW {bw} BX {bx} BK {bk} stages {st} SPLIT {split}", r)
        errors += isinstance(r, Exception) or r["smem"] > SMEM_MAX
    print(f"errors: {errors}")


def _report(what: str, r) -> None:
    if isinstance(r, Exception):
        res = f"ERROR {type(r).__name__}: {str(r)[-300:]}"
    else:
        res = " ".join(f"{k} {v}" for k, v in r.items()) + (" SHARED MEMORY OVER 227 KB" if r["smem"] > SMEM_MAX else "")
    print(f"triton {triton.__version__} {what}: {res}", flush=True)


if __name__ == "__main__":
    main()
