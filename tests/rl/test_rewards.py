"""Reward shaping, the built-in math reward, and loading/validating user reward functions."""

from __future__ import annotations

import uuid

import pytest
import torch

from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.rl.rewards import SHAPING, load_reward_fn, math_verdict


def test_overlong_penalty_dapo_soft_buffer():
    # max_len 20, cache 4: free up to 16, then (16 - L)/4: 17 -> -.25, 18 -> -.5, 20 -> -1; beyond 20 -> -1
    pen = SHAPING["overlong"]([10, 16, 17, 18, 20, 25], max_len=20, cache_len=4)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    half = SHAPING["overlong"](torch.tensor([18]), max_len=20, cache_len=4, coef=0.5)
    assert torch.allclose(half, torch.tensor([-0.25]))
    with pytest.raises(ValueError):
        SHAPING["overlong"]([1], max_len=20, cache_len=0)


def test_length_penalty():
    pen = SHAPING["length"]([0, 10, 20], max_len=20, coef=0.1)
    assert torch.allclose(pen, torch.tensor([0.0, -0.05, -0.1]))


# ----------------------------------------------------------------------------- built-in math


@pytest.mark.parametrize(
    "text, gold, expect",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("I count 7 apples", "7", 1.0),
        ("The answer is \\boxed{8}", "7", 0.0),
        ("I give up", "7", 0.0),
        ("the total is 1,234", "1234", 1.0),
        ("\\boxed{x^2+1}", "1 + x^2", 1.0),
        # math-verify extracts nothing from these; the last-number fallback finds the answer
        ("answer:12abc", "12", 1.0),
        ("value is `42`", "42", 1.0),
        ("value is `41`", "42", 0.0),
        # a gold answer that cannot be parsed gives no verdict
        ("\\boxed{3}", "", None),
    ],
)
def test_math_verdict(text, gold, expect):
    assert math_verdict(text, gold) == expect


def test_builtin_math_reward_via_loader():
    fn = load_reward_fn("math")
    comps = [{"id": "a", "completion": "\\boxed{2}"}, {"id": "b", "completion": "3"}]
    tasks = [{"id": "a", "answer": 2}, {"id": "b", "answer": "4"}]
    assert fn(comps, tasks) == [1.0, 0.0]
    with pytest.raises(SparseRLError, match=r"math.*task id b.*answer"):
        fn(comps, [{"id": "a", "answer": "2"}, {"id": "b"}])


def test_builtin_synth_reward_dispatches_to_the_synth_verifier():
    pytest.importorskip("sparse_rl.synth.verify")
    fn = load_reward_fn("synth")
    comps = [{"completion": "\\boxed{12}"}, {"completion": "\\boxed{13}"}]
    tasks = [{"id": "m1", "task": "math/arith", "answer": "12"}, {"id": "m2", "task": "math/arith", "answer": "12"}]
    assert fn(comps, tasks) == [1.0, 0.0]


# ----------------------------------------------------------------------------- user functions

USER_CODE = '''
import math

def exact(completions, tasks):
    return [1.0 if c["completion"] == t["answer"] else 0.0 for c, t in zip(completions, tasks)]

def skip_odd(completions, tasks):
    return [None if int(t["id"][1:]) % 2 else 0.5 for t in tasks]

def raise_on_t2(completions, tasks):
    for t in tasks:
        if t["id"] == "t2":
            raise KeyError("no field 'x'")
    return [0.0] * len(tasks)

def nan_on_t1(completions, tasks):
    return [math.nan if t["id"] == "t1" else 1.0 for t in tasks]

def too_few(completions, tasks):
    return [1.0]

def strings(completions, tasks):
    return ["yes"] * len(tasks)

def batch_only_failure(completions, tasks):
    if len(tasks) > 1:
        raise RuntimeError("batch too big")
    return [1.0]

NOT_A_FUNCTION = 3
'''

COMPS = [{"id": f"t{i}", "completion": str(i)} for i in range(3)]
TASKS = [{"id": f"t{i}", "answer": "1"} for i in range(3)]


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_CODE)
    return path


def test_load_from_file_and_module(user_file, monkeypatch):
    assert load_reward_fn(f"{user_file}:exact")(COMPS, TASKS) == [0.0, 1.0, 0.0]
    assert load_reward_fn(f"{user_file}:skip_odd")(COMPS, TASKS) == [0.5, None, 0.5]
    name = f"user_rewards_{uuid.uuid4().hex}"
    (user_file.parent / f"{name}.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(user_file.parent))
    assert load_reward_fn(f"{name}:exact")(COMPS, TASKS) == [0.0, 1.0, 0.0]


def test_loader_usage_errors_name_the_key(user_file, tmp_path):
    cases = [
        ("bogus", "unknown reward 'bogus'.*math"),
        (f"{tmp_path}/missing.py:f", "does not exist"),
        (f"{user_file}:nope", "no attribute 'nope'"),
        (f"{user_file}:NOT_A_FUNCTION", "not a function"),
        ("no_such_module_xyz:f", "cannot import module"),
        (f"{user_file}:", "must look like"),
    ]
    for spec, pattern in cases:
        with pytest.raises(UsageError, match=pattern) as e:
            load_reward_fn(spec, key="grpo.reward_fn")
        assert str(e.value).startswith("grpo.reward_fn:"), spec


def test_module_that_fails_to_import_is_a_runtime_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def f(:\n")
    with pytest.raises(SparseRLError, match="importing .*broken.py failed: SyntaxError") as e:
        load_reward_fn(f"{bad}:f")
    assert not isinstance(e.value, UsageError)


@pytest.mark.parametrize(
    "fname, pattern",
    [
        ("raise_on_t2", r"raise_on_t2 raised KeyError on task id t2: .*no field 'x'"),
        ("nan_on_t1", r"nan_on_t1 returned nan for task id t1"),
        ("too_few", r"too_few returned 1 rewards for 3 completions"),
        ("strings", r"strings returned 'yes' for task id t0"),
        ("batch_only_failure", r"batch_only_failure raised RuntimeError on the batch of task ids t0\.\.t2"),
    ],
)
def test_misbehaving_reward_functions(user_file, fname, pattern):
    fn = load_reward_fn(f"{user_file}:{fname}")
    with pytest.raises(SparseRLError, match=pattern) as e:
        fn(COMPS, TASKS)
    assert "\n" not in str(e.value)
