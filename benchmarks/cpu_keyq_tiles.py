"""What the key-major dk/dv pass (`keyq.py`) would gather and compute at other key-tile sizes, on the CPU.

The keyq dk/dv pass runs one program a (key tile of BN keys, KV head) over the tile's query list: every query that
selected a key of the tile has its q / dO rows (4 heads x D 128 x 2 B each) gathered once for that tile, and its
S / dP / dV / dK MMAs span all BN keys of the tile, selected or not. So its gather bytes scale with the touched
(key tile, query) pairs and its MMA work with pairs x BN. This replays the bench's trained indexer (patterns.py,
as `bench attention` trains it: 150 steps, crop 1024) and its exact top-k (sink 4, window 64) in PyTorch, and
counts, for BN = 64 / 128: touched pairs, selected keys a touched tile, and the MMA keys a query; and for the
forward's union tiles (BT queries): the union's MMA work over the selected pairs. The counts are the selection's,
not a GPU's (session 30: 2.32 M pairs at BN 64 and MMA / pairs 1.715 at BT 16 here, against the H100's 2.33 M and
1.73 for the bf16 GPU run).

    PYTHONPATH=$PWD python benchmarks/cpu_keyq_tiles.py --seqlen 32768 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def exact_topk(qi, w, ki, K: int, sink: int = 4, window: int = 64, chunk: int = 512) -> torch.Tensor:
    """The indexer's top-K `[L, K]` int64 (-1 where fewer keys are visible): scores sum_h w_h relu(q_h . k),
    causal, the sink and window keys forced in; qi `[1, L, H_I, d]`, w `[1, L, H_I]`, ki `[1, L, d]`."""
    L = qi.shape[1]
    idx = torch.empty(L, K, dtype=torch.int64)
    ar = torch.arange(L)
    for s in range(0, L, chunk):
        e = min(L, s + chunk)
        sc = (torch.einsum("thd,sd->ths", qi[0, s:e].float(), ki[0].float()).relu()
              * w[0, s:e].float()[..., None]).sum(1)
        future = ar[None, :] > ar[s:e, None]
        sc[future] = float("-inf")
        sc[((ar[None, :] < sink) | (ar[s:e, None] - ar[None, :] < window)) & ~future] = float("inf")
        v, i = sc.topk(min(K, L), dim=1)
        idx[s:e] = torch.where(v == float("-inf"), -1, i)
    return idx


def touched_pairs(idx: torch.Tensor, BN: int) -> int:
    """(key tile of BN keys, query) pairs with at least one selected key."""
    tiles = torch.where(idx >= 0, idx // BN, -1)
    n = 0
    for s in range(0, idx.shape[0], 2048):
        srt = tiles[s:s + 2048].sort(1).values
        n += int(((srt[:, 1:] != srt[:, :-1]) & (srt[:, 1:] >= 0)).sum() + (srt[:, 0] >= 0).sum())
    return n


def union_work(idx: torch.Tensor, BT: int) -> int:
    """Sum over BT-query tiles of |union of their selections| x BT (the union tile forward's MMA rows x keys)."""
    return sum(int(torch.unique(r[r >= 0]).numel()) * BT for r in idx.split(BT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    from sparse_rl.bench import patterns

    t0 = time.time()
    dev = torch.device("cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    ix, kl = patterns.train_indexer(dev, gen, index_heads=4, index_dim=64, steps=150, crop=1024)
    qi, w, ki = patterns.trained_index(ix, a.seqlen, dev, gen, 128)
    idx = exact_topk(qi, w, ki, a.topk)
    sel = int((idx >= 0).sum())
    res = {"seqlen": a.seqlen, "topk": a.topk, "indexer_kl": kl, "selected_pairs": sel, "keyq": {}, "union": {}}
    for BN in (64, 128):
        n = touched_pairs(idx, BN)
        res["keyq"][BN] = {"touched_pairs": n, "per_query": n / a.seqlen, "selected_per_touched_tile": sel / n,
                           "mma_keys_per_query": n * BN / a.seqlen}
    for BT in (16, 32):
        res["union"][BT] = {"mma_over_pairs": union_work(idx, BT) / sel}
    res["wall_s"] = time.time() - t0
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
