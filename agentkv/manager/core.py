"""TrajectoryManager: the one authority over agent trajectories and the KV blocks they hold.

Engine-thread primitives (the adapter calls them from vLLM's scheduler hooks; the request hooks
are requests.RequestTable's methods under the manager's lock, their docstrings the contracts):
  on_lookup(req, num_computed)       HIT (tokens past the engine's own prefix hit that the tiers
                                     hold, loaded async or layer by layer), MISS (0 tokens) or
                                     PENDING (ask again next step: a remote fetch or an admission
                                     wait in progress); pins the tier copies a HIT plans to load
  on_alloc(req_id, block_ids, n_ext) turn the lookup into a LoadJob on the allocated blocks
  fail_load(req_id, block_ids, n)    fail closed: a LoadJob every rank reports as failed, so the
                                     engine recomputes those blocks (for adapter errors)
  on_finish(req_id, ...)             pin the finished context (only blocks fully computed or
                                     loaded), start its grace period, return the turn's stats
  pause_finished(tid, branch, tool)  the implicit pause of a turn on_finish just returned (a
                                     caller that never pauses): pause with the learned wait of
                                     ``tool``, unless its next request already runs or waits or
                                     a pause came meanwhile
  on_preempt(req_id, block_ids, ...) vLLM preempted a running request: copy its trusted
                                     computed blocks to host before this step's forward, so its
                                     rescheduled lookup loads them instead of recomputing
  set_admission(admission)           this step's admission picture (agentkv.admission): what
                                     the scheduler could not admit for lack of blocks
  take_step()                        fire due timers, give blocks back to a blocked queue; the
                                     step's jobs (drops, stores, loads, moves) for the workers
  idle_step(admission)               both of the above in O(1) when nothing exists to act on
                                     (plain traffic): True, and the plan is empty
  on_report(report)                  jobs finished / failed per rank -> unpin, index, states
  has_work()                         the engine must keep stepping (jobs in flight, pins queued)
  prefix_cache_reset(reset)          the engine's plain prefix-cache reset, run so that deferred
                                     (CACHED) contexts are copied to host, not lost (writeback.py)
  record_tier_changes, take_tier_changes, tier_keys
                                     the residency index's copy changes, for the KV events
Any-thread primitives (the control channel): pause, resume, delete, get, status, tick,
next_deadline, take_prefetch_work (device prefetch orders and cancels for the API server's pump:
prefetch.py). Timers (grace, lease, prefetch, job timeouts, idle expiry) fire in ``take_step``
on the engine thread and in ``tick``, which the adapter's control thread calls when the engine
is idle; both paths only queue engine work (pins, jobs) that the engine thread applies.

The parts (each module's docstring lists its primitives):
  state.py        trajectories, branches, turns (plain data)
  requests.py     a request from lookup (HIT / MISS / PENDING) to finish
  pauses.py       pause and resume: the policy's decision, carried out
  transitions.py  branch state transitions and the tier writes they start
  jobtable.py     jobs in flight: prepare/complete pairs, a handler per kind, late ranks
  timers.py       the timer heap and the retained branches' leases
  prefetch.py     device prefetch: internal prefill-only requests at the predicted return
  pins.py         the ledger of pins on the engine's device blocks
  ownership.py    the trajectory table, ownership of tier keys, tombstones
  residency.py    which tier holds each key (the index), in flight included
  views.py        GET, /status, gauges
  writeback.py    deferred write-backs (CACHED branches) and their eviction forecast
  jobs.py, ports.py  the wire types to the workers, the engine ports

Invariants (checked by tests/unit/test_manager_stateful.py after every step):
  1. A block is loaded from a tier only if its copy was completely written from blocks that
     were fully computed or loaded (aborted loads never pin or store their blocks).
  2. After a lookup counted external tokens, every failure reports those blocks as failed.
  3. Pins held in the engine's pool equal the pins this manager records, and balance to zero.
  4. A trajectory that references a tier key owns it (in flight too); DELETE frees only keys no
     other trajectory owns; a deleted trajectory never comes back (its running requests end
     without pinning or storing anything; a request looked up before the DELETE and still
     PENDING, or queued in the engine before it and looked up after, runs as a vanilla
     request). Tenants: a trajectory is keyed by its id in its
     cache_salt's namespace (``state.scoped_id``); nothing crosses namespaces, except that with
     ``salt_generations`` (salts are weight versions) a request's id releases itself under
     older salts, as DELETE does (``ownership.Namespace.supersede``).
  5. One pressure event demotes only as many retained trajectories as needed.
  5b. Pins are a loan: when the scheduler's queue is blocked on blocks (a shortfall in the step's
     admission picture), the same take_step demotes retained branches (policy order) and then
     ends grace pins early until the shortfall is covered by blocks on their way back; those
     copies run before that step's forward, so the blocks are free by the next schedule.
  6. State is bounded (idle trajectories expire, a cap bounds the table even when the oldest
     runs, timers hold trajectories weakly) and per-step work is O(changes): timers sit in a
     heap; idle branches are never visited.
Every number acted on (lease, prefetch time, demotion order and action) comes from
``agentkv.policy`` and ``agentkv.predict``.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from agentkv import metrics as m
from agentkv.admission import NO_QUEUE, Admission, PoolTrend
from agentkv.costs import CostModel
from agentkv.manager import views
from agentkv.manager.jobs import (
    MoveJob,
    MoveKind,
    StepPlan,
    TransferKind,
    WorkerReport,
    rejection_counter,
)
from agentkv.manager.jobtable import Job, JobKind, JobTable
from agentkv.manager.ownership import Namespace
from agentkv.manager.pauses import Pauses
from agentkv.manager.pins import PinLedger, PinOp
from agentkv.manager.ports import BlockPinner, Clock, MonotonicClock
from agentkv.manager.prefetch import DevicePrefetcher, PrefetchOrder
from agentkv.manager.requests import (
    Request,
    RequestTable,
)
from agentkv.manager.residency import ResidencyIndex
from agentkv.manager.state import Branch, BranchState, DemotedBy, Trajectory, scoped_id
from agentkv.manager.timers import BRANCH_TIMERS, Leases, Timer, TimerHeap, TimerKind
from agentkv.manager.transitions import Transitions
from agentkv.manager.writeback import DeferredWritebacks
from agentkv.metrics import MetricsRecorder
from agentkv.policy import HIGH_WATER, Action, PolicyParams, Writeback
from agentkv.policy import pressure_victims as pressure_victims
from agentkv.predict import PrefetchOutcomeCounter, WaitPredictor
from agentkv.tier import Tier

log = logging.getLogger("agentkv.manager")

P = ParamSpec("P")
R = TypeVar("R")


def _engine_hook(
    fn: Callable[Concatenate[RequestTable, P], R],
) -> Callable[Concatenate[TrajectoryManager, P], R]:
    """An engine-thread hook: ``fn`` of the manager's RequestTable, under the lock, after the
    pin operations other threads queued are applied."""

    @functools.wraps(fn)
    def hook(self: TrajectoryManager, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.lock:
            self._apply_pin_ops()
            return fn(self.reqs, *args, **kwargs)

    return hook


def _control_op(
    fn: Callable[Concatenate[Pauses, P], R],
) -> Callable[Concatenate[TrajectoryManager, P], R]:
    """A control-channel op (any thread): ``fn`` of the manager's Pauses, under the lock."""

    @functools.wraps(fn)
    def op(self: TrajectoryManager, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.lock:
            return fn(self.pauses, *args, **kwargs)

    return op


@dataclass(frozen=True)
class ManagerConfig:
    block_size: int
    block_bytes: int  # all TP ranks together (what the policy weighs)
    tp_size: int = 1
    host_capacity_blocks: int = 0
    disk_capacity_blocks: int = 0
    grace_s: float = 0.5
    default_action: str = Action.OFFLOAD_HOST
    high_water: float = HIGH_WATER
    job_timeout_s: float = 30.0
    idle_ttl_s: float = 86400.0
    max_trajectories: int = 100_000
    layerwise: bool = False
    admission_wait: bool = False
    # A shared remote tier: confirmed host copies are uploaded, and a trajectory this replica
    # never saw is fetched from it (its lookup answers PENDING meanwhile).
    remote_enabled: bool = False
    # A benchmark's fixed policy (retain-always / offload-always): every pause takes this action
    # whatever ``decide`` says; None (production) follows the policy.
    policy_override: Action | None = None
    remote_ttl_s: float = 0.0  # how long the remote tier keeps a copy (0: not known)
    # Write back only when it pays: an offload_host decision's copy waits (CACHED) while the
    # pool's forecast says vLLM keeps the unpinned blocks past the wait (policy.defer_writeback).
    # EAGER here (the core's unit tests drive copies directly); the plugin's setting is FORECAST.
    writeback: Writeback = Writeback.EAGER
    # Prefetch into device blocks at the predicted return (prefetch.py): the adapter issues the
    # internal requests this manager orders (``take_prefetch_work``).
    device_prefetch: bool = False
    # A cache_salt is a weight version, not a tenant (an RL trainer's per-version salt, SkyRL's
    # ``use_cache_salt``): a trajectory id's first request under a new salt releases that id's
    # trajectories under every other salt (ownership.Namespace.supersede). Off by default: on a
    # multi-tenant server the same id under two salts is two tenants.
    salt_generations: bool = False

    @property
    def disk_enabled(self) -> bool:
        return self.disk_capacity_blocks > 0


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
            {Tier.HOST: config.host_capacity_blocks, Tier.DISK: config.disk_capacity_blocks}
        )
        self.outbox = StepPlan()  # the jobs of the next step, handed over by take_step
        self.timers = TimerHeap()
        self.leases = Leases(self.timers, lambda: self.policy.max_lease_s)
        self.pins = PinLedger(pinner)
        self.names = Namespace(self)
        self.job_table = JobTable(self)
        self.transitions = Transitions(self)
        self.reqs = RequestTable(self)
        self.pauses = Pauses(self)
        self.prefetcher = DevicePrefetcher(self)
        self.counters: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.prefetch_outcomes = PrefetchOutcomeCounter()
        self.bad_keys: dict[bytes, str] = {}  # keys ranks reported bad in the report at hand
        # The latest admission picture (decisions read it); a step's shortfall is acted on once,
        # in that step's take_step.
        self.admission: Admission = NO_QUEUE
        self.pool_trend = PoolTrend()
        self.steps = 0  # take_step calls: the engine's step count, as this manager sees it
        self.last_queue_demotion_step: int | None = None
        # HELD branches (their grace pins), so a blocked queue can end them early.
        self.held: dict[tuple[int, str], tuple[Trajectory, Branch]] = {}
        # CACHED branches (deferred write-backs), copied once the pool forecasts eviction.
        self.writebacks = DeferredWritebacks(self)

    # ------------------------------------------------------------------ the parts' state
    # (tests and views read these; the parts own them)

    @property
    def table(self) -> OrderedDict[str, Trajectory]:
        return self.names.table

    @property
    def tombstones(self) -> dict[int, Trajectory]:
        return self.names.tombstones

    @property
    def requests(self) -> dict[str, Request]:
        return self.reqs.requests

    @property
    def jobs(self) -> dict[int, Job]:
        return self.job_table.jobs

    @property
    def _outbox(self) -> StepPlan:
        return self.outbox

    @property
    def _pins(self) -> Counter[int]:
        return self.pins.held

    @property
    def _pin_ops(self) -> list[tuple[PinOp, Any]]:
        return self.pins.ops

    @property
    def _poisoned(self) -> Counter[bytes]:
        return self.job_table.poisoned

    @property
    def _timed_out(self) -> dict[int, tuple[list[bytes], Tier, int]]:
        return self.job_table.writes_timed_out()

    # ================================================================== engine-thread hooks

    # The request hooks run RequestTable's methods under the lock, after applying the pin ops
    # other threads queued; their contracts are those methods' docstrings.
    on_lookup = _engine_hook(RequestTable.lookup)
    on_alloc = _engine_hook(RequestTable.alloc)
    on_finish = _engine_hook(RequestTable.finish)
    on_preempt = _engine_hook(RequestTable.preempt)

    def fail_load(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """``RequestTable.fail_load``: fail closed after an adapter error."""
        with self.lock:
            self.reqs.fail_load(req_id, block_ids, num_external)

    def set_admission(self, admission: Admission) -> None:
        """Engine thread, before ``take_step``: what this step's schedule could not admit.
        Contract: the next ``take_step`` gives back blocks for its shortfall (invariant 5b)."""
        with self.lock:
            self.admission = admission
            placed = self.writebacks.take_hits(admission.hit_blocks)
            self.pool_trend.observe(
                self.clock.now(),
                admission.free_blocks,
                admission.filled_blocks + admission.hit_blocks - placed,
                placed,
            )

    def idle_step(self, admission: Admission) -> bool:
        """Engine thread, in place of ``set_admission`` + ``take_step``: when nothing exists that
        a step could act on (no trajectory, queued or in-flight job, pin op, timer, lease, held
        branch, deferred write-back or doomed key), count the step, keep its admission picture
        (``status`` shows it) and answer True: its plan is empty. Otherwise change nothing and
        answer False. Plain traffic pays only this check per step (issue 26). The pool trend
        skips idle steps: only trajectories' write-backs read it, and the first request of a
        trajectory makes the next step a full one."""
        with self.lock:
            if (
                self.names.table
                or self.outbox
                or self.pins.ops
                or self.job_table.jobs
                or len(self.timers)
                or len(self.leases)
                or self.held
                or self.writebacks.heap
                or self.index.has_doomed()
            ):
                return False
            self.steps += 1
            self.admission = admission
            return True

    def take_step(self) -> StepPlan:
        """Engine thread, once per step: fire due timers, give blocks back to a queue blocked on
        them, then hand over every queued job. Contract: never raises; loads queued before an
        internal error are still returned."""
        with self.lock:
            self.steps += 1
            try:
                self._apply_pin_ops()
                self._tick(self.clock.now(), self.admission.shortfall)
                self._apply_pin_ops()  # write-backs the tick queued go out with this step
            except Exception:
                self.counters["internal_errors"] += 1
                log.exception("agentkv: manager tick failed; queued jobs still go out")
            # Drops of keys that went idle go out no later than any new write of the same key.
            self.transitions.drain_doomed()
            plan, self.outbox = self.outbox, StepPlan()
            return plan

    def prefix_cache_reset(self, reset: Callable[[], Any]) -> Any:
        """Engine thread: run ``reset``, the engine's plain prefix-cache reset (tier copies
        stay), so that no CACHED branch loses its context to it: their deferred copies are made
        from the blocks the reset unhashed (writeback.py). Returns what ``reset`` returns (truthy:
        it reset) and lets its errors through; agentkv's own faults never fail the reset."""
        try:
            with self.lock:
                kept = self.writebacks.before_reset()
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("agentkv: reading the deferred copies before a cache reset failed")
            kept = []
        result = reset()
        if not result or not kept:
            return result  # refused (blocks in use): nothing was dropped
        try:
            with self.lock:
                copied, blocks = self.writebacks.after_reset(kept)
            if copied:
                log.info(
                    "agentkv: prefix-cache reset: %d paused context(s) whose host copy was "
                    "deferred are being copied to host now (%d blocks)",
                    copied,
                    blocks,
                )
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("agentkv: copying the deferred contexts after a cache reset failed")
        return result

    def on_report(self, report: WorkerReport) -> None:
        """Engine thread: a step's merged worker reports. Contract: never raises on unknown or
        late jobs. A store or move that timed out keeps its tier slots and its keys unwritable
        until every rank reported it; each late rank's copies are dropped again. A write that
        failed (or that a drop overtook) is dropped from the ranks that did write it."""
        with self.lock:
            self._apply_pin_ops()
            now = self.clock.now()
            self.bad_keys.update(report.bad_keys)
            for key, why in report.bad_keys.items():
                if not key:
                    continue  # a fail-closed load: no tier was ever asked
                self.counters["tier_corrupt_blocks" if why == "corrupt" else "tier_misses"] += 1
                self.transitions.lose_key(key)
            for job_id, keys in report.fetch_missing.items():
                job = self.jobs.get(job_id)
                if job is not None:
                    job.missing.update(keys)
            for job_id in report.jobs_failed:
                job = self.jobs.get(job_id)
                if job is not None:
                    job.failed = True
            for job_id, n in report.jobs_done.items():
                self.job_table.on_ranks(job_id, n, now)
            for (kind, tier, _), (nbytes, seconds) in report.transfers.items():
                if kind in (TransferKind.OFFLOAD, TransferKind.RELOAD):
                    off = kind == TransferKind.OFFLOAD
                    self.metrics.observe(
                        m.OFFLOAD_BYTES if off else m.RELOAD_BYTES, float(nbytes), tier=tier
                    )
                    self.metrics.observe(
                        m.OFFLOAD_SECONDS if off else m.RELOAD_SECONDS, seconds, tier=tier
                    )
            for phase, seconds in report.reload_phases.items():
                self.metrics.observe(m.RELOAD_PHASE_SECONDS, seconds, phase=str(phase))
            for (where, reason), n in report.rejected.items():  # forged or damaged values
                self.counters[rejection_counter(where, reason)] += n
                self.metrics.add(m.REJECTED_BLOCKS, float(n), tier=str(where), reason=str(reason))
            self.bad_keys.clear()
            self.transitions.drain_doomed()

    def has_work(self) -> bool:
        """Whether the engine must keep stepping: jobs queued or in flight, pins to apply."""
        with self.lock:
            return bool(self.outbox) or bool(self.pins.ops) or bool(self.jobs)

    def knows(self, trajectory_id: str, tenant: str | None = None) -> bool:
        with self.lock:
            return scoped_id(trajectory_id, tenant) in self.table

    def fetch_remote(
        self, trajectory_id: str, keys: Sequence[bytes], tenant: str | None = None
    ) -> int | None:
        """Engine thread: copy ``keys`` (a prompt's blocks, in order) from the shared remote tier
        into the host tier for ``trajectory_id`` (in ``tenant``'s namespace), a trajectory this
        replica does not hold (it is created here, as its first lookup would). Keys indexed
        here already, or known bad, are skipped; host room is made as for any write. The
        trajectory owns the copies, so they go when it is deleted or expires. Returns the job id
        (``on_lookup`` answers PENDING until it completes; the lookup then finds the fetched
        blocks in host) or None when there is nothing to fetch."""
        return self.fetch_remote_for(scoped_id(trajectory_id, tenant), keys)

    def fetch_remote_for(self, key: str, keys: Sequence[bytes]) -> int | None:
        """``fetch_remote`` for a trajectory's table key (``scoped_id``)."""
        with self.lock:
            want = [
                k
                for k in dict.fromkeys(keys)
                if self.index.get(k) is None and not self.job_table.poisoned[k]
            ]
            want = want[: self.transitions.make_room(Tier.HOST, len(want))]
            if not want:
                return None
            traj = self.names.for_request(key, self.clock.now())
            for k in want:
                self.index.begin_write(k, Tier.HOST, traj.trajectory_id)
                traj.owned.add(k)
            job = self.job_table.prepare(JobKind.FETCH, want, Tier.HOST, trajectory=traj)
            self.outbox.moves.append(MoveJob(job.job_id, MoveKind.FETCH, want))
            self.counters["remote_fetches"] += 1
            return job.job_id

    def take_prefetch_work(self) -> tuple[list[PrefetchOrder], list[str]]:
        """Any thread: the device prefetches to issue (internal prefill-only requests) and the
        tickets whose requests to abort. Contract: each order and cancel is handed out once;
        an order is still wanted when handed out (a resume or DELETE since cancelled it)."""
        with self.lock:
            return self.prefetcher.take_orders(), self.prefetcher.take_cancels()

    def job_pending(self, job_id: int) -> bool:
        with self.lock:
            return job_id in self.jobs

    def record_tier_changes(self) -> None:
        """Log every tier copy gained or lost from now on (for KV events; off by default)."""
        with self.lock:
            self.index.record_changes()

    def take_tier_changes(self) -> list[tuple[bytes, Tier, bool]]:
        """(tier key, tier, present) since the last call, in order."""
        with self.lock:
            return self.index.take_changes()

    def tier_keys(self, tier: Tier) -> list[bytes]:
        """Keys with a complete copy in ``tier`` now (a re-announce after a cache reset)."""
        with self.lock:
            return self.index.keys_in(tier)

    # ================================================================== control (any thread)

    def tick(self) -> float | None:
        """Fire due timers; returns seconds until the next one (None: no timer)."""
        with self.lock:
            now = self.clock.now()
            self._tick(now)
            return self.timers.next_due(now, self._stale)

    def next_deadline(self) -> float | None:
        with self.lock:
            return self.timers.next_due(self.clock.now(), self._stale)

    def next_prefetch_due(self) -> float | None:
        """Seconds until the next PREFETCH timer (None: none): its order waits for a tick."""
        with self.lock:
            return self.timers.next_wake(self.clock.now(), self._stale)

    def engine_work_pending(self) -> bool:
        with self.lock:
            return bool(self.outbox) or bool(self.pins.ops)

    def pause(
        self,
        trajectory_id: str,
        branch_name: str,
        tool: str | Sequence[str],
        expected_wait_s: float | None,
        *,
        max_lease_s: float | None = None,
        tenant: str | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Decide and apply (or record, while a request runs) what happens to a paused branch.
        ``tool``: the called tool, or the tools of parallel calls (the pause is predicted and
        learned as the one with the longest predicted wait: ``WaitPredictor.longest``).
        ``max_lease_s`` caps a retain decision's lease (a client's KV retention TTL).
        ``tenant`` (every control op): the cache_salt naming the trajectory's namespace; None
        addresses the unsalted one. Another tenant's trajectory of the same id is a 404."""
        tools = [tool] if isinstance(tool, str) else list(tool) or ["unknown"]
        tool = self.predictor.longest(tools, expected_wait_s)
        with self.lock:
            code, reply = self.pauses.pause(
                scoped_id(trajectory_id, tenant),
                branch_name,
                tool,
                expected_wait_s,
                max_lease_s=max_lease_s,
            )
        _as_client(reply, trajectory_id, tenant)
        if code == 200 and len(tools) > 1:
            reply["tools"] = tools
            reply["predicted_tool"] = tool
        return code, reply

    def pause_finished(
        self,
        trajectory_id: str,
        branch_name: str,
        tool: str,
        *,
        max_lease_s: float | None = None,
        tenant: str | None = None,
    ) -> dict[str, Any]:
        """The implicit pause of a turn that just finished (``on_finish``), for callers that
        never pause (an in-process RL rollout): ``pause`` with no declared wait, so the wait
        learned for ``tool`` (the trajectory's environment) decides. Skipped (the reply's
        ``skipped``, counted ``implicit_pause_skipped.<why>``: ``pauses.ImplicitSkip``) when
        the branch's next request is already running or waiting, or a pause came since the
        turn started (explicit wins; a later explicit pause or resume overrides this one).
        Check and pause under one hold of the lock: no control op slips between them."""
        with self.lock:
            skip = self.pauses.implicit_skip(scoped_id(trajectory_id, tenant), branch_name)
            if skip is not None:
                self.counters[f"implicit_pause_skipped.{skip.value}"] += 1
                return {"implicit": True, "skipped": skip.value}
            code, reply = self.pause(
                trajectory_id, branch_name, tool, None, max_lease_s=max_lease_s, tenant=tenant
            )
            self.counters["implicit_pauses" if code == 200 else "implicit_pause_failures"] += 1
        reply = {"implicit": True, **reply}
        return reply if code == 200 else {"status": code, **reply}

    def resume(
        self, trajectory_id: str, branch_name: str, *, tenant: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        with self.lock:
            code, reply = self.pauses.resume(scoped_id(trajectory_id, tenant), branch_name)
        _as_client(reply, trajectory_id, tenant)
        return code, reply

    def delete(
        self, trajectory_id: str, reason: str = "deleted", *, tenant: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Release everything the trajectory holds. Its running requests finish normally for
        their clients but pin and store nothing; GET answers 404 from now on. Final against
        requests queued in vLLM before it too, even unknown here yet (``mark_deleted``)."""
        key = scoped_id(trajectory_id, tenant)
        with self.lock:
            code, reply = self.delete_key(key, reason)
            self.reqs.mark_deleted(key)
        _as_client(reply, trajectory_id, tenant)
        return code, reply

    def delete_key(self, key: str, reason: str = "deleted") -> tuple[int, dict[str, Any]]:
        """``delete`` by table key (``scoped_id``), for the manager's own sweeps."""
        with self.lock:
            traj = self.names.pop(key)
            if traj is None:
                return 404, {"detail": f"unknown trajectory {key!r}"}
            released = self.names.release(traj, reason)
            return 200, {"trajectory_id": traj.name, **released}

    def get(self, trajectory_id: str, *, tenant: str | None = None) -> tuple[int, dict[str, Any]]:
        with self.lock:
            traj = self.table.get(scoped_id(trajectory_id, tenant))
            if traj is None:
                return 404, {"detail": f"unknown trajectory {trajectory_id!r}"}
            return 200, views.trajectory_view(self, traj)

    # ================================================================== internals

    def _stale(self, t: Timer) -> bool:
        if t.kind is TimerKind.JOB:
            return t.ref not in self.jobs
        if t.kind is TimerKind.IDLE:
            return bool(t.ref.deleted)
        traj, branch = t.ref
        return bool(traj.deleted) or branch.timer_token != t.token

    def _tick(self, now: float, queue_short: int = 0) -> None:
        for t in self.timers.pop_due(now, self._stale):
            if t.kind is TimerKind.JOB:
                self.job_table.time_out(t.ref, now)
            elif t.kind is TimerKind.IDLE:
                self.names.expire(t.ref, now)
            elif t.kind in BRANCH_TIMERS:
                self.transitions.fire(t.kind, t.ref[0], t.ref[1], now)
        self._check_pressure(now, queue_short)
        self.writebacks.check(now)
        self.transitions.drain_doomed()

    def _check_pressure(self, now: float, queue_short: int = 0) -> None:
        """Pool use over high water, or a scheduler queue short of ``queue_short`` blocks,
        demotes retained branches, farthest predicted return first, only as many as cover the
        excess (invariant 5); a queue still short then ends grace pins early (5b). Blocks already
        on their way back (store jobs in flight, unpins queued) count as given back."""
        if not len(self.leases) and not (queue_short > 0 and self.held):
            return
        total = max(1, self.pinner.total_blocks())
        excess = (self.pins.pressure() - self.config.high_water) * total
        short = queue_short - (self.pins.releasing + self.pins.unpins_queued)
        if max(excess, short) <= 0:
            return
        for traj, branch in self.leases.victims(max(excess, short), pressure_victims):
            short -= len(branch.pinned)
            if excess > 0:
                self.counters["pressure_demotions"] += 1
                self.transitions.demote(traj, branch, DemotedBy.PRESSURE, now)
            else:
                self.counters["queue_demotions"] += 1
                self.last_queue_demotion_step = self.steps
                self.transitions.demote(traj, branch, DemotedBy.QUEUE_BLOCKED, now, urgent=True)
        if short > 0:
            self._end_grace_early(short, now)

    def eviction_forecast(self) -> float:
        """Seconds until vLLM evicts a block unpinned now (admission.PoolTrend)."""
        return self.pool_trend.seconds_to_eviction(self.admission, self.writebacks.ahead(math.inf))

    def _end_grace_early(self, short: int, now: float) -> None:
        """A queue still short after every retained branch went: HELD branches take their
        default action now instead of when their grace ends, latest grace first."""
        held = sorted(self.held.values(), key=lambda tb: -tb[1].grace_until)
        for traj, branch in held:
            if short <= 0:
                break
            if traj.deleted or branch.state is not BranchState.HELD:
                self.held.pop((id(traj), branch.name), None)
                continue
            short -= len(branch.pinned)
            self.counters["grace_shortened"] += 1
            self.metrics.add(m.DEMOTIONS, reason=DemotedBy.QUEUE_BLOCKED)
            self.last_queue_demotion_step = self.steps
            action = Action(self.config.default_action)
            self.transitions.apply(traj, branch, action, 0.0, now, urgent=True)
            branch.demoted_by = DemotedBy.QUEUE_BLOCKED

    def _apply_pin_ops(self) -> None:
        """Engine thread: apply what other threads queued (pins must not race the scheduler)."""
        for op, ref in self.pins.take_ops():
            if op is PinOp.WRITEBACK:
                traj, branch, tier = ref
                if not traj.deleted and branch.state is BranchState.CACHED:
                    self.transitions.write_back(traj, branch, tier)
                continue
            traj, branch = ref
            if traj.deleted or branch.state is not BranchState.RETAINED or branch.pinned:
                continue  # gone, moved on, or pinned by an earlier repin of the same branch
            ids = branch.block_ids[: self.pins.still_cached(branch)]
            self.pins.pin_now(ids)
            branch.pinned = ids
            if not ids:
                # Evicted between the decision and now: fall back to the tier copy, if any.
                self.leases.release(traj, branch)
                self.transitions.fall_back(traj, branch, DemotedBy.EVICTED)

    # ================================================================== views and metrics

    def pinned_blocks(self) -> int:
        """Device blocks agentkv holds (branch pins plus store jobs still reading theirs)."""
        return self.pins.total()

    def bytes_held(self) -> dict[str, int]:
        return views.bytes_held(self)

    def count_by_state(self) -> dict[str, int]:
        return views.count_by_state(self)

    def gauges(self) -> list[tuple[m.MetricSpec, dict[str, str], float]]:
        return views.gauges(self)

    def status(self) -> dict[str, Any]:
        with self.lock:
            return views.status_view(self)


def _as_client(reply: dict[str, Any], trajectory_id: str, tenant: str | None) -> None:
    """A reply names the trajectory as its client does (never by its table key)."""
    if "trajectory_id" in reply:
        reply["trajectory_id"] = trajectory_id
    detail = reply.get("detail")
    if isinstance(detail, str):
        reply["detail"] = detail.replace(
            repr(scoped_id(trajectory_id, tenant)), repr(trajectory_id)
        )
