"""The run dir: the one owner of checkpoints, RNG states, metrics truncation and resume for every
trainer (`indexer train`, `grpo`, and any later one). Layout (docs/DESIGN.md, "Run dir"):

    run_dir/config.yaml            the resolved config (written by the trainer)
    run_dir/metrics.jsonl          one record per logged step (`append_jsonl`)
    run_dir/checkpoints/step-N/    one checkpoint: the trainer's files + rng.pt + meta.json

A checkpoint is built under a temporary name (`checkpoints/.step-N.XXXX.tmp`) and renamed into
place, so a killed run leaves either the whole checkpoint or none; only directories holding a
`meta.json` (written last) count. What goes into a checkpoint besides `meta.json` is the trainer's
business (`save_checkpoint(..., write=fn)`); this module owns the naming, atomicity, pruning, the RNG
states and what a resume does to the metrics log.

Resume: `latest()` gives the newest complete checkpoint; `truncate_metrics()` then drops the
records logged after it (the run repeats those steps) and a cut last line; `clean_orphans()` removes
temporary files and directories that a killed run left behind.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Callable

import torch

from sparse_rl.errors import SparseRLError
from sparse_rl.io import atomic_dir, atomic_write_json, atomic_write_text, drop_cut_last_line, writing

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
RNG_FILE = "rng.pt"
META_FILE = "meta.json"

__all__ = ["checkpoint_root", "list_checkpoints", "latest", "rng_state", "set_rng_state", "save_checkpoint",
           "prune", "truncate_metrics", "last_metrics", "clean_orphans", "torch_save"]


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints `run_dir/checkpoints/step-N/` (those with a meta.json) as `(N, path)`, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = re.match(r"^step-(\d+)$", p.name)
        if m and (p / META_FILE).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest(run_dir: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint as `(step, path)`, or None."""
    ck = list_checkpoints(run_dir)
    return ck[-1] if ck else None


# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    """This process's RNG states: python, numpy, torch CPU and every CUDA device."""
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore `rng_state()`'s output (a state without numpy's, from an older checkpoint, leaves numpy as is)."""
    import numpy as np

    random.setstate(state["python"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- checkpoints


def torch_save(obj, path: Path) -> None:
    """`torch.save` that names the file in a write error (full disk)."""
    with writing(path):
        torch.save(obj, path)


def save_checkpoint(run_dir: str | Path, step: int, write: Callable[[Path], None], meta: dict, *,
                    rng_states=None, keep: int = 0) -> Path:
    """Write `checkpoints/step-{step}` atomically and prune to the newest `keep` (0 = keep all).

    write(tmp): the trainer writes its files into the temporary directory `tmp`. Then `rng.pt`
    (`rng_states`, default this process's `rng_state()`; a list for per-rank states) and last
    `meta.json` (`{"step": step, **meta}`) are added and the directory is renamed into place. A write
    error names the file (and the temporary directory is removed)."""
    final = checkpoint_root(run_dir) / f"step-{step}"
    with atomic_dir(final, force=True, flag="checkpoint") as tmp:
        with writing(final, "checkpoint"):  # files the trainer writes without naming them itself
            write(tmp)
        torch_save(rng_state() if rng_states is None else rng_states, tmp / RNG_FILE)
        atomic_write_json(tmp / META_FILE, {"step": step, **meta})
    prune(run_dir, keep)
    return final


def prune(run_dir: str | Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints (0 = keep all)."""
    if keep > 0:
        for _, old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / META_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SparseRLError(f"checkpoint {path}: unreadable {META_FILE} ({str(e).splitlines()[0][:160]}); "
                            "delete it to resume from the one before") from None


def load_rng(path: Path) -> dict | list:
    return torch.load(path / RNG_FILE, map_location="cpu", weights_only=False)  # python's state is a tuple


# ----------------------------------------------------------------------------- metrics, orphans


def truncate_metrics(run_dir: str | Path, last_step: int, log: Callable[[str], None] | None = None) -> None:
    """Before a resumed run appends again: drop a cut last line of metrics.jsonl (one line to `log`)
    and the records logged after `last_step` (the checkpoint the run resumes from)."""
    p = Path(run_dir) / METRICS
    if not p.is_file():
        return
    drop_cut_last_line(p, log)
    keep = [line for line in p.read_text().splitlines() if line.strip() and _step_of(p, line) <= last_step]
    atomic_write_text(p, "".join(line + "\n" for line in keep))


def _step_of(path: Path, line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        raise SparseRLError(f"{path}: a damaged record before the last line ({line[:60]!r}); fix or remove "
                            "it to resume") from None


def last_metrics(run_dir: str | Path, step: int) -> dict:
    """The last metrics record at or before `step` ({} if none): a finished run's final record on resume."""
    p = Path(run_dir) / METRICS
    if not p.is_file():
        return {}
    recs = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    recs = [r for r in recs if int(r.get("step", 0)) <= step]
    return recs[-1] if recs else {}


def clean_orphans(run_dir: str | Path, outputs: tuple[str | Path, ...] = (), log: Callable[[str], None] | None = None
                  ) -> int:
    """Remove what killed runs left: temporary checkpoint dirs (`checkpoints/.step-N.*.tmp`, `.step-N.old-PID`),
    temporary files of atomic writes in the run dir (`.NAME.*.tmp`), and temporary copies of each of
    `outputs` beside it (`.OUT.*.tmp`). Call at the start of a run, before anything is written."""
    targets: list[Path] = []
    root = checkpoint_root(run_dir)
    if root.is_dir():
        targets += [p for p in root.iterdir() if re.match(r"^\.step-\d+\.(.+\.tmp|old-\d+)$", p.name)]
    rd = Path(run_dir)
    if rd.is_dir():
        targets += [p for p in rd.iterdir() if p.is_file() and re.match(r"^\..+\.(tmp|tmp\.png)$", p.name)]
    for out in outputs:
        o = Path(out)
        if o.parent.is_dir():
            pat = re.compile(rf"^\.{re.escape(o.name)}\.(.+\.tmp|old-\d+)$")
            targets += [p for p in o.parent.iterdir() if pat.match(p.name)]
    for t in targets:
        if t.is_dir():
            shutil.rmtree(t, ignore_errors=True)
        else:
            t.unlink(missing_ok=True)
    if targets and log is not None:
        log(f"removed {len(targets)} temporary file(s) left by an interrupted run ({targets[0].name}, ...)")
    return len(targets)
