"""Conventions shared by every CLI stage (docs/DESIGN.md, "Command-line conventions"): stderr
console, one-line errors, exit codes, the options every stage spells the same way, list parsing,
refusing to overwrite outputs, deprecated spellings.

Every command body runs inside `cli_errors()`: a SparseRLError becomes `error: <message>` on
stderr with its exit code (1 runtime, 2 usage); any other exception becomes one line too, unless
`SPARSE_RL_DEBUG=1`, which shows the traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from sparse_rl.console import console
from sparse_rl.devices import resolve_device
from sparse_rl.errors import SparseRLError, UsageError

__all__ = ["console", "cli_errors", "debug", "UsageError", "SparseRLError", "resolve_device", "group", "ints", "floats",
           "strs", "refuse_existing", "deprecated", "old_spelling", "renamed", "CONFIG", "SET", "FORCE", "RESUME",
           "INDEX_HEADS", "INDEX_DIM", "INDEX_DTYPE", "LR_WARMUP", "GRAD_CLIP", "LOG_EVERY", "SAVE_EVERY", "KEEP_CHECKPOINTS", "BATCH_SIZE_OLD"]


def group(help: str) -> typer.Typer:
    """A command group (`sparse-rl eval`, ...): bare, it prints its help to stdout and exits 0, like
    `--help`; the plain (not Rich) help keeps every `[default: X]` visible and greppable."""
    app = typer.Typer(help=help, add_completion=False, rich_markup_mode=None, invoke_without_command=True,
                      context_settings={"help_option_names": ["-h", "--help"]})

    @app.callback()
    def _bare(ctx: typer.Context) -> None:
        if ctx.invoked_subcommand is None:
            typer.echo(ctx.get_help())
            raise typer.Exit(0)

    return app


# Options every stage spells and explains the same way (one meaning per flag name).
CONFIG = typer.Option(None, "--config", metavar="FILE",
                      help="YAML recipe of this stage's config keys; --set and flags override it [default: none]")
SET = typer.Option(None, "--set", metavar="KEY=VALUE",
                   help="Override any config key (dots for sections, YAML value), e.g. --set seed=1; repeatable; "
                        "a flag of the same key wins [default: none]")
FORCE = typer.Option(False, "--force", help="Replace outputs (files and dirs) that exist already [default: off]")
RESUME = typer.Option(False, "--resume", help="Continue the run from its last checkpoint [default: off]")
# the sparse policy's LoRA (grpo's sparse+distill phi); generate merges it, eval fidelity wraps it with peft
ADAPTER = typer.Option(None, "--adapter", metavar="DIR", help="LoRA adapter dir of the sparse policy (peft), e.g. a "
                                                               "grpo checkpoint's adapter/ [default: none]")
INDEX_HEADS = typer.Option(None, "--index-heads", help="Indexer heads H_I [default: 4]")
# the trainers' (indexer train, sft) loop options
LR_WARMUP = typer.Option(None, "--lr-warmup", help="Linear LR warm-up steps before cosine decay [default: 0]")
GRAD_CLIP = typer.Option(None, "--grad-clip", help="Gradient-norm clip per parameter group, 0 = off [default: 1.0]")
LOG_EVERY = typer.Option(None, "--log-every", help="Metrics line every N steps [default: 1]")
SAVE_EVERY = typer.Option(None, "--save-every", help="Checkpoint every N steps [default: 100]")
KEEP_CHECKPOINTS = typer.Option(None, "--keep-checkpoints", help="Newest checkpoints kept, 0 = all [default: 2]")
INDEX_DIM = typer.Option(None, "--index-dim", help="Indexer dim d_I [default: 64]")
INDEX_DTYPE = typer.Option(None, "--index-dtype", help="Indexer: the decode cache's index keys, bf16 | fp8 (e4m3, a "
                                                      "scale per token) [default: bf16]")


# Options several stages share, where only the default differs by stage.
def device_option(default: str = "auto"):
    return typer.Option(None, "--device", help=f"auto (CUDA when present) | cpu | cuda | cuda:N [default: {default}]")


def dtype_option(default: str = "auto"):
    return typer.Option(None, "--dtype", help="Model dtype: auto (bfloat16 on CUDA, float32 on CPU) | float32 | "
                                              f"bfloat16 | float16 [default: {default}]")


def seed_option(default: int = 0):
    return typer.Option(None, "--seed", help=f"Seed; the same seed gives the same output [default: {default}]")


def samples_option(default: int):
    return typer.Option(None, "--samples", help=f"Completions sampled per prompt [default: {default}]")


def temperature_option(default: float):
    return typer.Option(None, "--temperature", help=f"Sampling temperature, 0 = greedy [default: {default}]")


def top_p_option(default: float = 1.0):
    return typer.Option(None, "--top-p", help=f"Nucleus sampling, 1 = off [default: {default}]")


def max_new_tokens_option(default):
    return typer.Option(None, "--max-new-tokens", help=f"Tokens per completion at most [default: {default}]")


def max_batch_option(default: int):
    return typer.Option(None, "--max-batch", help=f"Sequences decoded together (engine cache slots) [default: {default}]")


def compile_option():
    return typer.Option(None, "--compile/--no-compile",
                        help="torch.compile the engine's decode step (on an H200 at batch 64: 23-36 s to compile a "
                             "variant, then 1.15-1.6x faster steps) [default: off]")


# Renamed flags: the old name stays parsed, hidden from --help, with one warning line.
def deprecated(old: str, new: str) -> None:
    """One line on stderr for an old spelling that still works."""
    print(f"warning: {old} is deprecated; use {new}", file=sys.stderr)


def old_spelling(flag: str, new: str):
    """A renamed flag's old name: hidden from --help, still parsed; pair it with `renamed`."""
    return typer.Option(None, flag, hidden=True, help=f"Deprecated spelling of {new}.")


BATCH_SIZE_OLD = old_spelling("--batch-size", "--max-batch")


def renamed(value, old_value, old: str, new: str):
    """A flag's value when it may come under its old, hidden spelling: the new one wins."""
    if old_value is None:
        return value
    deprecated(old, new)
    return value if value is not None else old_value


def ints(flag: str, value: Optional[str], positive: bool = False) -> Optional[list[int]]:
    """`8192,32K` -> [8192, 32768] (K = 1024); `none` or empty -> []; None (flag not given) -> None."""
    if value is None:
        return None
    if value.strip().lower() in ("", "none"):
        return []
    out = []
    for part in value.split(","):
        p = part.strip().upper()
        if not p:
            continue
        mult = 1024 if p.endswith("K") else 1
        try:
            out.append(int(p.removesuffix("K")) * mult)
        except ValueError:
            raise UsageError(f"{flag} {value}: expected comma-separated integers, e.g. 1,4,8 or 8K,32K") from None
    if positive and any(x <= 0 for x in out):
        raise UsageError(f"{flag} {value}: expected positive integers, e.g. 8K,32K")
    return out


def floats(flag: str, value: Optional[str]) -> Optional[list[float]]:
    """`0,0.5,1` -> [0.0, 0.5, 1.0]; None -> None."""
    if value is None:
        return None
    try:
        return [float(p) for p in value.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"{flag} {value}: expected comma-separated numbers, e.g. 0,0.5,1") from None


def strs(value: Optional[str]) -> Optional[list[str]]:
    """`a, b,,c` -> ["a", "b", "c"]; None -> None."""
    return None if value is None else [p.strip() for p in value.split(",") if p.strip()]


def refuse_existing(force: bool, **outputs: Optional[str | Path]) -> None:
    """Output files follow the rule of output dirs: one that exists is a usage error unless --force.
    Keys are flag names with `_` for `-` (`prompts_out` -> --prompts-out); `-` (stdout) and None pass.
    Checked before any work starts, so a refused run costs nothing. Devices and FIFOs (`/dev/null`)
    are written in place, never replaced, so they pass."""
    for key, path in outputs.items():
        if path is None or str(path) == "-":
            continue
        if (Path(path).is_file() or Path(path).is_dir()) and not force:
            raise UsageError(f"--{key.replace('_', '-')} {path}: exists already (pass --force to overwrite)")


def debug() -> bool:
    return os.environ.get("SPARSE_RL_DEBUG", "") not in ("", "0")


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split()) or "unknown error"


@contextlib.contextmanager
def cli_errors():
    try:
        yield
    except typer.Exit:
        raise
    except SparseRLError as e:
        if debug():
            raise
        print(f"error: {_one_line(str(e))}", file=sys.stderr)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        raise typer.Exit(130) from None
    except Exception as e:  # unexpected: still one line, the traceback on request
        if debug():
            raise
        print(f"error: {type(e).__name__}: {_one_line(str(e))} (set SPARSE_RL_DEBUG=1 for the traceback)",
              file=sys.stderr)
        raise typer.Exit(1) from None

