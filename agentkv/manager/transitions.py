"""Branch state transitions: carrying out a decision, and the tier jobs a transition starts.

Primitives:
  Transitions.set_state       the one way a branch changes state (bumps its timer token, leaves
                              the retained set, arms the prefetch, re-owns on DROPPED)
  Transitions.apply           a decision for a branch whose blocks are pinned (HELD, RETAINED)
  Transitions.apply_decision  a decision in whatever state the branch is (a late pause too)
  Transitions.fire            a branch timer came up: GRACE, LEASE or PREFETCH
  Transitions.default_action  a grace ended with no pause: ``default_action`` (a host copy
                              deferred under ``writeback: forecast``)
  Transitions.demote          the engine's own move (lease expired, pool pressure)
  Transitions.defer           a deferred host write-back: unpin into vLLM's cache (CACHED)
  Transitions.write_back      a CACHED branch's copy, once eviction is forecast: its still-cached
                              blocks are pinned and stored (the rest are lost: recompute)
  Transitions.on_job_done     a job completed: what it means for its branch
  offload / copy_down / promote / upload / copy_down_lru
                              the tier writes a transition starts: reserve slots in the index,
                              register the job, queue the wire job
  make_room                   drop least recently used idle copies so new ones fit
  lose_key, drain_doomed      a key no tier is trusted for; idle keys nobody owns

State machine (state.py has the states):
  ACTIVE --finish--> HELD --grace/decision--> RETAINED | CACHED | OFFLOADING | DROPPED
  RETAINED --lease/pressure--> OFFLOADING; OFFLOADING --store done--> OFFLOADED (failed: DROPPED)
  CACHED --eviction forecast--> OFFLOADING (nothing still cached: OFFLOADED/DROPPED, fall_back)
  any paused state --lookup of a new turn--> ACTIVE
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentkv import metrics as m
from agentkv.manager.jobs import BlockTransfer, DropOp, MoveJob, MoveKind, StoreJob
from agentkv.manager.jobtable import Job, JobKind
from agentkv.manager.state import Branch, BranchState, DemotedBy, Trajectory
from agentkv.manager.timers import TimerKind
from agentkv.policy import DEMOTION_ACTION, Action, Writeback
from agentkv.tier import Tier

if TYPE_CHECKING:
    from agentkv.manager.core import TrajectoryManager

# Host use above this fraction (with a disk tier) copies least recently used host blocks down.
HOST_COPY_DOWN_AT = 0.9
HOST_COPY_DOWN_TO = 0.8


class Transitions:
    def __init__(self, mgr: TrajectoryManager) -> None:
        self.m = mgr

    # ------------------------------------------------------------------ states

    def set_state(self, traj: Trajectory, branch: Branch, state: BranchState) -> None:
        branch.state = state
        branch.timer_token += 1
        ref = (id(traj), branch.name)
        if state is BranchState.HELD:
            self.m.held[ref] = (traj, branch)
        else:
            self.m.held.pop(ref, None)
        self.m.writebacks.track(traj, branch)
        if state is not BranchState.RETAINED:
            self.m.leases.release(traj, branch)
        if state is BranchState.OFFLOADED:
            self.arm_prefetch(traj, branch)
        elif state is BranchState.DROPPED and not traj.deleted:
            self.m.names.reown(traj)  # nothing kept: tier copies only this branch held go

    def arm_prefetch(self, traj: Trajectory, branch: Branch) -> None:
        """The pause's prefetch timer, valid while the branch stays OFFLOADED (a store still in
        flight arms it when it completes)."""
        if (
            branch.state is BranchState.OFFLOADED
            and branch.prefetch_due is not None
            and branch.prefetch_done_at is None
        ):
            self.m.timers.add(
                branch.prefetch_due, TimerKind.PREFETCH, (traj, branch), branch.timer_token
            )

    def fall_back(self, traj: Trajectory, branch: Branch, why: DemotedBy) -> None:
        """The device copy is gone (evicted, an aborted turn): OFFLOADED when a tier still has
        the context, DROPPED otherwise."""
        branch.demoted_by = why
        has_tier = any(self.m.index.usable(k) for k in branch.keys)
        self.set_state(traj, branch, BranchState.OFFLOADED if has_tier else BranchState.DROPPED)

    # ------------------------------------------------------------------ decisions

    def apply_decision(
        self,
        traj: Trajectory,
        branch: Branch,
        action: Action,
        lease_s: float,
        now: float,
        deferred: bool = False,
    ) -> tuple[bool, str | None]:
        """Carry out a pause decision in whatever state the branch is; (applied, note).
        ``deferred``: an offload_host whose copy waits for an eviction forecast."""
        state = branch.state
        if state is BranchState.ACTIVE:
            branch.pending = (action, lease_s, deferred)
            return False, "a request of this branch is running: applied when it finishes"
        if state in (BranchState.HELD, BranchState.RETAINED):
            self.apply(traj, branch, action, lease_s, now, deferred)
            return True, None
        if state is BranchState.CACHED and action.tier is not None:
            if not deferred:
                self.m.pins.queue_writeback((traj, branch, action.tier))
            return True, None
        # A late pause: the engine already moved the branch off the device on its own.
        if action == Action.RETAIN:
            if not self.m.pins.still_cached(branch):
                return False, "the device blocks were evicted since; the tier copy is kept"
            # Pinned by the engine thread, which checks again that the blocks still hold it.
            self.m.pins.queue_repin((traj, branch))
            self.set_state(traj, branch, BranchState.RETAINED)
            branch.tier = None
            self.m.leases.retain(traj, branch, lease_s, now)
            return True, None
        if action == Action.OFFLOAD_DISK:
            if state is BranchState.OFFLOADING:
                branch.pending = (action, lease_s, False)
                return True, "applied when the copy in flight completes"
            self.copy_down(traj, branch)
            return True, None
        if action.tier is not None:
            # offload_host, or any offload without a late-pause rule of its own: the copy the
            # engine already made (or its drop) stands; never mistaken for a drop below.
            if state is BranchState.DROPPED:
                return False, "the device blocks were released before the decision"
            return True, None
        # drop: release the tier copies only this trajectory holds
        branch.tier = None
        self.set_state(traj, branch, BranchState.DROPPED)
        return True, None

    def apply(
        self,
        traj: Trajectory,
        branch: Branch,
        action: Action,
        lease_s: float,
        now: float,
        deferred: bool = False,
        urgent: bool = False,
    ) -> None:
        """Carry out a decision for a branch whose blocks are pinned (HELD or RETAINED).
        ``urgent``: a blocked queue waits for these blocks; the copy runs before this step's
        forward, so the pins are gone by the next schedule. Every path ends in ``set_state``,
        which ends a lease for any state but RETAINED (and a retain renews it)."""
        action = Action(action)
        if action is Action.RETAIN:
            self.set_state(traj, branch, BranchState.RETAINED)
            self.m.leases.retain(traj, branch, lease_s, now)
            return
        if deferred and action is Action.OFFLOAD_HOST:
            self.defer(traj, branch)
            return
        tier = action.tier
        if tier is not None:
            if tier == Tier.DISK and not self.m.config.disk_enabled:
                tier = Tier.HOST
            self.offload(traj, branch, tier, urgent)
            return
        self.m.pins.unpin_later(branch.pinned)
        branch.pinned = []
        self.set_state(traj, branch, BranchState.DROPPED)
        branch.tier = None

    def defer(self, traj: Trajectory, branch: Branch) -> None:
        """Write back only when it pays: the blocks go back, unpinned, to vLLM's prefix cache
        (a resume before any eviction hits them there); the host copy is made by
        ``write_back`` once the pool forecasts eviction. Tier copies the branch's keys already
        have stay owned (CACHED is a kept state)."""
        self.m.pins.unpin_later(branch.pinned)
        branch.pinned = []
        branch.tier = None
        self.set_state(traj, branch, BranchState.CACHED)
        self.m.writebacks.note(traj, branch)
        self.m.counters["writebacks_deferred"] += 1

    def write_back(
        self, traj: Trajectory, branch: Branch, tier: Tier = Tier.HOST, cached: int | None = None
    ) -> None:
        """Engine thread: a CACHED branch's deferred copy. The leading blocks vLLM still caches
        are pinned and stored as any offload (pins move to the store job); when none is left,
        the branch falls back to its tier copies or to DROPPED (a miss recomputes).
        ``cached``: how many the pool held just before a plain prefix-cache reset took their
        hashes (their KV is intact until vLLM allocates them again: writeback.py)."""
        n = self.m.pins.still_cached(branch) if cached is None else cached
        if n < len(branch.block_ids):
            self.m.counters["writebacks_deferred_lost_blocks"] += len(branch.block_ids) - n
        if n == 0:
            self.fall_back(traj, branch, DemotedBy.EVICTED)
            return
        ids = branch.block_ids[:n]
        self.m.pins.pin_now(ids)
        branch.pinned = list(ids)
        self.m.counters["writebacks_deferred_copied"] += 1
        self.offload(traj, branch, tier, urgent=self.m.admission.blocked)

    def default_action(self, traj: Trajectory, branch: Branch, now: float) -> None:
        """A HELD branch whose grace ended with no pause: ``default_action``. Under
        ``writeback: forecast`` its host copy is deferred like a pause's (no wait is predicted,
        so it is made once eviction is forecast within the horizon): a finished turn nobody
        paused is the common case of a harness that never pauses, and in a roomy pool its copy
        was never read. A fixed policy (``policy_override``) and ``eager`` copy at once."""
        cfg = self.m.config
        action = Action(cfg.default_action)
        deferred = cfg.writeback is Writeback.FORECAST and cfg.policy_override is None
        self.apply(traj, branch, action, 0.0, now, deferred=deferred)

    def demote(
        self, traj: Trajectory, branch: Branch, reason: DemotedBy, now: float, urgent: bool = False
    ) -> None:
        """The engine's own move off the device (a lease ran out, pool pressure, a blocked
        queue: ``urgent``)."""
        self.m.metrics.add(m.DEMOTIONS, reason=reason)
        if branch.device_prefetch is not None:
            # A prefetched branch's tier copy still holds it: unpin, nothing to write.
            self.m.prefetcher.expire(traj, branch, reason)
            return
        self.apply(traj, branch, DEMOTION_ACTION, 0.0, now, urgent=urgent)
        branch.demoted_by = reason

    def fire(self, kind: TimerKind, traj: Trajectory, branch: Branch, now: float) -> None:
        if kind is TimerKind.GRACE and branch.state is BranchState.HELD:
            self.m.counters["grace_expired"] += 1
            self.m.metrics.add(m.DEMOTIONS, reason=DemotedBy.GRACE_EXPIRED)
            branch.demoted_by = DemotedBy.GRACE_EXPIRED
            self.default_action(traj, branch, now)
        elif kind is TimerKind.LEASE and branch.state is BranchState.RETAINED:
            self.m.counters["lease_expired_demotions"] += 1
            self.demote(traj, branch, DemotedBy.LEASE_EXPIRED, now)
        elif (
            kind is TimerKind.PREFETCH
            and branch.state is BranchState.OFFLOADED
            and branch.prefetch_done_at is None
            # Into device blocks when it pays (prefetch.py), else disk -> host.
            and not self.m.prefetcher.start(traj, branch, now)
            and branch.tier == Tier.DISK
        ):
            self.promote(traj, branch, now)

    def on_job_done(self, job: Job, ok: bool, timed_out: bool, now: float) -> None:
        """What a completed job means for the branch that started it."""
        traj, name = job.trajectory, job.branch
        branch = traj.branches.get(name) if traj is not None and name is not None else None
        if branch is None or traj is None or traj.deleted:
            return  # a deleted trajectory's copies are disowned: nothing more is written
        if job.kind is JobKind.PROMOTE and ok:
            branch.prefetch_done_at = now
        if job.kind in (JobKind.STORE, JobKind.COPY_DOWN) and branch.store_job == job.job_id:
            branch.store_job = None
            if branch.state is BranchState.OFFLOADING:
                self._offload_done(traj, branch, job, ok, timed_out, now)
        if job.kind is JobKind.STORE and ok:
            self.copy_down_lru()
            self.upload(job.keys)

    def _offload_done(
        self, traj: Trajectory, branch: Branch, job: Job, ok: bool, timed_out: bool, now: float
    ) -> None:
        if ok:
            if job.kind is JobKind.COPY_DOWN:
                self._drop_host_copies(traj, job.keys)
            self.set_state(traj, branch, BranchState.OFFLOADED)
        else:
            branch.demoted_by = DemotedBy.JOB_TIMEOUT if timed_out else DemotedBy.STORE_FAILED
            branch.tier = None
            self.set_state(traj, branch, BranchState.DROPPED)
        pending, branch.pending = branch.pending, None
        if pending is not None and branch.state is BranchState.OFFLOADED:
            self.apply_decision(traj, branch, Action(pending[0]), pending[1], now, pending[2])

    # ------------------------------------------------------------------ tier writes

    def _skip(self, key: bytes) -> bool:
        """A key a late rank of a timed-out write may still publish: never written anew."""
        return bool(self.m.job_table.poisoned[key])

    def offload(self, traj: Trajectory, branch: Branch, tier: Tier, urgent: bool = False) -> None:
        """Write-back: copy the pinned blocks the tier lacks; the pins move to the store job
        (``urgent``: copied before this step's forward, unpinned by the next schedule)."""
        index = self.m.index
        owner = traj.trajectory_id
        copy: list[tuple[bytes, int]] = []
        queued: set[bytes] = set()
        pinned = branch.pinned
        for key, bid in zip(branch.keys[: len(pinned)], pinned, strict=False):
            entry = index.get(key)
            have = entry is not None and (
                entry.has(tier) or tier in entry.writing or (tier == Tier.HOST and entry.disk)
            )
            if have or self._skip(key) or key in queued:
                self.m.names.own(traj, key)
            else:
                copy.append((key, bid))
                queued.add(key)
        copy = copy[: self.make_room(tier, len(copy))]
        copied = {bid for _, bid in copy}
        self.m.pins.unpin_later([b for b in pinned if b not in copied])
        branch.pinned = []
        branch.tier = tier
        if not copy:
            self.set_state(traj, branch, BranchState.OFFLOADED)
            return
        for key, _ in copy:
            index.begin_write(key, tier, owner)
            traj.owned.add(key)
        job = self.m.job_table.prepare(
            JobKind.STORE,
            [k for k, _ in copy],
            tier,
            block_ids=[b for _, b in copy],
            trajectory=traj,
            branch=branch.name,
        )
        self.m.pins.releasing += len(copy)
        self.m.outbox.stores.append(
            StoreJob(
                job.job_id,
                tier,
                [BlockTransfer(k, b) for k, b in copy],
                owner=owner,
                before_forward=urgent,
            )
        )
        self.set_state(traj, branch, BranchState.OFFLOADING)
        branch.store_job = job.job_id
        self.m.counters["stores"] += 1
        self.m.counters["store_blocks"] += len(copy)

    def make_room(self, tier: Tier, n: int) -> int:
        """Free slots in ``tier`` for ``n`` new copies by dropping idle copies: in host, those
        that disk also holds first (no data lost), then least recently used. Returns how many
        fit."""
        index = self.m.index
        short = n - index.free(tier)
        if short > 0:
            for key in index.victims(tier, short, on_disk_first=tier == Tier.HOST):
                self.m.outbox.drops.append(DropOp([key], tier))
                index.remove_copy(key, tier)
                self.m.counters[f"evictions_{tier}"] += 1
        return min(n, index.free(tier))

    def _move(
        self, kind: JobKind, move: MoveKind, keys: list[bytes], tier: Tier, traj: Trajectory | None
    ) -> Job:
        """Reserve ``tier`` slots for a tier -> tier copy of ``keys`` (read-pinned at their
        source) and queue it."""
        for key in keys:
            self.m.index.begin_write(key, tier, traj.trajectory_id if traj else None)
            self.m.index.begin_read(key, load=False)
            if traj is not None:
                traj.owned.add(key)
        job = self.m.job_table.prepare(kind, keys, tier, trajectory=traj)
        self.m.outbox.moves.append(MoveJob(job.job_id, move, keys))
        return job

    def copy_down(self, traj: Trajectory, branch: Branch) -> None:
        """A late disk decision: host copies of the branch go down to disk."""
        if not self.m.config.disk_enabled:
            return
        keys = []
        for key in branch.keys:
            e = self.m.index.get(key)
            if e is None or e.doomed or e.disk or Tier.DISK in e.writing or not e.host:
                continue
            if not self._skip(key):
                keys.append(key)
        keys = keys[: self.make_room(Tier.DISK, len(keys))]
        branch.tier = Tier.DISK
        if not keys:
            self.set_state(traj, branch, BranchState.OFFLOADED)
            return
        job = self._move(JobKind.COPY_DOWN, MoveKind.DEMOTE, keys, Tier.DISK, traj)
        job.branch = branch.name
        self.set_state(traj, branch, BranchState.OFFLOADING)
        branch.store_job = job.job_id

    def promote(self, traj: Trajectory, branch: Branch, now: float) -> None:
        """Disk -> host copies of the branch's disk-only blocks (a prefetch or a resume)."""
        keys = []
        in_flight = False
        for key in branch.keys:
            e = self.m.index.get(key)
            if e is None or e.doomed or e.host or not e.disk:
                continue
            if Tier.HOST in e.writing:
                in_flight = True  # an earlier promote: done when it completes
                continue
            if not self._skip(key):
                keys.append(key)
        keys = keys[: self.make_room(Tier.HOST, len(keys))]
        if not keys:
            if not in_flight:
                branch.prefetch_done_at = branch.prefetch_done_at or now
            return
        job = self._move(JobKind.PROMOTE, MoveKind.PROMOTE, keys, Tier.HOST, traj)
        job.branch = branch.name
        self.m.counters["prefetches"] += 1

    def upload(self, keys: Sequence[bytes]) -> None:
        """Copies every rank confirmed (a completed store) go to the shared remote tier too, so
        another replica can resume the trajectory. Only confirmed copies: a rank's own copy of
        a store that later failed or timed out may hold bytes the engine overwrote, and the
        remote tier is content-addressed and shared. The local copy is pinned (a reader) until
        the upload is reported."""
        if not self.m.config.remote_enabled:
            return
        now = self.m.clock.now()
        ready = []
        for key in keys:
            e = self.m.index.get(key)
            # Host copies only: the worker's store reads host first, and a host copy the index
            # does not list (a timed-out job's late rank, its drop still queued) must never be
            # the one published. Keys a late rank may still write are skipped for the same reason.
            # Copies the remote tier is known to hold (our own upload, within its TTL) are not
            # sent again.
            if e is None or self.m.index.external(key, now):
                continue
            if not e.doomed and e.host and not self._skip(key):
                self.m.index.begin_read(key, load=False)
                ready.append(key)
        if ready:
            job = self.m.job_table.prepare(JobKind.UPLOAD, ready, Tier.HOST)
            self.m.outbox.moves.append(MoveJob(job.job_id, MoveKind.UPLOAD, ready))

    def copy_down_lru(self) -> None:
        """Host nearly full with a disk tier: copy least recently used host-only blocks down, so
        making room later only drops host copies that disk also has."""
        index = self.m.index
        cap = index.capacity[Tier.HOST]
        if not self.m.config.disk_enabled or cap <= 0:
            return
        if index.reserved(Tier.HOST) < HOST_COPY_DOWN_AT * cap:
            return
        want = int(index.reserved(Tier.HOST) - HOST_COPY_DOWN_TO * cap)
        keys = [
            k
            for k in index.victims(Tier.HOST, want * 2)
            if not index.get(k).disk  # type: ignore[union-attr]
            and Tier.DISK not in index.get(k).writing  # type: ignore[union-attr]
            and not self._skip(k)
        ][:want]
        keys = keys[: self.make_room(Tier.DISK, len(keys))]
        if keys:
            self._move(JobKind.COPY_DOWN, MoveKind.DEMOTE, keys, Tier.DISK, None)

    def _drop_host_copies(self, traj: Trajectory, keys: Sequence[bytes]) -> None:
        """After a disk decision's copy-down: host copies that disk now also holds, that no
        other trajectory owns and nothing reads, leave host."""
        gone = []
        for key in keys:
            e = self.m.index.get(key)
            if e is None or not (e.host and e.disk) or e.busy:
                continue
            if e.owners - {traj.trajectory_id}:
                continue
            self.m.index.remove_copy(key, Tier.HOST)
            gone.append(key)
        if gone:
            self.m.outbox.drops.append(DropOp(gone, Tier.HOST))

    # ------------------------------------------------------------------ lost and idle keys

    def lose_key(self, key: bytes) -> None:
        """A rank could not serve or keep ``key``: no tier is trusted for it any more."""
        if self.m.index.get(key) is None:
            return
        self.m.index.remove_copy(key, None)
        self.m.index.spoil_writes(key)  # the drop may overtake writes in flight
        self.m.outbox.drops.append(DropOp([key]))

    def drain_doomed(self) -> None:
        doomed = self.m.index.take_doomed()
        if doomed:
            self.m.outbox.drops.append(DropOp(doomed))
