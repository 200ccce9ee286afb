"""The prefill top-k's redo of flagged rows launched ahead of the count that says how many there are
(`CandConfig.redo_ahead`, cand_topk.py; B = 1).

Why: on the H200 the exact top-k at 32K keys spends 0.4-1.5 ms (of ~4) between its kernels (session 19), most of it
where the chunk waits for the flagged rows' `nonzero` and only then launches the decode select over them: the GPU
idles while Python launches. Here the first `cap` flagged rows are compacted on the device (a prefix sum and a
scatter, no sync), padded rows score one key, the decode select runs on all `cap` rows, and the results land in
the output's spare last row for the padded ones; the flagged count is copied to pinned host memory and read through
an event recorded before those launches, so the CPU goes on while the redo runs. More than `cap` flagged rows, or
enough for the tie path: the caller falls back to the synchronous path, which redoes every flagged row again (the
later writes win in stream order, so the rows are the synchronous path's). The default since session 20 (512 rows;
H200, 32K trained: whole top-k 4.48 -> 3.82 ms, results/2026-12-04-h200-session20.md)."""

from __future__ import annotations

from typing import Callable

import torch


def count_reader(count: torch.Tensor) -> Callable[[], int]:
    """A 0-d device count -> a function returning it as an int. CUDA: a non-blocking copy to pinned memory and an
    event recorded now, so reading waits for the count only, not for the work queued after this call."""
    if not count.is_cuda:
        return lambda: int(count)
    host = torch.empty((), dtype=count.dtype, pin_memory=True)
    host.copy_(count, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()

    def read() -> int:
        ev.synchronize()
        return int(host)

    return read


def redo_ahead(q_idx, w, k_idx, kvs, bad, t0: int, q_offset: int, topk: int, sink: int, window: int,
               out_full: torch.Tensor, cap: int) -> Callable[[], int]:
    """Exact rows, by the split-row decode select, of the first `cap` flagged rows of the chunk (bad `[1, Tc]`;
    q_idx `[1, T, H_I, D_I]`, w `[1, T, H_I]`, k_idx `[1, S, D_I]`), written into out_full `[1, T + 1, topk]` (row T:
    the padded rows' scratch). Returns the reader of the chunk's flagged count (`count_reader`)."""
    from sparse_rl.sparse.ops.indexer_topk.stream import decode_rows

    dev = bad.device
    flat = bad[0]
    read = count_reader(flat.sum())
    slot = torch.cumsum(flat, 0) - 1
    rows = torch.full((cap + 1,), -1, dtype=torch.int64, device=dev)  # slot cap: where the unkept rows scatter
    rows.scatter_(0, torch.where(flat & (slot < cap), slot, cap), torch.arange(flat.shape[0], device=dev))
    rows = rows[:cap]
    valid = rows >= 0
    tt = torch.where(valid, rows, 0) + t0
    pos = torch.where(valid, tt + q_offset, kvs[0].to(tt.dtype)).to(torch.int32)  # a padded row sees one key
    if k_idx.stride(-1) != 1:
        k_idx = k_idx.contiguous()
    res = decode_rows(q_idx, w, k_idx, kvs, 0, tt, pos, topk, sink, window)
    out_full[0].index_copy_(0, torch.where(valid, tt, out_full.shape[1] - 1), res)
    return read
