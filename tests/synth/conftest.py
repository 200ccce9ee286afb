"""Fixtures for synth tests: a local OpenAI-compatible chat-completions stub on 127.0.0.1 for tests (never an external address).

`behaviour(request_body) -> message dict` decides each reply; requests are recorded.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubServer:
    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.requests: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append({"path": self.path, "body": body})
                if self.path != "/v1/chat/completions":
                    self.send_response(404)
                    self.end_headers()
                    return
                msg = stub.behaviour(body)
                data = json.dumps({"id": "x", "object": "chat.completion", "model": body.get("model"),
                                   "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def solver(tasks: list[dict], wrong_every: int = 0):
    """A behaviour that solves `tasks` by their solutions (found by the user prompt), one call per
    turn; with `wrong_every=k`, every k-th request that would answer gives a wrong answer instead."""
    by_prompt = {t["messages"][-1]["content"]: t for t in tasks}
    count = {"answers": 0}

    def behave(body):
        msgs = body["messages"]
        user = [m for m in msgs if m["role"] == "user"][-1]["content"]
        if user.startswith("You review"):
            return {"role": "assistant", "content": "Looks fine.\nSCORE: 8"}
        task = by_prompt[user]
        done = sum(1 for m in msgs if m["role"] == "tool")
        sol = task["meta"]["solution"]
        if done < len(sol):
            c = sol[done]
            return {"role": "assistant", "content": None,
                    "tool_calls": [{"id": f"c{done}", "type": "function",
                                    "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}]}
        count["answers"] += 1
        ans = task["answer"]
        if wrong_every and count["answers"] % wrong_every == 0:
            ans = ans + "9"
        return {"role": "assistant", "content": f"The answer is \\boxed{{{ans}}}"}

    return behave


import pytest  # noqa: E402


@pytest.fixture
def stub_endpoint():
    """(StubServer, solver): start with `with StubServer(solver(tasks)) as srv: srv.url`."""
    return StubServer, solver
