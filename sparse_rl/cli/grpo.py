"""`sparse-rl grpo MODEL --tasks tasks.jsonl --config recipe.yaml --out RUN_DIR [--resume]`.

Thin layer: flags -> `GRPOConfig` (recipe < `--set section.key=value` < flags),
then `sparse_rl.rl.grpo.trainer.run`. Per-step summaries go to stderr; the last step's metrics
record is printed to stdout as JSON. With `--resume` the config is the run dir's config.yaml
(flags still override, e.g. `--steps` to extend a run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from sparse_rl.cli.common import (CONFIG, RESUME, SET, cli_errors, console, device_option, dtype_option,
                                  max_new_tokens_option, samples_option, seed_option)
from sparse_rl.errors import UsageError


def command(
    model: str = typer.Argument(..., metavar="MODEL",
                                help="Model dir (dense, or sparse from `sparse-rl convert` for sparse modes)."),
    tasks: Optional[str] = typer.Option(None, "--tasks", metavar="FILE",
                                        help="Tasks JSONL: {id, prompt|messages, answer, task} [default: none]"),
    out: Optional[str] = typer.Option(None, "--out", "-o", metavar="DIR",
                                      help="Run dir, required: config.yaml, metrics.jsonl, curves.png, checkpoints/ "
                                           "[default: none]"),
    config: Optional[Path] = CONFIG,
    resume: bool = RESUME,
    steps: Optional[int] = typer.Option(None, "--steps", help="Total GRPO steps [default: 100]"),
    mode: Optional[str] = typer.Option(None, "--mode",
                                       help="Rollout mode: dense | sparse | sparse+distill [default: dense]"),
    samples: Optional[int] = samples_option(8),
    keep: Optional[int] = typer.Option(None, "--keep", help="Completions kept per prompt, the top by reward [default: 4]"),
    prompts_per_step: Optional[int] = typer.Option(None, "--prompts-per-step",
                                                   help="Prompts per step, all processes [default: 8]"),
    max_new_tokens: Optional[int] = max_new_tokens_option(256),
    lr: Optional[float] = typer.Option(None, "--lr", help="Policy learning rate [default: 1e-06]"),
    reward: Optional[str] = typer.Option(None, "--reward",
                                         help="math | synth | module:function | file.py:function [default: math]"),
    eval_tasks: Optional[str] = typer.Option(None, "--eval-tasks", metavar="FILE",
                                             help="Held-out tasks JSONL [default: none]"),
    eval_every: Optional[int] = typer.Option(None, "--eval-every",
                                             help="Eval every N steps and after the last; 0 = after the last only "
                                                  "[default: 0]"),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every",
                                                   help="Checkpoint every N steps and after the last [default: 10]"),
    seed: Optional[int] = seed_option(),
    device: Optional[str] = device_option(),
    dtype: Optional[str] = dtype_option(),
    set_: Optional[list[str]] = SET,
) -> None:
    """GRPO with dense or sparse rollouts, mismatch correction, LoRA distillation and oversampling."""
    with cli_errors():
        from sparse_rl.config import load_config
        from sparse_rl.rl.grpo.config import GRPOConfig

        if out is None:
            raise UsageError("--out: give the run dir (e.g. --out runs/grpo1)")
        run_dir = Path(out)
        if resume and (run_dir / "config.yaml").is_file():  # without one the run starts (see Trainer)
            if config is not None:
                raise UsageError("--resume takes the config from RUN_DIR/config.yaml; drop --config (flags still override)")
            config = run_dir / "config.yaml"
        overrides = {
            "model": model, "out": out, "data.tasks": tasks, "steps": steps, "rollout.mode": mode,
            "rollout.samples": samples, "rollout.keep": keep, "data.prompts_per_step": prompts_per_step, "rollout.max_new_tokens": max_new_tokens,
            "optim.lr": lr, "reward.fn": reward, "eval.tasks": eval_tasks, "eval.every": eval_every,
            "checkpoint.every": checkpoint_every, "seed": seed, "device": device, "dtype": dtype,
        }
        cfg = load_config(GRPOConfig, config, overrides, sets=set_)
        from sparse_rl.rl.grpo.trainer import run

        last = run(cfg, resume=resume, log=console.print)
        sys.stdout.write(json.dumps(last) + "\n")
