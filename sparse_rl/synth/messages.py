"""Assistant messages in the OpenAI chat format: build a tool call, parse one out of raw model text,
normalise a server's reply. Shared by the agent loop (`agent.py`) and the tool-task verifier
(`tool_tasks.py`), so neither imports the other."""

from __future__ import annotations

import json
import re


def message_from_text(text: str) -> dict:
    """Turn raw model text into an assistant message: Hermes/Qwen-style
    `<tool_call>{"name": .., "arguments": {..}}</tool_call>` blocks become `tool_calls` (a block that
    is not valid JSON is kept as a call named "" with the raw text as arguments, so the rule filter
    sees and drops it); the text outside the blocks is the content. For a local-model policy."""
    calls = []
    for i, blob in enumerate(re.findall(r"<tool_call>(.*?)</tool_call>", text, flags=re.S)):
        try:
            c = json.loads(blob)
            name, args = str(c.get("name", "")), c.get("arguments", {})
        except (json.JSONDecodeError, AttributeError):
            name, args = "", blob.strip()
        calls.append(tool_call(i, name, args))
    content = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S).strip()
    msg = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def tool_call(i: int, name: str, arguments: dict | str) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


def normalize_message(msg: dict) -> dict:
    """Servers differ in small ways: content as a list of parts, arguments as an object rather than
    JSON text, missing call ids or types. Bring a reply to the one form the loop and filters read;
    anything that is not a tool call at all is left for the rule checks to reject."""
    content = msg.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out = {"role": "assistant", "content": content}
    calls = []
    for i, tc in enumerate(msg.get("tool_calls") or []):
        if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
            calls.append(tc)
            continue
        fn = dict(tc["function"])
        if isinstance(fn.get("arguments"), dict):
            fn["arguments"] = json.dumps(fn["arguments"])
        calls.append({"id": tc.get("id") or f"call_{i}", "type": tc.get("type") or "function", "function": fn})
    if calls:
        out["tool_calls"] = calls
    return out
