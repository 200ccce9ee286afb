"""The Gluon kernels (`union_gluon`: the union-tile forward and dq; `keyq_gluon`: the key-major dk/dv): compiled
for sm_90a on any host (registers, no spills), and on a Hopper GPU equal to the reference and to the Triton kernels
on the same tiles / lists."""

import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from sparse_rl.sparse.ops.sparse_attention import keyq, keyq_gluon, union, union_gluon
from sparse_rl.sparse.ops.sparse_attention.keymajor import bwd_delta
from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not (HOPPER and union_gluon.HAVE_GLUON), reason="needs an sm_90 GPU and Gluon")


def _ptxas() -> bool:
    import triton
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")) \
        or shutil.which("ptxas") is not None


@pytest.mark.skipif(not (union_gluon.HAVE_GLUON and _ptxas()), reason="needs Gluon and ptxas")
def test_compiles_for_sm90_without_spills():
    """Each launch form builds for sm_90a with no stack (spills), the tile kernels at most 232 registers (Triton
    3.6 gives 121-216, 3.9 up to 204), the dk/dv kernel within one SM's shared memory; compiled in a subprocess with
    the interpreter off (TRITON_INTERPRET=1 swaps the language's functions)."""
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.path.abspath(root))
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "sm90_tile_fwd_gluon.py"), "--tunes",
                        "64x2,64x3,32x3,64x3x1,64x2x0x1,dq64x2,dq32x3,dq64x2x1,kq128x2,kq128x2x0x1,kq64x2,"
                        "kq64x2x32x1,ws"],
                       capture_output=True, text=True, env=env, timeout=300)
    rows = re.findall(r"(fwd|dq|kq) BK (\d+) stages (\d+) pipe (\d+) prefetch (\d): regs (\d+) stack (\d+) shared "
                      r"(\d+)", r.stdout)
    assert len(rows) == 12, r.stdout + r.stderr[-2000:]
    # the warp-specialized dk/dv: within its launch's 168 registers (the consumers' setmaxnreg 200), a few spills
    # (Triton 3.6: 144 B, 3.9: 288 B), one SM's shared memory
    ws = re.search(r" ws: regs (\d+) stack (\d+) shared (\d+)", r.stdout)
    assert ws and int(ws.group(1)) <= 168 and int(ws.group(2)) <= 512 and int(ws.group(3)) <= 227 * 1024, r.stdout
    for kind, *nums in rows:
        bk, st, pipe, pf, regs, stack, shared = map(int, nums)
        if kind == "kq" and pipe == 32:  # 64 rows x 32 keys: half the accumulators, no spills, two programs an SM
            assert stack == 0 and shared <= 113 * 1024
            continue
        # no spills; the dk/dv at 255 registers: prefetching on 128 rows spills 72 B of loop invariants, the 64-row
        # form (4 warps hold all of dK^T / dV^T) ~300 B (Triton 3.6)
        assert stack <= (0 if kind != "kq" else 128 if bk == 128 and pf else 0 if bk == 128 else 512)
        if kind == "kq":  # q / dO ring + K / V + P / dS: 128 rows one program an SM, 64 rows two
            assert shared <= (227 if bk == 128 else 113) * 1024
        else:
            assert regs <= 232 and shared <= (2 * st * bk + 128) * 128 * 2  # the K / V ring, Q (and dO), D = 128


def _case(B, T, S, H, H_kv, D, K, seed, dev):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, device=dev).bfloat16()
    k = torch.randn(B, S, H_kv, D, generator=g, device=dev).bfloat16()
    v = torch.randn(B, S, H_kv, D, generator=g, device=dev).bfloat16()
    t = torch.arange(T, device=dev)[:, None] + (S - T)  # causal: query t sees keys <= t + S - T
    r = torch.rand(B, T, S, generator=g, device=dev).masked_fill(torch.arange(S, device=dev) > t[None], 2.0)
    idx = r.argsort(-1)[..., :K].to(torch.int32)
    idx = torch.where(torch.gather(r, -1, idx.long()) > 1.5, -1, idx)  # keys past the query are dropped
    idx[:, 5] = -1  # an empty row
    idx[torch.rand(B, T, K, generator=g, device=dev) < 0.2] = -1
    return q, k, v, idx


@needs_hopper
@pytest.mark.parametrize("H,H_kv,D", [(32, 8, 128), (8, 4, 128), (16, 2, 64)])
@pytest.mark.parametrize("T,S,K", [(333, 333, 96), (100, 1000, 200), (1031, 1031, 300)])
@pytest.mark.parametrize("tune", [(64, 2), (64, 3), (32, 3), (64, 3, 1), (32, 4, 1), (64, 2, 0, 1), (32, 3, 0, 1)])
def test_equals_reference_and_triton_tiles(H, H_kv, D, T, S, K, tune):
    dev = torch.device("cuda")
    q, k, v, idx = _case(2, T, S, H, H_kv, D, K, T + S + K, dev)
    BT = 64 // (H // H_kv)
    sel = union.build_union(idx, S, BT)
    scale = 1 / math.sqrt(D)
    out, lse = union_gluon.tile_fwd_gluon(q, k, v, sel, scale, tune=tune)
    ref, rl = sparse_attention_naive(q.float(), k.float(), v.float(), idx)
    tri, tl_ = union.tile_fwd(q, k, v, sel, scale, dot_precision(q.dtype))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), tri.float(), atol=2e-2, rtol=2e-2)
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse))  # empty rows: -inf lse, zero output
    torch.testing.assert_close(lse[fin], rl[fin], atol=2e-3, rtol=2e-3)
    assert torch.all(out[:, 5] == 0)
    if len(tune) > 3:  # the key lists read a block ahead: the same arithmetic in the same order
        o2, l2 = union_gluon.tile_fwd_gluon(q, k, v, sel, scale, tune=tune[:2])
        assert torch.equal(out, o2) and torch.equal(lse, l2)


@needs_hopper
@pytest.mark.parametrize("H,H_kv,D", [(32, 8, 128), (16, 2, 64)])
@pytest.mark.parametrize("T,S,K", [(333, 333, 96), (1031, 1031, 300)])
@pytest.mark.parametrize("tune", [(64, 2), (32, 3), (64, 2, 1), (32, 3, 1)])
def test_dq_equals_the_triton_tiles_and_autograd(H, H_kv, D, T, S, K, tune):
    dev = torch.device("cuda")
    q, k, v, idx = _case(2, T, S, H, H_kv, D, K, T + K, dev)
    BT = 64 // (H // H_kv)
    sel = union.build_union(idx, S, BT)
    scale = 1 / math.sqrt(D)
    prec = dot_precision(q.dtype)
    o, lse = union.tile_fwd(q, k, v, sel, scale, prec)
    g = torch.Generator(device=dev).manual_seed(1)
    do = torch.randn(o.shape, generator=g, device=dev).bfloat16()
    delta = (o.float() * do.float()).sum(-1).contiguous()
    got = union_gluon.tile_dq_gluon(q, k, v, sel, do, lse, delta, scale, tune=tune)
    if len(tune) > 2:  # prefetched key lists: bitwise the plain kernel
        assert torch.equal(got, union_gluon.tile_dq_gluon(q, k, v, sel, do, lse, delta, scale, tune=tune[:2]))
    tri = union.tile_dq(q, k, v, sel, do, lse, delta, scale, prec)
    torch.testing.assert_close(got.float(), tri.float(), atol=3e-2, rtol=3e-2)
    qr = q.float().requires_grad_()
    ref, _ = sparse_attention_naive(qr, k.float(), v.float(), idx)
    (ref * do.float()).sum().backward()
    torch.testing.assert_close(got.float(), qr.grad, atol=5e-2, rtol=5e-2)


@needs_hopper
def test_rejects_what_it_does_not_take():
    dev = torch.device("cuda")
    q, k, v, idx = _case(1, 64, 64, 8, 1, 128, 16, 0, dev)  # G = 8: 8-query tiles of 64 rows are fine
    sel = union.build_union(idx, 64, 8)
    union_gluon.tile_fwd_gluon(q, k, v, sel, 0.1)
    with pytest.raises(ValueError, match="64-row tiles"):
        union_gluon.tile_fwd_gluon(q, k, v, union.build_union(idx, 64, 4), 0.1)
    with pytest.raises(ValueError, match="64-row tiles"):
        union_gluon.tile_fwd_gluon(q.float(), k.float(), v.float(), sel, 0.1)


@pytest.mark.interpreter
def test_fwd_impl_is_an_argument_checked_where_the_kernel_cannot_run():
    """`tune={"fwd_impl": ...}` / `{"bwd_impl": ...}` pick the tile forward's / backward's kernels; on the CPU "triton"
    and "auto" run the Triton kernels (equal to each other), "gluon" is refused with a clear error, an unknown name
    too."""
    from sparse_rl.sparse.ops.sparse_attention import triton as sa
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 40, 8, 16, generator=g), torch.randn(1, 40, 2, 16, generator=g), torch.randn(
        1, 40, 2, 16, generator=g)
    idx = torch.stack([torch.randperm(t + 1, generator=g)[:8].sort().values if t >= 7 else
                       torch.cat([torch.arange(t + 1), torch.full((7 - t,), -1)]) for t in range(40)])[None].int()
    a = sa.sparse_attention(q, k, v, idx, fwd_path="tile", tune={"fwd_impl": "auto"})[0]
    b = sa.sparse_attention(q, k, v, idx, fwd_path="tile", tune={"fwd_impl": "triton"})[0]
    assert torch.equal(a, b)
    torch.testing.assert_close(a, sparse_attention_naive(q, k, v, idx)[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        sa.sparse_attention(q, k, v, idx, fwd_path="tile", tune={"fwd_impl": "gluon"})
    with pytest.raises(ValueError, match="fwd_impl 'cuda'"):
        sa.sparse_attention(q, k, v, idx, fwd_path="tile", tune={"fwd_impl": "cuda"})
    grads = {}
    for bwd in ("tile", "keyq"):  # the backward kernels likewise (tune "bwd_impl")
        for impl in ("auto", "triton", "gluon", "cuda"):
            qq = q.clone().requires_grad_()
            out = sa.sparse_attention(qq, k, v, idx, fwd_path="tile", bwd_path=bwd, tune={"bwd_impl": impl})[0]
            if impl in ("gluon", "cuda"):
                with pytest.raises(ValueError, match=f"bwd_impl '{impl}'"):
                    out.sum().backward()
            else:
                out.sum().backward()
                grads[bwd, impl] = qq.grad
        assert torch.equal(grads[bwd, "auto"], grads[bwd, "triton"])


@needs_hopper
@pytest.mark.parametrize("H,H_kv", [(32, 8), (8, 4), (16, 2)])
@pytest.mark.parametrize("T,S,K", [(333, 333, 96), (100, 1000, 200), (1031, 1031, 300)])
@pytest.mark.parametrize("tune", [(2, None, 0), (2, None, 1), (2, None, 0, 64), (2, None, 1, 64), (2, None, 1, 64, 32),
                                  (2, None, 1, 128, 64, 1)])
def test_dkdv_equals_the_triton_kernel_and_autograd(H, H_kv, T, S, K, tune):
    dev = torch.device("cuda")
    q, k, v, idx = _case(2, T, S, H, H_kv, 128, K, T + S + K + H, dev)
    scale = 1 / math.sqrt(128)
    qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
    ref, lse = sparse_attention_naive(qf, kf, vf, idx)
    g = torch.Generator(device=dev).manual_seed(2)
    do = torch.randn(ref.shape, generator=g, device=dev).bfloat16()
    (ref * do.float()).sum().backward()
    o = ref.detach().bfloat16()
    delta = bwd_delta(o, do, torch.zeros_like(lse))
    lse = lse.detach().contiguous()
    dk, dv = keyq_gluon.keyq_dkdv_gluon(q, k, v, idx, do, lse, delta, scale, tune=tune)
    if tune[2] and tune[5:] != (1,):  # lists, key bits, lse and delta read a chunk ahead: bitwise the plain kernel
        dk0, dv0 = keyq_gluon.keyq_dkdv_gluon(q, k, v, idx, do, lse, delta, scale, tune=(*tune[:2], 0, *tune[3:]))
        if tune[3:] == ():  # the default launch is the prefetching one
            assert all(torch.equal(a, b) for a, b in zip(
                (dk, dv), keyq_gluon.keyq_dkdv_gluon(q, k, v, idx, do, lse, delta, scale)))
        assert torch.equal(dk, dk0) and torch.equal(dv, dv0)
    tk, tv = keyq.keyq_dkdv(q, k, v, idx, do, lse, delta, scale, dot_precision(q.dtype))
    torch.testing.assert_close(dk.float(), tk.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(dv.float(), tv.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(dk.float(), kf.grad, atol=6e-2, rtol=6e-2)
    torch.testing.assert_close(dv.float(), vf.grad, atol=6e-2, rtol=6e-2)


@needs_hopper
def test_keyq_rejects_what_it_does_not_take():
    dev = torch.device("cuda")
    q, k, v, idx = _case(1, 64, 64, 8, 1, 64, 16, 0, dev)  # D 64
    lse = torch.zeros(1, 64, 8, device=dev)
    with pytest.raises(ValueError, match="D 128"):
        keyq_gluon.keyq_dkdv_gluon(q, k, v, idx, q, lse, lse, 0.1)
    assert union_gluon.available(q)


@needs_hopper
def test_auto_backward_runs_the_gluon_kernels():
    """On sm_90 the default ("auto") backward runs the Gluon tile dq and dk/dv where they fit (timed faster, session
    30): the keyq backward on 16-query tiles (64 rows; the dq reuses the forward's tiles) is bitwise the "gluon" run
    and close to the Triton one; a Triton launch tune given for the dq keeps it Triton. The key-major backward
    rebuilds 32-query tiles (128 rows) for its dq, which the Gluon kernel does not take, so there "auto" is Triton
    and "gluon" a clear error (a GPU run of session 30 showed both)."""
    from sparse_rl.sparse.ops.sparse_attention import triton as sa
    dev = torch.device("cuda")
    q, k, v, idx = _case(1, 515, 515, 32, 8, 128, 128, 7, dev)
    do = torch.randn(q.shape, generator=torch.Generator(device=dev).manual_seed(4), device=dev).bfloat16()

    def grads(bwd, **tune):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        sa.sparse_attention(qq, kk, vv, idx, fwd_path="tile", bwd_path=bwd, tune=tune)[0].backward(do)
        return qq.grad, kk.grad, vv.grad

    auto, glu, tri = (grads("keyq", bt=16, **({"bwd_impl": i} if i else {})) for i in (None, "gluon", "triton"))
    for a, b, c in zip(auto, glu, tri):
        assert torch.equal(a, b)
        torch.testing.assert_close(a.float(), c.float(), atol=3e-2, rtol=3e-2)
    forced = grads("keyq", bt=16, dq=(32, 4, 2))[0]
    assert torch.equal(forced, grads("keyq", bt=16, dq=(32, 4, 2), bwd_impl="triton")[0])
    for a, c in zip(grads("tile", bt=16), grads("tile", bt=16, bwd_impl="triton")):
        assert torch.equal(a, c)
    with pytest.raises(ValueError, match="bwd_impl 'gluon' needs"):
        grads("tile", bt=16, bwd_impl="gluon")
