"""Ownership: the trajectory table, tier keys owned by reference, tombstones.

Primitives:
  Namespace.table         trajectory id -> Trajectory, least recently active first
  Namespace.tombstones    deleted trajectories whose requests still run (they end without
                          pinning or storing anything); a tombstone is not a state
  Namespace.for_request   the trajectory a request belongs to: created (with its IDLE timer, the
                          table kept under its cap) or moved to the most recent end
  Namespace.expire        an IDLE timer came up: re-armed, or the trajectory is released
  Namespace.own           a trajectory takes a reference on an indexed key
  Namespace.reown         a trajectory owns exactly the keys its live branches reference
  Namespace.release       delete / expiry / cap eviction: pins queued off, keys disowned (keys no
                          other trajectory owns are dropped), the trajectory never comes back:
                          after a DELETE not even through a request looked up before it (one
                          PENDING on its remote fetch or admission runs as a vanilla request)

Why by reference: branches of different trajectories share prefix blocks (a system prompt), so a
DELETE may only drop keys no other trajectory owns; ``Trajectory.owned`` is exactly what the
trajectory holds in the residency index, in flight included.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from agentkv import metrics as m
from agentkv.manager.jobs import DropOp
from agentkv.manager.state import BranchState, Trajectory
from agentkv.manager.timers import TimerKind

if TYPE_CHECKING:
    from agentkv.manager.core import TrajectoryManager

# An idle timer whose trajectory is still busy looks again no sooner than this.
IDLE_RECHECK_S = 1.0


class Namespace:
    def __init__(self, mgr: TrajectoryManager) -> None:
        self.m = mgr
        self.table: OrderedDict[str, Trajectory] = OrderedDict()  # least recently active first
        self.tombstones: dict[int, Trajectory] = {}  # deleted, requests still running

    def for_request(self, trajectory_id: str, now: float) -> Trajectory:
        traj = self.table.get(trajectory_id)
        if traj is None:
            while len(self.table) >= self.m.config.max_trajectories and self._evict_idle_one():
                pass
            traj = Trajectory(trajectory_id, created_at=now, last_active=now)
            self.table[trajectory_id] = traj
            self.m.timers.add(now + self.m.config.idle_ttl_s, TimerKind.IDLE, traj)
        else:
            self.table.move_to_end(trajectory_id)
            traj.last_active = now
        return traj

    def _evict_idle_one(self) -> bool:
        """Evict the least recently active trajectory without a running request. One that runs
        is active now: it moves to the most recent end. So a creation passes at most the
        trajectories with running requests (bounded by the engine's running requests, not by
        the table), and each is passed once until it becomes the oldest again. False (the
        table goes over its cap) only when every trajectory runs."""
        for _ in range(len(self.table)):
            tid, traj = next(iter(self.table.items()))
            if traj.running:
                self.table.move_to_end(tid)
                continue
            self.table.pop(tid)
            self.release(traj, "capacity")
            return True
        return False

    def expire(self, idle: Trajectory, now: float) -> None:
        idle_until = idle.last_active + self.m.config.idle_ttl_s
        if idle.running or idle_until > now:
            self.m.timers.add(max(idle_until, now + IDLE_RECHECK_S), TimerKind.IDLE, idle)
        elif self.table.get(idle.trajectory_id) is idle:
            self.table.pop(idle.trajectory_id)
            self.release(idle, "expired")

    def own(self, traj: Trajectory, key: bytes) -> None:
        """``traj`` takes a reference on an indexed key, and remembers it (DELETE releases
        exactly ``traj.owned``)."""
        if self.m.index.own(key, traj.trajectory_id):
            traj.owned.add(key)

    def reown(self, traj: Trajectory) -> None:
        """The trajectory owns exactly the indexed keys its branches' contexts reference."""
        index = self.m.index
        owner = traj.trajectory_id
        wanted: set[bytes] = set()
        for b in traj.branches.values():
            if b.state is not BranchState.DROPPED:
                wanted.update(b.keys)
        old = traj.owned
        for key in wanted - old:
            index.own(key, owner)
        gone = index.disown(old - wanted, owner)
        if gone:
            self.m.outbox.drops.append(DropOp(gone))
        traj.owned = {k for k in wanted if owner in index.owners(k)}

    def release(self, traj: Trajectory, reason: str) -> dict[str, int]:
        mgr = self.m
        traj.deleted = True
        released = 0
        for branch in traj.branches.values():
            device = branch.device_prefetch is not None
            mgr.prefetcher.forget(branch)
            if branch.paused_at is not None and branch.prefetch_done_at is not None and not device:
                mgr.prefetch_outcomes.record("wasted")
                mgr.metrics.add(m.PREFETCH_OUTCOMES, outcome="wasted")
            if mgr.otel is not None:
                mgr.otel.end_pause((traj.trajectory_id, branch.name), {"agentkv.outcome": reason})
            released += len(branch.pinned)
            mgr.pins.unpin_later(branch.pinned)
            branch.pinned = []
            branch.pending = None
            branch.timer_token += 1
            mgr.leases.release(traj, branch)
            mgr.held.pop((id(traj), branch.name), None)  # its grace pins went above
            mgr.writebacks.track(traj, branch)  # deleted: no deferred copy of it is made
        gone = mgr.index.disown(traj.owned, traj.trajectory_id)
        traj.owned = set()
        if gone:
            mgr.outbox.drops.append(DropOp(gone))
        if traj.running:
            self.tombstones[id(traj)] = traj
        if reason not in ("capacity", "expired"):  # DELETE (or an invalidation) is final
            mgr.reqs.orphan_waiting(traj.trajectory_id)
        # trajectories_deleted | _expired | _capacity (the table cap) | _<invalidation reason>
        mgr.counters[f"trajectories_{reason}"] += 1
        return {"released_blocks": released, "dropped_tier_blocks": len(gone)}
