"""`sparse-rl synth math|lookup|agent`: verifiable tasks, tool environments, trajectories, filtering.

Thin layer: flags -> `SynthMathConfig` / `SynthAgentConfig` (sparse_rl/synth/pipeline.py), run,
write every output atomically at the end (a failed run writes nothing), stats as JSON (to --stats,
or stdout when the tasks go to a file) and as a rich table on stderr.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from sparse_rl.cli.common import (CONFIG, FORCE, SET, cli_errors, console, group, old_spelling, refuse_existing,
                                  renamed, seed_option, strs, temperature_option)
from sparse_rl.errors import UsageError

app = group("Synthesise verifiable math tasks and tool-use trajectories.")

_NUM_OLD = old_spelling("--n", "--num-tasks")
_K_OLD = old_spelling("-k", "--attempts")
_ATTEMPTS = typer.Option(None, "--attempts", help="Attempts per task, K (for the pass rate) [default: 4]")


def _table(stats: dict) -> None:
    from rich.table import Table

    t = Table(title=stats["stage"], show_header=True, header_style="bold")
    t.add_column("what")
    t.add_column("count", justify="right")
    for group in ("tasks", "trajectories"):
        if group not in stats:
            continue
        g = stats[group]
        t.add_row(f"{group} in", str(g.get("generated", g.get("sampled"))))
        for k, v in g["dropped"].items():
            t.add_row(f"  dropped: {k}", str(v))
        t.add_row(f"[green]{group} kept[/]", str(g["kept"]))
        for k, v in g.get("labels", {}).items():
            t.add_row(f"  {k}", str(v))
    for k, v in stats.get("pass_rate_histogram", {}).items():
        t.add_row(f"pass rate {k}", str(v))
    console.print(t)


def _emit(stats: dict, stats_path: Optional[str], out: str, records: list[dict],
          trajectories: Optional[str] = None, trajs: list[dict] = ()) -> None:
    """Write every output of the run together: all are renamed into place only once all are
    written, so a failure (an unwritable --out, a kill) leaves none of them."""
    from sparse_rl.io import dumps, open_outputs

    jobs = [(trajectories, [dumps(r) + "\n" for r in trajs])] if trajectories else []
    jobs.append((out, [dumps(r) + "\n" for r in records]))
    if stats_path:
        jobs.append((stats_path, [json.dumps(stats, indent=2, ensure_ascii=False) + "\n"]))
    with open_outputs(*[p for p, _ in jobs]) as fhs:
        for (_, lines), fh in zip(jobs, fhs):
            fh.writelines(lines)
    if not stats_path and out != "-":
        typer.echo(json.dumps(stats))
    _table(stats)


def _check_outputs(*paths: Optional[str]) -> None:
    if sum(1 for p in paths if p == "-") > 1:
        raise UsageError("only one of --out, --trajectories and --stats can be '-' (stdout)")
    seen = [p for p in paths if p and p != "-"]
    if len(set(seen)) != len(seen):
        raise UsageError("--out, --trajectories and --stats must be different files")
    for p in seen:
        parent = Path(p).parent
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"{p}: {parent} is not a directory")


@app.command("math")
def math_cmd(
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
    num_tasks: Optional[int] = typer.Option(None, "--num-tasks", help="Tasks to generate [default: 100]"),
    n_old: Optional[int] = _NUM_OLD,
    seed: Optional[int] = seed_option(),
    families: Optional[str] = typer.Option(None, help="Comma list of arith,word,vartrack [default: all]"),
    reasoning_gym: Optional[str] = typer.Option(None, "--reasoning-gym",
                                                help="Comma list of reasoning-gym dataset names (needs reasoning-gym) [default: none]"),
    min_level: Optional[int] = typer.Option(None, help="Lowest difficulty level [default: 1]"),
    max_level: Optional[int] = typer.Option(None, help="Highest difficulty level [default: 5]"),
    length: Optional[int] = typer.Option(None, help="vartrack: filler words in the context [default: 512]"),
    dedup_threshold: Optional[float] = typer.Option(None, help="Near-duplicate Jaccard threshold [default: 0.85]"),
    policy: Optional[str] = typer.Option(None, help="none | endpoint: calibrate difficulty by pass rate [default: none]"),
    endpoint: Optional[str] = typer.Option(None, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 [default: none]"),
    model: Optional[str] = typer.Option(None, help="Model name sent to the endpoint [default: none]"),
    temperature: Optional[float] = temperature_option(0.7),
    attempts: Optional[int] = _ATTEMPTS,
    k_old: Optional[int] = _K_OLD,
    min_pass: Optional[float] = typer.Option(None, help="Keep tasks with pass rate >= this [default: 0]"),
    max_pass: Optional[float] = typer.Option(None, help="Keep tasks with pass rate <= this [default: 1]"),
    out: Optional[str] = typer.Option(None, "--out", "-o", metavar="FILE", help="Tasks JSONL, - = stdout [default: -]"),
    stats: Optional[str] = typer.Option(None, metavar="FILE", help="Stats JSON file [default: stdout if --out is a file]"),
    force: bool = FORCE,
) -> None:
    """Math/reasoning tasks with exact answers: prompt/task JSONL for grpo, sft and eval math."""
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.synth.pipeline import SynthMathConfig, run_math

        num_tasks = renamed(num_tasks, n_old, "--n", "--num-tasks")
        attempts = renamed(attempts, k_old, "-k", "--attempts")
        cfg = load_config(SynthMathConfig, config, dict(
            n=num_tasks, seed=seed, families=strs(families), reasoning_gym=strs(reasoning_gym), min_level=min_level,
            max_level=max_level, length=length, dedup_threshold=dedup_threshold, policy=policy, endpoint=endpoint,
            model=model, temperature=temperature, attempts=attempts, min_pass=min_pass, max_pass=max_pass,
            out=out, stats=stats), sets=set_)
        _check_outputs(cfg.out, cfg.stats)
        refuse_existing(force, out=cfg.out, stats=cfg.stats)
        tasks, st = run_math(cfg)
        _emit(st, cfg.stats, cfg.out, tasks)


def _read_tool_tasks(path: str) -> list[dict]:
    from sparse_rl.errors import SparseRLError
    from sparse_rl.io import iter_jsonl
    from sparse_rl.synth.envs import ENVS

    tasks = []
    for i, rec in enumerate(iter_jsonl(path, required=("id", "messages", "answer", "task", "meta")), 1):
        meta = rec["meta"]
        if not isinstance(meta, dict) or meta.get("env") not in ENVS or not {"state", "tools", "solution"} <= set(meta):
            raise SparseRLError(f"{path} record {i} (id {rec['id']}): not a tool task (needs meta.env in "
                                f"{', '.join(ENVS)}, meta.state, meta.tools, meta.solution); make one with `synth agent`")
        try:
            ENVS[meta["env"]].check_state(meta["state"])
        except (ValueError, TypeError, AttributeError) as e:
            raise SparseRLError(f"{path} record {i} (id {rec['id']}): {e}") from None
        tasks.append(rec)
    if not tasks:
        raise SparseRLError(f"{path}: no tasks")
    return tasks


@app.command("lookup")
def lookup_cmd(
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
    num_tasks: Optional[int] = typer.Option(None, "--num-tasks", help="Tasks to generate [default: 100]"),
    seed: Optional[int] = seed_option(),
    keys: Optional[str] = typer.Option(None, help="Table rows: sets the context length, ~12 tokens a row; several "
                                                  "(4,16,48) mix the sizes, task i gets the (i mod n)-th [default: 64]"),
    hops: Optional[int] = typer.Option(None, help="Chained look-ups: sets the generation length [default: 2]"),
    digits: Optional[int] = typer.Option(None, help="Code length, one token per digit: how many tokens a key "
                                                    "is matched on [default: 4]"),
    out: Optional[str] = typer.Option(None, "--out", "-o", metavar="FILE", help="Tasks JSONL, - = stdout [default: -]"),
    stats: Optional[str] = typer.Option(None, metavar="FILE", help="Stats JSON file [default: stdout if --out is a file]"),
    force: bool = FORCE,
) -> None:
    """Chained look-ups over a table in the prompt (retrieval during generation), with worked solutions
    (`solution`, for sft) and an exact-match verifier (task retrieval/lookup, for grpo and eval)."""
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.synth.lookup import LookupConfig, make_tasks

        cfg = load_config(LookupConfig, config, dict(n=num_tasks, seed=seed, keys=keys, hops=hops,
                                                     digits=digits, out=out, stats=stats), sets=set_)
        _check_outputs(cfg.out, cfg.stats)
        refuse_existing(force, out=cfg.out, stats=cfg.stats)
        tasks, st = make_tasks(cfg)
        _emit(st, cfg.stats, cfg.out, tasks)


@app.command("agent")
def agent_cmd(
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
    num_tasks: Optional[int] = typer.Option(None, "--num-tasks", help="Tasks to generate [default: 20]"),
    n_old: Optional[int] = _NUM_OLD,
    seed: Optional[int] = seed_option(),
    envs: Optional[str] = typer.Option(None, help="Comma list of fs,sql,calendar,code,combo [default: all]"),
    min_level: Optional[int] = typer.Option(None, help="Lowest difficulty level [default: 1]"),
    max_level: Optional[int] = typer.Option(None, help="Highest difficulty level [default: 4]"),
    tasks_in: Optional[str] = typer.Option(None, "--tasks-in", metavar="FILE", help="Sample trajectories for these tool tasks instead [default: none]"),
    policy: Optional[str] = typer.Option(None, help="scripted (replay each task's solution) | endpoint [default: scripted]"),
    endpoint: Optional[str] = typer.Option(None, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 [default: none]"),
    model: Optional[str] = typer.Option(None, help="Model name sent to the endpoint [default: none]"),
    temperature: Optional[float] = temperature_option(0.7),
    attempts: Optional[int] = _ATTEMPTS,
    k_old: Optional[int] = _K_OLD,
    max_turns: Optional[int] = typer.Option(None, help="Assistant turns per attempt [default: 12]"),
    keep_failures: Optional[bool] = typer.Option(None, "--keep-failures/--no-keep-failures",
                                                 help="Keep informative failures, labelled [default: keep]"),
    min_pass: Optional[float] = typer.Option(None, help="Keep tasks with pass rate >= this [default: 0]"),
    max_pass: Optional[float] = typer.Option(None, help="Keep tasks with pass rate <= this [default: 1]"),
    reviewer: Optional[bool] = typer.Option(None, "--reviewer/--no-reviewer", help="Score trajectories with a reviewer model [default: no-reviewer]"),
    reviewer_model: Optional[str] = typer.Option(None, help="Reviewer model name [default: --model]"),
    min_review: Optional[float] = typer.Option(None, help="Reviewer score (0-1) to keep [default: 0.5]"),
    out: Optional[str] = typer.Option(None, "--out", "-o", metavar="FILE", help="Kept tasks JSONL, - = stdout [default: -]"),
    trajectories: Optional[str] = typer.Option(None, metavar="FILE", help="Kept trajectories JSONL [default: none]"),
    stats: Optional[str] = typer.Option(None, metavar="FILE", help="Stats JSON file [default: stdout if --out is a file]"),
    force: bool = FORCE,
) -> None:
    """Tool tasks in sandboxed environments, K trajectories each, filtered and calibrated."""
    with cli_errors():
        from rich.progress import Progress

        from sparse_rl.config import load_config
        from sparse_rl.synth.pipeline import SynthAgentConfig, generate_tool_tasks, run_agent

        num_tasks = renamed(num_tasks, n_old, "--n", "--num-tasks")
        attempts = renamed(attempts, k_old, "-k", "--attempts")
        cfg = load_config(SynthAgentConfig, config, dict(
            n=num_tasks, seed=seed, envs=strs(envs), min_level=min_level, max_level=max_level, tasks_in=tasks_in,
            policy=policy, endpoint=endpoint, model=model, temperature=temperature, attempts=attempts,
            max_turns=max_turns, keep_failures=keep_failures, min_pass=min_pass, max_pass=max_pass,
            reviewer=reviewer, reviewer_model=reviewer_model, min_review=min_review, out=out,
            trajectories=trajectories, stats=stats), sets=set_)
        _check_outputs(cfg.out, cfg.trajectories, cfg.stats)
        refuse_existing(force, out=cfg.out, trajectories=cfg.trajectories, stats=cfg.stats)
        if cfg.tasks_in:
            tasks, drops = _read_tool_tasks(cfg.tasks_in), None
        else:
            tasks, drops = generate_tool_tasks(cfg)
        with Progress(console=console, transient=True) as bar:
            job = bar.add_task("sampling trajectories", total=len(tasks) * cfg.attempts)
            kept, trajs, st = run_agent(cfg, tasks, drops, progress=lambda k: bar.advance(job, k))
        _emit(st, cfg.stats, cfg.out, kept, cfg.trajectories, trajs)
