"""Composition across environments: the file-system and SQLite tools together in one episode.

Difficulty by composition means more tools as well as more steps: a `combo` task needs a query in
the database and a file written in the workspace, and is verified on both final states.
"""

from __future__ import annotations

import random

from sparse_rl.synth.envs.base import Env, ToolError
from sparse_rl.synth.envs.fs import FsEnv
from sparse_rl.synth.envs.sql import SqlEnv, _gen_aggregate


class ComboEnv(Env):
    name = "combo"
    mutating = FsEnv.mutating | SqlEnv.mutating

    def __init__(self, state: dict):
        super().__init__(state)
        self.fs = FsEnv(state["fs"])
        self.sql = SqlEnv(state["sql"])

    @classmethod
    def check_state(cls, state: dict) -> None:
        if not isinstance(state.get("fs"), dict) or not isinstance(state.get("sql"), dict):
            raise ValueError("meta.state: a combo task needs the objects 'fs' and 'sql'")
        FsEnv.check_state(state["fs"])

    @classmethod
    def tools(cls) -> list[dict]:
        return FsEnv.tools() + SqlEnv.tools()

    def call(self, name: str, args: dict) -> str:
        fs_names = {t["function"]["name"] for t in FsEnv.tools()}
        sql_names = {t["function"]["name"] for t in SqlEnv.tools()}
        if name in fs_names:
            return self.fs.call(name, args)
        if name in sql_names:
            return self.sql.call(name, args)
        raise ToolError(f"unknown tool '{name}' (available: {', '.join(sorted(fs_names | sql_names))})")

    def check(self, spec: dict) -> bool:
        return (self.fs if spec["kind"] == "file" else self.sql).check(spec)

    def close(self) -> None:
        self.fs.close()
        self.sql.close()


def _gen_export(rng: random.Random, level: int) -> dict:
    """Query an aggregate, write it to a report file named in a config file (level >= 2)."""
    body = _gen_aggregate(rng, level)
    total = body["answer"]
    files = {"README.txt": "Reports go where config/report.cfg says.\n" if level >= 2 else "Write reports at the root.\n"}
    target = "report.txt"
    solution = []
    if level >= 2:
        target = f"out/{rng.choice(['q', 'r', 's'])}{rng.randint(10, 99)}.txt"
        files["config/report.cfg"] = f"report_path={target}\n"
        solution.append({"name": "read_file", "arguments": {"path": "config/report.cfg"}})
    where = "the path given in config/report.cfg" if level >= 2 else "report.txt"
    prompt = body["prompt"].replace(" Reply with the number.", "") + (
        f" Write the number to {where} as a single line `total=<N>`, then reply with the number.")
    solution += body["solution"] + [{"name": "write_file", "arguments": {"path": target, "content": f"total={total}\n"}}]
    return {"prompt": prompt, "answer": total, "answer_kind": "number",
            "state": {"fs": {"files": files}, "sql": body["state"]}, "solution": solution,
            "checks": body["checks"] + [{"kind": "file", "path": target, "equals": f"total={total}"}]}


TEMPLATES = {"export": _gen_export}
