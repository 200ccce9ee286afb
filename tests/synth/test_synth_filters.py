"""Filters drop hand-made bad trajectories (illegal tool, bad JSON, schema-invalid args, wrong
answer, duplicate), keep informative failures labelled, calibrate by pass rate; the HTTP policy
and the reviewer run against a local stub server."""

import json

import pytest

import sparse_rl.synth.pipeline as P
from sparse_rl.synth import filters as F
from sparse_rl.synth.agent import OpenAIChatPolicy, ReplayPolicy, ScriptedPolicy, run_episode
from sparse_rl.synth.messages import tool_call
from sparse_rl.synth.schema import SchemaError, tool, validate
from sparse_rl.synth.tool_tasks import make_tool_task


def _task():
    return make_tool_task("fs", 0, 0, 2, template="total")  # state-changing: write_file + answer


def _turns(task, calls, answer):
    turns = [{"role": "assistant", "content": f"step {i}", "tool_calls": [tool_call(i, n, a)]}
             for i, (n, a) in enumerate(calls)]
    return turns + [{"role": "assistant", "content": f"\\boxed{{{answer}}}"}]


def _sol(task):
    return [(c["name"], c["arguments"]) for c in task["meta"]["solution"]]


def test_schema_validator():
    t = tool("f", "", {"a": {"type": "integer"}, "b": {"type": "string", "enum": ["x", "y"]},
                       "c": {"type": "array", "items": {"type": "string"}}}, required=["a"])
    s = t["function"]["parameters"]
    assert validate({"a": 1, "b": "x", "c": ["u"]}, s) == []
    assert validate({"a": True}, s) and validate({"a": 1.5}, s) and validate({}, s)
    assert validate({"a": 1, "b": "z"}, s) and validate({"a": 1, "c": [1]}, s) and validate({"a": 1, "d": 0}, s)
    with pytest.raises(SchemaError):
        validate(1, {"type": "integer", "minimum": 0})


def test_rule_checks_on_hand_made_trajectories():
    task = _task()
    tools = task["meta"]["tools"]
    good = run_episode(task, ReplayPolicy(_turns(task, _sol(task), task["answer"])))
    assert F.rule_checks(good, tools) == {"format": True, "tool_names": True, "tool_args": True}
    assert F.execution_check(task, good) == 1.0

    illegal = run_episode(task, ReplayPolicy(_turns(task, [("rm_rf", {"path": "."})] + _sol(task), task["answer"])))
    assert F.rule_checks(illegal, tools)["tool_names"] is False

    bad_json = run_episode(task, ReplayPolicy(_turns(task, [("read_file", "{'path': 'x'")] + _sol(task), task["answer"])))
    assert F.rule_checks(bad_json, tools)["tool_args"] is False
    bad_schema = run_episode(task, ReplayPolicy(_turns(task, [("read_file", {"path": 3})] + _sol(task), task["answer"])))
    assert F.rule_checks(bad_schema, tools)["tool_args"] is False

    wrong = run_episode(task, ReplayPolicy(_turns(task, _sol(task), int(task["answer"]) + 5)))
    assert F.rule_checks(wrong, tools)["format"] and F.execution_check(task, wrong) == 0.0
    assert F.label_failure(wrong) == "failure:wrong_answer"
    no_write = run_episode(task, ReplayPolicy(_turns(task, _sol(task)[:-1], task["answer"])))
    assert F.execution_check(task, no_write) == 0.0 and F.label_failure(no_write) == "failure:wrong_state"

    no_final = dict(good, messages=good["messages"][:-1])  # ends on a tool message: no final answer
    assert F.rule_checks(no_final, tools)["format"] is False
    orphan = dict(good, messages=good["messages"] + [{"role": "tool", "tool_call_id": "nope", "content": "x"}])
    assert F.rule_checks(orphan, tools)["format"] is False
    # A stored reward is not trusted: the execution check replays the calls.
    assert F.execution_check(task, dict(wrong, reward=1.0)) == 0.0


def test_dedup_exact_and_near():
    d = F.Deduper(threshold=0.8)
    base = " ".join(f"word{i}" for i in range(200))
    assert d.add(base) is None
    assert d.add("  " + base.upper() + " ") == "exact_duplicate"
    assert d.add(base.replace("word100", "changed")) == "near_duplicate"
    assert d.add(" ".join(f"other{i}" for i in range(200))) is None
    assert F.Deduper().signature(base) == F.Deduper().signature(base)  # deterministic


def test_pipeline_drops_bad_trajectories(monkeypatch):
    """K=6 hand-made attempts per task: good, duplicate, illegal tool, bad JSON, wrong answer,
    and a failure that never used a tool. Each lands in its own counter."""
    def policy_for(cfg, task, k):
        sol = _sol(task)
        return ReplayPolicy([
            _turns(task, sol, task["answer"]),
            _turns(task, sol, task["answer"]),
            _turns(task, [("launch_missiles", {})] + sol, task["answer"]),
            _turns(task, [(sol[0][0], "{bad json")] + sol, task["answer"]),
            _turns(task, sol, task["answer"] + "7"),
            _turns(task, [], task["answer"] + "7"),
        ][k])

    monkeypatch.setattr(P, "_policy_for", policy_for)
    cfg = P.SynthAgentConfig(n=4, envs=["fs", "calendar"], attempts=6)
    tasks, trajs, st = P.run_agent(cfg)
    td = st["trajectories"]["dropped"]
    assert td == {"duplicate": 4, "tool_names": 4, "tool_args": 4, "uninformative_failure": 4}
    assert st["trajectories"]["labels"] == {"success": 4, "failure:wrong_answer": 4}
    # illegal-tool and bad-JSON attempts still solved the task: they count toward the pass rate.
    assert st["pass_rate_histogram"]["4/6"] == 4 and all(t["difficulty"] == pytest.approx(4 / 6) for t in tasks)
    for t in trajs:
        assert t["checks"]["format"] and t["checks"]["tool_names"] and t["checks"]["tool_args"]
        assert (t["reward"] == 1.0) == t["label"].startswith("success")
    # Calibration band: pass rate 4/6 is outside [0, 0.5]: every task and its trajectories go.
    tasks, trajs, st = P.run_agent(P.SynthAgentConfig(n=4, envs=["fs", "calendar"], attempts=6, max_pass=0.5))
    assert tasks == [] and trajs == [] and st["tasks"]["dropped"]["pass_band"] == 4


def test_http_policy_against_local_stub(stub_endpoint):
    StubServer, solver = stub_endpoint
    tasks = [make_tool_task(e, 0, i, 2) for i, e in enumerate(["fs", "sql", "calendar", "code"])]
    with StubServer(solver(tasks)) as srv:
        assert srv.url.startswith("http://127.0.0.1:")
        pol = OpenAIChatPolicy(srv.url, "stub-model", seed=3)
        for task in tasks:
            traj = run_episode(task, pol)
            assert traj["reward"] == 1.0
            assert F.rule_checks(traj, task["meta"]["tools"]) == {"format": True, "tool_names": True, "tool_args": True}
        body = srv.requests[0]["body"]
        assert body["model"] == "stub-model" and body["seed"] == 3 and body["tools"] == tasks[0]["meta"]["tools"]
        # Reviewer through the same interface.
        assert F.review_score(pol, tasks[0], traj) == pytest.approx(0.8)


def test_http_policy_errors_are_one_line():
    from sparse_rl.errors import SparseRLError

    with pytest.raises(SparseRLError, match="cannot reach"):
        OpenAIChatPolicy("http://127.0.0.1:9/v1", "m", timeout=2).chat([{"role": "user", "content": "hi"}], [])
    with pytest.raises(SparseRLError, match="http"):
        OpenAIChatPolicy("ftp://x", "m")


def test_scripted_policy_roundtrip_is_deterministic():
    a = P.run_agent(P.SynthAgentConfig(n=6, seed=5, envs=["fs", "sql", "calendar"], attempts=1))
    b = P.run_agent(P.SynthAgentConfig(n=6, seed=5, envs=["fs", "sql", "calendar"], attempts=1))
    assert json.dumps(a) == json.dumps(b)


def test_message_from_text_for_local_models():
    from sparse_rl.synth.messages import message_from_text

    task = make_tool_task("sql", 0, 3, 2, template="aggregate")
    text = "Let me look.\n" + "".join(f'<tool_call>{json.dumps(c)}</tool_call>' for c in task["meta"]["solution"])
    msg = message_from_text(text)
    assert msg["content"] == "Let me look." and [c["function"]["name"] for c in msg["tool_calls"]] == ["list_tables", "query"]
    bad = message_from_text("<tool_call>{oops</tool_call>")
    assert F.rule_checks({"messages": [bad, {"role": "tool", "tool_call_id": "call_0", "content": "x"},
                                       {"role": "assistant", "content": "1"}]}, task["meta"]["tools"])["tool_names"] is False
    assert message_from_text("\\boxed{3}") == {"role": "assistant", "content": "\\boxed{3}"}


def test_normalize_message_variants():
    from sparse_rl.synth.messages import normalize_message

    m = normalize_message({"role": "assistant", "content": [{"type": "text", "text": "hi"}],
                           "tool_calls": [{"function": {"name": "list_dir", "arguments": {"path": "."}}}]})
    assert m == {"role": "assistant", "content": "hi", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "list_dir", "arguments": '{"path": "."}'}}]}
    task = _task()
    traj = {"messages": [m, {"role": "tool", "tool_call_id": "call_0", "content": "x"},
                         {"role": "assistant", "content": "\\boxed{1}"}]}
    assert F.rule_checks(traj, task["meta"]["tools"]) == {"format": True, "tool_names": True, "tool_args": True}


def test_reviewer_drops_low_scores(stub_endpoint):
    StubServer, solver = stub_endpoint
    cfg = P.SynthAgentConfig(n=3, envs=["fs", "sql", "calendar"], attempts=2, policy="endpoint",
                             endpoint="http://unused", model="stub", reviewer=True, min_review=0.5)
    tasks, _ = P.generate_tool_tasks(cfg)
    solve = solver(tasks, wrong_every=2)

    def behave(body):
        user = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
        if user.startswith("You review"):  # the judge dislikes wrong answers
            right = any("boxed{" + t["answer"] + "}" in user for t in tasks)
            return {"role": "assistant", "content": "SCORE: 9" if right else "SCORE: 2"}
        return solve(body)

    with StubServer(behave) as srv:
        cfg.endpoint = srv.url
        kept, trajs, st = P.run_agent(cfg, tasks)
    assert st["trajectories"]["dropped"] == {"reviewer": 3}
    assert [t["label"] for t in trajs] == ["success"] * 3 and all(t["checks"]["reviewer"] == 0.9 for t in trajs)
