"""`sparse-rl indexer train`: learning, exact resume, the sparse stage, the CLI and its error paths."""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sparse_rl.cli.main import app
from sparse_rl.sparse.train import data as data_mod
from sparse_rl.sparse.train.trainer import IndexerTrainConfig, run

L = 128
TIMING_KEYS = {"tokens_per_s", "step_time_s", "max_mem_gb"}


@pytest.fixture(scope="module")
def sharp_sparse(tmp_path_factory):
    """A tiny llama whose attention is sharp (q/k projections scaled up), converted with k = L/8.

    A random-init model attends almost uniformly, so no selection can beat any other; scaling q and
    k gives content-dependent, peaked attention that an indexer can learn to predict."""
    from transformers import AutoModelForCausalLM

    from sparse_rl.modelinit import ModelInitConfig, init_model
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.convert import ConvertConfig, convert
    from sparse_rl.sparse.loader import load_tokenizer

    root = tmp_path_factory.mktemp("indexer")
    init_model(root / "dense", ModelInitConfig(size="tiny", seed=0))
    model = AutoModelForCausalLM.from_pretrained(root / "dense")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    model.save_pretrained(root / "sharp")
    load_tokenizer(root / "dense").save_pretrained(root / "sharp")
    sc = SparseConfig(topk=L // 8, index_heads=4, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
    convert(root / "sharp", root / "sparse", ConvertConfig(sparse=sc, seed=0))
    return root / "sparse"


def _cfg(model, out, **kw):
    base = dict(model=str(model), out=str(out), seq_len=L, batch_size=2, steps=6, lr=3e-2, synthetic_rows=16,
                device="cpu", save_every=1000)
    base.update(kw)
    return IndexerTrainConfig(**base)


def _metrics(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_warmup_lowers_kl_and_raises_recall(sharp_sparse, tmp_path):
    from sparse_rl.sparse.loader import load_model, load_tokenizer
    from sparse_rl.sparse.train.data import synthetic_rows
    from sparse_rl.sparse.train.hooks import evaluate

    held = synthetic_rows(load_tokenizer(sharp_sparse), 3, L, seed=777)  # rows never trained on
    before = evaluate(load_model(sharp_sparse), held, lm_loss=False)
    summary = run(_cfg(sharp_sparse, tmp_path / "out", steps=40, lr_warmup=2))
    after = evaluate(load_model(tmp_path / "out", attention="sparse"), held, lm_loss=False)
    assert after["kl"] < 0.8 * before["kl"], (before["kl"], after["kl"])
    assert after["attn_recall"] > before["attn_recall"] + 0.03, (before["attn_recall"], after["attn_recall"])
    assert after["attn_recall"] <= after["oracle_recall"] + 1e-6  # no selection of k keys beats the top-k
    rows = _metrics(tmp_path / "out.run")
    assert [r["step"] for r in rows] == list(range(1, 41)) and summary["steps"] == 40
    for key in ("step", "loss", "kl", "attn_recall", "lr", "tokens_per_s"):
        assert all(r[key] is not None for r in rows), key
    # the warm-up trains the indexers only: the base weights are bit-identical
    src, dst = _tensors(sharp_sparse / "model.safetensors"), _tensors(tmp_path / "out" / "model.safetensors")
    assert src.keys() == dst.keys() and all(torch.equal(src[k], dst[k]) for k in src)
    assert not torch.equal(_tensors(sharp_sparse / "indexer.safetensors")["layers.1.wq.weight"],
                           _tensors(tmp_path / "out" / "indexer.safetensors")["layers.1.wq.weight"])


@pytest.mark.parametrize("stage", ["warmup", "sparse"])
def test_resume_after_interruption_continues_exactly(sharp_sparse, tmp_path, monkeypatch, stage):
    cfg = dict(steps=6, save_every=2, stage=stage, model_lr=1e-3)
    run(_cfg(sharp_sparse, tmp_path / "a", **cfg))
    full = _metrics(tmp_path / "a.run")

    rows = data_mod.PackedData.rows

    def interrupted(self, start, n):  # dies fetching step 6's batch: step 5 ran after checkpoint 4
        if start >= 5 * 2:
            raise KeyboardInterrupt
        return rows(self, start, n)

    monkeypatch.setattr(data_mod.PackedData, "rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(sharp_sparse, tmp_path / "b", **cfg))
    assert not (tmp_path / "b").exists()  # no output model from an interrupted run
    ckpts = sorted(p.name for p in (tmp_path / "b.run" / "checkpoints").iterdir())
    assert ckpts == ["step-2", "step-4"]
    assert [r["step"] for r in _metrics(tmp_path / "b.run")] == [1, 2, 3, 4, 5]
    monkeypatch.setattr(data_mod.PackedData, "rows", rows)

    run(_cfg(sharp_sparse, tmp_path / "b", **cfg), resume=True)
    resumed = _metrics(tmp_path / "b.run")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]  # step 5 recomputed, not duplicated
    for a, b in zip(full, resumed):
        assert {k: v for k, v in a.items() if k not in TIMING_KEYS} == \
               {k: v for k, v in b.items() if k not in TIMING_KEYS}, (a, b)
    for name in ("indexer.safetensors", "model.safetensors"):
        x, y = _tensors(tmp_path / "a" / name), _tensors(tmp_path / "b" / name)
        assert all(torch.equal(x[k], y[k]) for k in x), name


def test_sparse_stage_lora_trains_model_and_indexer(sharp_sparse, tmp_path):
    from sparse_rl.sparse.loader import load_model

    summary = run(_cfg(sharp_sparse, tmp_path / "out", stage="sparse", finetune="lora", lora_r=4, steps=3,
                       model_lr=1e-2))
    rows = _metrics(tmp_path / "out.run")
    assert len(rows) == 3 and all(r["lm_loss"] > 0 and r["attn_recall"] is not None for r in rows)
    assert rows[0]["model_lr"] == pytest.approx(1e-2) and summary["stage"] == "sparse"
    src, dst = _tensors(sharp_sparse / "model.safetensors"), _tensors(tmp_path / "out" / "model.safetensors")
    assert src.keys() == dst.keys()  # LoRA merged away: a plain checkpoint again
    q = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(src[q], dst[q])  # the adapter was trained and merged
    assert torch.equal(src["model.embed_tokens.weight"], dst["model.embed_tokens.weight"])
    assert not torch.equal(_tensors(sharp_sparse / "indexer.safetensors")["layers.2.wq.weight"],
                           _tensors(tmp_path / "out" / "indexer.safetensors")["layers.2.wq.weight"])
    model = load_model(tmp_path / "out", attention="sparse")
    ids = torch.randint(5, 500, (1, 24))
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_cli_end_to_end_with_recipe_and_flags(sharp_sparse, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("seq_len: 64\nbatch_size: 1\nsteps: 50\nsynthetic_rows: 4\ndevice: cpu\nlog_every: 1\n")
    out = tmp_path / "m"
    res = CliRunner().invoke(app, ["indexer", "train", str(sharp_sparse), "--out", str(out), "--config", str(recipe),
                                   "--steps", "2", "--index-topk", "12"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["topk"] == 12 and len(_metrics(out.with_name("m.run"))) == 2
    assert json.loads((out / "sparse_config.json").read_text())["topk"] == 12
    # the recipe's values survive except where a flag overrode them
    saved = (out.with_name("m.run") / "config.yaml").read_text()
    assert "seq_len: 64" in saved and "steps: 2" in saved
    # a second run into the same run dir needs --resume or --force
    res = CliRunner().invoke(app, ["indexer", "train", str(sharp_sparse), "--out", str(tmp_path / "m2"),
                                   "--run-dir", str(out.with_name("m.run")), "--config", str(recipe)])
    assert res.exit_code == 2 and "--resume" in res.output and not (tmp_path / "m2").exists()
    # --resume of a finished run writes the output again only with --force
    res = CliRunner().invoke(app, ["indexer", "train", str(sharp_sparse), "--out", str(out), "--config", str(recipe),
                                   "--steps", "3", "--index-topk", "12", "--resume", "--force"])
    assert res.exit_code == 0, res.output
    assert [r["step"] for r in _metrics(out.with_name("m.run"))] == [1, 2, 3]
    # the trained dir evaluates: JSON on stdout, per-layer numbers, recall bounded by the oracle
    res = CliRunner().invoke(app, ["indexer", "eval", str(out), "--seq-len", "64", "--rows", "2", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    ev = json.loads(res.stdout.strip().splitlines()[-1])
    assert ev["topk"] == 12 and ev["rows"] == 2 and sorted(ev["layers"]) == ["1", "2", "3"]
    assert 0 < ev["attn_recall"] <= ev["oracle_recall"] + 1e-6 <= 1 + 1e-6 and ev["lm_loss_sparse"] > 0
    res = CliRunner().invoke(app, ["indexer", "eval", str(sharp_sparse.parent / "sharp"), "--device", "cpu"])
    assert res.exit_code == 1 and "not a sparse model dir" in res.output


def test_shipped_recipe_loads():
    from sparse_rl.config import load_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(IndexerTrainConfig, root / "recipes" / "indexer_warmup.yaml")
    assert cfg.stage == "warmup" and cfg.seq_len >= 4096
    launch = [x for x in (root / "recipes" / "indexer_warmup.yaml").read_text().splitlines() if "Launch:" in x]
    assert launch and "sparse-rl indexer train" in launch[0]


@pytest.mark.parametrize("setup,args,code,needle", [
    ("none", ["--data", "{tmp}/missing.jsonl"], 2, "--data"),
    ("badjsonl", ["--data", "{tmp}/bad.jsonl"], 1, "record 2"),
    ("short", ["--data", "{tmp}/short.txt"], 1, "fewer than one row"),
    ("none", ["--stage", "dense"], 2, "--stage"),
    ("badkey", ["--config", "{tmp}/bad.yaml"], 2, "unknown key 'sequence_length'"),
    ("dense", [], 1, "not a sparse model dir"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(sharp_sparse, tmp_path, setup, args, code, needle):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"prompt": "no text"}\n')
    (tmp_path / "short.txt").write_text("too short")
    (tmp_path / "bad.yaml").write_text("sequence_length: 128\n")
    model = sharp_sparse
    if setup == "dense":
        model = sharp_sparse.parent / "sharp"
    argv = ["indexer", "train", str(model), "--out", str(tmp_path / "o"), "--device", "cpu", "--seq-len", "64",
            "--steps", "1"] + [a.format(tmp=tmp_path) for a in args]
    res = CliRunner().invoke(app, argv)
    assert res.exit_code == code, res.output
    err = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and needle in err[0], res.output
    assert not (tmp_path / "o").exists()


# ---- data


class _Tok:
    """Character-level stand-in for a tokenizer: enough to test reading and packing."""

    eos_token_id = 0
    chat_template = "x"

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) % 250 + 1 for c in t] for t in texts]}

    def apply_chat_template(self, msgs, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in msgs)


def test_data_sources_pack_to_rows(tmp_path):
    tok = _Tok()
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "1", "text": "abcdefgh"}) + "\n" + json.dumps(
        {"id": "2", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")
    docs = data_mod.read_documents(tmp_path / "a.jsonl", tok)
    assert docs == ["abcdefgh", "<user>hi<assistant>yo"]
    d = data_mod.build_data(str(tmp_path / "a.jsonl"), tok, 5, seed=1)
    assert d.tokens.shape == (6, 5)  # 8 + 1 + 21 + 1 = 31 tokens -> 6 rows, the tail dropped
    assert d.tokens.flatten()[8] == 0  # EOS after the first document
    (tmp_path / "b.txt").write_text("x" * 23)
    assert data_mod.build_data(str(tmp_path / "b.txt"), tok, 8).tokens.shape == (3, 8)
    with pytest.raises(Exception, match="expected a .jsonl"):
        data_mod.read_documents(tmp_path / "a.csv", tok) if (tmp_path / "a.csv").write_text("x") else None


def test_rows_follow_a_seeded_permutation_per_epoch():
    d = data_mod.PackedData(torch.arange(20).view(10, 2), seed=3)
    first = d.rows(0, 10)[:, 0] // 2
    assert sorted(first.tolist()) == list(range(10))  # one epoch = each row once
    again = data_mod.PackedData(torch.arange(20).view(10, 2), seed=3)
    assert torch.equal(again.rows(7, 6), d.rows(7, 6))  # position alone decides the sample
    assert not torch.equal(d.rows(0, 10), d.rows(10, 10))  # a new order in the next epoch


def test_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["hello world", "more text here"]}).save_to_disk(str(tmp_path / "ds"))
    assert data_mod.read_documents(tmp_path / "ds", _Tok()) == ["hello world", "more text here"]
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(tmp_path / "ds2"))
    with pytest.raises(Exception, match="'text' or 'messages' column"):
        data_mod.read_documents(tmp_path / "ds2", _Tok())


def test_synthetic_rows_are_deterministic_and_recall_stated_facts(sharp_sparse):
    import re

    from sparse_rl.sparse.loader import load_tokenizer

    tok = load_tokenizer(sharp_sparse)
    a = data_mod.synthetic_rows(tok, 2, 512, seed=5)
    assert a.shape == (2, 512) and torch.equal(a, data_mod.synthetic_rows(tok, 2, 512, seed=5))
    assert not torch.equal(a, data_mod.synthetic_rows(tok, 2, 512, seed=6))
    text = tok.decode(a[0])
    facts = dict(re.findall(r"The value of (\w+) is (\d+)\.", text))
    asked = re.findall(r"What is the value of (\w+)\? (\d+)\.", text)
    assert len(facts) >= 3 and len(asked) >= 3
    assert all(facts[k] == v for k, v in asked)  # every question is answered by an earlier fact
    first_q = text.index("What is the value")
    assert all(text.index(f"The value of {k} is") < first_q for k, _ in asked)


def test_fused_kl_impl_trains_like_the_torch_path(sharp_sparse, tmp_path):
    # the Triton kernels run under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
    # one row of 48 tokens (k = 16 of them): the interpreter's cost grows with the tiles, and two
    # steps are enough to compare one update
    small = dict(steps=2, seq_len=48, batch_size=1)
    run(_cfg(sharp_sparse, tmp_path / "t", kl_impl="torch", **small))
    run(_cfg(sharp_sparse, tmp_path / "f", kl_impl="triton", **small))
    for a, b in zip(_metrics(tmp_path / "t.run"), _metrics(tmp_path / "f.run")):
        for key in ("kl", "attn_recall", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), key
    x, y = _tensors(tmp_path / "t" / "indexer.safetensors"), _tensors(tmp_path / "f" / "indexer.safetensors")
    for key in x:
        # atol: under 0.4% of one Adam step (lr 3e-2), where a float-order difference in a near-zero
        # gradient moves an element; a wrong kernel moves them by whole steps
        torch.testing.assert_close(x[key], y[key], rtol=1e-4, atol=1e-4)


def test_resume_without_a_checkpoint_starts_over_and_keeps_foreign_files(sharp_sparse, tmp_path):
    run_dir = tmp_path / "runs"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "kl": 9.0}\n')  # a run killed before its first checkpoint
    run(_cfg(sharp_sparse, tmp_path / "o", steps=2, run_dir=str(run_dir)), resume=True)
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2] and _metrics(run_dir)[0]["kl"] != 9.0
    assert (run_dir / "notes.txt").read_text() == "mine"
    run(_cfg(sharp_sparse, tmp_path / "o", steps=1, run_dir=str(run_dir)), force=True)
    assert [r["step"] for r in _metrics(run_dir)] == [1] and (run_dir / "notes.txt").exists()
