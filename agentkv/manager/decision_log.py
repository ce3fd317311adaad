"""The server log's line per pause decision: one compact INFO line, rate-limited.

Operators read the log at vLLM's default level (INFO) to see what agentkv decided; a burst of
pauses (hundreds of runs hitting a tool at once) must not flood it, so past ``MAX_PER_WINDOW``
lines in a ``WINDOW_S`` window the lines are counted instead and the next logged line says how
many were left out (``agentkv_decisions_total`` and ``/agentkv/v1/status`` count them all).
The plugin hands the ``agentkv`` loggers vLLM's handler (``agentkv_vllm.plugin``): a logger
outside the ``vllm`` namespace has none, and Python's last-resort handler drops INFO.
"""

from __future__ import annotations

import logging
import math

from agentkv.policy import Action, Decision
from agentkv.predict import WaitEstimate

log = logging.getLogger("agentkv.decisions")

WINDOW_S = 1.0
MAX_PER_WINDOW = 20


class DecisionLog:
    """Per manager; the caller holds the manager's lock (one writer)."""

    def __init__(self) -> None:
        self._window_start = -math.inf
        self._in_window = 0
        self._left_out = 0

    def pause(
        self,
        now: float,
        trajectory: str,
        branch: str,
        tool: str,
        estimate: WaitEstimate,
        action: Action,
        decision: Decision,
    ) -> bool:
        """Log one pause decision (trajectory, tool, predicted wait, action, why); False when
        the rate limit left it out."""
        if not log.isEnabledFor(logging.INFO):
            return False
        if now - self._window_start >= WINDOW_S:
            self._window_start, self._in_window = now, 0
        if self._in_window >= MAX_PER_WINDOW:
            self._left_out += 1
            return False
        self._in_window += 1
        left_out, self._left_out = self._left_out, 0
        wait = f"{estimate.p50:.3g}s" if math.isfinite(estimate.p50) else "unknown"
        log.info(
            "agentkv: pause %s/%s tool=%s predicted_wait=%s (%s) -> %s; why: %s%s",
            trajectory,
            branch,
            tool,
            wait,
            estimate.source,
            action.value,
            decision.rationale,
            f" ({left_out} earlier decisions not logged: rate limit)" if left_out else "",
        )
        return True
