"""The simulated workers of sim_engine.py: TP ranks executing StepPlans as the plugin's worker does.

Primitives:
  SimWorkers                 tp_size ranks executing StepPlans as the plugin's worker does, each
                             on a fake_store.FakeTierStore (the real store's results: no
                             overwrite of an existing copy, full tiers fail, damaged disk copies
                             are corrupt errors); jobs complete only when a test says so; a
                             silent rank never reports; async loads are cancelled at the
                             worker's own deadline
  Pending, LoadEvent         a job a rank holds until the test completes it; an async load's
                             report for the engine's load bookkeeping
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agentkv.manager import LoadJob, MoveJob, StepPlan, StoreJob, WorkerReport
from agentkv.tiers.results import BlockStatus
from tests.unit.fake_store import FakeTierStore, Result
from tests.unit.sim_pool import GARBAGE, SimPool, key_of

# ====================================================================== workers


JobOutcome = Literal["ok", "io_error", "start_error"]


@dataclass
class Pending:
    rank: int
    kind: Literal["store", "load", "move"]
    job: Any
    snapshot: list[bytes | None] = field(default_factory=list)  # store: content at start
    started: float = 0.0  # async load: when the worker started it (its own deadline)


@dataclass
class LoadEvent:
    req_id: str
    job_id: int
    rank: int
    failed_blocks: list[int]


class SimWorkers:
    """tp_size ranks, each with its own store (fake_store.FakeTierStore: the real TieredStore's
    results, a store that never evicts), plus the shared remote tier. Each job runs as the plugin's
    worker (plugins/agentkv_vllm/worker_side.py) runs it: what it reports on success, on a
    block's I/O error (``io_error``: the key is reported bad) and on a job that failed to start
    (``start_error``); an async load past the worker's own deadline is cancelled and reported
    failed (``expire_loads``, the worker's poll)."""

    def __init__(self, pool: SimPool, tp_size: int, capacity: dict[str, int]) -> None:
        self.pool = pool
        self.tp = tp_size
        self.capacity = capacity
        self.stores = [FakeTierStore(capacity["host"], capacity["disk"]) for _ in range(tp_size)]
        # tiers[rank]["host" | "disk"] -> {key: content}: the stores' copies, read-only views
        self.tiers = self.stores
        # the shared remote tier, per rank (keys are rank-salted in the real system): filled by
        # the manager's upload jobs, read by its fetch jobs; a key it has keeps its copy
        self.remote: list[dict[bytes, bytes | None]] = [{} for _ in range(tp_size)]
        self.pending: list[Pending] = []
        self.kept = False  # the restart's keep plan applied (once, as the worker does)
        self.silent: set[int] = set()
        # A silent rank's reports of copies it made before a forward (sent when it wakes).
        self.withheld: dict[int, list[WorkerReport]] = {}
        self.reports: list[WorkerReport] = []
        self.load_events: list[LoadEvent] = []
        self.violations: list[str] = []
        # Whether an upload may publish ``content`` under ``key``: the key must be its content's
        # key under the generation the key was derived in. One generation: ``key_of``. A test
        # that switches generations sets its own (test_invalidation_stateful.py): a copy of an
        # older generation is still its key's KV, where ``key_of`` knows only the current one.
        self.published_truth: Callable[[bytes, bytes], bool] = lambda key, content: (
            key_of(content) == key
        )

    # ---------------------------------------------------------------- plans
    def deliver(self, plan: StepPlan, now: float = 0.0) -> None:
        """start_step on every rank: the restart's keep plan (once, as the worker applies it:
        ``TieredStore.prune_disk``), drops, then stores, loads (layerwise ones run in this
        step's forward) and moves."""
        if plan.keep is not None and not self.kept:
            self.kept = True
            for store in self.stores:
                for key in [k for k in store.disk if k not in plan.keep.keys]:
                    del store.disk[key]  # in place: the folder outlives this process
                store.damaged &= set(store.disk)
                lacking = {k: "miss" for k in plan.keep.keys if k not in store.disk}
                if lacking:
                    self.reports.append(WorkerReport(bad_keys=lacking))  # type: ignore[arg-type]
        for rank in range(self.tp):
            for drop in plan.drops:
                self.stores[rank].drop(drop.keys, drop.tier)
        for rank in range(self.tp):
            for store in plan.stores:
                snap = [self.pool.content[rank][t.block_id] for t in store.blocks]
                if store.before_forward:
                    # Copied before this step's forward (a preemption save, a blocked queue's
                    # demotion); a silent rank copies it too, its report comes when it wakes.
                    out = self._run(Pending(rank, "store", store, snap), "ok", report=False)
                    if rank in self.silent:
                        self.withheld.setdefault(rank, []).append(out)
                    else:
                        self.reports.append(out)
                    continue
                self.pending.append(Pending(rank, "store", store, snap))
            for load in plan.loads:
                if load.layerwise:
                    # Copied during this step's forward, on every rank (a stuck rank would stall
                    # the forward itself); a silent rank just never reports it.
                    self._run(Pending(rank, "load", load), "ok", report=rank not in self.silent)
                else:
                    self.pending.append(Pending(rank, "load", load, started=now))
            for move in plan.moves:
                self.pending.append(Pending(rank, "move", move))

    def completable(self) -> list[Pending]:
        return [p for p in self.pending if p.rank not in self.silent]

    def complete(self, p: Pending, ok: bool | JobOutcome = True) -> None:
        """One rank finishes ``p``: ``ok`` (True / "ok"), a block I/O error (False / "io_error")
        or a job that failed to start ("start_error")."""
        outcome: JobOutcome = ok if isinstance(ok, str) else ("ok" if ok else "io_error")
        self.pending.remove(p)
        self._run(p, outcome, report=True)

    def expire_loads(self, now: float, timeout_s: float) -> None:
        """The worker's poll: an async load not done by its deadline is cancelled (nothing more
        is written into its blocks) and reported failed, on any rank (a rank whose transfers are
        stuck still polls; only the forward would stall a whole rank)."""
        for p in [p for p in self.pending if p.kind == "load"]:
            if now >= p.started + timeout_s:
                self.pending.remove(p)
                self._cancel_load(p)

    def _cancel_load(self, p: Pending) -> None:
        load: LoadJob = p.job
        self.reports.append(WorkerReport(jobs_done={load.job_id: 1}, jobs_failed={load.job_id}))
        self.load_events.append(
            LoadEvent(load.req_id, load.job_id, p.rank, [t.block_id for t in load.blocks])
        )

    def wake(self, rank: int, newest_first: bool = False) -> None:
        """A silent rank finishes its stores and moves late, in either order; its loads are
        cancelled (reported failed, nothing copied: the worker's deadline fence)."""
        self.silent.discard(rank)
        self.reports.extend(self.withheld.pop(rank, []))
        late = [p for p in self.pending if p.rank == rank]
        for p in reversed(late) if newest_first else late:
            self.pending.remove(p)
            if p.kind == "load":
                self._cancel_load(p)
            else:
                self._run(p, "ok", report=True)

    def damage(self, rank: int, key: bytes) -> bool:
        """Fault injection: rank's disk copy of ``key`` no longer verifies."""
        return self.stores[rank].damage(key)

    # ---------------------------------------------------------------- execution
    def _bad(self, rep: WorkerReport, key: bytes, r: Result) -> None:
        """worker_side._bad: the reason a rank could not serve or write ``key``."""
        if not key:
            return  # a fail-closed load: no tier was asked
        if r.corrupt:
            rep.bad_keys[key] = "corrupt"
        elif r.status is BlockStatus.MISS:
            rep.bad_keys.setdefault(key, "miss")
        else:
            rep.bad_keys.setdefault(key, "error")

    def _full(self, rank: int, what: str, results: Sequence[Result]) -> None:
        for r in results:
            if r.full:  # the manager reserves every slot it writes: a full tier is its bug
                self.violations.append(
                    f"rank {rank} {what}: {r.tier} full ({self.capacity[r.tier or 'host']}) "
                    f"writing {r.key.hex()[:8]}"
                )

    def _run(self, p: Pending, outcome: JobOutcome, report: bool) -> WorkerReport:
        rank = p.rank
        rep = WorkerReport()
        if outcome == "start_error":
            rep.jobs_done[p.job.job_id] = 1
            rep.jobs_failed.add(p.job.job_id)
            if p.kind == "load":
                load: LoadJob = p.job
                failed = [t.block_id for t in load.blocks]
                self.load_events.append(LoadEvent(load.req_id, load.job_id, rank, failed))
        elif p.kind == "store":
            self._run_store(p, outcome == "ok", rep)
        elif p.kind == "load":
            self._run_load(p, outcome == "ok", rep)
        elif p.job.kind == "upload":
            self._run_upload(p, outcome == "ok", rep)
        elif p.job.kind == "fetch":
            self._run_fetch(p, outcome == "ok", rep)
        else:
            self._run_move(p, outcome == "ok", rep)
        if report:
            self.reports.append(rep)
        return rep

    def _done(self, rep: WorkerReport, job_id: int, ok: bool) -> None:
        rep.jobs_done[job_id] = rep.jobs_done.get(job_id, 0) + 1
        if not ok:
            rep.jobs_failed.add(job_id)

    def _run_store(self, p: Pending, io_ok: bool, rep: WorkerReport) -> None:
        job: StoreJob = p.job
        store = self.stores[p.rank]
        keys = [t.key for t in job.blocks]
        if io_ok:
            # The copy reads the device blocks while the job runs: a block that changed since
            # the job started is copied as garbage (checksums cannot tell).
            contents = [
                now if now == before else GARBAGE
                for now, before in (
                    (self.pool.content[p.rank][t.block_id], snap)
                    for t, snap in zip(job.blocks, p.snapshot, strict=True)
                )
            ]
            results = store.store(keys, contents, job.tier)
            self._full(p.rank, f"store {job.job_id}", results)
        else:
            results = [Result(k, BlockStatus.ERROR, job.tier) for k in keys]
        for key, r in zip(keys, results, strict=True):
            if not r.ok:
                self._bad(rep, key, r)
        self._done(rep, job.job_id, all(r.ok for r in results))
        rep.transfers[("offload", job.tier, str(job.job_id))] = (len(job.blocks), 0.001)

    def _run_load(self, p: Pending, io_ok: bool, rep: WorkerReport) -> None:
        load: LoadJob = p.job
        rank = p.rank
        keys = [t.key for t in load.blocks]
        if io_ok:
            results = self.stores[rank].load(keys)
        else:
            results = [Result(k, BlockStatus.ERROR) for k in keys]
        failed: list[int] = []
        for t, r in zip(load.blocks, results, strict=True):
            if not r.ok:
                self._bad(rep, t.key, r)
                failed.append(t.block_id)
                continue
            if r.content is None or key_of(r.content) != t.key:
                self.violations.append(
                    f"load {load.job_id} rank {rank}: copy of {t.key.hex()[:8]} is not its "
                    f"true content ({r.content!r:.20})"
                )
            self.pool.write(t.block_id, r.content, rank)
        self._done(rep, load.job_id, not failed)
        rep.transfers[("reload", "host", str(load.job_id))] = (len(load.blocks), 0.001)
        self.load_events.append(LoadEvent(load.req_id, load.job_id, rank, failed))

    def _run_upload(self, p: Pending, remote_ok: bool, rep: WorkerReport) -> None:
        """A remote tier that is down fails the job; nothing local is lost or reported bad."""
        up: MoveJob = p.job
        if not remote_ok:
            self._done(rep, up.job_id, False)
            return
        results = self.stores[p.rank].copy_to_remote(up.keys, self.remote[p.rank])
        for key, r in zip(up.keys, results, strict=True):
            if r.ok and (
                r.content is None
                or r.content == GARBAGE
                or not self.published_truth(key, r.content)
            ):
                self.violations.append(
                    f"upload {up.job_id} rank {p.rank}: {key.hex()[:8]} would publish wrong KV "
                    f"to the shared remote tier ({r.content!r:.20})"
                )
        self._done(rep, up.job_id, all(r.ok for r in results))

    def _run_fetch(self, p: Pending, remote_ok: bool, rep: WorkerReport) -> None:
        """Best effort: keys the remote lacks (or a remote that is down, or no host room) are
        this rank's misses; the job itself reports done and ok."""
        fetch: MoveJob = p.job
        remote = self.remote[p.rank]
        missing: list[bytes] = []
        for key in fetch.keys:
            if not remote_ok or key not in remote:
                missing.append(key)
                continue
            results = self.stores[p.rank].store([key], [remote[key]], "host")
            self._full(p.rank, f"fetch {fetch.job_id}", results)
            if not results[0].ok:
                missing.append(key)
        if missing:
            rep.fetch_missing[fetch.job_id] = missing
        self._done(rep, fetch.job_id, True)

    def _run_move(self, p: Pending, io_ok: bool, rep: WorkerReport) -> None:
        move: MoveJob = p.job
        store = self.stores[p.rank]
        if not io_ok:
            results = [Result(k, BlockStatus.ERROR) for k in move.keys]
        elif move.kind == "promote":
            results = store.promote(move.keys)
        else:  # 'demote': copy_to_disk, the host copy stays until the manager drops it
            results = store.copy_to_disk(move.keys)
        self._full(p.rank, f"{move.kind} {move.job_id}", results)
        for key, r in zip(move.keys, results, strict=True):
            if not r.ok:
                self._bad(rep, key, r)
        self._done(rep, move.job_id, all(r.ok for r in results))

    def take_reports(self) -> WorkerReport | None:
        if not self.reports:
            return None
        out = WorkerReport()
        for rep in self.reports:
            out = out.merge(rep)
        self.reports = []
        return out
