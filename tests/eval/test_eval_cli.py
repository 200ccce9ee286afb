"""`sparse-rl eval math|niah` end to end through the real CLI app."""

import json

import pytest
from typer.testing import CliRunner

from sparse_rl.cli.main import app

PROBLEMS = [
    {"id": "g1", "prompt": "q1", "answer": "She sold 48 + 24 = 72 clips.\n#### 72", "task": "gsm8k"},
    {"id": "m1", "prompt": "q2", "answer": "$\\boxed{\\frac{1}{2}}$", "task": "math"},
    {"id": "s1", "prompt": "q3", "answer": 1000, "task": "synth"},
]
COMPLETIONS = [
    {"id": "g1", "prompt": "q1", "completion": "72 in total.\n#### 72", "tokens": 9, "finish_reason": "stop"},
    {"id": "g1", "prompt": "q1", "completion": "\\boxed{70}", "tokens": 4, "finish_reason": "stop"},
    {"id": "m1", "prompt": "q2", "completion": "The answer is 0.5.", "tokens": 6, "finish_reason": "stop"},
    {"id": "m1", "prompt": "q2", "completion": "so \\boxed{\\frac{1}{3}}", "tokens": 6, "finish_reason": "stop"},
    {"id": "s1", "prompt": "q3", "completion": "that makes 1,000", "tokens": 4, "finish_reason": "stop"},
    {"id": "s1", "prompt": "q3", "completion": "I give up", "tokens": 3, "finish_reason": "length"},
]


def _jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_eval_math_score_file(tmp_path):
    p = _jsonl(tmp_path / "p.jsonl", PROBLEMS)
    c = _jsonl(tmp_path / "c.jsonl", COMPLETIONS)
    res = CliRunner().invoke(app, ["eval", "math", "--problems", str(p), "--score", str(c),
                                   "--out", str(tmp_path / "per.jsonl"), "--summary", str(tmp_path / "s.json")])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["accuracy"] == pytest.approx(0.5) and summary["pass@k"]["2"] == pytest.approx(1.0)
    assert summary["problems"] == 3 and summary["samples"] == 6
    assert json.loads((tmp_path / "s.json").read_text()) == summary
    per = [json.loads(line) for line in (tmp_path / "per.jsonl").read_text().splitlines()]
    assert [(r["id"], r["correct"]) for r in per] == [("g1", 1), ("m1", 1), ("s1", 1)]
    assert "accuracy" in res.stderr  # the rich table goes to stderr


def test_eval_math_score_stdin_with_inline_answers(tmp_path):
    comps = [{**c, "answer": {"g1": "72", "m1": "1/2", "s1": "1000"}[c["id"]]} for c in COMPLETIONS]
    stdin = "".join(json.dumps(r) + "\n" for r in comps)
    res = CliRunner().invoke(app, ["eval", "math", "--score", "-", "--pass-at", "1"], input=stdin)
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["accuracy"] == pytest.approx(0.5) and list(s["pass@k"]) == ["1"]


def test_eval_math_config_file(tmp_path):
    p = _jsonl(tmp_path / "p.jsonl", PROBLEMS)
    c = _jsonl(tmp_path / "c.jsonl", COMPLETIONS)
    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"problems: {p}\nscore: {c}\nk: [1, 2]\n")
    res = CliRunner().invoke(app, ["eval", "math", "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    cfg.write_text("problemz: x\n")
    res = CliRunner().invoke(app, ["eval", "math", "--config", str(cfg)])
    assert res.exit_code == 2 and "unknown key 'problemz'" in res.stderr


def test_eval_math_bad_json_line_writes_nothing(tmp_path):
    p = _jsonl(tmp_path / "p.jsonl", PROBLEMS)
    c = tmp_path / "c.jsonl"
    c.write_text(json.dumps(COMPLETIONS[0]) + "\n" + json.dumps(COMPLETIONS[1]) + "\n{\"id\": \"m1\", oops\n")
    out, summ = tmp_path / "per.jsonl", tmp_path / "s.json"
    res = CliRunner().invoke(app, ["eval", "math", "--problems", str(p), "--score", str(c),
                                   "--out", str(out), "--summary", str(summ)])
    assert res.exit_code == 1
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "line 3" in err and "invalid JSON" in err, err
    assert res.stdout == ""
    assert not out.exists() and not summ.exists()
    assert set(tmp_path.iterdir()) == {p, c}


def test_eval_math_unknown_id_and_usage_errors(tmp_path):
    p = _jsonl(tmp_path / "p.jsonl", PROBLEMS)
    c = _jsonl(tmp_path / "c.jsonl", [{"id": "zz", "completion": "1"}])
    res = CliRunner().invoke(app, ["eval", "math", "--problems", str(p), "--score", str(c)])
    assert res.exit_code == 1 and "id 'zz' is not in the problems file" in res.stderr
    res = CliRunner().invoke(app, ["eval", "math", "--problems", str(p)])
    assert res.exit_code == 2 and "--score" in res.stderr
    res = CliRunner().invoke(app, ["eval", "math", "--score", str(c), "--problems", str(p), "--pass-at", "x"])
    assert res.exit_code == 2 and "--pass-at" in res.stderr
    c2 = _jsonl(tmp_path / "c2.jsonl", COMPLETIONS)
    res = CliRunner().invoke(app, ["eval", "math", "--score", str(c2), "--problems", str(p), "--pass-at", "3"])
    assert res.exit_code == 2 and "pass@k" in res.stderr


def test_eval_niah_build_then_score(tmp_path, bpe_dir):
    prompts = tmp_path / "niah.jsonl"
    res = CliRunner().invoke(app, ["eval", "niah", "--tokenizer", str(bpe_dir), "--kinds", "single,multivalue",
                                   "--lengths", "300,1k", "--depths", "0,0.5,1", "--prompts-out", str(prompts)])
    assert res.exit_code == 0, res.output
    recs = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert len(recs) == 2 * 2 * 3
    from sparse_rl.eval.niah import load_tokenizer

    tok = load_tokenizer(bpe_dir)
    assert all(len(tok(r["prompt"])["input_ids"]) == r["meta"]["length"] for r in recs)
    # completions as `sparse-rl generate` writes them: dense answers everything, sparse misses depth 1
    dense = [{"id": r["id"], "prompt": r["prompt"], "completion": " ".join(r["answer"]), "tokens": 8,
              "finish_reason": "stop"} for r in recs]
    sparse = [{**d, "completion": d["completion"] if r["meta"]["depth"] < 1 else "no idea"} for d, r in zip(dense, recs)]
    d, s = _jsonl(tmp_path / "d.jsonl", dense), _jsonl(tmp_path / "s.jsonl", sparse)
    out = tmp_path / "res"
    res = CliRunner().invoke(app, ["eval", "niah", "--prompts", str(prompts), "--score", f"dense={d}",
                                   "--score", f"sparse={s}", "--out", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["modes"]["dense"]["mean"] == 1.0
    assert summary["modes"]["sparse"]["grid"] == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    assert summary["difference"]["sparse-dense"]["mean"] == pytest.approx(-1 / 3)
    names = {p.name for p in out.iterdir()}
    assert {"cells.jsonl", "summary.json", "heatmap_dense.png", "heatmap_sparse.png",
            "diff_sparse_minus_dense.png"} <= names
    # an existing --out needs --force
    res = CliRunner().invoke(app, ["eval", "niah", "--prompts", str(prompts), "--score", f"dense={d}", "--out", str(out)])
    assert res.exit_code == 2 and "--force" in res.stderr


def test_eval_niah_bad_inputs(tmp_path, bpe_dir):
    res = CliRunner().invoke(app, ["eval", "niah", "--tokenizer", str(bpe_dir), "--kinds", "nope", "--prompts-out", "-"])
    assert res.exit_code == 2 and "unknown task 'nope'" in res.stderr
    res = CliRunner().invoke(app, ["eval", "niah", "--tokenizer", str(bpe_dir)])
    assert res.exit_code == 2 and "--prompts-out" in res.stderr
    prompts = tmp_path / "niah.jsonl"
    res = CliRunner().invoke(app, ["eval", "niah", "--tokenizer", str(bpe_dir), "--lengths", "300", "--depths", "0.5",
                                   "--prompts-out", "-"])
    assert res.exit_code == 0
    prompts.write_text(res.stdout)
    rec = json.loads(res.stdout.splitlines()[0])
    empty = _jsonl(tmp_path / "empty.jsonl", [{"id": "other", "completion": "x"}])
    out = tmp_path / "res"
    res = CliRunner().invoke(app, ["eval", "niah", "--prompts", str(prompts), "--score", f"dense={empty}",
                                   "--out", str(out)])
    assert res.exit_code == 1 and f"no completion for prompt '{rec['id']}'" in res.stderr
    assert not out.exists()
    res = CliRunner().invoke(app, ["eval", "niah", "--prompts", str(prompts), "--score", "dense", "--out", str(out)])
    assert res.exit_code == 2 and "MODE=FILE" in res.stderr


def test_eval_niah_build_from_recipe(tmp_path, bpe_dir):
    cfg = tmp_path / "niah.yaml"
    cfg.write_text(f"tokenizer: {bpe_dir}\ntasks: [multikey, vt]\nlengths: [400, 600]\ndepths: [0.5]\nseed: 3\n")
    res = CliRunner().invoke(app, ["eval", "niah", "--config", str(cfg), "--lengths", "700", "--prompts-out", "-"])
    assert res.exit_code == 0, res.output
    recs = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(r["task"], r["meta"]["length"], r["meta"]["seed"]) for r in recs] == [("niah_multikey", 700, 3),
                                                                                     ("niah_vt", 700, 3)]


def test_eval_niah_refuses_a_tokenizer_that_encodes_nothing(tmp_path):
    """NIAH goes through the one tokenizer loader: a vocabulary that encodes all text to no tokens is
    refused in one line naming --tokenizer, before any prompt file is written."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    d = tmp_path / "empty-tok"
    d.mkdir()
    Tokenizer(BPE(vocab={"<s>": 0, "</s>": 1}, merges=[])).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "bos_token": "<s>", "eos_token": "</s>"}))
    out = tmp_path / "p.jsonl"
    res = CliRunner().invoke(app, ["eval", "niah", "--tokenizer", str(d), "--lengths", "300", "--depths", "0.5",
                                   "--prompts-out", str(out)])
    lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert lines[0].startswith("error: --tokenizer ") and "encodes text to no tokens" in lines[0]
    assert not out.exists()
    res = CliRunner().invoke(app, ["eval", "niah", "--tokenizer", str(tmp_path / "none"), "--prompts-out", str(out)])
    assert res.exit_code == 2 and "not a directory" in res.stderr
