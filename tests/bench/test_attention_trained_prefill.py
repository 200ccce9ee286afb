"""`sparse-rl bench attention`'s token-level prefill row on the trained indexer (its scores -> the default top-k
-> the auto attention) on a tiny CPU run: the row is filled, its union/pairs is the trained selection's own (the
same selection `patterns.trained_selection` draws from the same generator state), and the table prints it."""

import torch

from sparse_rl.bench import patterns
from sparse_rl.bench.attention import BenchAttentionConfig, markdown_attention, run_attention_bench
from sparse_rl.bench.timing import fmt


def test_trained_prefill_row_and_its_union_ratio():
    cfg = BenchAttentionConfig(seqlens=[40], heads=4, kv_heads=1, head_dim=16, topk=12, index_heads=1, index_dim=16,
                               backward_seqlens=[], flex=False, patterns=["trained"], trained_steps=2, granular=[],
                               check=False, warmup_ms=1, rep_ms=1, device="cpu", dtype="float32")
    res = run_attention_bench(cfg, log=lambda *_: None)
    row = res["rows"][0]
    assert row["trained_prefill_ms"] > 0 and row["trained_indexer_topk_ms"] > 0
    assert row["trained_prefill_speedup"] == row["dense_ms"] / row["trained_prefill_ms"]
    assert 0 < row["trained_union_ratio"] <= 1
    table = markdown_attention(res)
    section = table.split("Token-level prefill on the trained indexer's selection")[1].split("\n\n")[1]
    line = [x for x in section.splitlines() if x.startswith("| 40 |")][0]
    assert len(line.strip("|").split("|")) == 13 and fmt(row["trained_prefill_ms"]) in line
    # the CPU plan takes the per-query path: the floor is at the default tiles (128 rows: 32 queries at G 4)
    assert row["trained_fwd_path"] == "query" and row["trained_tile_queries"] == 32
    assert abs(row["trained_floor_speedup"] - row["dense_ms"] / (row["indexer_rowmax_ms"]
                                                                 + row["trained_attn_floor_ms"])) < 1e-9
    # the ratio is the one of the selection the bench drew: redraw it from the same generator state
    dev = torch.device("cpu")
    gen = torch.Generator(device=dev).manual_seed(cfg.seed)
    L, H, Hkv, D, HI, DI = 40, 4, 1, 16, 1, 16
    for shape in ((1, L, H, D), (1, L, Hkv, D), (1, L, Hkv, D), (1, L, HI, DI), (1, L, DI)):  # q, k, v, qi, ki
        torch.randn(*shape, generator=gen)
    torch.rand(1, L, HI, generator=gen)  # wi
    ix, _ = patterns.train_indexer(dev, gen, steps=2, crop=min(1024, L))
    sel = patterns.trained_selection(ix, L, 12, dev, gen)
    from sparse_rl.sparse.ops.sparse_attention import union

    want = float(union.union_sizes(sel, L, union.tile_queries(H // Hkv)).sum()) / int((sel >= 0).sum())
    assert abs(row["trained_union_ratio"] - want) < 1e-12


def test_tile_floor_counts_masked_mma_work():
    """tile_floor against the tiles' unions counted in Python: queries t select keys t-7..t (a sliding window of 8,
    fewer at the start); with tiles of 4 queries a tile's union is 11 keys (8 at the first tile), and G = 4 puts
    16 rows in the MMA, so the masked work over the selected pairs' is (sum of 16 x |U| over tiles) / (4 x pairs)."""
    from sparse_rl.bench.attention import tile_floor

    L, K, BT, H, Hkv, D = 32, 8, 4, 4, 1, 16
    rows = [[s for s in range(t - K + 1, t + 1) if s >= 0] for t in range(L)]
    idx = torch.full((1, L, K), -1, dtype=torch.int32)
    for t, r in enumerate(rows):
        idx[0, t, :len(r)] = torch.tensor(r, dtype=torch.int32)
    unions = [len(set().union(*rows[i:i + BT])) for i in range(0, L, BT)]
    n = sum(len(r) for r in rows)
    assert unions[0] == 4 and unions[2] == 11
    res = tile_floor(idx, L, H, Hkv, D, BT, dense_ms=2.0, dense_tflops=5.0, scores_ms=0.5)
    want = sum(unions) * 16 * Hkv / (n * H)
    assert abs(res["union_ratio"] - sum(unions) / n) < 1e-12
    assert abs(res["mma_over_pairs"] - want) < 1e-12
    attn = want * 4.0 * n * H * D / 5e9
    assert abs(res["attn_floor_ms"] - attn) < 1e-15
    assert abs(res["floor_speedup"] - 2.0 / (0.5 + attn)) < 1e-9
    assert "prefill_floor_ms" not in tile_floor(idx, L, H, Hkv, D, BT, 2.0, 5.0, None)
