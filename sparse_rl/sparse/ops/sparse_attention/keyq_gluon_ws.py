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

from sparse_rl.sparse.ops.sparse_attention.keyq_gluon_chunk import kernel_args
from sparse_rl.sparse.ops.sparse_attention.union_gluon import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                                  warpgroup_mma, warpgroup_mma_wait)

    from sparse_rl.sparse.ops.sparse_attention.keyq_gluon_chunk import (_chunk_grads, _chunk_list, _chunk_scores,
                                                                        _issue_rows, _key_tile_program, _row_stats)
    # inside a warp-specialized partition Gluon's barrier syncs that partition's warps only (a named barrier of its
    # thread count: `BAR.SYNC 0x2, 0x80` in the consumers' SASS)
    from sparse_rl.sparse.ops.sparse_attention.union_gluon import _cta_barrier as _group_barrier

ROWS = 128  # MMA rows a chunk: 128 / G queries
STAGES = 2  # q / dO ring: 2 x 64 KB, K / V 32 KB, P / dS 32 KB = 192 KB
MAXNREG = 168  # 12 warps an SM: 65,536 registers / 384 threads
CONSUMER_REGS = 200  # the consumers' setmaxnreg (dK^T / dV^T / S / dP: 128 of them); the producer gets the rest


if HAVE_GLUON:

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

        tc, _ = _chunk_list(LIST, lo, hi, G, BQ, 128, gl.SliceLayout(1, LOAD))
        for i in range(gl.cdiv(hi - lo, BQ)):
            st = i % STAGES
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
            _issue_rows(q_smem, do_smem, Q, DO, tc, b, kvh, G, sqb, sqt, sqh, sdob, sdot, sdoh, st, D, 128, LOAD)
            async_copy.mbarrier_arrive(ready.index(st), increment_count=False)  # when this thread's copies land
            tc, _ = _chunk_list(LIST, lo + (i + 1) * BQ, hi, G, BQ, 128, gl.SliceLayout(1, LOAD))
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
        t, ok = _chunk_list(LIST, lo, hi, G, BQ, 128, gl.SliceLayout(1, ACC))
        mbarrier.wait(kv.index(0), 0)
        for i in range(gl.cdiv(hi - lo, BQ)):
            st = i % STAGES
            mbarrier.wait(ready.index(st), (i // STAGES) & 1)
            fence_async_shared()  # the cp.async writes before the MMAs' async-proxy reads
            s, dp = _chunk_scores(q_smem.index(st), do_smem.index(st), k_w, v_w, z)
            # under the MMAs: this chunk's key bits, lse, delta; the next chunk's list entries
            w = gl.load(MSK + lo + i * BQ + r // G, mask=ok, other=0)
            lse, delta = _row_stats(LSE, DELTA, t, ok, b, heads, slb, slt, slh)
            t_n, ok_n = _chunk_list(LIST, lo + (i + 1) * BQ, hi, G, BQ, 128, gl.SliceLayout(1, ACC))
            dk, dv = _chunk_grads(s, dp, q_smem.index(st), do_smem.index(st), p_w, ds_w, dk, dv, lse, delta, w, ok,
                                  nbit, qk_scale, dt)
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


def launch(q, k, v, do, lse, delta, lists, scale: float, log2e: float, heads_together: int):
    """dk, dv `[B, S, H_kv, D]` from prebuilt `keyq.key_query_lists(indices, S, 64)`; the caller
    (`keyq_gluon.keyq_dkdv_gluon`, tune entry ws = 1) checks shapes and strides."""
    grid, args, dk, dv = kernel_args(q, k, v, do, lse, delta, lists, 64, scale, log2e)
    _kq_dkdv_ws_kernel[grid](*args, BQ=ROWS // (q.shape[2] // k.shape[2]), D=q.shape[3], STAGES=STAGES,
                             GH=heads_together, CR=CONSUMER_REGS, num_warps=4, maxnreg=MAXNREG)
    return dk, dv
