"""Tool waits: ``async with traj.tool(name, expected_s=)`` pauses the branch on the server
while the tool runs and resumes it after (even on error), in a tool span.

Primitives:
  ToolWait(host, name, expected_s)   the context manager; ``decision`` (the server's pause
                                     decision, None when skipped), ``duration_s``, ``error``
  DeclaredPause                      a turn's ``then_tool``: the engine paused the branch when
                                     the turn finished, so the tool wait of that tool makes no
                                     control call (the next turn resumes the branch)
  check_tool_args(name, expected_s)  ConfigError on a bad tool name or expected wait
  ToolHost                           what a ToolWait needs from its owner: a Trajectory, or a
                                     wrapped OpenAI/Anthropic client (``harness_sdk.openai``)
  run_tool_wait(loop, wait)          the same from blocking code, on a private event loop
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

from harness_sdk.errors import ConfigError
from harness_sdk.session import _Shared
from harness_sdk.telemetry import ATTR_PAUSE_ACTION, ATTR_PAUSE_APPLIED

log = logging.getLogger("harness_sdk")


@dataclass(frozen=True)
class DeclaredPause:
    """The pause a turn asked for (``complete(then_tool=...)``): ``reply`` is the engine's
    answer the turn's response carried (``kv_transfer_params.agentkv.pause``; None when the
    turn was streamed)."""

    tool: str
    reply: dict[str, Any] | None


def check_tool_args(name: str, expected_s: float | None) -> None:
    if not name or len(name) > 128:
        raise ConfigError("tool name must be 1-128 characters")
    if expected_s is not None and expected_s < 0:
        raise ConfigError("expected_s must be >= 0")


class ToolHost(Protocol):
    """What a ToolWait needs from its owner: a Trajectory, or a wrapped OpenAI client
    (``harness_sdk.openai``)."""

    _shared: _Shared
    branch: str
    tool_waits: list[ToolWait]

    def _check_open(self) -> None: ...

    def observe(self, content: str, role: str = "user") -> None: ...


class ToolWait:
    """``async with traj.tool(name, expected_s=...)``: pause on enter, resume on exit.

    ``decision`` holds the server's pause decision (None when skipped), ``duration_s`` the
    measured wait. Exceptions in the body propagate after the resume.
    """

    def __init__(self, traj: ToolHost, name: str, expected_s: float | None) -> None:
        check_tool_args(name, expected_s)
        self.traj = traj
        self.name = name
        self.expected_s = expected_s
        self.pause_response: dict[str, Any] | None = None
        self.resume_response: dict[str, Any] | None = None
        self.duration_s: float | None = None
        self.error: BaseException | None = None
        self._stack = contextlib.ExitStack()
        self._t0 = 0.0
        self.declared = False  # paused by the turn's request: no pause or resume call

    @property
    def decision(self) -> dict[str, Any] | None:
        d = (self.pause_response or {}).get("decision")
        return d if isinstance(d, dict) else None

    def observe(self, content: str, role: str = "user") -> None:
        """Add the tool's output to the trajectory's observation zone."""
        self.traj.observe(f"[{self.name}] {content}", role=role)

    async def __aenter__(self) -> ToolWait:
        self.traj._check_open()
        shared = self.traj._shared
        span = self._stack.enter_context(
            shared.telemetry.tool_span(
                tool=self.name,
                expected_s=self.expected_s,
                trajectory_id=shared.trajectory_id,
                branch=self.traj.branch,
            )
        )
        self._span = span
        declared: DeclaredPause | None = getattr(self.traj, "_declared", None)
        if declared is not None:
            # One tool wait uses a turn's declared pause: any other resumes the branch itself.
            self.traj._declared = None  # type: ignore[attr-defined]
        if declared is not None and declared.tool == self.name:
            # The engine paused the branch when the turn finished; the next turn resumes it.
            self.declared = True
            self.pause_response = declared.reply
            self._note_decision(span)
            self._t0 = time.monotonic()
            return self
        try:
            self.pause_response = await shared.control(
                "POST",
                f"/trajectories/{shared.trajectory_id}/pause",
                {"tool": self.name, "expected_wait_s": self.expected_s, "branch": self.traj.branch},
                expect_known=True,
            )
        except BaseException as exc:
            self._stack.__exit__(type(exc), exc, exc.__traceback__)
            raise
        shared.check_pause_reply(self.traj.branch, self.pause_response)
        self._note_decision(span)
        self._t0 = time.monotonic()
        return self

    def _note_decision(self, span: Any) -> None:
        if self.decision is not None:
            span.set_attribute(ATTR_PAUSE_ACTION, str(self.decision.get("action")))
            span.set_attribute(
                ATTR_PAUSE_APPLIED, bool(self.pause_response and self.pause_response.get("applied"))
            )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.duration_s = time.monotonic() - self._t0
        self.error = exc
        shared = self.traj._shared
        try:
            if self.pause_response is not None and not shared.closed and not self.declared:
                self.resume_response = await shared.control(
                    "POST",
                    f"/trajectories/{shared.trajectory_id}/resume",
                    {"branch": self.traj.branch},
                    expect_known=True,
                )
        except Exception as resume_exc:  # a failed resume must not hide the tool's own error
            if exc is None:
                log.warning("harness_sdk: resume after %s failed: %s", self.name, resume_exc)
        finally:
            shared.telemetry.record_tool_wait(
                self._span, tool=self.name, duration_s=self.duration_s, error=exc
            )
            self._stack.__exit__(exc_type, exc, tb)
        self.traj.tool_waits.append(self)


@contextlib.contextmanager
def run_tool_wait(loop: asyncio.AbstractEventLoop, wait: ToolWait) -> Iterator[ToolWait]:
    """Enter and exit an async ToolWait from blocking code, on ``loop``.

    Both halves run in one contextvars context: the tool span's OTel context token is attached
    on enter and detached on exit, and two tasks with a context copy each would make the detach
    fail ("was created in a different Context"). Python 3.10 has no ``create_task(context=)``;
    there the detach error is only logged by OTel.
    """
    ctx = contextvars.copy_context()

    def run(coro: Any) -> Any:
        if sys.version_info >= (3, 11):
            return loop.run_until_complete(loop.create_task(coro, context=ctx))
        return loop.run_until_complete(coro)  # pragma: no cover

    run(wait.__aenter__())
    try:
        yield wait
    except BaseException as exc:
        run(wait.__aexit__(type(exc), exc, exc.__traceback__))
        raise
    run(wait.__aexit__(None, None, None))
