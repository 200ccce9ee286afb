"""The stderr console every stage prints progress to (stdout stays free for results and `-` outputs)."""

from rich.console import Console

console = Console(stderr=True)
