"""One device call for selection granularity (issue 15, item 4): correctness on the GPU first, then
the granular prefill rows of `sparse-rl bench attention` at 32K and 128K within a time budget.

    PYTHONPATH=. python benchmarks/gpu_granular_session5.py --out $OUT/gran2 [--budget-s 240] [--seqlens 32768 131072]

Order (so a short budget keeps what matters most): selection checks, engine checks (CUDA graphs of
granular configs: enabled by this branch), attention checks, then 32K rows (started below 70% of the
budget), then 128K (below 55%); each input's rows below 90%, each stage breakdown below 95%. One
file, granular.json, rewritten after every phase, so a run cut by an outer timeout keeps its results.

Checks (before any timing):
- the granular selection kernel (`ops/indexer_topk/granular.py`) against `granular_topk_naive` on the
  GPU, exactly: integer-valued bf16 index inputs (every score exact in fp32 whatever the summation
  order, many ties), odd sizes, left padding, key_block 1/4/16/64 x query_group 1/4/16, max and mean;
  on random bf16 inputs the fraction of equal rows and the key recall (summation order may split
  near-ties there);
- `layer.select_rows` + `layer.attend` (query groups: shared rows) against the reference attention over
  the per-query rows, forward and q/k/v gradients, fp32, GQA 1/4/7, odd T;
- the rollout engine's decode with CUDA graphs (now allowed for granular configs) against the same
  engine without graphs, greedy tokens equal (`engine_checks`).
Timings (bf16, B = 1, 32 heads, 8 KV heads, D = 128, k = 2048, index 4 x 64, sink 4, window 64):
`bench.granular.granular_rows` for kb16, g16 and kb16g16 on random index inputs and on an indexer
trained here (bench/patterns.py), against the fastest dense SDPA of the same run; fwd+bwd at 32K only.
Then, per length and granularity on the random inputs, where the selection's time goes
(`stage_times`: the block-score kernel alone, the whole selection with each top-k form, "keys",
"threshold", "radix" and what "auto" takes, which must all give equal rows). Writes $OUT/granular.json (+ log lines on stdout) and
prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from sparse_rl.bench import patterns
from sparse_rl.bench.attention import best_dense, dense_variants
from sparse_rl.bench.granular import granular_rows, markdown_granular, parse_granularity
from sparse_rl.bench.timing import bench_ms, rel_err
from sparse_rl.sparse.config import SparseConfig
from sparse_rl.sparse.layer import LayerState, attend, select, select_rows
from sparse_rl.sparse.ops import granular_topk
from sparse_rl.sparse.ops.indexer_topk.naive import granular_topk_naive
from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive

DEV = torch.device("cuda")
SHAPE = (1, 32, 8, 128, 2048)  # B, heads, KV heads, head dim, top-k (docs/BENCHMARKS.md)
TRAIN = (150, 1024)  # steps and crop of the trained-pattern indexer
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def _index(B, T, HI, DI, g, exact):
    if exact:
        def mk(*s):
            return torch.randint(-2, 3, s, device=DEV, generator=g).to(torch.bfloat16)
    else:
        def mk(*s):
            return torch.randn(*s, device=DEV, generator=g).to(torch.bfloat16)
    return mk(B, T, HI, DI), mk(B, T, HI), mk(B, T, DI)


def selection_checks(T: int = 1037, K: int = 256, sink: int = 4, window: int = 64) -> list[dict]:
    g = torch.Generator(device=DEV).manual_seed(0)
    out = []
    for exact in (True, False):
        q, w, k = _index(2, T, 4, 64, g, exact)
        for kb in (1, 4, 16, 64):
            for G in (1, 4, 16) if exact else (1, 16):
                for score in ("max", "mean") if exact or kb == 16 else ("max",):
                    for ks in (None, torch.tensor([0, 77], device=DEV)):
                        kw = dict(sink=sink, window=window, key_block=kb, query_group=G, block_score=score,
                                  kv_start=ks)
                        ref = granular_topk_naive(q.float(), w.float(), k.float(), K, **kw)
                        got = granular_topk(q, w, k, K, backend="triton", **kw)
                        eq = float((ref == got).all(-1).double().mean())
                        hit = sum(int(torch.isin(ref[b, t][ref[b, t] >= 0], got[b, t]).sum())
                                  for b in range(2) for t in range(0, T, 37))
                        tot = sum(int((ref[b, t] >= 0).sum()) for b in range(2) for t in range(0, T, 37))
                        out.append({"exact_inputs": exact, "key_block": kb, "query_group": G, "score": score,
                                    "left_pad": ks is not None, "rows_equal": eq, "recall_every_37th_row":
                                    hit / max(1, tot)})
                        if exact and eq != 1.0:
                            log(f"MISMATCH exact inputs kb={kb} G={G} {score} left_pad={ks is not None}: {eq}")
    return out


def attention_checks(T: int = 301, K: int = 128) -> list[dict]:
    g = torch.Generator(device=DEV).manual_seed(1)
    out = []
    for H, Hkv in ((8, 8), (8, 2), (7, 1)):
        for kb, G in ((16, 1), (1, 16), (4, 8)):
            B, D = 2, 64
            cfg = SparseConfig(topk=K, sink=4, window=16, key_block=kb, query_group=G, index_heads=4, index_dim=64)
            st = LayerState(cfg=cfg, dense_layer=False, mode="sparse", backend="triton")
            qi, wi, ki = (x.float() for x in _index(B, T, 4, 64, g, False))
            q = torch.randn(B, T, H, D, device=DEV, generator=g)
            k, v = (torch.randn(B, T, Hkv, D, device=DEV, generator=g) for _ in range(2))
            sel = select_rows(st, q, k, (qi, wi, ki))
            per = select(st, q, k, (qi, wi, ki))
            qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
            o, _ = attend(st, sel, qs, ks, vs)
            go = torch.randn_like(o)
            (o * go).sum().backward()
            qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
            ro, _ = sparse_attention_naive(qr, kr, vr, per)
            (ro * go).sum().backward()
            o, ro = o.detach(), ro.detach()
            out.append({"H": H, "H_kv": Hkv, "key_block": kb, "query_group": G, "shared_rows": sel.query_group > 1,
                        "rows_equal_per_query": bool(torch.equal(sel.per_query(T), per)),
                        "out_rel_err": rel_err(o, ro), "dq_rel_err": rel_err(qs.grad, qr.grad),
                        "dk_rel_err": rel_err(ks.grad, kr.grad), "dv_rel_err": rel_err(vs.grad, vr.grad)})
    return out


def engine_checks() -> list[dict]:
    """The rollout engine's decode with CUDA graphs (granular configs are captured now) against the same
    engine without graphs: greedy tokens equal, graphs really used (no graph_error), on a tiny
    converted qwen2 whose top-k is below the contexts (so the granular decode select runs)."""
    import tempfile
    from pathlib import Path

    from sparse_rl.modelinit import ModelInitConfig, init_model
    from sparse_rl.rl.rollout import RolloutEngine, SamplingParams
    from sparse_rl.sparse.convert import ConvertConfig, convert
    from sparse_rl.sparse.layer import set_granularity
    from sparse_rl.sparse.loader import load_model

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        init_model(root / "dense", ModelInitConfig(arch="qwen2", size="tiny", seed=1))
        sc = SparseConfig(topk=64, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=4, dense_layers=[0])
        convert(root / "dense", root / "sparse", ConvertConfig(sparse=sc, seed=3))
        model = load_model(root / "sparse", attention="sparse", device=str(DEV))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (70, 131, 95, 200)]
        for kb, G in ((16, 1), (1, 16), (4, 4)):
            set_granularity(model, kb, G)
            toks = {}
            for graphs in (False, True):
                eng = RolloutEngine(model, None, max_batch=4, max_seq_len=512, eos_token_ids=[],
                                    use_cuda_graphs=graphs, compile=False)
                res = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=48))
                toks[graphs] = [c.tokens for c in res]
                if graphs:
                    err, n_graphs = eng.runner.graph_error, len(eng.runner._graphs)
            out.append({"key_block": kb, "query_group": G, "tokens_equal": toks[True] == toks[False],
                        "graph_error": err, "graphs_captured": n_graphs})
            log(str(out[-1]))
    return out


def stage_times(qi, wi, ki, K: int, kb: int, G: int, W: dict) -> dict:
    """Where the selection's time goes (random inputs, all rows in one launch): the block-score kernel
    alone (int64 keys / fp32 scores out), and the whole selection with each top-k form."""
    from sparse_rl.sparse.ops.indexer_topk import granular as gr

    B, L = qi.shape[:2]
    rep = torch.arange(0, L, G, device=DEV)[None].expand(B, -1).contiguous()
    qr, wr = qi[:, ::G].contiguous(), wi[:, ::G].contiguous()
    start = torch.zeros(B, 1, dtype=torch.long, device=DEV)
    nbc = -(-L // kb)
    kw = dict(key_block=kb, sink=4, window=64, block_score="max")
    res = {"seqlen": L, "key_block": kb, "query_group": G}
    for keys in (True, False):
        res[f"block_kernel_{'keys' if keys else 'scores'}_ms"] = bench_ms(
            lambda: gr.block_keys(qr, wr, ki, rep, start, nbc, keys=keys, **kw), DEV, **W)
    sel = {}
    for impl in gr.TOPK_IMPLS:
        def run(impl=impl):
            return granular_topk(qi, wi, ki, K, sink=4, window=64, key_block=kb, query_group=G, shared=G > 1,
                                 topk_impl=impl, backend="triton")
        res[f"select_{impl}_ms"] = bench_ms(run, DEV, **W)
        sel[impl] = run()
    res["auto_impl"] = gr.resolve_topk_impl("auto", nbc)
    res["impls_equal"] = all(torch.equal(sel["keys"], x) for x in sel.values())
    res["index_score_tflop"] = 2.0 * B * (L / G) * L / 2 * qi.shape[2] * qi.shape[3] / 1e12
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--specs", nargs="+", default=["kb16", "g16", "kb16g16"])
    ap.add_argument("--rep-ms", type=int, default=40)
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "budget_s": a.budget_s,
           "engine_ok": None, "attention_ok": None}
    os.makedirs(a.out, exist_ok=True)

    def save():  # after every phase, atomically: a run cut short by its timeout keeps what it measured
        tmp = os.path.join(a.out, "granular.json.tmp")
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, os.path.join(a.out, "granular.json"))

    log("selection checks")
    res["selection_checks"] = selection_checks()
    res["selection_exact_ok"] = all(c["rows_equal"] == 1.0 for c in res["selection_checks"] if c["exact_inputs"])
    log(f"selection exact on integer inputs: {res['selection_exact_ok']}")
    save()
    log("engine: CUDA graphs vs eager decode, granular configs")
    try:
        res["engine_checks"] = engine_checks()
        res["engine_ok"] = all(c["tokens_equal"] and c["graph_error"] is None and c["graphs_captured"] > 0
                               for c in res["engine_checks"])
    except Exception as e:  # reported, and the timings still run
        res["engine_checks"], res["engine_ok"] = f"{type(e).__name__}: {e}", False
    log(f"engine graphs ok: {res['engine_ok']}")
    save()
    log("attention checks")
    res["attention_checks"] = attention_checks()
    res["attention_ok"] = all(c["rows_equal_per_query"] and max(c[x] for x in c if x.endswith("rel_err")) < 1e-3
                              for c in res["attention_checks"])
    log(f"attention + gradients vs reference: {res['attention_ok']}")
    save()
    W = dict(warmup_ms=10, rep_ms=a.rep_ms)
    gen = torch.Generator(device=DEV).manual_seed(0)
    log("training the trained-pattern indexer")
    ix, kl = patterns.train_indexer(DEV, gen, steps=TRAIN[0], crop=TRAIN[1])
    res["trained_indexer_kl"] = kl
    rows, skipped, stages = [], [], []
    B, H, Hkv, D, K = SHAPE
    for L in a.seqlens:
        if time.time() - T0 > a.budget_s * (0.55 if L > 32768 else 0.7):
            skipped.append(f"L={L}: over budget before it started ({time.time() - T0:.0f} s)")
            continue
        log(f"L={L}: inputs + dense")
        rnd = lambda *s: torch.randn(*s, device=DEV, dtype=torch.bfloat16, generator=gen)  # noqa: E731
        q, k, v = rnd(B, L, H, D), rnd(B, L, Hkv, D), rnd(B, L, Hkv, D)
        inputs = {"random": (rnd(B, L, 4, 64), torch.rand(B, L, 4, device=DEV, generator=gen).to(torch.bfloat16),
                             rnd(B, L, 64)),
                  "trained": patterns.trained_index(ix, L, DEV, gen)}
        qd, kd, vd = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        label, _, _, _, dense_all = best_dense(qd, kd, vd, lambda f: bench_ms(f, DEV, **W))
        fb = {}
        if L <= 32768:
            gd = torch.randn_like(qd)
            for lab, fn, kk, vv in dense_variants(qd, kd, vd):
                qq, kk, vv = (x.detach().requires_grad_() for x in (qd, kk, vv))
                fb[lab] = bench_ms(lambda: fn(qq, kk, vv).backward(gd), DEV, grad_to_none=[qq, kk, vv], **W)
            del gd, qq, kk, vv
        kw = {}
        if fb:
            kw = dict(dense_fwdbwd_ms=min(fb.values()), grad=torch.randn_like(q))
        for src in list(inputs):
            if time.time() - T0 > a.budget_s * 0.9:
                skipped.append(f"L={L} {src}: over budget ({time.time() - T0:.0f} s)")
                continue
            log(f"L={L}: granular rows on {src} inputs")
            got = granular_rows(q, k, v, {src: inputs[src]}, a.specs, K, 4, 64, DEV, W, dense_all[label],
                                check_n=64, **kw)
            for r in got:
                r["dense_label"] = label
                log(", ".join(f"{x}={y:.4g}" if isinstance(y, float) else f"{x}={y}" for x, y in r.items()))
            rows += got
            res["rows"] = rows
            save()
        if time.time() - T0 < a.budget_s * 0.9:
            for spec in a.specs:
                kb, G = parse_granularity(spec)
                log(f"L={L}: selection stages {spec}")
                if time.time() - T0 > a.budget_s * 0.95:
                    skipped.append(f"L={L} stages {spec}: over budget")
                    continue
                stages.append(stage_times(*inputs["random"], K, kb, G, W))
                res["stages"] = stages
                log(str(stages[-1]))
                save()
        del q, k, v, qd, kd, vd, inputs, kw
        torch.cuda.empty_cache()
    res["rows"], res["stages"], res["skipped"], res["wall_s"] = rows, stages, skipped, time.time() - T0
    res["markdown"] = "\n".join(markdown_granular(rows))
    save()
    print(f"selection exact: {res['selection_exact_ok']}  attention ok: {res['attention_ok']}  "
          f"engine graphs ok: {res['engine_ok']}  "
          f"skipped: {skipped}  wall {res['wall_s']:.0f} s")
    print(res["markdown"])
    for st in stages:
        print(st)


if __name__ == "__main__":
    main()
