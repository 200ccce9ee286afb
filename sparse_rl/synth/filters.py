"""Multi-level filters for tasks and trajectories.

  1. rule checks (`rule_checks`): message format, tool names known, arguments valid JSON objects that
     satisfy the tool's JSON schema, every tool call answered by a tool message, a final answer;
  2. execution check (`execution_check`): replay the trajectory's tool calls in a fresh environment
     and run the task's verifier over the final state and answer (does not trust the stored reward);
  3. exact and near-duplicate removal (`Deduper`): SHA-1 of normalised text, then MinHash over
     token 3-shingles with LSH banding, dropping items whose estimated Jaccard similarity to a kept
     item reaches the threshold;
  4. optional reviewer score (`review_score`): an LLM judge through the same endpoint interface,
     run last because it is the only filter that costs a model call;
  5. difficulty calibration (`in_band`): pass rate over K attempts within [min_pass, max_pass].
"""

from __future__ import annotations

import hashlib
import json
import re

from sparse_rl.synth.envs.base import calls_from_messages, replay_calls, score_state
from sparse_rl.synth.schema import tool_index, validate

RULES = ("format", "tool_names", "tool_args")


def rule_checks(traj: dict, tools: list[dict]) -> dict[str, bool]:
    schemas = tool_index(tools)
    fmt, names_ok, args_ok = True, True, True
    pending: set = set()
    msgs = traj.get("messages") or []
    last_assistant = None
    for m in msgs:
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "user", "assistant", "tool"):
            fmt = False
            continue
        if role == "assistant":
            last_assistant = m
            if not isinstance(m.get("content"), (str, type(None))):
                fmt = False
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or tc.get("type") != "function" or not tc.get("id"):
                    fmt = False
                    continue
                pending.add(tc["id"])
                name = fn.get("name")
                if name not in schemas:
                    names_ok = False
                    continue
                raw = fn.get("arguments")
                try:
                    args = json.loads(raw) if isinstance(raw, str) else None
                except json.JSONDecodeError:
                    args = None
                if not isinstance(args, dict) or validate(args, schemas[name]):
                    args_ok = False
        elif role == "tool":
            if m.get("tool_call_id") not in pending:
                fmt = False
            pending.discard(m.get("tool_call_id"))
    final_ok = (last_assistant is not None and not last_assistant.get("tool_calls")
                and bool((last_assistant.get("content") or "").strip()))
    return {"format": fmt and not pending and final_ok, "tool_names": names_ok, "tool_args": args_ok}


def execution_check(task: dict, traj: dict) -> float:
    from sparse_rl.synth.tool_tasks import make_env

    calls, final = calls_from_messages(traj["messages"][len(task["messages"]):])
    with make_env(task) as env:
        replay_calls(env, calls)
        return score_state(task, env, final)[0]


REVIEW_PROMPT = ("You review an AI agent's tool-use trajectory for training data quality. Judge whether the "
                 "reasoning is sound, the tool calls are sensible and the final answer follows from the "
                 "observations. Reply with one line `SCORE: <0-10>`.\n\nTask:\n{task}\n\nTrajectory:\n{traj}")


def review_score(policy, task: dict, traj: dict) -> float | None:
    """Reviewer-model score in [0, 1] (None if the reply has no `SCORE: n`)."""
    shown = [{k: m[k] for k in ("role", "content", "tool_calls") if k in m} for m in traj["messages"][1:]]
    prompt = REVIEW_PROMPT.format(task=task["messages"][-1]["content"], traj=json.dumps(shown, indent=1)[:12000])
    reply = policy.chat([{"role": "user", "content": prompt}], [])
    m = re.findall(r"SCORE:\s*(\d+(?:\.\d+)?)", reply.get("content") or "")
    return min(1.0, float(m[-1]) / 10.0) if m else None


def label_failure(traj: dict) -> str | None:
    """Why a rule-clean failure is still worth keeping, or None if it is not informative.

    A failure is informative when the policy actually worked the environment (at least one tool call
    that was not refused): the final answer or the final state was wrong, so it shows a mistake a
    verifier can point at. Running out of turns or never calling a tool teaches nothing.
    """
    tool_msgs = [m for m in traj["messages"] if m.get("role") == "tool"]
    if not any(not (m.get("content") or "").startswith("error:") for m in tool_msgs):
        return None
    if not traj["meta"].get("finished"):
        return None
    ch = traj["checks"]
    if not all(ch.get("state_checks", [])):
        return "failure:wrong_state"
    return "failure:wrong_answer"


# --------------------------------------------------------------------------------------- dedup

_P = (1 << 61) - 1


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def shingles(text: str, k: int = 3) -> set[str]:
    # Word and punctuation tokens, not whitespace-split, so CSV/JSON state compares by its values
    # and expressions by their operators too.
    w = re.findall(r"\w+|[^\w\s]", text.lower()) or [""]
    return {" ".join(w[i:i + k]) for i in range(max(1, len(w) - k + 1))}


class Deduper:
    """Streaming exact + near-duplicate filter. `add(text)` returns None if kept, else
    "exact_duplicate" / "near_duplicate". Deterministic (fixed hash seeds), order-dependent:
    the first of a group is kept."""

    def __init__(self, threshold: float = 0.85, num_perm: int = 64, bands: int = 16):
        assert num_perm % bands == 0
        self.threshold, self.num_perm, self.bands = threshold, num_perm, bands
        self.rows = num_perm // bands
        # (a, b) pairs for the universal hashes h(x) = (a*x + b) mod p, fixed so runs are reproducible.
        seed = hashlib.sha256(b"sparse-rl-minhash").digest()
        self.coef = []
        for i in range(num_perm):
            d = hashlib.sha256(seed + i.to_bytes(4, "little")).digest()
            self.coef.append((int.from_bytes(d[:8], "little") % (_P - 1) + 1, int.from_bytes(d[8:16], "little") % _P))
        self.exact: set[str] = set()
        self.buckets: dict[tuple, list[int]] = {}
        self.sigs: list[list[int]] = []

    def signature(self, text: str) -> list[int]:
        hs = [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") for s in shingles(text)]
        return [min((a * h + b) % _P for h in hs) for a, b in self.coef]

    def add(self, text: str) -> str | None:
        key = hashlib.sha1(_norm(text).encode()).hexdigest()
        if key in self.exact:
            return "exact_duplicate"
        sig = self.signature(text)
        cands: set[int] = set()
        bkeys = [(b, tuple(sig[b * self.rows:(b + 1) * self.rows])) for b in range(self.bands)]
        for bk in bkeys:
            cands.update(self.buckets.get(bk, ()))
        for c in cands:
            other = self.sigs[c]
            if sum(x == y for x, y in zip(sig, other)) / self.num_perm >= self.threshold:
                return "near_duplicate"
        self.exact.add(key)
        idx = len(self.sigs)
        self.sigs.append(sig)
        for bk in bkeys:
            self.buckets.setdefault(bk, []).append(idx)
        return None


def task_text(task: dict) -> str:
    """The text two tasks are compared on: the prompt, plus the initial state for tool tasks (two
    tool tasks may share a prompt and differ only in their files, rows or calendar)."""
    if "prompt" in task:
        text = str(task["prompt"])
    else:
        text = "\n".join(str(m.get("content") or "") for m in task.get("messages", []) if m.get("role") == "user")
    state = (task.get("meta") or {}).get("state")
    return text if state is None else text + "\n" + json.dumps(state, sort_keys=True)


def trajectory_text(traj: dict) -> str:
    """What makes two attempts at one task the same: the calls made and the final answer."""
    calls, final = calls_from_messages(traj["messages"])
    return traj.get("task_id", "") + "\n" + json.dumps(calls, sort_keys=True) + "\n" + str(final)


def in_band(pass_rate: float, lo: float, hi: float) -> bool:
    return lo - 1e-9 <= pass_rate <= hi + 1e-9
