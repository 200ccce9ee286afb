"""A Python code-execution tool: `run_python(code)` in the sandbox of `sparse_rl.synth.sandbox`.

The working directory is private to the episode and persists between calls (files written by one
call are there for the next); it starts with the task's data files and is deleted on close. Every
call is a fresh subprocess under the limits listed in sandbox.py. The limits are the operator's
(the `limits` argument, else the defaults), never the task's: a task file that names
`meta.state.limits` is refused.
"""

from __future__ import annotations

import random

from sparse_rl.synth.envs.base import Env, check_state_files, write_state_files
from sparse_rl.synth.sandbox import Limits, open_workdir, run_python
from sparse_rl.synth.schema import tool


class CodeEnv(Env):
    name = "code"

    def __init__(self, state: dict, limits: Limits | None = None):
        super().__init__(state)
        self.limits = limits or Limits()
        self.wd = open_workdir(self.limits)
        self.workdir = self.wd.path
        try:
            write_state_files(self.workdir, state.get("files", {}))
        except BaseException:
            self.wd.close()
            raise
        self.last = None

    @classmethod
    def check_state(cls, state: dict) -> None:
        if "limits" in state:
            raise ValueError("meta.state.limits: sandbox limits come from the operator's configuration, not from task data")
        check_state_files(state.get("files", {}))

    @classmethod
    def tools(cls) -> list[dict]:
        return [tool("run_python", "Run a Python 3 program in a sandbox (no network, limited CPU time and "
                     "memory; files in the working directory persist between calls). Returns what it "
                     "printed; print the values you need.", {"code": {"type": "string"}})]

    def tool_run_python(self, code: str) -> str:
        self.last = run_python(code, self.limits, workdir=self.wd)
        return self.last.summary()

    def check(self, spec: dict) -> bool:
        raise ValueError(f"code env: unknown check {spec['kind']!r}")

    def close(self) -> None:
        self.wd.close()


# ------------------------------------------------------------------------------------- tasks


def _gen_csv(rng: random.Random, level: int) -> dict:
    groups = ["red", "green", "blue", "amber"][: 2 + min(level, 4) // 2]
    rows = [(i, rng.choice(groups), rng.randint(1, 1000)) for i in range(1, 10 * level + 11)]
    g = rng.choice(groups)
    parity = rng.choice(["odd", "even"])
    want = [v for _, gg, v in rows if gg == g and (v % 2 == 1) == (parity == "odd")]
    if level >= 3:
        answer, what = max(want, default=0) - min(want, default=0), "the difference between the largest and smallest"
        expr = "max(vals) - min(vals) if vals else 0"
    else:
        answer, what = sum(want), "the sum of"
        expr = "sum(vals)"
    csv = "id,group,value\n" + "".join(f"{i},{gg},{v}\n" for i, gg, v in rows)
    prompt = (f"The file data.csv has columns id, group, value. Using Python, compute {what} the {parity} "
              f"values in group '{g}'. Reply with the number.")
    code = ("import csv\n"
            f"vals = [int(r['value']) for r in csv.DictReader(open('data.csv')) if r['group'] == {g!r} "
            f"and int(r['value']) % 2 == {1 if parity == 'odd' else 0}]\n"
            f"print({expr})\n")
    return {"prompt": prompt, "answer": str(answer), "answer_kind": "number",
            "state": {"files": {"data.csv": csv}}, "solution": [{"name": "run_python", "arguments": {"code": code}}],
            "checks": []}


def _gen_compute(rng: random.Random, level: int) -> dict:
    kind = rng.choice(["primes", "fib", "digits"])
    if kind == "primes":
        n = rng.randint(100, 1000) * level
        answer = sum(1 for k in range(2, n) if all(k % d for d in range(2, int(k ** 0.5) + 1)))
        prompt = f"How many prime numbers are smaller than {n}? Use the Python tool."
        code = f"n = {n}\nprint(sum(1 for k in range(2, n) if all(k % d for d in range(2, int(k ** 0.5) + 1))))\n"
    elif kind == "fib":
        n, m = rng.randint(50, 200) * level, rng.choice([97, 1009, 10007, 65521])
        a, b = 0, 1
        for _ in range(n):
            a, b = b, a + b
        answer = a % m
        prompt = f"Let F(0)=0, F(1)=1, F(k)=F(k-1)+F(k-2). What is F({n}) mod {m}? Use the Python tool."
        code = f"a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, a + b\nprint(a % {m})\n"
    else:
        b, e = rng.randint(3, 9), rng.randint(20, 60) * level
        answer = sum(int(c) for c in str(b ** e))
        prompt = f"What is the sum of the decimal digits of {b}^{e}? Use the Python tool."
        code = f"print(sum(int(c) for c in str({b} ** {e})))\n"
    return {"prompt": prompt, "answer": str(answer), "answer_kind": "number", "state": {"files": {}},
            "solution": [{"name": "run_python", "arguments": {"code": code}}], "checks": []}


TEMPLATES = {"csv": _gen_csv, "compute": _gen_compute}
