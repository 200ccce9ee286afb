"""Hop-by-hop retrieval grid of look-up completions (sparse_rl.eval.retrieval)."""

import json

import pytest

from sparse_rl.errors import SparseRLError
from sparse_rl.eval.retrieval import hop_grid, hop_grid_files, hops_right, steps_of
from sparse_rl.synth.lookup import make_task


def _task(i=0, keys=12, hops=3):
    return make_task(seed=5, index=i, keys=keys, hops=hops, digits=3)


def _answer(task, wrong_at=None):
    chain = list(task["meta"]["chain"])
    lines = []
    for j in range(len(chain) - 1):
        v = chain[j + 1] if j != wrong_at else "000"
        lines.append(f"{chain[j]} -> {v}")
    return "\n".join(lines) + f"\nAnswer: {chain[-1]}"


def test_steps_of_skips_other_lines():
    assert steps_of("x\n12 -> 34\nAnswer: 34\n 5->6 ") == [("12", "34"), ("5", "6")]


def test_hops_right_is_conditional_on_the_earlier_hops():
    t = _task()
    assert hops_right(t, _answer(t)) == [True, True, True]
    assert hops_right(t, _answer(t, wrong_at=1)) == [True, False, None]
    assert hops_right(t, "") == [False, None, None]
    # a right line at the wrong place does not count: hop 0 must be the first step line
    first, second = t["meta"]["chain"][1], t["meta"]["chain"][2]
    assert hops_right(t, f"{first} -> {second}") == [False, None, None]


def test_grid_bins_each_hop_by_the_depth_of_its_row():
    tasks = [_task(i) for i in range(6)]
    pairs = [(t, _answer(t, wrong_at=(1 if i % 2 else None))) for i, t in enumerate(tasks)]
    g = hop_grid(pairs, bins=3)
    assert g["hops"] == 3 and len(g["grid"]) == 3 and all(len(r) == 3 for r in g["grid"])
    # hop 0 always right; hop 1 wrong in half the tasks; hop 2 attempted only by the right half
    assert g["by_hop"][0] == 1.0 and g["by_hop"][1] == 0.5 and g["by_hop"][2] == 1.0
    assert sum(map(sum, g["n"])) == 6 + 6 + 3
    assert g["all"] == pytest.approx((6 + 3 + 3) / 15)
    # each attempt lands in the bin of its row's position
    for j in range(3):
        want = [0, 0, 0]
        for i, t in enumerate(tasks):
            if j == 2 and i % 2:
                continue
            want[min(2, int(3 * t["meta"]["positions"][j] / t["meta"]["keys"]))] += 1
        assert g["n"][j] == want


def test_files_join_on_id_and_reject_strangers(tmp_path):
    tasks = [_task(i) for i in range(3)]
    tf, cf = tmp_path / "tasks.jsonl", tmp_path / "c.jsonl"
    tf.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    cf.write_text("".join(json.dumps({"id": t["id"], "completion": _answer(t)}) + "\n" for t in tasks))
    assert hop_grid_files(cf, tf)["all"] == 1.0
    cf.write_text(json.dumps({"id": "nope", "completion": ""}) + "\n")
    with pytest.raises(SparseRLError, match="nope"):
        hop_grid_files(cf, tf)
