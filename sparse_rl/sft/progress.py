"""The rich progress bar of the SFT loop on stderr (only the main process draws it)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def progress_bar(console, main: bool, name: str, total: int, done: int):
    """Yields `update(step, info)`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console,
                        disable=not main or console is None)
    with progress:
        task = progress.add_task(name, total=total, completed=done, info="")
        yield lambda step, info: progress.update(task, completed=step, info=info)
