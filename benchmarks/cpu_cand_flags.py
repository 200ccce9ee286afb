"""Why the prefill top-k (`topk_impl="cand"`, cand_topk.py) redoes rows on the trained indexer, on the CPU.

The cand path keeps a row when its buffer of candidates (keys >= the row's sampled threshold, and the forced
ones) holds at least k keys and at most C = 2k; other rows are flagged and redone (~10 us a row on the H200:
252 rows ~1.2 ms of the 5.5 ms indexer + top-k at 32K trained, 3,166 rows ~19 ms of 54 at 128K; NOTES item 20).
This replays that rule in PyTorch on the same trained-indexer scores `bench attention` times (patterns.py, fp32
here, bf16 there), row by row, and classifies each flagged row:
- short: fewer than k candidates (the sample put the threshold too high);
- overflow: more than C candidates, split by whether the threshold is a value that many keys share exactly
  (a ReLU score of 0: every head's dot negative) - `tie_overflow` - or a sampling error.
Then the same counts for other rules, so a change is chosen on evidence before the GPU: E (the target in units
of k), and "ties apart" (candidates > th stored, the ties at th counted: a row flags only if the keys strictly
above th overflow or all of them plus the ties fall short).

    PYTHONPATH=$PWD python benchmarks/cpu_cand_flags.py --seqlen 32768 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def flags(scores: torch.Tensor, pos: torch.Tensor, K: int, C: int, R: int, E: float, sink: int, window: int):
    """For rows of scores `[n, S]` (queries at positions pos `[n]`, keys 0..pos visible), per row: the number
    of candidates under the cand rule, those strictly above the threshold, the threshold, and whether it is
    redone. Returns a dict of `[n]` tensors."""
    n, S = scores.shape
    keys = torch.arange(S)
    vis = keys[None, :] <= pos[:, None]
    forced = vis & ((keys[None, :] < sink) | (keys[None, :] > pos[:, None] - window))
    unf = vis & ~forced
    nvis = vis.sum(1)
    nf = forced.sum(1)
    kk = K - nf
    s = scores.masked_fill(~unf, float("-inf"))
    smp = s[:, ::R]  # keys j * R
    live = torch.isfinite(smp)
    ns = live.sum(1)
    m = torch.ceil(E * kk.float() * ns.float() / (nvis - nf).clamp(min=1).float()).long().clamp(min=1)
    srt = smp.sort(1, descending=True).values
    take = (ns > m) & (nvis > C)
    th = torch.where(take, srt.gather(1, (m - 1).clamp(max=srt.shape[1] - 1)[:, None])[:, 0],
                     torch.full((n,), float("-inf")))
    th = torch.where(kk <= 0, torch.full_like(th, float("inf")), th)
    above = ((s >= th[:, None]) & unf).sum(1) + nf  # candidates: visible keys >= th and the forced ones
    strict = ((s > th[:, None]) & unf).sum(1) + nf
    served = nvis > C  # rows with <= C visible keys take all: never flagged
    flagged = served & ((above > C) | (above < torch.clamp(nvis, max=K)))
    # ties apart: the keys strictly above th must fit, and with the ties reach k (the latest ties kept)
    flagged_ties = served & ((strict > C) | (above < torch.clamp(nvis, max=K)))
    return dict(above=above, strict=strict, th=th, flagged=flagged, flagged_ties=flagged_ties,
                short=served & (above < torch.clamp(nvis, max=K)), over=served & (above > C))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=200, help="indexer training steps (bench attention's default)")
    ap.add_argument("--targets", default="1.3,1.5")
    ap.add_argument("--rows", type=int, default=0, help="every n-th query row only (0: all)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    from sparse_rl.bench import patterns
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import CandConfig, sample_stride
    from sparse_rl.sparse.ops.indexer_topk.stream import stream_buffer_slots

    torch.manual_seed(0)
    t_start = time.time()
    dev = torch.device("cpu")
    gen = torch.Generator(device=dev).manual_seed(0)  # bench attention: one generator for the whole run
    ix, kl = patterns.train_indexer(dev, gen, steps=a.steps, crop=1024, log=print)
    L, K = a.seqlen, a.topk
    qi, w, ki = patterns.trained_index(ix, L, dev, gen)
    sink, window = min(4, K // 4), min(64, K // 2)
    C, R = stream_buffer_slots(K), sample_stride(CandConfig(), L)
    Es = [float(x) for x in a.targets.split(",")]
    rows = torch.arange(0, L, a.rows) if a.rows else torch.arange(L)
    res = {"seqlen": L, "topk": K, "C": C, "R": R, "trained_kl": kl, "rows": int(rows.numel()), "by_target": {}}
    acc = {E: {} for E in Es}
    zero_frac = []
    step = max(32, (1 << 24) // L)  # query rows a chunk: [rows, 4, L] fp32 dots stay ~256 MB
    for c0 in range(0, rows.numel(), step):
        pos = rows[c0:c0 + step]
        with torch.no_grad():
            dots = torch.einsum("thd,sd->ths", qi[0, pos].float(), ki[0].float()).relu()
            sc = torch.einsum("ths,th->ts", dots, w[0, pos].float())
        keys = torch.arange(L)
        vis = keys[None, :] <= pos[:, None]
        zero_frac.append(((sc == 0) & vis).sum(1).float() / vis.sum(1).float())
        for E in Es:
            f = flags(sc, pos, K, C, R, E, sink, window)
            for k2, v in f.items():
                acc[E].setdefault(k2, []).append(v)
        del dots, sc
    zf = torch.cat(zero_frac)
    res["zero_score_fraction"] = {"mean": float(zf.mean()), "p50": float(zf.median()), "max": float(zf.max())}
    for E in Es:
        f = {k2: torch.cat(v) for k2, v in acc[E].items()}
        fl = f["flagged"]
        tie_over = f["over"] & (f["strict"] <= C)  # overflow only through the ties at th
        res["by_target"][str(E)] = {
            "flagged": int(fl.sum()), "short": int(f["short"].sum()), "overflow": int(f["over"].sum()),
            "tie_overflow": int(tie_over.sum()), "flagged_ties_apart": int(f["flagged_ties"].sum()),
            "th_zero_among_flagged": int((fl & (f["th"] == 0)).sum()),
            "candidates_p50_p99": [float(f["above"][~fl].float().quantile(q)) for q in (0.5, 0.99)],
            "flagged_positions_sample": rows[fl][:20].tolist()}
        print(E, res["by_target"][str(E)])
    res["wall_s"] = round(time.time() - t_start, 1)
    print(json.dumps(res, indent=1))
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
