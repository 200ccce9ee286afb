"""Chained look-ups over a table in the prompt: a task that sparse attention must solve by retrieval
while it generates.

The prompt is a table of `keys` entries `KEY -> VALUE` (4-digit codes; digits are single tokens for
the project's tokenizers) followed by the question "follow H hops from S". The worked solution writes
each hop out, one line per step, and ends with `Answer: CODE`:

    4821 -> 1930
    1930 -> 7714
    Answer: 7714

so every generated line must find, thousands of tokens back, the one table row whose key is the
code just written. The table is made of chains of `hops` entries (the asked one and distractor
chains of the same shape, shuffled together), every code occurs at most once as a key and once as a
value, so each step has exactly one right row. `keys` sets the context length (about 12 tokens a
row with the tiny-model tokenizer: 180 rows = 2.2K tokens, 700 = 8.4K, measured) and `hops` the
generation length (~12 tokens a hop).

Verification is an exact string match of the last `Answer:` line's code with the gold code (no
math parsing: the answer is a token string).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from sparse_rl.errors import UsageError

TASK = "retrieval/lookup"
_ANSWER_RE = re.compile(r"Answer:\s*(\S+)")


@dataclass
class LookupConfig:
    n: int = 100            # tasks
    seed: int = 0
    keys: int | list[int] | str = 64  # table rows; several ("4,16,48") mix the sizes, task i gets the (i mod n)-th
    hops: int = 2           # look-ups chained in the solution
    digits: int = 4         # code length (one token per digit): a key matches only on all of them
    out: str = "-"          # tasks JSONL
    stats: str | None = None

    def __post_init__(self):
        if self.n < 1:
            raise UsageError(f"--n: must be at least 1, got {self.n}")
        if self.hops < 1:
            raise UsageError(f"--hops: must be at least 1, got {self.hops}")
        self.keys = _sizes(self.keys)
        if not 2 <= self.digits <= 8:
            raise UsageError(f"--digits: expected 2..8, got {self.digits}")
        for k in self.keys:
            if k < self.hops:
                raise UsageError(f"--keys {k}: the table needs at least --hops ({self.hops}) rows")
            if 2 * k > _codes(self.digits):
                raise UsageError(f"--keys {k}: at most {_codes(self.digits) // 2} rows ({self.digits}-digit codes)")


def _sizes(keys) -> list[int]:
    """--keys as a list of table sizes: an int, a list of ints, or "4,16,48"."""
    items = keys if isinstance(keys, list) else str(keys).split(",")
    try:
        out = [int(k) for k in items]
    except (TypeError, ValueError):
        raise UsageError(f"--keys {keys}: expected a row count or counts separated by commas, like 4,16,48") from None
    if not out:
        raise UsageError("--keys: expected at least one row count")
    return out


def _codes(digits: int) -> int:
    """How many codes of `digits` digits without a leading zero (1000..9999 for 4)."""
    return 9 * 10 ** (digits - 1)


def make_task(seed: int, index: int, keys: int, hops: int, digits: int = 4) -> dict:
    """One task record `{"id","prompt","messages","answer","solution","task","difficulty","meta"}`;
    deterministic. `messages` is the prompt as one user turn, so `generate`, `grpo` and `sft` all see
    it through the chat template."""
    rng = random.Random(f"{seed}:lookup:{index}")
    per_chain = hops + 1
    n_chains = -(-keys // hops)
    codes = [str(10 ** (digits - 1) + c) for c in rng.sample(range(_codes(digits)), n_chains * per_chain)]
    chains = [codes[i * per_chain:(i + 1) * per_chain] for i in range(n_chains)]
    rows = [(c[j], c[j + 1]) for c in chains for j in range(hops)][:keys]
    asked = chains[0]  # its rows come first, so the cut above never drops them
    rng.shuffle(rows)
    table = "\n".join(f"{k} -> {v}" for k, v in rows)
    prompt = (f"Table:\n{table}\n\nStart at {asked[0]} and follow the table for {hops} "
              f"step{'s' if hops > 1 else ''}. Write each step, then the answer.")
    steps = "\n".join(f"{asked[j]} -> {asked[j + 1]}" for j in range(hops))
    tag = "" if digits == 4 else f"-d{digits}"  # 4-digit ids as before
    return {"id": f"lookup-s{seed}-k{keys}-h{hops}{tag}-{index:06d}", "prompt": prompt,
            "messages": [{"role": "user", "content": prompt}], "answer": asked[-1],
            "solution": f"{steps}\nAnswer: {asked[-1]}", "task": TASK, "difficulty": hops,
            "meta": {"keys": keys, "hops": hops, "digits": digits, "start": asked[0], "chain": asked,
                     "positions": [next(i for i, r in enumerate(rows) if r[0] == asked[j]) for j in range(hops)]}}


def make_tasks(cfg: LookupConfig) -> tuple[list[dict], dict]:
    sizes = cfg.keys
    tasks = [make_task(cfg.seed, i, sizes[i % len(sizes)], cfg.hops, cfg.digits) for i in range(cfg.n)]
    stats = {"stage": "synth lookup", "seed": cfg.seed, "keys": sizes[0] if len(sizes) == 1 else sizes, "hops": cfg.hops, "digits": cfg.digits,
             "tasks": {"generated": cfg.n, "kept": cfg.n, "dropped": {}}}
    return tasks, stats


def final_answer(completion: str) -> str | None:
    """The code on the last `Answer:` line, or None."""
    found = _ANSWER_RE.findall(completion)
    return found[-1].rstrip(".") if found else None


def verify_lookup(task: dict, completion: str) -> float:
    """1.0 if the completion's last `Answer:` is exactly the gold code, else 0.0."""
    return 1.0 if final_answer(completion) == str(task["answer"]) else 0.0
