import math
from fractions import Fraction

import pytest

from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.eval.math_eval import pass_at_k, score_completions, summarize


def test_score_hand_made_completions():
    problems = {"g": {"gold": "72", "task": "gsm8k"}, "h": {"gold": "\\frac{1}{2}", "task": "math"},
                "s": {"gold": "1000", "task": "synth"}}
    comps = [
        {"id": "g", "completion": "48 + 24 = 72\n#### 72"},          # right, ####
        {"id": "g", "completion": "so \\boxed{72}"},                  # right, boxed
        {"id": "g", "completion": "#### 71"},                         # wrong
        {"id": "h", "completion": "The answer is 0.5."},              # right, equivalent form
        {"id": "h", "completion": "\\boxed{\\frac{2}{4}}"},           # right, unreduced
        {"id": "h", "completion": "\\boxed{2}"},                      # wrong
        {"id": "s", "completion": "we get 1,000 in total"},           # right, last number
        {"id": "s", "completion": "I cannot solve this"},             # wrong, nothing extracted
        {"id": "x", "completion": "\\boxed{9}", "answer": 9},         # right, inline gold, no problem entry
    ]
    res = score_completions(comps, problems)
    assert [r["id"] for r in res] == ["g", "h", "s", "x"]
    assert [r["correct"] for r in res] == [2, 2, 1, 1]
    s = summarize(res, [1], problems)
    assert s["samples"] == 9 and s["problems"] == 4
    assert s["accuracy"] == pytest.approx(6 / 9)
    assert s["pass@1"] == pytest.approx((2 / 3 + 2 / 3 + 1 / 2 + 1) / 4)
    assert s["extraction"]["none"] == 1
    assert s["by_task"]["math"]["accuracy"] == pytest.approx(2 / 3)
    # pass@2 needs every problem to have 2 samples: "x" has 1
    with pytest.raises(UsageError):
        summarize(res, [2], problems)
    s2 = summarize(res[:3], [2])
    assert s2["pass@k"]["2"] == pytest.approx((1 + 1 + 1) / 3)


def test_score_errors_name_the_record():
    with pytest.raises(SparseRLError, match="record 2: id 'nope' is not in the problems file"):
        score_completions([{"id": "a", "completion": "1"}, {"id": "nope", "completion": "1"}],
                          {"a": {"gold": "1", "task": None}})
    with pytest.raises(SparseRLError, match="record 1: no 'answer'"):
        score_completions([{"id": "a", "completion": "1"}], None)


def _closed_form(n, c, k):
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_matches_closed_form():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_closed_form(n, c, k)), abs=1e-12), (n, c, k)
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(4, 0, 3) == 0.0 and pass_at_k(4, 4, 1) == 1.0


def test_pass_at_k_large_n_is_stable():
    # C(1000, 500) overflows a float; the product form does not
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert pass_at_k(1000, 10, 100) == pytest.approx(float(_closed_form(1000, 10, 100)), rel=1e-9)
    assert 0.0 <= pass_at_k(2000, 3, 1000) <= 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
