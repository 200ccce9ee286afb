"""Granular rows of `sparse-rl bench attention`: sparse prefill at a selection granularity
(docs/DESIGN.md "Selection granularity") against dense SDPA in the same run.

For each granularity (`kb16`: key blocks of 16 tokens, per-query selection; `g16`: 16 consecutive
queries share one token-level selection; `kb16g16`: both; `kb1`: token level, the indexer's own top-k) and each index input (`random`: the
benchmark's random index tensors; `trained`: the indexer trained in the same run, bench/patterns.py):
- select: the granular selection kernel (`ops.granular_topk`, indexer scores + block pooling + top-k,
  one row per group for query groups), the path `layer.select_rows` takes;
- attn: `ops.sparse_attention` over its rows (query groups: the shared-rows tile kernels), `auto` paths;
- prefill = select + attn in one call, and its speed-up over dense;
- fwd+bwd of that attention (and select + fwd + bwd) at the backward lengths, against dense fwd+bwd;
- union/pairs of the selection (tiles of the GQA-packed kernels), the attention's TFLOP/s counted on
  the selected pairs, and a check of the selection
  against the PyTorch reference on the last queries (rows equal exactly, key recall).
"""

from __future__ import annotations

import re

from sparse_rl.bench.timing import bench_ms, fmt, rel_err
from sparse_rl.errors import UsageError

_SPEC = re.compile(r"^(?:kb(\d+))?(?:g(\d+))?$")


def parse_granularity(spec: str) -> tuple[int, int]:
    """"kb16" -> (16, 1), "g16" -> (1, 16), "kb16g4" -> (16, 4); a UsageError naming the spec otherwise."""
    m = _SPEC.match(spec)
    if not spec or m is None:
        raise UsageError(f"granularity {spec!r}: expected kb<N>, g<N> or kb<N>g<M> (e.g. kb16, g16, kb16g16)")
    kb, g = int(m.group(1) or 1), int(m.group(2) or 1)
    if kb & (kb - 1) or g & (g - 1) or kb < 1 or g < 1:
        raise UsageError(f"granularity {spec!r}: key block and query group must be powers of two")
    return kb, g


def check_selection(rows, qi, wi, ki, topk: int, kw: dict, n: int) -> dict:
    """The kernel's rows (`[B, L, K]` per query, or one per group when kw's query_group > 1) against
    `granular_topk_naive` on the last n queries (n a multiple of the group): fraction of rows equal,
    recall of the reference's keys."""
    import torch

    from sparse_rl.sparse.ops import shared_to_per_query
    from sparse_rl.sparse.ops.indexer_topk.naive import granular_topk_naive

    L, G = qi.shape[1], kw["query_group"]
    per = shared_to_per_query(rows, G, L) if G > 1 else rows
    t0 = L - n
    ref = granular_topk_naive(qi[:, t0:].float(), wi[:, t0:].float(), ki.float(), topk, q_offset=t0,
                              history=(qi[:, :t0].float(), wi[:, :t0].float()), **kw)
    got = per[:, t0:]
    B = ref.shape[0]
    hit = torch.zeros((), dtype=torch.float64, device=ref.device)
    for b in range(B):  # recall: reference keys the kernel also chose
        for t in range(ref.shape[1]):
            r = ref[b, t][ref[b, t] >= 0]
            hit += torch.isin(r, got[b, t]).sum() if r.numel() else 0
    return {"select_rows_equal": float((ref == got).all(-1).double().mean()),
            "select_recall": float(hit) / max(1, int((ref >= 0).sum()))}


def _union_ratio(rows, S: int, H: int, H_kv: int, G: int, L: int) -> tuple[float, int]:
    """(union/pairs of the attention's tiles, selected (query, key) pairs)."""
    from sparse_rl.sparse.ops import shared_to_per_query
    from sparse_rl.sparse.ops.sparse_attention import union

    per = shared_to_per_query(rows, G, L) if G > 1 else rows
    n_pairs = max(1, int((per >= 0).sum()))
    BT = union.tile_queries(H // H_kv)
    if G > 1 and G % min(BT, G) == 0:
        return union.shared_tiles(rows, S, G, min(BT, G), bits=False).union_size() / n_pairs, n_pairs
    return union.build_union(per, S, BT).union_size() / n_pairs, n_pairs


def granular_rows(q, k, v, inputs: dict, specs: list[str], topk: int, sink: int, window: int, dev, W: dict,
                  dense_ms: float, dense_fwdbwd_ms: float | None = None, grad=None, check_n: int = 0,
                  select_fwdbwd: bool = True, topk_impl: str = "auto") -> list[dict]:
    """One result per (input, granularity). q `[B, L, H, D]`, k/v `[B, L, H_kv, D]`, inputs {name: (q_I
    `[B, L, H_I, d_I]`, w `[B, L, H_I]`, k_I `[B, L, d_I]`)}; grad `[B, L, H, D]` (with dense_fwdbwd_ms)
    times forward + backward (and, with select_fwdbwd, the selection + forward + backward in one call);
    check_n > 0 checks the selection on the last check_n queries; topk_impl: the granular block top-k
    (`granular.resolve_topk_impl`)."""
    from sparse_rl.sparse.ops import granular_topk, indexer_topk, sparse_attention

    B, L, H, D = q.shape
    out = []
    for src, (qi, wi, ki) in inputs.items():
        for spec in specs:
            kb, G = parse_granularity(spec)
            if topk - (G - 1) - sink - window < kb:  # e.g. a tiny smoke-test top-k: said in the row, not timed
                out.append({"seqlen": L, "input": src, "granularity": spec, "skipped": f"top-k {topk} leaves no "
                            f"whole block of {kb} after sink {sink}, window {window} and the group of {G}"})
                continue
            kw = dict(sink=sink, window=window, key_block=kb, query_group=G, block_score="max")
            akw = {"query_group": G, "key_block": kb} if G > 1 else {}

            def select():
                if kb == G == 1:  # token level: the indexer's own top-k (what `layer.select` takes)
                    return indexer_topk(qi, wi, ki, topk, sink=sink, window=window, backend="triton")
                return granular_topk(qi, wi, ki, topk, shared=G > 1, backend="triton", topk_impl=topk_impl, **kw)

            rows = select()
            r: dict = {"seqlen": L, "input": src, "granularity": spec, "key_block": kb, "query_group": G,
                       "topk_impl": "indexer" if kb == G == 1 else topk_impl}
            r["select_ms"] = bench_ms(select, dev, **W)
            r["attn_ms"] = bench_ms(lambda: sparse_attention(q, k, v, rows, backend="triton", **akw), dev, **W)
            r["prefill_ms"] = bench_ms(lambda: sparse_attention(q, k, v, select(), backend="triton", **akw), dev, **W)
            r["dense_ms"] = dense_ms
            r["prefill_speedup"] = dense_ms / r["prefill_ms"]
            r["union_ratio"], r["pairs"] = _union_ratio(rows, k.shape[1], H, k.shape[2], G, L)
            r["attn_tflops"] = 4.0 * r["pairs"] * H * D / r["attn_ms"] / 1e9  # on selected pairs
            if dense_fwdbwd_ms is not None and grad is not None:
                qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
                r["fwdbwd_ms"] = bench_ms(
                    lambda: sparse_attention(qg, kg, vg, rows, backend="triton", **akw)[0].backward(grad), dev,
                    grad_to_none=[qg, kg, vg], **W)
                r["dense_fwdbwd_ms"] = dense_fwdbwd_ms
                r["fwdbwd_speedup"] = dense_fwdbwd_ms / r["fwdbwd_ms"]
                if select_fwdbwd:
                    r["select_fwdbwd_ms"] = bench_ms(
                        lambda: sparse_attention(qg, kg, vg, select(), backend="triton", **akw)[0].backward(grad),
                        dev, grad_to_none=[qg, kg, vg], **W)
                    r["select_fwdbwd_speedup"] = dense_fwdbwd_ms / r["select_fwdbwd_ms"]
                del qg, kg, vg
            if check_n:
                n = max(G, check_n // G * G)
                r.update(check_selection(rows, qi, wi, ki, topk, kw, min(n, L // G * G)))
                r.update(check_output(q, k, v, rows, G, min(n, L)))
            out.append(r)
    return out


def granular_stages(qi, wi, ki, topk: int, spec: str, sink: int, window: int, dev, W: dict,
                    impls: tuple[str, ...] = ("radix", "threshold")) -> dict:
    """Where a granular selection's time goes, each stage alone over all rows in one launch (random or
    trained index inputs `[B, L, ...]`, no left padding): the block-score kernel (fp32 scores; on CUDA
    also at the score sweep's 64 x 128-key, 8-warp tile), the block top-k in each form
    (`granular.top_blocks`: `impls`, the first the one the others must equal), the row assembly (torch vs the Triton kernel, which must
    agree), and the whole chunked selection (`ops.granular_topk`) with each top-k form, which must give
    equal rows."""
    import torch

    from sparse_rl.sparse.ops import granular_topk
    from sparse_rl.sparse.ops.indexer_topk import granular as gr
    from sparse_rl.sparse.ops.indexer_topk.naive import group_plan, rep_queries

    kb, G = parse_granularity(spec)
    B, L = qi.shape[:2]
    start, _, ev_pos, ev_rep, _, q_all, w_all, j = group_plan(qi, wi, 0, None, G, None)
    qr, wr = rep_queries(q_all, w_all, j)
    nbc = -(-L // kb)
    nb = min(nbc, (topk - (G - 1) - sink - window) // kb)
    kw = dict(key_block=kb, sink=sink, window=window, block_score="max")
    res = {"seqlen": L, "granularity": spec, "rows": int(ev_rep.shape[1]), "blocks_per_row": nbc,
           "blocks_kept": nb, "auto_impl": gr.resolve_topk_impl("auto", nbc, prefill=True)}
    res["block_scores_ms"] = bench_ms(lambda: gr.block_keys(qr, wr, ki, ev_rep, start, nbc, keys=False, **kw),
                                      dev, **W)
    if dev.type == "cuda":  # the token-level score sweep's tile (64 x 128 keys, 8 warps: 358-403 TF/s)
        alt = (64, max(128, kb), 8)
        res["block_scores_64x128w8_ms"] = bench_ms(
            lambda: gr.block_keys(qr, wr, ki, ev_rep, start, nbc, keys=False, launch=alt, **kw), dev, **W)
    x = gr.block_keys(qr, wr, ki, ev_rep, start, nbc, keys=False, **kw)
    for impl in impls:
        res[f"top_{impl}_ms"] = bench_ms(lambda: gr.top_blocks(x, nb, impl), dev, **W)
    blocks = gr.top_blocks(x, nb, impls[0])
    for impl in impls[1:]:
        res[f"top_{impls[0]}_equals_{impl}"] = bool(torch.equal(blocks, gr.top_blocks(x, nb, impl)))
    del x
    akw = dict(key_block=kb, query_group=G, sink=sink, window=window)
    res["assemble_torch_ms"] = bench_ms(lambda: gr.assemble_rows(blocks, ev_pos, ev_rep, start, topk, **akw), dev, **W)
    res["assemble_triton_ms"] = bench_ms(
        lambda: gr.assemble_rows_triton(blocks, ev_pos, ev_rep, start, topk, **akw), dev, **W)
    res["assemble_equal"] = bool(torch.equal(gr.assemble_rows(blocks, ev_pos, ev_rep, start, topk, **akw),
                                             gr.assemble_rows_triton(blocks, ev_pos, ev_rep, start, topk, **akw)))
    del blocks
    sel = {}
    for impl in impls:
        def run(impl=impl):
            return granular_topk(qi, wi, ki, topk, shared=G > 1, topk_impl=impl, backend="triton", **akw)
        res[f"select_{impl}_ms"] = bench_ms(run, dev, **W)
        sel[impl] = run()
    res["select_impls_equal"] = all(torch.equal(sel[impls[0]], sel[i]) for i in impls[1:])
    res["index_score_tflop"] = 2.0 * B * res["rows"] * L / 2 * qi.shape[2] * qi.shape[3] / 1e12
    return res


def check_output(q, k, v, rows, G: int, n: int) -> dict:
    """The attention over the granular rows against the float32 reference on the last n queries."""
    from sparse_rl.sparse.ops import shared_to_per_query, sparse_attention
    from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive

    L = q.shape[1]
    per = shared_to_per_query(rows, G, L) if G > 1 else rows
    o, _ = sparse_attention(q, k, v, rows, backend="triton", **({"query_group": G} if G > 1 else {}))
    ro, _ = sparse_attention_naive(q[:, L - n:].float(), k.float(), v.float(), per[:, L - n:])
    return {"attn_out_rel_err": rel_err(o[:, L - n:], ro)}


def markdown_granular(rows: list[dict]) -> list[str]:
    """The granular table's lines (empty without granular rows)."""
    if not rows:
        return []
    lines = ["", "Granular selection (docs/DESIGN.md \"Selection granularity\"): select = granular indexer + "
             "top-k kernel; prefill = select + sparse attention over its rows (query groups: shared rows); "
             "speed-ups against dense SDPA in the same run", "",
             "| L | input | granularity | select ms | attn ms | attn TF/s | prefill ms | dense ms | prefill speedup "
             "| union/pairs | fwd+bwd ms | fwd+bwd speedup | select+fwd+bwd speedup | rows equal ref | recall vs ref |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if "skipped" not in r):
        g = r.get
        lines.append("| " + " | ".join(fmt(x) for x in (
            r["seqlen"], r["input"], r["granularity"], g("select_ms"), g("attn_ms"), g("attn_tflops"), g("prefill_ms"),
            g("dense_ms"), g("prefill_speedup"), g("union_ratio"), g("fwdbwd_ms"), g("fwdbwd_speedup"),
            g("select_fwdbwd_speedup"), g("select_rows_equal"), g("select_recall"))) + " |")
    return lines


def granularity_cost(ix, teacher: dict, L: int, specs: list[str], topk: int, sink: int, window: int, dev,
                     generator=None, n: int = 256) -> list[dict]:
    """What a granularity costs in attention kept: on fresh synthetic hidden states of length L, each spec's
    selection (`ops.granular_topk`; kb1: the indexer's token top-k) of the trained indexer `ix`, scored on
    the last n queries against the teacher's causal attention (`patterns.teacher_probs`): recall = the
    teacher mass on the selected keys (mean, p10), and -log(recall), the KL from the attention renormalised
    on the selection to the full one (mean); beside them the oracle's (the teacher's own top-k per query).
    Since the indexer itself may miss the teacher, each row also says what the granularity costs against the
    token-level selection of the same indexer: index_mass, the indexer's own softmax mass on the selection,
    and kb1_kept, the share of the token-level top-k's keys the selection keeps."""
    import torch

    from sparse_rl.bench import patterns
    from sparse_rl.sparse.ops import granular_topk, indexer_scores, indexer_topk, shared_to_per_query

    x = patterns.synthetic_hidden(L, 128, dev, generator)
    qi, wi, ki = patterns.trained_index(ix, L, dev, generator, hidden=x)
    p = patterns.teacher_probs(teacher, x, L - n)[0]  # [n, L]
    pi = torch.softmax(indexer_scores(qi[:, L - n:].float(), wi[:, L - n:].float(), ki.float(), q_offset=L - n)[0], -1)
    tok = indexer_topk(qi, wi, ki, topk, sink=sink, window=window, backend="triton")[0, L - n:].long()
    tok_set = torch.zeros(n, L, dtype=torch.bool, device=dev)
    tok_set.scatter_(1, tok.clamp(min=0), tok >= 0)
    out = []

    def mass_on(dist, idx, ok):
        return torch.where(ok, dist.gather(1, idx.clamp(min=0)), 0.0).sum(-1).clamp(max=1.0)

    def scored(name: str, per) -> dict:
        idx = per[0, L - n:].long()
        ok = idx >= 0
        mass = mass_on(p, idx, ok)
        kept = torch.where(ok, tok_set.gather(1, idx.clamp(min=0)), False).sum(-1).double()
        return {"seqlen": L, "granularity": name, "queries": n, "recall_mean": float(mass.mean()),
                "recall_p10": float(mass.quantile(0.1)), "kl_renorm_mean": float((-mass.clamp(min=1e-30).log()).mean()),
                "index_mass_mean": float(mass_on(pi, idx, ok).mean()),
                "kb1_kept": float(kept.sum() / (tok >= 0).sum().clamp(min=1)),
                "keys_mean": float(ok.sum(-1).double().mean())}

    for spec in specs:
        kb, G = parse_granularity(spec)
        if kb == G == 1:
            rows = indexer_topk(qi, wi, ki, topk, sink=sink, window=window, backend="triton")
        else:
            rows = granular_topk(qi, wi, ki, topk, shared=G > 1, backend="triton", sink=sink, window=window,
                                 key_block=kb, query_group=G, block_score="max")
        out.append(scored(spec, shared_to_per_query(rows, G, L) if G > 1 else rows))
    oracle = p.topk(min(topk, L), -1).indices
    pad = torch.full((1, L, oracle.shape[1]), -1, dtype=torch.long, device=dev)
    pad[0, L - n:] = torch.where(torch.gather(p, 1, oracle) > 0, oracle, -1)
    out.append(scored("oracle", pad))
    return out
