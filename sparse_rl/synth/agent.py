"""The multi-turn agent loop (think -> call -> observe -> correct) and the policies that drive it.

A policy is anything with `chat(messages, tools) -> assistant message dict` in the OpenAI chat
format: `{"role": "assistant", "content": str | None, "tool_calls": [{"id", "type": "function",
"function": {"name", "arguments": <JSON string>}}]?}`. Three kinds plug in:

  - `ScriptedPolicy(task)`: replays the task's own solution, then answers (the loop's self-test);
    `ReplayPolicy(turns)` replays any fixed list of assistant messages.
  - `OpenAIChatPolicy(endpoint, model)`: POSTs to `<endpoint>/chat/completions` of an
    OpenAI-compatible server the user runs (vLLM, SGLang, llama.cpp, a hosted teacher...), stdlib
    urllib only. `--endpoint` must be a URL the user chose; nothing is contacted by default.
  - a local model: wrap the rollout engine's generate function in a class with the same `chat`
    method (render `messages` + `tools` with the model's chat template, generate, parse tool calls
    out of the text). That adapter belongs with the rollout engine; the loop needs nothing else.

`run_episode` executes tool calls in the task's environment, feeding back observations (a refused
or malformed call becomes an `error: ...` observation so the policy can correct itself) until the
policy answers without a tool call or `max_turns` is reached, then scores the final state and
answer with the task's verifier.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Protocol

from sparse_rl.errors import SparseRLError
from sparse_rl.synth.envs.base import ToolError, score_state
from sparse_rl.synth.messages import message_from_text, normalize_message, tool_call
from sparse_rl.synth.tool_tasks import make_env

class Policy(Protocol):
    def chat(self, messages: list[dict], tools: list[dict]) -> dict:
        """Return the next assistant message (OpenAI format, tool calls' arguments as JSON text)."""
        ...


class ReplayPolicy:
    """Returns the given assistant messages in order, whatever it observes."""

    def __init__(self, turns: list[dict]):
        self.turns = list(turns)
        self.i = 0

    def chat(self, messages: list[dict], tools: list[dict]) -> dict:
        if self.i >= len(self.turns):
            return {"role": "assistant", "content": ""}
        msg = self.turns[self.i]
        self.i += 1
        return msg


class ScriptedPolicy(ReplayPolicy):
    """Replays the task's solution one call per turn, then gives `answer` (default: the gold one)."""

    def __init__(self, task: dict, answer: str | None = None):
        sol = task["meta"]["solution"]
        turns = [{"role": "assistant", "content": f"Step {i + 1}: call {c['name']}.",
                  "tool_calls": [tool_call(i, c["name"], c["arguments"])]} for i, c in enumerate(sol)]
        ans = task["answer"] if answer is None else answer
        turns.append({"role": "assistant", "content": f"Done. \\boxed{{{ans}}}"})
        super().__init__(turns)


class OpenAIChatPolicy:
    """An OpenAI-compatible chat-completions endpoint (`endpoint` is the base URL, e.g.
    http://127.0.0.1:8000/v1). The API key, if any, comes from $OPENAI_API_KEY."""

    def __init__(self, endpoint: str, model: str, temperature: float = 0.7, max_tokens: int = 1024,
                 seed: int | None = None, timeout: float = 120.0):
        if not endpoint.startswith(("http://", "https://")):
            raise SparseRLError(f"--endpoint {endpoint}: expected an http:// or https:// URL")
        self.url = endpoint.rstrip("/") + "/chat/completions"
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens
        self.seed, self.timeout = seed, timeout

    def post(self, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if os.environ.get("OPENAI_API_KEY"):
            headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read().decode())
        except urllib.error.HTTPError as e:
            raise SparseRLError(f"--endpoint {self.url}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise SparseRLError(f"--endpoint {self.url}: cannot reach the server ({getattr(e, 'reason', e)})") from None
        except json.JSONDecodeError:
            raise SparseRLError(f"--endpoint {self.url}: the reply is not JSON") from None

    def chat(self, messages: list[dict], tools: list[dict]) -> dict:
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens}
        if tools:
            body["tools"] = tools
        if self.seed is not None:
            body["seed"] = self.seed
        data = self.post(body)
        try:
            msg = data["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            raise SparseRLError(f"--endpoint {self.url}: reply has no choices[0].message") from None
        return normalize_message(msg)


def _observe(env, tc) -> str:
    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
        return "error: malformed tool call; expected {\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}"
    fn = tc["function"]
    name, raw = fn.get("name"), fn.get("arguments", "{}")
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as e:
        return f"error: arguments are not valid JSON ({e.msg}); send a JSON object"
    if not isinstance(args, dict):
        return "error: arguments must be a JSON object"
    try:
        return env.call(name, args)
    except ToolError as e:
        return f"error: {e}"
    except TypeError as e:  # an argument the schema allowed but the tool rejects
        return f"error: {e}"


def run_episode(task: dict, policy: Policy, max_turns: int = 12) -> dict:
    """One attempt: returns a trajectory `{"id","task","task_id","messages","reward","checks","meta"}`.

    `checks` here holds the verifier's view (`verifier`, `answer`, `state_checks`); the filters add
    the rule checks. `meta.turns` counts assistant turns, `meta.tool_errors` refused calls.
    """
    tools = task["meta"]["tools"]
    messages = [dict(m) for m in task["messages"]]
    n_err = 0
    final = None
    with make_env(task) as env:
        for _turn in range(max_turns):
            msg = policy.chat(messages, tools)
            msg = {"role": "assistant", "content": msg.get("content"),
                   **({"tool_calls": msg["tool_calls"]} if msg.get("tool_calls") else {})}
            messages.append(msg)
            if not msg.get("tool_calls"):
                final = msg.get("content")
                break
            for tc in msg["tool_calls"]:
                obs = _observe(env, tc)
                n_err += obs.startswith("error:")
                tc_id = tc.get("id") if isinstance(tc, dict) else None
                messages.append({"role": "tool", "tool_call_id": tc_id, "content": obs})
        reward, detail = score_state(task, env, final)
    return {"id": task["id"], "task": task["task"], "task_id": task["id"], "messages": messages, "reward": reward,
            "checks": {"verifier": reward == 1.0, "answer": detail["answer"], "state_checks": detail["checks"]},
            "meta": {"turns": sum(m["role"] == "assistant" for m in messages[len(task["messages"]):]),
                     "tool_errors": n_err, "finished": final is not None}}
