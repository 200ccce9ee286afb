"""`sparse-rl synth math|agent` end to end through the real CLI, incl. error paths."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparse_rl.cli.main import app
from sparse_rl.config import load_config
from sparse_rl.synth import verify
from sparse_rl.synth.pipeline import SynthAgentConfig, SynthMathConfig

runner = CliRunner()
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _run(*args):
    return runner.invoke(app, list(map(str, args)))


def _err_line(res):
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def _jsonl(p):
    return [json.loads(x) for x in Path(p).read_text().splitlines()]


def test_math_to_file_deterministic_and_verifiable(tmp_path):
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    res = _run("synth", "math", "--num-tasks", 30, "--seed", 3, "--out", a, "--length", 200)
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout)
    assert stats["tasks"]["kept"] == 30 and sum(stats["by_task"].values()) == 30
    assert _run("synth", "math", "--num-tasks", 30, "--seed", 3, "-o", b, "--length", 200).exit_code == 0
    assert a.read_bytes() == b.read_bytes()
    assert _run("synth", "math", "--num-tasks", 30, "--seed", 4, "-o", c, "--length", 200).exit_code == 0
    assert a.read_bytes() != c.read_bytes()
    recs = _jsonl(a)
    assert len({r["id"] for r in recs}) == 30
    for r in recs:
        assert {"id", "prompt", "answer", "task", "difficulty", "meta"} <= set(r)
        assert verify(r, f"\\boxed{{{r['answer']}}}") == 1.0


def test_math_to_stdout_with_families():
    res = _run("synth", "math", "--num-tasks", 4, "--families", "arith,word")
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in res.stdout.splitlines()]
    assert [r["task"] for r in recs] == ["math/arith"] * 2 + ["math/word"] * 2


def test_agent_end_to_end(tmp_path):
    out, trj, st = tmp_path / "t.jsonl", tmp_path / "tr.jsonl", tmp_path / "st.json"
    res = _run("synth", "agent", "--num-tasks", 6, "--envs", "fs,sql,calendar", "--attempts", 2, "--out", out,
               "--trajectories", trj, "--stats", st)
    assert res.exit_code == 0, res.output
    stats = json.loads(st.read_text())
    assert stats["tasks"]["kept"] == 6 and stats["pass_rate_histogram"]["2/2"] == 6
    assert stats["trajectories"]["dropped"] == {"duplicate": 6}  # the scripted policy repeats itself
    tasks, trajs = _jsonl(out), _jsonl(trj)
    assert all(t["difficulty"] == 1.0 and t["meta"]["pass_rate"] == 1.0 for t in tasks)
    for tr in trajs:
        assert tr["reward"] == 1.0 and tr["label"] == "success" and tr["checks"]["execution"]
        assert any(m.get("tool_calls") for m in tr["messages"]) and tr["messages"][-1]["role"] == "assistant"
    # Seed tasks in: the same tasks, sampled again.
    res = _run("synth", "agent", "--tasks-in", out, "--attempts", 1, "--out", tmp_path / "t2.jsonl")
    assert res.exit_code == 0, res.output
    assert [t["id"] for t in _jsonl(tmp_path / "t2.jsonl")] == [t["id"] for t in tasks]


def test_agent_with_endpoint_and_reviewer(tmp_path, stub_endpoint):
    from sparse_rl.synth.pipeline import generate_tool_tasks

    StubServer, solver = stub_endpoint
    tasks, _ = generate_tool_tasks(SynthAgentConfig(n=3, envs=["fs", "sql", "calendar"]))
    with StubServer(solver(tasks, wrong_every=2)) as srv:
        res = _run("synth", "agent", "--num-tasks", 3, "--envs", "fs,sql,calendar", "--policy", "endpoint",
                   "--endpoint", srv.url, "--model", "stub", "--attempts", 2, "--reviewer", "--out", tmp_path / "t.jsonl",
                   "--trajectories", tmp_path / "tr.jsonl")
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout)
    assert stats["pass_rate_histogram"]["1/2"] == 3  # every second answer is wrong
    labels = sorted(t["label"] for t in _jsonl(tmp_path / "tr.jsonl"))
    assert labels == ["failure:wrong_answer"] * 3 + ["success"] * 3
    assert all(t["checks"]["reviewer"] == 0.8 for t in _jsonl(tmp_path / "tr.jsonl"))


def test_errors_are_one_line_and_write_nothing(tmp_path):
    out, trj = tmp_path / "o.jsonl", tmp_path / "tr.jsonl"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "messages": [], "answer": "1", "task": "tool/fs", "meta": {}}\n{not json\n')
    res = _run("synth", "agent", "--tasks-in", bad, "--out", out, "--trajectories", trj)
    assert res.exit_code == 1 and "bad.jsonl" in _err_line(res)
    bad.write_text("{not json\n")
    res = _run("synth", "agent", "--tasks-in", bad, "--out", out, "--trajectories", trj)
    assert res.exit_code == 1 and "line 1" in _err_line(res)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("n: 3\nfamlies: [arith]\n")
    res = _run("synth", "math", "--config", cfg, "--out", out)
    assert res.exit_code == 2 and "famlies" in _err_line(res)
    res = _run("synth", "agent", "--policy", "endpoint", "--out", out)
    assert res.exit_code == 2 and "--endpoint" in _err_line(res)
    res = _run("synth", "math", "--stats", "-")
    assert res.exit_code == 2 and "stdout" in _err_line(res) and res.stdout == ""
    res = _run("synth", "agent", "--envs", "fs,moon", "--out", out)
    assert res.exit_code == 2 and "moon" in _err_line(res)
    res = _run("synth", "agent", "--policy", "endpoint", "--endpoint", "http://127.0.0.1:9/v1", "--model", "m",
               "--num-tasks", 1, "--out", out, "--trajectories", trj)
    assert res.exit_code == 1 and "cannot reach" in _err_line(res)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "c.yaml"]


def test_reasoning_gym_optional(tmp_path):
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        res = _run("synth", "math", "--reasoning-gym", "leg_counting", "--out", tmp_path / "o.jsonl")
        assert res.exit_code == 2 and "pip install reasoning-gym" in _err_line(res)
        assert not (tmp_path / "o.jsonl").exists()
    else:
        res = _run("synth", "math", "--num-tasks", 4, "--families", "arith", "--reasoning-gym", "leg_counting")
        assert res.exit_code == 0, res.output
        recs = [json.loads(x) for x in res.stdout.splitlines()]
        rg = [r for r in recs if r["task"] == "rg/leg_counting"]
        assert rg and all(verify(r, f"<answer>{r['answer']}</answer>") == 1.0 for r in rg)


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("synth_*.yaml")))
def test_recipes_load(recipe):
    path = RECIPES / recipe
    header = [ln for ln in path.read_text().splitlines() if ln.startswith("#")]
    assert any(ln.startswith("# Launch: sparse-rl synth") for ln in header)  # launch command in the header
    cls = SynthMathConfig if "math" in recipe else SynthAgentConfig
    over = {"endpoint": "http://127.0.0.1:1/v1", "model": "m"} if "teacher" in recipe else {}
    load_config(cls, path, over)


def test_recipes_run_small(tmp_path, stub_endpoint):
    from sparse_rl.synth.pipeline import generate_tool_tasks

    res = _run("synth", "math", "--config", RECIPES / "synth_math.yaml", "--num-tasks", 6, "--length", 100, "-o", tmp_path / "m.jsonl")
    assert res.exit_code == 0, res.output
    res = _run("synth", "agent", "--config", RECIPES / "synth_agent.yaml", "--num-tasks", 4, "-o", tmp_path / "a.jsonl")
    assert res.exit_code == 0, res.output
    teacher = load_config(SynthAgentConfig, RECIPES / "synth_agent_teacher.yaml", {"endpoint": "x", "model": "m", "n": 2})
    StubServer, solver = stub_endpoint
    with StubServer(solver(generate_tool_tasks(teacher)[0], wrong_every=2)) as srv:
        res = _run("synth", "agent", "--config", RECIPES / "synth_agent_teacher.yaml", "--num-tasks", 2, "--endpoint", srv.url,
                   "--model", "stub", "-o", tmp_path / "t.jsonl")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["tasks"]["kept"] == 2  # pass rate 4/8 lies inside the recipe's band


def test_math_calibration_through_endpoint(tmp_path, stub_endpoint):
    """K=4 attempts per task by a stub model that is right on every other request."""
    StubServer, _ = stub_endpoint
    calls = {"n": 0}
    golds = {}
    for line in _run("synth", "math", "--num-tasks", 3, "--families", "arith").stdout.splitlines():
        r = json.loads(line)
        golds[r["prompt"]] = r["answer"]

    def behave(body):
        calls["n"] += 1
        gold = golds[body["messages"][-1]["content"]]
        ans = gold if calls["n"] % 2 else str(int(gold) + 1)
        return {"role": "assistant", "content": f"\\boxed{{{ans}}}"}

    with StubServer(behave) as srv:
        res = _run("synth", "math", "--num-tasks", 3, "--families", "arith", "--policy", "endpoint", "--endpoint", srv.url,
                   "--model", "stub", "--attempts", 4, "--min-pass", 0.25, "--max-pass", 0.75, "-o", tmp_path / "m.jsonl")
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout)
    assert stats["pass_rate_histogram"] == {"0/4": 0, "1/4": 0, "2/4": 3, "3/4": 0, "4/4": 0}
    recs = _jsonl(tmp_path / "m.jsonl")
    assert [r["difficulty"] for r in recs] == [0.5] * 3 and all(r["meta"]["level"] >= 1 for r in recs)
    assert calls["n"] == 12


def test_reasoning_gym_adapter_plumbing(monkeypatch):
    """The adapter against a stand-in module with reasoning-gym's documented API (create_dataset,
    indexing, score_answer): it checks our plumbing, not the real library (not installed here)."""
    import sys
    import types

    class DS:
        def __init__(self, size, seed):
            self.items = [{"question": f"q{seed}-{i}: 2+{i}?", "answer": str(2 + i), "metadata": {}} for i in range(size)]

        def __getitem__(self, i):
            return self.items[i]

        def score_answer(self, answer, entry):
            return 1.0 if answer == entry["answer"] else 0.0

    fake = types.ModuleType("reasoning_gym")
    fake.create_dataset = lambda name, size, seed: DS(size, seed)
    monkeypatch.setitem(sys.modules, "reasoning_gym", fake)
    from sparse_rl.synth import rg_adapter

    rg_adapter._dataset.cache_clear()
    res = _run("synth", "math", "--num-tasks", 4, "--families", "arith", "--reasoning-gym", "toy")
    rg_adapter._dataset.cache_clear()
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in res.stdout.splitlines()]
    rg = [r for r in recs if r["task"] == "rg/toy"]
    assert len(rg) == 2 and "<answer>" in rg[0]["prompt"]
    assert all(verify(r, f"so <answer>{r['answer']}</answer>") == 1.0 for r in rg)
    assert verify(rg[0], "<answer>99</answer>") == 0.0


def test_deterministic_across_processes():
    """Same seed, same bytes, whatever PYTHONHASHSEED a process draws (set order of strings varies)."""
    import os
    import subprocess
    import sys

    code = ("import json\nfrom sparse_rl.synth.pipeline import *\n"
            "print(json.dumps(run_math(SynthMathConfig(n=12, seed=2, length=100))))\n"
            "print(json.dumps(run_agent(SynthAgentConfig(n=8, seed=2, envs=['fs', 'sql', 'calendar', 'combo'], attempts=1))))\n")
    outs = []
    for hashseed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[1] and len(outs[0]) > 1000
