"""Triton block-selector scoring (Quest / DistillSparse style); same result as `naive.block_select_naive`.

A query scores each complete block of keys before its own by `sum_h q[h] . mean_key[block, kv(h)]`.
Since all G heads of a group share one mean key, the kernel first sums the group's queries (in
fp32), then does one dot per kv head: `[BLOCK_M, D] x [D, BLOCK_N]`. It writes the masked scores
(+inf for sink/recent blocks, -inf for blocks not visible) so only a top-k over `n_blocks` (S/128 =
1K at 128K) remains, done by `torch.topk`. Mean keys are a cheap reduction left to PyTorch.

On the GPU the dot runs in tf32 (the reference uses full fp32): blocks whose scores differ by less
than ~1e-3 relative may be ordered differently; everything else is identical.

The attention over the selected blocks is not here: on the GPU it is FlexAttention's block-sparse
path (`BlockMask.from_kv_blocks`), benchmarked as the peer of the token-level kernel.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sparse_rl.sparse.ops.block_select.naive import block_select_naive, check_block_args
from sparse_rl.sparse.ops.indexer_topk.triton import topk_from_scores
from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCORE_BUDGET_BYTES = 1 << 28


@triton.jit
def _block_score_kernel(Q, MEANS, NFULL, START, OUT,
                        sqb, sqt, sqh, sqd, smb, smn, smh, sob, sot, son,
                        T, NB, t0, q_offset, G, H_KV, D, block_size, sink_blocks, recent_blocks,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        PREC: tl.constexpr):
    """OUT `[B, Tc, NB]` fp32 for queries t0 + m: score, +inf forced, -inf not a candidate."""
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tq = t0 + offs_m
    mmask = tq < T
    dmask = offs_d < D
    nfull = tl.load(NFULL + b)
    st = tl.load(START + b)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kvh in range(0, H_KV):
        qs = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for g in range(0, G):
            qs += tl.load(Q + b * sqb + tq[:, None] * sqt + (kvh * G + g) * sqh + offs_d[None, :] * sqd,
                          mask=mmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        mt = tl.load(MEANS + b * smb + offs_n[None, :] * smn + kvh * smh + offs_d[:, None],
                     mask=(offs_n[None, :] < nfull) & dmask[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        acc += dot(qs, mt, PREC)
    pos = q_offset + tq - st  # position relative to the row's first valid key
    cur = tl.where(pos >= 0, pos // block_size, -1)
    j = offs_n[None, :]
    cand = (j <= cur[:, None]) & (pos[:, None] >= 0)
    forced = cand & ((j < sink_blocks) | (j > cur[:, None] - recent_blocks))
    acc = tl.where(cand, acc, float("-inf"))
    acc = tl.where(forced, float("inf"), acc)
    tl.store(OUT + b * sob + offs_m[:, None] * sot + offs_n[None, :] * son, acc,
             mask=mmask[:, None] & (offs_n[None, :] < NB))


def block_means(k: torch.Tensor, block_size: int, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean key of every complete block of each row: `[B, n_max, H_kv, D]` fp32 (contiguous) and
    the count of complete blocks per row `[B]` int32."""
    B, S, H_kv, D = k.shape
    n = [(S - st) // block_size for st in starts]
    means = torch.zeros(B, max(1, max(n)), H_kv, D, device=k.device, dtype=torch.float32)
    for b, (st, nb) in enumerate(zip(starts, n)):
        if nb:
            means[b, :nb] = k[b, st:st + nb * block_size].float().view(nb, block_size, H_kv, D).mean(1)
    return means, torch.tensor(n, dtype=torch.int32, device=k.device)


def block_select(q: torch.Tensor, k: torch.Tensor, block_size: int, topk_blocks: int, *, q_offset: int = 0,
                 sink_blocks: int = 1, recent_blocks: int = 2, kv_start: torch.Tensor | None = None,
                 budget_bytes: int | None = None) -> torch.Tensor:
    """Block selector, Triton scores. q `[B, T, H, D]`, k `[B, S, H_kv, D]` ->
    `[B, T, topk_blocks * block_size]` int32 key positions, ascending, -1 padded.
    Head dims above 128 or float64 take the reference."""
    check_block_args(topk_blocks, sink_blocks, recent_blocks)
    B, T, H, D = q.shape
    S, H_kv = k.shape[1], k.shape[2]
    if q.dtype not in _DTYPES or k.dtype not in _DTYPES or D > 128 or H % H_kv or T == 0 or S == 0:
        return block_select_naive(q, k, block_size, topk_blocks, q_offset=q_offset, sink_blocks=sink_blocks,
                                  recent_blocks=recent_blocks, kv_start=kv_start)
    dev = q.device
    starts = [0] * B if kv_start is None else [int(x) for x in torch.as_tensor(kv_start).tolist()]
    nb = max(1, max((S - st + block_size - 1) // block_size for st in starts))  # incl. partial blocks
    with torch.no_grad():
        means, nfull = block_means(k, block_size, starts)
        st_t = torch.tensor(starts, dtype=torch.int32, device=dev)
        budget = budget_bytes or SCORE_BUDGET_BYTES
        chunk = max(1, min(T, budget // (4 * B * nb)))
        BM, BN, BD = 32, 64, max(16, triton.next_power_of_2(D))
        # tf32 on the GPU (see module docstring); exact fp32 under the interpreter.
        prec = 2 if os.environ.get("TRITON_INTERPRET", "") == "1" else 0
        pos = torch.arange(T, device=dev)[None, :, None] + q_offset
        tok_off = torch.arange(block_size, device=dev, dtype=torch.int32)
        out = torch.empty(B, T, topk_blocks * block_size, dtype=torch.int32, device=dev)
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            scores = torch.empty(B, t1 - t0, nb, device=dev, dtype=torch.float32)
            grid = (triton.cdiv(t1 - t0, BM), triton.cdiv(nb, BN), B)
            _block_score_kernel[grid](q, means, nfull, st_t, scores, *q.stride(), *means.stride()[:3],
                                      *scores.stride(), t1, nb, t0, q_offset, H // H_kv, H_kv, D, block_size,
                                      sink_blocks, recent_blocks, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD, PREC=prec,
                                      num_warps=4)
            blocks = topk_from_scores(scores, topk_blocks)  # [B, Tc, kb] ascending, -1 padded
            # The query's own block is always kept and is the largest chosen, so after masking the
            # tokens past the query (and the -1 blocks) the valid tokens form an ascending prefix.
            tok = blocks[..., None] * block_size + tok_off + st_t[:, None, None, None]
            ok = (blocks[..., None] >= 0) & (tok <= pos[:, t0:t1, :, None]) & (tok < S)
            out[:, t0:t1] = torch.where(ok, tok, -1).flatten(2)
    return out
