"""Granular indexer selection (key blocks, query groups) in Triton: the fast path of
`naive.granular_topk_naive`, exact against it (ties included; docs/DESIGN.md "Selection granularity").

Why this shape:
- The DSA score `I(t, s) = sum_h w_h ReLU(q_h . k_s)` is not linear in k, so a block's max or mean
  score cannot come from block-pooled keys: `_block_keys_kernel` computes each `[BLOCK_M rows,
  BLOCK_B * key_block keys]` tile of token scores in registers (one small dot per index head, ReLU,
  weighted sum, as the token-level kernel) and reduces it to block scores there. Only
  `[rows, S / key_block]` block keys reach memory, never `[T, S]` token scores.
- Rows are query groups: the rule is evaluated at each group's representative (its first query), once
  per group where groups line up across the batch (`naive.group_rows`), so query_group G scores G x
  fewer rows; with left padding every query is its own row (its group differs per batch row).
- Exact top-k over blocks with the reference's tie rule (the later block wins; -0.0 counts as +0.0),
  in row chunks bounded by `budget` bytes (at 128K keys and key_block 16 a row has 8K blocks), in one
  of several forms (`top_blocks`, `topk_impl`): the one-histogram select (`bin_topk.py`) or the
  token-level path's radix select on the fp32 block scores; an fp32 `torch.topk` threshold with the
  ties settled by a prefix sum; or `torch.topk` on int64 keys, the score's order-preserving bits above
  the block index. `auto` takes bin in prefill (fastest on every prefill shape timed,
  `resolve_topk_impl`) and, in decode, radix for rows of <= 32K blocks and the threshold beyond. Blocks that are
  not candidates (no visible key that is not forced) score -inf (the smallest key) and are dropped.
- The row is then assembled without a sort of tokens: the sink keys, the chosen blocks' keys (blocks
  sorted, then expanded; forced keys cut out), the window and the group's keys after the
  representative are ascending and disjoint in that order, so one prefix sum compacts them. Prefill
  does it in one Triton program per row (`assemble_rows_triton`, written straight into the result:
  the torch form `assemble_rows`, kept for decode, makes ~10 passes over `[rows, topk]` int64
  tensors, ~0.5 GB each at 32K rows); decode keeps the torch form (one row per batch row, CUDA-graph
  capture checked on the GPU with it).

Output: per-query rows `[B, T, topk]` int32 (ascending, -1 padded), or with `shared=True` (no left
padding, q_offset a multiple of query_group) one row per group `[B, ceil(T / G), topk]`: the last
member's row, which `ops.sparse_attention(..., query_group=G, q_offset=)` takes as it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.indexer_topk.bin_topk import bin_topk
from sparse_rl.sparse.ops.indexer_topk.radix_topk import radix_topk
from sparse_rl.sparse.ops.indexer_topk.sampled_topk import sampled_topk
from sparse_rl.sparse.ops.indexer_topk.naive import group_plan, group_start, per_query_rows, rep_queries
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot, dot_precision

NO_BLOCK = -(2 ** 63)  # the key of a block that is not a candidate (below every real key)
_BIG = torch.iinfo(torch.int32).max
TOPK_IMPLS = ("auto", "keys", "threshold", "radix", "sampled", "bin")
RADIX_MAX_BLOCKS = 32768  # "auto": radix select for rows up to this many blocks, "threshold" beyond


def resolve_topk_impl(impl: str, n_blocks: int, prefill: bool = False) -> str:
    """`auto` -> "bin" for prefill (H200, session 9, benchmarks/NOTES.md item 16: the one-histogram select
    of `bin_topk.py` against radix on the trained indexer's 128K rows, 3.59 vs 5.87 ms for 2K rows (g64),
    6.36 vs 11.35 for 4K rows (g32); radix had beaten the torch.topk threshold on every prefill shape,
    item 13); for decode (a few rows, one program each; bin not timed there) "radix" up to
    RADIX_MAX_BLOCKS blocks and "threshold" beyond, the token-level path's rule (NOTES item 4: one
    program per row is latency bound on long rows when rows are few)."""
    if impl not in TOPK_IMPLS:
        raise ValueError(f"topk_impl {impl!r}: expected one of {', '.join(TOPK_IMPLS)}")
    if impl == "auto":
        if prefill:
            return "bin"
        return "radix" if n_blocks <= RADIX_MAX_BLOCKS else "threshold"
    return impl


@triton.jit
def _block_keys_kernel(Q, W, K, REP, START, OUT,
                       sqb, sqn, sqh, sqd, swb, swn, swh, skb, sks, skd, sob, son, sok,
                       N, S, NBC, DI, sink, window, rep0, rstep,
                       HI: tl.constexpr, KB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr,
                       BLOCK_D: tl.constexpr, MEAN: tl.constexpr, KEYS: tl.constexpr, PREC: tl.constexpr,
                       ARITH: tl.constexpr, HAS_START: tl.constexpr):
    """OUT `[B, N, NBC]`: for row n (representative position REP `[B, N]`, contiguous, or with ARITH
    rep0 + n * rstep) and key block c (keys START[b] + c*KB ..., START 0 without HAS_START), with KEYS the
    int64 (ordered score bits << 32) | c, or the smallest int64 when the block holds no key the
    representative sees and does not force; without KEYS the fp32 block score, -inf for such a block."""
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    BN: tl.constexpr = BLOCK_B * KB
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    if ARITH:
        r = tl.where(rmask, rep0 + rows.to(tl.int64) * rstep, -1)
    else:
        r = tl.load(REP + b * N + rows, mask=rmask, other=-1).to(tl.int64)
    if HAS_START:
        st = tl.load(START + b).to(tl.int64)
    else:
        st = tl.zeros([], tl.int64)
    blk = pk * BLOCK_B + tl.arange(0, BLOCK_B)
    s = st + pk * BN + tl.arange(0, BN)
    optr = OUT + b * sob + rows[:, None] * son + blk[None, :] * sok
    omask = rmask[:, None] & (blk < NBC)[None, :]
    if KEYS:
        none = tl.full([BLOCK_M, BLOCK_B], -2147483648, tl.int32).to(tl.int64) << 32
    else:
        none = tl.full([BLOCK_M, BLOCK_B], float("-inf"), tl.float32)
    if st + pk * BN <= tl.max(r, 0):  # some row of the tile sees a key of this tile
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < DI
        smask = s < S
        kt = tl.load(K + b * skb + s[None, :] * sks + offs_d[:, None] * skd,
                     mask=dmask[:, None] & smask[None, :], other=0.0)  # [BLOCK_D, BN]
        acc = tl.zeros([BLOCK_M, BN], tl.float32)
        for h in tl.static_range(HI):
            qh = tl.load(Q + b * sqb + rows[:, None] * sqn + h * sqh + offs_d[None, :] * sqd,
                         mask=rmask[:, None] & dmask[None, :], other=0.0)
            wh = tl.load(W + b * swb + rows * swn + h * swh, mask=rmask, other=0.0).to(tl.float32)
            acc += tl.maximum(dot(qh, kt, PREC), 0.0) * wh[:, None]
        acc = tl.where(acc == 0.0, 0.0, acc)  # -0.0 -> +0.0: equal scores for the tie rule
        vis = (s[None, :] <= r[:, None]) & smask[None, :]
        cand = vis & (s[None, :] >= st + sink) & (s[None, :] <= r[:, None] - window)
        if KB == 1:
            score = acc
            cb = cand
        else:
            cb = tl.max(tl.reshape(cand.to(tl.int32), [BLOCK_M, BLOCK_B, KB]), 2) > 0
            if MEAN:
                tot = tl.sum(tl.reshape(tl.where(vis, acc, 0.0), [BLOCK_M, BLOCK_B, KB]), 2)
                cnt = tl.sum(tl.reshape(vis.to(tl.float32), [BLOCK_M, BLOCK_B, KB]), 2)
                score = tl.math.div_rn(tot, tl.maximum(cnt, 1.0))
            else:
                score = tl.max(tl.reshape(tl.where(vis, acc, float("-inf")), [BLOCK_M, BLOCK_B, KB]), 2)
        if KEYS:
            bits = score.to(tl.int32, bitcast=True)
            ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int order == float order
            key = (ordered.to(tl.int64) << 32) | blk.to(tl.int64)[None, :]
            tl.store(optr, tl.where(cb, key, none), mask=omask)
        else:
            tl.store(optr, tl.where(cb, score, none), mask=omask)
    else:
        tl.store(optr, none, mask=omask)


def _launch(key_block: int, cuda: bool) -> tuple[int, int, int]:
    """(BLOCK_M, keys per program, num_warps)."""
    return (64, max(64, key_block), 4) if cuda else (16, max(16, key_block), 1)


def block_keys(qr, wr, k_idx, rep, start, n_blocks: int, *, key_block: int, sink: int, window: int,
               block_score: str, keys: bool = True, launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """qr `[B, N, H_I, D_I]`, wr `[B, N, H_I]` the rows' representatives (any strides: the arithmetic rows
    pass strided views), rep `[B, N]` their positions or a pair (rep0, step): row n's is rep0 + n * step,
    start `[B, 1]` or None (0), k_idx `[B, S, D_I]` -> `[B, N, n_blocks]` int64 block keys, or with
    keys=False fp32 block scores (`_block_keys_kernel`). launch: (rows, keys per program (a multiple of
    key_block), num_warps) instead of `_launch`'s (benchmarks)."""
    B, N, HI, DI = qr.shape
    out = torch.empty(B, N, n_blocks, dtype=torch.int64 if keys else torch.float32, device=qr.device)
    BM, BN, warps = launch or _launch(key_block, qr.is_cuda)
    BB = BN // key_block
    grid = (triton.cdiv(N, BM), triton.cdiv(n_blocks, BB), B)
    arith = isinstance(rep, tuple)
    rep0, rstep = rep if arith else (0, 0)
    _block_keys_kernel[grid](qr, wr, k_idx, out if arith else rep.contiguous(),
                             out if start is None else start.contiguous(), out,
                             *qr.stride(), *wr.stride(), *k_idx.stride(), *out.stride(),
                             N, k_idx.shape[1], n_blocks, DI, sink, window, rep0, rstep,
                             HI=HI, KB=key_block, BLOCK_M=BM, BLOCK_B=BB, BLOCK_D=max(16, triton.next_power_of_2(DI)),
                             MEAN=block_score == "mean", KEYS=keys, PREC=dot_precision(qr.dtype), ARITH=arith,
                             HAS_START=start is not None, num_warps=warps)
    return out


def top_blocks(x: torch.Tensor, kk: int, impl: str) -> torch.Tensor:
    """The kk best blocks of each row `[B, N, kk]` int64, ascending, -1 padded, ties to the later block.

    impl "keys": x the int64 block keys (distinct: the index is in the low bits), `torch.topk` then a
    sort of the kk indices. impl "threshold": x the fp32 scores (-inf = not a candidate); `torch.topk`
    gives the kk-th best score, every block above it is kept and, of the blocks equal to it, the latest
    ones that fill the budget (the reference's tie rule); the kept mask compacts to ascending indices by
    one prefix sum. The threshold form moves 4-byte scores instead of 8-byte keys through the top-k.
    impl "radix": x the fp32 scores, the token-level path's radix select (`radix_topk.py`, same tie
    rule, output already ascending). impl "sampled": the same rows by a sampled threshold, one
    compaction pass and a register select of the candidates (`sampled_topk.py`; radix on a miss)."""
    if kk == 0:
        return torch.empty(*x.shape[:-1], 0, dtype=torch.long, device=x.device)
    if impl == "radix":
        return radix_topk(x, kk).long()
    if impl == "sampled":
        return sampled_topk(x, kk).long()
    if impl == "bin":
        return bin_topk(x, kk).long()
    if impl == "keys":
        top = x.topk(kk, dim=-1, sorted=False).values
        blocks = torch.where(top == NO_BLOCK, _BIG, top & 0xFFFFFFFF).sort(-1).values
        return torch.where(blocks == _BIG, -1, blocks)
    thr = x.topk(kk, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    gt = x > thr
    eq = (x == thr) & (thr > float("-inf"))
    need = kk - gt.sum(-1, keepdim=True, dtype=torch.int32)
    eqi = eq.to(torch.int32)
    later = eqi.sum(-1, keepdim=True, dtype=torch.int32) - eqi.cumsum(-1, dtype=torch.int32) + eqi  # equal ones at >= i
    keep = gt | (eq & (later <= need))
    dest = torch.where(keep, keep.cumsum(-1, dtype=torch.int32) - 1, kk).long()
    out = torch.full((*x.shape[:-1], kk + 1), -1, dtype=torch.long, device=x.device)
    out.scatter_(-1, dest, torch.arange(x.shape[-1], device=x.device).expand_as(dest))
    return out[..., :kk]


def _span(first: torch.Tensor, n: int, ok_lo, ok_hi):
    """Keys first + 0..n-1 `[..., n]` and whether each lies in [ok_lo, ok_hi] (broadcast `[..., 1]`)."""
    x = first + torch.arange(n, device=first.device)
    return x, (x >= ok_lo) & (x <= ok_hi)


def assemble_rows(blocks: torch.Tensor, pos, rep, start, topk: int, *, key_block: int, query_group: int,
                  sink: int, window: int) -> torch.Tensor:
    """Chosen blocks `[B, N, nb]` (ascending, -1 padded) of rows at pos / rep `[B, N]` -> the rows
    `[B, N, topk]` int32: sink, blocks (forced keys cut out), window, the group's keys after rep."""
    p, r, st = pos[..., None], rep[..., None], start.view(-1, 1, 1)
    kb = key_block
    tok = (st[..., None] + blocks.long()[..., None] * kb + torch.arange(kb, device=blocks.device)).flatten(-2)
    tok_ok = (blocks >= 0).repeat_interleave(kb, -1) & (tok >= st + sink) & (tok <= r - window)
    parts = [_span(st, sink, st, r), (tok, tok_ok), _span(r - window + 1, window, st + sink, r),
             _span(r + 1, query_group - 1, r + 1, p)]
    lead = blocks.shape[:-1]
    keys = torch.cat([x.expand(*lead, x.shape[-1]) for x, _ in parts], -1)
    ok = torch.cat([m.expand(*lead, x.shape[-1]) for x, m in parts], -1)
    dest = torch.where(ok, ok.cumsum(-1) - 1, topk)
    out = torch.full((*keys.shape[:-1], topk + 1), -1, dtype=torch.long, device=keys.device)
    out.scatter_(-1, dest, torch.where(ok, keys, -1))
    full, full_ok = _span(st, topk, st, p)  # a group whose last member sees <= topk keys keeps them all
    short = (r + query_group - st) <= topk
    return torch.where(short, torch.where(full_ok, full, -1), out[..., :topk]).to(torch.int32)


@triton.jit
def _assemble_kernel(BLK, POS, REP, START, OUT, sbb, sbn, sbk, sob, son, sok, N, NB, topk, sink, window,
                     rep0, pmax, KB: tl.constexpr, KBP: tl.constexpr, G: tl.constexpr, NBP: tl.constexpr,
                     BLOCK: tl.constexpr, ARITH: tl.constexpr, HAS_START: tl.constexpr):
    """One row of `assemble_rows` per program: OUT[b, n, :topk] int32 from the chosen blocks BLK
    `[B, N, NB]` (ascending, -1 padded) of the row at POS / REP `[B, N]`, START `[B]`. The parts (sink,
    the blocks' non-forced keys, window, the group's keys after the representative) are ascending and
    disjoint, so each part's destination is a running count: only a block's first and last tokens can
    be cut (by the sink or the window), so its kept keys are one range and a prefix sum over the
    blocks places them. ARITH: row n's representative is rep0 + n * G and its position
    min(rep + G - 1, pmax) (no POS / REP read); without HAS_START the rows start at key 0."""
    n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    if ARITH:
        r = rep0 + n.to(tl.int64) * G
        p = tl.minimum(r + G - 1, pmax)
    else:
        p = tl.load(POS + b * N + n).to(tl.int64)
        r = tl.load(REP + b * N + n).to(tl.int64)
    if HAS_START:
        st = tl.load(START + b).to(tl.int64)
    else:
        st = tl.zeros([], tl.int64)
    obase = OUT + b * sob + n * son
    offs = tl.arange(0, BLOCK)
    if r + G - st <= topk:  # the group's last member sees <= topk keys: all of them
        for f0 in range(0, topk, BLOCK):
            xf = st + f0 + offs
            tl.store(obase + (f0 + offs) * sok, tl.where(xf <= p, xf, -1).to(tl.int32), mask=f0 + offs < topk)
    else:
        lo_ok = st + sink
        hi_ok = r - window
        n_sink = tl.maximum(tl.minimum(sink, r - st + 1), 0)  # keys st .. st + n_sink - 1
        cb = tl.arange(0, NBP)
        blk = tl.load(BLK + b * sbb + n * sbn + cb * sbk, mask=cb < NB, other=-1).to(tl.int64)
        first = tl.maximum(st + blk * KB, lo_ok)
        cnt = tl.where(blk >= 0, tl.maximum(tl.minimum(st + blk * KB + KB - 1, hi_ok) - first + 1, 0), 0)
        dst = n_sink + tl.cumsum(cnt, 0) - cnt  # each block's first output slot
        j = tl.arange(0, KBP)  # KBP = max(2, KB): the block's tokens
        tl.store(obase + (dst[:, None] + j[None, :]) * sok, (first[:, None] + j[None, :]).to(tl.int32),
                 mask=j[None, :] < cnt[:, None])
        n_blk = tl.sum(cnt, 0)
        w_first = tl.maximum(r - window + 1, lo_ok)
        n_win = tl.maximum(r - w_first + 1, 0)
        n_grp = tl.maximum(tl.minimum(r + G - 1, p) - r, 0)
        w0 = n_sink + n_blk
        g0 = w0 + n_win
        total = g0 + n_grp
        for c0 in range(0, topk, BLOCK):
            o = c0 + offs
            x = tl.where(o < n_sink, st + o, tl.where(o < g0, w_first + (o - w0), r + 1 + (o - g0)))
            x = tl.where(o < total, x, -1)
            part = (o < n_sink) | ((o >= w0) & (o < topk))  # sink, window, group or the -1 tail
            tl.store(obase + o * sok, x.to(tl.int32), mask=part & (o < topk))


def assemble_rows_triton(blocks: torch.Tensor, pos, rep, start, topk: int, *, key_block: int, query_group: int,
                         sink: int, window: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """`assemble_rows` (same arguments and rows, `[B, N, topk]` int32) in one Triton program per row, no
    `[B, N, topk]` int64 intermediates; `out` (a `[B, N, topk]` int32 view, last dim of any stride)
    receives the rows. The chunked prefill writes each chunk's rows into its slice of the result.
    Arithmetic rows (no left padding: `granular_topk`'s launch-light path): rep a pair (rep0, pmax), row n's
    representative rep0 + n * query_group and its position min(rep + query_group - 1, pmax); pos is then
    ignored and start may be None (0). blocks: int32 or int64."""
    B, N, NB = blocks.shape
    if out is None:
        out = torch.empty(B, N, topk, dtype=torch.int32, device=blocks.device)
    if N == 0 or topk == 0:
        return out
    arith = isinstance(rep, tuple)
    if arith:
        (rep0, pmax), pos = rep, out
        rep = out
    else:
        rep0 = pmax = 0
        pos, rep = pos.expand(B, N).contiguous(), rep.expand(B, N).contiguous()
    cuda = blocks.is_cuda
    _assemble_kernel[(N, B)](blocks, pos, rep, out if start is None else start.reshape(B).contiguous(), out,
                             *blocks.stride(), *out.stride(), N, NB, topk, sink, window, rep0, pmax,
                             KB=key_block, KBP=max(2, key_block), G=query_group,
                             NBP=max(2, triton.next_power_of_2(NB)), BLOCK=1024 if cuda else 64, ARITH=arith,
                             HAS_START=start is not None, num_warps=4 if cuda else 1)
    return out


def _chunk_rows(B: int, width: int, budget: int, impl: str) -> int:
    """Rows per chunk whose block-score buffer and top-k temporaries fit in `budget` bytes: the radix
    select needs only the fp32 scores (4 B a block); "keys" (int64 keys and torch.topk's copies) and
    "threshold" (its masks, prefix sums and int64 destinations) ~24 B a block. Fewer, larger chunks
    keep the one-program-per-row radix launch several waves deep (8K rows of 128K blocks: 4 chunks,
    not 24 of 341 rows, ~1.3 waves each on 132 SMs)."""
    per_block = 4 if impl in ("radix", "sampled", "bin") else 24
    return max(1, budget // max(1, B * width * per_block))


def granular_topk(q_idx, w, k_idx, topk: int, *, q_offset: int = 0, sink: int = 0, window: int = 0,
                  kv_start=None, key_block: int = 1, query_group: int = 1, block_score: str = "max",
                  history=None, shared: bool = False, budget: int | None = None,
                  topk_impl: str = "auto") -> torch.Tensor:
    """`naive.granular_topk_naive` (same arguments, rows and `shared`) on the kernel.
    budget: bytes of one chunk's block keys and row buffers (default 1 GiB on CUDA, 4 MiB elsewhere);
    topk_impl: the block top-k (`top_blocks`, `resolve_topk_impl`; every form gives the same rows,
    timed against each other by benchmarks/gpu_granular_session5.py)."""
    if sink + window > topk:
        raise ValueError(f"sink ({sink}) + window ({window}) must not exceed topk ({topk})")
    if key_block & (key_block - 1) or query_group < 1:
        raise ValueError(f"key_block {key_block} must be a power of two and query_group {query_group} >= 1")
    G, kb = query_group, key_block
    B, T = q_idx.shape[:2]
    S = k_idx.shape[1]
    if kv_start is None and history is None and q_offset % G == 0:
        return _arith_topk(q_idx, w, k_idx, topk, q_offset, sink, window, kb, G, block_score, shared, budget,
                           topk_impl)
    start, pos, ev_pos, ev_rep, inv, q_all, w_all, j = group_plan(q_idx, w, q_offset, kv_start, G, history)
    N = ev_pos.shape[1]
    nb = max(0, (topk - (G - 1) - sink - window) // kb)
    budget = budget or ((1 << 30) if q_idx.is_cuda else (1 << 22))
    n_all = triton.cdiv(S, kb)
    impl = resolve_topk_impl(topk_impl, n_all, prefill=True)
    step = _chunk_rows(B, max(n_all, topk + sink + window + G), budget, impl)
    rows = torch.empty(B, N, topk, dtype=torch.int32, device=q_idx.device)
    with torch.no_grad():
        for n0 in range(0, N, step):
            n1 = min(N, n0 + step)
            # the rows see keys up to their largest representative: blocks past it are never read
            last_rep = q_offset + n1 - 1 if inv is None else (q_offset // G + n1 - 1) * G
            nbc = min(n_all, last_rep // kb + 1)
            rep_c = ev_rep[:, n0:n1]
            qr, wr = rep_queries(q_all, w_all, j[:, n0:n1])
            x = block_keys(qr, wr, k_idx, rep_c, start, nbc, key_block=kb, sink=sink, window=window,
                           block_score=block_score, keys=impl == "keys")
            blocks = top_blocks(x, min(nb, nbc), impl)
            del x
            assemble_rows_triton(blocks, ev_pos[:, n0:n1], rep_c, start, topk, key_block=kb, query_group=G,
                                 sink=sink, window=window, out=rows[:, n0:n1])
    return rows if shared else per_query_rows(rows, pos, inv)


def _row_blocks(x: torch.Tensor, kk: int, impl: str) -> torch.Tensor:
    """`top_blocks` without its int64 copy for the row forms (their int32 rows go to the assembly as they are)."""
    if kk and impl in ("radix", "bin", "sampled"):
        return {"radix": radix_topk, "bin": bin_topk, "sampled": sampled_topk}[impl](x, kk)
    return top_blocks(x, kk, impl)


def _arith_topk(q_idx, w, k_idx, topk: int, q_offset: int, sink: int, window: int, kb: int, G: int,
                block_score: str, shared: bool, budget: int | None, topk_impl: str) -> torch.Tensor:
    """`granular_topk` without left padding or history, q_offset a multiple of G: group n's representative is
    q_offset + n * G and its row's position min(rep + G - 1, q_offset + T - 1), so the kernels compute both
    instead of reading `group_plan`'s tensors, the representatives' index queries are the strided views
    q_idx[:, ::G] (no gather), and nothing is read back to the host (group_plan's check of a group before
    q_offset is arithmetic here): per chunk three launches (block scores, block top-k, assembly) and no
    torch kernel, where the general path ran ~10 small torch kernels and one host sync (benchmarks/NOTES.md
    item 19: the 32K selection was host-launch bound)."""
    B, T = q_idx.shape[:2]
    S = k_idx.shape[1]
    N = triton.cdiv(T, G)
    nb = max(0, (topk - (G - 1) - sink - window) // kb)
    budget = budget or ((1 << 30) if q_idx.is_cuda else (1 << 22))
    n_all = triton.cdiv(S, kb)
    impl = resolve_topk_impl(topk_impl, n_all, prefill=True)
    step = _chunk_rows(B, max(n_all, topk + sink + window + G), budget, impl)
    rows = torch.empty(B, N, topk, dtype=torch.int32, device=q_idx.device)
    pmax = q_offset + T - 1
    with torch.no_grad():
        for n0 in range(0, N, step):
            n1 = min(N, n0 + step)
            rep0 = q_offset + n0 * G
            nbc = min(n_all, (q_offset + (n1 - 1) * G) // kb + 1)  # blocks past the last representative: unread
            x = block_keys(q_idx[:, n0 * G:n1 * G:G], w[:, n0 * G:n1 * G:G], k_idx, (rep0, G), None, nbc,
                           key_block=kb, sink=sink, window=window, block_score=block_score, keys=impl == "keys")
            blocks = _row_blocks(x, min(nb, nbc), impl)
            del x
            assemble_rows_triton(blocks, None, (rep0, pmax), None, topk, key_block=kb, query_group=G, sink=sink,
                                 window=window, out=rows[:, n0:n1])
    if shared or G == 1:
        return rows
    pos = torch.arange(T, device=q_idx.device) + q_offset  # each query's row: its group's, cut at its position
    per = rows[:, torch.arange(T, device=q_idx.device) // G]
    return torch.where(per <= pos[None, :, None], per, torch.full_like(per, -1))


def granular_topk_decode(q_rep, w_rep, k_idx, pos, topk: int, *, sink: int = 0, window: int = 0, kv_start=None,
                         key_block: int = 1, query_group: int = 1, block_score: str = "max",
                         topk_impl: str = "auto") -> torch.Tensor:
    """`naive.granular_topk_decode_naive` (same arguments and rows) on the kernel: one row per batch row at
    `pos [B]`, its representative's q_rep `[B, H_I, D_I]`, w_rep `[B, H_I]`, over k_idx `[B, S, D_I]`.
    Shapes depend on S and the config only and nothing is read back to the host, so a decode step
    running it can be captured in a CUDA graph."""
    B, S = k_idx.shape[:2]
    dev = k_idx.device
    start = (torch.zeros(B, 1, dtype=torch.long, device=dev) if kv_start is None
             else torch.as_tensor(kv_start, device=dev).long().view(B, 1))
    p = torch.as_tensor(pos, device=dev).long().view(B, 1)
    rep = group_start(p, start, query_group)
    n_blocks = triton.cdiv(S, key_block)
    impl = resolve_topk_impl(topk_impl, n_blocks)
    with torch.no_grad():
        x = block_keys(q_rep[:, None], w_rep[:, None], k_idx, rep, start, n_blocks, key_block=key_block, sink=sink,
                       window=window, block_score=block_score, keys=impl == "keys")
        nb = max(0, (topk - (query_group - 1) - sink - window) // key_block)
        blocks = top_blocks(x, min(nb, n_blocks), impl)
        return assemble_rows(blocks, p, rep, start, topk, key_block=key_block, query_group=query_group, sink=sink,
                             window=window)[:, 0]
