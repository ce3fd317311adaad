"""What the phase benchmarks' commands share (``bench overhead``, ``bench scale``): the plain
request options, the command line a report records, and how a finished report is shown.

Primitives:
    Requests, PromptTokens, OutputTokens, Preset, Seed
                    typer ``Annotated`` option aliases (defaults stay in each signature).
    bench_command   ``agentkv bench NAME ARGS...`` as typed, for the report's reproduce line.
    run_or_fail     run a benchmark under a progress bar; its AgentKVError (and the other
                    errors named) become a one-line error with exit code 2.
    show_report     run the benchmark under a progress bar; a one-line error (exit 2) when it
                    fails; print the chosen JSON keys, or report.md and where the files are.
Only typer is imported at module level.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from agentkv.cli.common import ProgressFn, fail, with_progress

T = TypeVar("T")

Requests = Annotated[
    int, typer.Option("--requests", min=2, help="Sequential plain requests per phase (timed).")
]
PromptTokens = Annotated[
    int, typer.Option("--prompt-tokens", min=1, help="Prompt length of each plain request.")
]
OutputTokens = Annotated[
    int, typer.Option("--output-tokens", min=1, help="Greedy output tokens of each plain request.")
]
Preset = Annotated[str, typer.Option("--preset", help="Embedded model: tiny or small.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the prompts (and the bootstrap).")]


def bench_command(name: str) -> str:
    """The command line as typed from ``bench NAME`` on (``agentkv bench NAME`` without argv)."""
    argv = sys.argv
    if name not in argv:
        return f"agentkv bench {name}"
    return f"agentkv bench {name} " + shlex.join(argv[argv.index(name) + 1 :])


def run_or_fail(run: Callable[[ProgressFn], T], *errors: type[Exception]) -> T:
    from agentkv.errors import AgentKVError

    caught: tuple[type[Exception], ...] = (AgentKVError, *errors)
    try:
        return with_progress(run)
    except caught as exc:
        fail(str(exc))


def show_report(
    run: Callable[[ProgressFn], dict[str, Any]],
    out: Path,
    as_json: bool,
    json_keys: tuple[str, ...],
) -> None:
    """Run the benchmark, then print ``json_keys`` of its report (with ``out``) as JSON, or
    report.md from ``out`` and where report.json and report.md are."""
    from rich.console import Console

    report = run_or_fail(run, RuntimeError)
    if as_json:
        typer.echo(json.dumps({"out": str(out), **{k: report[k] for k in json_keys}}))
        return
    from rich.markdown import Markdown

    Console().print(Markdown((out / "report.md").read_text()))
    print_paths(f"report: {out / 'report.json'}, {out / 'report.md'}")


def print_paths(line: str) -> None:
    """One line naming output files, on stderr, never wrapped: a path broken at the terminal's
    width cannot be copied."""
    from rich.console import Console

    Console(stderr=True, soft_wrap=True).print(line, highlight=False)
