"""The key-major dk/dv pass of the tile backward (no global atomics) and the backward's delta.

One program per (key tile of BN consecutive keys, KV head) runs over the query tiles whose selection
touches its key tile (a CSR list built from the tiles' bitmaps: the transposed selection), recomputes
the tile's scores and dP against its keys, accumulates dk/dv in registers and writes them once.
FSA (flash sparse attention) inverts NSA's loop the same way; here the mask inside a (key tile, query
tile) block is per token.

Two forms of the same pass (`form`):
- "rows" (session 4): dk/dv `[BN, D]` with the keys in the MMA's M dimension. At BN = 32 (the only size
  that did not spill badly: 37 ms at BN 64 vs 12.9 at 32 on the 32K block pattern, NOTES.md item 9)
  Triton cannot use Hopper's wgmma (M < 64 per warpgroup) and falls back to mma.sync with every operand
  in registers: 255 registers and a spill at BM = 64 rows (sm_90a compile of Triton 3.6 on the CPU host).
- "dt" (session 8): dk^T/dv^T `[D, BN]`, so every MMA has M = D (128) or M = the tile's BM rows
  (dK^T += Q^T dS, dV^T += dO^T P, S = Q K^T, dP = dO V^T): wgmma-shaped whatever BN, with BN free to
  shrink to 16 keys, where a trained selection's runs (~14 keys on session 7's pattern) fill more of
  each touched key tile (selected / touched keys 0.67 at BN 16, 0.56 at 32, 0.44 at 64).

The bytes this pass moves are the tile rows' q and dO (BM x D x 2 x 2 bytes) for every touched (key
tile, query tile) pair: 2 BN FLOP per byte on the MMA (64 at BN 32, from L2), the reason a bigger BN
is not simply worse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot
from sparse_rl.sparse.ops.sparse_attention.union import LOG2E, TileSelection, _common, _popc, _tile_bwd_rows

FORMS = ("rows", "dt", "dts")  # "dts": "dt" with each key tile's full (query tile) pairs first, run unmasked
# (session 9: its kernel ~9% faster on key-block rows, but its lists, sorted in torch, cost 0.9 ms more: not a default)


def _touched(bits: torch.Tensor, NKT: int, BN: int) -> torch.Tensor:
    """`[B, NR, NW]` int32 bitmaps -> `[B, NR, NKT]` bool: key tile of BN keys (16, 32, 64, 128) touched."""
    B, NR, NW = bits.shape
    if BN >= 32:
        t = bits.view(B, NR, NW * 32 // BN, BN // 32).ne(0).any(-1)
    else:  # 16-key halves of each 32-bit word, low half first (keys 32w .. 32w+15)
        t = torch.stack(((bits & 0xFFFF) != 0, (bits >> 16) & 0xFFFF != 0), -1).view(B, NR, NW * 2)
    return t[:, :, :NKT]


def _full_tiles(bits: torch.Tensor, NKT: int, BN: int) -> torch.Tensor:
    """`[B, NR, NW]` int32 bitmaps -> `[B, NR, NKT]` bool: every key of the BN-key tile selected."""
    B, NR, NW = bits.shape
    if BN >= 32:
        f = bits.view(B, NR, NW * 32 // BN, BN // 32).eq(-1).all(-1)
    else:
        f = torch.stack(((bits & 0xFFFF) == 0xFFFF, (bits >> 16) & 0xFFFF == 0xFFFF), -1).view(B, NR, NW * 2)
    return f[:, :, :NKT]


def key_tile_lists(sel: TileSelection, T: int, S: int, BN: int, split: bool = False):
    """The transposed selection: for each key tile of BN keys, the query tiles whose selection touches it.
    Returns (offsets `[B * NKT + 1]` int32, query-tile ids `[nnz]` int32 ascending per key tile, nnz); with
    `split` (shared selections) a fourth item, full `[B * NKT]` int32: how many of each key tile's entries,
    listed first, are full pairs (all BN keys selected by the group, none after the query tile's first query),
    which the "dts" form runs without a mask."""
    bits = sel.bits
    B = bits.shape[0]
    NKT = triton.cdiv(S, BN)
    touched = _touched(bits, NKT, BN)  # [B, NR, NKT]
    full = None
    if sel.shared:  # rows are groups: one per tile of BT queries, causal at key-tile granularity
        NT = triton.cdiv(T, sel.BT)
        tiles = torch.arange(NT, device=bits.device)
        touched = touched[:, tiles * sel.BT // sel.group]
        last = torch.clamp(tiles * sel.BT + sel.BT - 1, max=T - 1) + sel.q_offset  # last query position
        kt0 = torch.arange(NKT, device=bits.device)[None, :] * BN
        touched = touched & (kt0 <= last[:, None])[None]
        if split:
            first = tiles * sel.BT + sel.q_offset
            full = _full_tiles(bits, NKT, BN)[:, tiles * sel.BT // sel.group] & (kt0 + BN - 1 <= first[:, None])[None]
    elif split:
        raise ValueError("key_tile_lists(split=True) takes a shared selection")
    nz = touched.transpose(1, 2).nonzero()  # rows (b, key tile, query tile), sorted
    seg = nz[:, 0] * NKT + nz[:, 1]
    counts = torch.bincount(seg, minlength=B * NKT)
    off = torch.zeros(B * NKT + 1, dtype=torch.int32, device=bits.device)
    off[1:] = counts.cumsum(0)
    lst = nz[:, 2]
    if full is None:
        return off, lst.to(torch.int32).contiguous(), int(nz.shape[0])
    isfull = full.transpose(1, 2)[nz[:, 0], nz[:, 1], nz[:, 2]]
    order = torch.sort(seg * 2 + (~isfull).long(), stable=True).indices  # full entries first in each segment
    nfull = torch.bincount(seg[isfull], minlength=B * NKT).to(torch.int32)
    return off, lst[order].to(torch.int32).contiguous(), int(nz.shape[0]), nfull


@triton.jit
def _key_lists_kernel(BITS, LIST, CNT, NFULL, T, NT, NKT, NRB, NW, QG, q_off, BT: tl.constexpr, BN: tl.constexpr,
                      CH: tl.constexpr, SPLIT: tl.constexpr):
    """The transposed shared selection for key tile j of batch row b, written to LIST[b, j, :NT] (the
    dense form of `key_tile_lists`): the query tiles whose group row touches the tile and whose last
    query sees its first key, ascending; with SPLIT the full pairs (all BN keys selected, none after
    the tile's first query) first, then the others, each ascending. CNT / NFULL `[B, NKT]`: entries,
    full entries. The scan starts at the first query tile that can see the key tile."""
    j = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    lbase = LIST + (b * NKT + j) * NT
    k0 = j * BN
    t0 = tl.maximum(k0 - q_off, 0) // BT
    n = 0
    nf = 0
    for p in tl.static_range(2 if SPLIT else 1):
        for c0 in range(t0, NT, CH):
            tiles = c0 + tl.arange(0, CH)
            tm = tiles < NT
            brow = (b * NRB + (tiles * BT) // QG) * NW
            if BN == 16:
                word = tl.load(BITS + brow + (j >> 1), mask=tm, other=0)
                half = (word >> ((j & 1) * 16)) & 0xFFFF
                touched = half != 0
                allset = half == 0xFFFF
            else:
                WPT: tl.constexpr = BN // 32
                wi = j * WPT + tl.arange(0, WPT)
                words = tl.load(BITS + brow[:, None] + wi[None, :], mask=tm[:, None] & (wi < NW)[None, :], other=0)
                touched = tl.max((words != 0).to(tl.int32), 1) > 0
                allset = tl.min((words == -1).to(tl.int32), 1) > 0
            last = tl.minimum(tiles * BT + BT - 1, T - 1) + q_off
            live = tm & touched & (k0 <= last)
            if SPLIT:
                full = live & allset & (k0 + BN - 1 <= tiles * BT + q_off)
                take = full if p == 0 else live & ~full
            else:
                take = live
            ti = take.to(tl.int32)
            tl.store(lbase + n + tl.cumsum(ti, 0) - 1, tiles, mask=take)
            n += tl.sum(ti, 0)
        if SPLIT and p == 0:
            nf = n
    tl.store(CNT + b * NKT + j, n)
    tl.store(NFULL + b * NKT + j, nf)


def key_tile_lists_dense(sel: TileSelection, T: int, S: int, BN: int, split: bool = False):
    """`key_tile_lists` of a shared selection built on the device in one launch, no host sync: (list `[B, NKT, NT]`
    int32, count `[B, NKT]` int32, full count `[B, NKT]` int32: with `split` the first `full` entries of a key tile are
    its full pairs, else 0). A key tile's list has room for every query tile (NT), so its size is known before the
    bitmap is read; the torch form's `nonzero` synchronised the host (~0.8 ms of the 32K fwd+bwd, NOTES item 17)."""
    if not sel.shared:
        raise ValueError("key_tile_lists_dense takes a shared selection")
    bits = sel.bits
    B, NRB, NW = bits.shape
    NKT = triton.cdiv(S, BN)
    NT = triton.cdiv(T, sel.BT)
    lst = torch.empty(B, NKT, NT, dtype=torch.int32, device=bits.device)
    cnt = torch.empty(B, NKT, dtype=torch.int32, device=bits.device)
    nfull = torch.empty_like(cnt)
    CH = 256 if bits.is_cuda else 32
    _key_lists_kernel[(NKT, B)](bits, lst, cnt, nfull, T, NT, NKT, NRB, NW, sel.group, sel.q_offset, BT=sel.BT, BN=BN,
                                CH=CH, SPLIT=split, num_warps=4)
    return lst, cnt, nfull


@triton.jit
def _key_tile_mask(BITS, PREF, QMASK, b, tile, offs_n, nmask, qi, t, row_ok, NT, NRB, NW, UMAX, QG, q_off,
                   BT: tl.constexpr, SHARED: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The (row, key) pairs of the query tile that were selected, for the key tile offs_n:
    `[BLOCK_M, BLOCK_N]` when TRANSPOSED ("dt"), else `[BLOCK_N, BLOCK_M]` ("rows")."""
    w = offs_n >> 5
    bit = offs_n & 31
    if SHARED:
        brow = (b * NRB + (tile * BT) // QG) * NW
    else:
        brow = (b * NRB + tile) * NW
    word = tl.load(BITS + brow + w, mask=nmask, other=0)
    present = (((word >> bit) & 1) == 1) & nmask
    if SHARED:
        if TRANSPOSED:
            sel = present[None, :] & (offs_n[None, :] <= t[:, None] + q_off) & row_ok[:, None]
        else:
            sel = present[:, None] & (offs_n[:, None] <= t[None, :] + q_off) & row_ok[None, :]
    else:
        below = word & ((tl.full(offs_n.shape, 1, tl.int32) << bit) - 1)  # two's complement wrap at bit 31
        rank = tl.load(PREF + brow + w, mask=present, other=0) + _popc(below).to(tl.int32)
        qm = tl.load(QMASK + (b * NT + tile) * UMAX + rank, mask=present, other=0)
        if TRANSPOSED:
            sel = present[None, :] & (((qm[None, :] >> qi[:, None]) & 1) == 1) & row_ok[:, None]
        else:
            sel = present[:, None] & (((qm[:, None] >> qi[None, :]) & 1) == 1) & row_ok[None, :]
    return sel


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, BITS, PREF, QMASK, OFF, LIST, NFULL, DK, DV,
                 sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                 sdob, sdot, sdoh, sdod, slb, slt, slh, sdkb, sdks, sdkh, sdkd,
                 T, S, G, D, NT, NKT, NRB, NW, UMAX, QG, q_off, scale, qk_scale,
                 BT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 SHARED: tl.constexpr, PREC: tl.constexpr, TRANSPOSED: tl.constexpr, SPLIT: tl.constexpr,
                 DENSE: tl.constexpr):
    """dk/dv of one (key tile, kv head) over the query tiles listed for it, written once (no atomics).
    DK/DV share the layout `[B, S, H_kv, D]` (strides sdk*). TRANSPOSED: the "dt" form (module doc);
    SPLIT ("dts"): the key tile's first NFULL entries are full pairs, run without the mask. DENSE: the
    lists of `key_tile_lists_dense` (key tile (b, j) at LIST + (b * NKT + j) * NT, OFF its counts), else
    the CSR of `key_tile_lists` (OFF its offsets)."""
    j = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < S
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    nd = nmask[:, None] & dmask[None, :]
    kk = tl.load(K + b * skb + offs_n[:, None] * sks + kvh * skh + offs_d[None, :] * skd, mask=nd, other=0.0)
    vv = tl.load(V + b * svb + offs_n[:, None] * svs + kvh * svh + offs_d[None, :] * svd, mask=nd, other=0.0)
    if TRANSPOSED:
        dk = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
        dv = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    else:
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if DENSE:
        lo = (b * NKT + j) * NT
        hi = lo + tl.load(OFF + b * NKT + j)
    else:
        lo = tl.load(OFF + b * NKT + j)
        hi = tl.load(OFF + b * NKT + j + 1)
    if SPLIT:
        mid = lo + tl.load(NFULL + b * NKT + j)
        for p in range(lo, mid):  # full pairs: q / dO rows past T are zero, so they add nothing unmasked
            tile = tl.load(LIST + p)
            qi, t, heads, rd, row_ok, q, do, delta, lse2 = _tile_bwd_rows(
                Q, DO, LSE, DELTA, b, tile, kvh, sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt, slh, G, T, D,
                BT, BLOCK_M, BLOCK_D)
            s = dot(q, tl.trans(kk), PREC)
            pm = tl.exp2(s * qk_scale - lse2[:, None])
            dp = dot(do, tl.trans(vv), PREC)
            ds = pm * (dp - delta[:, None])
            dv += dot(tl.trans(do), pm.to(do.dtype), PREC)
            dk += dot(tl.trans(q), ds.to(q.dtype), PREC)
        lo = mid
    for p in range(lo, hi):
        tile = tl.load(LIST + p)
        qi, t, heads, rd, row_ok, q, do, delta, lse2 = _tile_bwd_rows(
            Q, DO, LSE, DELTA, b, tile, kvh, sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt, slh, G, T, D,
            BT, BLOCK_M, BLOCK_D)
        sel = _key_tile_mask(BITS, PREF, QMASK, b, tile, offs_n, nmask, qi, t, row_ok, NT, NRB, NW, UMAX, QG,
                             q_off, BT, SHARED, TRANSPOSED)
        if TRANSPOSED:
            s = dot(q, tl.trans(kk), PREC)  # [BLOCK_M, BLOCK_N]
            pm = tl.where(sel, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
            dp = dot(do, tl.trans(vv), PREC)
            ds = pm * (dp - delta[:, None])
            dv += dot(tl.trans(do), pm.to(do.dtype), PREC)  # [BLOCK_D, BLOCK_N]
            dk += dot(tl.trans(q), ds.to(q.dtype), PREC)
        else:
            sT = dot(kk, tl.trans(q), PREC)  # [BLOCK_N, BLOCK_M]
            pT = tl.where(sel, tl.exp2(sT * qk_scale - lse2[None, :]), 0.0)
            dv += dot(pT.to(do.dtype), do, PREC)
            dpT = dot(vv, tl.trans(do), PREC)
            dsT = pT * (dpT - delta[None, :])
            dk += dot(dsT.to(q.dtype), q, PREC)
    if TRANSPOSED:
        base = b * sdkb + offs_n[None, :] * sdks + kvh * sdkh + offs_d[:, None] * sdkd
        m = nmask[None, :] & dmask[:, None]
    else:
        base = b * sdkb + offs_n[:, None] * sdks + kvh * sdkh + offs_d[None, :] * sdkd
        m = nd
    tl.store(DK + base, (dk * scale).to(DK.dtype.element_ty), mask=m)
    tl.store(DV + base, dv.to(DV.dtype.element_ty), mask=m)


def default_tune(BM: int, cuda: bool, key_block: int = 1) -> tuple[int, int, int, str]:
    """(BLOCK_N, num_warps, num_stages, form). H200, 32K, query groups on the trained-indexer pattern, dk/dv
    pass alone (session 8, NOTES.md item 15): 64-row tiles "dt" (32, 4, 3) 16.9 ms, (32, 4, 2) 16.9,
    (16, 4, 2) 21.8, (64, 4, 2) 23.2, (64, 8, 2) 29.2, (32, 8, 2) 30.7, "rows" (32, 4, 2) 21.6; 128-row
    tiles "dt" (64, 8, 2) 15.7, (32, 8, 2) 17.0, (32, 4, 2) 17.8, (16, 8, 2) 23.4, "rows" (32, 4, 2) 24.9."""
    if not cuda:
        return (32, 4, 1, "dt")
    # on key-block rows (session 9 call 2, 32K, dk/dv with the torch lists, ms) the same launches won: kb64g64
    # (64, 8, 2) "dt" 9.59 / "dts" 9.71 (its kernel 0.8 ms faster, its sorted lists 0.9 ms slower), (64, 8, 3, "dts")
    # 9.71, (32, 8, 2) 11.4 / 11.7; kb32g32 "dt" 11.6 / "dts" 12.3, (32, 8, 2) 12.0 / 12.2; kb16g16 (64-row tiles)
    # (32, 4, 3) 13.8 / 14.3, (16, 4, 2) 17.0 / 15.9.
    # session 10 call 1 (NOTES item 19), fwd+bwd at 32K with the device lists: "dts" 13.99 vs "dt" 14.70 ms at
    # kb64g64 (its dk/dv kernel 7.60 vs 8.38), 16.52 vs 16.69 at kb32g32; token rows not re-timed: "dt"
    if BM > 64 and key_block >= 32:
        return (64, 8, 2, "dts")
    return (32, 4, 3, "dt") if BM <= 64 else (64, 8, 2, "dt")


def key_major_dkdv(q, k, v, sel: TileSelection, do, lse, delta, scale: float, prec: int, tune: tuple | None = None,
                   key_block: int = 1):
    """dk, dv `[B, S, H_kv, D]` in k's dtype, one write per element (no atomics). lse/delta `[B, T, H]`
    fp32 with equal strides. `tune=(BLOCK_N, num_warps, num_stages[, form[, lists]])` overrides the launch
    config (BLOCK_N in 16/32/64/128; form "rows" | "dt" | "dts", module doc; lists "device" (default:
    `key_tile_lists_dense` for shared selections, no host sync) | "torch" (`key_tile_lists`, the CSR built
    with `nonzero`; per-query union tiles always take it)); key_block (shared rows' key block) picks the
    default."""
    B, T, H, D, G, BM, BD, NT, umax = _common(q, k, sel)
    S, H_kv = k.shape[1], k.shape[2]
    t = tuple(tune or default_tune(BM, q.is_cuda, key_block))
    BN, warps, stages, form, lists = t[:3] + (t[3:] + ("rows", "device")[len(t) - 3:])[:2]
    if lists not in ("device", "torch"):
        raise ValueError(f"key_major_dkdv: lists {lists!r} (device or torch)")
    if form not in FORMS or BN not in (16, 32, 64, 128):
        raise ValueError(f"key_major_dkdv: form {form!r} (one of {FORMS}), BLOCK_N {BN} (16/32/64/128)")
    if form == "dts" and not sel.shared:
        form = "dt"  # per-query union tiles have no full pairs to split off
    dense = sel.shared and lists == "device"
    if dense:
        lst, off, nfull = key_tile_lists_dense(sel, T, S, BN, split=form == "dts")
    else:
        tl_lists = key_tile_lists(sel, T, S, BN, split=form == "dts")
        off, lst = tl_lists[0], tl_lists[1]
        nfull = tl_lists[3] if form == "dts" else off
    NKT = triton.cdiv(S, BN)
    dk = torch.empty(B, S, H_kv, D, device=q.device, dtype=k.dtype)
    dv = torch.empty_like(dk)
    pref = sel.pref if sel.pref is not None else sel.bits
    qmask = sel.qmask if sel.qmask is not None else sel.bits
    args = (q, k, v, do, lse, delta, sel.bits, pref, qmask, off, lst, nfull, dk, dv, *q.stride(), *k.stride(), *v.stride(),
            *do.stride(), *lse.stride(), *dk.stride(), T, S, G, D, NT, NKT, sel.bits.shape[1], sel.bits.shape[2],
            umax, sel.group, sel.q_offset, scale, scale * LOG2E)
    _dkdv_kernel[(NKT, H_kv, B)](*args, BT=sel.BT, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, SHARED=sel.shared, PREC=prec,
                                 TRANSPOSED=form != "rows", SPLIT=form == "dts", DENSE=dense, num_warps=warps,
                                 num_stages=stages)
    return dk, dv


@triton.jit
def _delta_kernel(O, DO, DLSE, DELTA, R, H, D, sob, sot, soh, sod, sdob, sdot, sdoh, sdod,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """DELTA[b, r] = sum_d O * dO - DLSE over rows r = t * H + h (DLSE/DELTA contiguous `[B, T, H]`)."""
    b = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    t = (r // H).to(tl.int64)
    h = r % H
    offs_d = tl.arange(0, BLOCK_D)
    m = rmask[:, None] & (offs_d < D)[None, :]
    o = tl.load(O + b * sob + t[:, None] * sot + h[:, None] * soh + offs_d[None, :] * sod, mask=m, other=0.0)
    do = tl.load(DO + b * sdob + t[:, None] * sdot + h[:, None] * sdoh + offs_d[None, :] * sdod, mask=m, other=0.0)
    dl = tl.load(DLSE + b * R + r, mask=rmask, other=0.0)
    tl.store(DELTA + b * R + r, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1) - dl, mask=rmask)


def bwd_delta(o: torch.Tensor, do: torch.Tensor, dlse: torch.Tensor) -> torch.Tensor:
    """delta `[B, T, H]` fp32 contiguous = rowsum(o * do) - dlse, one pass over o and do (the torch form
    made fp32 copies of both: ~2.7 GB of traffic at 32K x 32 heads x 128)."""
    B, T, H, D = o.shape
    dlse = dlse.float().contiguous()
    delta = torch.empty(B, T, H, device=o.device, dtype=torch.float32)
    R = T * H
    BR = 64 if o.is_cuda else 16
    _delta_kernel[(triton.cdiv(R, BR), B)](o, do, dlse, delta, R, H, D, *o.stride(), *do.stride(),
                                           BLOCK_R=BR, BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=4)
    return delta
