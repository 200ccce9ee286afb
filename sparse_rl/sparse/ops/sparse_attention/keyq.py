"""The key-major dk/dv pass over each key tile's compacted QUERY list (token-level selections; issue 15).

Why: the tile backward's key-major pass (keymajor.py) runs one MMA block of BN keys x 128 rows for every
(key tile, 32-query tile) pair in which ANY query selected ANY of the tile's keys. On the trained
indexer's 32K selection that is 135 K touched (64-key, 32-query) pairs, ~51% of a dense causal pass,
with most of each block masked (NOTES.md item 17, the brief's numbers: 32.6 ms of a 45 ms backward).
Here the transposed selection is kept per QUERY, not per query tile: for key tile j of BN keys, the
ascending list of the queries that selected at least one of its keys, each with its BN-bit mask of
which. One program per (key tile, KV head) gathers those queries' q / dO / lse / delta rows (G heads of
one query are G consecutive rows, 32 / 16 queries per 128 / 64-row chunk) and runs the "dt" form of
keymajor.py (dK^T += Q^T dS, dV^T += dO^T P: wgmma-shaped at any BN) on them, so the MMA's row
dimension holds only queries that selected something in the tile. dk/dv are written once: no atomics.
FSA (flash sparse attention) inverts NSA's loop the same way with a per-key-block query index; the
mask inside a (key tile, query) pair is per token here.

Measured (H200, 32K, trained-indexer token rows, session 12, NOTES.md): dk/dv 15.4 ms vs the key-major pass's 30.2
(74 K 128-row chunks vs 135 K touched pairs; still ~2.3x masked work: 27 of a pair's 64 keys selected), fwd+bwd
36.9 ms vs 50.4 = 1.51x dense cuDNN; per-query block rows (whole touched tiles) no gain, so `auto` (paths.py)
takes this path only where its estimate is clearly lower.

The lists (`key_query_lists`), three small kernels and one host sync (the list's total length):
1. bits: `[B, NKT, T]` words (int32 for BN <= 32, int64 for BN 64), word (j, t) = the BN-bit mask of
   the keys of tile j that query t selected (atomic adds at the ends of each run of the row's keys in tile j:
   one run a word on the top-k's ascending rows; one query's words come from one program);
2. count: per key tile the number of nonzero words, a device cumsum -> CSR offsets (the sync: the sum);
3. compact: per key tile the query ids and their masks, ascending.
Cost model (per KV head): one chunk of BQ queries costs about one touched pair of keymajor.py's "dt"
form at the same (BN, rows) (measured: 26.4 ns a 128-row chunk at (64, 128, 8, 3) vs 27.9 ns a touched pair of
"dt" (64, 8, 2), session 12); the chunks are sum_j ceil(n_j / BQ) with n_j the queries of tile j.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot, maxnreg_option
from sparse_rl.sparse.ops.sparse_attention.union import LOG2E

KEY_TILES = (16, 32, 64)


@triton.jit
def _kq_bits_kernel(IDX, M, T, NK, S, NKT, sib, sit, sik, BN: tl.constexpr, BQ: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """The BN-bit mask of query t's keys in tile j into M `[B, NKT, T]` (zeroed), seen as int32 words: BN 64's
    int64 mask is two of them (low keys first: little-endian); queries pid*BQ .. +BQ.

    Atomics by runs: a row's consecutive keys in one 32-bit word form a run (an ascending row's keys of a word are
    one); the sum of its bits is the block's prefix sum at its end less the one before its start, so the run's
    end adds the first and its start subtracts the second (one atomic where they coincide). A row's keys are
    distinct (the selection's contract), so the sum of its bits in a word is their OR; the sums wrap mod 2^32 and
    the differences stay exact. At most two atomics a run instead of one a key: at 32K the trained rows' 65 M
    selected pairs make 3.7 M runs, 7.1 M atomics (CPU replay, session 32), where one atomic a pair (a warp's
    lanes on a few words) took 0.82 of the lists' 0.96 ms (session 12)."""
    SUB: tl.constexpr = 32 if BN == 64 else BN  # keys a 32-bit word
    NS: tl.constexpr = BN // SUB  # words a mask
    LS: tl.constexpr = SUB.bit_length() - 1  # shifts, not signed divisions (a valid key is >= 0)
    LB: tl.constexpr = BN.bit_length() - 1
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    base = M + b * NKT * T * NS
    lane = tl.arange(0, BLOCK_K)
    for i in range(0, BQ):
        t = pid * BQ + i
        if t < T:
            row = IDX + b * sib + t * sit
            for k0 in range(0, NK, BLOCK_K):
                idx = tl.load(row + (k0 + lane) * sik, mask=k0 + lane < NK, other=-1)
                ok = (idx >= 0) & (idx < S)  # out-of-range keys are dropped like -1 (the reference's rule)
                w = tl.where(ok, idx >> LS, -1)
                # the neighbours' words from this block's registers (a block edge starts / ends a run)
                w_prev = tl.gather(w, tl.maximum(lane - 1, 0), 0)
                w_next = tl.gather(w, tl.minimum(lane + 1, BLOCK_K - 1), 0)
                start = ok & ((lane == 0) | (w != w_prev))
                end = ok & ((lane == BLOCK_K - 1) | (w != w_next))
                one = tl.where(ok, tl.full([BLOCK_K], 1, tl.int32) << (idx & (SUB - 1)), 0)  # bit 31: the sign
                cs = tl.cumsum(one, 0)
                delta = tl.where(end, cs, 0) - tl.where(start, cs - one, 0)
                word = ((idx >> LB).to(tl.int64) * T + t) * NS + (w & (NS - 1))
                tl.atomic_add(base + tl.where(ok, word, 0), delta, mask=start | end, sem="relaxed")


@triton.jit
def _kq_count_kernel(M, CNT, T, NKT, CH: tl.constexpr):
    j = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = M + (b * NKT + j) * T
    n = 0
    for c0 in range(0, T, CH):
        offs = c0 + tl.arange(0, CH)
        w = tl.load(row + offs, mask=offs < T, other=0)
        n += tl.sum((w != 0).to(tl.int32), 0)
    tl.store(CNT + b * NKT + j, n)


@triton.jit
def _kq_compact_kernel(M, OFF, LIST, MSK, T, NKT, CH: tl.constexpr):
    j = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = M + (b * NKT + j) * T
    base = tl.load(OFF + b * NKT + j).to(tl.int64)
    n = 0
    for c0 in range(0, T, CH):
        offs = c0 + tl.arange(0, CH)
        w = tl.load(row + offs, mask=offs < T, other=0)
        nz = w != 0
        pos = base + n + tl.cumsum(nz.to(tl.int32), 0) - 1
        tl.store(LIST + pos, offs, mask=nz)
        tl.store(MSK + pos, w, mask=nz)
        n += tl.sum(nz.to(tl.int32), 0)


def query_bits(indices: torch.Tensor, S: int, BN: int) -> torch.Tensor:
    """The lists' first step: `[B, NKT, T]` words (int32 for BN <= 32, int64 for BN 64), word (j, t) = the BN-bit
    mask of the keys of tile j that query t selected (`_kq_bits_kernel`)."""
    B, T, K = indices.shape
    NKT = triton.cdiv(S, BN)
    m = torch.zeros(B, NKT, T, dtype=torch.int64 if BN == 64 else torch.int32, device=indices.device)
    # a row's keys in one block where K <= 1024 (fewer run splits at block edges; 2.4 warp instructions a key at
    # 1024 vs 4.3 at 256, sm_90a SASS)
    BQ, BK = (16, min(1024, max(32, triton.next_power_of_2(K)))) if indices.is_cuda else (4, 32)
    _kq_bits_kernel[(triton.cdiv(T, BQ), B)](indices, m.view(torch.int32), T, K, S, NKT, *indices.stride(), BN=BN,
                                             BQ=BQ, BLOCK_K=BK, num_warps=4)
    return m


def key_query_lists(indices: torch.Tensor, S: int, BN: int):
    """Per-query indices `[B, T, K]` -> the transposed selection per key tile of BN keys (16/32/64):
    (offsets `[B * NKT + 1]` int32 CSR, queries `[nnz]` int32 ascending per key tile, masks `[nnz]`
    int32 (BN <= 32) / int64 (BN 64): bit n = key j BN + n selected by that query). One host sync."""
    if BN not in KEY_TILES:
        raise ValueError(f"key_query_lists: BN {BN} (one of {KEY_TILES})")
    B, T, _ = indices.shape
    dev = indices.device
    NKT = triton.cdiv(S, BN)
    m = query_bits(indices, S, BN)
    wdt = m.dtype
    CH = 1024 if indices.is_cuda else 32
    cnt = torch.empty(B * NKT, dtype=torch.int32, device=dev)
    _kq_count_kernel[(NKT, B)](m, cnt, T, NKT, CH=CH, num_warps=4)
    off = torch.zeros(B * NKT + 1, dtype=torch.int32, device=dev)
    off[1:] = cnt.cumsum(0)
    nnz = int(off[-1])
    lst = torch.empty(max(nnz, 1), dtype=torch.int32, device=dev)
    msk = torch.empty(max(nnz, 1), dtype=wdt, device=dev)
    _kq_compact_kernel[(NKT, B)](m, off, lst, msk, T, NKT, CH=CH, num_warps=4)
    return off, lst, msk


@triton.jit
def _tile_of(pid, NKT, GH: tl.constexpr):
    """Program pid's (KV head, key tile): groups of GH heads, within a group the heads fastest, then the tiles.
    Why GH < H_kv can matter: the programs running at once gather the q / dO rows of the queries in their tiles'
    lists; with fewer heads a wave spans more consecutive key tiles of each head, and a query that selected several
    of them has its rows fetched by programs running together (L2 hits: 26% at GH = 8, 32K, session 20's ncu)."""
    grp = pid // (GH * NKT)
    r = pid % (GH * NKT)
    return grp * GH + r % GH, r // GH


@triton.jit
def _kq_dkdv_kernel(Q, K, V, DO, LSE, DELTA, OFF, LIST, MSK, DK, DV,
                    sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                    sdob, sdot, sdoh, sdod, slb, slt, slh, sdkb, sdks, sdkh, sdkd,
                    S, G, D, NKT, scale, qk_scale,
                    BQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    PREC: tl.constexpr, GH: tl.constexpr = 1):
    """dk/dv of one (key tile j, KV head) over its listed queries, BQ queries (BQ G rows) a step.
    dk^T / dv^T `[BLOCK_D, BLOCK_N]` in registers (keymajor.py's "dt" form), written once. Program order
    (`_tile_of`): GH KV heads interleaved, the key tiles ascending within a group of heads; GH = H_kv (the
    default) makes the KV head the fastest dimension, so the key tiles start in ascending order, longest lists
    first on a causal selection: the sink tile's list holds every query (1,024 128-row chunks at 32K, ~7x the
    mean) and starting it last would leave it running alone at the end."""
    kvh, j = _tile_of(tl.program_id(0), NKT, GH)
    b = tl.program_id(1).to(tl.int64)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < S
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    nd = nmask[:, None] & dmask[None, :]
    kk = tl.load(K + b * skb + offs_n[:, None] * sks + kvh * skh + offs_d[None, :] * skd, mask=nd, other=0.0)
    vv = tl.load(V + b * svb + offs_n[:, None] * svs + kvh * svh + offs_d[None, :] * svd, mask=nd, other=0.0)
    dk = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    dv = tl.zeros([BLOCK_D, BLOCK_N], tl.float32)
    r = tl.arange(0, BLOCK_M)
    qi = r // G
    heads = kvh * G + r % G
    if BLOCK_N == 64:
        nbit = tl.arange(0, BLOCK_N).to(tl.int64)
    else:
        nbit = tl.arange(0, BLOCK_N)
    lo = tl.load(OFF + b * NKT + j)
    hi = tl.load(OFF + b * NKT + j + 1)
    for c in range(lo, hi, BQ):
        e = c + qi
        ok = (qi < BQ) & (e < hi)
        t = tl.load(LIST + e, mask=ok, other=0).to(tl.int64)
        w = tl.load(MSK + e, mask=ok, other=0)
        rd = ok[:, None] & dmask[None, :]
        q = tl.load(Q + b * sqb + t[:, None] * sqt + heads[:, None] * sqh + offs_d[None, :] * sqd, mask=rd, other=0.0)
        do = tl.load(DO + b * sdob + t[:, None] * sdot + heads[:, None] * sdoh + offs_d[None, :] * sdod, mask=rd,
                     other=0.0)
        lse = tl.load(LSE + b * slb + t * slt + heads * slh, mask=ok, other=float("-inf"))
        delta = tl.load(DELTA + b * slb + t * slt + heads * slh, mask=ok, other=0.0)
        row_ok = (lse != float("-inf")) & ok
        lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
        sel = (((w[:, None] >> nbit[None, :]) & 1) == 1) & row_ok[:, None]  # [BLOCK_M, BLOCK_N]
        s = dot(q, tl.trans(kk), PREC)
        pm = tl.where(sel, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        dp = dot(do, tl.trans(vv), PREC)
        ds = pm * (dp - delta[:, None])
        dv += dot(tl.trans(do), pm.to(do.dtype), PREC)  # [BLOCK_D, BLOCK_N]
        dk += dot(tl.trans(q), ds.to(q.dtype), PREC)
    base = b * sdkb + offs_n[None, :] * sdks + kvh * sdkh + offs_d[:, None] * sdkd
    m = nmask[None, :] & dmask[:, None]
    tl.store(DK + base, (dk * scale).to(DK.dtype.element_ty), mask=m)
    tl.store(DV + base, dv.to(DV.dtype.element_ty), mask=m)


def default_tune(cuda: bool, H_kv: int = 8) -> tuple:
    """(BLOCK_N, rows, num_warps, num_stages[, maxnreg, heads_together]). H200, 32K, trained-indexer rows, G 4, the kernel
    alone on prebuilt lists (session 12 call 1, NOTES.md; keymajor "dt" (64, 8, 2) 30.16 ms in the same run):
    (64, 128, 8, 3) 15.44 ms, (32, 64, 4, 2) 16.47, (64, 128, 8, 2) 16.79, (32, 128, 8, 3) 18.98, (32, 128, 8, 2) 21.13,
    (16, 128, 8, 2) 30.76. The program order (session 25 call 1, H100, results/2026-12-07-h100-session25.md, same rows):
    two KV heads together 15.16-15.23 ms, all eight 15.90-15.95, one 16.64 (bitwise equal); where two do not divide
    H_kv (GQA with an odd number of KV heads), all of them."""
    if not cuda:
        return (32, 64, 4, 1)
    return (64, 128, 8, 3, 0, 2) if H_kv % 2 == 0 else (64, 128, 8, 3)


def keyq_dkdv(q, k, v, indices, do, lse, delta, scale: float, prec: int, tune: tuple | None = None, lists=None):
    """dk, dv `[B, S, H_kv, D]` (k's dtype) of per-query `indices` `[B, T, K]` from the key tiles' query lists,
    one write per element. q/do `[B, T, H, D]`, lse/delta `[B, T, H]` fp32 with equal strides.
    `tune=(BLOCK_N, rows, num_warps, num_stages[, maxnreg[, heads_together]])`: BLOCK_N in 16/32/64, rows (BQ G
    rounded up to a power of 2) 64 or 128; `lists`: a prebuilt `key_query_lists(indices, S, BLOCK_N)` (benchmarks).
    heads_together: the KV heads interleaved in the program order (`_tile_of`; a divisor of H_kv; None or absent: all
    of them)."""
    B, T, H, D = q.shape
    S, H_kv = k.shape[1], k.shape[2]
    G = H // H_kv
    t = tuple(tune or default_tune(q.is_cuda, H_kv))
    BN, rows, warps, stages = t[:4]
    cap = t[4] if len(t) > 4 else 0
    heads_together = t[5] if len(t) > 5 else None
    if BN not in KEY_TILES or rows not in (16, 32, 64, 128, 256):
        raise ValueError(f"keyq_dkdv: BLOCK_N {BN} (one of {KEY_TILES}), rows {rows}")
    GH = H_kv if heads_together is None else int(heads_together)
    if GH < 1 or H_kv % GH:
        raise ValueError(f"keyq_dkdv: heads_together {heads_together} must divide the {H_kv} KV heads")
    BM = max(16, triton.next_power_of_2(G), rows)
    BQ = max(1, BM // G)  # whole queries per chunk (G = 7, 128 rows: 18 queries, 126 live rows)
    BD = max(16, triton.next_power_of_2(D))
    off, lst, msk = lists if lists is not None else key_query_lists(indices, S, BN)
    NKT = triton.cdiv(S, BN)
    dk = torch.empty(B, S, H_kv, D, device=q.device, dtype=k.dtype)
    dv = torch.empty_like(dk)
    _kq_dkdv_kernel[(H_kv * NKT, B)](
        q, k, v, do, lse, delta, off, lst, msk, dk, dv, *q.stride(), *k.stride(), *v.stride(), *do.stride(),
        *lse.stride(), *dk.stride(), S, G, D, NKT, scale, scale * LOG2E,
        BQ=BQ, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, PREC=prec, GH=GH, num_warps=warps, num_stages=stages,
        **maxnreg_option(cap, q))
    return dk, dv
