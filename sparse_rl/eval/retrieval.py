"""Hop-by-hop retrieval of chained look-up completions (synth `retrieval/lookup`): the
needle-in-a-haystack grid of a model trained on the look-up task.

Each hop of a look-up solution (`KEY -> VALUE`, one line) must retrieve one table row from the
prompt; the task records where that row sits (`meta.positions`, row index in a table of
`meta.keys` rows). So every completion yields `hops` retrievals at known depths, and the grid
`[hop, depth bin]` of conditional accuracy (hop j right, given hops 0..j-1 right) shows where a
model, or its sparse attention, loses the row: by depth in the context (NIAH's columns) and by how
far into the generation (the rows). RULER's NIAH asks a format this model never saw, so for it
this grid is the informative one.
"""

from __future__ import annotations

import re
from pathlib import Path

from sparse_rl.errors import SparseRLError

_STEP_RE = re.compile(r"^\s*(\S+)\s*->\s*(\S+)\s*$")


def steps_of(completion: str) -> list[tuple[str, str]]:
    """The `KEY -> VALUE` lines of a completion, in order (other lines skipped)."""
    out = []
    for line in completion.splitlines():
        m = _STEP_RE.match(line)
        if m:
            out.append((m.group(1), m.group(2)))
    return out


def hops_right(task: dict, completion: str) -> list[bool | None]:
    """Per hop j of the task's chain: True if line j is `chain[j] -> chain[j+1]` and every earlier
    hop was right, False if the earlier hops were right and this one is not, None if an earlier hop
    already failed (the hop was never attempted from the right key)."""
    chain = task["meta"]["chain"]
    lines = steps_of(completion)
    out: list[bool | None] = []
    ok = True
    for j in range(len(chain) - 1):
        if not ok:
            out.append(None)
            continue
        ok = j < len(lines) and lines[j] == (chain[j], chain[j + 1])
        out.append(ok)
    return out


def hop_grid(pairs: list[tuple[dict, str]], bins: int = 4) -> dict:
    """Conditional accuracy per (hop, depth bin) over (task, completion) pairs.

    Depth of hop j = `positions[j] / keys` (0 = first table row), cut into `bins` equal bins.
    Returns {"hops": H, "bins": [[lo, hi], ...], "grid": [H][bins] accuracy or None,
    "n": [H][bins] attempts, "by_hop": [H], "by_depth": [bins], "all": overall hop accuracy}."""
    if not pairs:
        raise SparseRLError("hop retrieval: no completions")
    n_hops = max(len(t["meta"]["chain"]) - 1 for t, _ in pairs)
    hit = [[0] * bins for _ in range(n_hops)]
    tried = [[0] * bins for _ in range(n_hops)]
    for task, comp in pairs:
        meta = task["meta"]
        for j, ok in enumerate(hops_right(task, comp)):
            if ok is None:
                continue
            b = min(bins - 1, int(bins * meta["positions"][j] / meta["keys"]))
            tried[j][b] += 1
            hit[j][b] += bool(ok)

    def ratio(h, n):
        return h / n if n else None

    return {"hops": n_hops, "bins": [[b / bins, (b + 1) / bins] for b in range(bins)],
            "grid": [[ratio(hit[j][b], tried[j][b]) for b in range(bins)] for j in range(n_hops)],
            "n": tried,
            "by_hop": [ratio(sum(hit[j]), sum(tried[j])) for j in range(n_hops)],
            "by_depth": [ratio(sum(hit[j][b] for j in range(n_hops)), sum(tried[j][b] for j in range(n_hops)))
                         for b in range(bins)],
            "all": ratio(sum(map(sum, hit)), sum(map(sum, tried)))}


def hop_grid_files(completions: str | Path, tasks: str | Path, bins: int = 4) -> dict:
    """`hop_grid` of a completions JSONL joined on id with its look-up tasks JSONL."""
    from sparse_rl.io import iter_jsonl

    gold = {t["id"]: t for t in iter_jsonl(tasks, required=("id",))}
    pairs = []
    for c in iter_jsonl(completions, required=("id", "completion")):
        task = gold.get(c["id"])
        if task is None:
            raise SparseRLError(f"{completions}: completion id {c['id']!r} is not in {tasks}")
        if "chain" not in task.get("meta", {}):
            raise SparseRLError(f"{tasks}: task {c['id']!r} is not a look-up task (no meta.chain)")
        pairs.append((task, c["completion"]))
    return hop_grid(pairs, bins)
