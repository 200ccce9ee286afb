"""Conventions shared by every CLI stage: stderr console, one-line errors, exit codes.

Every command body runs inside `cli_errors()`: a SparseRLError becomes `error: <message>` on
stderr with its exit code (1 runtime, 2 usage); any other exception becomes one line too, unless
`SPARSE_RL_DEBUG=1`, which shows the traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys

import typer
from sparse_rl.console import console
from sparse_rl.devices import resolve_device
from sparse_rl.errors import SparseRLError, UsageError

__all__ = ["console", "cli_errors", "debug", "UsageError", "SparseRLError", "resolve_device"]


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

