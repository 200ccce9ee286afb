"""The key-major dk/dv pass over each key tile's query list (`keyq.keyq_dkdv`) in Gluon (Hopper): the listed
queries' q / dO rows cp.async-gathered into a ring of shared-memory stages, the four products on warpgroup MMAs.
Same lists (`keyq.key_query_lists`, 64-key tiles), masks and result as the Triton kernel, within rounding.

Why: the Triton kernel (64 keys, 128 rows, 8 warps, 3 stages) is 15.6 ms of the 32K trained backward at ONE
program an SM (255 registers, 183 KB shared), latency-bound (ncu, session 20: 0.39 eligible warps a scheduler,
DRAM 34%): each 128-row chunk's q / dO gathers are waited for before its first dot. Here chunk i + STAGES - 1's
rows are in flight (no registers held) while chunk i's MMAs run.

One program per (key tile j of 64 keys, KV head), 8 warps (two warpgroups): K / V `[64, D]` in shared memory; per
chunk of 128 / G queries (their G head rows each, 128 rows): S = q K^T and dP = dO V^T (M = 128 rows), P and
dS = P (dP - delta) written to shared memory as bf16, then dV^T += dO^T P and dK^T += q^T dS (M = D: the "dt"
form, both operands from shared memory); dk / dv written once, no atomics.
"""

from __future__ import annotations

import torch
import triton

from sparse_rl.sparse.ops.sparse_attention import keyq, keyq_gluon_ws
from sparse_rl.sparse.ops.sparse_attention.keyq_gluon_chunk import kernel_args
from sparse_rl.sparse.ops.sparse_attention.union import LOG2E
from sparse_rl.sparse.ops.sparse_attention.union_gluon import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy

    from sparse_rl.sparse.ops.sparse_attention.keyq_gluon_chunk import (_chunk_grads, _chunk_list, _chunk_scores,
                                                                        _issue_chunk, _issue_rows, _key_tile_program,
                                                                        _row_stats)
    from sparse_rl.sparse.ops.sparse_attention.union_gluon import _ring_landed

BN = 64  # keys a tile by default (int64 masks; 32: int32)
ROWS = 128  # MMA rows a chunk by default: 128 / G queries on 8 warps (64 rows: 4 warps, two programs an SM)


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """The shapes this kernel takes: G dividing 128, D 128 (dK^T / dV^T are `[D, 64]` in S's MMA layout), bf16 /
    fp16, unit stride along D."""
    G = q.shape[2] // k.shape[2]
    return (ROWS % G == 0 and q.shape[3] == ROWS and q.dtype in (torch.bfloat16, torch.float16)
            and k.dtype == q.dtype and all(x.stride(3) == 1 for x in (q, k)))


if HAVE_GLUON:

    @gluon.jit
    def _kq_dkdv_gluon_kernel(Q, K, V, DO, LSE, DELTA, OFF, LIST, MSK, DK, DV,
                              sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sdob, sdot, sdoh, slb, slt, slh,
                              sdkb, sdks, sdkh, S, G, NKT, scale, qk_scale,
                              BQ: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, GH: gl.constexpr,
                              PREFETCH: gl.constexpr, ROWS: gl.constexpr, BN: gl.constexpr):
        W: gl.constexpr = ROWS // 16  # warps: 8 (two warpgroups on 128 rows) or 4 (one on 64)
        kvh, j, b = _key_tile_program(NKT, GH)
        dt: gl.constexpr = Q.dtype.element_ty
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [W, 1], [1, 0])
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BN, 16])
        RS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, D], dt)
        KS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], dt)
        PS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BN], dt)

        q_smem = gl.allocate_shared_memory(dt, [STAGES, ROWS, D], RS)
        do_smem = gl.allocate_shared_memory(dt, [STAGES, ROWS, D], RS)
        k_smem = gl.allocate_shared_memory(dt, [BN, D], KS)
        v_smem = gl.allocate_shared_memory(dt, [BN, D], KS)
        p_smem = gl.allocate_shared_memory(dt, [ROWS, BN], PS)
        ds_smem = gl.allocate_shared_memory(dt, [ROWS, BN], PS)

        lo = gl.load(OFF + b * NKT + j)
        hi = gl.load(OFF + b * NKT + j + 1)
        for i in gl.static_range(STAGES - 1):
            _issue_chunk(q_smem, do_smem, Q, DO, LIST, b, lo + i * BQ, hi, kvh, G, sqb, sqt, sqh, sdob, sdot, sdoh,
                         i, BQ, D, ROWS, LOAD)
        n_l = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LOAD))
        d_l = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
        k_smem.store(gl.load(K + b * skb + n_l[:, None] * sks + kvh * skh + d_l[None, :], mask=(n_l < S)[:, None],
                             other=0.0))
        v_smem.store(gl.load(V + b * svb + n_l[:, None] * svs + kvh * svh + d_l[None, :], mask=(n_l < S)[:, None],
                             other=0.0))

        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, ACC))
        nbit = gl.arange(0, BN, layout=gl.SliceLayout(0, ACC)).to(MSK.dtype.element_ty)
        z = gl.zeros([ROWS, BN], gl.float32, ACC)
        dk = gl.zeros([D, BN], gl.float32, ACC)
        dv = gl.zeros([D, BN], gl.float32, ACC)
        heads = kvh * G + r % G
        nchunks = gl.cdiv(hi - lo, BQ)
        if PREFETCH:  # the list entries one chunk ahead; the key bits, lse and delta loaded under the S / dP MMAs
            tc, _ = _chunk_list(LIST, lo + (STAGES - 1) * BQ, hi, G, BQ, ROWS, gl.SliceLayout(1, LOAD))
            t, ok = _chunk_list(LIST, lo, hi, G, BQ, ROWS, gl.SliceLayout(1, ACC))
            for i in range(nchunks):
                _ring_landed(STAGES - 2)
                nxt = i + STAGES - 1
                _issue_rows(q_smem, do_smem, Q, DO, tc, b, kvh, G, sqb, sqt, sqh, sdob, sdot, sdoh, nxt % STAGES, D,
                            ROWS, LOAD)
                tc, _ = _chunk_list(LIST, lo + (nxt + 1) * BQ, hi, G, BQ, ROWS, gl.SliceLayout(1, LOAD))
                st = i % STAGES
                s, dp = _chunk_scores(q_smem.index(st), do_smem.index(st), k_smem, v_smem, z)
                w = gl.load(MSK + lo + i * BQ + r // G, mask=ok, other=0)
                lse, delta = _row_stats(LSE, DELTA, t, ok, b, heads, slb, slt, slh)
                t_n, ok_n = _chunk_list(LIST, lo + (i + 1) * BQ, hi, G, BQ, ROWS, gl.SliceLayout(1, ACC))
                dk, dv = _chunk_grads(s, dp, q_smem.index(st), do_smem.index(st), p_smem, ds_smem, dk, dv, lse, delta,
                                      w, ok, nbit, qk_scale, dt)
                t, ok = t_n, ok_n
        else:
            for i in range(nchunks):
                e = lo + i * BQ + r // G
                ok = (r // G < BQ) & (e < hi)
                t = gl.load(LIST + e, mask=ok, other=0).to(gl.int64)
                w = gl.load(MSK + e, mask=ok, other=0)
                lse = gl.load(LSE + b * slb + t * slt + heads * slh, mask=ok, other=float("-inf"))
                delta = gl.load(DELTA + b * slb + t * slt + heads * slh, mask=ok, other=0.0)
                # every thread's copies of chunk i landed; every warp is past chunk i - 1's MMAs (its stage, P, dS
                # free)
                _ring_landed(STAGES - 2)
                nxt = i + STAGES - 1
                _issue_chunk(q_smem, do_smem, Q, DO, LIST, b, lo + nxt * BQ, hi, kvh, G, sqb, sqt, sqh, sdob, sdot,
                             sdoh, nxt % STAGES, BQ, D, ROWS, LOAD)
                st = i % STAGES
                s, dp = _chunk_scores(q_smem.index(st), do_smem.index(st), k_smem, v_smem, z)
                dk, dv = _chunk_grads(s, dp, q_smem.index(st), do_smem.index(st), p_smem, ds_smem, dk, dv, lse, delta,
                                      w, ok, nbit, qk_scale, dt)
        async_copy.wait_group(0)
        d_o = gl.arange(0, D, layout=gl.SliceLayout(1, ACC))
        n_o = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, ACC))
        m = (n_o < S)[None, :]
        base = b * sdkb + n_o[None, :] * sdks + kvh * sdkh + d_o[:, None]
        gl.store(DK + base, (dk * scale).to(dt), mask=m)
        gl.store(DV + base, dv.to(dt), mask=m)


def keyq_dkdv_gluon(q, k, v, indices, do, lse, delta, scale: float, tune: tuple | None = None, lists=None):
    """`keyq.keyq_dkdv` on an sm_90 GPU: dk, dv `[B, S, H_kv, D]` of per-query `indices` `[B, T, K]`; q / do
    `[B, T, H, D]`, lse / delta `[B, T, H]` fp32 with equal strides. tune = (STAGES, heads_together, prefetch, rows,
    keys), each entry left out taking its default:
    - STAGES 2 (3 would need more than 227 KB of shared memory);
    - heads_together: the KV heads interleaved in the program order (default: the Triton kernel's,
      `keyq.default_tune`);
    - prefetch 1 (default) = the list entries read a chunk ahead and the key bits, lse and delta under the S / dP
      MMAs; 0 = all read before the MMAs, two dependent loads' latency a chunk (session 31, H100, 32K trained:
      14.11-14.30 ms against 14.82-15.06, Triton 15.05-15.14);
    - rows 128 (default: 8 warps, 192 KB of shared memory, one program an SM) or 64 (4 warps, 112 KB, two programs
      an SM; holding all of dK^T / dV^T spills, 24.7 ms);
    - keys a tile 64 (default) or 32 (half the accumulators, no spills on 64 rows, more (tile, query) pairs to
      gather: 14.5 ms);
    - ws 1: `keyq_gluon_ws`, a producer warpgroup and two consumer warpgroups of 32 keys each (FA3's structure;
      session 31, not yet run on a GPU), default 0.
    Through `sparse_attention`, `tune={"keyq_gluon": ...}`; `lists`: a prebuilt `keyq.key_query_lists(indices, S,
    keys)`."""
    if not supports(q, k) or do.stride(3) != 1 or v.stride(3) != 1 or lse.stride() != delta.stride():
        raise ValueError(f"keyq_dkdv_gluon: G dividing 128, D 128, bf16 / fp16 only (q {tuple(q.shape)} "
                         f"{q.dtype}, k {tuple(k.shape)})")
    B, T, H, D = q.shape
    S, H_kv = k.shape[1], k.shape[2]
    G = H // H_kv
    given = tuple(tune or ())
    stages, gh, prefetch, rows, bn, ws = given + (2, None, 1, ROWS, BN, 0)[len(given):]
    if gh is None:  # the Triton kernel's program order (its tune's sixth entry; absent: all KV heads)
        gh = (*keyq.default_tune(True, H_kv), None, None)[5] or H_kv
    if stages != 2 or gh < 1 or H_kv % gh or rows not in (64, 128) or rows % G or bn not in (32, 64):
        raise ValueError(f"keyq_dkdv_gluon: tune {tune}: 2 stages (3: > 227 KB shared), heads_together dividing "
                         f"{H_kv}, rows 64 / 128 divisible by G {G}, keys 32 / 64")
    off, lst, msk = lists if lists is not None else keyq.key_query_lists(indices, S, bn)
    if msk.dtype != (torch.int64 if bn == 64 else torch.int32):
        raise ValueError(f"keyq_dkdv_gluon: lists of {msk.dtype} masks for {bn}-key tiles")
    if ws:  # the warp-specialized form: 128 rows, 64-key tiles, 2 stages, its lists read ahead by its producer
        if rows != 128 or bn != 64 or not keyq_gluon_ws.available():
            raise ValueError(f"keyq_dkdv_gluon: tune {tune}: ws needs rows 128, 64-key tiles and Gluon's "
                             "warp_specialize")
        return keyq_gluon_ws.launch(q, k, v, do, lse, delta, (off, lst, msk), scale, LOG2E, gh)
    grid, args, dk, dv = kernel_args(q, k, v, do, lse, delta, (off, lst, msk), bn, scale, LOG2E)
    _kq_dkdv_gluon_kernel[grid](*args, BQ=rows // G, D=D, STAGES=stages, GH=gh, PREFETCH=bool(prefetch), ROWS=rows,
                                BN=bn, num_warps=rows // 16)
    return dk, dv
