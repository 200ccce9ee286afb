"""The union-tile sparse attention forward in Gluon (Hopper): the key rows gathered by cp.async into a ring of
shared-memory stages, QK^T and PV on warpgroup MMAs. Same tiles, masks and result as `union.tile_fwd` (within
rounding: 64-key blocks instead of 32, so another fp32 summation order).

Why: the Triton tile forward runs its MMA work at ~290 TFLOP/s (32K, trained selections, H100) against dense
attention's ~600, because Triton 3.6's pipeliner issues the row gathers of a key block only one iteration ahead
and waits for all of them before the QK dot (the gathers' addresses come from the key list loaded in the loop;
session 22's TTGIR), and a register prefetch costs the occupancy that hides the rest (session 25). Gluon states
the pipeline: block j + STAGES - 1's K / V rows are in flight (cp.async, 16 bytes a thread and row chunk,
no registers held) while block j's two MMAs and its online softmax run.

One program per (tile of BT queries, KV head): the tile's BT * G query rows are the MMA's M = 64 (one warpgroup);
the tile's union of selected keys (`union.build_union`, ascending, padded with zeroed masks to whole
`SLOT_PAD` blocks) is read BK keys at a time; row r = (query r // G, head r % G) keeps key slot u where bit r // G
of qmask[u] is set. Per-query selections only (shared `query_group` rows keep the Triton kernel).
"""

from __future__ import annotations

import torch
import triton

# Gluon's API moved between releases (names, layouts): these kernels are run on Triton 3.6 (the GPU machine's) and
# compiled for sm_90a under 3.9; an older Triton with a partial Gluon keeps the Triton kernels rather than failing
# to compile the default backward
MIN_TRITON = (3, 6)
try:  # the CPU / interpreter paths never reach it
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < MIN_TRITON:
        raise ImportError(f"Triton {triton.__version__}: the Gluon kernels need >= 3.6")
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    # Triton 3.6 (the GPU machine's) names the cp.async gather `async_copy_global_to_shared`; later ones `async_load`
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # renamed `barrier` after 3.6
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - older Triton
    HAVE_GLUON = False

from sparse_rl.sparse.ops.sparse_attention.union import LOG2E, SLOT_PAD, TileSelection

ROWS = 64  # one warpgroup's MMA rows
WARPS = 4
# Default launches (session 31, H100, 32K trained; results/2026-12-07-h100-session31.md): the forward on 32-key
# blocks with its key lists read a block ahead, 5.44-6.16 ms (median 5.60) against Triton's 6.33-7.44 (6.41) and
# 6.15-6.80 (6.17) without the prefetch; the dq on 64-key blocks with the prefetch, 6.35-6.40 against 7.25-7.40
# without and Triton's 7.85-7.92.
FWD_TUNE = (32, 2, 0, 1)
DQ_TUNE = (64, 2, 1)


def available(q: torch.Tensor) -> bool:
    """Whether the Gluon kernels (here and keyq_gluon.py) can run on q's device: Gluon of Triton >= MIN_TRITON, a
    CUDA GPU of sm_90 (warpgroup MMA)."""
    return HAVE_GLUON and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9


def supports(q: torch.Tensor, k: torch.Tensor, sel: TileSelection) -> bool:
    """The shapes this kernel takes: per-query tiles of 64 rows (BT * G == 64), D 64 or 128, bf16 / fp16, unit
    stride along D, key lists padded to whole 64-slot blocks."""
    G = q.shape[2] // k.shape[2]
    return (not sel.shared and sel.BT * G == ROWS and q.shape[3] in (64, 128)
            and q.dtype in (torch.bfloat16, torch.float16) and all(x.stride(3) == 1 for x in (q, k))
            and sel.ukey.shape[2] % 64 == 0 and sel.ukey.stride(2) == 1)


def _require_supported(name: str, q: torch.Tensor, k: torch.Tensor, sel: TileSelection) -> None:
    if not supports(q, k, sel):
        raise ValueError(f"{name}: per-query 64-row tiles, D 64 / 128, bf16 / fp16 only (q {tuple(q.shape)} "
                         f"{q.dtype}, BT {sel.BT}, group {sel.group})")


if HAVE_GLUON:

    @gluon.jit
    def _block_keys(UKEY, urow, u0, n, BK: gl.constexpr, LOAD: gl.constexpr):
        """Block u0's key positions `[BK]` int32 in SliceLayout(1, LOAD) (slots past n read key 0: their masks are
        zero)."""
        offs_u = u0 + gl.arange(0, BK, layout=gl.SliceLayout(1, LOAD))
        return gl.load(UKEY + urow + offs_u, mask=offs_u < n, other=0)

    @gluon.jit
    def _issue_keys(k_smem, v_smem, kbase, vbase, key, sks, svs, stage, D: gl.constexpr, LOAD: gl.constexpr):
        """cp.async the K / V rows `[BK, D]` of positions key (`_block_keys`) into ring stage `stage`, one commit
        group."""
        key = key.to(gl.int64)
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
        _cp_async(k_smem.index(stage), kbase + key[:, None] * sks + offs_d[None, :])
        _cp_async(v_smem.index(stage), vbase + key[:, None] * svs + offs_d[None, :])
        async_copy.commit_group()

    @gluon.jit
    def _issue_block(k_smem, v_smem, kbase, vbase, UKEY, urow, u0, n, sks, svs, stage,
                     BK: gl.constexpr, D: gl.constexpr, LOAD: gl.constexpr):
        """`_issue_keys` of block u0, its key list read here (the load's latency stalls the caller)."""
        _issue_keys(k_smem, v_smem, kbase, vbase, _block_keys(UKEY, urow, u0, n, BK, LOAD), sks, svs, stage, D, LOAD)

    @gluon.jit
    def _ring_landed(WAIT: gl.constexpr):
        """This thread's cp.async groups down to WAIT in flight, its copies fenced for the MMAs' async-proxy reads,
        then a CTA barrier: every thread's copies have landed, and every warp is past the MMAs it issued before (so
        the ring stage those read may be refilled)."""
        async_copy.wait_group(WAIT)
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _tile_rows(tile, kvh, G, T, BT: gl.constexpr, layout: gl.constexpr):
        """The tile's 64 MMA rows in `layout` (a slice along rows): query-in-tile, query position, head, valid."""
        r = gl.arange(0, 64, layout=layout)
        t = tile * BT + r // G
        return r // G, t, kvh * G + r % G, (r // G < BT) & (t < T)

    @gluon.jit
    def _rows_to_smem(smem, X, b, sxb, sxt, sxh, tile, kvh, G, T, BT: gl.constexpr, D: gl.constexpr,
                      LOAD: gl.constexpr):
        """The tile's rows of X `[B, T, H, D]` (q or dO; zero past T) into smem `[64, D]`."""
        _, t, heads, ok = _tile_rows(tile, kvh, G, T, BT, gl.SliceLayout(1, LOAD))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
        smem.store(gl.load(X + b * sxb + t[:, None] * sxt + heads[:, None] * sxh + offs_d[None, :], mask=ok[:, None],
                           other=0.0))

    @gluon.jit
    def _online_pv(s, qm, rbit, m_i, l_i, acc, v_st, qk_scale, dt: gl.constexpr, O_L: gl.constexpr,
                   P_L: gl.constexpr):
        """One key block's online softmax on its scores s `[M, BK]` (rows keep the slots whose query mask qm has
        their bit rbit) and its PV MMA issued (async: the caller waits) -> (m_i, l_i, acc)."""
        sel = (qm[None, :] & rbit[:, None]) != 0
        s = gl.where(sel, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(dt), P_L), v_st, acc, is_async=True)
        return m_new, l_i, acc

    @gluon.jit
    def _tile_fwd_gluon_kernel(Q, K, V, UKEY, QMASK, ULEN, O, LSE,
                               sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sob, sot, soh, slb, slt, slh, sub, sur,
                               T, G, NT, UMAX, qk_scale,
                               BT: gl.constexpr, BK: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                               PIPE: gl.constexpr, PREFETCH: gl.constexpr):
        M: gl.constexpr = 64
        tile = gl.program_id(0)
        kvh = gl.program_id(1)
        b = gl.program_id(2).to(gl.int64)
        dt: gl.constexpr = Q.dtype.element_ty
        # register layouts: the gathers (16 bytes a thread along D), the two MMA accumulators, P as MMA operand A
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [4, 1], [1, 0])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        QS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, D], dt)
        KS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, D], dt)

        q_smem = gl.allocate_shared_memory(dt, [M, D], QS)
        k_smem = gl.allocate_shared_memory(dt, [STAGES, BK, D], KS)
        v_smem = gl.allocate_shared_memory(dt, [STAGES, BK, D], KS)

        urow = b * sub + tile * sur
        n = gl.load(ULEN + b * NT + tile)
        kbase = K + b * skb + kvh * skh
        vbase = V + b * svb + kvh * svh
        for i in gl.static_range(STAGES - 1):  # the ring's first blocks in flight before Q is even read
            _issue_block(k_smem, v_smem, kbase, vbase, UKEY, urow, i * BK, n, sks, svs, i, BK, D, LOAD)

        _rows_to_smem(q_smem, Q, b, sqb, sqt, sqh, tile, kvh, G, T, BT, D, LOAD)
        qi, _, _, rmask = _tile_rows(tile, kvh, G, T, BT, gl.SliceLayout(1, S_L))
        rbit = gl.where(rmask, gl.full([M], 1, gl.int32, gl.SliceLayout(1, S_L)) << qi, 0)
        m_i = gl.full([M], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
        l_i = gl.zeros([M], gl.float32, gl.SliceLayout(1, S_L))
        acc = gl.zeros([M, D], gl.float32, O_L)
        s0 = gl.zeros([M, BK], gl.float32, S_L)
        qrow = (b * NT + tile) * UMAX
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, S_L))
        nb = gl.cdiv(n, BK)
        if PIPE:  # S of block j + 1 on the tensor cores while block j's softmax runs (FA3's in-warpgroup overlap)
            _ring_landed(STAGES - 2)
            s_cur = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s0, use_acc=False, is_async=True)
            s_cur = warpgroup_mma_wait(0, deps=(s_cur,))
            for j in range(nb):
                _ring_landed(STAGES - 3)  # block j + 1 landed; every warp is past block j - 1's PV: its stage is free
                nxt = j + STAGES - 1
                _issue_block(k_smem, v_smem, kbase, vbase, UKEY, urow, nxt * BK, n, sks, svs, nxt % STAGES, BK, D,
                             LOAD)
                # (at j = nb - 1 this scores block nb: key 0 rows, never used)
                s_nxt = warpgroup_mma(q_smem, k_smem.index((j + 1) % STAGES).permute((1, 0)), s0, use_acc=False,
                                      is_async=True)
                qm = gl.load(QMASK + qrow + j * BK + offs_k)
                m_i, l_i, acc = _online_pv(s_cur, qm, rbit, m_i, l_i, acc, v_smem.index(j % STAGES), qk_scale, dt,
                                           O_L, P_L)
                s_cur, acc = warpgroup_mma_wait(0, deps=(s_nxt, acc))
        else:
            key_n = _block_keys(UKEY, urow, (STAGES - 1) * BK, n, BK, LOAD)  # PREFETCH: the next block's keys
            for j in range(nb):
                # block j (and q's store) landed; every warp waited for block j - 1's MMAs, so its stage takes block
                # j + STAGES - 1
                _ring_landed(STAGES - 2)
                nxt = j + STAGES - 1
                if PREFETCH:  # keys read a block ahead: no dependent load between the ring's wait and the MMA
                    _issue_keys(k_smem, v_smem, kbase, vbase, key_n, sks, svs, nxt % STAGES, D, LOAD)
                    key_n = _block_keys(UKEY, urow, (nxt + 1) * BK, n, BK, LOAD)
                else:
                    _issue_block(k_smem, v_smem, kbase, vbase, UKEY, urow, nxt * BK, n, sks, svs, nxt % STAGES, BK,
                                 D, LOAD)
                st = j % STAGES
                s = warpgroup_mma(q_smem, k_smem.index(st).permute((1, 0)), s0, use_acc=False, is_async=True)
                qm = gl.load(QMASK + qrow + j * BK + offs_k)  # zero past |U| (SLOT_PAD)
                s = warpgroup_mma_wait(0, deps=(s,))
                m_i, l_i, acc = _online_pv(s, qm, rbit, m_i, l_i, acc, v_smem.index(st), qk_scale, dt, O_L, P_L)
                acc = warpgroup_mma_wait(0, deps=(acc,))
        async_copy.wait_group(0)  # no copy left in flight at exit

        _, to, heads_o, ok_o = _tile_rows(tile, kvh, G, T, BT, gl.SliceLayout(1, O_L))
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, O_L))
        empty = l_o == 0.0
        out = acc / gl.where(empty, 1.0, l_o)[:, None]
        od = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
        gl.store(O + b * sob + to[:, None] * sot + heads_o[:, None] * soh + od[None, :], out.to(dt),
                 mask=ok_o[:, None])
        m_o = gl.convert_layout(m_i, gl.SliceLayout(1, O_L))
        lse = gl.where(empty, float("-inf"), (m_o + gl.log2(gl.where(empty, 1.0, l_o))) / 1.4426950408889634)
        gl.store(LSE + b * slb + to * slt + heads_o * slh, lse, mask=ok_o)


    @gluon.jit
    def _tile_dq_gluon_kernel(Q, K, V, UKEY, QMASK, ULEN, DO, LSE, DELTA, DQ,
                              sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sdob, sdot, sdoh, slb, slt, slh,
                              sdqb, sdqt, sdqh, sub, sur, T, G, NT, UMAX, scale, qk_scale,
                              BT: gl.constexpr, BK: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                              PREFETCH: gl.constexpr):
        """dq of one (tile, KV head) as `union._tile_dq_kernel`: per key block S = q K^T and dP = dO V^T (two
        warpgroup MMAs on the gathered rows), dS = P (dP - delta), dq += dS K (dS from registers); stored once."""
        M: gl.constexpr = 64
        tile = gl.program_id(0)
        kvh = gl.program_id(1)
        b = gl.program_id(2).to(gl.int64)
        dt: gl.constexpr = Q.dtype.element_ty
        LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // D, D // 8], [4, 1], [1, 0])
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BK, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        QS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, D], dt)
        KS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, D], dt)

        q_smem = gl.allocate_shared_memory(dt, [M, D], QS)
        do_smem = gl.allocate_shared_memory(dt, [M, D], QS)
        k_smem = gl.allocate_shared_memory(dt, [STAGES, BK, D], KS)
        v_smem = gl.allocate_shared_memory(dt, [STAGES, BK, D], KS)

        urow = b * sub + tile * sur
        n = gl.load(ULEN + b * NT + tile)
        kbase = K + b * skb + kvh * skh
        vbase = V + b * svb + kvh * svh
        for i in gl.static_range(STAGES - 1):
            _issue_block(k_smem, v_smem, kbase, vbase, UKEY, urow, i * BK, n, sks, svs, i, BK, D, LOAD)

        _rows_to_smem(q_smem, Q, b, sqb, sqt, sqh, tile, kvh, G, T, BT, D, LOAD)
        _rows_to_smem(do_smem, DO, b, sdob, sdot, sdoh, tile, kvh, G, T, BT, D, LOAD)
        qi, t, heads, rmask = _tile_rows(tile, kvh, G, T, BT, gl.SliceLayout(1, S_L))
        lse = gl.load(LSE + b * slb + t * slt + heads * slh, mask=rmask, other=float("-inf"))
        delta = gl.load(DELTA + b * slb + t * slt + heads * slh, mask=rmask, other=0.0)
        row_ok = (lse != float("-inf")) & rmask
        lse2 = gl.where(row_ok, lse * 1.4426950408889634, 0.0)
        rbit = gl.where(row_ok, gl.full([M], 1, gl.int32, gl.SliceLayout(1, S_L)) << qi, 0)
        dq = gl.zeros([M, D], gl.float32, O_L)
        s0 = gl.zeros([M, BK], gl.float32, S_L)
        qrow = (b * NT + tile) * UMAX
        offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, S_L))
        key_n = _block_keys(UKEY, urow, (STAGES - 1) * BK, n, BK, LOAD)  # PREFETCH: the next block's keys
        for j in range(gl.cdiv(n, BK)):
            _ring_landed(STAGES - 2)  # block j landed everywhere; every warp is past block j - 1's MMAs
            nxt = j + STAGES - 1
            if PREFETCH:  # as in the forward
                _issue_keys(k_smem, v_smem, kbase, vbase, key_n, sks, svs, nxt % STAGES, D, LOAD)
                key_n = _block_keys(UKEY, urow, (nxt + 1) * BK, n, BK, LOAD)
            else:
                _issue_block(k_smem, v_smem, kbase, vbase, UKEY, urow, nxt * BK, n, sks, svs, nxt % STAGES, BK, D,
                             LOAD)
            st = j % STAGES
            s = warpgroup_mma(q_smem, k_smem.index(st).permute((1, 0)), s0, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_smem, v_smem.index(st).permute((1, 0)), s0, use_acc=False, is_async=True)
            qm = gl.load(QMASK + qrow + j * BK + offs_k)
            s, dp = warpgroup_mma_wait(0, deps=(s, dp))
            sel = (qm[None, :] & rbit[:, None]) != 0
            p = gl.where(sel, gl.exp2(s * qk_scale - lse2[:, None]), 0.0)
            ds = p * (dp - delta[:, None])
            dq = warpgroup_mma(gl.convert_layout(ds.to(dt), P_L), k_smem.index(st), dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq,))
        async_copy.wait_group(0)

        _, to, heads_o, ok_o = _tile_rows(tile, kvh, G, T, BT, gl.SliceLayout(1, O_L))
        od = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
        gl.store(DQ + b * sdqb + to[:, None] * sdqt + heads_o[:, None] * sdqh + od[None, :], (dq * scale).to(dt),
                 mask=ok_o[:, None])


def tile_fwd_gluon(q, k, v, sel: TileSelection, scale: float, out=None, tune: tuple | None = None):
    """`union.tile_fwd` for per-query 64-row tiles on an sm_90 GPU: q `[B, T, H, D]`, k / v `[B, S, H_kv, D]`
    -> out `[B, T, H, D]`, lse `[B, T, H]` fp32. tune = (BK, STAGES[, PIPE[, PREFETCH]]): keys a block (64), ring
    stages (2), PIPE 1 = the next block's QK^T issued before this block's softmax (needs 3 stages or more),
    PREFETCH 1 = each block's key list read a block ahead (without PIPE; default 0: read just before its copies,
    the load's latency exposed every block); through
    `sparse_attention`, `tune={"fwd_gluon": ...}`."""
    _require_supported("tile_fwd_gluon", q, k, sel)
    B, T, H, D = q.shape
    G = H // k.shape[2]
    NT = triton.cdiv(T, sel.BT)
    if out is None:
        o = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
        lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    else:
        o, lse = out
    if v.stride(3) != 1 or o.stride(3) != 1:
        raise ValueError("tile_fwd_gluon: v and out need unit stride along D")
    BK, stages, pipe, prefetch = (*(tune or FWD_TUNE), 0, 0)[:4]
    if stages < (3 if pipe else 2):
        raise ValueError(f"tile_fwd_gluon: tune {tune}: at least {3 if pipe else 2} stages")
    if sel.ukey.shape[2] % BK or BK > SLOT_PAD:
        raise ValueError(f"tile_fwd_gluon: {BK}-key blocks over key lists of {sel.ukey.shape[2]} slots")
    _tile_fwd_gluon_kernel[(NT, k.shape[2], B)](
        q, k, v, sel.ukey, sel.qmask, sel.ulen, o, lse, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        sel.ukey.stride(0), sel.ukey.stride(1), T, G, NT, sel.ukey.shape[2], scale * LOG2E,
        BT=sel.BT, BK=BK, D=D, STAGES=stages, PIPE=bool(pipe), PREFETCH=bool(prefetch), num_warps=WARPS)
    return o, lse


def tile_dq_gluon(q, k, v, sel: TileSelection, do, lse, delta, scale: float, tune: tuple | None = None):
    """`union.tile_dq` for per-query 64-row tiles on an sm_90 GPU: dq `[B, T, H, D]` (q.dtype); lse / delta
    `[B, T, H]` fp32 with equal strides (delta = rowsum(o * dO) - dlse). tune = (BK, STAGES[, PREFETCH]), default
    (64, 2, 0) (PREFETCH as the forward's); through `sparse_attention`, `tune={"dq_gluon": ...}`."""
    _require_supported("tile_dq_gluon", q, k, sel)
    if do.stride(3) != 1 or v.stride(3) != 1 or lse.stride() != delta.stride():
        raise ValueError("tile_dq_gluon: do and v need unit stride along D, lse and delta equal strides")
    B, T, H, D = q.shape
    NT = triton.cdiv(T, sel.BT)
    BK, stages, prefetch = (*(tune or DQ_TUNE), 0)[:3]
    if sel.ukey.shape[2] % BK or BK > SLOT_PAD or stages < 2:
        raise ValueError(f"tile_dq_gluon: tune {tune} over key lists of {sel.ukey.shape[2]} slots")
    dq = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
    _tile_dq_gluon_kernel[(NT, k.shape[2], B)](
        q, k, v, sel.ukey, sel.qmask, sel.ulen, do, lse, delta, dq, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2), sel.ukey.stride(0), sel.ukey.stride(1), T, H // k.shape[2], NT,
        sel.ukey.shape[2], scale, scale * LOG2E, BT=sel.BT, BK=BK, D=D, STAGES=stages, PREFETCH=bool(prefetch),
        num_warps=WARPS)
    return dq
