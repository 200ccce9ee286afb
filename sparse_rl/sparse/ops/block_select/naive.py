"""Reference training-free block selector (Quest / DistillSparse style).

Keys are cut into blocks of `block_size` counted from the row's first valid key. A query scores
every *complete* block before its own by `sum_h q[h] . mean_key[block, kv(h)]`, keeps the first
`sink_blocks` and the last `recent_blocks` (its own, partial block included) unconditionally, and
fills the rest of `topk_blocks` with the best-scoring blocks. Scoring only complete blocks makes
the choice identical whether the sequence is processed at once or token by token.
"""

from __future__ import annotations

import torch

from sparse_rl.sparse.ops.indexer_topk.naive import select_topk


def check_block_args(topk_blocks: int, sink_blocks: int, recent_blocks: int) -> None:
    """The block counts every block selector (reference or kernel) must be given."""
    if recent_blocks < 1:
        raise ValueError("recent_blocks must be >= 1 (the query's own block is always kept)")
    if sink_blocks + recent_blocks > topk_blocks:
        raise ValueError(f"sink_blocks ({sink_blocks}) + recent_blocks ({recent_blocks}) must not exceed "
                         f"topk_blocks ({topk_blocks})")


def block_scores_naive(q: torch.Tensor, k: torch.Tensor, block_size: int, start: int = 0) -> torch.Tensor:
    """Scores of one row's queries against block mean keys.

    q `[T, H, D]`, k `[S, H_kv, D]` (keys from `start` on are blocked). Returns `[T, n_blocks]` float32.
    """
    T, H, D = q.shape
    kv = k[start:].float()
    n = kv.shape[0] // block_size
    if n == 0:
        return q.new_zeros(T, 0, dtype=torch.float32)
    means = kv[: n * block_size].view(n, block_size, kv.shape[1], D).mean(1)  # [n, H_kv, D]
    means = means.repeat_interleave(H // kv.shape[1], dim=1)  # [n, H, D]
    return torch.einsum("thd,nhd->tn", q.float(), means)


def block_select_naive(q, k, block_size: int, topk_blocks: int, *, q_offset: int = 0, sink_blocks: int = 1,
                       recent_blocks: int = 2, kv_start=None) -> torch.Tensor:
    """Token indices of the selected blocks.

    Args:
        q: `[B, T, H, D]` queries (after RoPE); k: `[B, S, H_kv, D]` keys.
        kv_start: optional `[B]` first valid key per row.
    Returns:
        `[B, T, topk_blocks * block_size]` int32 key positions, ascending, causal, -1 padded.
    """
    check_block_args(topk_blocks, sink_blocks, recent_blocks)
    B, T, H, D = q.shape
    S = k.shape[1]
    K = topk_blocks * block_size
    dev = q.device
    starts = [0] * B if kv_start is None else [int(x) for x in torch.as_tensor(kv_start).tolist()]
    rows = []
    with torch.no_grad():
        for b in range(B):
            st = starts[b]
            nb = (S - st + block_size - 1) // block_size  # blocks incl. a partial last one
            pos = torch.arange(T, device=dev) + q_offset - st  # relative query position
            cur = torch.div(pos, block_size, rounding_mode="floor")  # [T]
            j = torch.arange(max(nb, 1), device=dev)
            full = block_scores_naive(q[b], k[b], block_size, st)  # [T, n_complete]
            scores = torch.zeros(T, max(nb, 1), device=dev)
            scores[:, : full.shape[1]] = full
            cand = (j[None] <= cur[:, None]) & (pos[:, None] >= 0)
            forced = cand & ((j[None] < sink_blocks) | (j[None] > cur[:, None] - recent_blocks))
            blocks = select_topk(scores[None], cand[None], forced[None], topk_blocks)[0]  # [T, kb]
            tok = blocks.long()[:, :, None] * block_size + torch.arange(block_size, device=dev) + st
            ok = (blocks[:, :, None] >= 0) & (tok <= (pos + st)[:, None, None]) & (tok < S)
            tok = torch.where(ok, tok, torch.full_like(tok, -1)).flatten(1)
            big = torch.iinfo(torch.int32).max
            tok = torch.sort(torch.where(tok < 0, torch.full_like(tok, big), tok), -1).values
            rows.append(torch.where(tok == big, torch.full_like(tok, -1), tok).to(torch.int32))
    return torch.stack(rows) if rows else torch.empty(0, T, K, dtype=torch.int32, device=dev)
