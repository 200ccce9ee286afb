"""Math generators: over many seeds and levels the gold answer verifies and a corrupted one fails."""

import random
import re

import pytest

from sparse_rl.synth import verify
from sparse_rl.synth.math_tasks import GENERATORS, corrupt_answer, gen_arith, gen_vartrack, make_math_task, verify_math
from sparse_rl.synth.rg_adapter import extract_answer


@pytest.mark.parametrize("family", sorted(GENERATORS))
def test_gold_passes_corrupted_fails(family):
    for seed in range(3):
        for i in range(12):
            t = make_math_task(family, seed, i, level=1 + i % 8, length=64)
            assert set(t) == {"id", "prompt", "answer", "task", "difficulty", "meta"}
            assert t["task"] == f"math/{family}" and int(t["answer"]) == int(t["answer"])  # plain integer
            assert verify(t, f"Working... so the result is \\boxed{{{t['answer']}}}.") == 1.0
            assert verify(t, f"\\boxed{{{corrupt_answer(t['answer'])}}}") == 0.0
            assert verify(t, "I do not know.") == 0.0


def test_arith_answer_is_the_value_of_the_expression():
    for i in range(50):
        body = gen_arith(random.Random(i), 1 + i % 8)
        # The expression uses only + - * and exact '/', so Python's // evaluates it exactly.
        assert eval(body["meta"]["expression"].replace("/", "//")) == int(body["answer"])
        # every operation the level asks for is in the expression (none silently dropped)
        assert sum(body["meta"]["expression"].count(f" {op} ") for op in "+-*/") == body["meta"]["n_ops"]


def test_difficulty_knobs():
    ops = [make_math_task("arith", 0, 0, lvl)["meta"]["n_ops"] for lvl in (1, 4, 8)]
    assert ops == [3, 6, 10]
    short = make_math_task("vartrack", 0, 0, 2, length=100)
    long = make_math_task("vartrack", 0, 0, 2, length=4000)
    assert len(long["prompt"].split()) > 10 * len(short["prompt"].split()) / 2
    assert long["meta"]["filler_words"] >= 4000 and short["answer"] == long["answer"]
    hops = [make_math_task("vartrack", 0, 3, lvl, length=50)["meta"]["hops"] for lvl in (1, 5)]
    assert hops == [2, 6]


def test_vartrack_answer_follows_the_chain():
    for i in range(20):
        body = gen_vartrack(random.Random(i), 1 + i % 6, length=200)
        env: dict = {}
        for name, src, add, lit in re.findall(r"VAR (\w+) = (?:VAR (\w+)(?: \+ (\d+))?|(\d+))\.", body["prompt"]):
            env[name] = int(lit) if lit else env[src] + int(add or 0)
        assert env[body["meta"]["target"]] == int(body["answer"])


def test_deterministic_per_seed_and_index():
    a = [make_math_task("word", 7, i, 3) for i in range(5)]
    b = [make_math_task("word", 7, i, 3) for i in range(5)]
    assert a == b and make_math_task("word", 8, 0, 3) != a[0]


def test_verify_math_and_answer_extraction():
    assert verify_math("-12", "x = -12") == 1.0
    assert verify_math("42", "\\boxed{42} was wrong, it is \\boxed{43}") == 0.0
    assert extract_answer("blah <answer> 7 </answer>") == "7"


def test_word_problem_answer_follows_the_story():
    """Re-read each story sentence by sentence, independently of the generator's bookkeeping."""
    from sparse_rl.synth.math_tasks import gen_word

    rules = [(r"^\w+ has (\d+) \w+\.$", lambda x, m: int(m[1])),
             (r"^Then \w+ buys (\d+) \w+s with (\d+) \w+ in each \w+\.$", lambda x, m: x + int(m[1]) * int(m[2])),
             (r"^\w+ gives (\d+) \w+ to \w+\.$", lambda x, m: x - int(m[1])),
             (r"^\w+ gives \w+ as many \w+ as \w+ already has\.$", lambda x, m: 2 * x),
             (r"^\w+ splits the \w+ equally into (\d+) groups and keeps only one group\.$",
              lambda x, m: x // int(m[1]) if x % int(m[1]) == 0 else None),
             (r"^\w+ gives \w+ (\d+) more \w+\.$", lambda x, m: x + int(m[1]))]
    for i in range(60):
        body = gen_word(random.Random(i), 1 + i % 8)
        story = body["prompt"].split(" How many ")[0]
        x = None
        for sent in re.findall(r"[^.]+\.", story):
            sent = sent.strip()
            hits = [(f, re.match(p, sent)) for p, f in rules if re.match(p, sent)]
            assert len(hits) == 1, sent
            x = hits[0][0](x, hits[0][1])
            assert x is not None and x >= 0, sent
        assert x == int(body["answer"])
