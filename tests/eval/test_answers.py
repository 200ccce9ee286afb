"""The one answer rule (sparse_rl/eval/answers.py): math-verify's verdict, the same in every caller.

The table is in the spirit of math-verify's own test suite (huggingface/Math-Verify tests/, the
latex + expression configuration). Each row is checked three ways: math-verify itself, called as
its test suite calls it, gives the expected verdict (so the table says what math-verify says); our
rule gives it; and every caller (`reward=math`, `reward=synth` / `verify_math`, the tool-task
answer check, `eval math`) gives it too.
"""

import json

import pytest
from typer.testing import CliRunner

from sparse_rl.cli.main import app
from sparse_rl.errors import SparseRLError
from sparse_rl.eval.answers import answer_verdict, extract_answer, gold_answer
from sparse_rl.eval.math_eval import score_completions
from sparse_rl.rl.rewards import load_reward_fn
from sparse_rl.synth.envs.base import answer_matches
from sparse_rl.synth.math_tasks import verify_math
from sparse_rl.synth.verify import verify as synth_verify

# (gold as LaTeX, completion, math-verify's verdict)
TABLE = [
    # intervals
    ("$[0,1)$", "so $x \\in [0,1)$", 1),
    ("$[0,1)$", "\\boxed{(0,1)}", 0),
    ("$1$", "$-[0,1)$", 0),
    ("$(1,3]$", "$(1,3)$", 0),
    ("$(-6,2)$", "the answer is \\((-6, 2)\\)", 1),
    # tuples
    ("$(1,3)$", "\\boxed{(1,3)}", 1),
    ("$(1,3)$", "\\boxed{13}", 0),
    ("$(1,3)$", "\\boxed{(3,1)}", 0),
    # fractions
    ("$\\frac{1}{3}$", "$\\frac13$", 1),
    ("$\\frac{1}{3}$", "so it is $\\frac{1}{3}$ in the end", 1),
    ("$\\frac{10}{9}$", "The answer is $\\frac{10}{9}$.", 1),
    ("$\\frac{10}{9}$", "\\boxed{9}", 0),
    ("$\\frac{1}{2}$", "\\boxed{0.5}", 1),
    # roots
    ("$\\sqrt{3}$", "$\\sqrt3$", 1),
    ("$3$", "$\\sqrt3$", 0),
    ("$\\frac{\\sqrt{2}}{2}$", "\\boxed{\\sqrt{2}/2}", 1),
    # sets
    ("$\\{1,2,3\\}$", "\\boxed{\\{3,2,1\\}}", 1),
    ("$\\{1,2,3\\}$", "\\boxed{\\{1,2\\}}", 0),
    # several boxed answers
    ("$\\boxed{1}\\boxed{2}$", "\\boxed{1}, \\boxed{2}", 1),
    ("$\\boxed{1}\\boxed{2}$", "\\boxed{2}", 0),
    ("$42$", "\\boxed{42} was wrong, it is \\boxed{43}", 0),
    # letter answers
    ("$E$", "$\\text{E}$", 1),
    ("$E$", "\\boxed{E}", 1),
    ("$E$", "\\boxed{D}", 0),
    # units
    ("$10$", "\\boxed{10 \\text{ cm}}", 1),
    ("$10$", "$10$ cm", 1),
    # percentages
    ("$10\\%$", "$0.1$", 1),
    ("$10\\%$", "\\boxed{10\\%}", 1),
    # numbers, thousands separators, GSM8K markers, equations, expressions
    ("$7425000$", "7,425,000", 1),
    ("$72$", "48 + 24 = 72\n#### 72", 1),
    ("$72$", "so \\boxed{71}", 0),
    ("$2$", "we get $x = 2$", 1),
    ("$x+1$", "\\boxed{1+x}", 1),
    ("$-5$", "-5", 1),
]


def _math_verify(gold: str, pred: str) -> int:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    cfg = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]  # its compare_strings
    return int(verify(parse(gold, cfg), parse(pred, cfg)))


def _bare(gold: str) -> str:
    """The gold as a dataset's answer field holds it: `$(1,3)$` -> `(1,3)`."""
    return gold[1:-1] if gold.startswith("$") and gold.endswith("$") and "\\boxed" not in gold else gold


@pytest.mark.parametrize("gold,pred,expected", TABLE)
def test_table_rows_are_math_verify_verdicts(gold, pred, expected):
    assert _math_verify(gold, pred) == expected


@pytest.mark.parametrize("gold,pred,expected", TABLE)
def test_every_caller_gives_math_verify_verdict(gold, pred, expected):
    for g in {gold, _bare(gold)}:
        assert answer_verdict(pred, g) == float(expected), g
        assert verify_math(g, pred) == float(expected), g
        assert synth_verify({"id": "t", "task": "math/x", "answer": g}, pred) == float(expected), g
        assert load_reward_fn("math")([{"completion": pred}], [{"id": "t", "answer": g}]) == [float(expected)], g
        (res,) = score_completions([{"id": "t", "completion": pred, "answer": g}])
        assert res["correct"] == expected, g


def test_tool_task_number_answers_use_the_same_rule():
    assert answer_matches("1000", "done: \\boxed{1,000}", "number")
    assert answer_matches("0.5", "\\boxed{\\frac{1}{2}}", "number")
    assert not answer_matches("1000", "\\boxed{100}", "number")


def test_eval_math_cli_agrees_with_math_verify_on_the_table(tmp_path):
    recs = [{"id": f"r{i}", "completion": p, "answer": _bare(g)} for i, (g, p, _) in enumerate(TABLE)]
    c = tmp_path / "c.jsonl"
    c.write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = CliRunner().invoke(app, ["eval", "math", "--score", str(c), "--out", str(tmp_path / "per.jsonl")])
    assert res.exit_code == 0, res.output
    per = [json.loads(line) for line in (tmp_path / "per.jsonl").read_text().splitlines()]
    assert [r["correct"] for r in per] == [e for _, _, e in TABLE]


# Our documented differences, where math-verify extracts nothing or reads words as products.
@pytest.mark.parametrize("gold,pred,expected", [
    ("12", "answer:12abc", 1.0),           # nothing extracted, plain-number gold: last number
    ("12", "answer:13abc", 0.0),
    ("1000", "we get 1,000 in total", 1.0),
    ("Paris", "The capital is \\boxed{Paris}.", 1.0),
    ("Paris", "\\boxed{sirap}", 0.0),      # math-verify's parser would call P*a*r*i*s == s*i*r*a*p
    ("Tuesday", "so the answer is tuesday.", 1.0),
    ("New York", "\\boxed{\\text{New York}}", 1.0),
    ("", "\\boxed{3}", None),              # an unreadable gold: no verdict
])
def test_documented_differences(gold, pred, expected):
    assert answer_verdict(pred, gold) == expected


def test_extract_answer_reports_the_path():
    assert extract_answer("so \\boxed{\\frac{1}{2}}", "0.5").method == "math_verify"
    assert extract_answer("answer:12abc", "12") == extract_answer("answer:12abc", "12")
    assert extract_answer("answer:12abc", "12").answer == "12"
    assert extract_answer("\\boxed{Paris}", "Paris").method == "text"
    assert extract_answer("I give up", "7").method == "none"


def test_gold_answer_forms():
    assert gold_answer("Natalia sold 48/2 = 24 clips.\n#### 1,072") == "1072"
    assert gold_answer(42) == "42" and gold_answer(" 17 ") == "17"
    # a MATH solution keeps all its text: math-verify reads every \boxed{} in it
    assert answer_verdict("\\boxed{0.75}", gold_answer("so $x = \\boxed{\\dfrac{3}{4}}$")) == 1.0
    with pytest.raises(ValueError):
        gold_answer(None)


def test_math_reward_on_a_reasoning_gym_task_names_the_task_and_the_right_reward():
    with pytest.raises(SparseRLError, match=r"rg-x.*rg/leg_counting.*reward=synth"):
        load_reward_fn("math")([{"completion": "<answer>4</answer>"}],
                               [{"id": "rg-x", "task": "rg/leg_counting", "answer": "4"}])


def test_bare_expression_golds_are_read_whole():
    # bare, math-verify's expression extraction would read only the leading 2 / 1
    assert answer_verdict("\\boxed{1+2x}", "2x+1") == 1.0
    assert answer_verdict("\\boxed{2}", "2x+1") == 0.0
    assert answer_verdict("\\boxed{x^2+1}", "1 + x^2") == 1.0


# ----------------------------------------------------------------------------- reasoning-gym


class _FakeRG:
    """Stands in for a reasoning-gym dataset: exact match scores 1, anything else 0.01 (its convention)."""

    def __getitem__(self, i):
        return {"question": "q", "answer": "3/4"}

    def score_answer(self, answer, entry):
        return 1.0 if answer == entry["answer"] else 0.01


RG_TASK = {"id": "rg-1", "task": "rg/fraction_simplification", "answer": "3/4",
           "meta": {"rg_dataset": "fraction_simplification", "rg_seed": 0, "rg_size": 1, "rg_index": 0}}


def test_eval_math_scores_reasoning_gym_tasks_with_score_answer(monkeypatch, tmp_path):
    from sparse_rl.synth import rg_adapter

    monkeypatch.setattr(rg_adapter, "_dataset", lambda name, seed, size: _FakeRG())
    problems = tmp_path / "p.jsonl"
    problems.write_text(json.dumps({**RG_TASK, "prompt": "q"}) + "\n")
    comps = tmp_path / "c.jsonl"
    comps.write_text("".join(json.dumps({"id": "rg-1", "completion": c}) + "\n"
                             for c in ("<answer>3/4</answer>", "<answer>0.75</answer>")))
    res = CliRunner().invoke(app, ["eval", "math", "--problems", str(problems), "--score", str(comps),
                                   "--out", str(tmp_path / "per.jsonl")])
    assert res.exit_code == 0, res.output
    (per,) = [json.loads(line) for line in (tmp_path / "per.jsonl").read_text().splitlines()]
    assert [s["score"] for s in per["samples"]] == [1.0, 0.01]
    assert [s["method"] for s in per["samples"]] == ["rg_score_answer"] * 2
    # reward=synth goes through the same scorer
    assert synth_verify(RG_TASK, "<answer>3/4</answer>") == 1.0


def test_reasoning_gym_task_without_its_meta_is_a_clear_error():
    with pytest.raises(SparseRLError, match=r"rg-1.*meta has no rg_dataset"):
        score_completions([{"id": "rg-1", "completion": "<answer>1</answer>", "answer": "1",
                            "task": "rg/leg_counting"}])


def test_reasoning_gym_adapter_against_the_real_package():
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (optional dependency)")
    from sparse_rl.synth.rg_adapter import make_rg_tasks

    (task,) = make_rg_tasks("leg_counting", 1, seed=3)
    gold = task["answer"]
    assert synth_verify(task, f"<answer>{gold}</answer>") == 1.0
    (res,) = score_completions([{"id": task["id"], "completion": f"<answer>{gold}</answer>", **task}])
    assert res["correct"] == 1
    assert synth_verify(task, "<answer>-1</answer>") < 1.0
