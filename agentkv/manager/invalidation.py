"""Invalidation: after a cache reset or a weight update, no tier copy written before may load.

Primitives:
    invalidate_tiers(manager, reason) -> Invalidation
        every trajectory is ended as DELETE ends it (pins released, host and disk copies dropped
        once idle, running requests finish for their clients but pin and store nothing), every
        running request forgets the tier keys it derived (a re-lookup derives them under the new
        generation), and idle copies no trajectory owns are dropped as well.
    Invalidation    what happened: trajectories ended, copies dropped, the planned loads
                    cancelled, and the loads still in flight (copying: they were looked up
                    before the reset, so their KV is stale; ``clean`` is False while any exists).

Why a planned load is cancelled, not counted: a lookup that vLLM could not allocate for has
copied nothing. Its plan (read pins on old-generation keys) is released here and its request
forgets its keys, so vLLM's next lookup of it (it always asks again before allocating) derives
them under the new generation and finds nothing stale; an allocation without that lookup finds
no plan and fails closed (recompute). While vLLM is paused (pause_generation wait/keep) waiting
requests are never looked up again: counting their plans as stale refused every reset
(``pause(clear_cache=True)`` raised, issue 40).

Contract: engine thread only (device pins are released at once). The caller changes the key derivation (a new generation, ``agentkv.kv_identity``) under
the manager's lock in the same critical section, so a lookup after this derives keys that no
copy written before can match, on any tier, remote included. Safe while jobs are in flight:
stores of ended trajectories are dropped when they complete (the manager's tombstone rules),
loads finish or fail as they would. Uses the manager's public ``delete`` plus its residency
index; no state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentkv.manager.jobs import DropOp

if TYPE_CHECKING:
    from agentkv.manager.core import TrajectoryManager


@dataclass(frozen=True)
class Invalidation:
    reason: str
    trajectories: int
    dropped_blocks: int
    stale_loads: int

    @property
    def clean(self) -> bool:
        """True when nothing looked up before the invalidation can still load."""
        return self.stale_loads == 0


def invalidate_tiers(manager: TrajectoryManager, reason: str) -> Invalidation:
    """End every trajectory and drop every idle tier copy (see the module docstring)."""
    with manager.lock:
        stale = 0
        for req in manager.requests.values():
            if req.load_state == "planned":
                manager.reqs.cancel_plan(req)
            elif req.load_state == "in_flight":
                stale += 1
        ended = dropped = 0
        for tid in list(manager.table):
            code, body = manager.delete_key(tid, reason)
            if code == 200:
                ended += 1
                dropped += int(body.get("dropped_tier_blocks", 0))
        for req in manager.requests.values():
            req.key_cache.clear()
        orphans = []
        for key in list(manager.index):
            entry = manager.index.get(key)
            if entry is None or entry.busy or entry.owners:
                continue  # in flight: the job's completion drops it (its owner is gone)
            manager.index.remove_copy(key, None)
            orphans.append(key)
        if orphans:
            manager.outbox.drops.append(DropOp(orphans))
        # Engine thread: the released pins go now, so a prefix-cache reset that follows in the
        # same call (vLLM's reset_prefix_cache) finds no block agentkv holds.
        manager._apply_pin_ops()
        manager.counters[f"invalidations_{reason}"] += 1
        return Invalidation(reason, ended, dropped + len(orphans), stale)
