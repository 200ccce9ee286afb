"""`sparse-rl generate MODEL`: sample completions with the rollout engine (dense or sparse)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from sparse_rl.cli.common import (ADAPTER, BATCH_SIZE_OLD, CONFIG, FORCE, SET, cli_errors, compile_option, console,
                                  device_option, dtype_option, max_batch_option, max_new_tokens_option, old_spelling,
                                  refuse_existing, renamed, samples_option, seed_option, temperature_option,
                                  top_p_option)


def command(
    model: Path = typer.Argument(..., metavar="MODEL", help="Model dir (dense, or sparse from `sparse-rl convert`)."),
    prompts: str = typer.Option(..., "--prompts", metavar="FILE", help="Prompts JSONL ({id, prompt|messages}); - = stdin."),
    out: str = typer.Option("-", "--out", "-o", metavar="FILE", help="Completions JSONL; - = stdout."),
    attention: Optional[str] = typer.Option(None, help="dense | sparse [default: dense]"),
    samples: Optional[int] = samples_option(1),
    n_old: Optional[int] = old_spelling("--n", "--samples"),
    temperature: Optional[float] = temperature_option(1.0),
    top_p: Optional[float] = top_p_option(),
    top_k: Optional[int] = typer.Option(None, help="Top-k sampling, 0 = off [default: 0]"),
    max_new_tokens: Optional[int] = max_new_tokens_option(256),
    max_batch: Optional[int] = max_batch_option(32),
    batch_size_old: Optional[int] = BATCH_SIZE_OLD,
    seed: Optional[int] = seed_option(),
    logprobs: Optional[bool] = typer.Option(None, "--logprobs/--no-logprobs",
                                            help="Record each token's log-prob under the sampling distribution [default: off]"),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop string (repeatable); cut from the text [default: none]"),
    max_seq_len: Optional[int] = typer.Option(None, help="Cache rows per sequence [default: as needed]"),
    adapter: Optional[str] = ADAPTER,
    device: Optional[str] = device_option(),
    dtype: Optional[str] = dtype_option(),
    compile: Optional[bool] = compile_option(),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
    force: bool = FORCE,
) -> None:
    """Sample completions: prompts JSONL in, completions JSONL out (tokens, finish reason, log-probs)."""
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.rl.rollout.generate import GenerateConfig, run_generate
        from sparse_rl.sparse.loader import check_model_dir

        samples = renamed(samples, n_old, "--n", "--samples")
        max_batch = renamed(max_batch, batch_size_old, "--batch-size", "--max-batch")
        refuse_existing(force, out=out)
        cfg = load_config(GenerateConfig, config, dict(
            attention=attention, samples=samples, temperature=temperature, top_p=top_p, top_k=top_k,
            max_new_tokens=max_new_tokens, batch_size=max_batch, seed=seed, logprobs=logprobs,
            stop=list(stop) if stop else None, max_seq_len=max_seq_len, device=device, dtype=dtype,
            compile=compile, adapter=adapter), sets=set_)
        cfg.sampling()  # flag errors before loading anything
        check_model_dir(model)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("generate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task("generate", total=None)

            def progress(done: int, total: int | None) -> None:
                bar.update(task, completed=done, total=total)

            summary = run_generate(model, prompts, None if out == "-" else out, cfg, progress)
        console.print(f"[green]done[/] {summary['completions']} completions for {summary['prompts']} prompts, "
                      f"{summary['generated_tokens']} tokens ({cfg.attention})"
                      + ("" if out == "-" else f" -> {out}"))
