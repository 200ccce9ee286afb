"""`sparse-rl demo`: the whole chain on a tiny model, offline, on a CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from sparse_rl.cli.common import CONFIG, SET, cli_errors, seed_option


def command(
    out: Path = typer.Option(Path("runs/demo"), "--out", "-o", metavar="DIR",
                             help="Run dir (re-running resumes, skipping finished steps)."),
    seed: Optional[int] = seed_option(),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
) -> None:
    """Init a tiny model, convert it to sparse, and compare dense vs sparse (more stages as they land)."""
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.demo import DemoConfig, print_summary, run_demo

        cfg = load_config(DemoConfig, config, dict(seed=seed), sets=set_)
        summary = run_demo(out, cfg)
        print_summary(summary)
        typer.echo(json.dumps(summary))
