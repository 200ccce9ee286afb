"""The pieces both Gluon dk/dv kernels (`keyq_gluon`, `keyq_gluon_ws`) are built from: the program order, a
chunk's query list, its q / dO gathers, its lse / delta, its four MMAs, and the launch arguments they share."""

from __future__ import annotations

import torch
import triton

from sparse_rl.sparse.ops.sparse_attention.union_gluon import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from sparse_rl.sparse.ops.sparse_attention.union_gluon import _cp_async, _cta_barrier

    @gluon.jit
    def _key_tile_program(NKT, GH: gl.constexpr):
        """This program's (KV head, key tile, batch) in `keyq._tile_of`'s order (this module's kernel and
        `keyq_gluon_ws`'s)."""
        pid = gl.program_id(0)
        grp = pid // (GH * NKT)
        rr = pid % (GH * NKT)
        return grp * GH + rr % GH, rr // GH, gl.program_id(1).to(gl.int64)

    @gluon.jit
    def _chunk_list(LIST, c, hi, G, BQ: gl.constexpr, ROWS: gl.constexpr, layout: gl.constexpr):
        """The query of each of the chunk's ROWS rows (list entries c .. c + BQ, G rows each; entries past hi read
        query 0, their rows masked out later) `[ROWS]` int32 in `layout`, and whether the row is live."""
        r = gl.arange(0, ROWS, layout=layout)
        e = c + r // G
        ok = (r // G < BQ) & (e < hi)
        return gl.load(LIST + e, mask=ok, other=0), ok

    @gluon.jit
    def _issue_rows(q_smem, do_smem, Q, DO, t, b, kvh, G, sqb, sqt, sqh, sdob, sdot, sdoh, stage,
                    D: gl.constexpr, ROWS: gl.constexpr, LOAD: gl.constexpr):
        """cp.async the q / dO rows `[ROWS, D]` of queries t (`_chunk_list` in SliceLayout(1, LOAD)) into ring stage
        `stage`, one commit group."""
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LOAD))
        t = t.to(gl.int64)
        heads = kvh * G + r % G
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
        _cp_async(q_smem.index(stage), Q + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + offs_d[None, :])
        _cp_async(do_smem.index(stage), DO + b * sdob + t[:, None] * sdot + heads[:, None] * sdoh + offs_d[None, :])
        async_copy.commit_group()

    @gluon.jit
    def _issue_chunk(q_smem, do_smem, Q, DO, LIST, b, c, hi, kvh, G, sqb, sqt, sqh, sdob, sdot, sdoh, stage,
                     BQ: gl.constexpr, D: gl.constexpr, ROWS: gl.constexpr, LOAD: gl.constexpr):
        """`_issue_rows` of list entries c .. c + BQ (the list read here: its latency is the caller's stall)."""
        t, _ = _chunk_list(LIST, c, hi, G, BQ, ROWS, gl.SliceLayout(1, LOAD))
        _issue_rows(q_smem, do_smem, Q, DO, t, b, kvh, G, sqb, sqt, sqh, sdob, sdot, sdoh, stage, D, ROWS, LOAD)

    @gluon.jit
    def _row_stats(LSE, DELTA, t, ok, b, heads, slb, slt, slh):
        """lse / delta `[ROWS]` of the chunk's rows (queries t, live rows ok)."""
        t = t.to(gl.int64)
        lse = gl.load(LSE + b * slb + t * slt + heads * slh, mask=ok, other=float("-inf"))
        delta = gl.load(DELTA + b * slb + t * slt + heads * slh, mask=ok, other=0.0)
        return lse, delta

    @gluon.jit
    def _chunk_scores(q_st, do_st, k_smem, v_smem, z):
        """S = q K^T and dP = dO V^T on a chunk's rows (ring stage q_st / do_st; the keys of k_smem / v_smem), issued
        (async: `_chunk_grads` waits)."""
        s = warpgroup_mma(q_st, k_smem.permute((1, 0)), z, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_st, v_smem.permute((1, 0)), z, use_acc=False, is_async=True)
        return s, dp

    @gluon.jit
    def _chunk_grads(s, dp, q_st, do_st, p_smem, ds_smem, dk, dv, lse, delta, w, ok, nbit, qk_scale,
                     dt: gl.constexpr):
        """The rest of a chunk once S / dP are issued: P and dS = P (dP - delta) to shared memory (w: each row's key
        bits), dV^T += dO^T P and dK^T += q^T dS -> (dk, dv)."""
        row_ok = (lse != float("-inf")) & ok
        lse2 = gl.where(row_ok, lse * 1.4426950408889634, 0.0)
        sel = (((w[:, None] >> nbit[None, :]) & 1) == 1) & row_ok[:, None]
        s, dp = warpgroup_mma_wait(0, deps=(s, dp))
        p = gl.where(sel, gl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        p_smem.store(p.to(dt))
        ds_smem.store((p * (dp - delta[:, None])).to(dt))
        fence_async_shared()
        # every warp's P / dS rows before MMAs that read all of them (this CTA's, or in `keyq_gluon_ws` the
        # consumer partition's: Gluon's barrier there syncs that partition's warps)
        _cta_barrier()
        dv = warpgroup_mma(do_st.permute((1, 0)), p_smem, dv, is_async=True)
        dk = warpgroup_mma(q_st.permute((1, 0)), ds_smem, dk, is_async=True)
        return warpgroup_mma_wait(0, deps=(dk, dv))



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
