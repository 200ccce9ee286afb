"""The chained look-up task family: well-formed tables, worked solutions, the exact-match verifier,
and `sparse-rl synth lookup` through the CLI."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sparse_rl.cli.main import app
from sparse_rl.synth.lookup import LookupConfig, final_answer, make_task, verify_lookup
from sparse_rl.synth.verify import verify


@pytest.mark.parametrize("keys,hops", [(5, 1), (7, 3), (64, 4)])
def test_table_has_one_right_row_per_step_and_the_solution_follows_it(keys, hops):
    t = make_task(3, 11, keys, hops)
    lines = t["prompt"].split("\n\n")[0].splitlines()[1:]
    table = [tuple(x.split(" -> ")) for x in lines]
    assert len(table) == keys
    ks = [k for k, _ in table]
    assert len(set(ks)) == keys  # a key occurs once: each step has exactly one matching row
    assert len({v for _, v in table}) == keys
    cur = t["meta"]["start"]
    assert f"Start at {cur} " in t["prompt"]
    steps = t["solution"].splitlines()
    for j in range(hops):
        nxt = dict(table)[cur]
        assert steps[j] == f"{cur} -> {nxt}"
        cur = nxt
    assert steps[-1] == f"Answer: {cur}" and t["answer"] == cur
    assert make_task(3, 11, keys, hops) == t and make_task(4, 11, keys, hops) != t


def test_verifier_is_an_exact_match_of_the_last_answer_line():
    t = make_task(0, 0, 16, 2)
    assert verify(t, t["solution"]) == 1.0 and verify_lookup(t, t["solution"]) == 1.0
    wrong = str(int(t["answer"]) + 1) if t["answer"] != "9999" else "1000"
    assert verify(t, t["solution"].replace(f"Answer: {t['answer']}", f"Answer: {wrong}")) == 0.0
    assert verify(t, f"Answer: {wrong}\nAnswer: {t['answer']}.") == 1.0  # the last one counts
    assert verify(t, t["answer"]) == 0.0  # no Answer: line, no credit
    assert verify(t, f"Answer: {t['answer']}0") == 0.0
    assert final_answer("nothing") is None


def test_config_rejects_impossible_tables():
    with pytest.raises(Exception, match="--keys"):
        LookupConfig(keys=2, hops=3)


def test_synth_lookup_cli_writes_tasks_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "t.jsonl"
    args = ["synth", "lookup", "--num-tasks", "3", "--keys", "10", "--hops", "2", "--seed", "5", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 3 and all(r["task"] == "retrieval/lookup" and verify(r, r["solution"]) == 1.0 for r in recs)
    assert json.loads(res.stdout.strip().splitlines()[0])["tasks"]["kept"] == 3
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "--force" in res.output
    assert CliRunner().invoke(app, args + ["--force"]).exit_code == 0


@pytest.mark.parametrize("digits", [2, 3, 6])
def test_code_length_is_a_difficulty_knob(digits):
    t = make_task(5, 2, 40, 3, digits)
    rows = [x.split(" -> ") for x in t["prompt"].split("\n\n")[0].splitlines()[1:]]
    assert all(len(k) == len(v) == digits and k[0] != "0" for k, v in rows)
    assert t["meta"]["digits"] == digits and f"-d{digits}-" in t["id"]
    assert make_task(5, 2, 40, 3) == make_task(5, 2, 40, 3, 4) and "-d4" not in make_task(5, 2, 40, 3)["id"]


def test_too_many_rows_for_the_code_length_is_a_usage_error():
    res = CliRunner().invoke(app, ["synth", "lookup", "--num-tasks", "1", "--keys", "46", "--digits", "2"])
    assert res.exit_code == 2 and "--keys 46: at most 45 rows (2-digit codes)" in res.output
    res = CliRunner().invoke(app, ["synth", "lookup", "--num-tasks", "1", "--digits", "1"])
    assert res.exit_code == 2 and "--digits" in res.output


def test_keys_list_mixes_table_sizes_through_the_cli(tmp_path):
    out = tmp_path / "mix.jsonl"
    res = CliRunner().invoke(app, ["synth", "lookup", "--num-tasks", "5", "--keys", "4,9", "--hops", "2",
                                   "--digits", "3", "--out", str(out)])
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["meta"]["keys"] for r in recs] == [4, 9, 4, 9, 4]
    assert all(verify(r, r["solution"]) == 1.0 for r in recs)
    assert recs[1] == make_task(0, 1, 9, 2, 3)  # the same task as a one-size file of 9 rows would hold
    assert json.loads(res.stdout.strip().splitlines()[0])["keys"] == [4, 9]
    for bad, msg in (("4,x", "--keys 4,x"), ("4,1", "--keys 1")):
        res = CliRunner().invoke(app, ["synth", "lookup", "--num-tasks", "1", "--keys", bad, "--hops", "2"])
        assert res.exit_code == 2 and msg in res.output, res.output
