"""Ownership: the trajectory table, tier keys owned by reference, tombstones.

Primitives:
  Namespace.table         trajectory id -> Trajectory, least recently active first
  Namespace.tombstones    deleted trajectories whose requests still run (they end without
                          pinning or storing anything); a tombstone is not a state
  Namespace.for_request   the trajectory a request belongs to: created (with its IDLE timer, the
                          table kept under its cap) or moved to the most recent end
  Namespace.pop           a trajectory leaves the table (its release follows)
  Namespace.expire        an IDLE timer came up: re-armed, or the trajectory is released
  Namespace.supersede     salt_generations: a request's trajectory id under every other
                          cache_salt is an older weight version of it, released as DELETE does
  Namespace.own           a trajectory takes a reference on an indexed key
  Namespace.reown         a trajectory owns exactly the keys its live branches reference
  Namespace.release       delete / expiry / cap eviction: pins queued off, keys disowned (keys no
                          other trajectory owns are dropped), the trajectory never comes back:
                          after a DELETE not even through a request looked up before it (one
                          PENDING on its remote fetch or admission runs as a vanilla request)

Why by reference: branches of different trajectories share prefix blocks (a system prompt), so a
DELETE may only drop keys no other trajectory owns; ``Trajectory.owned`` is exactly what the
trajectory holds in the residency index, in flight included.

Salt generations (``ManagerConfig.salt_generations``, the connector's setting): an RL trainer
that salts each weight version (SkyRL's ``use_cache_salt``) sends every trajectory id again under
a new salt after a sync, and the old salt's trajectory held its pins and tier copies until its
lease and idle expiry. With the setting on, the first request of an id under a new salt releases
that id under every other salt, before the request is served. Only that id: releasing the old
salt's whole namespace would need a salt-to-trajectories index for one sync, and an id that never
comes back is released anyway by its lease (device pins) and idle expiry (tier copies); the
trajectories of one rollout step come back together, so the old namespace empties as fast as the
new step starts.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from agentkv import metrics as m
from agentkv.manager.jobs import DropOp
from agentkv.manager.state import BranchState, Trajectory, split_scoped
from agentkv.manager.timers import TimerKind

if TYPE_CHECKING:
    from agentkv.manager.core import TrajectoryManager

log = logging.getLogger("agentkv.manager")

# An idle timer whose trajectory is still busy looks again no sooner than this.
IDLE_RECHECK_S = 1.0
# How many old salts a salt-generation release remembers having logged (one INFO line each).
SALT_LOG_MEMORY = 1024


class Namespace:
    def __init__(self, mgr: TrajectoryManager) -> None:
        self.m = mgr
        self.table: OrderedDict[str, Trajectory] = OrderedDict()  # least recently active first
        self.tombstones: dict[int, Trajectory] = {}  # deleted, requests still running
        # salt_generations only: client id -> its table keys, one per cache_salt it runs under
        # (what ``supersede`` looks up); None when off, so a multi-tenant server pays nothing.
        self.by_name: dict[str, set[str]] | None = {} if mgr.config.salt_generations else None
        self._logged_salts: OrderedDict[str | None, None] = OrderedDict()  # tenant digests

    def for_request(self, trajectory_id: str, now: float) -> Trajectory:
        traj = self.table.get(trajectory_id)
        if traj is None:
            while len(self.table) >= self.m.config.max_trajectories and self._evict_idle_one():
                pass
            traj = Trajectory(trajectory_id, created_at=now, last_active=now)
            self.table[trajectory_id] = traj
            if self.by_name is not None:
                self.by_name.setdefault(traj.name, set()).add(trajectory_id)
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
            self.pop(tid)
            self.release(traj, "capacity")
            return True
        return False

    def expire(self, idle: Trajectory, now: float) -> None:
        idle_until = idle.last_active + self.m.config.idle_ttl_s
        if idle.running or idle_until > now:
            self.m.timers.add(max(idle_until, now + IDLE_RECHECK_S), TimerKind.IDLE, idle)
        elif self.table.get(idle.trajectory_id) is idle:
            self.pop(idle.trajectory_id)
            self.release(idle, "expired")

    def pop(self, key: str) -> Trajectory | None:
        """Take the trajectory of table key ``key`` out of the table (None: not there); the
        caller releases it."""
        traj = self.table.pop(key, None)
        if traj is not None and self.by_name is not None:
            keys = self.by_name.get(traj.name)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.by_name[traj.name]
        return traj

    def supersede(self, key: str, arrived_at: float) -> None:
        """salt_generations: the request of table key ``key`` (an id under its cache_salt),
        about to start, makes the id's trajectories under every other salt (the unsalted
        namespace included) an older weight version: each is released as a DELETE releases it
        (device pins off, tier copies dropped but those another trajectory owns, its running
        requests finish without pinning or storing, requests that arrived before it run
        vanilla), counted ``salt_generation_releases``, logged once per old salt. Skipped: one
        created after the request arrived (``arrived_at``), a newer version that a straggler of
        an older one (queued in vLLM across the sync) must not release. O(salts of the id)."""
        if self.by_name is None:
            return
        keys = self.by_name.get(split_scoped(key)[0])
        if not keys or keys == {key}:
            return
        for old in sorted(keys - {key}):
            traj = self.table[old]
            if traj.created_at > arrived_at:
                continue
            self.m.delete_key(old, "salt_generation")
            self.m.reqs.mark_deleted(old)
            self.m.counters["salt_generation_releases"] += 1
            self._log_once(traj, key)

    def _log_once(self, old: Trajectory, key: str) -> None:
        """One INFO line per old salt (by its digest: the salt itself is never logged)."""
        if old.tenant in self._logged_salts:
            return
        self._logged_salts[old.tenant] = None
        if len(self._logged_salts) > SALT_LOG_MEMORY:
            self._logged_salts.popitem(last=False)
        log.info(
            "agentkv: trajectory %s came back under another cache_salt (tenant %s, was %s): its "
            "old trajectory is released, as is every id of the old salt that comes back "
            "(salt_generations; logged once per old salt)",
            old.name,
            split_scoped(key)[1] or "unsalted",
            old.tenant or "unsalted",
        )

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
