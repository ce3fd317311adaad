"""The request side: one engine request of a trajectory, from lookup to finish.

Primitives:
  RequestParams           what a request says about its trajectory (the adapter validated it)
  LookupStatus            HIT | MISS | PENDING; LookupAnswer(tokens, load_async).status
  Request                 a running request: its turn, its load plan, its load job and state
  RequestTable.lookup     HIT: the longest run of blocks past vLLM's own hit that a local tier
                          holds (read-pinned until loaded); MISS; PENDING while a remote fetch
                          for a trajectory this replica never saw, or an admission wait, runs;
                          an internal device-prefetch request (``RequestParams.prefetch``) is
                          planned by prefetch.py, without a turn; MISS for good (vanilla) for a
                          request that arrived before its trajectory's DELETE
  RequestTable.mark_deleted  a DELETE's mark, against requests queued in vLLM before it
                          (a salt-generation release marks the old salt's trajectory too:
                          ``Namespace.supersede``, before the request's first lookup)
  RequestTable.alloc      the lookup becomes a LOAD job on the blocks vLLM allocated
  RequestTable.fail_load  fail closed: a load every rank reports failed (vLLM recomputes)
  RequestTable.cancel_plan  an invalidation drops a planned (unallocated) load
  RequestTable.finish     the branch's context becomes the turn's trusted blocks, pinned; HELD
                          for the grace period (or a decision made meanwhile applies)
  RequestTable.preempt    vLLM preempted a running request: its trusted computed blocks are
                          copied to host before this step's forward (swap, not recompute); its
                          next lookup loads them like any host hit

Load states: none -> planned (lookup) -> in_flight (alloc) -> ok | failed (job completes);
planned -> none (``cancel_plan``: an invalidation before the allocation).
Only blocks computed or loaded with a confirmed load are ever pinned or stored (invariant 1).
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from agentkv import metrics as m
from agentkv.manager import views
from agentkv.manager.jobs import BlockTransfer, LoadJob, StoreJob
from agentkv.manager.jobtable import JobKind
from agentkv.manager.state import (
    Branch,
    BranchState,
    DemotedBy,
    Trajectory,
    TurnStats,
    scoped_id,
)
from agentkv.manager.timers import TimerKind
from agentkv.policy import Action
from agentkv.tier import Tier

if TYPE_CHECKING:
    from agentkv.manager.core import TrajectoryManager

log = logging.getLogger("agentkv.manager")

LoadState = Literal["none", "planned", "in_flight", "ok", "failed"]
ADMISSION_MAX_WAIT_S = 5.0
# DELETE marks (``RequestTable.mark_deleted``): how long, and how many, are kept. A request that
# arrived before a DELETE and is first looked up later than this re-creates the trajectory.
DELETE_MARK_TTL_S = 3600.0
MAX_DELETE_MARKS = 65_536


@dataclass(frozen=True)
class RequestParams:
    """What a request says about its trajectory (the adapter parsed and validated it)."""

    trajectory_id: str
    branch: str = "main"
    zone_of: Callable[[int], str | None] | None = None  # token index -> zone name
    tenant: str | None = None  # the request's cache_salt: its trajectory namespace
    # An internal device-prefetch request's ticket (prefetch.py): never a turn.
    prefetch: str | None = None
    # When the request arrived, on the manager's clock (the adapter converts vLLM's
    # ``Request.arrival_time``); None: unknown. One that arrived before its trajectory's DELETE
    # runs as a vanilla request (DELETE is final against requests queued before it).
    arrived_at: float | None = None

    @property
    def key(self) -> str:
        """The trajectory's table key: its id in its tenant's namespace."""
        return scoped_id(self.trajectory_id, self.tenant)


class LookupStatus(enum.StrEnum):
    HIT = "hit"  # the tiers hold ``tokens`` more tokens: vLLM allocates, then on_alloc loads
    MISS = "miss"  # nothing past vLLM's own hit
    PENDING = "pending"  # ask again next step (a remote fetch or an admission wait runs)


@dataclass(frozen=True)
class LookupAnswer:
    tokens: int | None  # None: PENDING, ask again later
    load_async: bool = False

    @property
    def status(self) -> LookupStatus:
        if self.tokens is None:
            return LookupStatus.PENDING
        return LookupStatus.HIT if self.tokens > 0 else LookupStatus.MISS


PENDING = LookupAnswer(None)
MISS = LookupAnswer(0)


@dataclass
class LoadPlan:
    start_block: int
    keys: list[bytes]
    tier: Tier
    layerwise: bool


@dataclass
class Request:
    req_id: str
    traj: Trajectory
    branch: str
    turn: TurnStats
    first_seen: float
    device_hit: int = 0
    plan: LoadPlan | None = None
    load_job: int | None = None
    load_state: LoadState = "none"
    # What the last lookup told vLLM: False = it waits for the load (WAITING_FOR_REMOTE_KVS);
    # True = it runs the forward this step, the load must happen layer by layer inside it.
    layerwise: bool = False
    key_cache: list[bytes] = field(default_factory=list)
    prefetch: str | None = None  # the ticket of an internal device-prefetch request


class RequestTable:
    """Requests with agentkv params, by id. Engine thread, under the manager's lock."""

    def __init__(self, mgr: TrajectoryManager) -> None:
        self.m = mgr
        self.requests: dict[str, Request] = {}
        self._admission_seen: dict[str, float] = {}
        # request id -> remote fetch job for its trajectory (0: checked, nothing to wait for)
        self._remote_waits: dict[str, int] = {}
        # Requests looked up but not started (PENDING: a remote fetch or an admission wait) ->
        # their trajectory's key; those whose trajectory was deleted meanwhile are ``_orphans``:
        # they run as vanilla requests and never re-create it (DELETE is final).
        self._waiting: dict[str, str] = {}
        self._orphans: set[str] = set()
        # DELETE marks: trajectory key -> when a DELETE named it (the manager's clock), oldest
        # first. A request still queued in vLLM at the DELETE, never looked up, is unknown here:
        # its arrival before the mark is what makes it an orphan too. Bounded by
        # DELETE_MARK_TTL_S and MAX_DELETE_MARKS.
        self._deleted_at: OrderedDict[str, float] = OrderedDict()

    def lookup(
        self,
        req_id: str,
        params: RequestParams,
        prompt_token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        num_computed: int,
        num_tokens: int | None = None,
    ) -> LookupAnswer:
        """Contract: HIT with tokens (a multiple of the block size) the tiers hold past
        ``num_computed``, never the request's last token (``num_tokens``: prompt and output so
        far, a preempted request's; default the prompt's); MISS (0) when nothing; PENDING (None)
        while a remote fetch for a trajectory this replica never saw, or an admission wait,
        runs. Repeatable for one request (vLLM asks again after a failed allocation, a
        preemption or a PENDING): each call replaces the last plan."""
        if params.prefetch is not None:
            return self.m.prefetcher.lookup(
                req_id, params, prompt_token_ids, block_hashes, num_computed
            )
        now = self.m.clock.now()
        req = self.requests.get(req_id)
        if req is None:
            if req_id in self._orphans:
                return MISS
            if self._queued_before_delete(req_id, params, now):
                return MISS
            # Before any wait: the old salt's pins are given back before an admission wait
            # weighs the pool, and its stale copies are gone before the request plans a load.
            self.m.names.supersede(
                params.key, now if params.arrived_at is None else params.arrived_at
            )
            if self._waits_for_remote(
                req_id, params, prompt_token_ids, block_hashes, num_computed
            ) or self._waits_for_admission(req_id, params, now):
                self._waiting[req_id] = params.key
                return PENDING
            self._waiting.pop(req_id, None)
            req = self._start_request(req_id, params, prompt_token_ids, now)
        else:
            self.release_plan(req)
            req.load_job = None
        req.device_hit = num_computed
        req.turn.device_hit_tokens = num_computed
        req.load_state = "none"
        req.layerwise = False
        total = max(len(prompt_token_ids), num_tokens or 0)
        return self.plan_load(req, total, block_hashes, num_computed)

    def _waits_for_remote(
        self,
        req_id: str,
        params: RequestParams,
        prompt: Sequence[int],
        block_hashes: Sequence[bytes],
        num_computed: int,
    ) -> bool:
        """A trajectory this replica never saw may have run elsewhere (failover, rebalancing):
        its prompt's full blocks past the device hit are fetched from the remote tier into host
        before its first lookup, which then loads them like any host hit. True while the fetch
        runs (bounded by job_timeout_s); misses only cost the recompute vLLM would do anyway."""
        if not self.m.config.remote_enabled:
            return False
        job = self._remote_waits.get(req_id)
        if job is None:
            self._remote_waits[req_id] = job = 0
            if params.key not in self.m.table:
                bs = self.m.config.block_size
                hashes = block_hashes[num_computed // bs : len(prompt) // bs]
                if hashes:
                    keys = [self.m.key_of(h) for h in hashes]
                    job = self.m.fetch_remote_for(params.key, keys) or 0
                    self._remote_waits[req_id] = job
        return bool(job) and job in self.m.jobs

    def orphan_waiting(self, key: str) -> None:
        """The trajectory ``key`` was deleted: requests that were looked up for it and still
        wait (vLLM asks again) run without it. O(waiting requests), a short list."""
        for req_id, waits_for in list(self._waiting.items()):
            if waits_for == key:
                del self._waiting[req_id]
                self._orphans.add(req_id)
                self.m.counters["requests_of_deleted_trajectories"] += 1

    def waiting_for(self, key: str) -> bool:
        """A request of the trajectory ``key`` was looked up and waits to start (PENDING: a
        remote fetch or an admission wait). O(waiting requests), a short list."""
        return key in self._waiting.values()

    def mark_deleted(self, key: str) -> None:
        """A DELETE named the trajectory ``key`` (answered 200 or 404: on another DP rank a
        request of it may still be queued): every request that arrived until now and is looked
        up later runs without it. O(1) amortized; the oldest marks go past the bounds."""
        now = self.m.clock.now()
        marks = self._deleted_at
        marks.pop(key, None)
        marks[key] = now
        while marks and (
            len(marks) > MAX_DELETE_MARKS or now - next(iter(marks.values())) > DELETE_MARK_TTL_S
        ):
            marks.popitem(last=False)
            self.m.counters["delete_marks_expired"] += 1

    def _queued_before_delete(self, req_id: str, params: RequestParams, now: float) -> bool:
        """A request unknown here that arrived before its trajectory's DELETE (queued in vLLM
        meanwhile) becomes an orphan: vanilla from now on, never re-creating the trajectory.
        The same instant counts as before: DELETE is final, an ambiguous race runs vanilla."""
        if params.arrived_at is None or not self._deleted_at:
            return False
        at = self._deleted_at.get(params.key)
        if at is None or params.arrived_at > at or now - at > DELETE_MARK_TTL_S:
            return False
        self._orphans.add(req_id)
        self.m.counters["requests_of_deleted_trajectories"] += 1
        return True

    def _waits_for_admission(self, req_id: str, params: RequestParams, now: float) -> bool:
        """A new trajectory waits (at most ADMISSION_MAX_WAIT_S) for pressure demotion rather
        than evicting live ones, when ``admission_wait`` is on and the pool is over high water."""
        traj = self.m.table.get(params.key)
        if (
            self.m.config.admission_wait
            and (traj is None or not traj.turn_count)
            and self.m.pinner.usage() > self.m.config.high_water
        ):
            first = self._admission_seen.setdefault(req_id, now)
            if now - first < ADMISSION_MAX_WAIT_S:
                self.m.counters["admission_waits"] += 1
                return True
        self._admission_seen.pop(req_id, None)
        return False

    def _start_request(
        self, req_id: str, params: RequestParams, prompt: Sequence[int], now: float
    ) -> Request:
        """A new turn of a branch: the branch becomes ACTIVE (the pause it was in ends)."""
        traj = self.m.names.for_request(params.key, now)
        turn = TurnStats(turn=traj.turn_count + 1, branch=params.branch, prompt_tokens=len(prompt))
        req = self.requests[req_id] = Request(req_id, traj, params.branch, turn, now)
        branch = traj.branch(params.branch)
        if self.m.config.device_prefetch:
            traj.salt = params.tenant  # in memory only: a device prefetch hashes like the turns
        if branch.state is not BranchState.ACTIVE:
            branch.pending = None  # a decision for the pause that this turn ends
        resumed, branch.resumed_prefetch = branch.resumed_prefetch, None
        turn.prefetch = self.m.pauses.note_resume(traj, branch, now) or resumed
        if branch.running:
            self._note_concurrent(traj, turn, len(branch.running))
        branch.running.add(req_id)
        self.m.transitions.set_state(traj, branch, BranchState.ACTIVE)
        if branch.token_ids:
            lcp = _lcp(branch.token_ids, prompt)
            if lcp < min(len(branch.token_ids), len(prompt)):
                turn.first_divergence_token = lcp
                turn.divergence_zone = params.zone_of(lcp) if params.zone_of else None
        return req

    def _note_concurrent(self, traj: Trajectory, turn: TurnStats, running: int) -> None:
        """A request of a branch while ``running`` others of it run: not a next turn but
        another run under the same session id. It still counts as a turn of the trajectory (its
        prompt, hits and pauses apply to the branch as ever, the last to finish keeps the
        context); the turn's stats, a counter and one warning per trajectory tell it."""
        turn.concurrent_turns = running
        self.m.counters["concurrent_turns"] += 1
        self.m.metrics.add(m.CONCURRENT_TURNS)
        if not traj.warned_concurrent:
            traj.warned_concurrent = True
            log.warning(
                "agentkv: concurrent turns of trajectory %s branch %s: a request started while %d "
                "other(s) of the branch still ran; several runs share one session id and are merged (give each "
                "run its own id; docs/sdk.md, Agent frameworks). Warned once per trajectory.",
                traj.name,
                turn.branch,
                running,
            )

    def plan_load(
        self, req: Request, prompt_len: int, block_hashes: Sequence[bytes], num_computed: int
    ) -> LookupAnswer:
        """The longest run of blocks past the device hit that a local tier holds, read-pinned
        until loaded (never evicted mid-plan)."""
        bs = self.m.config.block_size
        n_max = min((prompt_len - 1) // bs, len(block_hashes))
        start = num_computed // bs
        if start >= n_max:
            return MISS
        keys = self._keys(req, block_hashes, n_max)
        count = 0
        tiers: set[Tier] = set()
        for key in keys[start:n_max]:
            tier = self.m.index.usable(key)
            if tier is None:
                break
            tiers.add(tier)
            count += 1
        if count == 0:
            return MISS
        plan_keys = keys[start : start + count]
        for key in plan_keys:
            self.m.index.begin_read(key)
        layerwise = self.m.config.layerwise and tiers == {Tier.HOST}
        tier = Tier.DISK if Tier.DISK in tiers else Tier.HOST
        req.plan = LoadPlan(start, plan_keys, tier, layerwise)
        req.layerwise = layerwise
        req.load_state = "planned"
        return LookupAnswer(count * bs, load_async=not layerwise)

    def alloc(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """Contract: after this returns, every external token vLLM counted is covered by a queued
        LoadJob (possibly one that fails, so vLLM recomputes): never a silent hole."""
        req = self.requests.get(req_id)
        if req is None:
            if num_external > 0:  # not ours, yet vLLM counts tokens: fail closed
                self._queue_failing_load(req_id, block_ids, 0, num_external)
            return
        traj = req.traj
        branch = traj.branches.get(req.branch)
        if branch is not None and branch.pinned and not traj.deleted and req.prefetch is None:
            # The request now holds its own references to the blocks it hit.
            self.m.pins.unpin_now(branch.pinned)
            branch.pinned = []
        plan, req.plan = req.plan, None
        if num_external <= 0 or plan is None:
            if plan is not None:
                self._end_reads(plan.keys)
            req.load_state = "none"
            if num_external > 0:
                self._queue_failing_load(
                    req_id, block_ids, req.device_hit, num_external, req.layerwise
                )
            return
        bs = self.m.config.block_size
        n = num_external // bs
        targets = list(block_ids[plan.start_block : plan.start_block + n])
        keys = plan.keys[:n]
        self._end_reads(plan.keys[n:])
        if len(targets) != len(keys) or len(keys) != n:
            log.warning("agentkv: load plan mismatch for %s; recomputing", req_id)
            self._end_reads(keys)
            self._queue_failing_load(
                req_id, block_ids, plan.start_block * bs, num_external, plan.layerwise
            )
            req.load_state = "failed"
            return
        self._queue_load(req, plan, keys, targets)

    def _queue_load(
        self, req: Request, plan: LoadPlan, keys: list[bytes], targets: list[int]
    ) -> None:
        job = self.m.job_table.prepare(JobKind.LOAD, keys, plan.tier, req_id=req.req_id)
        self.m.outbox.loads.append(
            LoadJob(
                job.job_id,
                req.req_id,
                [BlockTransfer(k, b) for k, b in zip(keys, targets, strict=True)],
                layerwise=plan.layerwise,
            )
        )
        req.load_job = job.job_id
        req.load_state = "in_flight"
        req.turn.tier_hit_tokens = len(keys) * self.m.config.block_size
        req.turn.tier = plan.tier
        for key in keys:
            self.m.index.touch(key)
        self.m.counters["loads"] += 1
        self.m.counters["load_blocks"] += len(keys)
        if plan.layerwise:
            self.m.counters["layerwise_loads"] += 1

    def preempt(
        self,
        req_id: str,
        block_ids: Sequence[int],
        *,
        computed_tokens: int,
        block_hashes: Sequence[bytes],
    ) -> int:
        """vLLM preempted ``req_id``; ``block_ids`` are the blocks it held, ``computed_tokens``
        what their KV holds. Contract: copies to host only blocks that are trusted (computed, or
        loaded with a confirmed load: invariant 1) and that host lacks, in one store job the
        worker runs before this step's forward (the blocks are back in vLLM's pool, unpinned).
        The trajectory owns the copies (a later turn references them; an abort's reown drops
        them). Returns the tokens saved."""
        req = self.requests.get(req_id)
        if req is None or req.traj.deleted:
            return 0
        bs = self.m.config.block_size
        trusted = computed_tokens
        if req.load_state in ("planned", "in_flight", "failed"):
            trusted = min(trusted, req.device_hit)  # an unconfirmed load: not trusted
        n = max(0, min(trusted // bs, len(block_hashes), len(block_ids)))
        keys = self._keys(req, block_hashes, n)[:n]
        index, owner = self.m.index, req.traj.trajectory_id
        copy: list[tuple[bytes, int]] = []
        for key, bid in zip(keys, block_ids[:n], strict=True):
            e = index.get(key)
            if e is not None and (e.host or Tier.HOST in e.writing):
                self.m.names.own(req.traj, key)  # already kept: the reload reads that copy
            elif not self.m.job_table.poisoned[key] and bid >= 0:
                copy.append((key, bid))
        copy = copy[: self.m.transitions.make_room(Tier.HOST, len(copy))]
        if not copy:
            return 0
        for key, _ in copy:
            index.begin_write(key, Tier.HOST, owner)
            req.traj.owned.add(key)
        job = self.m.job_table.prepare(
            JobKind.STORE, [k for k, _ in copy], Tier.HOST, trajectory=req.traj
        )
        self.m.outbox.stores.append(
            StoreJob(
                job.job_id,
                Tier.HOST,
                [BlockTransfer(k, b) for k, b in copy],
                owner=owner,
                before_forward=True,
            )
        )
        tokens = len(copy) * bs
        self.m.counters["preempt_saves"] += 1
        self.m.counters["preempt_saved_blocks"] += len(copy)
        self.m.counters["preempt_saved_tokens"] += tokens
        self.m.metrics.add(m.PREEMPT_SAVES)
        self.m.metrics.add(m.PREEMPT_SAVED_TOKENS, float(tokens))
        return tokens

    def fail_load(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """Fail closed after an internal error: queue a load every rank reports as failed for the
        blocks past the request's device hit, so vLLM recomputes them."""
        req = self.requests.get(req_id)
        start = req.device_hit if req is not None else 0
        layerwise = req.layerwise if req is not None else False
        if req is not None:
            self.release_plan(req)
            req.load_state = "failed"
        self._queue_failing_load(req_id, block_ids, start, num_external, layerwise)

    def finish(
        self,
        req_id: str,
        block_ids: Sequence[int],
        *,
        computed_tokens: int,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        aborted: bool,
    ) -> dict[str, Any] | None:
        """Contract: pins only blocks whose KV is trustworthy: every computed block when the
        request finished normally or its load was confirmed; only the blocks before its load
        otherwise (an abort while its tier load was unconfirmed). Returns the turn's stats, or
        None for a request without agentkv params. Never pins for a deleted trajectory."""
        req = self.requests.pop(req_id, None)
        self._admission_seen.pop(req_id, None)
        self._remote_waits.pop(req_id, None)
        self._waiting.pop(req_id, None)
        self._orphans.discard(req_id)
        if req is None:
            return None
        now = self.m.clock.now()
        self.release_plan(req)
        if req.prefetch is not None:
            self.m.prefetcher.finish(req, block_ids, computed_tokens, block_hashes, aborted)
            return None
        traj = req.traj
        branch = traj.branch(req.branch)
        branch.running.discard(req_id)
        traj.add_turn(req.turn)
        views.record_turn(self.m.metrics, req.turn)
        stats = req.turn.to_dict()
        stats["trajectory_id"] = traj.name
        stats["prefix_hit_ratio"] = round(traj.prefix_hit_ratio, 6)
        if traj.deleted:
            if traj.running == 0:
                self.m.tombstones.pop(id(traj), None)
            return stats
        trusted = computed_tokens
        if req.load_state in ("planned", "in_flight", "failed") and aborted:
            trusted = min(trusted, req.device_hit)
            self.m.counters["aborted_loads"] += 1
            if len(branch.keys) > trusted // self.m.config.block_size:
                # The aborted turn knows less than the branch's last context: keep that
                # context (and its tier copies) instead of shrinking it.
                traj.last_active = now
                if branch.running:
                    pass  # another request of the branch runs: stays ACTIVE
                elif branch.pinned:
                    # A turn of the branch that finished meanwhile pinned that context: it is
                    # on the device, so the branch is HELD as after that turn, not demoted
                    # with those pins still held.
                    self._hold(traj, branch, now)
                else:
                    self.m.transitions.fall_back(traj, branch, DemotedBy.ABORTED)
                return stats
        self._keep_context(req, branch, block_ids, token_ids, block_hashes, trusted)
        traj.last_active = now
        self.m.names.reown(traj)
        if not branch.running:  # else another request of the branch runs: stays ACTIVE
            self._hold(traj, branch, now)
        return stats

    def _keep_context(
        self,
        req: Request,
        branch: Branch,
        block_ids: Sequence[int],
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        trusted: int,
    ) -> None:
        """The branch's context becomes the finished turn's trusted blocks, pinned."""
        n_full = max(0, min(len(block_ids), trusted // self.m.config.block_size, len(block_hashes)))
        keys = self._keys(req, block_hashes, n_full)[:n_full]
        if branch.pinned:
            self.m.pins.unpin_now(branch.pinned)
        ids = [b for b in block_ids[:n_full] if b is not None and b >= 0]
        n_full = len(ids)
        branch.token_ids = list(token_ids[:trusted])
        branch.keys = keys[:n_full]
        branch.hashes = list(block_hashes[:n_full])
        branch.block_ids = ids
        self.m.pins.pin_now(ids)
        branch.pinned = ids

    def _hold(self, traj: Trajectory, branch: Branch, now: float) -> None:
        """HELD for the grace period; a decision made while the request ran applies now."""
        self.m.transitions.set_state(traj, branch, BranchState.HELD)
        branch.grace_until = now + self.m.config.grace_s
        pending, branch.pending = branch.pending, None
        if pending is not None:
            self.m.transitions.apply(traj, branch, Action(pending[0]), pending[1], now, pending[2])
        elif self.m.config.grace_s <= 0:
            self.m.transitions.default_action(traj, branch, now)
        else:
            self.m.timers.add(
                branch.grace_until, TimerKind.GRACE, (traj, branch), branch.timer_token
            )

    def _keys(self, req: Request, block_hashes: Sequence[bytes], n: int) -> list[bytes]:
        cache = req.key_cache
        for h in block_hashes[len(cache) : n]:
            cache.append(self.m.key_of(h))
        return cache

    def _end_reads(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.m.index.end_read(key)
        self.m.transitions.drain_doomed()

    def cancel_plan(self, req: Request) -> None:
        """A planned load that will not happen (an invalidation: its keys are stale): its read
        pins go and the request forgets its plan, so its next lookup plans afresh. ``layerwise``
        stays what the lookup told vLLM: an allocation without a new lookup fails closed as the
        request expects (``alloc``: no plan, external tokens counted)."""
        self.release_plan(req)
        req.load_state = "none"
        self.m.counters["loads_cancelled"] += 1

    def release_plan(self, req: Request) -> None:
        if req.plan is not None:
            keys, req.plan = req.plan.keys, None
            self._end_reads(keys)

    def _queue_failing_load(
        self,
        req_id: str,
        block_ids: Sequence[int],
        start_token: int,
        num_external: int,
        layerwise: bool = False,
    ) -> None:
        """``layerwise`` as the lookup told vLLM: a request it runs this step must see the
        failure inside this step's forward, not after it computed on unloaded blocks."""
        bs = self.m.config.block_size
        first = start_token // bs
        targets = list(block_ids[first : first + max(0, num_external) // bs]) or list(
            block_ids[first:]
        )
        # Empty keys are held by no tier: every rank reports each block as failed to load.
        self.m.outbox.loads.append(
            LoadJob(
                self.m.job_table.next_id(),
                req_id,
                [BlockTransfer(b"", b) for b in targets],
                layerwise=layerwise,
            )
        )
        self.m.counters["failed_closed_loads"] += 1


# Chunk widths of ``_lcp``'s search, widest first: slice compares run in C, so a prompt that
# extends the branch's context costs one compare, a divergence a few dozen.
_LCP_WIDTHS = (512, 64, 8, 1)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences. Compares list slices (C) rather than
    converting both to arrays: the conversion of every token was most of the cost."""
    n = min(len(a), len(b))
    x = a[:n] if isinstance(a, list) else list(a[:n])
    y = b[:n] if isinstance(b, list) else list(b[:n])
    if x == y:
        return n
    lo = 0
    for width in _LCP_WIDTHS:
        while lo + width <= n and x[lo : lo + width] == y[lo : lo + width]:
            lo += width
    return lo
