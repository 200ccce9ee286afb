"""`sparse-rl model init`: a small random-init model dir with a local tokenizer (offline)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from sparse_rl.cli.common import CONFIG, FORCE, SET, cli_errors, console, group, seed_option

app = group("Create small offline models.")


@app.command("init")
def init(
    out: Path = typer.Argument(..., metavar="OUT", help="Model dir to write."),
    arch: Optional[str] = typer.Option(None, help="llama | qwen2 | qwen3 | mistral [default: llama]"),
    size: Optional[str] = typer.Option(None, help="tiny (~0.26M) | small (~5.5M) | medium (~28M) | base (~88M) [default: tiny]"),
    seed: Optional[int] = seed_option(),
    vocab_size: Optional[int] = typer.Option(None, help="Tokenizer vocabulary [default: the preset's]"),
    max_position_embeddings: Optional[int] = typer.Option(None, help="Context length [default: 32768]"),
    dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16 weights on disk [default: float32]"),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
    force: bool = FORCE,
) -> None:
    """Create a random-initialised causal LM plus a byte-level BPE tokenizer, fully offline."""
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.modelinit import ModelInitConfig, init_model

        cfg = load_config(ModelInitConfig, config, dict(arch=arch, size=size, seed=seed, vocab_size=vocab_size,
                                                         max_position_embeddings=max_position_embeddings, dtype=dtype),
                          sets=set_)
        with console.status(f"building {cfg.arch}/{cfg.size} model"):
            summary = init_model(out, cfg, force=force)
        console.print(f"[green]wrote[/] {out}  ({summary['params'] / 1e6:.2f}M params, vocab {summary['vocab_size']})")
        typer.echo(json.dumps(summary))
