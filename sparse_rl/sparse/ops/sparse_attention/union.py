"""GQA-packed query tiles for sparse attention (Triton): the union build, the tile forward, the
tile dq pass and the key-major dk/dv pass (no global atomics).

Why: the per-query kernel reads every selected K/V row once per query and KV head, 4*D bytes per
selected pair; with GQA (G = 4 query heads per KV head) that is G FLOP/byte, so it runs at the L2
gather rate (~25 TFLOP/s on an H200) whatever the selection looks like. Here one program per
(tile of BT consecutive queries, KV head) puts the tile's BT*G query rows (128 for G = 4: BT = 32)
in the M dimension of the MMA and streams the *union* U of the tile's index rows once, masking each
row to its own keys with a per-key bitmask of the queries that chose it, so the exact per-token DSA
semantics are kept. Bytes drop by the overlap factor BT*K/|U|; FLOPs grow by the same factor
(masked rows still go through the MMA), which costs nothing until the tile is compute bound.

Shared selections (`query_group` g: g consecutive queries share one index row `[B, ceil(T/g), K]`):
when the tile's queries all lie in one group the union IS the group's row, so nothing is built:
the kernels read the row directly and mask only causality (key <= q_offset + t).

The union is built with small kernels and no sort (per-query selections only):
1. bitmap: each tile sets bit s of a `[S/32]` word array for every selected key s (atomic OR);
2. count: popcount per tile gives |U|, so the key lists are sized by the largest union, not BT*K;
3. compact: popcount prefix sums turn the bitmap into the ascending key list U and a word->rank table;
4. query masks: each (query i, key s) ORs bit i into the mask of s's slot (rank via the table).

Backward without atomics on dk/dv: the key-major pass runs one program per (key tile of BN keys,
KV head) over the query tiles whose bitmap touches the key tile (a CSR list built from the tile
bitmaps: the transposed union), recomputes P^T and dS^T for those rows, accumulates dk/dv in
registers and writes them once. dq comes from a query-major pass over the same tiles (or the
per-query kernel), also written once. FSA (flash sparse attention) inverts the loop the same way
for NSA's block selections; here the mask inside a (key tile, query tile) block is per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot, maxnreg_option

LOG2E = 1.4426950408889634
WORD_PAD = 4  # bitmap rows padded to 128 keys, so any key tile of 32/64/128 keys maps to whole words
SLOT_PAD = 128  # the union's key lists and query masks padded to whole 128-slot blocks (masks zero past |U|): a key
# block of <= 128 slots never reads past its tile's row, so the prefetching forward loads the masks unmasked


def tile_queries(G: int, rows: int = 128) -> int:
    """Queries per tile: `rows` MMA rows (G=4 -> 32 queries), at most 32 (int32 query masks)."""
    return max(1, min(32, rows // triton.next_power_of_2(G)))


@dataclass
class TileSelection:
    """What the tile kernels read. Per-query mode (group == 1): ukey `[B, NT, Umax]` the tile's union
    ascending, qmask `[B, NT, Umax]` per key the bitmask of the tile's queries that chose it, ulen
    `[B, NT]`, bits `[B, NT, NW]` the union bitmap and pref `[B, NT, NW]` its word ranks. Shared mode
    (group g > 1, BT divides g): ukey is the shared selection `[B, ceil(T/g), K]`, bits its bitmap per
    group, the rest None."""
    BT: int
    group: int
    q_offset: int
    ukey: torch.Tensor
    bits: torch.Tensor | None = None  # shared mode: None until a backward needs it (`with_bits`)
    ulen: torch.Tensor | None = None
    qmask: torch.Tensor | None = None
    pref: torch.Tensor | None = None

    @property
    def shared(self) -> bool:
        return self.group > 1

    def tensors(self) -> list:
        return [x for x in (self.ukey, self.bits, self.ulen, self.qmask, self.pref) if x is not None]

    @classmethod
    def from_tensors(cls, BT: int, group: int, q_offset: int, ts: list) -> "TileSelection":
        return cls(BT, group, q_offset, *ts)

    def union_size(self) -> int:
        """Sum of |U| over tiles (shared mode: the selected keys of each tile's row)."""
        if self.ulen is not None:
            return int(self.ulen.sum())
        return int((self.ukey >= 0).sum()) * (self.group // self.BT)


@triton.jit
def _popc(x):
    """Population count of int32/uint32 words (SWAR; runs under the interpreter too)."""
    x = x.to(tl.uint32, bitcast=True)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24) & 0xFF


@triton.jit
def _bitmap_kernel(IDX, BITS, T, NK, S, NW, NT, sib, sit, sik, BT: tl.constexpr, BLOCK_K: tl.constexpr,
                   DEDUPE: tl.constexpr):
    """BITS `[B, NT, NW]` (zeroed) |= each tile's selected keys. DEDUPE: a key whose bit an earlier row of the tile
    already set (read at L2, `.cg`) takes no atomic: a tile's queries share most keys (trained rows: union/pairs
    0.11 at 16 queries), and the atomics, not the loads, bound this pass. A stale read costs only a redundant
    atomic, never a missing bit."""
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    wbase = BITS + (b * NT + tile) * NW
    for i in range(0, BT):
        t = tile * BT + i
        if t < T:
            for k0 in range(0, NK, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                idx = tl.load(IDX + b * sib + t * sit + offs * sik, mask=offs < NK, other=-1)
                ok = (idx >= 0) & (idx < S)  # out-of-range keys are dropped like -1
                bit = tl.full([BLOCK_K], 1, tl.int32) << (idx & 31)
                wptr = wbase + tl.where(ok, idx >> 5, 0)
                if DEDUPE:
                    if i > 0:
                        ok = ok & ((tl.load(wptr, mask=ok, other=0, cache_modifier=".cg") & bit) == 0)
                tl.atomic_or(wptr, bit, mask=ok, sem="relaxed")


@triton.jit
def _count_kernel(BITS, ULEN, NW, NT, BLOCK_W: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = b * NT + tile
    offs_w = tl.arange(0, BLOCK_W)
    run = 0
    for w0 in range(0, NW, BLOCK_W):
        words = tl.load(BITS + row * NW + w0 + offs_w, mask=w0 + offs_w < NW, other=0)
        run += tl.sum(_popc(words).to(tl.int32), 0)
    tl.store(ULEN + row, run)


@triton.jit
def _compact_kernel(BITS, PREF, UKEY, NW, NT, UMAX, BLOCK_W: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = b * NT + tile
    offs_w = tl.arange(0, BLOCK_W)
    bitpos = tl.arange(0, 32)
    run = 0
    for w0 in range(0, NW, BLOCK_W):
        wm = w0 + offs_w < NW
        words = tl.load(BITS + row * NW + w0 + offs_w, mask=wm, other=0)
        cnt = _popc(words).to(tl.int32)
        excl = tl.cumsum(cnt, 0) - cnt
        tl.store(PREF + row * NW + w0 + offs_w, run + excl, mask=wm)
        bits = (words[:, None] >> bitpos[None, :]) & 1  # [BLOCK_W, 32] (arithmetic shift is fine: & 1)
        flat = tl.reshape(bits, [BLOCK_W * 32])
        pos = run + tl.cumsum(flat, 0) - 1
        key = tl.reshape((w0 + offs_w)[:, None] * 32 + bitpos[None, :], [BLOCK_W * 32])
        tl.store(UKEY + row * UMAX + pos, key, mask=flat == 1)
        run += tl.sum(cnt, 0)


@triton.jit
def _qmask_kernel(IDX, BITS, PREF, QMASK, T, NK, S, NW, NT, UMAX, sib, sit, sik,
                  BT: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = b * NT + tile
    for i in range(0, BT):
        t = tile * BT + i
        if t < T:
            for k0 in range(0, NK, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                idx = tl.load(IDX + b * sib + t * sit + offs * sik, mask=offs < NK, other=-1)
                ok = (idx >= 0) & (idx < S)  # out-of-range keys are dropped like -1
                w = tl.where(ok, idx >> 5, 0)
                word = tl.load(BITS + row * NW + w, mask=ok, other=0)
                below = word & ((tl.full([BLOCK_K], 1, tl.int32) << (idx & 31)) - 1)  # two's complement wrap
                rank = tl.load(PREF + row * NW + w, mask=ok, other=0) + _popc(below).to(tl.int32)
                tl.atomic_or(QMASK + row * UMAX + rank, tl.full([BLOCK_K], 1, tl.int32) << i, mask=ok, sem="relaxed")


def _launch(x: torch.Tensor):
    return (256, 64, 4) if x.is_cuda else (32, 8, 1)  # (BLOCK_K, BLOCK_W, num_warps)


def _bitmap(indices: torch.Tensor, S: int, BT: int, dedupe: bool = True) -> torch.Tensor:
    """`[B, R, K]` index rows -> `[B, ceil(R/BT), NW]` int32 bitmaps of each tile's keys (dedupe: see
    `_bitmap_kernel`; the same bits either way)."""
    B, R, K = indices.shape
    NT = triton.cdiv(R, BT)
    NW = triton.cdiv(max(S, 1), 32 * WORD_PAD) * WORD_PAD
    bits = torch.zeros(B, NT, NW, dtype=torch.int32, device=indices.device)
    BK, _, warps = _launch(indices)
    _bitmap_kernel[(NT, B)](indices, bits, R, K, S, NW, NT, *indices.stride(), BT=BT, BLOCK_K=BK, DEDUPE=dedupe,
                            num_warps=warps)
    return bits


def count_union(bits: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """|U| per tile `[B, NT]` int32 from the tiles' bitmaps `[B, NT, NW]` (`like`: a tensor on the launch's device)."""
    B, NT, NW = bits.shape
    ulen = torch.empty(B, NT, dtype=torch.int32, device=bits.device)
    _, BW, warps = _launch(like)
    _count_kernel[(NT, B)](bits, ulen, NW, NT, BLOCK_W=BW, num_warps=warps)
    return ulen


def union_sizes(indices: torch.Tensor, S: int, BT: int) -> torch.Tensor:
    """|U| per tile `[B, NT]` int32 (bitmap + popcount only: the cheap part of a build)."""
    return count_union(_bitmap(indices, S, BT), indices)


def build_union(indices: torch.Tensor, S: int, BT: int, prebuilt: tuple | None = None) -> TileSelection:
    """Per-query indices `[B, T, K]` int32 -> the tiles' unions (see TileSelection). One host sync
    (the largest union sizes the key lists). `prebuilt=(bits, ulen, umax)`: the bitmap, |U| and its
    maximum of these indices and BT already computed (paths.full_stats): the build starts at the compact
    step and does not sync."""
    B, T, K = indices.shape
    dev = indices.device
    BK, BW, warps = _launch(indices)
    if prebuilt is not None:
        bits, ulen, umax = prebuilt
    else:
        bits = _bitmap(indices, S, BT)
        ulen = count_union(bits, indices)
        umax = max(1, int(ulen.max()) if ulen.numel() else 1)
    NT, NW = bits.shape[1], bits.shape[2]
    pref = torch.empty(B, NT, NW, dtype=torch.int32, device=dev)
    umax = triton.cdiv(umax, SLOT_PAD) * SLOT_PAD
    ukey = torch.empty(B, NT, umax, dtype=torch.int32, device=dev)
    qmask = torch.zeros(B, NT, umax, dtype=torch.int32, device=dev)
    _compact_kernel[(NT, B)](bits, pref, ukey, NW, NT, umax, BLOCK_W=BW, num_warps=warps)
    _qmask_kernel[(NT, B)](indices, bits, pref, qmask, T, K, S, NW, NT, umax, *indices.stride(), BT=BT, BLOCK_K=BK,
                           num_warps=warps)
    return TileSelection(BT, 1, 0, ukey, bits, ulen, qmask, pref)


def shared_tiles(indices: torch.Tensor, S: int, group: int, BT: int, q_offset: int = 0,
                 bits: bool = True) -> TileSelection:
    """A selection shared by `group` consecutive queries `[B, ceil(T/group), K]` as tiles of BT queries
    (BT divides group): no union build, only the per-group bitmap the key-major backward needs
    (`bits=False`: not built, for a forward that no backward follows; `with_bits` adds it later)."""
    if group % BT:
        raise ValueError(f"tile of {BT} queries does not divide query_group {group}")
    return TileSelection(BT, group, q_offset, indices, _bitmap(indices, S, 1) if bits else None)


def with_bits(sel: TileSelection, S: int) -> TileSelection:
    """A shared selection with its per-group bitmap (built here when `shared_tiles(bits=False)` left it out)."""
    if sel.bits is None:
        sel.bits = _bitmap(sel.ukey, S, 1)
    return sel


@triton.jit
def _tile_rows(tile, G, T, BT: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows of a tile: query-in-tile, head-in-group, query position, valid."""
    r = tl.arange(0, BLOCK_M)
    qi = r // G
    t = tile * BT + qi
    return qi, r % G, t, (qi < BT) & (t < T)


@triton.jit
def _tile_slots(UKEY, QMASK, urow, qrow, suk, u0, n, S, q_off, qi, t, rmask,
                BLOCK_K: tl.constexpr, SHARED: tl.constexpr, MASK_AND: tl.constexpr):
    """One block of a tile's key list: key positions `[BLOCK_K]` (0 where unused), their validity and
    the `[BLOCK_M, BLOCK_K]` mask of (row, key) pairs that were selected. MASK_AND: test a row's bit as
    qmask & (1 << qi) != 0 (the row's bit made once, one AND + compare an element) instead of
    (qmask >> qi) & 1 == 1 (shift, AND, compare); the same bits."""
    offs = u0 + tl.arange(0, BLOCK_K)
    um = offs < n
    key = tl.load(UKEY + urow + offs * suk, mask=um, other=-1).to(tl.int64)
    if SHARED:
        ok = um & (key >= 0) & (key < S)  # out-of-range keys are treated as -1, never read
        sel = ok[None, :] & (key[None, :] <= t[:, None] + q_off) & rmask[:, None]
    else:
        ok = um
        qm = tl.load(QMASK + qrow + offs, mask=um, other=0)
        if MASK_AND:
            sel = ((qm[None, :] & (tl.full(qi.shape, 1, tl.int32) << qi)[:, None]) != 0) & rmask[:, None]
        else:
            sel = (((qm[None, :] >> qi[:, None]) & 1) == 1) & um[None, :] & rmask[:, None]
    return tl.where(ok, key, 0), ok, sel


@triton.jit
def _slot_keys(UKEY, urow, suk, u0, n, S, BLOCK_K: tl.constexpr, SHARED: tl.constexpr):
    """Key positions `[BLOCK_K]` int64 of the tile's slots u0.. (0 where unused) and their validity, as
    `_tile_slots` reads them, without the pair mask (the prefetching loop builds that a block later)."""
    offs = u0 + tl.arange(0, BLOCK_K)
    um = offs < n
    key = tl.load(UKEY + urow + offs * suk, mask=um, other=-1).to(tl.int64)
    if SHARED:
        ok = um & (key >= 0) & (key < S)  # out-of-range keys are treated as -1, never read
    else:
        ok = um
    return tl.where(ok, key, 0), ok


@triton.jit
def _slot_pairs(key, ok, qm, qi, t, rmask, q_off, SHARED: tl.constexpr):
    """The `[BLOCK_M, BLOCK_K]` selected (row, key) pairs of one key block (`_tile_slots`' sel, the AND bit test)."""
    if SHARED:
        sel = ok[None, :] & (key[None, :] <= t[:, None] + q_off) & rmask[:, None]
    else:
        sel = ((qm[None, :] & (tl.full(qi.shape, 1, tl.int32) << qi)[:, None]) != 0) & rmask[:, None]
    return sel


@triton.jit
def _slot_masks(QMASK, qrow, offs, SHARED: tl.constexpr):
    """The query masks `[BLOCK_K]` int32 of slots offs (0 past |U|; shared selections have none: zeros). The rows hold
    whole blocks of zeroed slots (SLOT_PAD), so the load takes no mask: 27 fewer SASS instructions a warp and 32-key
    block at sm_90a (453 against 480)."""
    if SHARED:
        qm = tl.zeros(offs.shape, tl.int32)
    else:
        qm = tl.load(QMASK + tl.multiple_of(qrow, 16) + offs)
    return qm


@triton.jit
def _gather_rows(base, key, ok, sks, skd, offs_d, dmask):
    """Rows key of K or V `[BLOCK_K, BLOCK_D]` (256 contiguous bytes each at D = 128; 0 where not ok)."""
    return tl.load(base + key[:, None] * sks + offs_d[None, :] * skd, mask=ok[:, None] & dmask[None, :], other=0.0)


@triton.jit
def _online_step(s, sel, v, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
    """One key block of the online softmax: scores s `[BLOCK_M, BLOCK_K]` (unscaled), sel the pairs kept, v the
    block's rows `[BLOCK_K, BLOCK_D]` -> (m_i, l_i, acc) after it (base-2 running max, sum, unnormalised output)."""
    s = tl.where(sel, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PREC)
    return m_new, l_i, acc


@triton.jit
def _prefetch_first(UKEY, QMASK, urow, qrow, suk, kbase, vbase, sks, skd, svs, svd, offs_d, dmask, n, S,
                    BLOCK_K: tl.constexpr, SHARED: tl.constexpr):
    """The prefetching loops' start: key block 0's K / V rows, masks and keys (loaded), block 1's keys."""
    key_c, ok_c = _slot_keys(UKEY, urow, suk, 0, n, S, BLOCK_K, SHARED)
    kt_n = _gather_rows(kbase, key_c, ok_c, sks, skd, offs_d, dmask)
    v_n = _gather_rows(vbase, key_c, ok_c, svs, svd, offs_d, dmask)
    qm_n = _slot_masks(QMASK, qrow, tl.arange(0, BLOCK_K), SHARED)
    key_n, ok_n = _slot_keys(UKEY, urow, suk, BLOCK_K, n, S, BLOCK_K, SHARED)
    return kt_n, v_n, qm_n, key_c, ok_c, key_n, ok_n


@triton.jit
def _prefetch_next(UKEY, QMASK, urow, qrow, suk, kbase, vbase, sks, skd, svs, svd, offs_d, dmask, u0, n, S, key_n,
                   ok_n, BLOCK_K: tl.constexpr, SHARED: tl.constexpr):
    """In key block u0 of a prefetching loop: block u0 + BK's rows and masks issued on the keys loaded a block ago,
    block u0 + 2 BK's keys issued; -> (its rows, masks, keys, validity; the next keys, validity)."""
    kt_n = _gather_rows(kbase, key_n, ok_n, sks, skd, offs_d, dmask)
    v_n = _gather_rows(vbase, key_n, ok_n, svs, svd, offs_d, dmask)
    qm_n = _slot_masks(QMASK, qrow, u0 + BLOCK_K + tl.arange(0, BLOCK_K), SHARED)
    key2, ok2 = _slot_keys(UKEY, urow, suk, u0 + 2 * BLOCK_K, n, S, BLOCK_K, SHARED)
    return kt_n, v_n, qm_n, key_n, ok_n, key2, ok2


@triton.jit
def _tile_fwd_prefetch(q, UKEY, QMASK, urow, qrow, kbase, vbase, sks, skd, svs, svd, suk, n, S, q_off,
                       qk_scale, qi, t, rmask, offs_d, dmask, m_i, l_i, acc, BLOCK_K: tl.constexpr,
                       SHARED: tl.constexpr, PREC: tl.constexpr):
    """The key loop with its gathers issued one block ahead into registers (`tile_fwd(tune=...)`'s 8th entry).
    Why: Triton 3.6's pipeliner gives the cp.async gathers of the default loop a distance of one iteration
    whatever num_stages says (their addresses come from the key list, loaded in the loop) and waits for all of
    them at the top of the next (sm_90a TTGIR: `async_wait {num = 0}` before the QK dot; benchmarks/
    sm90_tile_fwd.py), so each block waits a gather's latency (L2, ~1 us) that only other programs can hide (ncu,
    session 19: 0.97 eligible warps a scheduler). Here block i+1's K / V rows and query masks are plain loads
    issued before block i's dots (and block i+2's keys before them), so a whole block's work covers them; the
    cost is their registers (32 at (32 keys, 4 warps): 214 a thread, 2 programs an SM, against 149 / 3). Same
    blocks, order and arithmetic as the default loop: bitwise its result."""
    kt_n, v_n, qm_n, key_c, ok_c, key_n, ok_n = _prefetch_first(UKEY, QMASK, urow, qrow, suk, kbase, vbase, sks, skd,
                                                                svs, svd, offs_d, dmask, n, S, BLOCK_K, SHARED)
    for u0 in tl.range(0, n, BLOCK_K, num_stages=1):
        kt, v, qm, key, ok = kt_n, v_n, qm_n, key_c, ok_c
        kt_n, v_n, qm_n, key_c, ok_c, key_n, ok_n = _prefetch_next(UKEY, QMASK, urow, qrow, suk, kbase, vbase, sks, skd,
                                                                   svs, svd, offs_d, dmask, u0, n, S, key_n, ok_n,
                                                                   BLOCK_K, SHARED)
        sel = _slot_pairs(key, ok, qm, qi, t, rmask, q_off, SHARED)
        s = dot(q, tl.trans(kt), PREC)
        m_i, l_i, acc = _online_step(s, sel, v, m_i, l_i, acc, qk_scale, PREC)
    return m_i, l_i, acc


@triton.jit
def _tile_fwd_kernel(Q, K, V, UKEY, QMASK, ULEN, O, LSE,
                     sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                     sob, sot, soh, sod, slb, slt, slh, sub, sur, suk,
                     T, S, G, D, NT, UMAX, QG, NKEYS, q_off, qk_scale,
                     BT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                     SHARED: tl.constexpr, PREC: tl.constexpr, KT_LOAD: tl.constexpr, LAZY: tl.constexpr,
                     MASK_AND: tl.constexpr, PREFETCH: tl.constexpr = False):
    """LAZY: rescale acc / l only when a row's running max grew by more than 8 (log2 units) in a key block
    (one tile-wide max and a uniform branch a block instead of BLOCK_M * BLOCK_D multiplies a thread's share;
    not bit-equal to the default, equal within rounding). MASK_AND: see _tile_slots. PREFETCH: the key loop of
    `_tile_fwd_prefetch` (the AND bit test, no LAZY, rows gathered row-major)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    qi, gh, t, rmask = _tile_rows(tile, G, T, BT, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    heads = kvh * G + gh
    q = tl.load(Q + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd,
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if SHARED:
        urow = b * sub + ((tile * BT) // QG) * sur
        n = NKEYS
    else:
        urow = b * sub + tile * sur
        n = tl.load(ULEN + b * NT + tile)
    qrow = (b * NT + tile) * UMAX
    kbase = K + b * skb + kvh * skh
    vbase = V + b * svb + kvh * svh
    if PREFETCH:
        m_i, l_i, acc = _tile_fwd_prefetch(q, UKEY, QMASK, urow, qrow, kbase, vbase, sks, skd, svs, svd, suk, n, S,
                                           q_off, qk_scale, qi, t, rmask, offs_d, dmask, m_i, l_i, acc, BLOCK_K,
                                           SHARED, PREC)
    else:
        for u0 in range(0, n, BLOCK_K):
            key, ok, sel = _tile_slots(UKEY, QMASK, urow, qrow, suk, u0, n, S, q_off, qi, t, rmask, BLOCK_K,
                                       SHARED, MASK_AND)
            if KT_LOAD:  # gathered as [BLOCK_D, BLOCK_K] (run 1's layout: 4.7 ms on the 32K block pattern)
                kt = tl.load(kbase + key[None, :] * sks + offs_d[:, None] * skd,
                             mask=ok[None, :] & dmask[:, None], other=0.0)
            else:  # rows gathered as [BLOCK_K, BLOCK_D], 256 contiguous bytes each, transposed in registers
                kt = tl.trans(_gather_rows(kbase, key, ok, sks, skd, offs_d, dmask))
            s = dot(q, kt, PREC)
            # (V's load sits before or after the softmax: the same SASS, the pipeliner issues both gathers ahead)
            v = _gather_rows(vbase, key, ok, svs, svd, offs_d, dmask)
            if LAZY:
                s = tl.where(sel, s * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # the running max moves (and acc, l are rescaled) only when some row's max grew by more than 2^8:
                # p = exp2(s - m) <= 256 otherwise, exact in fp32 and within bf16's range, and the final
                # acc / l and lse = m + log2(l) do not depend on which reference m was used
                if tl.max((m_new > m_i + 8.0).to(tl.int32), 0) > 0:
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp2(m_i - m_safe)
                    l_i = l_i * alpha
                    acc = acc * alpha[:, None]
                    m_i = m_new
                m_ref = tl.where(m_i == float("-inf"), 0.0, m_i)
                p = tl.exp2(s - m_ref[:, None])
                l_i = l_i + tl.sum(p, 1)
                acc = acc + dot(p.to(v.dtype), v, PREC)
            else:
                m_i, l_i, acc = _online_step(s, sel, v, m_i, l_i, acc, qk_scale, PREC)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    tl.store(O + b * sob + t[:, None] * sot + heads[:, None] * soh + offs_d[None, :] * sod,
             out.to(O.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
    tl.store(LSE + b * slb + t * slt + heads * slh, lse, mask=rmask)


def _common(q, k, sel: TileSelection):
    B, T, H, D = q.shape
    G = H // k.shape[2]
    BM = max(16, triton.next_power_of_2(sel.BT * G))
    BD = max(16, triton.next_power_of_2(D))
    NT = triton.cdiv(T, sel.BT)
    umax = sel.ukey.shape[2] if not sel.shared else 0
    return B, T, H, D, G, BM, BD, NT, umax


def _default_tune(BM: int, cuda: bool, shared: bool = True) -> tuple:
    # 128-row tiles, 32K block pattern, H200 run 2 (NOTES.md item 9): (32, 4, 2) 3.87 ms, (64, 8, 2) 4.27,
    # (128, 8, 2) 4.67, (64, 8, 3) 4.80, (32, 8, 2) 6.57; the K rows gathered transposed (run 1's layout) 4.49
    # at (64, 8, 2). Query groups 32 on the trained pattern (session 8, item 15): (32, 4, 3) 4.24 ms, (32, 4, 2)
    # 4.38, (64, 8, 2) 4.69, (64, 4, 2) 4.74, (128, 8, 2) 4.96, (32, 8, 2) 6.68. 64-row tiles (16 queries x 4
    # heads: query_group 16, 32K; session 6, item 13, and session 8 the same within 1%): (64, 4, 2) 4.37 ms,
    # (64, 4, 3) 4.42, (32, 4, 3) 4.81, (32, 4, 2) 4.90, (128, 8, 3) 8.78, (64, 8, 2) 9.44, (128, 4, 2) 9.45.
    # Per-query unions on the trained pattern (session 12, fwd12, H200, one run): 128-row tiles (32, 4, 3) 9.29 ms,
    # with the AND bit test 9.11 (the same bits; block pattern 4.01 -> 3.92), lazy rescale + AND 9.04, (64, 8, 2)
    # 9.68, (16, 4, 4) 12.5, (32, 8, 3) 13.3; 64-row tiles (32, 4, 3) 7.88, (64, 4, 2) 8.12, (64, 4, 2) lazy+AND 11.5
    # (128K: 37.7 / 40.0 against 47.1 for 128 rows); call 2: 64-row (32, 4, 3) with the AND test 7.49 vs 7.88 ms,
    # bit-equal. Session 19 (ncu at 32K trained: issue slots 54% busy, 0.97 eligible warps a scheduler, L2 39%: latency,
    # with 152 registers = 3 programs an SM): 64-row per-query tiles at (32, 4, 2) capped at 128 registers (4
    # programs, 60 B of spills) 7.97 vs 9.18 ms for the whole attention at 32K, 38.7 vs 41.2 at 128K, bit-equal;
    # (32, 4, 3) capped 8.87, (16, 4, 4) capped 10.5. Returned as (BLOCK_K, warps, stages, kt_load, lazy, mask_and,
    # maxnreg).
    if not cuda:
        return (64 if BM <= 64 else 32, 4, 1)
    if shared:
        return (64, 4, 2) if BM <= 64 else (32, 4, 3)
    return (32, 4, 2, 0, 0, 1, 128) if BM <= 64 else (32, 4, 3, 0, 0, 1)


def _check_slots(pf, sel: TileSelection, umax: int, BK: int, tune, who: str) -> None:
    """The prefetching loops read whole BK-slot blocks of the key lists and masks: build_union's padding (SLOT_PAD)."""
    if pf and not sel.shared and (umax % BK or BK > SLOT_PAD):
        raise ValueError(f"{who}: tune {tune}: prefetch reads whole {BK}-slot blocks of the key lists "
                         f"({umax} slots a tile: build them with build_union)")


def tile_fwd(q, k, v, sel: TileSelection, scale: float, prec: int, out=None, tune: tuple | None = None):
    """Forward over tiles: q `[B, T, H, D]` -> out `[B, T, H, D]`, lse `[B, T, H]` fp32.
    `tune=(BLOCK_K, num_warps, num_stages[, kt_load[, lazy[, mask_and[, maxnreg[, prefetch]]]]])` overrides the
    launch config (the flags default to 0, K rows gathered row-major and a rescale every key block; mask_and, the
    AND bit test, is on in the default launches of per-query tiles: `_default_tune`; prefetch: the key loop of
    `_tile_fwd_prefetch`, its gathers a block ahead in registers, num_stages ignored, with the AND bit test and
    neither kt_load nor lazy: a ValueError)."""
    B, T, H, D, G, BM, BD, NT, umax = _common(q, k, sel)
    if out is None:
        o = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
        lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    else:
        o, lse = out
    BK, warps, stages, kt_load, lazy, mask_and, cap, pf = (*(tune or _default_tune(BM, q.is_cuda, sel.shared)), 0, 0,
                                                           0, 0, 0)[:8]
    if pf and (kt_load or lazy):
        raise ValueError(f"tile_fwd: tune {tune}: prefetch gathers K row-major and rescales every block "
                         "(kt_load and lazy must be 0)")
    _check_slots(pf, sel, umax, BK, tune, "tile_fwd")
    ulen = sel.ulen if sel.ulen is not None else sel.ukey
    qmask = sel.qmask if sel.qmask is not None else sel.ukey
    _tile_fwd_kernel[(NT, k.shape[2], B)](
        q, k, v, sel.ukey, qmask, ulen, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
        *sel.ukey.stride(), T, k.shape[1], G, D, NT, umax, sel.group, sel.ukey.shape[2], sel.q_offset,
        scale * LOG2E, BT=sel.BT, BLOCK_M=BM, BLOCK_K=BK, BLOCK_D=BD, SHARED=sel.shared, PREC=prec,
        KT_LOAD=bool(kt_load), LAZY=bool(lazy), MASK_AND=bool(mask_and), PREFETCH=bool(pf), num_warps=warps,
        num_stages=1 if pf else stages,
        **maxnreg_option(cap, q))
    return o, lse


@triton.jit
def _tile_bwd_rows(Q, DO, LSE, DELTA, b, tile, kvh, sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt, slh,
                   G, T, D, BT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """What the backward passes read of a tile's rows: q and dO `[BLOCK_M, BLOCK_D]`, delta, the
    base-2 lse and the row masks."""
    qi, gh, t, rmask = _tile_rows(tile, G, T, BT, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * G + gh
    rd = rmask[:, None] & (offs_d < D)[None, :]
    q = tl.load(Q + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd, mask=rd, other=0.0)
    do = tl.load(DO + b * sdob + t[:, None] * sdot + heads[:, None] * sdoh + offs_d[None, :] * sdod, mask=rd,
                 other=0.0)
    lse = tl.load(LSE + b * slb + t * slt + heads * slh, mask=rmask, other=float("-inf"))
    delta = tl.load(DELTA + b * slb + t * slt + heads * slh, mask=rmask, other=0.0)
    row_ok = (lse != float("-inf")) & rmask
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
    return qi, t, heads, rd, row_ok, q, do, delta, lse2


@triton.jit
def _dq_step(q, do, kk, vv, sel, lse2, delta, dq, qk_scale, PREC: tl.constexpr):
    """One key block of the tile dq pass: K / V rows kk, vv `[BLOCK_K, BLOCK_D]`, sel the pairs kept -> dq + dS K
    (unscaled; lse2 the base-2 lse, delta = rowsum(o * dO) - dlse, per row)."""
    s = dot(q, tl.trans(kk), PREC)
    dp = dot(do, tl.trans(vv), PREC)
    p = tl.where(sel, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
    ds = p * (dp - delta[:, None])
    return dq + dot(ds.to(kk.dtype), kk, PREC)


@triton.jit
def _tile_dq_kernel(Q, K, V, UKEY, QMASK, ULEN, DO, LSE, DELTA, DQ,
                    sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                    sdob, sdot, sdoh, sdod, slb, slt, slh, sdqb, sdqt, sdqh, sdqd, sub, sur, suk,
                    T, S, G, D, NT, UMAX, QG, NKEYS, q_off, scale, qk_scale,
                    BT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                    SHARED: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr = False):
    """dq of one (tile, kv head), accumulated in registers and stored once. DELTA `[B, T, H]` fp32
    = rowsum(o * do) - dlse (LSE's strides). PREFETCH: the key loop with its gathers a block ahead in registers
    (bitwise the default loop at the same key block)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    qi, t, heads, rd, row_ok, q, do, delta, lse2 = _tile_bwd_rows(
        Q, DO, LSE, DELTA, b, tile, kvh, sqb, sqt, sqh, sqd, sdob, sdot, sdoh, sdod, slb, slt, slh, G, T, D,
        BT, BLOCK_M, BLOCK_D)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if SHARED:
        urow = b * sub + ((tile * BT) // QG) * sur
        n = NKEYS
    else:
        urow = b * sub + tile * sur
        n = tl.load(ULEN + b * NT + tile)
    qrow = (b * NT + tile) * UMAX
    kbase = K + b * skb + kvh * skh
    vbase = V + b * svb + kvh * svh
    if PREFETCH:  # as the forward's prefetching loop (`_tile_fwd_prefetch`): block i+1's rows before block i's dots
        kk_n, vv_n, qm_n, key_c, ok_c, key_n, ok_n = _prefetch_first(UKEY, QMASK, urow, qrow, suk, kbase, vbase, sks,
                                                                    skd, svs, svd, offs_d, dmask, n, S, BLOCK_K, SHARED)
        for u0 in tl.range(0, n, BLOCK_K, num_stages=1):
            kk, vv, qm, key, ok = kk_n, vv_n, qm_n, key_c, ok_c
            kk_n, vv_n, qm_n, key_c, ok_c, key_n, ok_n = _prefetch_next(UKEY, QMASK, urow, qrow, suk, kbase, vbase, sks,
                                                                       skd, svs, svd, offs_d, dmask, u0, n, S, key_n,
                                                                       ok_n, BLOCK_K, SHARED)
            sel = _slot_pairs(key, ok, qm, qi, t, row_ok, q_off, SHARED)
            dq = _dq_step(q, do, kk, vv, sel, lse2, delta, dq, qk_scale, PREC)
    else:
        for u0 in range(0, n, BLOCK_K):
            key, ok, sel = _tile_slots(UKEY, QMASK, urow, qrow, suk, u0, n, S, q_off, qi, t, row_ok, BLOCK_K,
                                       SHARED, False)
            kk = _gather_rows(kbase, key, ok, sks, skd, offs_d, dmask)
            vv = _gather_rows(vbase, key, ok, svs, svd, offs_d, dmask)
            dq = _dq_step(q, do, kk, vv, sel, lse2, delta, dq, qk_scale, PREC)
    tl.store(DQ + b * sdqb + t[:, None] * sdqt + heads[:, None] * sdqh + offs_d[None, :] * sdqd,
             (dq * scale).to(DQ.dtype.element_ty), mask=rd)


def dq_default_tune(BM: int, cuda: bool, shared: bool = True, umax: int = SLOT_PAD) -> tuple:
    """(BLOCK_K, num_warps, num_stages[, maxnreg, prefetch]) of `tile_dq` for BM-row tiles; umax: the tiles' key-list
    slots (the prefetching loop reads whole blocks of them: build_union pads to SLOT_PAD, a hand-cut list takes the
    plain loop)."""
    # query groups on the trained pattern, 32K, H200 (session 8, NOTES.md item 15): 64-row tiles (64, 4, 2)
    # 4.60 ms, (32, 4, 2) 4.97, (32, 4, 3) 5.70, (16, 4, 2) 6.89, (64, 8, 2) 10.4; 128-row tiles (64, 8, 2)
    # 4.77, (32, 4, 2) 4.81, (16, 4, 2) 6.23, (32, 8, 2) 7.22. Block pattern, 128 rows (run 1): (32, 4, 2) 4.5
    # Per-query union tiles (128 rows, the trained indexer's token rows at 32K; session 12 call 2, NOTES.md): (128, 8, 2)
    # 9.32 ms, (32, 4, 2) 9.75, (64, 8, 2) 10.18, (64, 8, 3) 10.43; shared rows not timed at (128, 8, 2): unchanged
    # 64-row per-query tiles (16 queries, auto's on trained rows; session 25 call 1, H100,
    # results/2026-12-07-h100-session25.md): the prefetching loop at 32 keys (32, 4, 1, 0, 1) 7.85-8.23 ms against
    # (64, 4, 2) 8.24-8.41 and the plain 32-key loop (32, 4, 2) 10.72-10.73, bitwise the latter
    if not cuda:
        return (32, 4, 1)
    if BM <= 64:
        if shared or umax % 32:
            return (64, 4, 2)
        return (32, 4, 1, 0, 1)
    return (64, 8, 2) if shared else (128, 8, 2)


def tile_dq(q, k, v, sel: TileSelection, do, lse, delta, scale: float, prec: int,
            tune: tuple | None = None):
    """dq `[B, T, H, D]` (q.dtype) over tiles; lse/delta `[B, T, H]` fp32 with equal strides. `tune=(BLOCK_K,
    num_warps, num_stages[, maxnreg[, prefetch]])` (prefetch: the gathers a key block ahead in registers, as
    `tile_fwd`'s; num_stages ignored)."""
    B, T, H, D, G, BM, BD, NT, umax = _common(q, k, sel)
    dq = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
    BK, warps, stages, cap, pf = (*(tune or dq_default_tune(BM, q.is_cuda, sel.shared, umax)), 0, 0)[:5]
    _check_slots(pf, sel, umax, BK, tune, "tile_dq")
    ulen = sel.ulen if sel.ulen is not None else sel.ukey
    qmask = sel.qmask if sel.qmask is not None else sel.ukey
    _tile_dq_kernel[(NT, k.shape[2], B)](
        q, k, v, sel.ukey, qmask, ulen, do, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        *lse.stride(), *dq.stride(), *sel.ukey.stride(), T, k.shape[1], G, D, NT, umax, sel.group,
        sel.ukey.shape[2], sel.q_offset, scale, scale * LOG2E,
        BT=sel.BT, BLOCK_M=BM, BLOCK_K=BK, BLOCK_D=BD, SHARED=sel.shared, PREC=prec, PREFETCH=bool(pf),
        num_warps=warps, num_stages=1 if pf else stages, **maxnreg_option(cap, q))
    return dq
