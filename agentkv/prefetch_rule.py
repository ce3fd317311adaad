"""When a device prefetch pays: the one rule the manager (agentkv.manager.prefetch) and the fleet
simulator (agentkv.simulate.replica) both apply.

Primitives:
  SkipReason            why a due device prefetch is not issued
  device_prefetch_skip  the "never worse" rules, in order; None: issue it
  prefetch_lease_until  how long an unused prefetched context stays pinned

The rules (each one a unit test in tests/unit/test_device_prefetch.py):
  - BUSY: the trajectory is deleted, running, or not offloaded any more;
  - NO_CONTEXT: nothing whole to load;
  - SPREAD: the wait prediction's p90 / p10 is wider than ``max_spread`` (a prefetch would pin
    blocks for long, or come early, too often);
  - QUEUE: the scheduler's queue waits on blocks (or was short this step): a prefetch must never
    queue ahead of, or take blocks from, real work;
  - HEADROOM: pool use plus the context's blocks would pass ``high_water`` (pressure would demote
    it at once, or push out running work).
"""

from __future__ import annotations

import enum
import math

from agentkv.predict import WaitEstimate


class SkipReason(enum.StrEnum):
    BUSY = "busy"
    NO_CONTEXT = "no_context"
    SPREAD = "spread"
    QUEUE = "queue"
    HEADROOM = "headroom"
    # a salted trajectory whose cache_salt is unknown: its request would prefill the tenant's
    # context in another namespace (the manager's check, not a simulator rule)
    NO_SALT = "no_salt"


def spread_ok(estimate: WaitEstimate | None, max_spread: float) -> bool:
    """p90 / p10 of the prediction is finite and at most ``max_spread``."""
    if estimate is None or not (math.isfinite(estimate.p10) and math.isfinite(estimate.p90)):
        return False
    return estimate.p10 > 0 and estimate.p90 / estimate.p10 <= max_spread


def device_prefetch_skip(
    *,
    alive: bool,
    blocks: int,
    estimate: WaitEstimate | None,
    max_spread: float,
    queue_blocked: bool,
    pool_usage: float,
    total_blocks: int,
    high_water: float,
) -> SkipReason | None:
    """``pool_usage``: the fraction of the pool in use (held or pinned) now; ``blocks``: the
    context's whole blocks. Contract: None only when every rule passes."""
    if not alive:
        return SkipReason.BUSY
    if blocks <= 0:
        return SkipReason.NO_CONTEXT
    if not spread_ok(estimate, max_spread):
        return SkipReason.SPREAD
    if queue_blocked:
        return SkipReason.QUEUE
    if pool_usage + (blocks + 1) / max(1, total_blocks) > high_water:
        return SkipReason.HEADROOM
    return None


def prefetch_lease_until(
    now: float, paused_at: float, estimate: WaitEstimate | None, slack_s: float, max_s: float
) -> float:
    """Until the predicted p90 return plus ``slack_s`` (at least ``slack_s`` from now), never more
    than ``max_s`` from now."""
    p90 = estimate.p90 if estimate is not None and math.isfinite(estimate.p90) else 0.0
    until = max(paused_at + p90 + slack_s, now + slack_s)
    return min(until, now + max_s)
