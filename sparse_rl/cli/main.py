"""Entry point: mounts each stage's Typer app or command from one flat list.

A stage module exposes either `app` (a group of subcommands, e.g. `model init`) or `command`
(one command, e.g. `convert`). Stages import torch lazily so `--help` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Optional

import typer

from sparse_rl import __version__

# (name, module, help). Only stages that exist are listed: nothing here is a stub.
STAGES: list[tuple[str, str, str]] = [
    ("model", "sparse_rl.cli.model", "Create small offline models (random init + local tokenizer)."),
    ("sft", "sparse_rl.cli.sft", "Supervised fine-tuning (full or LoRA): assistant-only loss, packed documents."),
    ("convert", "sparse_rl.cli.convert", "Add a sparse-attention selector to a dense HF checkpoint."),
    ("indexer", "sparse_rl.cli.indexer", "Train the lightning indexers: dense KL warm-up, then sparse training."),
    ("generate", "sparse_rl.cli.generate", "Sample completions with the rollout engine (dense or sparse), with log-probs."),
    ("grpo", "sparse_rl.cli.grpo", "GRPO with dense or sparse rollouts, mismatch correction, LoRA distillation, oversampling."),
    ("synth", "sparse_rl.cli.synth", "Synthesise verifiable math tasks and sandboxed tool-use trajectories."),
    ("eval", "sparse_rl.cli.eval", "Evaluate: math accuracy and pass@k, RULER-style needle grids, sparse-vs-dense fidelity."),
    ("bench", "sparse_rl.cli.bench", "Speed benchmarks: sparse attention and decode kernels vs dense SDPA/FlexAttention."),
    ("demo", "sparse_rl.cli.demo", "Run the whole chain on a tiny model, offline, on a CPU."),
]

app = typer.Typer(
    name="sparse-rl",
    help="LLM post-training with trainable sparse attention (DSA) and sparse-rollout GRPO.",
    invoke_without_command=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: `[default: X]` stays visible (Rich would eat it as markup)
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"sparse-rl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True,
                                           help="Print the version and exit."),
) -> None:
    """sparse-rl: each stage reads and writes files, so stages chain in shell scripts."""
    if ctx.invoked_subcommand is None:  # bare `sparse-rl`: the help, on stdout, exit 0 (like --help)
        typer.echo(ctx.get_help())
        raise typer.Exit(0)


for _name, _module, _help in STAGES:
    _mod = importlib.import_module(_module)
    if hasattr(_mod, "app"):
        app.add_typer(_mod.app, name=_name, help=_help)
    else:
        app.command(_name, help=_help)(_mod.command)


def _leave(code) -> None:
    """Exit with `code`. A rank of a multi-process run (torchrun sets WORLD_SIZE) leaves by `os._exit` once its
    output is flushed: its process group is already torn down (`Dist.close`), but FSDP / DTensor objects still
    hold the gloo / NCCL backend, and Python's finalization may destroy it with its worker threads still joinable
    (`terminate called without an active exception`, SIGABRT, seen once in CI after a run that had finished and
    written everything). Files are closed by then: checkpoints and metrics are written and closed as they go."""
    import os
    import sys

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "torch.distributed" in sys.modules:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe (`| head`) or a closed stream: nothing left to say
                pass
        os._exit(0 if code is None else code if isinstance(code, int) else 1)
    sys.exit(code)


def main() -> None:
    """Run the app; click's usage errors become one line (`error: ...`) with exit code 2."""
    import sys

    try:  # typer >= 0.20 vendors click as typer._click
        from typer._click import exceptions as click_exc
    except ImportError:
        from click import exceptions as click_exc

    try:
        rv = app(standalone_mode=False)
    except click_exc.UsageError as e:
        path = e.ctx.command_path if e.ctx else "sparse-rl"
        msg = " ".join(e.format_message().split())
        print(f"error: {msg} (see '{path} --help')", file=sys.stderr)
        _leave(2)
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        _leave(130)
    except typer.Exit as e:
        _leave(e.exit_code)
    except BrokenPipeError:  # `sparse-rl ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        _leave(0)
    except click_exc.ClickException as e:
        print(f"error: {' '.join(e.format_message().split())}", file=sys.stderr)
        _leave(e.exit_code)
    _leave(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
