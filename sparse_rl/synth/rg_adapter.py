"""Adapter to the reasoning-gym library's procedural generators (optional dependency).

reasoning-gym already ships 100+ generators with their own scorers, so we wrap them rather than
rewrite them: `make_rg_tasks(name, n, seed)` turns `reasoning_gym.create_dataset(name, size=n,
seed=seed)` entries into our prompt/task records (`task` = `rg/<name>`), and `verify_rg` scores a
completion with that dataset's own `score_answer`, re-creating the dataset from (name, seed, size)
stored in `meta` (generation is deterministic for a seed). Without the library installed, asking for
it is a one-line error; nothing else in `synth` needs it.
"""

from __future__ import annotations

import re
from functools import lru_cache

from sparse_rl.errors import UsageError

INSTRUCTION = "Put the final answer between <answer> and </answer>."


def _import():
    try:
        import reasoning_gym
    except ImportError:
        raise UsageError("reasoning-gym is not installed: `pip install reasoning-gym` to use reasoning_gym "
                         "datasets, or drop them from the config") from None
    return reasoning_gym


@lru_cache(maxsize=32)
def _dataset(name: str, seed: int, size: int):
    rg = _import()
    try:
        return rg.create_dataset(name, size=size, seed=seed)
    except Exception as e:
        raise UsageError(f"reasoning_gym dataset '{name}': {e}") from None


def make_rg_tasks(name: str, n: int, seed: int) -> list[dict]:
    ds = _dataset(name, seed, n)
    out = []
    for i in range(n):
        entry = ds[i]
        out.append({"id": f"rg-{name}-s{seed}-{i:06d}", "prompt": f"{entry['question']}\n\n{INSTRUCTION}",
                    "answer": str(entry["answer"]), "task": f"rg/{name}", "difficulty": None,
                    "meta": {"rg_dataset": name, "rg_seed": seed, "rg_size": n, "rg_index": i}})
    return out


def extract_answer(text: str) -> str:
    m = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
    return m[-1].strip() if m else text.strip()


def verify_rg(task: dict, completion: str) -> float:
    """The reasoning-gym dataset's own `score_answer` of the completion's last <answer>...</answer>
    (the whole text when there is none), the entry rebuilt from (rg_dataset, rg_seed, rg_size,
    rg_index) in the task's `meta`."""
    meta = task.get("meta") or {}
    missing = [k for k in ("rg_dataset", "rg_seed", "rg_size", "rg_index") if k not in meta]
    if missing:
        from sparse_rl.errors import SparseRLError

        raise SparseRLError(f"task {task.get('id')} ({task.get('task')}): meta has no {missing[0]}; reasoning-gym "
                            f"tasks are scored from the record `sparse-rl synth` wrote (keep its meta)")
    ds = _dataset(meta["rg_dataset"], int(meta["rg_seed"]), int(meta["rg_size"]))
    entry = ds[int(meta["rg_index"])]
    return float(ds.score_answer(answer=extract_answer(completion), entry=entry))
