"""Tool-use tasks: generation with a proof of solvability, and the verifier other stages call.

`make_tool_task(env, seed, index, level)` draws a template of the environment, builds the task
record and runs `self_check` on it: the solution must score 1, the solution with a corrupted answer
must score 0, and, when the solution changes state, the solution without its last state-changing call
must score 0 too. A task failing any of these is discarded (returns None); the caller counts it.
"""

from __future__ import annotations

import json
import random

from sparse_rl.errors import UsageError
from sparse_rl.synth.envs import ENVS, Env
from sparse_rl.synth.envs import calendar as cal_mod
from sparse_rl.synth.envs import code as code_mod
from sparse_rl.synth.envs import combo as combo_mod
from sparse_rl.synth.envs import fs as fs_mod
from sparse_rl.synth.envs import sql as sql_mod
from sparse_rl.synth.envs.base import (SYSTEM_PROMPT, calls_from_messages, corrupt, extract_final, replay_calls,
                                       run_calls, score_state)
from sparse_rl.synth.messages import message_from_text

TEMPLATES = {"fs": fs_mod.TEMPLATES, "sql": sql_mod.TEMPLATES, "calendar": cal_mod.TEMPLATES,
             "code": code_mod.TEMPLATES, "combo": combo_mod.TEMPLATES}


def make_env(task: dict) -> Env:
    meta = task.get("meta") or {}
    name = meta.get("env")
    if name not in ENVS:
        raise UsageError(f"task {task.get('id')}: unknown environment {name!r} (known: {', '.join(ENVS)})")
    if not isinstance(meta.get("state"), dict) or "checks" not in meta:
        raise UsageError(f"task {task.get('id')}: a tool task needs meta.state and meta.checks (make it with `synth agent`)")
    return ENVS[name](meta["state"])


def solution_score(task: dict, calls: list[dict], final_text: str | None) -> float:
    with make_env(task) as env:
        run_calls(env, calls)
        return score_state(task, env, final_text)[0]


def self_check(task: dict) -> tuple[bool, str]:
    meta = task["meta"]
    sol, gold, kind = meta["solution"], str(task["answer"]), meta.get("answer_kind", "text")
    if solution_score(task, sol, f"\\boxed{{{gold}}}") != 1.0:
        return False, "solution does not pass"
    if solution_score(task, sol, f"\\boxed{{{corrupt(gold, kind)}}}") != 0.0:
        return False, "corrupted answer passes"
    mutating = ENVS[meta["env"]].mutating
    idx = [i for i, c in enumerate(sol) if c["name"] in mutating]
    if idx:
        cut = sol[: idx[-1]] + sol[idx[-1] + 1:]
        if solution_score(task, cut, f"\\boxed{{{gold}}}") != 0.0:
            return False, "state check passes without the last state change"
    return True, ""


def make_tool_task(env: str, seed: int, index: int, level: int, template: str | None = None) -> dict | None:
    if env not in TEMPLATES:
        raise UsageError(f"unknown environment '{env}' (known: {', '.join(TEMPLATES)})")
    rng = random.Random(f"{seed}:tool:{env}:{index}")
    tname = template or rng.choice(sorted(TEMPLATES[env]))
    body = TEMPLATES[env][tname](rng, level)
    if not body:
        return None
    tools = ENVS[env].tools()
    task = {"id": f"tool-{env}-s{seed}-{index:06d}",
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": body["prompt"]}],
            "answer": body["answer"], "task": f"tool/{env}", "difficulty": level,
            "meta": {"env": env, "template": tname, "level": level, "seed": seed, "index": index,
                     "answer_kind": body["answer_kind"], "state": body["state"], "tools": tools,
                     "solution": body["solution"], "checks": body["checks"]}}
    ok, _why = self_check(task)
    return task if ok else None


def verify_tool(task: dict, completion: str) -> float:
    """Score a completion for a tool task by replaying its tool calls in a fresh environment.

    `completion` is either a JSON list of OpenAI chat messages (the assistant/tool turns of a
    trajectory), or model text with Hermes-style `<tool_call>{"name":..,"arguments":{..}}</tool_call>`
    blocks, the final answer after the last one.
    """
    calls, final = _parse_completion(completion)
    with make_env(task) as env:
        replay_calls(env, calls)
        return score_state(task, env, final)[0]


def _parse_completion(text: str) -> tuple[list[dict], str | None]:
    s = text.strip()
    if s.startswith("["):
        try:
            msgs = json.loads(s)
        except json.JSONDecodeError:
            msgs = None
        if isinstance(msgs, list) and all(isinstance(m, dict) for m in msgs):
            return calls_from_messages(msgs)
    msg = message_from_text(text)
    calls, _ = calls_from_messages([msg])
    tail = text.rsplit("</tool_call>", 1)[-1]
    return calls, (tail if tail.strip() else None)


__all__ = ["make_tool_task", "make_env", "self_check", "verify_tool", "solution_score", "extract_final"]
