"""Why a paused branch left the device without a client's decision.

Primitives:
    DemotedBy        the reasons (a StrEnum: each value is what GET answers as ``demoted_by``)
    COUNTED_REASONS  the reasons the engine demotes for, by its own decision (grace, lease,
                     pressure, a blocked queue): the ``reason`` label values of
                     ``agentkv_demotions_total``. The others say a copy was lost (evicted,
                     aborted, a store that failed or timed out) or came back after a restart;
                     they show in ``demoted_by`` only.

Dependency free, like ``agentkv.tier``: the metric definitions (``agentkv.metrics``) derive the
counter's help text from it without importing the manager (which imports the metrics).
The manager re-exports ``DemotedBy`` (``agentkv.manager.state``, ``agentkv.manager``).
"""

from __future__ import annotations

import enum


class DemotedBy(enum.StrEnum):
    """Why the engine, not a client's decision, moved a paused branch off the device."""

    GRACE_EXPIRED = "grace_expired"  # no pause decision came within the grace period
    LEASE_EXPIRED = "lease_expired"  # a retained branch's lease ran out
    PRESSURE = "pressure"  # the pool went over its high-water mark
    QUEUE_BLOCKED = "queue_blocked"  # waiting requests were short of blocks
    JOB_TIMEOUT = "job_timeout"  # the offload's copy timed out: nothing kept
    STORE_FAILED = "store_failed"  # the offload's copy failed: nothing kept
    EVICTED = "evicted"  # vLLM evicted the unpinned device copy
    ABORTED = "aborted"  # a turn was aborted: its device copy is gone
    RESTART = "restart"  # restored from the disk manifest after an engine restart


COUNTED_REASONS: tuple[DemotedBy, ...] = (
    DemotedBy.GRACE_EXPIRED,
    DemotedBy.LEASE_EXPIRED,
    DemotedBy.PRESSURE,
    DemotedBy.QUEUE_BLOCKED,
)
