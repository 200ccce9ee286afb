"""eval niah / eval math driven by a real (tiny, random) model through the rollout engine."""

import json

import pytest
from typer.testing import CliRunner

from sparse_rl.cli.main import app
from sparse_rl.eval.niah import build_niah_sample, load_tokenizer
from sparse_rl.eval.niah_run import model_generate_fns
from sparse_rl.sparse.config import SparseConfig
from sparse_rl.sparse.convert import ConvertConfig, convert


@pytest.fixture(scope="module")
def full_sparse_dir(tiny_model_dir, tmp_path_factory):
    """Sparse dir whose top-k covers every prompt here, so sparse must equal dense."""
    out = tmp_path_factory.mktemp("evalmodel") / "sparse"
    sc = SparseConfig(topk=256, index_heads=2, index_dim=16, rope_dim=8, sink=1, window=2, dense_layers=[0])
    convert(tiny_model_dir, out, ConvertConfig(sparse=sc, seed=3))
    return out


def test_model_generate_fns_are_the_engine_greedy(full_sparse_dir):
    from sparse_rl.rl.rollout import generate_texts

    tok = load_tokenizer(full_sparse_dir)
    prompts = [build_niah_sample(tok, "single", 200, d)["prompt"] for d in (0.0, 1.0)]  # + 6 new < top-k
    fns = model_generate_fns(str(full_sparse_dir), ["dense", "sparse"], device="cpu", batch_size=4)
    dense = fns["dense"](prompts, 6)
    assert dense == generate_texts(full_sparse_dir, prompts, 6, attention="dense", device="cpu")
    assert fns["sparse"](prompts, 6) == dense  # k >= length: sparse is dense


def test_cli_niah_model_runs_and_resumes(full_sparse_dir, tmp_path):
    out = tmp_path / "niah"
    args = ["eval", "niah", str(full_sparse_dir), "--kinds", "single", "--lengths", "200",
            "--depths", "0,1", "--max-new-tokens", "8", "--out", str(out), "--device", "cpu"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    first = json.loads(res.stdout)
    cells = (out / "cells.jsonl").read_text()
    assert len(cells.splitlines()) == 4  # a sparse dir: dense and sparse by default
    assert all(isinstance(json.loads(c)["samples"][0]["output"], str) for c in cells.splitlines())
    assert first["modes"]["sparse"]["grid"] == first["modes"]["dense"]["grid"]  # k >= length
    res = CliRunner().invoke(app, args)  # resume: nothing left to run
    assert res.exit_code == 0, res.output
    assert (out / "cells.jsonl").read_text() == cells and json.loads(res.stdout) == first
    res = CliRunner().invoke(app, args[:-4] + ["--tokenizer", str(full_sparse_dir), "--out", str(out)])
    assert res.exit_code == 2 and "--tokenizer" in res.stderr


def test_cli_math_model_samples_then_scores_the_same(full_sparse_dir, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "prompt": "What is 2 + 3? Answer:", "answer": "5"},
        {"id": "b", "question": "What is 10 - 4?", "answer": "Ten minus four. #### 6"},
    ]))
    comp = tmp_path / "c.jsonl"
    args = ["eval", "math", str(full_sparse_dir), "--attention", "sparse", "--problems", str(p),
            "--samples", "2", "--temperature", "1.0", "--max-new-tokens", "6", "--seed", "1", "--device", "cpu",
            "--completions-out", str(comp)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["problems"] == 2 and s["samples"] == 4 and s["sampling"]["attention"] == "sparse"
    recs = [json.loads(line) for line in comp.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["a", "a", "b", "b"] and all(len(r["tokens"]) <= 6 for r in recs)
    again = CliRunner().invoke(app, args + ["--force"])  # same seed, same samples (--force: the file exists)
    assert json.loads(again.stdout) == s and [json.loads(x) for x in comp.read_text().splitlines()] == recs
    scored = CliRunner().invoke(app, ["eval", "math", "--problems", str(p), "--score", str(comp)])
    assert scored.exit_code == 0, scored.output
    t = json.loads(scored.stdout)
    assert (t["accuracy"], t["pass@k"]) == (s["accuracy"], s["pass@k"])
    both = CliRunner().invoke(app, args + ["--score", str(comp), "--force"])
    assert both.exit_code == 2 and "not both" in both.stderr


def test_generate_pipes_into_eval_math(full_sparse_dir, tmp_path):
    """`sparse-rl generate ... --n 2` output scores as 2 samples per problem, joined on id."""
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "prompt": "2 + 3 =", "answer": "5", "task": "arith"},
        {"id": "b", "prompt": "10 - 4 =", "answer": "#### 6", "task": "arith"},
    ]))
    comp = tmp_path / "c.jsonl"
    res = CliRunner().invoke(app, ["generate", str(full_sparse_dir), "--prompts", str(p), "--out", str(comp), "--samples", "2",
                                   "--max-new-tokens", "4", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    for extra in ([], ["--problems", str(p)]):  # gold carried by the completions, or joined from the problems
        res = CliRunner().invoke(app, ["eval", "math", "--score", str(comp), *extra])
        assert res.exit_code == 0, res.output
        s = json.loads(res.stdout)
        assert (s["problems"], s["samples"], list(s["pass@k"])) == (2, 4, ["1", "2"])
