"""`sparse-rl generate MODEL`: sample completions with the rollout engine (dense or sparse)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from sparse_rl.cli.common import cli_errors, console


def command(
    model: Path = typer.Argument(..., metavar="MODEL", help="Model dir (dense, or sparse from `sparse-rl convert`)."),
    prompts: str = typer.Option(..., "--prompts", help="Prompts JSONL ({id, prompt|messages}); - = stdin."),
    out: str = typer.Option("-", "--out", help="Completions JSONL; - = stdout."),
    attention: Optional[str] = typer.Option(None, help="dense | sparse [default: dense]"),
    n: Optional[int] = typer.Option(None, "--n", help="Samples per prompt (share one prefill) [default: 1]"),
    temperature: Optional[float] = typer.Option(None, help="0 = greedy [default: 1.0]"),
    top_p: Optional[float] = typer.Option(None, help="Nucleus sampling, 1 = off [default: 1.0]"),
    top_k: Optional[int] = typer.Option(None, help="Top-k sampling, 0 = off [default: 0]"),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens per completion at most [default: 256]"),
    batch_size: Optional[int] = typer.Option(None, help="Sequences decoded together (cache slots) [default: 32]"),
    seed: Optional[int] = typer.Option(None, help="Sampling seed; same seed, same completions [default: 0]"),
    logprobs: Optional[bool] = typer.Option(None, "--logprobs/--no-logprobs",
                                            help="Record each token's log-prob under the sampling distribution [default: off]"),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop string (repeatable); cut from the text."),
    max_seq_len: Optional[int] = typer.Option(None, help="Cache rows per sequence [default: as needed]"),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda | cuda:N [default: auto]"),
    dtype: Optional[str] = typer.Option(None, help="auto | float32 | bfloat16 | float16 [default: auto]"),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile",
                                           help="torch.compile the decode step (H200, batch 64: 23-36 s to compile a variant, steps 1.15-1.6x faster) [default: off]"),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML recipe with GenerateConfig keys."),
) -> None:
    """Sample completions: prompts JSONL in, completions JSONL out (tokens, finish reason, log-probs)."""
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.rl.rollout.generate import GenerateConfig, run_generate
        from sparse_rl.sparse.loader import check_model_dir

        cfg = load_config(GenerateConfig, config, dict(
            attention=attention, n=n, temperature=temperature, top_p=top_p, top_k=top_k,
            max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, logprobs=logprobs,
            stop=list(stop) if stop else None, max_seq_len=max_seq_len, device=device, dtype=dtype,
            compile=compile))
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
