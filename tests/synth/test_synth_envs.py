"""Tool environments: solutions pass, corruptions fail, the agent loop replays them to reward 1,
confinement and rules hold."""

import json
import os

import pytest

from sparse_rl.synth import verify
from sparse_rl.synth.agent import ReplayPolicy, ScriptedPolicy, run_episode
from sparse_rl.synth.messages import tool_call
from sparse_rl.synth.envs import CalendarEnv, FsEnv, SqlEnv, ToolError
from sparse_rl.synth.envs.base import corrupt
from sparse_rl.synth.tool_tasks import TEMPLATES, make_tool_task, self_check, solution_score

CASES = [(env, t) for env in sorted(TEMPLATES) for t in sorted(TEMPLATES[env])]
SEEDS = {"code": 4}  # each code-env run starts an interpreter; other envs are cheap


@pytest.mark.parametrize("env,template", CASES)
def test_solution_passes_corruption_fails_and_loop_scores_one(env, template):
    made = 0
    for i in range(SEEDS.get(env, 15)):
        task = make_tool_task(env, seed=i % 3, index=i, level=1 + i % 5, template=template)
        if task is None:  # discarded by its own self-check: allowed, but must be rare
            continue
        made += 1
        meta = task["meta"]
        assert self_check(task) == (True, "")
        gold, kind = task["answer"], meta["answer_kind"]
        assert solution_score(task, meta["solution"], f"\\boxed{{{gold}}}") == 1.0
        assert solution_score(task, meta["solution"], f"\\boxed{{{corrupt(gold, kind)}}}") == 0.0
        # The scripted solution through the agent loop scores 1 ...
        traj = run_episode(task, ScriptedPolicy(task))
        assert traj["reward"] == 1.0 and traj["checks"]["verifier"], traj["messages"][-3:]
        # ... and so does verify() on the trajectory's turns, while a wrong answer does not.
        turns = traj["messages"][len(task["messages"]):]
        assert verify(task, json.dumps(turns)) == 1.0
        assert run_episode(task, ScriptedPolicy(task, answer=corrupt(gold, kind)))["reward"] == 0.0
        # Hermes-style text completions verify too.
        text = "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in meta["solution"]) + f" \\boxed{{{gold}}}"
        assert verify(task, text) == 1.0
        assert verify(task, f"\\boxed{{{gold}}}") == (1.0 if not meta["checks"] or meta["env"] == "sql" and
                                                       task["meta"]["template"] == "aggregate" else 0.0)
    assert made >= SEEDS.get(env, 15) * 0.7


def test_fs_confinement(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host data")
    env = FsEnv({"files": {"a/b.txt": "hello"}})
    try:
        os.symlink(tmp_path, env.root / "link")
        os.symlink(secret, env.root / "leaf")
        for bad in ["../x", "a/../../x", "/etc/passwd", str(secret), "link/secret.txt", "leaf", "a/\x00"]:
            with pytest.raises(ToolError):
                env.call("read_file", {"path": bad})
            with pytest.raises(ToolError):
                env.call("write_file", {"path": bad, "content": "pwned"})
        with pytest.raises(ToolError):
            env.call("list_dir", {"path": "link"})
        assert "secret" not in env.call("search", {"pattern": "host"})  # walks do not follow links
        assert env.call("read_file", {"path": "a/./b.txt"}) == "hello"
        with pytest.raises(ToolError, match="NotADirectoryError|FileExistsError"):  # parent is a file
            env.call("write_file", {"path": "a/b.txt/x", "content": "x"})
        with pytest.raises(ToolError, match="is a directory"):
            env.call("write_file", {"path": "a", "content": "x"})
        env.call("write_file", {"path": "a/c/new.txt", "content": "x"})
        assert (env.root / "a/c/new.txt").read_text() == "x"
    finally:
        env.close()
    assert secret.read_text() == "host data" and sorted(p.name for p in tmp_path.iterdir()) == ["secret.txt"]
    assert not env.root.exists()


def test_sql_authorizer_and_one_statement():
    task = make_tool_task("sql", 0, 1, 2, template="update")
    env = SqlEnv(task["meta"]["state"])
    for sql in ["DELETE FROM orders", "DROP TABLE orders", "ATTACH DATABASE 'x.db' AS x", "PRAGMA writable_schema=1"]:
        with pytest.raises(ToolError):
            env.call("query", {"sql": sql})
    for sql in ["DROP TABLE orders", "CREATE TABLE t(a)", "ATTACH DATABASE 'x.db' AS x", "SELECT 1; DELETE FROM orders",
                "SELECT load_extension('x')"]:
        with pytest.raises(ToolError):
            env.call("execute", {"sql": sql})
    assert not os.path.exists("x.db")
    n = int(env.call("query", {"sql": "SELECT COUNT(*) FROM orders"}).split("\n")[1])
    assert env.call("execute", {"sql": "DELETE FROM orders WHERE id = 1"}) == "1 rows changed"
    assert int(env.call("query", {"sql": "SELECT COUNT(*) FROM orders"}).split("\n")[1]) == n - 1
    with pytest.raises(ToolError, match="invalid arguments"):
        env.call("query", {"sql": 3})
    with pytest.raises(ToolError, match="unknown tool"):
        env.call("drop_everything", {})


def test_calendar_rules():
    env = CalendarEnv({"events": [{"id": 1, "title": "A", "day": "Mon", "start": "10:00", "end": "11:00",
                                   "attendees": ["ana", "ben"]}]})
    ok = {"title": "B", "day": "Mon", "start": "11:00", "end": "11:30", "attendees": ["ana"]}
    for bad, why in [({"start": "10:30"}, "conflict"), ({"start": "08:00", "end": "09:00"}, "office hours"),
                     ({"start": "11:15", "end": "11:45"}, "half hour"), ({"end": "14:00"}, "at most"),
                     ({"attendees": ["zed"]}, "unknown attendee"), ({"attendees": []}, "at least one")]:
        with pytest.raises(ToolError, match=why):
            env.call("create_event", {**ok, **bad})
    with pytest.raises(ToolError, match="invalid arguments"):
        env.call("create_event", {**ok, "day": "Sun"})
    assert env.call("create_event", ok) == "created event 2"
    with pytest.raises(ToolError, match="conflict"):
        env.call("move_event", {"event_id": 2, "day": "Mon", "start": "10:00"})
    assert env.check({"kind": "valid"})


def test_agent_loop_feeds_back_errors_and_recovers():
    task = make_tool_task("calendar", 0, 2, 2, template="schedule")
    sol = task["meta"]["solution"]
    bad_start = dict(sol[-1]["arguments"], start="07:00")
    turns = [{"role": "assistant", "content": "try", "tool_calls": [tool_call(0, "create_event", bad_start)]},
             {"role": "assistant", "content": "oops", "tool_calls": [tool_call(1, "create_event", "{not json")]},
             {"role": "assistant", "content": "fix", "tool_calls": [tool_call(2, "create_event", sol[-1]["arguments"])]},
             {"role": "assistant", "content": f"\\boxed{{{task['answer']}}}"}]
    traj = run_episode(task, ReplayPolicy(turns))
    obs = [m["content"] for m in traj["messages"] if m["role"] == "tool"]
    assert obs[0].startswith("error: events must lie within office hours")
    assert obs[1].startswith("error: arguments are not valid JSON")
    assert traj["reward"] == 1.0 and traj["meta"]["tool_errors"] == 2


class _FuzzPolicy:
    """Random tool names, hostile or ill-typed arguments, broken JSON, odd answers."""

    VALUES = ["", ".", "..", "/etc/passwd", "a/../../x", "data", "x" * 300, "Mon", "09:00", "SELECT * FROM orders",
              "DROP TABLE orders", "\x00", -5, 0, 7, None, ["ana", "zed"], {"a": 1}]

    def __init__(self, seed):
        import random

        self.rng, self.i = random.Random(seed), 0

    def chat(self, messages, tools):
        r = self.rng
        self.i += 1
        if r.random() < 0.15:
            return {"role": "assistant", "content": r.choice(["\\boxed{3}", "", "idk", "\\boxed{09:00}"])}
        fn = r.choice(tools)["function"]
        name = fn["name"] if r.random() < 0.9 else "nope"
        args = {k: r.choice(self.VALUES) for k in fn["parameters"]["properties"]}
        raw = json.dumps(args) if r.random() < 0.9 else "{bad"
        call = tool_call(self.i, name, raw) if r.random() < 0.95 else r.choice(["junk", {"id": "x"}, None])
        return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.mark.parametrize("env", ["fs", "sql", "calendar", "combo"])
def test_loop_survives_hostile_policy(env):
    from sparse_rl.synth import filters as F

    for i in range(6):
        task = make_tool_task(env, 1, i, 1 + i % 4)
        traj = run_episode(task, _FuzzPolicy(i), max_turns=10)
        assert traj["meta"]["turns"] <= 10 and traj["messages"][: len(task["messages"])] == task["messages"]
        F.rule_checks(traj, task["meta"]["tools"])
        assert F.execution_check(task, traj) in (0.0, 1.0)


def test_generators_answers_checked_independently():
    """self_check proves the solution consistent with the verifier; these re-derive the answers the
    generators claim by other means (brute force over the calendar, Python over the rows/files)."""
    from sparse_rl.synth.envs.calendar import hm, mins

    for i in range(20):
        # calendar: no earlier half-hour slot is feasible (tried through the env's own rules)
        for template in ("schedule", "reschedule"):
            task = make_tool_task("calendar", 2, i, 1 + i % 5, template=template)
            if task is None:
                continue
            final = task["meta"]["solution"][-1]
            for s in range(9 * 60, mins(task["answer"]), 30):
                env = CalendarEnv(task["meta"]["state"])
                for c in task["meta"]["solution"][:-1]:
                    env.call(c["name"], c["arguments"])
                args = dict(final["arguments"], start=hm(s))
                if final["name"] == "create_event":
                    args["end"] = hm(s + mins(final["arguments"]["end"]) - mins(final["arguments"]["start"]))
                with pytest.raises(ToolError):
                    env.call(final["name"], args)
        # sql aggregate: recompute the sum in Python from the rows
        task = make_tool_task("sql", 2, i, 1 + i % 5, template="aggregate")
        q = task["messages"][1]["content"]
        rows = task["meta"]["state"]["rows"]
        city = {c[0]: c[2] for c in rows["customers"]}
        status = next(s for s in ("pending", "shipped", "cancelled") if f"amount of {s} orders" in q)
        where = q.split("living in ")[1].split(" ")[0].rstrip("?")
        floor = int(q.split("above ")[1].split("?")[0]) if "above" in q else -1
        want = sum(o[2] for o in rows["orders"] if o[3] == status and city[o[1]] == where and o[2] > floor)
        assert int(task["answer"]) == want
        # fs find: exactly one file holds the code word, and it is the answer
        task = make_tool_task("fs", 2, i, 1 + i % 5, template="find")
        token = task["messages"][1]["content"].split("code word ")[1].split(".")[0]
        holders = [p for p, text in task["meta"]["state"]["files"].items() if token in text]
        assert holders == [task["answer"]]
        # fs total: the sum of cost= values in .txt files under data/, archive excluded
        task = make_tool_task("fs", 2, i, 1 + i % 5, template="total")
        files = task["meta"]["state"]["files"]
        want = sum(int(tok.split("=")[1]) for p, text in files.items()
                   if p.startswith("data/") and p.endswith(".txt") and not p.startswith("data/archive/")
                   for tok in text.split() if tok.startswith("cost="))
        assert int(task["answer"]) == want
