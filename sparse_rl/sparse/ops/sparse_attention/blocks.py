"""Block-list kernels for shared selections (query groups): the forward and the dq pass iterate over the
key tiles of BN consecutive keys that a group's row touches, with contiguous K/V tiles, in two loops:
the FULL tiles (all BN keys selected, none after the group's first query) without any mask, then the
PARTIAL ones with the per-key bitmap and causal mask.

Why (benchmarks/NOTES.md items 15-17): the gather form (`union.tile_fwd`, shared mode) loads a key id
per slot and builds a `[rows, keys]` mask from int64 key ids every step; it runs ~245 TF/s on selected
pairs whatever the tile, against ~420 for FlexAttention's block-sparse kernel at the same key budget,
which splits its key blocks into full ones (no mask_mod call) and partial ones the same way. With
key_block >= BN (NSA-like page selection) every touched tile is a selected block, nearly all of it
full; with token-level rows (key_block 1) most tiles are partial and part-empty, so the MMA work grows
by touched/selected (the bitmap keeps the exact per-token semantics either way).

The lists come from the per-group bitmap the key-major backward builds anyway (`union.shared_tiles`):
`block_lists` runs one program per group row that counts each key tile's bits (popcount), keeps
tiles with a key the group's last query may see, and writes full tile ids from the front of a row of
width W = min(#tiles, K) and partial ones from its back (their sum is at most the row's keys, so they
never meet; no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot, tma_capable
from sparse_rl.sparse.ops.sparse_attention.union import LOG2E, TileSelection, _common, _popc, _tile_bwd_rows, _tile_rows

BLOCKS = (16, 32, 64, 128)


@dataclass
class BlockLists:
    """Per group row: tiles `[B, NR, W]` int32 (full ids from the front, partial from the back), nfull and
    npart `[B, NR]` int32; BN keys per tile."""
    BN: int
    tiles: torch.Tensor
    nfull: torch.Tensor
    npart: torch.Tensor


@triton.jit
def _tile_counts(BITS, brow, j, NW, BN: tl.constexpr):
    """Selected keys in key tiles j `[CH]` of BN keys (16/32/64/128) from a bitmap row."""
    if BN == 16:
        word = tl.load(BITS + brow + (j >> 1), mask=(j >> 1) < NW, other=0)
        cnt = _popc((word >> ((j & 1) * 16)) & 0xFFFF).to(tl.int32)
    else:
        WPT: tl.constexpr = BN // 32
        w = j[:, None] * WPT + tl.arange(0, WPT)[None, :]
        word = tl.load(BITS + brow + w, mask=w < NW, other=0)
        cnt = tl.sum(_popc(word).to(tl.int32), 1)
    return cnt


@triton.jit
def _block_list_kernel(BITS, TILES, NFULL, NPART, NR, NW, NKT, W, QG, T, q_off,
                       BN: tl.constexpr, CH: tl.constexpr):
    r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = b * NR + r
    brow = row * NW
    first = r * QG + q_off  # the group's first query position: tiles wholly at or before it need no causal mask
    last = tl.minimum(r * QG + QG - 1, T - 1) + q_off
    nf = 0
    npart = 0
    for c0 in range(0, NKT, CH):
        j = c0 + tl.arange(0, CH)
        jm = j < NKT
        cnt = _tile_counts(BITS, brow, j, NW, BN)
        live = jm & (cnt > 0) & (j * BN <= last)
        full = live & (cnt == BN) & (j * BN + BN - 1 <= first)
        part = live & (cnt < BN) | live & (j * BN + BN - 1 > first)
        fi = full.to(tl.int32)
        pi = part.to(tl.int32)
        tl.store(TILES + row * W + nf + tl.cumsum(fi, 0) - 1, j, mask=full)
        tl.store(TILES + row * W + W - npart - tl.cumsum(pi, 0), j, mask=part)
        nf += tl.sum(fi, 0)
        npart += tl.sum(pi, 0)
    tl.store(NFULL + row, nf)
    tl.store(NPART + row, npart)


def block_lists(sel: TileSelection, T: int, S: int, BN: int) -> BlockLists:
    """The full and partial key tiles of BN keys of each group row of a shared selection with its bitmap."""
    if BN not in BLOCKS:
        raise ValueError(f"block_lists: BLOCK_N {BN} not in {BLOCKS}")
    if not sel.shared or sel.bits is None:
        raise ValueError("block_lists: a shared selection with its bitmap (union.shared_tiles(bits=True))")
    B, NR, NW = sel.bits.shape
    NKT = triton.cdiv(S, BN)
    W = max(1, min(NKT, sel.ukey.shape[2]))
    dev = sel.bits.device
    tiles = torch.empty(B, NR, W, dtype=torch.int32, device=dev)
    nfull = torch.empty(B, NR, dtype=torch.int32, device=dev)
    npart = torch.empty_like(nfull)
    CH = 256 if dev.type == "cuda" else 64
    _block_list_kernel[(NR, B)](sel.bits, tiles, nfull, npart, NR, NW, NKT, W, sel.group, T, sel.q_offset,
                                BN=BN, CH=CH, num_warps=4)
    return BlockLists(BN, tiles, nfull, npart)


@triton.jit
def _part_mask(BITS, brow, offs_n, S, t, q_off, rmask):
    """`[BLOCK_M, BN]` (row, key) pairs of a partial tile that were selected and are causal for the row."""
    nm = offs_n < S
    word = tl.load(BITS + brow + (offs_n >> 5), mask=nm, other=0)
    present = (((word >> (offs_n & 31)) & 1) == 1) & nm
    return present[None, :] & (offs_n[None, :] <= t[:, None] + q_off) & rmask[:, None]


@triton.jit
def _kv_tile(kbase, vbase, kb, offs_n, offs_d, sks, skd, svs, svd, S, MASKED: tl.constexpr):
    """The K and V rows kb + offs_n `[BLOCK_N, BLOCK_D]` of one contiguous key tile. A full tile's keys are
    all < S, so only a partial tile's loads are masked (the last tile may end past S)."""
    keys = kb + offs_n
    if MASKED:
        kk = tl.load(kbase + keys[:, None] * sks + offs_d[None, :] * skd, mask=(keys < S)[:, None], other=0.0)
        vv = tl.load(vbase + keys[:, None] * svs + offs_d[None, :] * svd, mask=(keys < S)[:, None], other=0.0)
    else:
        kk = tl.load(kbase + keys[:, None] * sks + offs_d[None, :] * skd)
        vv = tl.load(vbase + keys[:, None] * svs + offs_d[None, :] * svd)
    return kk, vv


@triton.jit
def _fwd_step(q, kbase, vbase, kb, offs_n, offs_d, sks, skd, svs, svd, S, m_i, l_i, acc, qk_scale, sel,
              kdesc, vdesc, PREC: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """One key tile of the online softmax (base 2, the scale folded into one FMA per score). TMA: K / V rows
    through the tensor descriptors kdesc / vdesc (Hopper's bulk copies; rows past S read as zero)."""
    if TMA:
        kk = kdesc.load([kb.to(tl.int32), 0])
        vv = vdesc.load([kb.to(tl.int32), 0])
    else:
        kk, vv = _kv_tile(kbase, vbase, kb, offs_n, offs_d, sks, skd, svs, svd, S, MASKED)
    s = dot(q, tl.trans(kk), PREC)
    if MASKED:
        s = tl.where(sel, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(vv.dtype), vv, PREC)
    return m_new, l_i, acc


@triton.jit
def _group_tiles(TILES, NFULL, NPART, K, V, b, kvh, tile, skb, skh, svb, svh, NR, W, QG, BT: tl.constexpr):
    """The shared row of query tile `tile` (its group's selection), that row's tile list (full tiles from the
    front, partial ones from the back), their counts, and the K / V bases of KV head kvh in batch row b."""
    row = b * NR + (tile * BT) // QG
    return (row, TILES + row * W, K + b * skb + kvh * skh, V + b * svb + kvh * svh, tl.load(NFULL + row),
            tl.load(NPART + row))


@triton.jit
def _block_fwd_kernel(Q, K, V, BITS, TILES, NFULL, NPART, O, LSE,
                      sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                      sob, sot, soh, sod, slb, slt, slh,
                      T, S, G, D, NR, NW, W, QG, q_off, qk_scale,
                      BT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      PREC: tl.constexpr, TMA: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    qi, gh, t, rmask = _tile_rows(tile, G, T, BT, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * G + gh
    q = tl.load(Q + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd,
                mask=rmask[:, None] & (offs_d < D)[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row, lrow, kbase, vbase, nf, npart = _group_tiles(TILES, NFULL, NPART, K, V, b, kvh, tile, skb, skh, svb, svh,
                                                      NR, W, QG, BT)
    kdesc, vdesc = _kv_descs(kbase, vbase, S, sks, svs, BLOCK_N, BLOCK_D, TMA)
    for i in range(0, nf):  # full tiles: no mask (every key selected and before every query of the group)
        kb = tl.load(lrow + i).to(tl.int64) * BLOCK_N
        m_i, l_i, acc = _fwd_step(q, kbase, vbase, kb, offs_n, offs_d, sks, skd, svs, svd, S, m_i, l_i, acc, qk_scale,
                                  rmask[:, None], kdesc, vdesc, PREC, False, TMA)
    for i in range(0, npart):
        kb = tl.load(lrow + W - 1 - i).to(tl.int64) * BLOCK_N
        sel = _part_mask(BITS, row * NW, kb + offs_n, S, t, q_off, rmask)
        m_i, l_i, acc = _fwd_step(q, kbase, vbase, kb, offs_n, offs_d, sks, skd, svs, svd, S, m_i, l_i, acc, qk_scale,
                                  sel, kdesc, vdesc, PREC, True, TMA)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    tl.store(O + b * sob + t[:, None] * sot + heads[:, None] * soh + offs_d[None, :] * sod,
             out.to(O.dtype.element_ty), mask=rmask[:, None] & (offs_d < D)[None, :])
    tl.store(LSE + b * slb + t * slt + heads * slh, lse, mask=rmask)


def supported(q) -> bool:
    """The block kernels load whole tiles unmasked along D: a power-of-two head dim >= 16."""
    D = q.shape[-1]
    return D >= 16 and not D & (D - 1)


def _check_dims(q):
    if not supported(q):
        raise ValueError(f"block kernels: head dim {q.shape[-1]} must be a power of two >= 16 (unmasked tile loads)")


def default_tune(BM: int, cuda: bool, key_block: int = 1) -> tuple:
    """(BLOCK_N, num_warps, num_stages[, loads]) of the block forward. H200, 32K, trained input (session 9 call 1,
    NOTES.md item 17), ms: 128-row tiles kb64g64 (32, 4, 3) 2.98, (64, 8, 3) 3.09, (64, 4, 2) 3.16, (64, 4, 3)
    3.18, (16, 4, 2) 4.07, (128, 8, 3) 5.45, (128, 8, 2) 6.05 (gather tiles 4.27); kb32g32 (32, 4, 3) 3.02,
    (16, 4, 2) 4.08, 64-key tiles 5.0-6.0 (half of them partial); 64-row tiles kb16g16 (16, 4, 2) 4.25,
    (32, 4, 3) 4.96, (32, 4, 2) 5.00, (64, 4, 2) 6.00 (gather 4.38). Tiles no wider than the key block. Rows of
    128-key blocks (the block pattern, shared rows g128, calls 1-2): (128, 8, 3) 2.78-2.79, (32, 4, 3) 3.06, (64, 8, 3)
    3.10, (64, 4, 3) 3.13 (FlexAttention 2.61-2.63)."""
    if not cuda:
        return (16, 4, 1)
    if BM > 64 and key_block >= 128:
        # session 10 call 2 (NOTES item 19), the block pattern: (128, 8, 3, tma) 2.638 vs pointer loads 2.788 ms,
        # (64, 4, 3, tma) 2.696, (32, 4, 3, tma) 2.797, (64, 8, 3, tma) 2.944; FlexAttention 2.610
        return (128, 8, 3, "tma")
    if BM > 64 and key_block >= 32:
        # session 10 call 1 (NOTES item 19): tensor-descriptor loads 2.743 vs 3.002 ms (kb64g64), 2.770 vs 3.035
        # (kb32g32); (64, 4, 3, tma) 2.746, (32, 4, 4, tma) 2.745, 8 warps 2.93 (64 keys) / 3.75 (32 keys)
        return (32, 4, 3, "tma")
    return (16, 4, 2)


def lists_for(sel: TileSelection, T: int, S: int, BN: int, cache: dict | None = None) -> BlockLists:
    if cache is not None and BN in cache:
        return cache[BN]
    bl = block_lists(sel, T, S, BN)
    if cache is not None:
        cache[BN] = bl
    return bl


def block_fwd(q, k, v, sel: TileSelection, scale: float, prec: int, out=None, tune: tuple | None = None,
              cache: dict | None = None, key_block: int = 1):
    """Forward over a shared selection's key tiles: q `[B, T, H, D]` -> out `[B, T, H, D]`, lse `[B, T, H]`
    fp32. sel: `union.shared_tiles(..., bits=True)`. `tune=(BLOCK_N, num_warps, num_stages[, loads])`, loads
    "ptr" (pointer loads) or "tma" (tensor descriptors, sm_90+; the default's "tma" falls back to pointer loads
    where the strides or the GPU do not allow it, `_use_tma`); `cache` {BN: BlockLists} reuses
    lists between passes; key_block (the rows' key block) picks the default launch."""
    B, T, H, D, G, BM, BD, NT, _ = _common(q, k, sel)
    S = k.shape[1]
    BN, warps, stages, loads = (*(tune or default_tune(BM, q.is_cuda, key_block)), "ptr")[:4]
    _check_dims(q)
    tma = _use_tma(loads, tune is not None, q, k, v)
    bl = lists_for(sel, T, S, BN, cache)
    if out is None:
        o = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
        lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    else:
        o, lse = out
    _block_fwd_kernel[(NT, k.shape[2], B)](
        q, k, v, sel.bits, bl.tiles, bl.nfull, bl.npart, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        *lse.stride(), T, S, G, D, sel.bits.shape[1], sel.bits.shape[2], bl.tiles.shape[2], sel.group, sel.q_offset,
        scale * LOG2E, BT=sel.BT, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, PREC=prec, TMA=tma, num_warps=warps,
        num_stages=stages)
    return o, lse


def _tma_alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def _use_tma(loads: str, explicit: bool, *xs) -> bool:
    """Whether a block kernel takes tensor-descriptor loads: asked for ("tma") and possible for every tensor
    xs; a launch given explicitly (`tune`) that cannot raises, the default falls back to pointer loads. Sets the
    scratch allocator the in-kernel descriptors need (`triton.set_allocator`)."""
    if loads not in ("ptr", "tma"):
        raise ValueError(f"block kernels: loads {loads!r} (ptr or tma)")
    if loads == "ptr":
        return False
    if not all(tma_capable(x) for x in xs):
        if explicit:
            raise ValueError("block kernels (loads='tma'): rows need unit stride along D, 16-byte aligned strides "
                             "and bases, and an sm_90+ GPU")
        return False
    triton.set_allocator(_tma_alloc)
    return True


@triton.jit
def _kv_descs(kbase, vbase, S, sks, svs, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """[S, D] tensor descriptors of one (batch row, KV head)'s keys and values (D == BLOCK_D, unit stride along
    D), or the bases themselves without TMA (unused then)."""
    if TMA:
        kdesc = tl.make_tensor_descriptor(kbase, shape=[S, BLOCK_D], strides=[sks, 1], block_shape=[BLOCK_N, BLOCK_D])
        vdesc = tl.make_tensor_descriptor(vbase, shape=[S, BLOCK_D], strides=[svs, 1], block_shape=[BLOCK_N, BLOCK_D])
    else:
        kdesc = kbase
        vdesc = vbase
    return kdesc, vdesc


@triton.jit
def _dq_step(q, do, kbase, vbase, kb, offs_n, offs_d, sks, skd, svs, svd, S, dq, qk_scale, lse2, delta, sel,
             kdesc, vdesc, PREC: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    if TMA:
        kk = kdesc.load([kb.to(tl.int32), 0])
        vv = vdesc.load([kb.to(tl.int32), 0])
    else:
        kk, vv = _kv_tile(kbase, vbase, kb, offs_n, offs_d, sks, skd, svs, svd, S, MASKED)
    s = dot(q, tl.trans(kk), PREC)
    dp = dot(do, tl.trans(vv), PREC)
    p = tl.exp2(s * qk_scale - lse2[:, None])
    if MASKED:
        p = tl.where(sel, p, 0.0)
    ds = p * (dp - delta[:, None])
    return dq + dot(ds.to(kk.dtype), kk, PREC)


@triton.jit
def _block_dq_kernel(Q, K, V, BITS, TILES, NFULL, NPART, DO, LSE, DELTA, DQ,
                     sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                     sdob, sdot, sdoh, sdod, slb, slt, slh, sdqb, sdqt, sdqh, sdqd,
                     T, S, G, D, NR, NW, W, QG, q_off, scale, qk_scale,
                     BT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     PREC: tl.constexpr, TMA: tl.constexpr):
    """dq of one (query tile, kv head) over its group's full then partial key tiles, stored once (TMA: K / V
    through tensor descriptors)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    qi, t, heads, rd, row_ok, q, do, delta, lse2 = _tile_bwd_rows(
        Q, DO, LSE, DELTA, b, tile, kvh, sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt, slh, G, T, D,
        BT, BLOCK_M, BLOCK_D)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row, lrow, kbase, vbase, nf, npart = _group_tiles(TILES, NFULL, NPART, K, V, b, kvh, tile, skb, skh, svb, svh,
                                                      NR, W, QG, BT)
    kdesc, vdesc = _kv_descs(kbase, vbase, S, sks, svs, BLOCK_N, BLOCK_D, TMA)
    for i in range(0, nf):
        kb = tl.load(lrow + i).to(tl.int64) * BLOCK_N
        dq = _dq_step(q, do, kbase, vbase, kb, offs_n, offs_d, sks, skd, svs, svd, S, dq, qk_scale, lse2, delta,
                      row_ok[:, None], kdesc, vdesc, PREC, False, TMA)
    for i in range(0, npart):
        kb = tl.load(lrow + W - 1 - i).to(tl.int64) * BLOCK_N
        sel = _part_mask(BITS, row * NW, kb + offs_n, S, t, q_off, row_ok)
        dq = _dq_step(q, do, kbase, vbase, kb, offs_n, offs_d, sks, skd, svs, svd, S, dq, qk_scale, lse2, delta,
                      sel, kdesc, vdesc, PREC, True, TMA)
    tl.store(DQ + b * sdqb + t[:, None] * sdqt + heads[:, None] * sdqh + offs_d[None, :] * sdqd,
             (dq * scale).to(DQ.dtype.element_ty), mask=rd)


def dq_default_tune(BM: int, cuda: bool, key_block: int = 1) -> tuple:
    """(BLOCK_N, num_warps, num_stages[, loads]) of the block dq pass. H200, 32K, trained input (session 9 call 1), ms:
    128-row tiles kb64g64 (64, 8, 2) 3.17, (32, 4, 2) 3.37, (16, 4, 2) 4.43, (128, 8, 2) 7.50, (64, 4, 2) 8.19
    (gather tiles 4.73); kb32g32 (32, 4, 2) 3.36, (16, 4, 2) 4.48, (64, 8, 2) 5.05; 64-row tiles kb16g16
    (16, 4, 2) 4.41, (32, 4, 2) 5.33, (64, 4, 2) 7.20 (gather 4.62)."""
    if not cuda:
        return (16, 4, 1)
    # session 10 call 2 (NOTES item 19), tensor-descriptor loads: kb64g64 (64, 8, 2) 3.156 ms vs tma 3.254, (64, 8,
    # 3, tma) 3.123, (32, 4, 2, tma) 3.177, (64, 4, 2, tma) 6.54: no gain, pointer loads stay; kb32g32 (32, 4, 2)
    # 3.392 vs tma 3.203, (32, 4, 3, tma) 4.18, (32, 8, 2, tma) 4.21
    if BM > 64 and key_block >= 64:
        return (64, 8, 2)
    if BM > 64 and key_block >= 32:
        return (32, 4, 2, "tma")
    return (16, 4, 2)


def block_dq(q, k, v, sel: TileSelection, do, lse, delta, scale: float, prec: int, tune: tuple | None = None,
             cache: dict | None = None, key_block: int = 1):
    """dq `[B, T, H, D]` (q.dtype) over a shared selection's key tiles; lse/delta `[B, T, H]` fp32 with equal
    strides (keymajor.bwd_delta). `tune=(BLOCK_N, num_warps, num_stages[, loads])` as `block_fwd`'s."""
    B, T, H, D, G, BM, BD, NT, _ = _common(q, k, sel)
    S = k.shape[1]
    BN, warps, stages, loads = (*(tune or dq_default_tune(BM, q.is_cuda, key_block)), "ptr")[:4]
    _check_dims(q)
    tma = _use_tma(loads, tune is not None, q, k, v)
    bl = lists_for(sel, T, S, BN, cache)
    dq = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
    _block_dq_kernel[(NT, k.shape[2], B)](
        q, k, v, sel.bits, bl.tiles, bl.nfull, bl.npart, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(),
        *do.stride(), *lse.stride(), *dq.stride(), T, S, G, D, sel.bits.shape[1], sel.bits.shape[2],
        bl.tiles.shape[2], sel.group, sel.q_offset, scale, scale * LOG2E,
        BT=sel.BT, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, PREC=prec, TMA=tma, num_warps=warps, num_stages=stages)
    return dq
