"""`sparse-rl bench attention`: sparse prefill (indexer + top-k + sparse attention) against dense SDPA
and FlexAttention block-sparse, in one run, with correctness checks against the float32 reference.

Shapes follow docs/BENCHMARKS.md: batch 1, 32 query heads, 8 KV heads, head dim 128, k = 2048, 4 index
heads of 64 dims, bf16. Index patterns timed for the sparse attention kernels (`--patterns`):
- `indexer`: the Triton indexer's top-k on random inputs, i.e. independent random keys per query
  (the worst case for locality: every query gathers its own 2048 rows per KV head);
- `block`: the FlexAttention selection written as token indices (16 blocks of 128 keys per query
  block, causal diagonal), so the token-level kernel and FlexAttention compute the same attention;
  also timed as a shared selection (`query_group` = block size: one row per query block, no union);
- `local`: sinks + local window + shared retrieval spans + per-query noise (bench/patterns.py);
- `trained`: the top-k of an indexer trained in the same run on synthetic data (bench/patterns.py); its
  token-level prefill is also timed end to end (the trained indexer's scores -> the default top-k -> the
  `auto` attention: `trained_prefill_ms`, with union/pairs), the measure issue 15's targets name.
Granular rows (`granular`, bench/granular.py): prefill at key_block / query_group granularities (the
granular selection kernel + the attention over its rows) on the random and the trained index inputs.
Each pattern prints union/pairs (the tiles' union over the selected pairs: lower = more sharing),
every forward path, the path `auto` took, and TFLOP/s counted on selected pairs.
Times are medians of `triton.testing.do_bench` (CUDA events, L2 flushed between repeats).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from sparse_rl.bench import patterns
from sparse_rl.bench.granular import granular_rows, markdown_granular, parse_granularity
from sparse_rl.bench.timing import bench_ms, device_name, fmt, rel_err, table_title
from sparse_rl.errors import UsageError


@dataclass
class BenchAttentionConfig:
    seqlens: list[int] = field(default_factory=lambda: [8192, 16384, 32768, 65536, 131072])
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    topk: int = 2048
    index_heads: int = 4
    index_dim: int = 64
    block_size: int = 128  # FlexAttention block (and the `block` index pattern)
    backward_seqlens: list[int] = field(default_factory=lambda: [32768])
    flex: bool = True
    flex_min_seqlen: int = 32768  # each sequence length costs one FlexAttention compile
    patterns: list[str] = field(default_factory=lambda: ["indexer", "block", "local", "trained"])
    trained_steps: int = 200  # training steps of the `trained` pattern's indexer
    granular: list[str] = field(default_factory=lambda: ["kb16", "g16"])  # bench/granular.py specs
    check: bool = True
    check_queries: int = 256  # rows compared with the float32 reference at each length
    dtype: str = "bfloat16"
    warmup_ms: int = 25
    rep_ms: int = 100
    seed: int = 0
    device: str = "auto"


# ----------------------------------------------------------------------------------------- helpers

def dense_variants(q, k, v, causal: bool = True):
    """Dense SDPA candidates in `[B, H, L, D]` layout: on CUDA the flash and cuDNN backends, each with
    GQA through `enable_gqa` and with K/V repeated beforehand (outside the timed region); those that
    run are yielded as (label, fn(q, k, v) -> out, k, v). The benchmark keeps the fastest."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    G = q.shape[1] // k.shape[1]
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
    rep = None
    for backend in backends:
        for gqa in ([True, False] if G > 1 else [False]):
            if not gqa and G > 1:
                if rep is None:
                    rep = (k.repeat_interleave(G, 1).detach(), v.repeat_interleave(G, 1).detach())
                kk, vv = rep
            else:
                kk, vv = k, v

            def run(q_, k_, v_, backend=backend, gqa=gqa):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=gqa)

            try:
                run(q[:, :, :16], kk[:, :, :16], vv[:, :, :16])
            except RuntimeError:
                continue
            label = f"sdpa-{backend.name.lower().replace('_attention', '')}" + ("-gqa" if gqa else "-repkv" if G > 1 else "")
            yield label, run, kk, vv


def best_dense(q, k, v, bench, causal: bool = True):
    """Time every dense variant with `bench(fn)`; returns (best label, fn, k, v, {label: ms})."""
    times, best = {}, None
    for label, fn, kk, vv in dense_variants(q, k, v, causal):
        times[label] = bench(lambda: fn(q, kk, vv))
        if best is None or times[label] < times[best[0]]:
            best = (label, fn, kk, vv)
    if best is None:
        raise UsageError("no dense SDPA backend ran on this device")
    return (*best, times)


def block_pattern(L: int, block: int, nsel: int, device, generator=None):
    """Random block-sparse causal selection: each query block keeps its diagonal block plus up to
    nsel-1 random earlier blocks. Returns (full `[nqb, nsel-1]` sorted earlier blocks, counts `[nqb]`)."""
    import torch

    nqb = L // block
    r = torch.rand(nqb, nqb, device=device, generator=generator)
    earlier = torch.ones(nqb, nqb, dtype=torch.bool, device=device).tril(-1)
    r = torch.where(earlier, r, -1.0)
    m = max(1, min(nsel - 1, nqb))
    vals, idx = r.topk(m, dim=-1)
    cnt = earlier.sum(-1).clamp(max=nsel - 1)
    big = nqb + 1
    idx = torch.where(vals >= 0, idx, big).sort(-1).values
    return idx, cnt


def block_pattern_indices(full_blocks, cnt, L: int, block: int, topk: int):
    """The block selection as token indices `[1, L, topk]` int32 (ascending, -1 padded)."""
    import torch

    nqb, m = full_blocks.shape
    dev = full_blocks.device
    ar = torch.arange(block, device=dev)
    valid = full_blocks < nqb
    tok = torch.where(valid[..., None], full_blocks[..., None] * block + ar, -1).flatten(1)  # [nqb, m*block]
    diag = torch.arange(nqb, device=dev)[:, None] * block + ar  # [nqb, block]
    t = torch.arange(L, device=dev)
    rows = torch.cat([tok, diag], 1)  # earlier blocks ascending, then the diagonal block
    rows = rows.repeat_interleave(block, 0)[:L]  # [L, (m+1)*block]
    rows = torch.where(rows <= t[:, None], rows, -1)
    # push -1 to the end, keep ascending order
    big = torch.iinfo(torch.int32).max
    rows = torch.where(rows < 0, big, rows).sort(-1).values
    rows = torch.where(rows == big, -1, rows).to(torch.int32)
    if rows.shape[1] < topk:
        rows = torch.cat([rows, rows.new_full((L, topk - rows.shape[1]), -1)], 1)
    return rows[None, :, :topk].contiguous()


def flex_block_mask(full_blocks, cnt, L: int, block: int):
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    nqb, m = full_blocks.shape
    dev = full_blocks.device
    full_idx = torch.zeros(1, 1, nqb, nqb, dtype=torch.int32, device=dev)
    full_idx[0, 0, :, :m] = torch.where(full_blocks < nqb, full_blocks, 0).to(torch.int32)
    diag_idx = torch.zeros(1, 1, nqb, nqb, dtype=torch.int32, device=dev)
    diag_idx[0, 0, :, 0] = torch.arange(nqb, dtype=torch.int32, device=dev)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return BlockMask.from_kv_blocks(
        torch.ones(1, 1, nqb, dtype=torch.int32, device=dev), diag_idx,
        cnt.to(torch.int32).view(1, 1, nqb), full_idx, BLOCK_SIZE=block, mask_mod=causal, seq_lengths=(L, L))


def pairs(indices) -> int:
    return int((indices >= 0).sum())


# ----------------------------------------------------------------------------------------- checks

def check_attention(q, k, v, idx, n: int, **kw) -> dict:
    """Both forward paths (per-query and GQA-packed tiles) vs the float32 reference on the last n
    queries, outputs poisoned with NaN before each run (every element must be overwritten).
    `kw` (query_group, q_offset) describes a shared selection."""
    import torch

    from sparse_rl.sparse.ops import shared_to_per_query
    from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention_forward

    B, L, H, D = q.shape
    sl = slice(L - n, L)
    per = shared_to_per_query(idx, kw["query_group"], L, kw.get("q_offset", 0)) if kw.get("query_group", 1) > 1 else idx
    ro, rl = sparse_attention_naive(q[:, sl].float(), k.float(), v.float(), per[:, sl])
    fin = torch.isfinite(rl)
    res = {}
    for path in ("query", "tile"):
        o = torch.full((B, L, H, D), float("nan"), device=q.device, dtype=q.dtype)
        ls = torch.full((B, L, H), float("nan"), device=q.device, dtype=torch.float32)
        sparse_attention_forward(q, k, v, idx, fwd_path=path, out=(o, ls), **kw)
        res[f"{path}_out_rel_err"] = rel_err(o[:, sl], ro)
        res[f"{path}_lse_max_abs_err"] = float((ls[:, sl][fin] - rl[fin]).abs().max())
        res[f"{path}_nan_free"] = bool(torch.isfinite(o).all() and not torch.isnan(ls).any())
        del o, ls
    return res


def time_pattern(q, k, v, idx, dev, W, prefix: str, **kw) -> dict:
    """Forward time of each path, of building the union and of the tile kernel alone, the path `auto`
    takes and its estimate, union/pairs and TFLOP/s on selected pairs, for one index pattern.
    `kw` (query_group, q_offset, key_block) describes a shared selection (then nothing is built)."""
    from sparse_rl.sparse.ops import shared_to_per_query
    from sparse_rl.sparse.ops.sparse_attention import union
    from sparse_rl.sparse.ops.sparse_attention.tl_utils import dot_precision
    from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention_forward

    B, L, H, D = q.shape
    G = H // k.shape[2]
    S = k.shape[1]
    shared = kw.get("query_group", 1) > 1
    per = shared_to_per_query(idx, kw["query_group"], L, kw.get("q_offset", 0)) if shared else idx
    n_pairs = pairs(per)
    flop = 4.0 * n_pairs * H * D
    res = {f"{prefix}_pairs": n_pairs}
    if shared:
        sel = union.shared_tiles(idx, S, kw["query_group"], union.tile_queries(G), kw.get("q_offset", 0))
    else:
        BT = union.tile_queries(G)
        sel = union.build_union(idx, S, BT)
        res[f"{prefix}_union_build_ms"] = bench_ms(lambda: union.build_union(idx, S, BT), dev, **W)
        res[f"{prefix}_query_path_ms"] = bench_ms(lambda: sparse_attention_forward(q, k, v, idx, fwd_path="query"),
                                                  dev, **W)
    res[f"{prefix}_union_ratio"] = sel.union_size() / max(1, n_pairs)
    prec = dot_precision(q.dtype)
    res[f"{prefix}_tile_kernel_ms"] = bench_ms(lambda: union.tile_fwd(q, k, v, sel, 1 / math.sqrt(D), prec), dev, **W)
    res[f"{prefix}_auto_ms"] = bench_ms(lambda: sparse_attention_forward(q, k, v, idx, **kw), dev, **W)
    plan = sparse_attention_forward(q, k, v, idx, **kw)[2]
    res[f"{prefix}_auto_path"] = f"{plan.fwd}/{plan.bwd}/{plan.dq}"
    res[f"{prefix}_estimate_ms"] = {a: round(b, 3) for a, b in plan.estimate_ms.items()}
    res[f"{prefix}_tile_kernel_tflops"] = flop / res[f"{prefix}_tile_kernel_ms"] / 1e9
    res[f"{prefix}_auto_tflops"] = flop / res[f"{prefix}_auto_ms"] / 1e9
    return res


def mma_over_pairs(ukeys: float, n_pairs: int, BT: int, H: int, H_kv: int) -> float:
    """The union tiles' MMA work over the selected pairs': each (tile of BT queries, KV head) multiplies its
    BM = next_pow2(BT * G) rows (G = H / H_kv) by every key of its union, selected or masked; ukeys: the unions'
    sizes summed over tiles, n_pairs: the selected (query, key) pairs."""
    import triton

    BM = max(16, triton.next_power_of_2(BT * (H // H_kv)))
    return ukeys * BM * H_kv / max(1, n_pairs * H)


def tile_floor(indices, S: int, H: int, H_kv: int, D: int, BT: int, dense_ms: float, dense_tflops: float,
               scores_ms: float | None) -> dict:
    """What the GQA-packed forward's design allows on one selection, from numbers of the same run: the tiles' MMA
    work (each (tile of BT queries, KV head) multiplies its BM = next_pow2(BT * G) rows by every key of its union,
    selected or masked) over the selected pairs' work, that work at dense SDPA's measured TF/s (the attention's
    time if the tile kernel ran as fast per MMA FLOP as dense), plus the streamed score sweep alone (the top-k at
    no cost beyond its scores): a floor for this tiling, not for the card (a tiling with less masked work, or a
    kernel faster per FLOP than cuDNN, would go below it). indices `[B, T, K]` per-query rows."""
    from sparse_rl.sparse.ops.sparse_attention import union

    n = pairs(indices)
    ukeys = float(union.union_sizes(indices, S, BT).sum())
    waste = mma_over_pairs(ukeys, n, BT, H, H_kv)
    attn = waste * 4.0 * n * H * D / (dense_tflops * 1e9)
    res = {"tile_queries": BT, "union_ratio": ukeys / max(1, n), "mma_over_pairs": waste, "attn_floor_ms": attn}
    if scores_ms is not None:
        res["prefill_floor_ms"] = scores_ms + attn
        res["floor_speedup"] = dense_ms / res["prefill_floor_ms"]
    return res


def time_fwdbwd(q, k, v, idx, g, dev, W, prefix: str, **kw) -> dict:
    """Forward + backward time with each backward path (the forward as `auto` picks it)."""
    from sparse_rl.sparse.ops import sparse_attention

    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    res = {}
    for bwd in ("atomic", "tile", "auto") if dev.type == "cuda" else ("auto",):  # the CPU: a smoke test
        res[f"{prefix}_fwdbwd_{bwd}_ms"] = bench_ms(
            lambda: sparse_attention(qg, kg, vg, idx, backend="triton", bwd_path=bwd, **kw)[0].backward(g), dev,
            grad_to_none=[qg, kg, vg], **W)
    return res


def check_indexer(q_idx, w, k_idx, sel, topk: int, n: int) -> dict:
    """Selected sets vs the float32 reference scores on the last n queries: the sorted scores of the
    kernel's choice must equal the reference top-k scores (ties may pick different keys)."""
    import torch

    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_scores_naive

    B, L = q_idx.shape[:2]
    t0 = L - n
    ref = indexer_scores_naive(q_idx[:, t0:].float(), w[:, t0:].float(), k_idx.float(), t0=t0)  # [B, n, L]
    top = ref.topk(min(topk, L), -1).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    got = torch.gather(ref, 2, sel[:, t0:].clamp(min=0).long())
    got = torch.where(sel[:, t0:] >= 0, got, torch.zeros_like(got)).sort(-1, descending=True).values
    ok_range = bool(((sel >= -1) & (sel < L)).all())
    counts = (sel[:, t0:] >= 0).sum(-1)
    want = torch.clamp(torch.arange(t0, L, device=sel.device) + 1, max=topk)
    return {"score_rel_err": rel_err(got, top[..., :got.shape[-1]]), "in_range": ok_range,
            "counts_ok": bool((counts == want).all())}


def check_backward(device, dtype, heads: int, kv_heads: int, head_dim: int, L: int = 4096, topk: int = 512,
                   seed: int = 0, bwd_path: str = "auto") -> dict:
    """dq/dk/dv of the Triton kernel vs autograd through the float32 reference (random indices)."""
    import torch

    from sparse_rl.sparse.ops import indexer_topk, sparse_attention
    from sparse_rl.sparse.ops.sparse_attention.naive import sparse_attention_naive

    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, L, heads, head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, L, kv_heads, head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, L, kv_heads, head_dim, device=device, dtype=dtype, generator=g)
    idx = indexer_topk(torch.randn(1, L, 4, 64, device=device, dtype=dtype, generator=g),
                       torch.rand(1, L, 4, device=device, dtype=dtype, generator=g),
                       torch.randn(1, L, 64, device=device, dtype=dtype, generator=g), topk, sink=4, window=64,
                       backend="triton")
    go = torch.randn(1, L, heads, head_dim, device=device, dtype=dtype, generator=g)
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    out, _ = sparse_attention(qs, ks, vs, idx, backend="triton", bwd_path=bwd_path)
    out.backward(go)
    qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
    ro, _ = sparse_attention_naive(qr, kr, vr, idx)
    ro.backward(go.float())
    res = {f"{n}_rel_err": rel_err(a.grad, b.grad) for n, a, b in (("dq", qs, qr), ("dk", ks, kr), ("dv", vs, vr))}
    res["nan_free"] = all(bool(torch.isfinite(t.grad).all()) for t in (qs, ks, vs))
    res["shape"] = f"L={L} k={topk} H={heads} H_kv={kv_heads} D={head_dim}"
    return res


# ----------------------------------------------------------------------------------------- bench

def bench_setup(cfg):
    """Device and dtype of a kernel benchmark, with the checks both benchmarks share."""
    import os

    import torch

    from sparse_rl.devices import resolve_device, resolve_dtype

    dev = torch.device(resolve_device(cfg.device))
    if cfg.heads % cfg.kv_heads:
        raise UsageError(f"--heads {cfg.heads} must be a multiple of --kv-heads {cfg.kv_heads}")
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET", "") != "1":
        raise UsageError("bench on a CPU needs TRITON_INTERPRET=1 (Triton kernels run in the interpreter)")
    return dev, resolve_dtype(cfg.dtype, dev.type)


def run_attention_bench(cfg: BenchAttentionConfig, log=print) -> dict:
    """Time and check every kernel at each sequence length; returns {"config", "device", "rows", ...}."""
    import torch

    from sparse_rl.sparse.ops import indexer_topk, sparse_attention
    from sparse_rl.sparse.ops.indexer_topk import triton as it

    dev, dtype = bench_setup(cfg)
    for spec in cfg.granular:
        parse_granularity(spec)
    B, H, Hkv, D, K = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.topk
    HI, DI = cfg.index_heads, cfg.index_dim
    W = dict(warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms)
    rows, checks, gran_rows = [], [], []
    flex = None
    if cfg.flex and dev.type == "cuda":
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    gen = torch.Generator(device=dev).manual_seed(cfg.seed)
    bidx = None
    trained = None
    for L in cfg.seqlens:
        log(f"L={L}: inputs")
        rnd = lambda *s: torch.randn(*s, device=dev, dtype=dtype, generator=gen)  # noqa: E731
        q, k, v = rnd(B, L, H, D), rnd(B, L, Hkv, D), rnd(B, L, Hkv, D)
        qi, ki = rnd(B, L, HI, DI), rnd(B, L, DI)
        wi = torch.rand(B, L, HI, device=dev, dtype=dtype, generator=gen)
        row: dict = {"seqlen": L}
        # dense
        qd, kg0, vg0 = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        label, dense, kd, vd, dense_all = best_dense(qd, kg0, vg0, lambda f: bench_ms(f, dev, **W))
        row["dense_label"] = label
        row["dense_all_ms"] = dense_all
        row["dense_ms"] = dense_all[label]
        dense_flops = 2.0 * B * H * D * L * L  # causal: half of 4*L^2*H*D
        row["dense_tflops"] = dense_flops / row["dense_ms"] / 1e9
        # indexer: the default (streaming) indexer + top-k against the streamed score dots alone (row
        # maxima, no selection), then the materialising path's parts: its score kernel writing [T, S]
        # fp32 chunks, and its selects alone on real score chunks
        from sparse_rl.sparse.ops.indexer_topk.stream import indexer_row_max

        idx = indexer_topk(qi, wi, ki, K, backend="triton")
        row["indexer_topk_ms"] = bench_ms(lambda: indexer_topk(qi, wi, ki, K, backend="triton"), dev, **W)
        row["indexer_rowmax_ms"] = bench_ms(lambda: indexer_row_max(qi, wi, ki), dev, **W)
        row["indexer_topk_over_scores"] = row["indexer_topk_ms"] / row["indexer_rowmax_ms"]
        kvs = torch.zeros(B, dtype=torch.int32, device=dev)
        chunk = max(1, min(L, it.SCORE_BUDGET_BYTES // (4 * B * L))) if dev.type == "cuda" else L
        bounds = [(t0, min(L, t0 + chunk)) for t0 in range(0, L, chunk)]
        buf = torch.empty(B, chunk, L, device=dev, dtype=torch.float32)

        def scores_only():
            for t0, t1 in bounds:
                it.indexer_scores_chunk(qi, wi, ki, kvs, t0, t1, t1, 0, 0, 0, out=buf[:, :t1 - t0, :t1])

        row["indexer_scores_ms"] = bench_ms(scores_only, dev, **W)
        t0l, t1l = bounds[-1]
        it.indexer_scores_chunk(qi, wi, ki, kvs, t0l, t1l, t1l, 0, 0, 0, out=buf[:, :t1l - t0l, :t1l])

        from sparse_rl.sparse.ops.indexer_topk.radix_topk import radix_topk

        def topk_only(impl):
            for t0, t1 in bounds:  # real scores of the last chunk, viewed at each chunk's shape
                if impl == "radix":
                    radix_topk(buf[:, :t1 - t0, :t1], K, q_lim=t0)
                else:
                    it.topk_from_scores(buf[:, :t1 - t0, :t1], K)

        row["topk_ms"] = bench_ms(lambda: topk_only("radix"), dev, **W)  # the materialising path, rows <= 32K
        row["topk_torch_ms"] = bench_ms(lambda: topk_only("torch"), dev, **W)
        del buf
        row["indexer_tflops"] = 2.0 * B * L * L / 2 * HI * DI / row["indexer_scores_ms"] / 1e9
        # sparse attention, indexer pattern
        n_pairs = pairs(idx)
        row["avg_keys"] = n_pairs / (B * L)
        row["sparse_attn_ms"] = bench_ms(lambda: sparse_attention(q, k, v, idx, backend="triton"), dev, **W)
        row["sparse_attn_tflops"] = 4.0 * n_pairs * H * D / row["sparse_attn_ms"] / 1e9
        row["sparse_prefill_ms"] = bench_ms(
            lambda: sparse_attention(q, k, v, indexer_topk(qi, wi, ki, K, backend="triton"), backend="triton"),
            dev, **W)
        row["prefill_speedup"] = row["dense_ms"] / row["sparse_prefill_ms"]
        row["attn_speedup"] = row["dense_ms"] / row["sparse_attn_ms"]
        if cfg.check and dev.type == "cuda":
            c = check_attention(q, k, v, idx, min(cfg.check_queries, L))
            c.update({f"indexer_{a}": b for a, b in check_indexer(qi, wi, ki, idx, K, min(64, L)).items()})
            checks.append({"seqlen": L, "pattern": "indexer", **c})
        # every pattern: (name, indices, kwargs of a shared selection)
        pats = []
        if "indexer" in cfg.patterns:
            pats.append(("idx", idx, {}))
        nsel = max(1, K // cfg.block_size)
        fb = cnt = None
        if "block" in cfg.patterns and L % cfg.block_size == 0:
            fb, cnt = block_pattern(L, cfg.block_size, nsel, dev, gen)
            bidx = block_pattern_indices(fb, cnt, L, cfg.block_size, K)
            row["block_attn_ms"] = bench_ms(lambda: sparse_attention(q, k, v, bidx, backend="triton"), dev, **W)
            row["block_attn_tflops"] = 4.0 * pairs(bidx) * H * D / row["block_attn_ms"] / 1e9
            # the same selection, one row per query block: what a block-granular selector emits, with its
            # key-block hint, so `auto` can take the block kernels (blocks.py) as a key_block model does
            shared_rows = bidx[:, cfg.block_size - 1::cfg.block_size].contiguous()
            pats += [("blk", bidx, {}), ("blkshared", shared_rows, {"query_group": cfg.block_size,
                                                                    "key_block": cfg.block_size})]
        if "local" in cfg.patterns:
            pats.append(("local", patterns.local_retrieval(L, K, dev, gen), {}))
        if "trained" in cfg.patterns:
            if trained is None:
                log("training the `trained` pattern's indexer")
                steps = cfg.trained_steps if dev.type == "cuda" else min(cfg.trained_steps, 3)  # CPU: smoke test
                trained = patterns.train_indexer(dev, gen, steps=steps, crop=min(1024, L), log=log)
                row["trained_indexer_kl"] = trained[1]
            # the trained indexer's inputs, then its default top-k (what trained_selection does, same RNG use),
            # kept for the end-to-end row below: scores -> top-k -> the auto attention, the measure
            tix = patterns.trained_index(trained[0], L, dev, gen)
            tkw = dict(sink=min(4, K // 4), window=min(64, K // 2))
            tsel = indexer_topk(*tix, K, **tkw)
            pats.append(("trained", tsel, {}))
            row["trained_indexer_topk_ms"] = bench_ms(lambda: indexer_topk(*tix, K, **tkw), dev, **W)
            row["trained_prefill_ms"] = bench_ms(
                lambda: sparse_attention(q, k, v, indexer_topk(*tix, K, **tkw), backend="triton"), dev, **W)
            row["trained_prefill_speedup"] = row["dense_ms"] / row["trained_prefill_ms"]
            # the tiles the forward runs on (auto may halve the default's queries; the default where it takes
            # another path, e.g. on the CPU), their union/pairs and what this tiling allows (tile_floor)
            from sparse_rl.sparse.ops.sparse_attention import union as _union
            from sparse_rl.sparse.ops.sparse_attention.triton import sparse_attention_forward

            plan = sparse_attention_forward(q, k, v, tsel)[2]
            BT = (plan.bt if plan.fwd == "tile" else 0) or _union.tile_queries(H // Hkv)
            fl = tile_floor(tsel, L, H, Hkv, D, BT, row["dense_ms"], row["dense_tflops"], row["indexer_rowmax_ms"])
            row.update({f"trained_{a}": b for a, b in fl.items()})
            row["trained_fwd_path"] = plan.fwd
            del tix, tsel
        for pre, ix, kw in pats:
            if dev.type == "cuda":
                row.update(time_pattern(q, k, v, ix, dev, W, pre, **kw))
            if cfg.check and dev.type == "cuda" and pre != "idx":
                checks.append({"seqlen": L, "pattern": pre, **check_attention(q, k, v, ix, min(cfg.check_queries, L),
                                                                              **kw)})
        if fb is not None and flex is not None and L >= cfg.flex_min_seqlen:
            log(f"L={L}: FlexAttention (compiling)")
            bm = flex_block_mask(fb, cnt, L, cfg.block_size)
            fo = flex(qd, kg0, vg0, block_mask=bm, enable_gqa=Hkv != H)
            row["flex_ms"] = bench_ms(lambda: flex(qd, kg0, vg0, block_mask=bm, enable_gqa=Hkv != H), dev, **W)
            row["flex_tflops"] = 4.0 * pairs(bidx) * H * D / row["flex_ms"] / 1e9
            row["block_attn_vs_flex"] = row["flex_ms"] / row["block_attn_ms"]
            for pre in ("blk", "blkshared"):
                if f"{pre}_tile_kernel_ms" in row:
                    row[f"{pre}_tile_kernel_vs_flex"] = row["flex_ms"] / row[f"{pre}_tile_kernel_ms"]
                    row[f"{pre}_auto_vs_flex"] = row["flex_ms"] / row[f"{pre}_auto_ms"]
            if cfg.check:
                o_tok, _ = sparse_attention(q, k, v, bidx, backend="triton")
                checks.append({"seqlen": L, "pattern": "block-vs-flex",
                               "token_kernel_vs_flex_rel_err": rel_err(o_tok, fo.transpose(1, 2))})
                del o_tok
            del fo, bm
        # forward + backward
        if L in cfg.backward_seqlens:
            log(f"L={L}: forward+backward")
            g = torch.randn_like(q)
            gd = g.transpose(1, 2).contiguous()
            fbt = {}
            for lab, fn, kk, vv in dense_variants(qd, kg0, vg0):
                qq, kk, vv = (x.detach().requires_grad_() for x in (qd, kk, vv))
                fbt[lab] = bench_ms(lambda: fn(qq, kk, vv).backward(gd), dev, grad_to_none=[qq, kk, vv], **W)
                del qq, kk, vv
            row["dense_fwdbwd_all_ms"] = fbt
            row["dense_fwdbwd_label"] = min(fbt, key=fbt.get)
            row["dense_fwdbwd_ms"] = fbt[row["dense_fwdbwd_label"]]
            for pre, ix, kw in pats if dev.type == "cuda" else pats[:1]:  # the CPU: a smoke test
                row.update(time_fwdbwd(q, k, v, ix, g, dev, W, pre, **kw))
                row[f"{pre}_fwdbwd_speedup"] = row["dense_fwdbwd_ms"] / row[f"{pre}_fwdbwd_auto_ms"]
            if "idx_fwdbwd_auto_ms" in row:  # the former columns
                row["sparse_fwdbwd_ms"] = row["idx_fwdbwd_auto_ms"]
                row["fwdbwd_speedup"] = row["dense_fwdbwd_ms"] / row["sparse_fwdbwd_ms"]
            del g, gd
        del pats
        if cfg.granular:
            log(f"L={L}: granular selection")
            inputs = {"random": (qi, wi, ki)}
            if trained is not None:
                inputs["trained"] = patterns.trained_index(trained[0], L, dev, gen)
            fb_args = {}
            if "dense_fwdbwd_ms" in row:
                fb_args = dict(dense_fwdbwd_ms=row["dense_fwdbwd_ms"], grad=torch.randn_like(q))
            gran_rows += granular_rows(q, k, v, inputs, cfg.granular, K, min(4, K // 4), min(64, K // 2), dev, W,
                                       row["dense_ms"], check_n=min(cfg.check_queries, L) if cfg.check else 0,
                                       **fb_args)
            del inputs, fb_args
        rows.append(row)
        log(f"L={L}: " + ", ".join(f"{a}={b:.3g}" for a, b in row.items() if isinstance(b, float)))
        del q, k, v, qd, kd, vd, kg0, vg0, qi, ki, wi, idx
        bidx = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if cfg.check and dev.type == "cuda":
        log("backward check")
        for path in ("atomic", "tile"):
            checks.append({"pattern": f"backward-{path}",
                           **check_backward(dev, dtype, H, Hkv, D, seed=cfg.seed, bwd_path=path)})
    return {"bench": "attention", "config": dataclasses.asdict(cfg), "device": device_name(dev), "rows": rows,
            "checks": checks, "granular": gran_rows}


def markdown_attention(res: dict) -> str:
    lines = [table_title("Sparse prefill vs dense", res), "",
             "| L | dense ms | dense TF/s | idx scores alone ms (streamed) | idx+top-k ms | idx+top-k / scores "
             "| idx scores ms (materialised) | top-k ms (radix) | top-k ms (torch) "
             "| attn ms (indexer idx) | attn TF/s | prefill ms | prefill speedup | attn ms (block idx) | flex ms "
             "| token/flex |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        g = r.get
        lines.append("| " + " | ".join(fmt(x) for x in (
            r["seqlen"], g("dense_ms"), g("dense_tflops"), g("indexer_rowmax_ms"), g("indexer_topk_ms"),
            g("indexer_topk_over_scores"), g("indexer_scores_ms"), g("topk_ms"), g("topk_torch_ms"),
            g("sparse_attn_ms"), g("sparse_attn_tflops"), g("sparse_prefill_ms"),
            g("prefill_speedup"), g("block_attn_ms"), g("flex_ms"), g("block_attn_vs_flex"))) + " |")
    pats = [("idx", "indexer (random)"), ("blk", "block"), ("blkshared", "block, shared rows"),
            ("local", "local+spans+noise"), ("trained", "trained indexer")]
    if any(f"{p}_tile_kernel_ms" in r for r in res["rows"] for p, _ in pats):
        lines += ["", "Forward paths (ms): per-query kernel, GQA-packed tiles (union build + tile kernel), and "
                  "`auto` (what sparse_attention runs; path fwd/bwd/dq). union/pairs = the tiles' union over the "
                  "selected pairs (lower = more sharing); TF/s counted on selected pairs; flex = FlexAttention "
                  "block-sparse on the block selection", "",
                  "| L | pattern | union/pairs | per-query | union build | tile kernel | tile TF/s | auto | auto path "
                  "| auto TF/s | tile/flex speed |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            for pre, name in pats:
                if f"{pre}_tile_kernel_ms" in r:
                    lines.append("| " + " | ".join(fmt(x) for x in (
                        r["seqlen"], name, r[f"{pre}_union_ratio"], r.get(f"{pre}_query_path_ms"),
                        r.get(f"{pre}_union_build_ms"), r[f"{pre}_tile_kernel_ms"], r[f"{pre}_tile_kernel_tflops"],
                        r[f"{pre}_auto_ms"], r[f"{pre}_auto_path"], r[f"{pre}_auto_tflops"],
                        r.get(f"{pre}_tile_kernel_vs_flex"))) + " |")
    tp = [r for r in res["rows"] if "trained_prefill_ms" in r]
    if tp:
        lines += ["", "Token-level prefill on the trained indexer's selection (its scores -> the default top-k -> "
                  "`auto` sparse attention; sink 4, window 64), end to end vs dense. Tiles: the queries of the "
                  "forward's tiles (path: auto's forward); union/pairs at those tiles; MMA/pairs: the tiles' MMA "
                  "work (rows x union keys) over the selected pairs'; floor: that work at dense's TF/s of this run "
                  "plus the score sweep alone (the top-k free), what this tiling allows, not the card", "",
                  "| L | dense ms | idx+top-k ms | attn ms (auto) | prefill ms | speedup vs dense | path | tiles "
                  "| union/pairs | MMA/pairs | attn floor ms | prefill floor ms | floor speedup |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in tp:
            lines.append("| " + " | ".join(fmt(x) for x in (
                r["seqlen"], r.get("dense_ms"), r.get("trained_indexer_topk_ms"), r.get("trained_auto_ms"),
                r["trained_prefill_ms"], r.get("trained_prefill_speedup"), r.get("trained_fwd_path"),
                r.get("trained_tile_queries"), r.get("trained_union_ratio"), r.get("trained_mma_over_pairs"),
                r.get("trained_attn_floor_ms"), r.get("trained_prefill_floor_ms"), r.get("trained_floor_speedup")))
                + " |")
    bw = [r for r in res["rows"] if "dense_fwdbwd_ms" in r]
    if bw:
        lines += ["", "Forward + backward (ms): backward `atomic` (per query, fp32 atomics) vs `tile` (dq per tile, "
                  "dk/dv key-major, no atomics); speedup = dense / auto", "",
                  "| L | dense | pattern | atomic bwd | tile bwd | auto | speedup vs dense |",
                  "|---|---|---|---|---|---|---|"]
        for r in bw:
            for pre, name in pats:
                if f"{pre}_fwdbwd_auto_ms" in r:
                    lines.append("| " + " | ".join(fmt(x) for x in (
                        r["seqlen"], f"{fmt(r['dense_fwdbwd_ms'])} ({r['dense_fwdbwd_label']})", name,
                        r.get(f"{pre}_fwdbwd_atomic_ms"), r.get(f"{pre}_fwdbwd_tile_ms"), r[f"{pre}_fwdbwd_auto_ms"],
                        r[f"{pre}_fwdbwd_speedup"])) + " |")
    lines += markdown_granular(res.get("granular", []))
    lines += ["", "Dense = the fastest SDPA variant per length: " + "; ".join(
        f"{r['seqlen']}: " + ", ".join(f"{a} {fmt(b)} ms" for a, b in r.get("dense_all_ms", {}).items())
        for r in res["rows"])]
    if res.get("checks"):
        lines += ["", "Checks (float32 reference; rel err = ||a-ref||/||ref||):", ""]
        for c in res["checks"]:
            lines.append("- " + ", ".join(f"{a}={fmt(b, 4) if isinstance(b, float) else b}" for a, b in c.items()))
    return "\n".join(lines) + "\n"
