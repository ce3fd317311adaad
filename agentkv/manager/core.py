"""TrajectoryManager: the one authority over agent trajectories and the KV blocks they hold.

Engine-thread primitives (called from the engine's scheduler hooks, through the adapter):
  on_lookup(req, num_computed)       tokens past the engine's own prefix hit that the tiers hold,
                                     and whether they load asynchronously; pins those tier copies
  on_alloc(req_id, block_ids, n_ext) turn the lookup into a LoadJob on the allocated blocks
  fail_load(req_id, block_ids, n)    fail closed: a LoadJob every rank reports as failed, so the
                                     engine recomputes those blocks (for adapter errors)
  on_finish(req_id, ...)             pin the finished context (only blocks fully computed or
                                     loaded), start its grace period, return the turn's stats
  take_step()                        the step's jobs (drops, stores, loads, moves) for the workers
  on_report(report)                  jobs finished / failed per rank -> unpin, index, states
  has_work()                         the engine must keep stepping (jobs in flight, pins queued)
  knows, fetch_remote, job_pending  a trajectory this replica never saw: its prompt's blocks come
                                     from the shared remote tier into host first (best effort)
  record_tier_changes, take_tier_changes, tier_keys
                                     the residency index's copy changes, for the KV events
Any-thread primitives (the control channel): pause, resume, delete, get, status, tick,
next_deadline. Timers (grace, lease, prefetch, job timeouts, idle expiry) fire in ``tick``, which
the adapter calls from the engine thread every step and from the control thread when the engine
is idle; both paths only queue engine work (pins, jobs) that the engine thread applies.

Invariants (checked by tests/unit/test_manager_stateful.py after every step):
  1. A block is loaded from a tier only if its copy was completely written from blocks that
     were fully computed or loaded (aborted loads never pin or store their blocks).
  2. After a lookup counted external tokens, every failure reports those blocks as failed.
  3. Pins held in the engine's pool equal the pins this manager records, and balance to zero.
  4. A trajectory that references a tier key owns it (in flight too); DELETE frees only keys no
     other trajectory owns; a deleted trajectory never comes back (its running requests end
     without pinning or storing anything).
  5. One pressure event demotes only as many retained trajectories as needed.
  6. State is bounded (idle trajectories expire, a cap bounds the table) and per-step work is
     O(changes): timers sit in a heap; idle branches are never visited.
Every number acted on (lease, prefetch time, demotion order and action) comes from
``agentkv.policy`` and ``agentkv.predict``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from agentkv import metrics as m
from agentkv.manager.jobs import (
    BlockTransfer,
    DropOp,
    LoadJob,
    MoveJob,
    StepPlan,
    StoreJob,
    TierName,
    WorkerReport,
)
from agentkv.manager.ports import BlockPinner, Clock, MonotonicClock
from agentkv.manager.residency import ResidencyIndex
from agentkv.manager.state import (
    PAUSED_STATES,
    Branch,
    BranchState,
    Trajectory,
    TurnStats,
)
from agentkv.metrics import MetricsRecorder
from agentkv.policy import (
    DEMOTION_ACTION,
    Action,
    CostModel,
    Decision,
    PolicyParams,
    decide,
    pressure_victims,
)
from agentkv.predict import PrefetchOutcomeCounter, WaitPredictor, classify_prefetch

log = logging.getLogger("agentkv.manager")

JobKind = Literal["store", "load", "promote", "copy_down", "fetch", "upload"]
LoadState = Literal["none", "planned", "in_flight", "ok", "failed"]
ADMISSION_MAX_WAIT_S = 5.0
# Counters /status always reports (0 until they happen), so dashboards and tests see every one.
REPORTED_COUNTERS = (
    "loads",
    "layerwise_loads",
    "load_failures",
    "failed_closed_loads",
    "aborted_loads",
    "stores",
    "store_failures",
    "store_timeouts",
    "job_timeouts",
    "tier_misses",
    "tier_corrupt_blocks",
    "grace_expired",
    "lease_expired_demotions",
    "pressure_demotions",
    "prefetches",
    "evictions_host",
    "evictions_disk",
    "internal_errors",
    "remote_fetches",
    "remote_fetched_blocks",
    "remote_missed_blocks",
    "remote_uploaded_blocks",
    "remote_upload_failures",
)
# Host use above this fraction (with a disk tier) copies least recently used host blocks down.
HOST_COPY_DOWN_AT = 0.9
HOST_COPY_DOWN_TO = 0.8


@dataclass(frozen=True)
class ManagerConfig:
    block_size: int
    block_bytes: int  # all TP ranks together (what the policy weighs)
    tp_size: int = 1
    host_capacity_blocks: int = 0
    disk_capacity_blocks: int = 0
    grace_s: float = 0.5
    default_action: str = "offload_host"
    high_water: float = 0.88
    job_timeout_s: float = 30.0
    idle_ttl_s: float = 86400.0
    max_trajectories: int = 100_000
    layerwise: bool = False
    admission_wait: bool = False
    remote_enabled: bool = False  # a shared remote tier: confirmed host copies are uploaded
    # A benchmark's fixed policy (retain-always / offload-always): every pause takes this action
    # whatever ``decide`` says; None (production) follows the policy.
    policy_override: str | None = None

    @property
    def disk_enabled(self) -> bool:
        return self.disk_capacity_blocks > 0


@dataclass(frozen=True)
class RequestParams:
    """What a request says about its trajectory (the adapter parsed and validated it)."""

    trajectory_id: str
    branch: str = "main"
    zone_of: Callable[[int], str | None] | None = None  # token index -> zone name


@dataclass(frozen=True)
class LookupAnswer:
    tokens: int | None  # None: ask again later (admission wait)
    load_async: bool = False


@dataclass
class _LoadPlan:
    start_block: int
    keys: list[bytes]
    tier: str
    layerwise: bool


@dataclass
class _Request:
    req_id: str
    traj: Trajectory
    branch: str
    turn: TurnStats
    first_seen: float
    device_hit: int = 0
    plan: _LoadPlan | None = None
    load_job: int | None = None
    load_state: LoadState = "none"
    # What the last lookup told vLLM: False = it waits for the load (WAITING_FOR_REMOTE_KVS);
    # True = it runs the forward this step, the load must happen layer by layer inside it.
    layerwise: bool = False
    key_cache: list[bytes] = field(default_factory=list)


@dataclass
class _Job:
    kind: JobKind
    job_id: int
    keys: list[bytes]
    tier: TierName
    deadline: float
    block_ids: list[int] = field(default_factory=list)  # store: device blocks pinned for the copy
    trajectory: Trajectory | None = None
    branch: str | None = None
    req_id: str | None = None
    ranks: int = 0
    failed: bool = False
    started: float = 0.0
    missing: set[bytes] = field(default_factory=set)  # fetch: keys some rank could not get


@dataclass(order=True)
class _Timer:
    due: float
    seq: int
    kind: str = field(compare=False)
    ref: Any = field(compare=False)
    token: int = field(compare=False, default=0)


class TrajectoryManager:
    def __init__(
        self,
        config: ManagerConfig,
        pinner: BlockPinner,
        *,
        key_of: Callable[[bytes], bytes],
        costs: CostModel | None = None,
        policy: PolicyParams | None = None,
        predictor: WaitPredictor | None = None,
        clock: Clock | None = None,
        metrics: MetricsRecorder | None = None,
        otel: Any = None,
    ) -> None:
        self.config = config
        self.pinner = pinner
        self.key_of = key_of
        self.costs = costs or CostModel(host_link_bytes_per_s=None)
        self.policy = policy or PolicyParams()
        self.predictor = predictor or WaitPredictor()
        self.clock = clock or MonotonicClock()
        self.metrics = metrics or MetricsRecorder()
        self.otel = otel
        self.lock = threading.RLock()
        self.index = ResidencyIndex(
            {"host": config.host_capacity_blocks, "disk": config.disk_capacity_blocks}
        )
        self.table: OrderedDict[str, Trajectory] = OrderedDict()  # least recently active first
        self.tombstones: dict[int, Trajectory] = {}  # deleted, requests still running
        self.requests: dict[str, _Request] = {}
        self.jobs: dict[int, _Job] = {}
        # Timed-out store/move jobs: (keys, tier, ranks still to report). A late rank may still
        # publish those keys (a late store, possibly from reused blocks): each late report drops
        # them again, and they are not written anew until every rank reported.
        self._timed_out: dict[int, tuple[list[bytes], TierName, int]] = {}
        # timed-out upload job -> (keys still pinned, ranks yet to report)
        self._late_uploads: dict[int, tuple[list[bytes], int]] = {}
        self._poisoned: Counter[bytes] = Counter()
        self._job_ids = itertools.count(1)
        self._timer_seq = itertools.count()
        self._timers: list[_Timer] = []
        self._outbox = StepPlan()
        self._pin_ops: list[tuple[str, Any]] = []  # queued by non-engine threads
        self._pins: Counter[int] = Counter()  # block id -> pins held (all reasons)
        self._releasing = 0  # pinned blocks of store jobs in flight (about to be unpinned)
        self._unpins_queued = 0  # pinned blocks whose unpin waits for the engine thread
        self._retained: dict[tuple[int, str], tuple[Trajectory, Branch]] = {}
        self.counters: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.prefetch_outcomes = PrefetchOutcomeCounter()
        self._admission_seen: dict[str, float] = {}
        self._engine_ident: int | None = None
        self._bad_keys: dict[bytes, str] = {}  # keys ranks reported bad (bounded below)

    # ================================================================== engine-thread hooks

    def on_lookup(
        self,
        req_id: str,
        params: RequestParams,
        prompt_token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        num_computed: int,
    ) -> LookupAnswer:
        """Contract: tokens (a multiple of the block size) the tiers hold past ``num_computed``,
        never the prompt's last token; 0 when nothing. Repeatable for one request (vLLM asks
        again after a failed allocation or a preemption): each call replaces the last plan."""
        with self.lock:
            self._apply_pin_ops()
            now = self.clock.now()
            req = self.requests.get(req_id)
            if req is None:
                traj = self.table.get(params.trajectory_id)
                if (
                    self.config.admission_wait
                    and (traj is None or not traj.turn_count)
                    and self.pinner.usage() > self.config.high_water
                ):
                    first = self._admission_seen.setdefault(req_id, now)
                    if now - first < ADMISSION_MAX_WAIT_S:
                        # A new trajectory waits for pressure demotion rather than evicting live
                        # ones; vLLM asks again next step.
                        self.counters["admission_waits"] += 1
                        return LookupAnswer(None)
                self._admission_seen.pop(req_id, None)
                traj = self._traj_for_request(params.trajectory_id, now)
                turn = TurnStats(
                    turn=traj.turn_count + 1,
                    branch=params.branch,
                    prompt_tokens=len(prompt_token_ids),
                )
                req = self.requests[req_id] = _Request(req_id, traj, params.branch, turn, now)
                branch = traj.branch(params.branch)
                if branch.state is not BranchState.ACTIVE:
                    branch.pending = None  # a decision for the pause that this turn ends
                self._note_resume(traj, branch, now)
                branch.running.add(req_id)
                self._set_state(traj, branch, BranchState.ACTIVE)
                if branch.token_ids:
                    lcp = _lcp(branch.token_ids, prompt_token_ids)
                    if lcp < min(len(branch.token_ids), len(prompt_token_ids)):
                        turn.first_divergence_token = lcp
                        turn.divergence_zone = params.zone_of(lcp) if params.zone_of else None
            else:
                self._release_plan(req)
                req.load_job = None
            req.device_hit = num_computed
            req.turn.device_hit_tokens = num_computed
            req.load_state = "none"
            req.layerwise = False
            bs = self.config.block_size
            n_max = min((len(prompt_token_ids) - 1) // bs, len(block_hashes))
            start = num_computed // bs
            if start >= n_max:
                return LookupAnswer(0)
            keys = self._keys(req, block_hashes, n_max)
            count = 0
            tiers: set[str] = set()
            for key in keys[start:n_max]:
                tier = self.index.usable(key)
                if tier is None:
                    break
                tiers.add(tier)
                count += 1
            if count == 0:
                return LookupAnswer(0)
            plan_keys = keys[start : start + count]
            for key in plan_keys:  # pinned in their tier until loaded: never evicted mid-plan
                self.index.begin_read(key)
            layerwise = self.config.layerwise and tiers == {"host"}
            req.plan = _LoadPlan(start, plan_keys, "disk" if "disk" in tiers else "host", layerwise)
            req.layerwise = layerwise
            req.load_state = "planned"
            return LookupAnswer(count * bs, load_async=not layerwise)

    def on_alloc(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """Contract: after this returns, every external token vLLM counted is covered by a queued
        LoadJob (possibly one that fails, so vLLM recomputes): never a silent hole."""
        with self.lock:
            self._apply_pin_ops()
            req = self.requests.get(req_id)
            if req is None:
                if num_external > 0:  # not ours, yet vLLM counts tokens: fail closed
                    self._queue_failing_load(req_id, block_ids, 0, num_external)
                return
            traj = req.traj
            branch = traj.branches.get(req.branch)
            if branch is not None and branch.pinned and not traj.deleted:
                # The request now holds its own references to the blocks it hit.
                self._unpin_now(branch.pinned)
                branch.pinned = []
            plan, req.plan = req.plan, None
            if num_external <= 0 or plan is None:
                if plan is not None:
                    for key in plan.keys:
                        self.index.end_read(key)
                    self._drain_doomed()
                req.load_state = "none"
                if num_external > 0:
                    self._queue_failing_load(
                        req_id, block_ids, req.device_hit, num_external, req.layerwise
                    )
                return
            bs = self.config.block_size
            n = num_external // bs
            targets = list(block_ids[plan.start_block : plan.start_block + n])
            keys = plan.keys[:n]
            for key in plan.keys[n:]:
                self.index.end_read(key)
            if len(targets) != len(keys) or len(keys) != n:
                log.warning("agentkv: load plan mismatch for %s; recomputing", req_id)
                for key in keys:
                    self.index.end_read(key)
                self._drain_doomed()
                self._queue_failing_load(
                    req_id, block_ids, plan.start_block * bs, num_external, plan.layerwise
                )
                req.load_state = "failed"
                return
            job = self._new_job("load", keys, plan.tier, req_id=req_id)  # type: ignore[arg-type]
            self._outbox.loads.append(
                LoadJob(
                    job.job_id,
                    req_id,
                    [BlockTransfer(k, b) for k, b in zip(keys, targets, strict=True)],
                    layerwise=plan.layerwise,
                )
            )
            req.load_job = job.job_id
            req.load_state = "in_flight"
            req.turn.tier_hit_tokens = n * bs
            req.turn.tier = plan.tier
            for key in keys:
                self.index.touch(key)
            self.counters["loads"] += 1
            self.counters["load_blocks"] += n
            if plan.layerwise:
                self.counters["layerwise_loads"] += 1

    def fail_load(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """Fail closed after an internal error: queue a load every rank reports as failed for the
        blocks past the request's device hit, so vLLM recomputes them."""
        with self.lock:
            req = self.requests.get(req_id)
            start = req.device_hit if req is not None else 0
            layerwise = req.layerwise if req is not None else False
            if req is not None:
                self._release_plan(req)
                req.load_state = "failed"
            self._queue_failing_load(req_id, block_ids, start, num_external, layerwise)

    def on_finish(
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
        with self.lock:
            self._apply_pin_ops()
            req = self.requests.pop(req_id, None)
            self._admission_seen.pop(req_id, None)
            if req is None:
                return None
            now = self.clock.now()
            self._release_plan(req)
            traj = req.traj
            branch = traj.branch(req.branch)
            branch.running.discard(req_id)
            traj.add_turn(req.turn)
            self._record_turn(req.turn)
            stats = req.turn.to_dict()
            stats["trajectory_id"] = traj.trajectory_id
            stats["prefix_hit_ratio"] = round(traj.prefix_hit_ratio, 6)
            if traj.deleted:
                if traj.running == 0:
                    self.tombstones.pop(id(traj), None)
                return stats
            trusted = computed_tokens
            unconfirmed = req.load_state in ("planned", "in_flight", "failed")
            bs = self.config.block_size
            if unconfirmed and aborted:
                trusted = min(trusted, req.device_hit)
                self.counters["aborted_loads"] += 1
                if len(branch.keys) > trusted // bs:
                    # The aborted turn knows less than the branch's last context: keep that
                    # context (and its tier copies) instead of shrinking it.
                    traj.last_active = now
                    if branch.running:
                        return stats
                    has_tier = any(self.index.usable(k) for k in branch.keys)
                    branch.demoted_by = "aborted"
                    self._set_state(
                        traj, branch, BranchState.OFFLOADED if has_tier else BranchState.DROPPED
                    )
                    return stats
            n_full = max(0, min(len(block_ids), trusted // bs, len(block_hashes)))
            keys = self._keys(req, block_hashes, n_full)[:n_full]
            if branch.pinned:
                self._unpin_now(branch.pinned)
            ids = [b for b in block_ids[:n_full] if b is not None and b >= 0]
            n_full = len(ids)
            branch.token_ids = list(token_ids[:trusted])
            branch.keys = keys[:n_full]
            branch.hashes = list(block_hashes[:n_full])
            branch.block_ids = ids
            self._pin_now(ids)
            branch.pinned = ids
            traj.last_active = now
            self._reown(traj)
            if branch.running:
                return stats  # another request of the branch still runs: stays ACTIVE
            self._set_state(traj, branch, BranchState.HELD)
            branch.grace_until = now + self.config.grace_s
            pending, branch.pending = branch.pending, None
            if pending is not None:
                self._apply(traj, branch, pending[0], pending[1], now)
            elif self.config.grace_s <= 0:
                self._apply(traj, branch, self.config.default_action, 0.0, now)
            else:
                self._add_timer(branch.grace_until, "grace", (traj, branch), branch.timer_token)
            return stats

    def take_step(self) -> StepPlan:
        """Engine thread, once per step: fire due timers, then hand over every queued job.
        Contract: never raises; loads queued before an internal error are still returned."""
        with self.lock:
            try:
                self._apply_pin_ops()
                self._tick(self.clock.now())
            except Exception:
                self.counters["internal_errors"] += 1
                log.exception("agentkv: manager tick failed; queued jobs still go out")
            # Drops of keys that went idle go out no later than any new write of the same key.
            self._drain_doomed()
            plan, self._outbox = self._outbox, StepPlan()
            return plan

    def on_report(self, report: WorkerReport) -> None:
        """Engine thread: a step's merged worker reports. Contract: never raises on unknown or
        late jobs. A store or move that timed out keeps its tier slots and its keys unwritable
        until every rank reported it; each late rank's copies are dropped again. A write that
        failed (or that a drop overtook) is dropped from the ranks that did write it."""
        with self.lock:
            self._apply_pin_ops()
            now = self.clock.now()
            self._bad_keys.update(report.bad_keys)
            for key, why in report.bad_keys.items():
                if not key:
                    continue  # a fail-closed load: no tier was ever asked
                self.counters["tier_corrupt_blocks" if why == "corrupt" else "tier_misses"] += 1
                self._lose_key(key)
            for job_id, keys in report.fetch_missing.items():
                job = self.jobs.get(job_id)
                if job is not None:
                    job.missing.update(keys)
            for job_id in report.jobs_failed:
                job = self.jobs.get(job_id)
                if job is not None:
                    job.failed = True
            for job_id, n in report.jobs_done.items():
                job = self.jobs.get(job_id)
                if job is None:
                    self._late_report(job_id, n)
                    continue
                job.ranks += n
                if job.ranks >= self.config.tp_size:
                    self._complete(job, now)
            for (kind, tier, _), (nbytes, seconds) in report.transfers.items():
                off = kind == "offload"
                if kind in ("offload", "reload"):
                    self.metrics.observe(
                        m.OFFLOAD_BYTES if off else m.RELOAD_BYTES, float(nbytes), tier=tier
                    )
                    self.metrics.observe(
                        m.OFFLOAD_SECONDS if off else m.RELOAD_SECONDS, seconds, tier=tier
                    )
            self._bad_keys.clear()
            self._drain_doomed()

    def has_work(self) -> bool:
        """Whether the engine must keep stepping: jobs queued or in flight, pins to apply."""
        with self.lock:
            return bool(self._outbox) or bool(self._pin_ops) or bool(self.jobs)

    def knows(self, trajectory_id: str) -> bool:
        with self.lock:
            return trajectory_id in self.table

    def fetch_remote(self, trajectory_id: str, keys: Sequence[bytes]) -> int | None:
        """Engine thread: copy ``keys`` (a prompt's blocks, in order) from the shared remote tier
        into the host tier for ``trajectory_id``, a trajectory this replica does not hold (it is
        created here, as its first lookup would). Keys indexed here already, or known bad, are
        skipped; host room is made as for any write. The trajectory owns the copies, so they go
        when it is deleted or expires. Returns the job id (the request waits until
        ``job_pending`` is False; its lookup then finds the fetched blocks in host) or None when
        there is nothing to fetch."""
        with self.lock:
            want = [
                k
                for k in dict.fromkeys(keys)
                if self.index.get(k) is None and not self._poisoned[k]
            ]
            want = want[: self._make_room("host", len(want))]
            if not want:
                return None
            traj = self._traj_for_request(trajectory_id, self.clock.now())
            for key in want:
                self.index.begin_write(key, "host", traj.trajectory_id)
                traj.owned.add(key)
            job = self._new_job("fetch", want, "host", trajectory=traj)
            self._outbox.moves.append(MoveJob(job.job_id, "fetch", want))
            self.counters["remote_fetches"] += 1
            return job.job_id

    def job_pending(self, job_id: int) -> bool:
        with self.lock:
            return job_id in self.jobs

    def record_tier_changes(self) -> None:
        """Log every tier copy gained or lost from now on (for KV events; off by default)."""
        with self.lock:
            self.index.record_changes()

    def take_tier_changes(self) -> list[tuple[bytes, TierName, bool]]:
        """(tier key, tier, present) since the last call, in order."""
        with self.lock:
            return self.index.take_changes()

    def tier_keys(self, tier: TierName) -> list[bytes]:
        """Keys with a complete copy in ``tier`` now (a re-announce after a cache reset)."""
        with self.lock:
            return self.index.keys_in(tier)

    # ================================================================== control (any thread)

    def tick(self) -> float | None:
        """Fire due timers; returns seconds until the next one (None: no timer)."""
        with self.lock:
            now = self.clock.now()
            self._tick(now)
            return self._next_due(now)

    def next_deadline(self) -> float | None:
        with self.lock:
            return self._next_due(self.clock.now())

    def engine_work_pending(self) -> bool:
        with self.lock:
            return bool(self._outbox) or bool(self._pin_ops)

    def pause(
        self,
        trajectory_id: str,
        branch_name: str,
        tool: str | Sequence[str],
        expected_wait_s: float | None,
        *,
        max_lease_s: float | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Decide and apply (or record, while a request runs) what happens to a paused branch.
        ``tool``: the called tool, or the tools of parallel calls (the pause is predicted and
        learned as the one with the longest predicted wait: ``WaitPredictor.longest``).
        ``max_lease_s`` caps a retain decision's lease (a client's KV retention TTL)."""
        tools = [tool] if isinstance(tool, str) else list(tool) or ["unknown"]
        tool = self.predictor.longest(tools, expected_wait_s)
        with self.lock:
            traj = self.table.get(trajectory_id)
            if traj is None:
                return 404, {"detail": f"unknown trajectory {trajectory_id!r}"}
            branch = traj.branches.get(branch_name)
            if branch is None:
                detail = f"trajectory {trajectory_id!r} has no branch {branch_name!r}"
                return 404, {"detail": detail}
            now = self.clock.now()
            estimate = self.predictor.predict(tool, expected_wait_s)
            kv_bytes = float(len(branch.keys) * self.config.block_bytes)
            decision: Decision = decide(
                tokens=branch.kv_tokens,
                kv_bytes=kv_bytes,
                wait=estimate,
                costs=self.costs,
                pressure=self._pressure(),
                host_free_bytes=float(self.index.free("host") * self.config.block_bytes),
                disk_free_bytes=float(self.index.free("disk") * self.config.block_bytes)
                if self.config.disk_enabled
                else 0.0,
                params=self.policy,
            )
            if self.config.policy_override is not None:
                decision = _overridden(decision, self.config.policy_override, self.policy)
            action = decision.action
            if action == "offload_disk" and not self.config.disk_enabled:
                action = "offload_host"
            body = decision.to_dict()
            body["action"] = action
            branch.tool = tool
            branch.paused_at = now
            branch.demoted_by = None
            p50 = estimate.p50 if math.isfinite(estimate.p50) else 0.0
            branch.predicted_return_at = now + p50
            branch.prefetch_due = (
                now + decision.prefetch_at_s
                if decision.prefetch_at_s is not None and action.startswith("offload")
                else None
            )
            branch.prefetch_done_at = None
            branch.decision = body
            self.decisions[action] += 1
            self.metrics.add(m.DECISIONS, action=action)
            if math.isfinite(estimate.p50):
                self.metrics.observe(m.TOOL_WAIT_PREDICTED, estimate.p50, tool=tool)
            if self.otel is not None:
                self.otel.start_pause(
                    (traj.trajectory_id, branch.name),
                    {
                        "agentkv.trajectory_id": traj.trajectory_id,
                        "agentkv.branch": branch.name,
                        "agentkv.tool": tool,
                        "agentkv.expected_wait_s": expected_wait_s,
                        "agentkv.predicted_wait_s": _finite_or_none(estimate.p50),
                        "agentkv.action": action,
                        "agentkv.kv_tokens": branch.kv_tokens,
                        "agentkv.kv_bytes": int(kv_bytes),
                        "agentkv.rationale": decision.rationale,
                    },
                )
            log.info(
                "agentkv: pause %s/%s tool=%s -> %s (%s)",
                trajectory_id,
                branch.name,
                tool,
                action,
                decision.rationale,
            )
            token = branch.timer_token
            lease_s = decision.lease_s
            if max_lease_s is not None and action == "retain":
                lease_s = min(lease_s, max(0.0, max_lease_s))
                body["lease_s"] = lease_s
            applied, note = self._apply_decision(traj, branch, action, lease_s, now)
            if branch.timer_token == token:  # no state change (which arms it when due)
                self._arm_prefetch(traj, branch)
            reply: dict[str, Any] = {
                "trajectory_id": trajectory_id,
                "branch": branch.name,
                "applied": applied,
                "state": branch.state.value,
                "decision": body,
                "wait_estimate": estimate.to_dict(),
            }
            if len(tools) > 1:
                reply["tools"] = tools
                reply["predicted_tool"] = tool
            if note:
                reply["reason"] = note
            return 200, reply

    def resume(self, trajectory_id: str, branch_name: str) -> tuple[int, dict[str, Any]]:
        with self.lock:
            traj = self.table.get(trajectory_id)
            branch = traj.branches.get(branch_name) if traj is not None else None
            if traj is None or branch is None:
                return 404, {"detail": f"unknown trajectory or branch {trajectory_id!r}"}
            now = self.clock.now()
            observed = now - branch.paused_at if branch.paused_at is not None else None
            if branch.state is BranchState.OFFLOADED:
                self._promote(traj, branch, now)
            self._note_resume(traj, branch, now)
            return 200, {
                "trajectory_id": trajectory_id,
                "branch": branch.name,
                "state": branch.state.value,
                "observed_wait_s": observed,
            }

    def delete(self, trajectory_id: str, reason: str = "deleted") -> tuple[int, dict[str, Any]]:
        """Release everything the trajectory holds. Its running requests finish normally for
        their clients but pin and store nothing; GET answers 404 from now on."""
        with self.lock:
            traj = self.table.pop(trajectory_id, None)
            if traj is None:
                return 404, {"detail": f"unknown trajectory {trajectory_id!r}"}
            released = self._release_trajectory(traj, reason)
            return 200, {"trajectory_id": trajectory_id, **released}

    def get(self, trajectory_id: str) -> tuple[int, dict[str, Any]]:
        with self.lock:
            traj = self.table.get(trajectory_id)
            if traj is None:
                return 404, {"detail": f"unknown trajectory {trajectory_id!r}"}
            return 200, self._view(traj)

    # ================================================================== internals: requests

    def _traj_for_request(self, trajectory_id: str, now: float) -> Trajectory:
        traj = self.table.get(trajectory_id)
        if traj is None:
            while len(self.table) >= self.config.max_trajectories and self._evict_idle_one():
                pass
            traj = Trajectory(trajectory_id, created_at=now, last_active=now)
            self.table[trajectory_id] = traj
            self._add_timer(now + self.config.idle_ttl_s, "idle", traj)
        else:
            self.table.move_to_end(trajectory_id)
            traj.last_active = now
        return traj

    def _evict_idle_one(self) -> bool:
        for tid, traj in self.table.items():
            if traj.running == 0:
                self.counters["trajectories_evicted_cap"] += 1
                self.table.pop(tid)
                self._release_trajectory(traj, "capacity")
                return True
            break  # the least recently active one is busy: go over the cap rather than scan
        return False

    def _keys(self, req: _Request, block_hashes: Sequence[bytes], n: int) -> list[bytes]:
        cache = req.key_cache
        for h in block_hashes[len(cache) : n]:
            cache.append(self.key_of(h))
        return cache

    def _release_plan(self, req: _Request) -> None:
        if req.plan is not None:
            for key in req.plan.keys:
                self.index.end_read(key)
            req.plan = None
            self._drain_doomed()

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
        bs = self.config.block_size
        first = start_token // bs
        targets = list(block_ids[first : first + max(0, num_external) // bs]) or list(
            block_ids[first:]
        )
        job_id = next(self._job_ids)
        # Empty keys are held by no tier: every rank reports each block as failed to load.
        self._outbox.loads.append(
            LoadJob(job_id, req_id, [BlockTransfer(b"", b) for b in targets], layerwise=layerwise)
        )
        self.counters["failed_closed_loads"] += 1

    def _note_resume(self, traj: Trajectory, branch: Branch, now: float) -> None:
        if branch.paused_at is None:
            return
        observed = now - branch.paused_at
        if branch.tool:
            self.predictor.observe(branch.tool, observed)
            self.metrics.observe(m.TOOL_WAIT_OBSERVED, observed, tool=branch.tool)
        outcome = None
        if branch.prefetch_due is not None and branch.tier == "disk":
            outcome = classify_prefetch(branch.prefetch_done_at, now)
            self.prefetch_outcomes.record(outcome)
            self.metrics.add(m.PREFETCH_OUTCOMES, outcome=outcome)
        if self.otel is not None:
            self.otel.end_pause(
                (traj.trajectory_id, branch.name),
                {
                    "agentkv.outcome": "resumed",
                    "agentkv.observed_wait_s": round(observed, 6),
                    "agentkv.resumed_state": branch.state.value,
                    "agentkv.resumed_tier": branch.tier,
                    "agentkv.prefetch_outcome": outcome,
                },
            )
        branch.paused_at = None
        branch.prefetch_due = None
        branch.prefetch_done_at = None

    # ================================================================== internals: decisions

    def _apply_decision(
        self, traj: Trajectory, branch: Branch, action: str, lease_s: float, now: float
    ) -> tuple[bool, str | None]:
        """Carry out a pause decision in whatever state the branch is; (applied, note)."""
        state = branch.state
        if state is BranchState.ACTIVE:
            branch.pending = (action, lease_s)
            return False, "a request of this branch is running: applied when it finishes"
        if state in (BranchState.HELD, BranchState.RETAINED):
            self._apply(traj, branch, action, lease_s, now)
            return True, None
        # A late pause: the engine already moved the branch off the device on its own.
        if action == "retain":
            held = self._still_cached(branch)
            if not held:
                return False, "the device blocks were evicted since; the tier copy is kept"
            # Pinned by the engine thread, which checks again that the blocks still hold it.
            self._pin_ops.append(("repin", (traj, branch)))
            self._set_state(traj, branch, BranchState.RETAINED)
            branch.tier = None
            self._lease(traj, branch, lease_s, now)
            return True, None
        if action == "offload_disk":
            if state is BranchState.OFFLOADING:
                branch.pending = (action, lease_s)
                return True, "applied when the copy in flight completes"
            self._copy_down(traj, branch, now)
            return True, None
        if action == "offload_host":
            if state is BranchState.DROPPED:
                return False, "the device blocks were released before the decision"
            return True, None
        # drop: release the tier copies only this trajectory holds
        branch.tier = None
        self._set_state(traj, branch, BranchState.DROPPED)
        return True, None

    def _apply(
        self, traj: Trajectory, branch: Branch, action: str, lease_s: float, now: float
    ) -> None:
        """Carry out a decision for a branch whose blocks are pinned (HELD or RETAINED)."""
        self._retained.pop((id(traj), branch.name), None)
        if action == "retain":
            self._set_state(traj, branch, BranchState.RETAINED)
            self._lease(traj, branch, lease_s, now)
            return
        if action in ("offload_host", "offload_disk"):
            tier: TierName = (
                "disk" if action == "offload_disk" and self.config.disk_enabled else "host"
            )
            self._offload(traj, branch, tier, now)
            return
        self._unpin_later(branch.pinned)
        branch.pinned = []
        self._set_state(traj, branch, BranchState.DROPPED)
        branch.tier = None

    def _lease(self, traj: Trajectory, branch: Branch, lease_s: float, now: float) -> None:
        branch.lease_until = now + max(0.0, min(lease_s, self.policy.max_lease_s))
        self._retained[(id(traj), branch.name)] = (traj, branch)
        self._add_timer(branch.lease_until, "lease", (traj, branch), branch.timer_token)

    def _offload(self, traj: Trajectory, branch: Branch, tier: TierName, now: float) -> None:
        """Write-back: copy the pinned blocks the tier lacks; the pins move to the store job."""
        owner = traj.trajectory_id
        copy: list[tuple[bytes, int]] = []
        queued: set[bytes] = set()
        pinned = branch.pinned
        for key, bid in zip(branch.keys[: len(pinned)], pinned, strict=False):
            entry = self.index.get(key)
            have = entry is not None and (
                entry.has(tier) or tier in entry.writing or (tier == "host" and entry.disk)
            )
            if have or self._poisoned[key] or key in queued:
                self._own(traj, key)
            else:
                copy.append((key, bid))
                queued.add(key)
        copy = copy[: self._make_room(tier, len(copy))]
        copied = {bid for _, bid in copy}
        self._unpin_later([b for b in pinned if b not in copied])
        branch.pinned = []
        branch.tier = tier
        if not copy:
            self._set_state(traj, branch, BranchState.OFFLOADED)
            return
        for key, _ in copy:
            self.index.begin_write(key, tier, owner)
            traj.owned.add(key)
        job = self._new_job(
            "store",
            [k for k, _ in copy],
            tier,
            block_ids=[b for _, b in copy],
            trajectory=traj,
            branch=branch.name,
        )
        self._releasing += len(copy)
        self._outbox.stores.append(
            StoreJob(job.job_id, tier, [BlockTransfer(k, b) for k, b in copy], owner=owner)
        )
        self._set_state(traj, branch, BranchState.OFFLOADING)
        branch.store_job = job.job_id
        self.counters["stores"] += 1
        self.counters["store_blocks"] += len(copy)

    def _make_room(self, tier: TierName, n: int) -> int:
        """Free slots in ``tier`` for ``n`` new copies by dropping least recently used idle
        copies (a host copy that is also on disk goes first). Returns how many fit."""
        short = n - self.index.free(tier)
        if short > 0:
            victims = self.index.victims(tier, short)
            if tier == "host":
                victims.sort(key=lambda k: not self.index.get(k).disk)  # type: ignore[union-attr]
            for key in victims:
                self._outbox.drops.append(DropOp([key], tier))
                self.index.remove_copy(key, tier)
                self.counters[f"evictions_{tier}"] += 1
        return min(n, self.index.free(tier))

    def _copy_down(self, traj: Trajectory, branch: Branch, now: float) -> None:
        """A late disk decision: host copies of the branch go down to disk."""
        if not self.config.disk_enabled:
            return
        keys = []
        for key in branch.keys:
            e = self.index.get(key)
            if e is None or e.doomed or e.disk or "disk" in e.writing or not e.host:
                continue
            if self._poisoned[key]:
                continue
            keys.append(key)
        keys = keys[: self._make_room("disk", len(keys))]
        branch.tier = "disk"
        if not keys:
            self._set_state(traj, branch, BranchState.OFFLOADED)
            return
        for key in keys:
            self.index.begin_write(key, "disk", traj.trajectory_id)
            self.index.begin_read(key)
            traj.owned.add(key)
        job = self._new_job("copy_down", keys, "disk", trajectory=traj, branch=branch.name)
        self._outbox.moves.append(MoveJob(job.job_id, "demote", keys))
        self._set_state(traj, branch, BranchState.OFFLOADING)
        branch.store_job = job.job_id

    def _promote(self, traj: Trajectory, branch: Branch, now: float) -> None:
        """Disk -> host copies of the branch's disk-only blocks (a prefetch or a resume)."""
        keys = []
        in_flight = False
        for key in branch.keys:
            e = self.index.get(key)
            if e is None or e.doomed or e.host or not e.disk:
                continue
            if "host" in e.writing:
                in_flight = True  # an earlier promote: done when it completes
                continue
            if self._poisoned[key]:
                continue
            keys.append(key)
        keys = keys[: self._make_room("host", len(keys))]
        if not keys:
            if not in_flight:
                branch.prefetch_done_at = branch.prefetch_done_at or now
            return
        for key in keys:
            self.index.begin_write(key, "host", traj.trajectory_id)
            self.index.begin_read(key)
            traj.owned.add(key)
        job = self._new_job("promote", keys, "host", trajectory=traj, branch=branch.name)
        self._outbox.moves.append(MoveJob(job.job_id, "promote", keys))
        self.counters["prefetches"] += 1

    def _upload(self, keys: Sequence[bytes]) -> None:
        """Copies every rank confirmed (a completed store) go to the shared remote tier too, so
        another replica can resume the trajectory. Only confirmed copies: a rank's own copy of
        a store that later failed or timed out may hold bytes the engine overwrote, and the
        remote tier is content-addressed and shared. The local copy is pinned (a reader) until
        the upload is reported."""
        if not self.config.remote_enabled:
            return
        ready = []
        for key in keys:
            e = self.index.get(key)
            # Host copies only: the worker's store reads host first, and a host copy the index
            # does not list (a timed-out job's late rank, its drop still queued) must never be
            # the one published. Keys a late rank may still write are skipped for the same reason.
            if e is not None and not e.doomed and e.host and not self._poisoned[key]:
                self.index.begin_read(key)
                ready.append(key)
        if ready:
            job = self._new_job("upload", ready, "host")
            self._outbox.moves.append(MoveJob(job.job_id, "upload", ready))

    def _maybe_copy_down_lru(self) -> None:
        """Host nearly full with a disk tier: copy least recently used host-only blocks down, so
        making room later only drops host copies that disk also has."""
        cap = self.index.capacity["host"]
        if not self.config.disk_enabled or cap <= 0:
            return
        if self.index.reserved("host") < HOST_COPY_DOWN_AT * cap:
            return
        want = int(self.index.reserved("host") - HOST_COPY_DOWN_TO * cap)
        keys = [
            k
            for k in self.index.victims("host", want * 2)
            if not self.index.get(k).disk  # type: ignore[union-attr]
            and "disk" not in self.index.get(k).writing  # type: ignore[union-attr]
            and not self._poisoned[k]
        ][:want]
        keys = keys[: self._make_room("disk", len(keys))]
        if not keys:
            return
        for key in keys:
            self.index.begin_write(key, "disk", None)
            self.index.begin_read(key)
        job = self._new_job("copy_down", keys, "disk")
        self._outbox.moves.append(MoveJob(job.job_id, "demote", keys))

    # ================================================================== internals: jobs

    def _new_job(self, kind: JobKind, keys: list[bytes], tier: TierName, **kw: Any) -> _Job:
        now = self.clock.now()
        job = _Job(
            kind,
            next(self._job_ids),
            list(keys),
            tier,
            deadline=now + self.config.job_timeout_s,
            started=now,
            **kw,
        )
        self.jobs[job.job_id] = job
        self._add_timer(job.deadline, "job", job.job_id)
        return job

    def _complete(self, job: _Job, now: float, timed_out: bool = False) -> None:
        self.jobs.pop(job.job_id, None)
        ok = not job.failed and not timed_out
        unwritten: list[bytes] = []  # copies that did not become readable: partial on some ranks
        if job.kind == "store":
            self._unpin(job.block_ids)
            self._releasing -= len(job.block_ids)
            unwritten = [k for k in job.keys if not self.index.end_write(k, job.tier, ok)]
            if not ok:
                self.counters["store_failures" if not timed_out else "store_timeouts"] += 1
        elif job.kind == "load":
            for key in job.keys:
                self.index.end_read(key)
            req = self.requests.get(job.req_id or "")
            if req is not None and req.load_job == job.job_id:
                req.load_state = "ok" if ok else "failed"
                if not ok:
                    # vLLM recomputes from the first block that failed: only those before it
                    # were served from the tier.
                    served = 0
                    if not timed_out:
                        for key in job.keys:
                            if key in self._bad_keys:
                                break
                            served += 1
                    req.turn.tier_hit_tokens = served * self.config.block_size
                    if not served:
                        req.turn.tier = None
            if not ok:
                self.counters["load_failures"] += 1
        elif job.kind == "upload":
            if timed_out:
                # A rank may still be reading the copies: they stay pinned (never dropped, so
                # never rewritten by an unconfirmed store) until every rank reported.
                self._late_uploads[job.job_id] = (list(job.keys), self.config.tp_size - job.ranks)
            else:
                for key in job.keys:
                    self.index.end_read(key)
            self.counters["remote_uploaded_blocks" if ok else "remote_upload_failures"] += (
                len(job.keys) if ok else 1
            )
        elif job.kind == "fetch":
            got = 0
            for key in job.keys:
                if self.index.end_write(key, job.tier, ok and key not in job.missing):
                    got += 1
                else:  # a rank that did get it must not keep a copy the index does not list
                    unwritten.append(key)
            self.counters["remote_fetched_blocks"] += got
            self.counters["remote_missed_blocks"] += len(job.keys) - got
        else:  # promote / copy_down
            for key in job.keys:
                if not self.index.end_write(key, job.tier, ok):
                    unwritten.append(key)
                self.index.end_read(key)
        if unwritten:
            # Ranks that did write keep no copy the index does not know (a failed job, a drop
            # that overtook the write, a timeout).
            self._outbox.drops.append(DropOp(unwritten, job.tier))
        if timed_out and job.kind not in ("load", "upload"):
            # Loads and uploads write no local tier; a store or move may still land on a late
            # rank.
            self._timed_out[job.job_id] = (
                list(job.keys),
                job.tier,
                self.config.tp_size - job.ranks,
            )
            self._poisoned.update(job.keys)
            self.index.hold_late(job.tier, len(job.keys))
        traj, name = job.trajectory, job.branch
        branch = traj.branches.get(name) if traj is not None and name is not None else None
        if branch is None or traj is None or traj.deleted:
            return
        if job.kind == "promote" and ok:
            branch.prefetch_done_at = now
        if job.kind in ("store", "copy_down") and branch.store_job == job.job_id:
            branch.store_job = None
            if branch.state is BranchState.OFFLOADING:
                if ok:
                    if job.kind == "copy_down":
                        self._drop_host_copies(traj, job.keys)
                    self._set_state(traj, branch, BranchState.OFFLOADED)
                else:
                    branch.demoted_by = "job_timeout" if timed_out else "store_failed"
                    branch.tier = None
                    self._set_state(traj, branch, BranchState.DROPPED)
                pending, branch.pending = branch.pending, None
                if pending is not None and branch.state is BranchState.OFFLOADED:
                    self._apply_decision(traj, branch, pending[0], pending[1], now)
        if job.kind == "store" and ok:
            self._maybe_copy_down_lru()
            self._upload(job.keys)

    def _drop_host_copies(self, traj: Trajectory, keys: Sequence[bytes]) -> None:
        """After a disk decision's copy-down: host copies that disk now also holds, that no
        other trajectory owns and nothing reads, leave host."""
        gone = []
        for key in keys:
            e = self.index.get(key)
            if e is None or not (e.host and e.disk) or e.busy:
                continue
            if e.owners - {traj.trajectory_id}:
                continue
            self.index.remove_copy(key, "host")
            gone.append(key)
        if gone:
            self._outbox.drops.append(DropOp(gone, "host"))

    def _late_report(self, job_id: int, ranks: int) -> None:
        """Ranks reported a job after it timed out: what they wrote is dropped again (the index
        does not list it); its keys may be written anew once every rank reported. A late upload
        unpins its copies once every rank reported."""
        upload = self._late_uploads.get(job_id)
        if upload is not None:
            keys_up, left_up = upload
            left_up -= ranks
            if left_up > 0:
                self._late_uploads[job_id] = (keys_up, left_up)
            else:
                del self._late_uploads[job_id]
                for key in keys_up:
                    self.index.end_read(key)
            return
        late = self._timed_out.get(job_id)
        if late is None:
            return
        keys, tier, left = late
        stray = []
        for key in keys:
            e = self.index.get(key)
            if e is None or not (e.has(tier) or tier in e.writing):
                stray.append(key)
        if stray:
            self._outbox.drops.append(DropOp(stray, tier))
        left -= ranks
        if left > 0:
            self._timed_out[job_id] = (keys, tier, left)
            return
        del self._timed_out[job_id]
        self.index.release_late(tier, len(keys))
        self._poisoned.subtract(keys)
        for key in keys:
            if self._poisoned[key] <= 0:
                del self._poisoned[key]

    def _lose_key(self, key: bytes) -> None:
        """A rank could not serve or keep ``key``: no tier is trusted for it any more."""
        e = self.index.get(key)
        if e is None:
            return
        self.index.remove_copy(key, None)
        self.index.spoil_writes(key)  # the drop may overtake writes in flight
        self._outbox.drops.append(DropOp([key]))

    def _drain_doomed(self) -> None:
        doomed = self.index.take_doomed()
        if doomed:
            self._outbox.drops.append(DropOp(doomed))

    def _own(self, traj: Trajectory, key: bytes) -> None:
        """``traj`` takes a reference on an indexed key, and remembers it (DELETE releases
        exactly ``traj.owned``)."""
        if self.index.own(key, traj.trajectory_id):
            traj.owned.add(key)

    def _reown(self, traj: Trajectory) -> None:
        """The trajectory owns exactly the indexed keys its branches' contexts reference."""
        owner = traj.trajectory_id
        wanted: set[bytes] = set()
        for b in traj.branches.values():
            if b.state is not BranchState.DROPPED:
                wanted.update(b.keys)
        old = traj.owned
        for key in wanted - old:
            self.index.own(key, owner)
        gone = self.index.disown(old - wanted, owner)
        if gone:
            self._outbox.drops.append(DropOp(gone))
        traj.owned = {k for k in wanted if owner in self.index.owners(k)}

    def _release_trajectory(self, traj: Trajectory, reason: str) -> dict[str, int]:
        traj.deleted = True
        released = 0
        for branch in traj.branches.values():
            if branch.paused_at is not None and branch.prefetch_done_at is not None:
                self.prefetch_outcomes.record("wasted")
                self.metrics.add(m.PREFETCH_OUTCOMES, outcome="wasted")
            if self.otel is not None:
                self.otel.end_pause((traj.trajectory_id, branch.name), {"agentkv.outcome": reason})
            released += len(branch.pinned)
            self._unpin_later(branch.pinned)
            branch.pinned = []
            branch.pending = None
            branch.timer_token += 1
            self._retained.pop((id(traj), branch.name), None)
        gone = self.index.disown(traj.owned, traj.trajectory_id)
        traj.owned = set()
        if gone:
            self._outbox.drops.append(DropOp(gone))
        if traj.running:
            self.tombstones[id(traj)] = traj
        self.counters[f"trajectories_{reason}"] += 1
        return {"released_blocks": released, "dropped_tier_blocks": len(gone)}

    # ================================================================== internals: timers

    def _add_timer(self, due: float, kind: str, ref: Any, token: int = 0) -> None:
        heapq.heappush(self._timers, _Timer(due, next(self._timer_seq), kind, ref, token))

    def _next_due(self, now: float) -> float | None:
        while self._timers and self._stale(self._timers[0]):
            heapq.heappop(self._timers)
        return max(0.0, self._timers[0].due - now) if self._timers else None

    def _stale(self, t: _Timer) -> bool:
        if t.kind == "job":
            return t.ref not in self.jobs
        if t.kind == "idle":
            return bool(t.ref.deleted)
        traj, branch = t.ref
        return bool(traj.deleted) or branch.timer_token != t.token

    def _tick(self, now: float) -> None:
        while self._timers and self._timers[0].due <= now:
            t = heapq.heappop(self._timers)
            if self._stale(t):
                continue
            if t.kind == "job":
                job = self.jobs.get(t.ref)
                if job is not None:
                    log.warning(
                        "agentkv: %s job %d not reported by every rank in %.1f s; failing it",
                        job.kind,
                        job.job_id,
                        self.config.job_timeout_s,
                    )
                    self.counters["job_timeouts"] += 1
                    self._complete(job, now, timed_out=True)
            elif t.kind == "idle":
                idle: Trajectory = t.ref
                idle_until = idle.last_active + self.config.idle_ttl_s
                if idle.running or idle_until > now:
                    self._add_timer(max(idle_until, now + 1.0), "idle", idle)
                elif self.table.get(idle.trajectory_id) is idle:
                    self.table.pop(idle.trajectory_id)
                    self._release_trajectory(idle, "expired")
            else:
                self._fire(t.kind, t.ref[0], t.ref[1], now)
        self._check_pressure(now)
        self._drain_doomed()

    def _fire(self, kind: str, traj: Trajectory, branch: Branch, now: float) -> None:
        if kind == "grace" and branch.state is BranchState.HELD:
            self.counters["grace_expired"] += 1
            self.metrics.add(m.DEMOTIONS, reason="grace_expired")
            branch.demoted_by = "grace_expired"
            self._apply(traj, branch, self.config.default_action, 0.0, now)
        elif kind == "lease" and branch.state is BranchState.RETAINED:
            self.counters["lease_expired_demotions"] += 1
            self.metrics.add(m.DEMOTIONS, reason="lease_expired")
            self._apply(traj, branch, DEMOTION_ACTION, 0.0, now)
            branch.demoted_by = "lease_expired"
        elif (
            kind == "prefetch"
            and branch.state is BranchState.OFFLOADED
            and branch.tier == "disk"
            and branch.prefetch_done_at is None
        ):
            self._promote(traj, branch, now)

    def _pressure(self) -> float:
        """Pool use, minus the pinned blocks already on their way out (store jobs in flight,
        unpins queued for the engine thread): a demotion is counted once, not again on every
        tick until the engine applies it."""
        total = max(1, self.pinner.total_blocks())
        return max(0.0, self.pinner.usage() - (self._releasing + self._unpins_queued) / total)

    def _check_pressure(self, now: float) -> None:
        if not self._retained:
            return
        total = max(1, self.pinner.total_blocks())
        excess = (self._pressure() - self.config.high_water) * total
        if excess <= 0:
            return
        candidates: list[tuple[object, float, int]] = [
            ((t, b), b.predicted_return_at or b.lease_until, len(b.pinned))
            for t, b in self._retained.values()
        ]
        for handle in pressure_victims(candidates, excess):
            traj: Trajectory
            branch: Branch
            traj, branch = handle  # type: ignore[misc]
            self.counters["pressure_demotions"] += 1
            self.metrics.add(m.DEMOTIONS, reason="pressure")
            self._apply(traj, branch, DEMOTION_ACTION, 0.0, now)
            branch.demoted_by = "pressure"

    # ================================================================== internals: pins

    def _pin_now(self, ids: Sequence[int]) -> None:
        if ids:
            self.pinner.pin(ids)
            self._pins.update(ids)

    def _unpin_now(self, ids: Sequence[int]) -> None:
        if ids:
            # Reverse order: vLLM evicts the tail of a freed run first, keeping the shared head.
            self.pinner.unpin(list(reversed(ids)))
            self._pins.subtract(ids)
            for b in ids:
                if self._pins[b] <= 0:
                    del self._pins[b]

    def _unpin_later(self, ids: Sequence[int]) -> None:
        if ids:
            self._pin_ops.append(("unpin", list(ids)))
            self._unpins_queued += len(ids)

    def _unpin(self, ids: Sequence[int]) -> None:
        """Now on the engine thread, queued on any other (the pool is not thread-safe)."""
        if threading.get_ident() == self._engine_ident:
            self._unpin_now(ids)
        else:
            self._unpin_later(ids)

    def _still_cached(self, branch: Branch) -> int:
        """How many leading blocks of the branch's context the pool still holds."""
        n = 0
        for bid, h in zip(branch.block_ids, branch.hashes, strict=False):
            if not self.pinner.holds(bid, h):
                break
            n += 1
        return n

    def _apply_pin_ops(self) -> None:
        """Engine thread: apply what other threads queued (pins must not race the scheduler)."""
        self._engine_ident = threading.get_ident()
        if not self._pin_ops:
            return
        ops, self._pin_ops = self._pin_ops, []
        for op, arg in ops:
            if op == "unpin":
                self._unpins_queued -= len(arg)
                self._unpin_now(arg)
                continue
            traj, branch = arg
            if traj.deleted or branch.state is not BranchState.RETAINED or branch.pinned:
                continue  # gone, moved on, or pinned by an earlier repin of the same branch
            held = self._still_cached(branch)
            ids = branch.block_ids[:held]
            self._pin_now(ids)
            branch.pinned = ids
            if not ids:
                # Evicted between the decision and now: fall back to the tier copy, if any.
                self._retained.pop((id(traj), branch.name), None)
                branch.demoted_by = "evicted"
                has_tier = any(self.index.usable(k) for k in branch.keys)
                self._set_state(
                    traj, branch, BranchState.OFFLOADED if has_tier else BranchState.DROPPED
                )

    def _set_state(self, traj: Trajectory, branch: Branch, state: BranchState) -> None:
        branch.state = state
        branch.timer_token += 1
        if state is not BranchState.RETAINED:
            self._retained.pop((id(traj), branch.name), None)
        if state is BranchState.OFFLOADED:
            self._arm_prefetch(traj, branch)
        elif state is BranchState.DROPPED and not traj.deleted:
            self._reown(traj)  # nothing kept: tier copies only this branch held go

    def _arm_prefetch(self, traj: Trajectory, branch: Branch) -> None:
        """The pause's prefetch timer, valid while the branch stays OFFLOADED (a store still in
        flight arms it when it completes)."""
        if (
            branch.state is BranchState.OFFLOADED
            and branch.prefetch_due is not None
            and branch.prefetch_done_at is None
        ):
            self._add_timer(branch.prefetch_due, "prefetch", (traj, branch), branch.timer_token)

    # ================================================================== views and metrics

    def pinned_blocks(self) -> int:
        """Device blocks agentkv holds (branch pins plus store jobs still reading theirs)."""
        return sum(self._pins.values())

    def bytes_held(self) -> dict[str, int]:
        bb = self.config.block_bytes
        return {
            "device_pinned": self.pinned_blocks() * bb,
            "host": self.index.count("host") * bb,
            "disk": self.index.count("disk") * bb,
        }

    def count_by_state(self) -> dict[str, int]:
        counts = {s.value: 0 for s in BranchState}
        for traj in self.table.values():
            for b in traj.branches.values():
                counts[b.state.value] += 1
        return counts

    def _view(self, traj: Trajectory) -> dict[str, Any]:
        branches = {}
        owned_bytes = {"device_pinned": 0, "host": 0, "disk": 0}
        bb = self.config.block_bytes
        seen: set[bytes] = set()
        for name, b in traj.branches.items():
            s = b.summary()
            residency: Counter[str] = Counter()
            for key in b.keys:
                e = self.index.get(key)
                if e is None:
                    residency["none"] += 1
                    continue
                if e.host:
                    residency["host"] += 1
                if e.disk:
                    residency["disk"] += 1
                if e.writing:
                    residency["in_flight"] += 1
                if key not in seen:
                    seen.add(key)
                    owned_bytes["host"] += bb * e.host
                    owned_bytes["disk"] += bb * e.disk
            residency["device_pinned"] = len(b.pinned)
            owned_bytes["device_pinned"] += bb * len(b.pinned)
            s["residency_blocks"] = dict(residency)
            branches[name] = s
        return {
            "trajectory_id": traj.trajectory_id,
            "branches": branches,
            "turns": [t.to_dict() for t in traj.turns],
            "prefix_hit_ratio": round(traj.prefix_hit_ratio, 6),
            "bytes_held": owned_bytes,
        }

    def _record_turn(self, turn: TurnStats) -> None:
        self.metrics.add(m.PROMPT_TOKENS, float(turn.prompt_tokens))
        self.metrics.add(m.CACHED_TOKENS, float(turn.device_hit_tokens), source="device")
        if turn.tier_hit_tokens:
            self.metrics.add(
                m.CACHED_TOKENS, float(turn.tier_hit_tokens), source=turn.tier or "host"
            )
        if turn.prompt_tokens:
            self.metrics.observe(m.PREFIX_HIT_RATIO, turn.hit_tokens / turn.prompt_tokens)
        if turn.first_divergence_token is not None:
            self.metrics.add(m.DIVERGENCES, zone=turn.divergence_zone or "undeclared")

    def gauges(self) -> list[tuple[m.MetricSpec, dict[str, str], float]]:
        with self.lock:
            held = self.bytes_held()
            by_state = self.count_by_state()
            n = len(self.table)
        out: list[tuple[m.MetricSpec, dict[str, str], float]] = [
            (m.BYTES_HELD, {"tier": tier}, float(v)) for tier, v in held.items()
        ]
        out += [
            (m.PAUSED_TRAJECTORIES, {"state": s.value}, float(by_state.get(s.value, 0)))
            for s in sorted(PAUSED_STATES, key=lambda s: s.value)
        ]
        out.append((m.TRAJECTORIES, {}, float(n)))
        return out

    def status(self) -> dict[str, Any]:
        with self.lock:
            bb = self.config.block_bytes
            return {
                "pool": {
                    "usage": round(self.pinner.usage(), 6),
                    "total_blocks": self.pinner.total_blocks(),
                    "pinned_blocks": self.pinned_blocks(),
                    "releasing_blocks": self._releasing,
                    "high_water": self.config.high_water,
                    "block_size_tokens": self.config.block_size,
                    "block_bytes": bb,
                },
                "tiers": {
                    "host": {
                        "blocks": self.index.count("host"),
                        "bytes": self.index.count("host") * bb,
                        "capacity_bytes": self.index.capacity["host"] * bb,
                    },
                    "disk": {
                        "blocks": self.index.count("disk"),
                        "bytes": self.index.count("disk") * bb,
                        "capacity_bytes": self.index.capacity["disk"] * bb,
                        "enabled": self.config.disk_enabled,
                    },
                    "in_flight_jobs": len(self.jobs),
                },
                "bytes_held": self.bytes_held(),
                "trajectories": len(self.table),
                "trajectory_ids": list(self.table)[:1000],
                "tombstones": len(self.tombstones),
                "running_requests": len(self.requests),
                "branches_by_state": self.count_by_state(),
                "decisions": dict(self.decisions),
                "prefetch": self.prefetch_outcomes.counts(),
                "counters": {**dict.fromkeys(REPORTED_COUNTERS, 0), **self.counters},
                "predictor": self.predictor.tools(),
            }


def _overridden(decision: Decision, action: str, policy: PolicyParams) -> Decision:
    """``decision`` with its action replaced by a fixed one (``policy_override``): retain holds
    for the longest lease the policy allows (the resume or the pool's pressure ends it)."""
    return dataclasses.replace(
        decision,
        action=cast(Action, action),
        lease_s=policy.max_lease_s if action == "retain" else 0.0,
        rationale=f"{action} (fixed by policy_override; the policy said {decision.action})",
    )


def _finite_or_none(value: float) -> float | None:
    return round(value, 6) if math.isfinite(value) else None


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    import numpy as np

    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n
