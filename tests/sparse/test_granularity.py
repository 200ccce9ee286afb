"""Selection granularity (key blocks, query groups): the reference rule, its decode form, and every
path that honours it (HF forward with left padding, incremental decoding, the rollout engine)."""

import pytest
import torch

from sparse_rl.errors import UsageError
from sparse_rl.modelinit import ModelInitConfig, init_model
from sparse_rl.sparse.config import SparseConfig
from sparse_rl.sparse.convert import ConvertConfig, convert
from sparse_rl.sparse.layer import LayerState, select, set_granularity, set_topk
from sparse_rl.sparse.loader import load_model, set_attention
from sparse_rl.sparse.ops.indexer_topk.naive import (granular_topk_decode_naive, granular_topk_naive, group_start,
                                                     indexer_topk_naive)
from sparse_rl.sparse.patch import cache_kwarg

GRANULARITIES = [(1, 1), (4, 1), (1, 4), (4, 4), (2, 8)]
L = 24


def _index(B=2, T=37, H=3, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, generator=g), torch.randn(B, T, D, generator=g)


def test_token_level_equals_indexer_topk():
    q, w, k = _index()
    for ks in (None, torch.tensor([0, 5])):
        ref = indexer_topk_naive(q, w, k, 12, sink=2, window=3, kv_start=ks)
        assert torch.equal(granular_topk_naive(q, w, k, 12, sink=2, window=3, kv_start=ks), ref)


def test_hand_computed_blocks_and_groups():
    """One row, 12 keys, scores chosen by hand: key_block 4 picks the block with the best max (or mean)."""
    T, S = 12, 12
    k = torch.eye(S)[:, :S]  # key s is the unit vector e_s: the score of key s is relu(q_s) * w
    base = torch.tensor([0, 5, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0], dtype=torch.float32)
    q = base.expand(T, S).reshape(1, T, 1, S).clone()
    w = torch.ones(1, T, 1)
    # topk 8, sink 1, window 3: at query 11 (not short) the sink {0}, the window {9, 10, 11} and one block of 4
    got = granular_topk_naive(q, w, k[None], 8, sink=1, window=3, key_block=4, block_score="max")[0, 11]
    assert got.tolist() == [0, 1, 2, 3, 9, 10, 11, -1]  # block 0 (max 5) beats block 1 (max 2)
    got = granular_topk_naive(q, w, k[None], 8, sink=1, window=3, key_block=4, block_score="mean")[0, 11]
    assert got.tolist() == [0, 4, 5, 6, 7, 9, 10, 11]  # by mean block 1 (2.0) beats block 0 (1.25)
    # query groups of 4: queries 8..11 share query 8's selection (budget 8 - 3 = 5: sink 0, window 6..8,
    # the best other key 1) and add the group's keys after 8 up to themselves
    rows = granular_topk_naive(q, w, k[None], 8, sink=1, window=3, query_group=4)[0]
    assert rows[8].tolist() == [0, 1, 6, 7, 8, -1, -1, -1]
    assert rows[11].tolist() == [0, 1, 6, 7, 8, 9, 10, 11]
    # a query group whose last query sees <= topk keys keeps every visible key
    assert rows[7].tolist() == list(range(8))


@pytest.mark.parametrize("kb,G", GRANULARITIES)
@pytest.mark.parametrize("score", ["max", "mean"])
def test_rule_properties_and_decode_form(kb, G, score):
    q, w, k = _index()
    ks = torch.tensor([0, 5])
    topk, sink, window = 16, 2, 3
    rows = granular_topk_naive(q, w, k, topk, sink=sink, window=window, kv_start=ks, key_block=kb,
                               query_group=G, block_score=score)
    T = q.shape[1]
    for b in range(2):
        for t in range(T):
            got = [x for x in rows[b, t].tolist() if x >= 0]
            visible = list(range(int(ks[b]), t + 1))
            assert got == sorted(set(got)) and set(got) <= set(visible)
            if len(visible) <= topk:
                continue
            assert set(visible[:sink]) | set(visible[-window:]) <= set(got)
            r = int(group_start(torch.tensor(t), ks[b], G))
            assert set(range(r, t + 1)) <= set(got)
            last = min(T - 1, r + G - 1)  # members share the selection: t's row is the last member's up to t
            assert got == [x for x in rows[b, last].tolist() if 0 <= x <= t]
    for t in (20, 31, 36):  # decode form: the representative's index query, the sequence's row
        pos = torch.full((2,), t)
        rep = group_start(pos, ks, G)
        d = granular_topk_decode_naive(q[torch.arange(2), rep], w[torch.arange(2), rep], k[:, :t + 1], pos, topk,
                                       sink=sink, window=window, kv_start=ks, key_block=kb, query_group=G,
                                       block_score=score)
        assert torch.equal(d, rows[:, t])
    # the once-per-group evaluation (rows without left padding) equals the per-query one
    kw = dict(sink=sink, window=window, key_block=kb, query_group=G, block_score=score)
    assert torch.equal(granular_topk_naive(q, w, k, topk, **kw),
                       granular_topk_naive(q, w, k, topk, kv_start=torch.zeros(2, dtype=torch.long), **kw))
    # incremental: a chunk after q_offset with the earlier positions as history
    inc = granular_topk_naive(q[:, 30:], w[:, 30:], k, topk, q_offset=30, sink=sink, window=window, kv_start=ks,
                              key_block=kb, query_group=G, block_score=score, history=(q[:, :30], w[:, :30]))
    assert torch.equal(inc, rows[:, 30:])


@pytest.mark.parametrize("kb,backend", [(4, "torch"), (1, "torch")])
def test_select_dispatch_and_its_decode_form_with_group_buffers(kb, backend):
    """Decode of token-level groups runs the indexer's decode top-k op at the representative (its
    Triton kernel is checked against the reference elsewhere); key blocks the reference; both give
    the sequence's rows."""
    cfg = SparseConfig(topk=16, sink=2, window=3, key_block=kb, query_group=4, index_heads=3, index_dim=8)
    st = LayerState(cfg=cfg, dense_layer=False, mode="sparse", backend=backend)
    q, w, k = _index(B=1)
    rows = select(st, None, None, (q, w, k))
    assert torch.equal(rows, granular_topk_naive(q, w, k, 16, sink=2, window=3, key_block=kb, query_group=4))
    group = (torch.zeros(1, 3, 8), torch.zeros(1, 3))
    for t in range(q.shape[1]):  # decode one position after the other: the buffers carry the representative
        got = select(st, None, None, (q[:, t], w[:, t], k), pos=torch.tensor([t]), S=t + 1, group=group)
        assert torch.equal(got, rows[:, t]), t


def test_config_validation_names_the_flag():
    for kw, flag in [(dict(key_block=3), "--key-block"), (dict(topk=72, query_group=16), "--query-group"),
                     (dict(selector="block", key_block=4), "--key-block"), (dict(block_score="sum"), "--block-score"),
                     (dict(topk=16, sink=4, window=8, query_group=8), "--query-group")]:
        with pytest.raises(UsageError, match=flag):
            SparseConfig(**kw)


def test_old_config_files_load_as_token_level(tmp_path):
    import json

    SparseConfig(topk=128).save(tmp_path)
    data = json.loads((tmp_path / "sparse_config.json").read_text())
    for key in ("key_block", "query_group", "block_score"):
        data.pop(key)
    (tmp_path / "sparse_config.json").write_text(json.dumps(data))
    c = SparseConfig.load(tmp_path)
    assert (c.key_block, c.query_group, c.block_score) == (1, 1, "max")


# ---------------------------------------------------------------------------------------------
# the model paths


@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gran")
    init_model(root / "dense", ModelInitConfig(arch="qwen2", size="tiny", seed=1))
    sc = SparseConfig(topk=32, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
    convert(root / "dense", root / "sparse", ConvertConfig(sparse=sc, seed=3))
    return root / "sparse"


def _batch(seed=0, pad=6):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 500, (2, L), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _logits(model, ids, mask, pos):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


@pytest.mark.parametrize("kb,G", [(4, 1), (1, 4), (4, 4), (16, 16)])
def test_full_topk_equals_dense_every_granularity(sparse_dir, kb, G):
    model = load_model(sparse_dir, attention="sparse")
    set_granularity(model, kb, G)
    ids, mask, pos = _batch()
    sparse = _logits(model, ids, mask, pos)
    set_attention(model, "dense")
    valid = mask.bool()
    torch.testing.assert_close(sparse[valid], _logits(model, ids, mask, pos)[valid], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kb,G", [(4, 1), (1, 4), (4, 4)])
def test_incremental_decoding_equals_full_forward(sparse_dir, kb, G):
    """Left padding, a prefill that ends inside a query group, then one token at a time."""
    from transformers import DynamicCache

    model = load_model(sparse_dir, attention="sparse")
    set_topk(model, 8)
    set_granularity(model, kb, G)
    ids, mask, pos = _batch(seed=2, pad=3)
    full = _logits(model, ids, mask, pos)
    set_attention(model, "dense")
    assert (full[0, 12:] - _logits(model, ids, mask, pos)[0, 12:]).abs().max() > 1e-3  # it really selects
    set_attention(model, "sparse")
    P, cache, ck = 10, DynamicCache(), cache_kwarg(model)
    with torch.no_grad():
        out = model(input_ids=ids[:, :P], attention_mask=mask[:, :P], position_ids=pos[:, :P], use_cache=True,
                    **{ck: cache})
        steps = [out.logits]
        for t in range(P, L):
            out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1],
                        use_cache=True, **{ck: cache})
            steps.append(out.logits)
    valid = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[valid], full[valid], atol=3e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# the rollout engine


def _prompts(seed=0, lengths=(5, 11, 3, 14, 8)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kb,G", [(1, 4), (4, 4)])
def test_engine_greedy_equals_hf_generate_and_logprobs_teacher_forced(sparse_dir, kb, G):
    """More prompts than slots (continuous batching, shared prefixes with samples=2), prompts ending inside a
    query group; the engine's decode equals HF's generate and a teacher-forced full forward."""
    from sparse_rl.rl.rollout import RolloutEngine, SamplingParams, process_logits

    model = load_model(sparse_dir, attention="sparse")
    set_topk(model, 8)
    set_granularity(model, kb, G)
    eng = RolloutEngine(model, None, max_batch=3, max_seq_len=64, eos_token_ids=[])
    prompts = _prompts()
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_new_tokens=16))
    for p, c in zip(prompts, outs):
        ref = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert c.tokens == ref[0, len(p):].tolist()
    params = SamplingParams(samples=2, temperature=0.8, max_new_tokens=12, seed=1)
    for c in eng.generate(_prompts(1, (9, 4, 13)), params):
        ids = torch.tensor([c.prompt_tokens + c.tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(c.prompt_tokens) - 1:-1]
        ref = process_logits(logits, params).gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# the warm-up KL target at a granularity, and `indexer eval`


def test_granular_target_sums_to_one_and_matches_a_hand_computed_case():
    from sparse_rl.sparse.ops.indexer_kl.naive import granular_target

    # 2 groups of 2 queries over 4 keys; the queries' dense targets are given by hand
    p = torch.tensor([[[1.0, 0, 0, 0], [0.5, 0.5, 0, 0], [0.2, 0.2, 0.6, 0], [0.1, 0.1, 0.4, 0.4]]])
    scores = torch.zeros(1, 4, 4)
    tgt, s, valid = granular_target(p, scores, 0, 1, 2)
    # group 0 (rep 0 sees key 0): mean of rows 0, 1 restricted to key 0 -> [1, 0, 0, 0]
    # group 1 (rep 2 sees keys 0..2): mean [0.15, 0.15, 0.5, 0.2] -> drop key 3, renormalise by 0.8
    torch.testing.assert_close(tgt[0], torch.tensor([[1.0, 0, 0, 0], [0.1875, 0.1875, 0.625, 0]]))
    assert valid[0].tolist() == [[True, False, False, False], [True, True, True, False]]
    tgt_b, _, valid_b = granular_target(p, scores, 0, 2, 2)  # and blocks of 2 keys
    torch.testing.assert_close(tgt_b[0], torch.tensor([[1.0, 0], [0.375, 0.625]]))
    assert valid_b[0].tolist() == [[True, False], [True, True]]
    torch.testing.assert_close(tgt_b.sum(-1), torch.ones(1, 2))


@pytest.mark.parametrize("kb,G", [(1, 1), (4, 1), (1, 4), (4, 4), (2, 8)])
@pytest.mark.parametrize("score", ["max", "mean"])
def test_granular_warmup_kl_equals_brute_force_and_is_chunk_invariant(kb, G, score):
    from sparse_rl.sparse.ops import warmup_kl
    from sparse_rl.sparse.ops.indexer_kl.naive import dense_target
    from sparse_rl.sparse.ops.indexer_topk.naive import indexer_scores_naive

    g = torch.Generator().manual_seed(kb * 10 + G)
    B, H, Hkv, T, D = 2, 4, 2, 19, 8
    q, k = torch.randn(B, H, T, D, generator=g, dtype=torch.float64), torch.randn(B, Hkv, T, D, generator=g,
                                                                                  dtype=torch.float64)
    leaves = [torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_() for s in ((B, T, 3, 5), (B, T, 3),
                                                                                          (B, T, 5))]
    grads = []
    for chunk in (3, 64):
        st = warmup_kl(q, k, *leaves, scale=0.5, key_block=kb, query_group=G, block_score=score, chunk=chunk,
                       grad_scale=1.0, backend="torch")
        grads.append([x.grad.clone() for x in leaves])
        for x in leaves:
            x.grad = None
    p, sc = dense_target(q, k, 0.5), indexer_scores_naive(*(x.detach() for x in leaves))
    ref = 0.0
    for b in range(B):
        for r in range(0, T, G):  # one term per group: its mean target over the keys its first query sees
            tg = p[b, r:r + G].mean(0)[:r + 1]
            tg = tg / tg.sum()
            blocks = range(0, r + 1, kb)
            tb = torch.stack([tg[j:j + kb].sum() for j in blocks])
            pool = (lambda x: x.max()) if score == "max" else (lambda x: x.mean())
            lq = torch.log_softmax(torch.stack([pool(sc[b, r, j:min(j + kb, r + 1)]) for j in blocks]), 0)
            ref += float((torch.xlogy(tb, tb) - tb * lq).sum())
    assert st.n == B * -(-T // G)
    assert abs(float(st.kl) - ref) < 1e-9 * max(1.0, ref)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-9)
    assert grads[0][0].abs().sum() > 0


def test_indexer_eval_reports_recall_per_granularity(sparse_dir, tmp_path):
    import json

    from typer.testing import CliRunner

    from sparse_rl.cli.main import app

    res = CliRunner().invoke(app, ["indexer", "eval", str(sparse_dir), "--seq-len", "160", "--rows", "1", "--index-topk",
                                   "64", "--no-lm-loss", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    ev = json.loads(res.stdout.strip().splitlines()[-1])
    rows = {(r["key_block"], r["query_group"]): r for r in ev["granularity"]}
    assert sorted(rows) == [(kb, g) for kb in (1, 4, 16, 64) for g in (1, 4, 16)]
    base = rows[(1, 1)]  # the model's own (token-level) selection is the grid's first point
    assert abs(base["attn_recall"] - ev["attn_recall"]) < 1e-6 and abs(base["oracle_recall"] - ev["oracle_recall"]) < 1e-6
    for r in rows.values():  # a coarser selection of the same budget can not beat per-query top-k tokens
        assert 0 < r["attn_recall"] <= 1 + 1e-6 and r["oracle_recall"] <= base["oracle_recall"] + 1e-6
    assert rows[(64, 16)]["oracle_recall"] < base["oracle_recall"]
    assert "key_block 64  query_group 16" in res.stderr
