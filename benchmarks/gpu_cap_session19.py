"""Session 19 (issue 15): register caps for the latency-bound sparse attention kernels, on the H200.

Reading before the call (ncu, call 5 of this session, `results/2026-12-04-h200-ncu-session19.txt`): the 16-query
union-tile forward at 32K trained (`union._tile_fwd_kernel`, (32, 4, 3), 7.49 ms) issues on 54% of cycles with
0.97 eligible warps a scheduler; L2 39%, L1 44%, DRAM 3% of peak; 152 registers = 3 programs (12 warps) an SM,
the register file the occupancy limit (shared memory allows 4). So it is latency-bound, not bandwidth- or
MMA-bound. ptxas (Triton 3.6, sm_90a, the launch's specialisations): capped at 128 registers it spills 44 B
(4 programs an SM); (16, 4, 4) needs 135 (127 capped, no spill). Variants: the cap at (32, 4, 3), (32, 4, 2),
(32, 4, 4); (16, 4, 4) with and without; (64, 4, 2) at 168 (3 programs). The backward's two largest kernels
(the keyq dk/dv pass, 8 warps at 255 registers = 1 program an SM; the tile dq, (128, 8, 2)) with caps, in a
fwd+bwd through `auto`.

Predictions: forward 32K trained 7.5 -> ~6.3-7.0 ms at (32, 4, 3, cap 128) (16 warps an SM, +33% warps, some of it
lost to the spills); (16, 4, 4) capped within +-5% of it; 128K alike (-7 to -15%); fwd+bwd: keyq capped at 128 (2
programs an SM) -5 to +20% (heavy spills likely), dq capped at 128 -5 to +10%.

Call 1 outcome (9cfc0f8; whole attention through `auto`, union build included; every capped launch bit-equal):
32K default 9.18 ms, cap128 8.87, (32, 4, 2) cap 128 **7.97**, (32, 4, 4) cap 128 8.81, (16, 4, 4) 11.99 / capped
10.52, (64, 4, 2) cap 168 9.16, cap 136 9.50; 128K 41.23 / 39.99 / **38.74** / 39.69 / 55.27 / 47.39 / 42.78 / 43.38.
The backward's caps lose badly: fwd+bwd 34.9 ms default, keyq capped 128 66.2 / 168 42.7, dq capped 128 61.3 / 168
48.0. So the 64-row per-query tiles' default is (32, 4, 2) capped at 128 now.

Call 2: prefill (top-k + attention) in three interleaved reps, the old launch (32, 4, 3), the new default and (32, 4,
2) uncapped (149 registers, 3 programs an SM); then the CLI's `bench attention`. Predictions: prefill 32K ~12.8 ->
~11.6-12.0 ms (1.2-1.26x dense), 128K ~69 -> ~66-67 (3.9x); (32, 4, 2) uncapped within 3% of (32, 4, 3).

Call 2 outcome (8d585e5): prefill 32K old 1.10-1.12x, default 1.20-1.21x (attention 9.13-9.18 -> 8.06-8.09 ms),
uncapped (32, 4, 2) 1.17x; 128K 3.81-3.86x -> 4.04-4.08x (attention 41.8 -> 37.5-38.2). CLI at 8d585e5: 32K 1.22x
(12.08 ms), 128K 4.05x (64.5 ms), trained fwd+bwd 33.08 ms = 1.69x.

Call 3: call 1's dq caps ran (128, 8, 2) on the 16-query tiles that `auto` gives a keyq backward (their default is
(64, 4, 2): 241 registers and 98.5 KB of shared memory, 2 programs an SM), so the dq question is open: (32, 4, 2) (181
registers, 65.7 KB: shared memory allows 3) uncapped, capped at 168 (3) and 128 (3, 100 B spills), in a fwd+bwd at
32K trained. And `auto`'s BT 16 vs 32 on the 32K block pattern (forward only), forced by tune "bt", since the capped
64-row forward makes NS_TILE_FWD_64 (0.135) stale. Predictions: dq (32, 4, 2, 168) -3 to -8% of the dq pass (fwd+bwd
~33 -> ~32.3-32.8 ms); block pattern: BT 16 within +-5% of BT 32 (session 12: 4.28 vs 4.01 ms kernel).

Call 3 outcome: fwd+bwd default 33.72 / 33.53 ms (two reps), dq (32, 4, 2) 36.29 / 35.84, capped 168 33.77 / 33.62,
capped 128 34.43 / 34.36: no dq launch beats the default. Block pattern forward: auto 5.47 / 5.55 ms, BT 16 6.08 /
6.08, BT 32 5.45 / 5.47: auto keeps BT 32 there, rightly, so NS_TILE_FWD_64 stays.

Call 4: the union bitmap without the atomics of bits an earlier row of the tile set (`union._bitmap_kernel`
DEDUPE: read at L2 first), alone and in the whole attention, 3 interleaved reps. Predictions: bitmap at 32K
trained (BT 16) 0.76 -> ~0.25-0.4 ms, 128K ~3 -> ~1-1.5; whole attention 32K 7.97 -> ~7.5-7.7, 128K 38.7 -> ~37-37.5.

    PYTHONPATH=$PWD python benchmarks/gpu_cap_session19.py --out $OUT/cap19 [--call 1|2|3|4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from granular_harness import log, trained_indexer  # noqa: E402

FWD = {"default": None, "cap128": (32, 4, 3, 0, 0, 1, 128), "s2-cap128": (32, 4, 2, 0, 0, 1, 128),
       "s4-cap128": (32, 4, 4, 0, 0, 1, 128), "k16-s4": (16, 4, 4, 0, 0, 1, 0), "k16-s4-cap128": (16, 4, 4, 0, 0, 1, 128),
       "k64-s2-cap168": (64, 4, 2, 0, 0, 1, 168), "cap136": (32, 4, 3, 0, 0, 1, 136)}
BWD = {"default": {}, "keyq-cap128": {"keyq": (64, 128, 8, 3, 128)}, "keyq-cap168": {"keyq": (64, 128, 8, 3, 168)},
       "dq-cap128": {"dq": (128, 8, 2, 128)}, "dq-cap168": {"dq": (128, 8, 2, 168)}}


PREFILL = {"old": (32, 4, 3, 0, 0, 1), "default": None, "s2": (32, 4, 2, 0, 0, 1)}


def prefill(ix, gen, L, dev, W) -> dict:
    """Top-k + attention (the forward `auto` runs without a backward) vs dense, per launch, 3 interleaved reps."""
    from granular_harness import dense_times

    from sparse_rl.bench import patterns
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import indexer_topk_cand
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention_forward

    qi, wi, ki = patterns.trained_index(ix, L, dev, gen)
    g = torch.Generator(device=dev).manual_seed(7)
    q, k, v = (torch.randn(1, L, h, 128, device=dev, generator=g).to(torch.bfloat16) for h in (32, 8, 8))
    r = {"seqlen": L, **dense_times(q, k, v, dev, W, False)}

    def sel():
        return indexer_topk_cand(qi, wi, ki, 2048, sink=4, window=64)

    rows = sel()
    for rep in range(3):
        for lab, t in PREFILL.items():
            tune = {} if t is None else {"fwd": t}
            with torch.no_grad():
                tt = {"attn_ms": bench_ms(lambda: sparse_attention_forward(q, k, v, rows, tune=tune), dev, **W),
                      "prefill_ms": bench_ms(lambda: sparse_attention_forward(q, k, v, sel(), tune=tune), dev, **W)}
            tt["speedup"] = r["dense_ms"] / tt["prefill_ms"]
            r.setdefault(lab, []).append(tt)
    log(f"prefill {L}: {r}")
    return r


def inputs(ix, gen, L, dev):
    """The trained indexer's rows at L (the default top-k) and random bf16 q `[1, L, 32, 128]`, k / v `[1, L, 8, 128]`."""
    from sparse_rl.bench import patterns
    from sparse_rl.sparse.ops.indexer_topk.cand_topk import indexer_topk_cand

    qi, wi, ki = patterns.trained_index(ix, L, dev, gen)
    rows = indexer_topk_cand(qi, wi, ki, 2048, sink=4, window=64)
    g = torch.Generator(device=dev).manual_seed(7)
    q, k, v = (torch.randn(1, L, h, 128, device=dev, generator=g).to(torch.bfloat16) for h in (32, 8, 8))
    return rows, q, k, v


def fwd_bwd(leaves, rows, go, tune, refs, dev, W):
    """One fwd+bwd through `auto` with `tune`: (ms, largest gradient rel. difference to refs, refs: the first
    call's gradients when refs is None)."""
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention

    qg, kg, vg = leaves

    def fb():
        qg.grad = kg.grad = vg.grad = None
        sparse_attention(qg, kg, vg, rows, tune=tune)[0].backward(go)

    fb()
    torch.cuda.synchronize()
    grads = [x.grad.float() for x in leaves]
    refs = grads if refs is None else refs
    err = max(float((gr - rf).norm() / rf.norm()) for gr, rf in zip(grads, refs))
    return bench_ms(fb, dev, **W), err, refs


DQ3 = {"default": {}, "dq32": {"dq": (32, 4, 2)}, "dq32-168": {"dq": (32, 4, 2, 168)},
       "dq32-128": {"dq": (32, 4, 2, 128)}}


def call3(ix, gen, dev, W) -> dict:
    from sparse_rl.bench.attention import block_pattern, block_pattern_indices
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention_forward

    L = 32768
    rows, q, k, v = inputs(ix, gen, L, dev)
    g = torch.Generator(device=dev).manual_seed(8)
    out = {"fwd_bwd": {}, "block_fwd": {}}
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    go = torch.randn_like(q)
    refs = None
    for rep in range(2):
        for lab, tune in DQ3.items():
            ms, err, refs = fwd_bwd((qg, kg, vg), rows, go, tune, refs, dev, W)
            out["fwd_bwd"].setdefault(lab, []).append({"ms": ms, "rel_diff_vs_default": err})
            log(f"fwd+bwd {lab}: {out['fwd_bwd'][lab][-1]}")
    del qg, kg, vg, refs
    fb_, cnt = block_pattern(L, 128, 2048 // 128, dev, g)
    bidx = block_pattern_indices(fb_, cnt, L, 128, 2048)
    for rep in range(2):
        for lab, tune in {"auto": {}, "bt16": {"bt": 16}, "bt32": {"bt": 32}}.items():
            with torch.no_grad():
                ms = bench_ms(lambda: sparse_attention_forward(q, k, v, bidx, tune=tune), dev, **W)
            out["block_fwd"].setdefault(lab, []).append(ms)
            log(f"block fwd {lab}: {ms:.3f}")
    return out


def call4(ix, gen, dev, W) -> dict:
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.sparse_attention import union
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention_forward

    out = {}
    for L in (32768, 131072):
        rows, q, k, v = inputs(ix, gen, L, dev)
        r = {"equal_bits": bool(torch.equal(union._bitmap(rows, L, 16, True), union._bitmap(rows, L, 16, False)))}
        with torch.no_grad():
            ref = sparse_attention_forward(q, k, v, rows)[0]
        for rep in range(3):
            for dd in (False, True):
                lab = "dedupe" if dd else "atomics"
                union._bitmap.__defaults__ = (dd,)  # the A/B: every caller of _bitmap takes the default
                t = {"bitmap_ms": bench_ms(lambda: union._bitmap(rows, L, 16), dev, **W)}
                with torch.no_grad():
                    t["attn_ms"] = bench_ms(lambda: sparse_attention_forward(q, k, v, rows), dev, **W)
                    t["equal_out"] = bool(torch.equal(sparse_attention_forward(q, k, v, rows)[0], ref))
                r.setdefault(lab, []).append(t)
        union._bitmap.__defaults__ = (True,)
        log(f"L{L}: {r}")
        out[str(L)] = r
        del q, k, v, rows, ref
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cap19"))
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--call", type=int, default=4, choices=(1, 2, 3, 4))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    from sparse_rl.bench.timing import bench_ms
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention_forward

    dev = torch.device("cuda")
    W = dict(warmup_ms=25, rep_ms=80)
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "commit": a.commit, "rows": {}}
    ix, kl, gen = trained_indexer(dev, 0, 4, 64, 150)
    res["trained_indexer_kl"] = kl

    def save():
        with open(os.path.join(a.out, "cap19.json"), "w") as f:
            json.dump(res, f, indent=1)

    if a.call in (3, 4):
        res["rows"] = call3(ix, gen, dev, W) if a.call == 3 else call4(ix, gen, dev, W)
        res["wall_s"] = time.time() - t0
        save()
        return
    if a.call == 2:
        for L in (32768, 131072):
            res["rows"][str(L)] = prefill(ix, gen, L, dev, W)
            save()
        res["wall_s"] = time.time() - t0
        save()
        return
    for L in (32768, 131072):
        rows, q, k, v = inputs(ix, gen, L, dev)
        r = {"fwd": {}}
        ref = None
        for lab, t in FWD.items():
            tune = {} if t is None else {"fwd": t}
            try:
                with torch.no_grad():
                    o = sparse_attention_forward(q, k, v, rows, tune=tune)[0]
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = o.float()
                    err = float((o.float() - ref).norm() / ref.norm())
                    ms = bench_ms(lambda: sparse_attention_forward(q, k, v, rows, tune=tune), dev, **W)
                r["fwd"][lab] = {"ms": ms, "rel_diff_vs_default": err, "tune": t}
            except Exception as e:  # noqa: BLE001 (a launch that fails is a result)
                r["fwd"][lab] = {"error": repr(e)[:300], "tune": t}
            log(f"L{L} fwd {lab}: {r['fwd'][lab]}")
        save()
        if L == 32768:
            r["fwd_bwd"] = {}
            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
            go = torch.randn_like(q)
            refs = None
            for lab, tune in BWD.items():
                try:
                    ms, err, refs = fwd_bwd((qg, kg, vg), rows, go, tune, refs, dev, W)
                    r["fwd_bwd"][lab] = {"ms": ms, "rel_diff_vs_default": err, "tune": tune}
                except Exception as e:  # noqa: BLE001
                    r["fwd_bwd"][lab] = {"error": repr(e)[:300], "tune": tune}
                log(f"L{L} fwd+bwd {lab}: {r['fwd_bwd'][lab]}")
            del qg, kg, vg, refs
        res["rows"][str(L)] = r
        save()
        del q, k, v, rows, ref
        torch.cuda.empty_cache()
    res["wall_s"] = time.time() - t0
    save()
    log(f"done in {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
