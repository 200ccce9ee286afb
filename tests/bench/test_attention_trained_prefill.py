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
    assert len(line.strip("|").split("|")) == 7 and fmt(row["trained_prefill_ms"]) in line
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
