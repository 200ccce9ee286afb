"""The key-major dk/dv (`keyq.keyq_dkdv`) warp-specialized, FA3's structure in Gluon (Hopper): one producer
warpgroup gathers the listed queries' q / dO rows by cp.async into a ring of stages, two consumer warpgroups each
own one 32-key half of the 64-key tile and run their four MMAs on every chunk independently.

Why (session 31's ncu of `keyq_gluon`): that kernel's 8 warps move in lockstep (S / dP MMAs, wait, softmax, CTA
barrier, dV / dK MMAs, wait), so the tensor cores idle through every softmax and barrier: 0.30 issued warps a
scheduler, DRAM 27 %. Here the two consumers share no P / dS (each its own keys), so nothing ties one's softmax to
the other's MMAs, and the producer's gathers wait on nobody's MMAs.

Per program (key tile j of 64 keys, KV head): K / V `[2, 32, D]` in shared memory; per chunk of 128 / G queries
(their G head rows: 128 rows), consumer w: S_w = q K_w^T and dP_w = dO V_w^T `[128, 32]`, P_w and dS_w = P_w (dP_w -
delta) to its own shared memory, dV_w^T += dO^T P_w and dK_w^T += q^T dS_w `[D, 32]`; dk / dv written once, no
atomics. Barriers: ready[s] (the producer's 128 threads, each when its copies of stage s landed), empty[s] (each
consumer once it is past stage s), kv (K / V stored).
"""

from __future__ import annotations

import torch
import triton

from sparse_rl.sparse.ops.sparse_attention.union_gluon import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                                  warpgroup_mma, warpgroup_mma_wait)

    from sparse_rl.sparse.ops.sparse_attention.union_gluon import _cp_async
    # inside a warp-specialized partition Gluon's barrier syncs that partition's warps only (a named barrier of its
    # thread count: `BAR.SYNC 0x2, 0x80` in the consumers' SASS)
    from sparse_rl.sparse.ops.sparse_attention.union_gluon import _cta_barrier as _group_barrier

ROWS = 128  # MMA rows a chunk: 128 / G queries
STAGES = 2  # q / dO ring: 2 x 64 KB, K / V 32 KB, P / dS 32 KB = 192 KB
MAXNREG = 168  # 12 warps an SM: 65,536 registers / 384 threads
CONSUMER_REGS = 200  # the consumers' setmaxnreg (dK^T / dV^T / S / dP: 128 of them); the producer gets the rest


if HAVE_GLUON:

    @gluon.jit
    def _key_tile_program(NKT, GH: gl.constexpr):
        """This program's (KV head, key tile, batch) in `keyq._tile_of`'s order (both Gluon dk/dv kernels)."""
        pid = gl.program_id(0)
        grp = pid // (GH * NKT)
        rr = pid % (GH * NKT)
        return grp * GH + rr % GH, rr // GH, gl.program_id(1).to(gl.int64)

    @gluon.jit
    def _producer(bufs, bars, ptrs, scal, G, BQ: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
        """K / V of the tile into shared memory (then `kv`), then each chunk's q / dO rows by cp.async into ring
        stage i % STAGES once both consumers released it; the list entries read a chunk ahead."""
        q_smem, do_smem, k_smem, v_smem = bufs
        ready, empty, kv = bars
        Q, DO, K, V, LIST = ptrs
        b, kvh, j, lo, hi, S, sqb, sqt, sqh, sdob, sdot, sdoh, skb, sks, skh, svb, svs, svh = scal
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [4, 1], [1, 0])
        d_l = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
        n_l = gl.arange(0, 32, layout=gl.SliceLayout(1, LOAD))
        for h in gl.static_range(2):
            n = j * 64 + h * 32 + n_l
            m = (n < S)[:, None]
            k_smem.index(h).store(gl.load(K + b * skb + n[:, None] * sks + kvh * skh + d_l[None, :], mask=m,
                                          other=0.0))
            v_smem.index(h).store(gl.load(V + b * svb + n[:, None] * svs + kvh * svh + d_l[None, :], mask=m,
                                          other=0.0))
        fence_async_shared()
        _group_barrier()  # every producer thread's K / V rows before the one arrival
        mbarrier.arrive(kv.index(0))

        r = gl.arange(0, 128, layout=gl.SliceLayout(1, LOAD))
        heads = kvh * G + r % G
        tc = gl.load(LIST + lo + r // G, mask=(r // G < BQ) & (lo + r // G < hi), other=0)
        for i in range(gl.cdiv(hi - lo, BQ)):
            st = i % STAGES
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
            t = tc.to(gl.int64)
            _cp_async(q_smem.index(st), Q + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + d_l[None, :])
            _cp_async(do_smem.index(st), DO + b * sdob + t[:, None] * sdot + heads[:, None] * sdoh + d_l[None, :])
            async_copy.mbarrier_arrive(ready.index(st), increment_count=False)  # when this thread's copies land
            async_copy.commit_group()
            e = lo + (i + 1) * BQ + r // G
            tc = gl.load(LIST + e, mask=(r // G < BQ) & (e < hi), other=0)
        async_copy.wait_group(0)

    @gluon.jit
    def _consumer(bufs, bars, ptrs, scal, G, WG: gl.constexpr, BQ: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr):
        """Warpgroup WG's half of the tile (keys j * 64 + 32 WG ..): its four MMAs on every chunk, its dk / dv
        written at the end."""
        q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem = bufs
        ready, empty, kv = bars
        LSE, DELTA, LIST, MSK, DK, DV = ptrs
        b, kvh, j, lo, hi, S, slb, slt, slh, sdkb, sdks, sdkh, scale, qk_scale = scal
        dt: gl.constexpr = DK.dtype.element_ty
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
        r = gl.arange(0, 128, layout=gl.SliceLayout(1, ACC))
        heads = kvh * G + r % G
        nbit = (gl.arange(0, 32, layout=gl.SliceLayout(0, ACC)) + 32 * WG).to(gl.int64)  # bits of the 64-key mask
        z = gl.zeros([128, 32], gl.float32, ACC)
        dk = gl.zeros([D, 32], gl.float32, ACC)
        dv = gl.zeros([D, 32], gl.float32, ACC)
        k_w = k_smem.index(WG)
        v_w = v_smem.index(WG)
        p_w = p_smem.index(WG)
        ds_w = ds_smem.index(WG)
        ok = (r // G < BQ) & (lo + r // G < hi)
        t = gl.load(LIST + lo + r // G, mask=ok, other=0)
        mbarrier.wait(kv.index(0), 0)
        for i in range(gl.cdiv(hi - lo, BQ)):
            st = i % STAGES
            mbarrier.wait(ready.index(st), (i // STAGES) & 1)
            fence_async_shared()  # the cp.async writes before the MMAs' async-proxy reads
            s = warpgroup_mma(q_smem.index(st), k_w.permute((1, 0)), z, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_smem.index(st), v_w.permute((1, 0)), z, use_acc=False, is_async=True)
            # under the MMAs: this chunk's key bits, lse, delta; the next chunk's list entries
            w = gl.load(MSK + lo + i * BQ + r // G, mask=ok, other=0)
            t64 = t.to(gl.int64)
            lse = gl.load(LSE + b * slb + t64 * slt + heads * slh, mask=ok, other=float("-inf"))
            delta = gl.load(DELTA + b * slb + t64 * slt + heads * slh, mask=ok, other=0.0)
            e = lo + (i + 1) * BQ + r // G
            ok_n = (r // G < BQ) & (e < hi)
            t_n = gl.load(LIST + e, mask=ok_n, other=0)
            row_ok = (lse != float("-inf")) & ok
            lse2 = gl.where(row_ok, lse * 1.4426950408889634, 0.0)
            s, dp = warpgroup_mma_wait(0, deps=(s, dp))
            sel = (((w[:, None] >> nbit[None, :]) & 1) == 1) & row_ok[:, None]
            p = gl.where(sel, gl.exp2(s * qk_scale - lse2[:, None]), 0.0)
            p_w.store(p.to(dt))
            ds_w.store((p * (dp - delta[:, None])).to(dt))
            fence_async_shared()
            _group_barrier()  # this warpgroup's P / dS rows before its MMAs read all of them
            dv = warpgroup_mma(do_smem.index(st).permute((1, 0)), p_w, dv, is_async=True)
            dk = warpgroup_mma(q_smem.index(st).permute((1, 0)), ds_w, dk, is_async=True)
            dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
            _group_barrier()  # every warp past its MMAs' reads of stage st (and of P / dS)
            mbarrier.arrive(empty.index(st))
            t, ok = t_n, ok_n
        d_o = gl.arange(0, D, layout=gl.SliceLayout(1, ACC))
        n_o = j * 64 + 32 * WG + gl.arange(0, 32, layout=gl.SliceLayout(0, ACC))
        m = (n_o < S)[None, :]
        base = b * sdkb + n_o[None, :] * sdks + kvh * sdkh + d_o[:, None]
        gl.store(DK + base, (dk * scale).to(dt), mask=m)
        gl.store(DV + base, dv.to(dt), mask=m)

    @gluon.jit
    def _kq_dkdv_ws_kernel(Q, K, V, DO, LSE, DELTA, OFF, LIST, MSK, DK, DV,
                           sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sdob, sdot, sdoh, slb, slt, slh,
                           sdkb, sdks, sdkh, S, G, NKT, scale, qk_scale,
                           BQ: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, GH: gl.constexpr,
                           CR: gl.constexpr):
        kvh, j, b = _key_tile_program(NKT, GH)
        dt: gl.constexpr = Q.dtype.element_ty
        RS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, D], dt)
        KS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([32, D], dt)
        PS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, 32], dt)
        q_smem = gl.allocate_shared_memory(dt, [STAGES, 128, D], RS)
        do_smem = gl.allocate_shared_memory(dt, [STAGES, 128, D], RS)
        k_smem = gl.allocate_shared_memory(dt, [2, 32, D], KS)
        v_smem = gl.allocate_shared_memory(dt, [2, 32, D], KS)
        p_smem = gl.allocate_shared_memory(dt, [2, 128, 32], PS)
        ds_smem = gl.allocate_shared_memory(dt, [2, 128, 32], PS)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=128)  # the producer warpgroup's threads, each for its own copies
            mbarrier.init(empty.index(i), count=2)  # both consumers
        mbarrier.init(kv.index(0), count=1)
        lo = gl.load(OFF + b * NKT + j)
        hi = gl.load(OFF + b * NKT + j + 1)
        bars = (ready, empty, kv)
        pbufs = (q_smem, do_smem, k_smem, v_smem)
        cbufs = (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem)
        pscal = (b, kvh, j, lo, hi, S, sqb, sqt, sqh, sdob, sdot, sdoh, skb, sks, skh, svb, svs, svh)
        cscal = (b, kvh, j, lo, hi, S, slb, slt, slh, sdkb, sdks, sdkh, scale, qk_scale)
        cptrs = (LSE, DELTA, LIST, MSK, DK, DV)
        gl.warp_specialize([(_producer, (pbufs, bars, (Q, DO, K, V, LIST), pscal, G, BQ, D, STAGES)),
                            (_consumer, (cbufs, bars, cptrs, cscal, G, 0, BQ, D, STAGES)),
                            (_consumer, (cbufs, bars, cptrs, cscal, G, 1, BQ, D, STAGES))], [4, 4], [CR, CR])


def available() -> bool:
    """Gluon with warp specialization (Triton >= 3.6's `gl.warp_specialize`)."""
    return HAVE_GLUON and hasattr(gl, "warp_specialize")


def kernel_args(q, k, v, do, lse, delta, lists, BN: int, scale: float, log2e: float):
    """(grid, positional arguments, dk, dv) of both Gluon dk/dv kernels (theirs share one signature up to the
    constexprs): dk / dv `[B, S, H_kv, D]` allocated here, `lists` = `keyq.key_query_lists(indices, S, BN)`."""
    B, T, H, D = q.shape
    S, H_kv = k.shape[1], k.shape[2]
    NKT = triton.cdiv(S, BN)
    dk = torch.empty(B, S, H_kv, D, device=q.device, dtype=k.dtype)
    dv = torch.empty_like(dk)
    args = (q, k, v, do, lse, delta, *lists, dk, dv, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *do.stride()[:3], *lse.stride()[:3], *dk.stride()[:3], S, H // H_kv, NKT, scale, scale * log2e)
    return (H_kv * NKT, B), args, dk, dv


def launch(q, k, v, do, lse, delta, lists, scale: float, log2e: float, heads_together: int):
    """dk, dv `[B, S, H_kv, D]` from prebuilt `keyq.key_query_lists(indices, S, 64)`; the caller
    (`keyq_gluon.keyq_dkdv_gluon`, tune entry ws = 1) checks shapes and strides."""
    grid, args, dk, dv = kernel_args(q, k, v, do, lse, delta, lists, 64, scale, log2e)
    _kq_dkdv_ws_kernel[grid](*args, BQ=ROWS // (q.shape[2] // k.shape[2]), D=q.shape[3], STAGES=STAGES,
                             GH=heads_together, CR=CONSUMER_REGS, num_warps=4, maxnreg=MAXNREG)
    return dk, dv
