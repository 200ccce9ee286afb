"""Rewards: shaping penalties, the built-in math verifier, and loading a user's reward function.

A reward function has the signature `(completions: list[dict], tasks: list[dict]) -> list[float | None]`
(completion and task records as in docs/DESIGN.md; completions[i] answers tasks[i]). None means "no
verdict": the trainer skips that task. `load_reward_fn(spec)` returns a `RewardFn` that calls the
function and turns every way it can misbehave into a one-line SparseRLError naming the function
and the task id.

Shaping registry `SHAPING`: `fn(lengths [N], *, max_len, cache_len, coef) -> penalties [N]` (<= 0,
added to the verifier's reward), lengths = completion lengths in tokens.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

from sparse_rl.errors import SparseRLError, UsageError
from sparse_rl.rl.algos.registry import Registry

SHAPING = Registry("reward shaping")


def _lengths(lengths) -> torch.Tensor:
    return (lengths if isinstance(lengths, torch.Tensor) else torch.tensor(list(lengths))).float()


@SHAPING.register("overlong")
def overlong_penalty(lengths: torch.Tensor | Sequence[int], *, max_len: int, cache_len: int, coef: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), times `coef`.

    0 for |y| <= max_len - cache_len; ((max_len - cache_len) - |y|) / cache_len, falling linearly
    from 0 to -1, inside the last `cache_len` tokens; -1 beyond max_len. Punishing truncation softly
    keeps a reasonable answer that ran slightly long from getting the same signal as garbage.
    lengths `[N]` -> penalties `[N]` float32.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"overlong penalty needs 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    n = _lengths(lengths)
    soft = max_len - cache_len
    pen = ((soft - n) / cache_len).clamp(-1.0, 0.0)
    return coef * torch.where(n > max_len, torch.full_like(pen, -1.0), pen)


@SHAPING.register("length")
def length_penalty(lengths: torch.Tensor | Sequence[int], *, max_len: int, cache_len: int = 0, coef: float = 1.0) -> torch.Tensor:
    """Linear length penalty -coef * |y| / max_len: every token costs the same (cache_len unused).

    lengths `[N]` -> penalties `[N]` float32.
    """
    return -coef * _lengths(lengths) / float(max_len)


# ----------------------------------------------------------------------------- built-in math reward

def math_verdict(completion_text: str, answer) -> float | None:
    """1.0 if the completion's final answer equals `answer`, else 0.0; None if the gold cannot be read.

    The project's one answer rule (`sparse_rl.eval.answers.answer_verdict`: math-verify, boxed
    answers first), the same that `reward=synth` and `eval math` apply.
    """
    from sparse_rl.eval.answers import answer_verdict

    return answer_verdict(completion_text, answer)


def math_reward(completions: list[dict], tasks: list[dict]) -> list[float | None]:
    """Built-in reward for tasks with an `answer`: `math_verdict(completion["completion"], task["answer"])`.

    A reasoning-gym task (`task: rg/...`) is an error: its answers are scored by the dataset's own
    `score_answer`, which `reward=synth` calls.
    """
    out: list[float | None] = []
    for comp, task in zip(completions, tasks):
        kind = str(task.get("task") or "")
        if kind.startswith("rg/"):
            raise SparseRLError(f"task {task.get('id')} is a reasoning-gym task ({kind}): the math reward would "
                                f"score it with the wrong rule; use reward=synth (reward.fn: synth), which calls "
                                f"the dataset's own score_answer")
        if task.get("answer") is None:
            raise SparseRLError("the task has no 'answer' field; the math reward compares the completion against it")
        out.append(math_verdict(str(comp.get("completion", "")), task["answer"]))
    return out


def synth_reward(completions: list[dict], tasks: list[dict]) -> list[float | None]:
    """Built-in reward dispatching on each task's `task` field through `sparse_rl.synth.verify.verify`
    (math via math-verify, `tool/*` by replaying tool calls, `rg/*` via reasoning-gym)."""
    from sparse_rl.synth.verify import verify

    return [verify(task, str(comp.get("completion", ""))) for comp, task in zip(completions, tasks)]


BUILTIN_REWARDS: dict[str, Callable] = {"math": math_reward, "synth": synth_reward}


# ----------------------------------------------------------------------------- loading user functions


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class RewardFn:
    """A reward function wrapped with validation. Call as `fn(completions, tasks) -> list[float | None]`.

    Raises SparseRLError (one line, naming `name` and the task id) when the function raises, returns
    the wrong number of values, or returns NaN/inf or a non-number. When a batch call raises, the
    tasks are retried one at a time to name the first one that fails.
    """

    def __init__(self, fn: Callable, name: str):
        self.fn = fn
        self.name = name

    def __repr__(self) -> str:
        return f"RewardFn({self.name})"

    def __call__(self, completions: list[dict], tasks: list[dict]) -> list[float | None]:
        if len(completions) != len(tasks):
            raise ValueError(f"{len(completions)} completions for {len(tasks)} tasks")
        ids = [t.get("id", c.get("id")) for c, t in zip(completions, tasks)]
        try:
            out = self.fn(completions, tasks)
        except Exception as batch_err:  # noqa: BLE001 - any failure of user code becomes one clear line
            self._raise_for_first_failure(completions, tasks, ids, batch_err)
        try:
            values = list(out)
        except TypeError:
            raise SparseRLError(
                f"reward function {self.name} returned {type(out).__name__}, expected a list of floats or None "
                f"(batch starting at task id {ids[0] if ids else '-'})"
            ) from None
        if len(values) != len(completions):
            raise SparseRLError(
                f"reward function {self.name} returned {len(values)} rewards for {len(completions)} completions "
                f"(batch starting at task id {ids[0] if ids else '-'}); return one value per completion"
            )
        return [self._check(v, tid) for v, tid in zip(values, ids)]

    def _check(self, v, tid) -> float | None:
        if v is None:
            return None
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise SparseRLError(f"reward function {self.name} returned {v!r} for task id {tid}; expected a float or None")
        f = float(v)
        if not math.isfinite(f):
            raise SparseRLError(f"reward function {self.name} returned {f} for task id {tid}; rewards must be finite (None skips a task)")
        return f

    def _raise_for_first_failure(self, completions, tasks, ids, batch_err: Exception):
        for c, t, tid in zip(completions, tasks, ids):
            try:
                self.fn([c], [t])
            except Exception as e:  # noqa: BLE001
                raise SparseRLError(
                    f"reward function {self.name} raised {type(e).__name__} on task id {tid}: {_one_line(e)}"
                ) from e
        span = f"{ids[0]}..{ids[-1]}" if ids else "-"
        raise SparseRLError(
            f"reward function {self.name} raised {type(batch_err).__name__} on the batch of task ids {span} "
            f"(each task alone succeeds): {_one_line(batch_err)}"
        ) from batch_err


def _import_file(path: Path, spec: str, key: str):
    if not path.is_file():
        raise UsageError(f"{key}: {spec!r}: file {path} does not exist")
    mod_name = f"sparse_rl_user_reward_{abs(hash(str(path.resolve())))}"
    mspec = importlib.util.spec_from_file_location(mod_name, path)
    if mspec is None or mspec.loader is None:
        raise UsageError(f"{key}: {spec!r}: cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mod_name] = module
    try:
        mspec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001
        del sys.modules[mod_name]
        raise SparseRLError(f"{key}: importing {path} failed: {type(e).__name__}: {_one_line(e)}") from e
    return module


def load_reward_fn(spec: str, *, key: str = "reward_fn") -> RewardFn:
    """Resolve a reward function: a built-in name (`math`), `package.module:function`, or `path/to/file.py:function`.

    `key` is the config key or flag the spec came from, named in errors. Unknown names, missing
    modules/files/attributes and non-callables are UsageErrors; a module that fails while importing
    is a SparseRLError. Returns a validating `RewardFn`.
    """
    spec = str(spec).strip()
    if ":" not in spec:
        if spec in BUILTIN_REWARDS:
            return RewardFn(BUILTIN_REWARDS[spec], spec)
        raise UsageError(
            f"{key}: unknown reward {spec!r}; use a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) "
            f"or 'module:function' / 'path/to/file.py:function'"
        )
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise UsageError(f"{key}: {spec!r} must look like 'module:function' or 'path/to/file.py:function'")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(Path(target).expanduser(), spec, key)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise UsageError(f"{key}: {spec!r}: cannot import module {target!r} ({_one_line(e)}); check the name or PYTHONPATH") from e
        except Exception as e:  # noqa: BLE001
            raise SparseRLError(f"{key}: importing module {target!r} failed: {type(e).__name__}: {_one_line(e)}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise UsageError(f"{key}: {spec!r}: {target} has no attribute {attr!r}")
    if not callable(fn):
        raise UsageError(f"{key}: {spec!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return RewardFn(fn, spec)
