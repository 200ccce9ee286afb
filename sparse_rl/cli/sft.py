"""`sparse-rl sft MODEL --data FILE --out DIR`: supervised fine-tuning (full or LoRA) with packing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from sparse_rl.cli.common import (CONFIG, FORCE, GRAD_CLIP, KEEP_CHECKPOINTS, LOG_EVERY, LR_WARMUP, SAVE_EVERY,
                                  RESUME, SET, cli_errors, console, device_option, dtype_option, seed_option)


def command(
    model: Optional[Path] = typer.Argument(None, metavar="MODEL", help="Model dir to fine-tune (dense or sparse)."),
    data: Optional[Path] = typer.Option(None, "--data", metavar="FILE", help="JSONL records: messages | prompt + completion (or solution) | text [default: none, required]"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", metavar="DIR", help="Model dir to write [default: none, required]"),
    run_dir: Optional[Path] = typer.Option(None, metavar="DIR", help="Run dir: config, metrics.jsonl, checkpoints [default: OUT.run]"),
    loss_on: Optional[str] = typer.Option(None, help="assistant (assistant turns; every token of text records) | all (every token: pre-training) [default: assistant]"),
    seq_len: Optional[int] = typer.Option(None, help="Tokens per packed row [default: 2048]"),
    batch_size: Optional[int] = typer.Option(None, help="Rows per process per step [default: 8]"),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps, 0 = --epochs over the rows [default: 0]"),
    epochs: Optional[float] = typer.Option(None, help="Passes over the packed rows when --steps is 0 [default: 1]"),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate [default: 2e-5]"),
    lr_warmup: Optional[int] = LR_WARMUP,
    weight_decay: Optional[float] = typer.Option(None, help="AdamW weight decay [default: 0]"),
    adam_beta2: Optional[float] = typer.Option(None, help="AdamW beta2 (second-moment decay); 0.95 is the usual "
                                                          "choice for pre-training from scratch [default: 0.999]"),
    grad_clip: Optional[float] = GRAD_CLIP,
    finetune: Optional[str] = typer.Option(None, help="full (all weights) | lora (a peft adapter, merged into OUT) [default: full]"),
    lora_r: Optional[int] = typer.Option(None, help="LoRA rank [default: 16]"),
    seed: Optional[int] = seed_option(),
    log_every: Optional[int] = LOG_EVERY,
    save_every: Optional[int] = SAVE_EVERY,
    keep_checkpoints: Optional[int] = KEEP_CHECKPOINTS,
    device: Optional[str] = device_option(),
    dtype: Optional[str] = dtype_option(),
    mixed_precision: Optional[str] = typer.Option(None, help="no | bf16 (autocast: bf16 matmuls and attention over the --dtype weights, as accelerate's mixed_precision) [default: no]"),
    config: Optional[Path] = CONFIG,
    set_: Optional[list[str]] = SET,
    resume: bool = RESUME,
    force: bool = FORCE,
) -> None:
    """Supervised fine-tuning: loss on assistant tokens only (all tokens of `text` records), documents
    packed into rows without attending across each other. --force replaces OUT and starts the run dir over.

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
            model=s(model), data=s(data), out=s(out), run_dir=s(run_dir), loss_on=loss_on, seq_len=seq_len, batch_size=batch_size,
            steps=steps, epochs=epochs, lr=lr, lr_warmup=lr_warmup, weight_decay=weight_decay, adam_beta2=adam_beta2,
            grad_clip=grad_clip,
            finetune=finetune, lora_r=lora_r, seed=seed, log_every=log_every, save_every=save_every,
            keep_checkpoints=keep_checkpoints, device=device, dtype=dtype,
            mixed_precision=mixed_precision), sets=set_)
        summary = run(cfg, resume=resume, force=force, console=console)
        import os

        if os.environ.get("RANK", "0") == "0":
            console.print(f"[green]wrote[/] {summary['out']}  ({summary['steps']} steps, "
                          f"loss {summary['last'].get('loss', float('nan')):.4f})")
            typer.echo(json.dumps(summary))
