"""Helpers shared by CLI commands: one-line errors with exit code 2, a progress bar for long runs,
a JSON-object option."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import typer

T = TypeVar("T")
ProgressFn = Callable[[str, int, int], None]


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code`` (no traceback)."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def with_progress(run: Callable[[ProgressFn], T]) -> T:
    """Call ``run(on_progress)`` under a rich progress bar on stderr; ``on_progress(phase, done,
    total)`` updates it (total 0: unknown). The bar is transient when stderr is not a terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    stderr = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr,
        transient=not stderr.is_terminal,
    ) as progress:
        task = progress.add_task("starting", total=None)

        def on_progress(phase: str, done: int, total: int) -> None:
            progress.update(task, description=phase, completed=done, total=total or None)

        return run(on_progress)


def json_object(text: str, flag: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object; a one-line error naming ``flag`` otherwise."""
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        fail(f"{flag} is not JSON ({exc}): {text!r}")
    if not isinstance(value, dict):
        fail(f"{flag} must be a JSON object, got {text!r}")
    return value
