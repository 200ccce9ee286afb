"""`sparse-rl eval math|niah|fidelity`: math accuracy and pass@k; RULER-style needle-in-a-haystack
grids; sparse-vs-dense token fidelity.

Thin layer: parse flags into the stage config dataclasses, call `sparse_rl.eval.*`, print the
summary as a rich table on stderr and JSON on stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from sparse_rl.cli.common import (ADAPTER, BATCH_SIZE_OLD, CONFIG, FORCE, SET, cli_errors, console, device_option, dtype_option,
                                  floats, group, ints, max_batch_option, max_new_tokens_option, old_spelling,
                                  refuse_existing, renamed, samples_option, seed_option, strs, temperature_option,
                                  top_p_option)
from sparse_rl.errors import UsageError

app = group("Evaluate: math accuracy/pass@k from completions; NIAH prompt grids and their scores.")
_MODEL_OLD = typer.Option(None, "--model", hidden=True, help="Deprecated: give the model dir as the first argument.")

def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


@app.command("math")
def math_cmd(
    model: Optional[str] = typer.Argument(None, metavar="MODEL",
                                          help="Sample answers from this model dir (instead of --score) [default: none]"),
    score: Optional[str] = typer.Option(None, "--score", metavar="FILE",
                                        help="Completions JSONL to score, - = stdin [default: none]"),
    problems: Optional[str] = typer.Option(None, "--problems", metavar="FILE",
                                           help="Problems JSONL with gold answers, joined on id (not needed when "
                                                "completions carry 'answer') [default: none]"),
    out: Optional[str] = typer.Option(None, "--out", "-o", metavar="FILE",
                                      help="Per-problem results JSONL [default: none]"),
    summary: Optional[str] = typer.Option(None, "--summary", metavar="FILE",
                                          help="Also write the summary JSON here [default: none]"),
    pass_at: Optional[str] = typer.Option(None, "--pass-at", help="pass@k values, e.g. 1,4,8 [default: 1,2,4,... up to "
                                                                  "the fewest samples of a problem]"),
    k_old: Optional[str] = old_spelling("--k", "--pass-at"),
    model_old: Optional[str] = _MODEL_OLD,
    attention: Optional[str] = typer.Option(None, "--attention", help="With MODEL: dense | sparse [default: dense]"),
    samples: Optional[int] = samples_option(1),
    n_old: Optional[int] = old_spelling("--n", "--samples"),
    temperature: Optional[float] = temperature_option(0.0),
    top_p: Optional[float] = top_p_option(),
    max_new_tokens: Optional[int] = max_new_tokens_option(512),
    seed: Optional[int] = seed_option(),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat",
                                        help="Send plain prompts through the chat template [default: no-chat]"),
    max_batch: Optional[int] = max_batch_option(32),
    batch_size_old: Optional[int] = BATCH_SIZE_OLD,
    device: Optional[str] = device_option(),
    dtype: Optional[str] = dtype_option(),
    completions_out: Optional[str] = typer.Option(None, "--completions-out", metavar="FILE",
                                                  help="With MODEL: also save the sampled completions [default: none]"),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
    force: bool = FORCE,
) -> None:
    """Score completions (--score FILE|-) or sample them (MODEL): answer extraction,
    math-verify equivalence, accuracy, pass@1, pass@k."""
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.eval.math_eval import MathEvalConfig, run

        model = renamed(model, model_old, "--model DIR", "DIR as the first argument")
        pass_at = renamed(pass_at, k_old, "--k", "--pass-at")
        samples = renamed(samples, n_old, "--n", "--samples")
        max_batch = renamed(max_batch, batch_size_old, "--batch-size", "--max-batch")
        cfg = load_config(MathEvalConfig, config, {
            "score": score, "problems": problems, "out": out, "summary": summary, "k": ints("--pass-at", pass_at),
            "model": model, "attention": attention, "samples": samples, "temperature": temperature, "top_p": top_p,
            "max_new_tokens": max_new_tokens, "seed": seed, "chat": chat, "batch_size": max_batch,
            "device": device, "dtype": dtype, "completions_out": completions_out}, sets=set_)
        refuse_existing(force, out=cfg.out, summary=cfg.summary, completions_out=cfg.completions_out)
        result, _ = run(cfg)
        from rich.markup import escape
        from rich.table import Table

        table = Table(title="eval math")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key in ("problems", "samples", "accuracy"):
            table.add_row(key, _fmt(result[key]))
        for kk, v in {"1": result["pass@1"], **result["pass@k"]}.items():
            table.add_row(f"pass@{kk}", _fmt(v))
        for task, t in result["by_task"].items():
            table.add_row(escape(f"accuracy [{task}]"), _fmt(t["accuracy"]))
        table.add_row("extraction", ", ".join(f"{m}={c}" for m, c in result["extraction"].items()))
        if result.get("unscored_problems"):
            table.add_row("problems without completions", str(result["unscored_problems"]))
        console.print(table)
        sys.stdout.write(json.dumps(result) + "\n")


@app.command("niah")
def niah_cmd(
    model: Optional[str] = typer.Argument(None, metavar="MODEL",
                                          help="Run the grid on this model dir (greedy), resumably [default: none]"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", metavar="DIR",
                                            help="Local tokenizer or model dir (for building) [default: none]"),
    preset: Optional[str] = typer.Option(None, "--preset", help="grid (depth x length heatmaps) or ruler (RULER's 13 "
                                                                "tasks, lengths and metrics) [default: grid]"),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat",
                                        help="Send plain prompts through the chat template [default: ruler: when the "
                                             "tokenizer has one; grid: never]"),
    kinds: Optional[str] = typer.Option(None, "--kinds", help="grid: single,multikey,multivalue,multiquery,vt "
                                                              "[default: single]; ruler: niah_single_1,...,vt,cwe,fwe,"
                                                              "qa_1,qa_2 [default: all]"),
    tasks_old: Optional[str] = old_spelling("--tasks", "--kinds"),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="Prompt lengths in tokens, e.g. 1k,4k,16k "
                                                                  "[default: 1k,2k,4k]"),
    depths: Optional[str] = typer.Option(None, "--depths", help="Needle depths in [0,1], e.g. 0,0.5,1 "
                                                                "[default: 0,0.25,0.5,0.75,1]"),
    per_cell: Optional[int] = typer.Option(None, "--per-cell", help="Prompts per (kind, length, depth) cell [default: 1]"),
    samples_old: Optional[int] = old_spelling("--samples", "--per-cell"),
    seed: Optional[int] = seed_option(),
    haystack: Optional[str] = typer.Option(None, "--haystack", metavar="FILE",
                                           help="Filler text file [default: RULER's repeated noise sentences]; "
                                                "ruler: the essay text its essay tasks need"),
    squad: Optional[str] = typer.Option(None, "--squad", metavar="FILE", help="ruler qa_1: a local SQuAD v2 dev JSON [default: none]"),
    hotpotqa: Optional[str] = typer.Option(None, "--hotpotqa", metavar="FILE",
                                           help="ruler qa_2: a local HotpotQA distractor dev JSON [default: none]"),
    prompts_out: Optional[str] = typer.Option(None, "--prompts-out", metavar="FILE",
                                              help="Build the grid: write prompts JSONL, - = stdout [default: none]"),
    prompts: Optional[str] = typer.Option(None, "--prompts", metavar="FILE",
                                          help="Prompts JSONL (from --prompts-out) to score [default: none]"),
    score: Optional[list[str]] = typer.Option(None, "--score", metavar="MODE=FILE",
                                              help="Completions of one attention mode, repeatable (dense=..., "
                                                   "sparse=...) [default: none]"),
    out: Optional[str] = typer.Option(None, "--out", "-o", metavar="DIR",
                                      help="Results dir: cells.jsonl, summary.json, heatmaps [default: none]"),
    force: bool = FORCE,
    model_old: Optional[str] = _MODEL_OLD,
    modes: Optional[str] = typer.Option(None, "--modes", help="With MODEL: dense,sparse [default: both for a "
                                                             "sparse dir, else dense]"),
    device: Optional[str] = device_option(),
    dtype: Optional[str] = dtype_option(),
    max_batch: Optional[int] = max_batch_option(16),
    batch_size_old: Optional[int] = BATCH_SIZE_OLD,
    max_new_tokens: Optional[int] = max_new_tokens_option("RULER's budget, 128; vt 30"),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Build RULER-style NIAH prompts at exact token lengths, or score completions into heatmaps.

    Build: --tokenizer DIR --prompts-out FILE|-. Score: --prompts FILE --score dense=FILE
    [--score sparse=FILE] --out DIR (cells.jsonl, summary.json, heatmap_<mode>.png, difference map).
    Run: MODEL [--modes dense,sparse] --out DIR (greedy; re-running skips finished cells).
    """
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.eval.niah import NiahConfig

        model = renamed(model, model_old, "--model DIR", "DIR as the first argument")
        kinds = renamed(kinds, tasks_old, "--tasks", "--kinds")
        per_cell = renamed(per_cell, samples_old, "--samples", "--per-cell")
        max_batch = renamed(max_batch, batch_size_old, "--batch-size", "--max-batch")
        cfg = load_config(NiahConfig, config, {
            "tokenizer": tokenizer, "preset": preset, "chat": chat, "squad": squad, "hotpotqa": hotpotqa,
            "tasks": strs(kinds), "lengths": ints("--lengths", lengths),
            "depths": floats("--depths", depths), "samples": per_cell, "seed": seed, "haystack": haystack,
            "prompts_out": prompts_out, "prompts": prompts, "score": score or None, "out": out, "model": model,
            "modes": strs(modes), "device": device, "dtype": dtype, "batch_size": max_batch,
            "max_new_tokens": max_new_tokens}, sets=set_)
        refuse_existing(force, prompts_out=cfg.prompts_out)
        if sum(map(bool, (cfg.prompts_out, cfg.score, cfg.model))) != 1:
            raise UsageError("give one of --prompts-out FILE (build prompts), --prompts FILE --score MODE=FILE --out DIR "
                             "(score completions) or MODEL --out DIR (run the grid)")
        if cfg.prompts_out:
            _niah_build(cfg)
        elif cfg.score:
            _niah_score(cfg, force)
        else:
            from sparse_rl.eval.niah_run import run_model_grid

            summary = run_model_grid(cfg)
            _niah_table(summary)
            sys.stdout.write(json.dumps(summary) + "\n")


def _niah_build(cfg) -> None:
    from rich.progress import Progress

    from sparse_rl.eval.niah import build_niah_prompts, load_tokenizer, prompt_plan
    from sparse_rl.io import write_jsonl

    cells, notes = prompt_plan(cfg)
    if not cfg.tokenizer:
        raise UsageError("--tokenizer DIR is required to build prompts at exact token lengths")
    tok = load_tokenizer(cfg.tokenizer)
    for note in notes:
        console.print(f"[yellow]{note}[/]")
    with Progress(console=console, transient=True) as bar:
        job = bar.add_task(f"building {cfg.preset} prompts", total=len(cells))
        recs = build_niah_prompts(tok, cfg, progress=lambda: bar.advance(job))
    n = write_jsonl(cfg.prompts_out, recs)
    tasks = list(dict.fromkeys(c[0] for c in cells))
    depths = f"; depths {cfg.depths}" if cfg.depths else ""
    console.print(f"wrote {n} {cfg.preset} prompts ({', '.join(tasks)}; lengths {cfg.lengths}{depths})"
                  f" to {'stdout' if cfg.prompts_out == '-' else cfg.prompts_out}")


def _niah_score(cfg, force: bool) -> None:
    from sparse_rl.eval.niah_run import score_niah_completions
    from sparse_rl.io import atomic_dir, read_jsonl

    if not cfg.prompts or not cfg.out:
        raise UsageError("--score needs --prompts FILE (the prompts the completions answer) and --out DIR")
    runs: dict[str, str] = {}
    for item in cfg.score:
        mode, sep, path = item.partition("=")
        if not sep or not mode or not path:
            raise UsageError(f"--score {item}: expected MODE=FILE, e.g. dense=dense.jsonl")
        if mode in runs:
            raise UsageError(f"--score {item}: mode '{mode}' given twice")
        runs[mode] = path
    if sum(p == "-" for p in [cfg.prompts, *runs.values()]) > 1:
        raise UsageError("--prompts/--score: only one input can be stdin ('-')")
    recs = read_jsonl(cfg.prompts, required=("id", "prompt", "answer", "task", "meta"))
    for i, r in enumerate(recs, 1):
        if not isinstance(r["answer"], list) or not all(isinstance(a, str) for a in r["answer"]) \
                or not all(k in r["meta"] for k in ("length", "depth", "max_new_tokens")):
            raise UsageError(f"--prompts {cfg.prompts} record {i}: not a NIAH prompt (build it with --prompts-out)")
    completions = {m: read_jsonl(p) for m, p in runs.items()}
    # Scoring is cheap, so it starts fresh in a temp dir renamed into place: a bad input writes nothing.
    with atomic_dir(cfg.out, force=force, flag="--out") as tmp:
        summary = score_niah_completions(recs, completions, tmp)
    _niah_table(summary)
    sys.stdout.write(json.dumps(summary) + "\n")


def _niah_table(summary: dict) -> None:
    from rich.table import Table

    table = Table(title="eval niah (string_match_all)")
    table.add_column("mode")
    table.add_column("mean", justify="right")
    for t in summary["tasks"]:
        table.add_column(t, justify="right")
    for n in summary["lengths"]:
        table.add_column(f"L={n}", justify="right")
    for mode, m in summary["modes"].items():
        table.add_row(mode, _fmt(m["mean"]), *[_fmt(m["by_task"][t]) for t in summary["tasks"]],
                      *[_fmt(m["by_length"][str(n)]) for n in summary["lengths"]])
    console.print(table)
    if "difference" in summary:
        console.print(f"sparse - dense: mean {_fmt(summary['difference']['sparse-dense']['mean'])}")
    for mode, m in summary["modes"].items():
        if "ruler" in m:  # RULER's own table: percent per task and length, Avg. over tasks
            console.print(f"RULER ({mode}) avg by length: " + ", ".join(
                f"{n}: {_fmt(v)}" for n, v in m["ruler"]["avg"].items()))
    for note in summary.get("skipped", []):
        console.print(f"[yellow]{note}[/]")


@app.command("fidelity")
def fidelity_cmd(
    model: Optional[str] = typer.Argument(None, metavar="MODEL",
                                          help="Sparse model dir (from `sparse-rl convert` / `indexer train`) "
                                               "[default: the recipe's model]"),
    data: Optional[str] = typer.Option(None, "--data", metavar="FILE",
                                       help="JSONL of {'text'} or completion records, - = stdin [default: none]"),
    out: Optional[str] = typer.Option(None, "--out", "-o", metavar="DIR",
                                      help="Results dir: records.jsonl, summary.json, plots [default: none]"),
    adapter: Optional[str] = ADAPTER,
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Truncate each sequence to this many tokens "
                                                                        "[default: 4096]"),
    limit: Optional[int] = typer.Option(None, "--limit", help="Score at most this many records, 0 = all [default: 0]"),
    device: Optional[str] = device_option(),
    dtype: Optional[str] = dtype_option(),
    force: bool = FORCE,
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Sparse vs dense on the same tokens: KL by position, top-1 agreement, acceptance min(1, p/q),
    per-layer attention recall of the selector."""
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.eval.fidelity import FidelityConfig, run

        cfg = load_config(FidelityConfig, config, {"model": model, "adapter": adapter, "data": data, "out": out,
                                                   "max_tokens": max_tokens,
                                                   "limit": limit, "device": device, "dtype": dtype}, sets=set_)
        summary = run(cfg, force=force)
        from rich.table import Table

        table = Table(title=f"eval fidelity: {summary['records']} records, {summary['tokens']} tokens")
        for col in ("positions", "tokens", "KL(dense||sparse)", "top-1 agree", "accept mean", "accept p5",
                    "attn recall"):
            table.add_column(col, justify="right")
        for b in summary["by_position"] + [{"from": "all", "to": "", **summary}]:
            table.add_row(f"{b['from']}-{b['to']}" if b["to"] != "" else "all", str(b["tokens"]), f"{b['kl']:.4g}",
                          _fmt(b["top1_agreement"]), _fmt(b["acceptance_mean"]), _fmt(b["acceptance_p5"]),
                          _fmt(b["attn_recall"]))
        console.print(table)
        console.print("attention recall by layer: " + ", ".join(
            f"{i}: {v:.4f}" for i, v in summary["attn_recall_by_layer"].items()))
        sys.stdout.write(json.dumps(summary) + "\n")
