"""One turn of a trajectory: what the client checks before it sends, what it keeps after.

Primitives:
  TurnResult                 one completed turn: the reply, CacheUsage, engine stats, zone
                             changes, lint, the client-side divergence, latency (and TTFT)
  TurnChecks / check_turn(rendered, turn, last, last_reply, seen_lint)
                             the stable zones' changes since the last turn and the volatile-data
                             lint (each warned: StableZoneChangedWarning, VolatileContentWarning
                             once per finding), and the first message that differs from what
                             the last turn sent plus its reply
  record_turn(shared, span, result, parsed)   the turn span's attributes and the turn metrics
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

from harness_sdk.adapters import CacheUsage, ParsedTurn
from harness_sdk.errors import StableZoneChangedWarning, VolatileContentWarning
from harness_sdk.session import _Shared
from harness_sdk.zones import (
    LintFinding,
    RenderedContext,
    ZoneChange,
    check_stability,
    lint_context,
)

log = logging.getLogger("harness_sdk")


@dataclass
class TurnResult:
    """One completed turn: the reply and its cache statistics."""

    trajectory_id: str
    branch: str
    turn: int
    content: str
    message: dict[str, Any]
    usage: CacheUsage
    engine: dict[str, Any] | None
    zone_changes: list[ZoneChange]
    lint: list[LintFinding]
    client_divergence_message: int | None
    client_divergence_zone: str | None
    latency_s: float
    finish_reasons: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    # Streamed turns only: seconds from sending the request to the first chunk with a choice
    # (vLLM sends it once the first output token exists, i.e. after prefill). None otherwise.
    ttft_s: float | None = None

    @property
    def cached_tokens(self) -> int:
        return self.usage.cached_tokens or 0

    @property
    def prompt_tokens(self) -> int:
        return self.usage.input_tokens or 0

    @property
    def hit_ratio(self) -> float | None:
        """The engine's prefix hit ratio when reported, else cached / prompt tokens."""
        if self.engine is not None:
            for key in ("prefix_hit_ratio", "hit_ratio"):
                v = self.engine.get(key)
                if isinstance(v, (int, float)):
                    return float(v)
        return self.usage.hit_ratio


def _first_divergence(expected: list[dict[str, Any]], actual: list[dict[str, Any]]) -> int | None:
    for i, (a, b) in enumerate(zip(expected, actual, strict=False)):
        if a != b:
            return i
    return None if len(actual) >= len(expected) else len(actual)


@dataclass
class TurnChecks:
    """What the client found in a turn's context before sending it."""

    changes: list[ZoneChange]
    lint: list[LintFinding]
    divergence: int | None  # the first message that differs from the last turn's, if any
    divergence_zone: str | None


def check_turn(
    rendered: RenderedContext,
    turn: int,
    last: RenderedContext | None,
    last_reply: dict[str, Any] | None,
    seen_lint: set[LintFinding],
) -> TurnChecks:
    """Check turn ``turn``'s context against the last one sent; warn as the module says.

    The warnings point at the caller of ``Trajectory.complete`` (stacklevel 3: this, complete).
    """
    changes = [ZoneChange(c.zone, c.diff, turn) for c in check_stability(last, rendered)]
    for c in changes:
        warnings.warn(str(c), StableZoneChangedWarning, stacklevel=3)
        log.warning("harness_sdk: %s", c)
    lint = lint_context(rendered)
    for finding in lint:
        if finding not in seen_lint:
            seen_lint.add(finding)
            warnings.warn(
                f"volatile data in stable zone {finding}", VolatileContentWarning, stacklevel=3
            )
    divergence: int | None = None
    if last is not None and last_reply is not None:
        divergence = _first_divergence([*last.messages, last_reply], rendered.messages)
    div_zone = rendered.zone_of_message(divergence) if divergence is not None else None
    return TurnChecks(changes, lint, divergence, div_zone)


def record_turn(shared: _Shared, span: Any, result: TurnResult, parsed: ParsedTurn) -> None:
    """The turn span's attributes and the turn metrics (``Telemetry.record_turn``)."""
    shared.telemetry.record_turn(
        span,
        model=shared.model,
        provider=shared.adapter.provider,
        trajectory_id=shared.trajectory_id,
        branch=result.branch,
        input_tokens=parsed.usage.input_tokens,
        output_tokens=parsed.usage.output_tokens,
        cached_tokens=parsed.usage.cached_tokens,
        cache_creation_tokens=parsed.usage.cache_creation_tokens,
        hit_ratio=result.hit_ratio,
        engine=parsed.engine,
        response_model=parsed.response_model,
        response_id=parsed.response_id,
        finish_reasons=parsed.finish_reasons,
        zone_changes=[(c.zone, c.diff) for c in result.zone_changes],
        lint=[str(f) for f in result.lint],
        client_divergence_message=result.client_divergence_message,
    )
