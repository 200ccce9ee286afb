"""The prefill top-k's compaction of a score tile into per-row buffers by 32-key words (cand_topk.py's words
gather, and cand_ties.py's regather of the rows it flags): slots without a scan over the tile, and the
predicated stores kept in the accumulator's register layout."""

from __future__ import annotations

import triton
import triton.language as tl

try:  # libdevice's POPC for the words gather (the module moved between Triton versions; without it, SWAR)
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover -- depends on the Triton build
    try:
        from triton.language.extra import libdevice
    except ImportError:
        libdevice = None
HAS_POPC = libdevice is not None and hasattr(libdevice, "popc")


@triton.jit
def _popc(x, HW: tl.constexpr):
    """Set bits of each uint32 x, as int32: the hardware POPC (libdevice) on CUDA; the SWAR form under the
    interpreter, which has no libdevice (both are tested: tests/sparse/test_cand_topk.py)."""
    if HW:
        return libdevice.popc(x.to(tl.int32, bitcast=True))
    else:
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _append_words(s, cand, forced, n0, run, vbase, ibase, C, EDGE: tl.constexpr, PACKED: tl.constexpr,
                  HWPOPC: tl.constexpr, ASM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Append the cand `[BM, BN]` keys of tile n0 (scores s; +inf where forced, EDGE tiles only) to the row
    buffers at vbase / ibase `[BM, 1]` pointers, in key order, from slot run `[BM]`; returns the new run.
    A key's slot, without a scan over the BN scores: the row's mask packed into BN / 32 words of 32
    consecutive keys (one OR-reduction over each word's lanes), each word's popcount, an exclusive prefix
    over the BN / 32 counts, and in the word the popcount of the bits below the key's lane."""
    NW: tl.constexpr = BN // 32
    c3, slot, cnt = _word_slots(cand, run, HWPOPC, BM, BN)
    ok = c3 & (slot < C)
    key3 = n0 + (tl.arange(0, NW)[:, None] * 32 + tl.arange(0, 32)[None, :])[None, :, :]
    v = tl.reshape(s, [BM, NW, 32])
    if EDGE:
        v = tl.where(tl.reshape(forced, [BM, NW, 32]), float("inf"), v)
    _store_kept(vbase[:, :, None] + slot, ibase[:, :, None] + slot, v, tl.broadcast_to(key3, [BM, NW, 32]), ok,
                PACKED, ASM)
    return run + cnt


@triton.jit
def _word_slots(cand, run, HWPOPC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Slots of the cand `[BM, BN]` keys appended in key order from run `[BM]`, by 32-key words (see
    `_append_words`) -> (cand as `[BM, BN / 32, 32]`, their slots alike, the count a row `[BM]`)."""
    NW: tl.constexpr = BN // 32
    lane = tl.arange(0, 32).to(tl.uint32)
    c3 = tl.reshape(cand, [BM, NW, 32])
    word = tl.reduce(tl.where(c3, (1 << lane)[None, None, :], 0).to(tl.uint32), 2, _or)  # [BM, NW]
    cnt = _popc(word, HWPOPC)
    excl = tl.cumsum(cnt, 1) - cnt
    below = _popc(word[:, :, None] & ((1 << lane) - 1)[None, None, :], HWPOPC)
    return c3, (run[:, None] + excl)[:, :, None] + below, tl.sum(cnt, 1)


@triton.jit
def _store_kept(vptr, iptr, v, idx, ok, PACKED: tl.constexpr, ASM: tl.constexpr):
    """Predicated stores of the kept (ok) lanes: v fp32 at vptr and idx int32 at iptr, or PACKED one int64 at vptr
    = (v's fp32 bits << 32) | idx. ASM: as PTX `st.global` in the values' own register layout; `tl.store`'s
    coalescing pass otherwise converts value, index, mask and pointers of the scattered store to a blocked layout
    through shared memory (sm_90a SASS of the [64, 128] tile: ~160 STS + ~80 LDS a tile, more than the scores
    take). The interpreter has no inline asm (ASM False there; the device script checks ASM True)."""
    if ASM:
        vb = v.to(tl.int32, bitcast=True)
        if PACKED:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.v2.b32 [$1], {$4, $2}; mov.b32 $0, 0; }",
                "=r,l,r,r,r", [vptr.to(tl.int64), vb, ok.to(tl.int32), idx], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; @p st.global.b32 [$4], $5; "
                "mov.b32 $0, 0; }",
                "=r,l,r,r,l,r", [vptr.to(tl.int64), vb, ok.to(tl.int32), iptr.to(tl.int64), idx], dtype=tl.int32,
                is_pure=False, pack=1)
    else:
        if PACKED:
            word = (v.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (idx.to(tl.int64) & 0xFFFFFFFF)
            tl.store(vptr, word, mask=ok)
        else:
            tl.store(vptr, v, mask=ok)
            tl.store(iptr, idx, mask=ok)
