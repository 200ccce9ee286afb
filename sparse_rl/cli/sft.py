"""`sparse-rl sft MODEL --data FILE --out DIR`: supervised fine-tuning (full or LoRA) with packing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from sparse_rl.cli.common import cli_errors, console


def command(
    model: Optional[Path] = typer.Argument(None, metavar="MODEL", help="Model dir to fine-tune."),
    data: Optional[Path] = typer.Option(None, "--data", help="JSONL: messages | prompt+completion (or solution) | text."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output model dir."),
    run_dir: Optional[Path] = typer.Option(None, help="Run dir: config, metrics.jsonl, checkpoints [default: OUT.run]"),
    seq_len: Optional[int] = typer.Option(None, help="Tokens per packed row [default: 2048]"),
    batch_size: Optional[int] = typer.Option(None, help="Rows per process per step [default: 8]"),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps, 0 = --epochs over the rows [default: 0]"),
    epochs: Optional[float] = typer.Option(None, help="Passes over the packed rows when --steps is 0 [default: 1]"),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate [default: 2e-5]"),
    lr_warmup: Optional[int] = typer.Option(None, help="Linear warm-up steps before cosine decay [default: 0]"),
    weight_decay: Optional[float] = typer.Option(None, help="AdamW weight decay [default: 0]"),
    grad_clip: Optional[float] = typer.Option(None, help="Gradient-norm clip, 0 = off [default: 1.0]"),
    finetune: Optional[str] = typer.Option(None, help="full | lora [default: full]"),
    lora_r: Optional[int] = typer.Option(None, help="LoRA rank [default: 16]"),
    seed: Optional[int] = typer.Option(None, help="Seed: data order and init of LoRA [default: 0]"),
    log_every: Optional[int] = typer.Option(None, help="Metrics record every N steps [default: 1]"),
    save_every: Optional[int] = typer.Option(None, help="Checkpoint every N steps [default: 100]"),
    keep_checkpoints: Optional[int] = typer.Option(None, help="Newest checkpoints kept, 0 = all [default: 2]"),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda[:N] [default: auto]"),
    dtype: Optional[str] = typer.Option(None, help="auto | float32 | bfloat16 [default: auto]"),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML recipe (flags override it)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the run dir's last checkpoint."),
    force: bool = typer.Option(False, "--force", help="Overwrite OUT and start the run dir over."),
) -> None:
    """Supervised fine-tuning: loss on assistant tokens only (all tokens of `text` records), documents
    packed into rows without attending across each other.

    Prints a JSON summary on stdout; progress on stderr; metrics in RUN_DIR/metrics.jsonl. LoRA runs
    write the merged model to OUT and the adapter to OUT/adapter. Several processes (data parallel):
    `torchrun --nproc-per-node N -m sparse_rl.cli.main sft ...` or `accelerate launch`.
    """
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.sft.config import SFTConfig
        from sparse_rl.sft.trainer import run

        def s(p):
            return str(p) if p is not None else None

        cfg = load_config(SFTConfig, config, dict(
            model=s(model), data=s(data), out=s(out), run_dir=s(run_dir), seq_len=seq_len, batch_size=batch_size,
            steps=steps, epochs=epochs, lr=lr, lr_warmup=lr_warmup, weight_decay=weight_decay, grad_clip=grad_clip,
            finetune=finetune, lora_r=lora_r, seed=seed, log_every=log_every, save_every=save_every,
            keep_checkpoints=keep_checkpoints, device=device, dtype=dtype))
        summary = run(cfg, resume=resume, force=force, console=console)
        import os

        if os.environ.get("RANK", "0") == "0":
            console.print(f"[green]wrote[/] {summary['out']}  ({summary['steps']} steps, "
                          f"loss {summary['last'].get('loss', float('nan')):.4f})")
            typer.echo(json.dumps(summary))
