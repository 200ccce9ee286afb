"""Triton decode-time indexer top-k: one query per row, every row at its own position.

`indexer_topk_decode(q_idx [B, H_I, D_I], w [B, H_I], k_idx [B, S, D_I], pos [B], topk)` ->
`[B, topk]` int32 ascending, -1 padded; the same selection as `naive.indexer_topk_decode_naive`
(forced sinks and window, the highest scores, ties between equal scores to the later key).

Why a separate kernel: in decode there are only B rows (8-64) of up to 128K keys. One program per
row (the prefill radix select) leaves most of the GPU idle and is latency bound (measured 0.21 ms
for B = 32 at 32K), and `torch.topk` costs ~100 µs a layer. Here every row is split into chunks of
`CH` keys and each pass runs one program per (chunk, row):

1. `_score_hist`: scores of the chunk (one small tensor-core dot per key block against all index
   heads, ReLU, weighted sum; masked: +inf forced, -inf not visible) written to a `[B, S]` fp32
   scratch, and an 11-bit histogram of their order-preserving keys added to the row's global
   histogram (2048 atomics per program).
2. `_count`: every program reads the row histogram and finds the bin b* that holds the k-th
   largest score; it counts its keys above b* and the candidates in b*.
3. `_gather_cands`: candidates (scores in bin b*) are copied, in key order, to a scratch list
   (offsets from the earlier chunks' counts).
4. `_select` (one program per row, over the candidates only, usually a few dozen): three radix
   levels over the remaining 21 bits find the exact threshold key tau and how many keys equal to
   tau are kept; as in the reference the later ones win, so that becomes an index cut. It also
   counts how many keys each chunk will emit and turns that into output offsets.
5. `_write`: each program emits its selected key positions in ascending order at its offset;
   the row's first program pads with -1.

Only rows' visible prefixes are read (chunks past `pos` do nothing), and the grid depends on S
only, so the whole sequence is CUDA-graph capturable with `pos` in device memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.radix_topk import _okey
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot, dot_precision



@triton.jit
def _bstar(HIST, b, K, NB: tl.constexpr):
    """The row's bin holding the K-th largest key (-1 when all finite entries fit in K) and the count
    of finite entries."""
    bins = tl.arange(0, NB)
    h = tl.load(HIST + b * NB + bins)
    total = tl.sum(h, 0)
    suf = total - tl.cumsum(h, 0) + h
    bstar = tl.where(total > K, tl.sum((suf >= K).to(tl.int32), 0) - 1, -1)
    return bstar, total


@triton.jit
def _score_hist(Q, W, KI, POS, KVS, SC, HIST, sqb, sqh, sqd, swb, swh, skb, sks, skd,
                S, sink, window, HI, DI,
                HB: tl.constexpr, BD: tl.constexpr, CH: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                SHIFT: tl.constexpr, PREC: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    start = tl.load(KVS + b)
    c0 = p * CH
    if c0 <= pos:
        offs_h = tl.arange(0, HB)
        offs_d = tl.arange(0, BD)
        qt = tl.load(Q + b * sqb + offs_h[None, :] * sqh + offs_d[:, None] * sqd,
                     mask=(offs_h[None, :] < HI) & (offs_d[:, None] < DI), other=0.0)  # [BD, HB]
        wv = tl.load(W + b * swb + offs_h * swh, mask=offs_h < HI, other=0.0).to(tl.float32)
        bins = tl.arange(0, NB)
        hist = tl.zeros([NB], tl.int32)
        for i in range(0, CH // BN):
            offs_n = c0 + i * BN + tl.arange(0, BN)
            vis = (offs_n <= pos) & (offs_n >= start) & (offs_n < S)
            k = tl.load(KI + b * skb + offs_n[:, None] * sks + offs_d[None, :] * skd,
                        mask=vis[:, None] & (offs_d[None, :] < DI), other=0.0)  # [BN, BD]
            s = tl.sum(tl.maximum(dot(k, qt, PREC), 0.0) * wv[None, :], 1)
            forced = vis & ((offs_n < start + sink) | (offs_n > pos - window))
            s = tl.where(vis, s, float("-inf"))
            s = tl.where(forced, float("inf"), s)
            tl.store(SC + b * S + offs_n, s, mask=(offs_n <= pos) & (offs_n < S))
            d = tl.where(vis, _okey(s) >> SHIFT, 0).to(tl.int32)
            hist += tl.histogram(d, NB) - tl.where(bins == 0, tl.sum((~vis).to(tl.int32), 0), 0)
        tl.atomic_add(HIST + b * NB + bins, hist, mask=hist > 0)


@triton.jit
def _count(SC, POS, HIST, CNT, S, K, P, CH: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
           SHIFT: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    n_above = 0
    n_cand = 0
    if c0 <= pos:
        bstar, total = _bstar(HIST, b, K, NB)
        for i in range(0, CH // BN):
            offs_n = c0 + i * BN + tl.arange(0, BN)
            x = tl.load(SC + b * S + offs_n, mask=(offs_n <= pos) & (offs_n < S), other=float("-inf"))
            valid = x > float("-inf")
            d = (_okey(x) >> SHIFT).to(tl.int32)
            n_above += tl.sum((valid & (d > bstar)).to(tl.int32), 0)
            n_cand += tl.sum((valid & (d == bstar)).to(tl.int32), 0)
    tl.store(CNT + (b * P + p) * 2, n_above)
    tl.store(CNT + (b * P + p) * 2 + 1, n_cand)


@triton.jit
def _gather_cands(SC, POS, HIST, CNT, CS, CI, S, K, P, CH: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                  SHIFT: tl.constexpr, PMAX: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    if c0 <= pos:
        bstar, total = _bstar(HIST, b, K, NB)
        if bstar >= 0:
            offs_p = tl.arange(0, PMAX)
            off = tl.sum(tl.load(CNT + (b * P + offs_p) * 2 + 1, mask=offs_p < p, other=0), 0)
            for i in range(0, CH // BN):
                offs_n = c0 + i * BN + tl.arange(0, BN)
                x = tl.load(SC + b * S + offs_n, mask=(offs_n <= pos) & (offs_n < S), other=float("-inf"))
                cand = (x > float("-inf")) & ((_okey(x) >> SHIFT).to(tl.int32) == bstar)
                slot = off + tl.cumsum(cand.to(tl.int32), 0) - 1
                tl.store(CS + b * S + slot, x, mask=cand)
                tl.store(CI + b * S + slot, offs_n, mask=cand)
                off += tl.sum(cand.to(tl.int32), 0)


@triton.jit
def _radix_level(CS, b, S, n, prefix, kk, lo: tl.constexpr, hi: tl.constexpr, BLOCK: tl.constexpr):
    """One radix digit (bits lo..hi-1) over the n candidates whose bits >= hi equal `prefix`'s:
    returns the updated prefix, the rank left to place inside it, and the digit's bin count."""
    bins = tl.arange(0, 256)
    offs = tl.arange(0, BLOCK)
    hist = tl.zeros([256], tl.int32)
    for c in range(0, n, BLOCK):
        x = tl.load(CS + b * S + c + offs, mask=c + offs < n, other=float("-inf"))
        key = _okey(x)
        m = (c + offs < n) & ((key >> hi) == (prefix >> hi))
        d = tl.where(m, (key >> lo) & ((1 << (hi - lo)) - 1), 0).to(tl.int32)
        hist += tl.histogram(d, 256) - tl.where(bins == 0, tl.sum((~m).to(tl.int32), 0), 0)
    total = tl.sum(hist, 0)
    suf = total - tl.cumsum(hist, 0) + hist
    dstar = tl.sum((suf >= kk).to(tl.int32), 0) - 1
    kk = kk - tl.sum(tl.where(bins > dstar, hist, 0), 0)
    n_eq = tl.sum(tl.where(bins == dstar, hist, 0), 0)
    return prefix | (dstar.to(tl.uint32) << lo), kk, n_eq


@triton.jit
def _select(HIST, CNT, CS, CI, TAU, CUT, OFFS, S, K, P, CH: tl.constexpr, NB: tl.constexpr, SHIFT: tl.constexpr,
            PMAX: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    bstar, total = _bstar(HIST, b, K, NB)
    offs_p = tl.arange(0, PMAX)
    pm = offs_p < P
    above = tl.load(CNT + (b * P + offs_p) * 2, mask=pm, other=0)
    n_c = tl.sum(tl.load(CNT + (b * P + offs_p) * 2 + 1, mask=pm, other=0), 0)
    emit = above
    tau = tl.zeros([], tl.uint32)  # every finite key is > 0: with no candidates all are taken
    cut = 0
    if bstar >= 0:
        kk = K - tl.sum(above, 0)
        prefix = bstar.to(tl.uint32) << SHIFT
        # the bits below the first level's: two 8-bit digits, then the rest (SHIFT - 16 bits)
        prefix, kk, n_eq = _radix_level(CS, b, S, n_c, prefix, kk, SHIFT - 8, SHIFT, BLOCK)
        prefix, kk, n_eq = _radix_level(CS, b, S, n_c, prefix, kk, SHIFT - 16, SHIFT - 8, BLOCK)
        prefix, kk, n_eq = _radix_level(CS, b, S, n_c, prefix, kk, 0, SHIFT - 16, BLOCK)
        tau = prefix
        r = n_eq - kk  # equal keys of rank >= r (in key order) are kept: the later keys win
        offs = tl.arange(0, BLOCK)
        seen = 0
        per_chunk = tl.zeros([PMAX], tl.int32)
        for c in range(0, n_c, BLOCK):
            live = c + offs < n_c
            x = tl.load(CS + b * S + c + offs, mask=live, other=float("-inf"))
            idx = tl.load(CI + b * S + c + offs, mask=live, other=0)
            key = _okey(x)
            eq = live & (key == tau)
            rank = seen + tl.cumsum(eq.to(tl.int32), 0) - 1
            cut += tl.sum(tl.where(eq & (rank == r), idx, 0), 0)
            seen += tl.sum(eq.to(tl.int32), 0)
            sel = live & ((key > tau) | (eq & (rank >= r)))
            cid = tl.where(sel, idx // CH, 0)
            per_chunk += tl.histogram(cid, PMAX) - tl.where(offs_p == 0, tl.sum((~sel).to(tl.int32), 0), 0)
        emit = above + per_chunk
    tl.store(TAU + b, tau.to(tl.int32, bitcast=True))
    tl.store(CUT + b, cut)
    tl.store(OFFS + b * P + offs_p, tl.cumsum(emit, 0) - emit, mask=pm)


@triton.jit
def _write(SC, POS, TAU, CUT, OFFS, OUT, sob, S, K, P, CH: tl.constexpr, BN: tl.constexpr):
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int32)
    c0 = p * CH
    tau = tl.load(TAU + b).to(tl.uint32, bitcast=True)
    cut = tl.load(CUT + b)
    off = tl.load(OFFS + b * P + p)
    if c0 <= pos:
        for i in range(0, CH // BN):
            offs_n = c0 + i * BN + tl.arange(0, BN)
            x = tl.load(SC + b * S + offs_n, mask=(offs_n <= pos) & (offs_n < S), other=float("-inf"))
            key = _okey(x)
            sel = (x > float("-inf")) & ((key > tau) | ((key == tau) & (offs_n >= cut)))
            slot = off + tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.store(OUT + b * sob + slot, offs_n, mask=sel)
            off += tl.sum(sel.to(tl.int32), 0)
    if p == P - 1:  # the last chunk's end offset is the row's count: pad the rest with -1
        for c in range(off, K, BN):
            offs = c + tl.arange(0, BN)
            tl.store(OUT + b * sob + offs, tl.full([BN], -1, tl.int32), mask=offs < K)


def _chunk(B: int, S: int, interpret: bool) -> int:
    """Keys per program: enough programs to fill the GPU (~2 per SM), at least 256 keys each."""
    if interpret:
        return 32
    ch = 256
    while ch < 4096 and B * triton.cdiv(S, ch) > 264:
        ch *= 2
    return ch


def indexer_topk_decode(q_idx: torch.Tensor, w: torch.Tensor, k_idx: torch.Tensor, pos: torch.Tensor, topk: int, *,
                        sink: int = 0, window: int = 0, kv_start: torch.Tensor | None = None,
                        chunk: int | None = None, nbits: int = 11, num_warps: int | None = None) -> torch.Tensor:
    """See the module docstring. q_idx `[B, H_I, D_I]`, w `[B, H_I]`, k_idx `[B, S, D_I]` (last dim
    contiguous), pos `[B]` -> `[B, topk]` int32. Index dims above 128, more than 64 index heads or
    float64 take the reference."""
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_topk_decode_naive

    if sink + window > topk:
        raise ValueError(f"sink ({sink}) + window ({window}) must not exceed topk ({topk})")
    B, HI, DI = q_idx.shape
    S = k_idx.shape[1]
    if (q_idx.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k_idx.dtype != q_idx.dtype
            or DI > 128 or HI > 64 or B == 0 or S == 0):
        return indexer_topk_decode_naive(q_idx, w, k_idx, pos, topk, sink=sink, window=window, kv_start=kv_start)
    dev = q_idx.device
    interpret = not q_idx.is_cuda
    pos = torch.as_tensor(pos, device=dev).to(torch.int32).reshape(B)
    kvs = (torch.zeros(B, dtype=torch.int32, device=dev) if kv_start is None
           else torch.as_tensor(kv_start, device=dev).to(torch.int32).reshape(B))
    if k_idx.stride(-1) != 1:
        k_idx = k_idx.contiguous()
    if not 8 <= nbits <= 16:
        raise ValueError(f"nbits {nbits}: expected 8..16")
    NB, SHIFT = 1 << nbits, 32 - nbits
    CH = chunk or _chunk(B, S, interpret)
    BN = min(CH, 16 if interpret else 256)
    P = triton.cdiv(S, CH)
    PMAX = max(16, triton.next_power_of_2(P))
    sc = torch.empty(B, S, device=dev, dtype=torch.float32)
    cs = torch.empty(B, S, device=dev, dtype=torch.float32)
    ci = torch.empty(B, S, device=dev, dtype=torch.int32)
    hist = torch.zeros(B, NB, device=dev, dtype=torch.int32)
    cnt = torch.empty(B, P, 2, device=dev, dtype=torch.int32)
    small = torch.empty(2, B, device=dev, dtype=torch.int32)  # tau (bit pattern), cut
    offs = torch.empty(B, P, device=dev, dtype=torch.int32)
    out = torch.empty(B, topk, device=dev, dtype=torch.int32)
    nw = 1 if interpret else (num_warps or 4)
    grid = (P, B)
    _score_hist[grid](q_idx, w, k_idx, pos, kvs, sc, hist, *q_idx.stride(), *w.stride(), *k_idx.stride(),
                      S, sink, window, HI, DI, HB=max(16, triton.next_power_of_2(HI)),
                      BD=max(16, triton.next_power_of_2(DI)), CH=CH, BN=BN, NB=NB, SHIFT=SHIFT,
                      PREC=dot_precision(q_idx.dtype), num_warps=nw)
    _count[grid](sc, pos, hist, cnt, S, topk, P, CH=CH, BN=BN, NB=NB, SHIFT=SHIFT, num_warps=nw)
    _gather_cands[grid](sc, pos, hist, cnt, cs, ci, S, topk, P, CH=CH, BN=BN, NB=NB, SHIFT=SHIFT, PMAX=PMAX,
                        num_warps=nw)
    _select[(B,)](hist, cnt, cs, ci, small[0], small[1], offs, S, topk, P, CH=CH, NB=NB, SHIFT=SHIFT, PMAX=PMAX,
                  BLOCK=64 if interpret else 1024, num_warps=1 if interpret else 8)
    _write[grid](sc, pos, small[0], small[1], offs, out, out.stride(0), S, topk, P, CH=CH, BN=BN, num_warps=nw)
    return out
