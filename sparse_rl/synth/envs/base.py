"""The tool-environment contract shared by every sandbox, and the task verifier over it.

An environment is built from a JSON-serialisable `state` (stored in the task record's `meta`), so
any stage can rebuild it from the task file alone. It exposes OpenAI tool schemas, executes calls
(`call(name, args) -> observation text`, raising `ToolError` for a refused call, which the agent
loop turns into an error observation the model can correct), and evaluates declarative `checks`
over its final state. A task is `{"id","messages","answer","task":"tool/<env>","difficulty","meta":
{"env","state","tools","solution":[{"name","arguments"}...],"checks":[...],"answer_kind",...}}`.

Scoring (`score_state`): 1.0 iff every check holds on the final state AND the final answer matches
(`answer_matches`); otherwise 0.0. "Hard to solve, easy to verify": `self_check` proves at
generation that the solution scores 1, that a corrupted answer scores 0, and (for tasks that
change state) that the solution without its last state-changing call scores 0.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from sparse_rl.synth.schema import tool_index, validate


class ToolError(Exception):
    """A refused tool call (bad path, rule violation, bad SQL): shown to the model as an error."""


class Env:
    name = "base"
    mutating: frozenset[str] = frozenset()  # tools that change state

    def __init__(self, state: dict):
        self.check_state(state)
        self.state = state

    @classmethod
    def check_state(cls, state: dict) -> None:
        """Refuse task state this environment must not accept (ValueError naming the field); called
        before anything is built, and by readers of task files to name the bad record."""

    @classmethod
    def tools(cls) -> list[dict]:
        raise NotImplementedError

    def call(self, name: str, args: dict) -> str:
        """Validate `args` against the tool's schema, then run `tool_<name>`."""
        schemas = tool_index(self.tools())
        if name not in schemas:
            raise ToolError(f"unknown tool '{name}' (available: {', '.join(schemas)})")
        errs = validate(args, schemas[name])
        if errs:
            raise ToolError("invalid arguments: " + "; ".join(errs))
        try:
            return getattr(self, f"tool_{name}")(**args)
        except ToolError:
            raise
        except Exception as e:  # e.g. OSError from a model's odd path: an observation, not a crash
            raise ToolError(f"{type(e).__name__}: {e}") from None

    def check(self, spec: dict) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_state_files(files: Any, where: str = "meta.state.files") -> dict:
    """A task's data files: an object of relative path -> text, each path staying inside the
    working directory once normalised (ValueError naming the path otherwise)."""
    if not isinstance(files, dict):
        raise ValueError(f"{where}: must be an object mapping relative file paths to text")
    for rel, content in files.items():
        if not isinstance(content, str):
            raise ValueError(f"{where}[{rel!r}]: the content must be a string")
        if not rel or "\x00" in rel or os.path.isabs(rel) or os.path.normpath(rel).split(os.sep)[0] in ("..", "."):
            raise ValueError(f"{where}[{rel!r}]: must be a relative path inside the working directory")
    return files


def resolve_inside(root: Path, rel: str) -> Path:
    """`root / rel`, refusing (ValueError) a path that leaves `root` once `..` and symlinks are
    resolved."""
    real_root = os.path.realpath(root)
    joined = os.path.normpath(os.path.join(real_root, rel))
    for p in (joined, os.path.realpath(joined)):
        if p == real_root or not p.startswith(real_root + os.sep):
            raise ValueError(f"meta.state.files[{rel!r}]: resolves outside the working directory")
    return Path(joined)


def write_state_files(root: Path, files: dict) -> None:
    """Create the (checked) data files under `root`; every path is resolved before the first write,
    and each file is opened with O_NOFOLLOW, so no name or symlink can lead the write outside."""
    plan = [(resolve_inside(root, rel), content) for rel, content in check_state_files(files).items()]
    for p, content in plan:
        p.parent.mkdir(parents=True, exist_ok=True)
        resolve_inside(root, os.path.relpath(p, os.path.realpath(root)))  # parents may have been created by earlier files
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as fh:
            fh.write(content)


SYSTEM_PROMPT = ("You are an agent working in a sandboxed environment through the tools provided. "
                 "Think about what to do, call tools, read their results and correct course if a call "
                 "fails. When you are done, reply without a tool call, giving the final answer as \\boxed{...}.")


def _norm_text(s: str) -> str:
    s = s.strip().strip("`'\".").strip()
    return re.sub(r"\s+", " ", s).casefold()


def extract_final(text: str) -> str:
    """The last \\boxed{...} (brace-balanced) in `text`, else its last non-empty line."""
    i = text.rfind("\\boxed{")
    if i >= 0:
        j, depth = i + len("\\boxed{"), 1
        k = j
        while k < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            k += 1
        if depth == 0:
            return text[j:k - 1].strip()
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def answer_matches(gold: str, text: str | None, kind: str) -> bool:
    if not text:
        return False
    got = extract_final(text)
    if kind == "number":
        from sparse_rl.eval.answers import answer_verdict

        return answer_verdict(f"\\boxed{{{got}}}", gold) == 1.0
    if kind == "time":
        m = re.fullmatch(r"\s*(\d{1,2}):(\d{2})\s*", got)
        g = re.fullmatch(r"(\d{1,2}):(\d{2})", gold)
        return bool(m and g) and (int(m[1]), int(m[2])) == (int(g[1]), int(g[2]))
    return _norm_text(got) == _norm_text(gold)


def corrupt(gold: str, kind: str) -> str:
    if kind == "number":
        return str(int(gold) + 1) if re.fullmatch(r"-?\d+", gold) else gold + "1"
    if kind == "time":
        h, m = map(int, gold.split(":"))
        return f"{(h + 1) % 24:02d}:{m:02d}"
    return gold + "_x"


def run_calls(env: Env, calls: list[dict]) -> list[str]:
    """Execute `[{"name", "arguments"}]` in order; refused calls become 'error: ...' strings."""
    out = []
    for c in calls:
        try:
            out.append(env.call(c["name"], c["arguments"]))
        except ToolError as e:
            out.append(f"error: {e}")
    return out


def score_state(task: dict, env: Env, final_text: str | None) -> tuple[float, dict]:
    """Verifier over final state + answer: (1.0 or 0.0, {"checks": [bool...], "answer": bool})."""
    meta = task["meta"]
    checks = [bool(env.check(spec)) for spec in meta.get("checks", [])]
    ans = answer_matches(str(task["answer"]), final_text, meta.get("answer_kind", "text"))
    return (1.0 if ans and all(checks) else 0.0), {"checks": checks, "answer": ans}


def calls_from_messages(messages: list[dict]) -> tuple[list[dict], str | None]:
    """Tool calls (arguments parsed; unparsable ones kept as the raw string) and the final answer."""
    calls, final = [], None
    for m in messages:
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function") if isinstance(tc, dict) else None
            if not isinstance(fn, dict):
                continue  # malformed: never ran
            raw = fn.get("arguments", "{}")
            try:
                args: Any = json.loads(raw) if isinstance(raw, str) else raw
            except json.JSONDecodeError:
                args = raw
            calls.append({"name": fn.get("name"), "arguments": args})
        final = None if m.get("tool_calls") else m.get("content")
    return calls, final


def replay_calls(env: Env, calls: list[dict]) -> None:
    for c in calls:
        if not isinstance(c.get("arguments"), dict):
            continue  # unparsable arguments: the call never ran
        try:
            env.call(c["name"], c["arguments"])
        except ToolError:
            pass
