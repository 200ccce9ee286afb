"""The one verifier entry point other stages call: `verify(task, completion) -> float` in [0, 1].

Dispatches on the task record's `task` field:
  - `math/*` (and any task with a plain `answer` and no tool environment): the project's one answer
    rule (sparse_rl/eval/answers.py: math-verify, boxed answers first);
  - `tool/*`: replays the completion's tool calls in a fresh environment built from `meta.state`
    and checks the final state and answer (see tool_tasks.verify_tool for the accepted formats);
  - `rg/*`: reasoning-gym's own scorer (needs the optional reasoning-gym package);
  - `retrieval/lookup`: the last `Answer:` code equals the gold code exactly (synth/lookup.py).
"""

from __future__ import annotations

from sparse_rl.errors import SparseRLError


def verify(task: dict, completion: str) -> float:
    kind = str(task.get("task", ""))
    if kind.startswith("tool/"):
        from sparse_rl.synth.tool_tasks import verify_tool

        return verify_tool(task, completion)
    if kind == "retrieval/lookup":
        from sparse_rl.synth.lookup import verify_lookup

        return verify_lookup(task, completion)
    if kind.startswith("rg/"):
        from sparse_rl.synth.rg_adapter import verify_rg

        return verify_rg(task, completion)
    if "answer" not in task or task["answer"] is None:
        raise SparseRLError(f"task {task.get('id')}: no 'answer' to verify against")
    from sparse_rl.synth.math_tasks import verify_math

    return verify_math(str(task["answer"]), completion)
