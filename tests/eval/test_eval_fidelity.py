"""eval fidelity on a tiny random model: k >= length gives KL 0 and recall 1; small k moves every metric away."""

import json

import pytest
import torch
from typer.testing import CliRunner

from sparse_rl.cli.main import app
from sparse_rl.eval.fidelity import bucket_of, compare_sequence
from sparse_rl.sparse.config import SparseConfig
from sparse_rl.sparse.convert import ConvertConfig, convert
from sparse_rl.sparse.loader import load_model, set_attention

T = 80


def _sparse(tiny_model_dir, root, topk):
    sc = SparseConfig(topk=topk, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
    out = root / f"k{topk}"
    convert(tiny_model_dir, out, ConvertConfig(sparse=sc, seed=3))
    return out


@pytest.fixture(scope="module")
def sparse_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fidelity")
    return {k: _sparse(tiny_model_dir, root, k) for k in (4, 16, 4 * T)}


def _ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 500, (T,), generator=g).tolist()


def test_bucket_edges():
    assert [bucket_of(p) for p in (0, 31, 32, 63, 64, 100, 128, 4095, 4096)] == [0, 0, 32, 32, 64, 64, 128, 2048, 4096]


def test_full_topk_is_dense(sparse_dirs):
    model = load_model(sparse_dirs[4 * T], attention="sparse")
    m = compare_sequence(model, _ids(), start=0, chunk=7)  # odd chunk: chunk edges must not matter
    assert m["kl"].shape == (T - 1,) and m["pos"].tolist() == list(range(T - 1))
    assert m["kl"].max() < 1e-5
    assert m["top1"].min() == 1.0
    assert m["acceptance"].min() > 1 - 1e-4
    assert sorted(m["recall"]) == [1, 2, 3]  # layer 0 is kept dense
    for r in m["recall"].values():
        assert r.shape == (T - 1,) and (r - 1).abs().max() < 1e-5


def test_small_topk_moves_every_metric(sparse_dirs):
    res = {}
    for k in (4, 16):
        model = load_model(sparse_dirs[k], attention="sparse")
        res[k] = compare_sequence(model, _ids(), start=0, chunk=32)
        m = res[k]
        early = m["pos"] < k  # query t sees t + 1 keys: all of them while t + 1 <= k
        assert m["kl"][early].max() < 1e-5
        assert m["kl"][~early].mean() > 1e-4
        assert m["acceptance"][~early].mean() < 1.0
        for r in m["recall"].values():
            assert (r[early] - 1).abs().max() < 1e-5 and r[~early].max() < 1.0 and r.min() > 0.0
    # fewer selected keys -> further from dense
    assert res[4]["kl"][res[4]["pos"] >= 16].mean() > res[16]["kl"][res[16]["pos"] >= 16].mean()
    assert res[4]["acceptance"].mean() < res[16]["acceptance"].mean()
    for i in (1, 2, 3):
        assert res[4]["recall"][i].mean() < res[16]["recall"][i].mean()


def test_cli_fidelity_end_to_end(sparse_dirs, tmp_path):
    data = tmp_path / "d.jsonl"
    ids = _ids(1)
    recs = [{"id": "t0", "text": "the cat sat on the mat and then the dog ran far away " * 4},
            {"id": "c0", "prompt": "the cat sat", "completion": "x", "tokens": ids[:30], "finish_reason": "length"},
            {"id": "m0", "prompt": [{"role": "user", "content": "hello"}], "completion": "x", "tokens": ids[:10],
             "finish_reason": "length"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "fid"
    res = CliRunner().invoke(app, ["eval", "fidelity", str(sparse_dirs[4]), "--data", str(data), "--out", str(out),
                                   "--device", "cpu"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["records"] == 3 and s["kl"] > 0 and 0 <= s["acceptance_p5"] <= s["acceptance_mean"] <= 1
    assert 0 < s["attn_recall"] < 1 and sorted(s["attn_recall_by_layer"]) == ["1", "2", "3"]
    assert sum(b["tokens"] for b in s["by_position"]) == s["tokens"]
    per = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert per[1]["id"] == "c0" and per[1]["tokens"] == 30  # only the completion's tokens are scored
    assert per[2]["id"] == "m0" and per[2]["tokens"] == 10  # chat prompt through the template
    for name in ("fidelity_kl.png", "fidelity_agreement.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # bad record: one line, exit 1, nothing written
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "prompt": "only a prompt"}) + "\n")
    res = CliRunner().invoke(app, ["eval", "fidelity", str(sparse_dirs[4]), "--data", str(bad), "--out",
                                   str(tmp_path / "fid2"), "--device", "cpu"])
    assert res.exit_code == 1 and "record 1: needs 'text'" in res.stderr
    assert not (tmp_path / "fid2").exists()


def test_cli_fidelity_needs_a_sparse_dir(tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "t", "text": "hello there"}) + "\n")
    res = CliRunner().invoke(app, ["eval", "fidelity", str(tiny_model_dir), "--data", str(data), "--out",
                                   str(tmp_path / "o")])
    assert res.exit_code == 1 and "not a sparse model dir" in res.stderr


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_adapter_belongs_to_the_sparse_side(sparse_dirs, tmp_path):
    """With k >= length only a LoRA adapter can separate the two sides: zero-init B gives KL 0,
    a random-B adapter gives KL > 0, equal to dense-without-adapter against sparse-with-adapter."""
    from peft import LoraConfig, get_peft_model

    from sparse_rl.eval.fidelity import _with_adapter

    for init, name in ((True, "zero"), (False, "random")):
        base = load_model(sparse_dirs[4 * T], attention="sparse")
        pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             init_lora_weights=init))
        pm.save_pretrained(str(tmp_path / name))
    for name in ("zero", "random"):
        model = _with_adapter(load_model(sparse_dirs[4 * T], attention="sparse"), str(tmp_path / name))
        m = compare_sequence(model, _ids(), recall=False)
        if name == "zero":
            assert m["kl"].max() < 1e-5
            continue
        assert m["kl"].mean() > 1e-4
        # the same KL by hand: plain dense model (no adapter) against sparse + adapter
        ids = torch.tensor([_ids()])
        plain = load_model(sparse_dirs[4 * T], attention="dense")
        with torch.no_grad():
            lp = torch.log_softmax(plain(input_ids=ids).logits[0, :-1].float(), -1)
            set_attention(model, "sparse")
            lq = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        torch.testing.assert_close(m["kl"], (lp.exp() * (lp - lq)).sum(-1), atol=1e-5, rtol=1e-4)
    res = CliRunner().invoke(app, ["eval", "fidelity", str(sparse_dirs[4 * T]), "--adapter", str(tmp_path),
                                   "--data", "-", "--out", str(tmp_path / "o")], input='{"id": 1, "text": "hi"}\n')
    assert res.exit_code == 2 and "adapter_config.json" in res.stderr
