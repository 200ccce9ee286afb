"""How much MMA work the union tiles do on a trained indexer's token-level selection, on the CPU (no GPU): the bench's
indexer (`bench.patterns.train_indexer`, 150 steps, fp32) selects k = 2048 keys a query (sink 4, window 64, the
exact top-k of its scores by torch), then for tiles of 16 / 32 / 64 consecutive queries: union/pairs, the tiles'
MMA work over the selected pairs' (union x rows over pairs: masked pairs go through the MMA too), the keys every
query of a tile selected; and whether grouping a window's queries by overlap instead of position shrinks the unions
(greedy: each group grows by the query adding the fewest new keys).

    PYTHONPATH=$PWD python benchmarks/union_cpu_session22.py --seqlen 32768          # ~1 minute on 2 cores
    PYTHONPATH=$PWD python benchmarks/union_cpu_session22.py --seqlen 131072 --step 16  # ~10 minutes

Session 22 (results/2026-12-04-cpu-session22.md): 32K 16-query tiles 1.72x the pairs' work, 32-query 2.13x; the
greedy grouping within 64 / 256 queries no better than consecutive tiles.
"""

from __future__ import annotations

import argparse
import json

import torch

from sparse_rl.bench import patterns
from sparse_rl.bench.attention import mma_over_pairs


def exact_rows(qi, w, ki, K: int, sink: int, window: int, chunk: int = 1024) -> torch.Tensor:
    """`[L, K]` int32: the K best keys of each query by the indexer's fp32 scores, sink / window forced, -1 past
    the visible keys (the reference's rule; forced keys score +inf)."""
    L = qi.shape[1]
    keys = torch.arange(L)
    out = torch.empty(L, K, dtype=torch.int32)
    for t0 in range(0, L, chunk):
        t1 = min(L, t0 + chunk)
        s = (torch.einsum("thd,sd->ths", qi[0, t0:t1].float(), ki[0].float()).relu() * w[0, t0:t1, :, None].float()).sum(1)
        t = torch.arange(t0, t1)[:, None]
        s = torch.where((keys < sink) | (keys > t - window), float("inf"), s).masked_fill(keys > t, float("-inf"))
        vals, idx = s.topk(min(K, L), -1)
        out[t0:t1] = torch.where(vals > float("-inf"), idx, -1).to(torch.int32)
    return out


def tile_stats(rows: torch.Tensor, BT: int, step: int) -> dict:
    """union/pairs, MMA work over pairs (the bench's 32 / 8 heads) and the keys every query chose, over every
    `step`-th tile of BT queries."""
    u = c = p = 0
    for tile in range(0, rows.shape[0] // BT, step):
        r = rows[tile * BT:(tile + 1) * BT]
        keys, cnt = r[r >= 0].unique(return_counts=True)
        u, c, p = u + keys.numel(), c + int((cnt == BT).sum()), p + int((r >= 0).sum())
    return {"union_over_pairs": u / p, "mma_over_pairs": mma_over_pairs(u, p, BT, 32, 8), "common_over_union": c / u}


def grouping(rows: torch.Tensor, L: int, W: int, BT: int = 16, windows: int = 16) -> dict:
    """MMA work over pairs of consecutive tiles vs greedy groups of BT, in `windows` windows of W queries."""
    cons = greedy = pairs = 0
    for w0 in torch.linspace(L // 4, L - W, windows).long().tolist():
        r = rows[w0:w0 + W]
        m = torch.zeros(W, L)
        ok = r >= 0
        m[torch.arange(W)[:, None].expand_as(r)[ok], r[ok].long()] = 1
        pairs += float(m.sum())
        cons += sum(float(m[i:i + BT].amax(0).sum()) for i in range(0, W, BT))
        left = list(range(W))
        while left:
            grp_u = m[left.pop(0)].clone()
            for _ in range(BT - 1):
                if not left:
                    break
                j = int((m[left] * (1 - grp_u)).sum(1).argmin())
                grp_u = torch.maximum(grp_u, m[left.pop(j)])
            greedy += float(grp_u.sum())
    return {"window": W, "consecutive": mma_over_pairs(cons, pairs, BT, 32, 8),
            "greedy": mma_over_pairs(greedy, pairs, BT, 32, 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--step", type=int, default=4, help="every step-th tile counted")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    dev = torch.device("cpu")
    gen = torch.Generator().manual_seed(a.seed)
    ix, kl = patterns.train_indexer(dev, gen, steps=150, crop=1024)
    qi, w, ki = patterns.trained_index(ix, a.seqlen, dev, gen)
    rows = exact_rows(qi, w, ki, 2048, 4, 64)
    res = {"seqlen": a.seqlen, "indexer_kl": kl, "pairs": int((rows >= 0).sum()),
           "tiles": {bt: tile_stats(rows, bt, a.step) for bt in (16, 32, 64)},
           "grouping": [grouping(rows, a.seqlen, W) for W in (64, 256)]}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
