"""`sparse-rl grpo MODEL --tasks tasks.jsonl --config recipe.yaml --out RUN_DIR [--resume]`.

Thin layer: flags -> `GRPOConfig` (recipe < flags; `--set section.key=value` reaches any key),
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

from sparse_rl.cli.common import cli_errors, console
from sparse_rl.errors import UsageError


def _parse_sets(items: Optional[list[str]]) -> dict:
    import yaml

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item}: expected KEY=VALUE, e.g. --set loss.eps_high=0.28")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise UsageError(f"--set {item}: the value is not valid YAML") from None
    return out


def command(
    model: str = typer.Argument(..., help="Model dir (dense, or sparse from `sparse-rl convert` for sparse modes)."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Tasks JSONL: {id, prompt|messages, answer, task}."),
    out: Optional[str] = typer.Option(None, "--out", help="Run dir: config.yaml, metrics.jsonl, curves.png, checkpoints/."),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML recipe (recipes/grpo_*.yaml); flags override it."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its last checkpoint."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Total GRPO steps."),
    mode: Optional[str] = typer.Option(None, "--mode", help="Rollout mode: dense | sparse | sparse+distill."),
    m: Optional[int] = typer.Option(None, "--samples", help="M: completions sampled per prompt (rollout.m)."),
    n: Optional[int] = typer.Option(None, "--keep", help="n: completions kept per prompt, top-n by reward (rollout.n)."),
    prompts_per_step: Optional[int] = typer.Option(None, "--prompts-per-step", help="Prompts per step (all processes)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens"),
    lr: Optional[float] = typer.Option(None, "--lr", help="Policy learning rate."),
    reward: Optional[str] = typer.Option(None, "--reward", help="math | synth | module:function | file.py:function."),
    eval_tasks: Optional[str] = typer.Option(None, "--eval-tasks", help="Held-out tasks JSONL."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", help="Eval every N steps (and after the last)."),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    device: Optional[str] = typer.Option(None, "--device", help="auto | cpu | cuda | cuda:N."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto | float32 | bfloat16."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Any config key: --set loss.mismatch=tis (repeatable)."),
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
        overrides = _parse_sets(set_)
        overrides.update({
            "model": model, "out": out, "data.tasks": tasks, "steps": steps, "rollout.mode": mode, "rollout.m": m,
            "rollout.n": n, "data.prompts_per_step": prompts_per_step, "rollout.max_new_tokens": max_new_tokens,
            "optim.lr": lr, "reward.fn": reward, "eval.tasks": eval_tasks, "eval.every": eval_every,
            "checkpoint.every": checkpoint_every, "seed": seed, "device": device, "dtype": dtype,
        })
        cfg = load_config(GRPOConfig, config, overrides)
        from sparse_rl.rl.grpo.trainer import run

        last = run(cfg, resume=resume, log=console.print)
        sys.stdout.write(json.dumps(last) + "\n")
