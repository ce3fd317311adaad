"""Progress reports of a bench run (one definition for every runner).

Primitives:
  ProgressFn                 ``progress(phase, done, total)``: what the CLI passes a runner (its
                             rich progress bar; total 0: unknown)
  reporter(progress) -> Say  ``say(phase, done=0, total=0)``: forwards to ``progress``, or does
                             nothing when the caller passed none
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

ProgressFn = Callable[[str, int, int], None]


class Say(Protocol):
    def __call__(self, phase: str, done: int = 0, total: int = 0) -> None: ...


def reporter(progress: ProgressFn | None) -> Say:
    """A ``say`` for a runner: every phase goes to ``progress`` when one was given."""

    def say(phase: str, done: int = 0, total: int = 0) -> None:
        if progress is not None:
            progress(phase, done, total)

    return say
