"""The pause decision's inputs made safe: every unusable number becomes a named fallback.

Primitives:
    sanitize_wait       a WaitEstimate, a number or None -> (estimate or None for "unknown", source)
    sanitize_fraction   a number clamped to [0, 1] (pool pressure), a default when not a number
    sanitize_forecast   the pool's eviction forecast in seconds; 0 ("eviction now") when unusable
    has_room            whether a tier's free bytes hold the KV (None: unlimited; bad: full)
    bandwidth_ok        whether a link or disk bandwidth is usable

Contract of every function: never raises; each fallback it takes is appended, as one sentence, to
the ``notes`` list it is given (``agentkv.policy.decide`` reports them in ``Decision.fallbacks``).
"""

from __future__ import annotations

import math

from agentkv.costs import positive_finite
from agentkv.predict import WaitEstimate


def sanitize_wait(
    wait: WaitEstimate | float | None, notes: list[str]
) -> tuple[WaitEstimate | None, str]:
    """The wait estimate to decide on and its source; None ("unknown") when ``wait`` is
    missing, not a number, negative or NaN (noted in ``notes``)."""
    if isinstance(wait, WaitEstimate):
        if wait.is_valid():
            return wait, wait.source
        notes.append(f"wait estimate {wait.p10}/{wait.p50}/{wait.p90} is unusable; wait unknown")
        return None, "unknown"
    if wait is None:
        notes.append("no wait estimate; wait unknown")
        return None, "unknown"
    try:
        w = float(wait)
    except (TypeError, ValueError):
        notes.append(f"wait {wait!r} is not a number; wait unknown")
        return None, "unknown"
    if math.isnan(w) or w < 0:
        notes.append(f"wait {w} s is negative or NaN; wait unknown")
        return None, "unknown"
    return WaitEstimate.point(w), "declared"


def sanitize_fraction(value: float, name: str, default: float, notes: list[str]) -> float:
    """``value`` as a number in [0, 1]: ``default`` when not a number or NaN, else clamped."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        notes.append(f"{name} {value!r} is not a number; assumed {default}")
        return default
    if math.isnan(v):
        notes.append(f"{name} is NaN; assumed {default}")
        return default
    if v < 0.0 or v > 1.0:
        clamped = min(max(v, 0.0), 1.0)
        notes.append(f"{name} {v} outside [0, 1]; clamped to {clamped}")
        return clamped
    return v


def has_room(free_bytes: float | None, kv_bytes: float, name: str, notes: list[str]) -> bool:
    """Whether a tier with ``free_bytes`` free holds ``kv_bytes``: None means unlimited; an
    unusable figure (not a number, NaN, negative) means full."""
    if free_bytes is None:
        return True
    try:
        free = float(free_bytes)
    except (TypeError, ValueError):
        notes.append(f"{name} free bytes {free_bytes!r} unusable; tier treated as full")
        return False
    if math.isnan(free) or free < 0:
        notes.append(f"{name} free bytes {free} unusable; tier treated as full")
        return False
    return free >= kv_bytes


def bandwidth_ok(value: float | None, name: str, notes: list[str], required: bool) -> bool:
    """Whether a bandwidth is usable; a missing one is noted only when ``required``."""
    if positive_finite(value):
        return True
    if value is not None or required:
        notes.append(f"{name} bandwidth {value} unusable; that path is off")
    return False


def sanitize_forecast(value: float, notes: list[str]) -> float:
    """The eviction forecast in seconds; 0 (eviction now, the safe reading) when unusable."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if math.isnan(v) or v < 0:
        notes.append(f"eviction forecast {value!r} unusable; eviction assumed now")
        return 0.0
    return v
