"""Run a NIAH grid for one or more modes (e.g. dense and sparse), resumably, and draw it.

A *cell* is (mode, task, length, depth): its prompts (one per sample) are answered together and
scored with `string_match_all`; the cell's mean score is one line of `cells.jsonl`, appended as
soon as the cell is done. Re-running with the same out dir skips the cells already there, after
checking that they were built from the same prompts (a hash of the cell's prompt texts). At the
end `summary.json` and the heatmaps are rewritten from all cells of the grid.

Answers come from a *responder* per mode: either a `generate_fn(prompts: list[str],
max_new_tokens: int) -> list[str]` (greedy decoding; the model-backed one is built from the
rollout engine by the CLI) or the completions of an earlier `sparse-rl generate` run, joined on id.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from pathlib import Path
from typing import Callable, Mapping

from sparse_rl.errors import SparseRLError
from sparse_rl.eval.niah import score_output
from sparse_rl.io import append_jsonl, atomic_write_json, drop_cut_last_line, iter_jsonl

GenerateFn = Callable[[list[str], int], list[str]]
Responder = Callable[[list[dict]], list[str]]

CELLS_FILE = "cells.jsonl"
SUMMARY_FILE = "summary.json"


def _depth(value) -> float | None:
    """A cell's depth; None for ruler cells (RULER draws needle depths per sample)."""
    return None if value is None else float(value)


def _cell_of(rec: dict) -> tuple[str, int, float | None]:
    m = rec["meta"]
    return rec["task"], int(m["length"]), _depth(m["depth"])


def _cell_name(mode: str, task: str, length: int, depth: float | None) -> str:
    return f"{mode}/{task}/L{length}" + ("" if depth is None else f"/d{depth:g}")


def _prompt_sha(records: list[dict]) -> str:
    """Fingerprint of what a cell's score depends on: its prompt texts and generation budgets."""
    h = hashlib.sha256()
    for r in records:
        h.update(r["prompt"].encode())
        h.update(f"\x00{r['meta'].get('max_new_tokens')}\x00".encode())
    return h.hexdigest()[:16]


def generate_fn_responder(fn: GenerateFn) -> Responder:
    """Adapt a `generate_fn(prompts, max_new_tokens)` to records (one call per max_new_tokens value)."""

    def respond(records: list[dict]) -> list[str]:
        outs: list[str | None] = [None] * len(records)
        by_budget: dict[int, list[int]] = defaultdict(list)
        for i, r in enumerate(records):
            by_budget[int(r["meta"]["max_new_tokens"])].append(i)
        for budget, idx in sorted(by_budget.items()):
            got = fn([records[i]["prompt"] for i in idx], budget)
            if len(got) != len(idx):
                raise SparseRLError(f"generate_fn returned {len(got)} outputs for {len(idx)} prompts")
            for i, text in zip(idx, got):
                outs[i] = text
        return outs  # type: ignore[return-value]

    return respond


def completions_responder(completions: list[dict], prompts: list[dict], source: str) -> Responder:
    """Answer prompts from completion records joined on `id` (`prompt_id` if present); checks up
    front that every prompt has a completion so nothing is written for a mismatched file."""
    by_id: dict[str, str] = {}
    for i, rec in enumerate(completions, 1):
        if "id" not in rec or not isinstance(rec.get("completion"), str):
            raise SparseRLError(f"{source} record {i}: needs 'id' and a string 'completion'")
        by_id[str(rec.get("prompt_id", rec["id"]))] = rec["completion"]
    missing = [r["id"] for r in prompts if r["id"] not in by_id]
    if missing:
        raise SparseRLError(f"{source}: no completion for prompt '{missing[0]}' ({len(missing)} missing); "
                            f"generate completions for the same prompts file")
    return lambda records: [by_id[r["id"]] for r in records]


def load_cells(out_dir: str | Path) -> dict[tuple, dict]:
    path = Path(out_dir) / CELLS_FILE
    if not path.exists():
        return {}
    return {(c["mode"], c["task"], int(c["length"]), _depth(c["depth"])): c for c in iter_jsonl(drop_cut_last_line(path))}


def run_niah(prompts: list[dict], generate_fns: Mapping[str, GenerateFn], out_dir: str | Path,
             *, batch: int = 16, progress: bool = True) -> dict:
    """Answer and score every cell of the grid in `prompts` for every mode; resumable; returns the summary.

    `generate_fns` maps a mode name ("dense", "sparse", ...) to a greedy
    `generate_fn(prompts: list[str], max_new_tokens: int) -> list[str]`; each call gets the
    prompts of whole cells, about `batch` of them (so an engine can batch them).
    """
    return run_cells(prompts, {m: generate_fn_responder(f) for m, f in generate_fns.items()}, out_dir,
                     batch=batch, progress=progress)


def score_niah_completions(prompts: list[dict], completions: Mapping[str, list[dict]], out_dir: str | Path,
                           *, progress: bool = True) -> dict:
    """Like `run_niah`, with the answers taken from completion records per mode (joined on id)."""
    responders = {m: completions_responder(c, prompts, f"{m} completions") for m, c in completions.items()}
    return run_cells(prompts, responders, out_dir, progress=progress)


def run_cells(prompts: list[dict], responders: Mapping[str, Responder], out_dir: str | Path,
              *, batch: int = 16, progress: bool = True) -> dict:
    """The grid loop behind `run_niah` and `score_niah_completions` (see the module docstring).
    Cells of one mode are answered in groups of about `batch` prompts; each cell is appended to
    cells.jsonl as soon as its group is done."""
    if not prompts:
        raise SparseRLError("no NIAH prompts to run")
    if not responders:
        raise SparseRLError("no modes to run (give at least one generate_fn or completions file)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in prompts:
        cells[_cell_of(r)].append(r)
    done = load_cells(out)
    todo = []
    for mode in responders:
        for key, recs in cells.items():
            prev = done.get((mode, *key))
            if prev is None:
                todo.append((mode, key, recs))
            elif prev.get("prompt_sha") != _prompt_sha(recs):
                raise SparseRLError(f"{out / CELLS_FILE}: cell {_cell_name(mode, *key)} was scored on "
                                    f"different prompts (other seed, tokenizer, haystack, samples or "
                                    f"--max-new-tokens); use a new --out")

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("niah {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), disable=not progress or not todo) as bar:
        job = bar.add_task("cells", total=len(todo))
        for group in _groups(todo, batch):
            mode = group[0][0]
            (task, length, depth) = group[0][1]
            bar.update(job, description=_cell_name(mode, task, length, depth) + (" ..." if len(group) > 1 else ""))
            outputs = responders[mode]([r for _, _, recs in group for r in recs])
            for _, (task, length, depth), recs in group:
                outs, outputs = outputs[:len(recs)], outputs[len(recs):]
                scores = [score_output(o, r) for o, r in zip(outs, recs)]
                cell = {"id": _cell_name(mode, task, length, depth), "mode": mode, "task": task, "length": length,
                        "depth": depth, "score": sum(scores) / len(scores), "n": len(recs),
                        "prompt_sha": _prompt_sha(recs),
                        "samples": [{"id": r["id"], "expected": r["answer"], "output": o, "score": sc,
                                     "needle_depths": r["meta"].get("needle_depths")}
                                    for r, o, sc in zip(recs, outs, scores)]}
                append_jsonl(out / CELLS_FILE, cell)
                done[(mode, task, length, depth)] = cell
                bar.advance(job)
    return write_summary(done, cells.keys(), list(responders), out)


def _groups(todo: list[tuple], batch: int) -> list[list[tuple]]:
    """Consecutive cells of the same mode, about `batch` prompts a group (a cell is never split)."""
    groups: list[list[tuple]] = []
    size = 0
    for item in todo:
        if groups and groups[-1][0][0] == item[0] and size + len(item[2]) <= max(batch, 1):
            groups[-1].append(item)
            size += len(item[2])
        else:
            groups.append([item])
            size = len(item[2])
    return groups


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def write_summary(done: Mapping[tuple, dict], grid_keys, modes: list[str], out: Path) -> dict:
    """summary.json plus heatmap_<mode>.png and, with both dense and sparse,
    diff_sparse_minus_dense.png. Grid cells: depth x length, mean over tasks. Ruler cells (no
    depth): task x length, and per mode RULER's table (`ruler`: percent per task and length, and
    the mean over tasks per length)."""
    from sparse_rl.eval.plots import difference_map, heatmap

    keys = list(grid_keys)
    lengths = sorted({k[1] for k in keys})
    ruler = all(k[2] is None for k in keys)
    if ruler:
        from sparse_rl.eval.ruler import TASKS as RULER_TASKS
        from sparse_rl.eval.ruler import summary_table

        present = {k[0] for k in keys}
        tasks = [t for t in RULER_TASKS if t in present] + sorted(present - set(RULER_TASKS))
        depths: list = []
        rows = [[(t, None)] for t in tasks]  # one row per task
        row_labels, ylabel, metric = tasks, "task", "RULER metric"
    else:
        tasks = sorted({k[0] for k in keys})
        depths = sorted({k[2] for k in keys})
        rows = [[(t, d) for t in tasks] for d in depths]  # one row per depth, mean over tasks
        row_labels, ylabel, metric = [f"{d:g}" for d in depths], "needle depth", "string_match_all"

    def grid(mode: str) -> list[list[float | None]]:
        # columns = lengths (the usual NIAH picture: context length along x)
        return [[_mean([done[(mode, t, n, d)]["score"] for t, d in row if (mode, t, n, d) in done])
                 for n in lengths] for row in rows]

    def mean_where(mode: str, i: int, v) -> float | None:
        return _mean([done[(mode, *k)]["score"] for k in keys if k[i] == v and (mode, *k) in done])

    summary: dict = {"tasks": tasks, "lengths": lengths, "depths": depths, "modes": {}, "files": {"cells": CELLS_FILE}}
    if ruler:
        summary["preset"] = "ruler"
    for mode in modes:
        m = summary["modes"][mode] = {
            "mean": _mean([done[(mode, *k)]["score"] for k in keys if (mode, *k) in done]),
            "by_task": {t: mean_where(mode, 0, t) for t in tasks},
            "by_length": {str(n): mean_where(mode, 1, n) for n in lengths},
            "grid": grid(mode),
        }
        if ruler:
            m["ruler"] = summary_table(done, tasks, lengths, mode)
        else:
            m["by_depth"] = {f"{d:g}": mean_where(mode, 2, d) for d in depths}
        name = f"heatmap_{mode}.png"
        heatmap(m["grid"], row_labels, lengths, out / name, title=f"NIAH {mode} ({', '.join(tasks)}): {metric}",
                xlabel="context length (tokens)", ylabel=ylabel, colorbar_label="score")
        summary["files"][f"heatmap_{mode}"] = name
    if "dense" in modes and "sparse" in modes:
        a, b = summary["modes"]["dense"]["grid"], summary["modes"]["sparse"]["grid"]
        diff = [[None if x is None or y is None else y - x for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]
        summary["difference"] = {"sparse-dense": {"mean": _mean([v for row in diff for v in row if v is not None]),
                                                  "grid": diff}}
        difference_map(a, b, row_labels, lengths, out / "diff_sparse_minus_dense.png",
                       title="NIAH sparse - dense", xlabel="context length (tokens)", ylabel=ylabel,
                       name_a="dense", name_b="sparse")
        summary["files"]["difference"] = "diff_sparse_minus_dense.png"
    atomic_write_json(out / SUMMARY_FILE, summary)
    return summary


def _encode(tokenizer, prompt: str) -> list[int]:
    """Plain prompt text with the tokenizer's special tokens, except a BOS the text already holds (a
    ruler prompt through a chat template that starts with it)."""
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))["input_ids"]


def model_generate_fns(model_dir: str, modes: list[str], device: str = "auto", dtype="auto",
                       batch_size: int = 16) -> dict[str, GenerateFn]:
    """Greedy generate_fns, one per attention mode, over ONE loaded rollout engine (switched
    between modes per call, so the weights are in memory once). Prompts are encoded as plain
    text with the tokenizer's special tokens, as the NIAH lengths were measured."""
    from sparse_rl.devices import resolve_device
    from sparse_rl.rl.rollout import SamplingParams, load_engine

    eng = load_engine(model_dir, attention=modes[0], device=resolve_device(device), dtype=dtype, max_batch=batch_size)

    def make(mode: str) -> GenerateFn:
        def generate_fn(prompts: list[str], max_new_tokens: int) -> list[str]:
            eng.set_attention(mode)
            ids = [_encode(eng.tokenizer, p) for p in prompts]
            outs = eng.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, logprobs=False))
            return [c.text for c in outs]

        return generate_fn

    return {m: make(m) for m in modes}


def run_model_grid(cfg) -> dict:
    """`eval niah --model`: build the grid with the model's tokenizer, run every mode, resume from
    `cfg.out`. `cfg` is a `NiahConfig`."""
    from sparse_rl.errors import UsageError
    from sparse_rl.eval.niah import build_niah_prompts, load_tokenizer, prompt_plan
    from sparse_rl.sparse.config import SparseConfig
    from sparse_rl.sparse.loader import check_model_dir

    cfg.check()
    if not cfg.out:
        raise UsageError("--model needs --out DIR (results; re-running with the same DIR resumes)")
    if cfg.tokenizer:
        raise UsageError("--tokenizer: with --model the model's own tokenizer measures the prompts; drop --tokenizer")
    check_model_dir(cfg.model, flag="--model")
    is_sparse = SparseConfig.load(cfg.model) is not None
    modes = cfg.modes or (["dense", "sparse"] if is_sparse else ["dense"])
    bad = [m for m in modes if m not in ("dense", "sparse")]
    if bad or (not is_sparse and "sparse" in modes):
        raise UsageError(f"--modes {','.join(modes)}: expected dense and/or sparse (sparse needs a sparse model dir)")
    tok = load_tokenizer(cfg.model, flag="MODEL")
    _, notes = prompt_plan(cfg)
    prompts = build_niah_prompts(tok, cfg)
    summary = run_niah(prompts, model_generate_fns(cfg.model, modes, cfg.device, cfg.dtype, cfg.batch_size), cfg.out,
                       batch=cfg.batch_size)
    if notes:
        summary["skipped"] = notes
    return summary
