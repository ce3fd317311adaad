"""Worker side of AgentKVConnector: moves whole blocks between vLLM's KV cache and the tiers.

Primitives:
  WorkerSide.register_kv_caches(kv_caches)   find the block layout, open this rank's TieredStore
  WorkerSide.start_step(meta)                start the step's drops, stores, moves and loads;
                                             must not block
  WorkerSide.wait_for_layer(name)            layer-by-layer loads: block until ``name``'s
                                             segments of this step's layerwise loads are copied
  WorkerSide.finish_step()                   after the forward: the layer copier is done, its
                                             host pins are released
  WorkerSide.poll()                          request ids whose async loads are complete (their
                                             blocks written, or failed -> load_error_block_ids)
  WorkerSide.take_report()                   AgentKVWorkerReport for the scheduler, or None:
                                             every job this rank finished (ok or failed), keys
                                             it could not serve (miss / corrupt / error)
  WorkerSide.load_error_block_ids()          engine block ids whose load failed -> recompute

Each TP rank of each DP rank keeps its own store under ``<disk_dir>/dp<d>/rank<r>`` with keys
salted by its rank fingerprint, so shards never mix and DP engines never count or delete each
other's files. After a restart the worker deletes nothing on its own: the first step's plan
carries its manager's keep plan (the keys it restored, ``jobs.KeepPlan``), applied once before
any other job. Loads of a request are reported finished only when every block
has a result; a failed block is also reported through ``load_error_block_ids`` so vLLM recomputes
it instead of reading garbage.

Layer-by-layer loads (``LoadJob.layerwise``, the ``layerwise_loads.LayerwiseLoads`` mixin):
vLLM has already scheduled the request in this step; the host copies are pinned in place and one
copier thread writes them layer after layer in forward order while the model runs; each
attention layer waits only for its own layer (``wait_for_layer``). A block missing from host, or
any copy error, goes to ``load_error_block_ids`` and vLLM recomputes.

Data path (agentkv.tiers.batched): a block is handed to the store as a BlockRef (O(1), no
per-layer tensors). CUDA: a step's store jobs are gathered together into device staging (one
``index_select`` per KV run for every block of every job) and cross to the host arena one DMA
per block; a load lands in staging rows and is scattered (one ``index_copy_`` per run) on the
engine's stream in ``poll`` before the request is reported finished. Layerwise loads copy one
layer of every block of the step per call (one batched pointer copy on CUDA when vLLM has it).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from agentkv.errors import CorruptBlockError
from agentkv.kv_identity import KVIdentity
from agentkv.manager.jobs import (
    KeepPlan,
    LoadJob,
    MoveJob,
    MoveKind,
    Rejection,
    StepPlan,
    StoreJob,
    TransferKind,
    TransferRef,
    WorkerReport,
)
from agentkv.tier import Tier
from agentkv.tiers import BlockResult, BlockStatus, TieredStore, TransferHandle
from agentkv.tiers.batched import StagedBlocks, staging_budget
from agentkv.tiers.disk import rank_dir, remove_stale_rank_dirs
from agentkv.tiers.keys import BlockKey, rank_key
from agentkv_vllm.block_copy import BlockViews
from agentkv_vllm.layerwise_loads import LayerwiseLoads, LayerwiseStep
from agentkv_vllm.metadata import AgentKVStepMetadata, AgentKVWorkerReport
from agentkv_vllm.settings import ConnectorSettings

log = logging.getLogger("agentkv.worker")
GiB = 1 << 30


class _DelayedLoad:
    """A load started after ``delay_s`` (the ``debug_load_delay_s`` test knob), cancellable."""

    def __init__(self, delay_s: float, start: Any) -> None:
        self._start_fn = start
        self._handle: TransferHandle | None = None
        self._cancelled = False
        self.started_at: float | None = None  # the delay is not transfer time
        self._lock = threading.Lock()
        self._timer = threading.Timer(delay_s, self._start)
        self._timer.daemon = True
        self._timer.start()

    def _start(self) -> None:
        with self._lock:
            if not self._cancelled:
                self.started_at = time.monotonic()
                self._handle = self._start_fn()

    def done(self) -> bool:
        with self._lock:
            return self._cancelled or (self._handle is not None and self._handle.done())

    def result(self) -> list[Any] | None:
        with self._lock:
            return None if self._handle is None else self._handle.result()

    @property
    def finished_at(self) -> float | None:
        return None if self._handle is None else self._handle.finished_at

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            self._timer.cancel()
            handle = self._handle
        if handle is not None:
            handle.cancel()


# How each tier move is reported: a fetch reloads from the remote tier, an upload offloads to
# it; a promote lands in host, a demote on disk.
_MOVE_REPORTS: dict[MoveKind, tuple[TransferKind, Tier]] = {
    MoveKind.FETCH: (TransferKind.RELOAD, Tier.REMOTE),
    MoveKind.UPLOAD: (TransferKind.OFFLOAD, Tier.REMOTE),
    MoveKind.PROMOTE: (TransferKind.PROMOTE, Tier.HOST),
    MoveKind.DEMOTE: (TransferKind.DEMOTE, Tier.DISK),
}


@dataclass
class _Pending:
    handle: Any  # TransferHandle | _DelayedLoad
    started: float
    nbytes: int
    job_id: int
    ref: TransferRef  # what the report says this transfer measured
    keys: list[bytes]
    load: LoadJob | None = None
    deadline: float = math.inf
    staged: StagedBlocks | None = None  # CUDA: the device staging this job copies to or from
    move: MoveKind | None = None  # a tier move (fetch/upload/promote/demote); None: store/load

    def seconds(self, now: float) -> float:
        """The transfer's own time: from its start (when a store worker first took it up, not
        its submit: the wait behind the step's other transfers is queueing, not transfer; a
        delayed load's: after the delay) to its last block (``now``, the poll that saw it, where
        the handle does not say)."""
        started = getattr(self.handle, "started_at", None) or self.started
        finished = getattr(self.handle, "finished_at", None) or now
        return max(0.0, finished - started)


@dataclass
class WorkerSide(LayerwiseLoads):
    settings: ConnectorSettings
    model_id: str
    tp_rank: int
    tp_size: int
    num_blocks: int
    views: BlockViews | None = None
    store: TieredStore | None = None
    identity: KVIdentity | None = None  # from vLLM's config; the rank's layout is added here
    fingerprint: KVIdentity | None = None
    dp_rank: int = 0  # vLLM's data-parallel rank: names this engine's disk folder
    dp_size: int = 1
    _kept: bool = False  # the restart's keep plan applied (once: later stores are the manager's)
    _jobs: list[_Pending] = field(default_factory=list)
    _loads: list[_Pending] = field(default_factory=list)
    _recving_done: set[str] = field(default_factory=set)
    _load_errors: set[int] = field(default_factory=set)
    _report: WorkerReport = field(default_factory=WorkerReport)
    _key_cache: dict[bytes, BlockKey] = field(default_factory=dict)
    _layerwise: LayerwiseStep | None = None
    _copier: ThreadPoolExecutor | None = None
    _layers: list[tuple[str, list[tuple[int, int, int]]]] = field(default_factory=list)
    # this step's layerwise load job ids, and those that failed
    _layerwise_jobs: tuple[list[int], set[int]] = field(default_factory=lambda: ([], set()))
    _fetcher: ThreadPoolExecutor | None = None
    # id() of this step's plan jobs already started or reported (``fail_step`` fails the rest)
    _settled: set[int] = field(default_factory=set)
    # the remote client's (bad_tags, corrupt) already reported, and whether a transfer that may
    # have read the remote tier was collected since
    _remote_seen: tuple[int, int] = (0, 0)
    _remote_read: bool = False

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.views = BlockViews(kv_caches, self.num_blocks)
        self._layers = self.views.layer_slices()
        self.fingerprint = replace(
            self.identity or KVIdentity(model=self.model_id),
            num_layers=len(self.views.layer_names),
            layout=self.views.layout,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )
        disk_dir = None
        if self.settings.disk_dir:
            root = Path(self.settings.disk_dir)
            # Folders of DP or TP ranks this deployment no longer runs: nobody restores them.
            remove_stale_rank_dirs(root, self.dp_rank, self.dp_size, self.tp_rank, self.tp_size)
            disk_dir = rank_dir(root, self.dp_rank, self.tp_rank)
            disk_dir.mkdir(parents=True, exist_ok=True)
            # What of it survives a restart is the manager's call: the first step's keep plan
            # (its scheduler is built after this, vLLM's EngineCore order).
        remote_config = self.settings.remote_config()
        remote = None
        if remote_config is not None:
            from agentkv.tiers.remote import RemoteBlocks

            remote = RemoteBlocks(remote_config)  # no I/O here; failures become results
        self.store = TieredStore(
            remote=remote,
            host_capacity_bytes=int(self.settings.host_capacity_gib * GiB),
            disk_dir=disk_dir,
            disk_capacity_bytes=int(self.settings.disk_capacity_gib * GiB),
            block_bytes=self.views.block_bytes,
            workers=self.settings.io_threads,  # never evicts: the manager decides
        )
        self._report.hello[self.tp_rank] = os.getpid()
        log.info(
            "agentkv worker rank %d: %d layers, block %d B, host tier %.1f GiB, disk %s",
            self.tp_rank,
            len(self.views.layer_names),
            self.views.block_bytes,
            self.settings.host_capacity_gib,
            disk_dir or "off",
        )

    # Logical keys are rank-agnostic (the scheduler computes them); each rank salts them with its
    # own fingerprint so a block can only ever come back to the rank, layout and model it left.
    def rank_key(self, logical: bytes) -> BlockKey:
        key = self._key_cache.get(logical)
        if key is None:
            assert self.fingerprint is not None
            key = rank_key(logical, self.fingerprint.digest())
            if len(self._key_cache) > 1_000_000:
                self._key_cache.clear()
            self._key_cache[logical] = key
        return key

    def _silent(self, job: StoreJob) -> bool:
        prefix = self.settings.debug_silent_rank_trajectory_prefix
        return bool(prefix) and self.tp_rank == 1 and job.owner.startswith(prefix or "")

    def start_step(self, meta: AgentKVStepMetadata) -> None:
        """Start this step's jobs: drops first (their slots are free for this step's stores), then
        stores, moves and loads. Must not block. Never raises: a job that cannot start is
        reported failed, and a fault anywhere in the step fails every job it had not started
        yet (``fail_step``), so vLLM recomputes instead of reading blocks nothing wrote or
        waiting for a load nobody runs."""
        entered = time.perf_counter()
        plan = meta.plan
        self._settled = set()
        try:
            if plan.keep is not None:
                self._apply_keep_plan(plan.keep)
            if self.store is None or self.views is None:
                self.fail_step(plan)  # never leave vLLM waiting on a load we cannot run
                return
            self._start_plan(plan, entered)
        except Exception:
            log.exception("agentkv: worker step failed; the loads it did not start recompute")
            self.fail_step(plan)

    def fail_step(self, plan: StepPlan) -> None:
        """Fail every job of ``plan`` not started or reported yet (``_settled``), once: a load's
        blocks become load errors and an async load is reported finished (vLLM recomputes,
        never waits), and every job is reported failed so the manager releases its pins and
        tier slots. Idempotent within the step."""
        settled = self._settled
        jobs: list[StoreJob | MoveJob] = [*plan.stores, *plan.moves]
        for job in jobs:
            if id(job) not in settled:
                settled.add(id(job))
                self._done(job.job_id, ok=False)
        for load in plan.loads:
            if id(load) not in settled:
                settled.add(id(load))
                self._fail_load(load)

    def _fail_load(self, load: LoadJob) -> None:
        self._load_errors.update(b.block_id for b in load.blocks)
        if not load.layerwise:  # a layerwise request is not waiting: vLLM runs it this step
            self._recving_done.add(load.req_id)
        self._done(load.job_id, ok=False)

    def _start_plan(self, plan: StepPlan, entered: float) -> None:
        assert self.store is not None and self.views is not None
        for drop in plan.drops:
            self.store.drop([self.rank_key(k) for k in drop.keys], tier=drop.tier)
        now = time.monotonic()
        self._start_stores(plan.stores, now)
        for move in plan.moves:
            self._start_move(move, now)
        layerwise = [load for load in plan.loads if load.layerwise]
        if layerwise:
            self._start_layerwise(layerwise, entered)
            self._settled.update(id(load) for load in layerwise)  # finish_step reports them
        for load in plan.loads:
            if not load.layerwise:
                self._start_load(load, now)
                self._settled.add(id(load))
        if layerwise and self._layerwise is not None:
            self._layerwise.stamps.returned = time.perf_counter()

    def _apply_keep_plan(self, keep: KeepPlan) -> None:
        """The restart's keep plan, once (a later plan would delete what was stored since):
        this rank's disk holds exactly the restored keys it has files for, under its identity,
        and the keys it lacks are reported missing. A fault keeps the files (the next loads
        miss or verify them): never fails the step."""
        if self._kept or self.store is None:
            return
        self._kept = True
        store = self.store
        try:
            kept, removed = store.prune_disk({self.rank_key(k) for k in keep.keys})
            # Listed but not here (a crash after the manifest's last write cut or never made
            # the file, another identity's file): the manager forgets them now, not at a load.
            for logical in keep.keys:
                if store.tier_of(self.rank_key(logical)) is None:
                    self._report.bad_keys[logical] = "miss"
        except Exception:
            log.exception("agentkv rank %d: applying the disk keep plan failed", self.tp_rank)
            return
        if kept or removed:
            log.info(
                "agentkv rank %d: disk tier kept %d blocks, removed %d files",
                self.tp_rank,
                kept,
                removed,
            )

    def _start_stores(self, jobs: list[StoreJob], now: float) -> None:
        """Device -> tier copies of the step's store jobs (a silent rank's test knob skips its
        own); a preemption save (``before_forward``) is waited for here."""
        assert self.store is not None and self.views is not None
        store = self.store
        stores = [job for job in jobs if not self._silent(job)]
        staged = self._stage_stores(stores)
        # Preemption saves read blocks vLLM already freed (maybe reallocated this step): they
        # are copied before anything of this step writes the device (loads below, the forward).
        before_forward: list[TransferHandle] = []
        self._settled.update(id(job) for job in jobs if self._silent(job))  # never reported
        for job in stores:
            keys = [self.rank_key(b.key) for b in job.blocks]
            staging = staged.pop(job.job_id, None)
            try:
                buffers: list[Any] = (
                    staging.rows if staging else [self.views.block(b.block_id) for b in job.blocks]
                )
                handle = store.submit_store(keys, buffers, tier=job.tier)
                if job.before_forward:
                    before_forward.append(handle)
            except Exception as exc:  # a tier fault must never take the engine down
                log.warning("agentkv: store job %d failed to start: %s", job.job_id, exc)
                self._settled.add(id(job))
                self._done(job.job_id, ok=False)
                continue
            self._settled.add(id(job))
            self._jobs.append(
                _Pending(
                    handle,
                    now,
                    len(keys) * self.views.block_bytes,
                    job.job_id,
                    TransferRef(TransferKind.OFFLOAD, job.tier, f"job-{job.job_id}"),
                    [b.key for b in job.blocks],
                    staged=staging,
                )
            )
        for handle in before_forward:
            if not handle.wait(self.settings.job_timeout_s):
                handle.cancel()  # reported failed when polled: the index never lists it

    def _start_move(self, move: MoveJob, now: float) -> None:
        """A tier move: remote -> host (fetch, on the fetch thread), host -> remote (upload),
        disk -> host (promote) or host -> disk (demote)."""
        assert self.store is not None and self.views is not None
        store = self.store
        keys = [self.rank_key(k) for k in move.keys]
        try:
            kind = MoveKind(move.kind)  # the plan crossed a process boundary: normalise
            moving: TransferHandle | Future[list[Any]]
            if kind is MoveKind.FETCH:
                moving = self._fetch_pool().submit(self._fetch_remote, keys)
            elif kind is MoveKind.UPLOAD:
                moving = store.copy_to_remote(keys)
            elif kind is MoveKind.PROMOTE:
                moving = store.promote(keys)
            else:
                moving = store.copy_to_disk(keys)
        except Exception as exc:
            log.warning("agentkv: %s job %d failed to start: %s", move.kind, move.job_id, exc)
            self._settled.add(id(move))
            self._done(move.job_id, ok=False)
            return
        self._settled.add(id(move))
        self._jobs.append(
            _Pending(
                moving,
                now,
                len(keys) * self.views.block_bytes,
                move.job_id,
                TransferRef(*_MOVE_REPORTS[kind], f"job-{move.job_id}"),
                list(move.keys),
                move=kind,
            )
        )

    def _start_load(self, load: LoadJob, now: float) -> None:
        """An async tier -> device load (into staging rows on CUDA when they fit), reported
        finished by ``poll``; one that cannot start fails its blocks so vLLM recomputes them."""
        assert self.store is not None and self.views is not None
        store = self.store
        keys = [self.rank_key(b.key) for b in load.blocks]
        staging = None
        try:
            ids = [b.block_id for b in load.blocks]
            if staging_budget(self.views.table, len(ids)) == len(ids):
                staging = StagedBlocks.for_load(self.views.table, ids)
                targets: list[Any] = list(staging.rows)
            else:
                targets = [self.views.block(bid) for bid in ids]
            pending: TransferHandle | _DelayedLoad
            if self.settings.debug_load_delay_s > 0:
                pending = _DelayedLoad(
                    self.settings.debug_load_delay_s,
                    lambda keys=keys, targets=targets: store.submit_load(keys, targets),
                )
            else:
                pending = store.submit_load(keys, targets)
        except Exception as exc:
            log.warning("agentkv: load for %s failed to start: %s", load.req_id, exc)
            self._settled.add(id(load))
            self._fail_load(load)
            return
        self._loads.append(
            _Pending(
                pending,
                now,
                len(keys) * self.views.block_bytes,
                load.job_id,
                TransferRef(TransferKind.RELOAD, Tier.HOST, f"req-{load.req_id}"),
                [b.key for b in load.blocks],
                load=load,
                deadline=now + self.settings.job_timeout_s,
                staged=staging,
            )
        )

    def _stage_stores(self, jobs: list[StoreJob]) -> dict[int, StagedBlocks]:
        """CUDA: gather the step's store jobs into device staging, one ``index_select`` per run
        for all of them (up to the staging budget; later jobs go block by block)."""
        assert self.views is not None
        table = self.views.table
        budget = staging_budget(table, sum(len(job.blocks) for job in jobs))
        chosen: list[StoreJob] = []
        for job in jobs:
            if len(job.blocks) > budget:
                break
            chosen.append(job)
            budget -= len(job.blocks)
        if not chosen:
            return {}
        try:
            batch = StagedBlocks.gather(table, [b.block_id for job in chosen for b in job.blocks])
        except Exception as exc:  # e.g. out of device memory: the per-block path still works
            log.warning("agentkv: batched store gather failed (%s); copying block by block", exc)
            return {}
        out: dict[int, StagedBlocks] = {}
        first = 0
        for job in chosen:
            out[job.job_id] = batch.slice(first, first + len(job.blocks))
            first += len(job.blocks)
        return out

    def _done(self, job_id: int, ok: bool) -> None:
        if job_id <= 0:
            return  # a fail-closed load of the connector's own: no manager job behind it
        self._report.jobs_done[job_id] = self._report.jobs_done.get(job_id, 0) + 1
        if not ok:
            self._report.jobs_failed.add(job_id)

    def _bad(self, logical: bytes, result: Any) -> None:
        if not logical:
            return
        error = getattr(result, "error", None)
        if result is None:
            self._report.bad_keys.setdefault(logical, "miss")
        elif isinstance(error, CorruptBlockError):
            self._report.bad_keys[logical] = "corrupt"
            tier = getattr(result, "tier", None)
            if tier is not None and Tier(tier) != Tier.REMOTE:  # remote: its client counts them
                self._reject(Tier(tier), Rejection.CORRUPT, 1)
        elif getattr(result, "status", None) is BlockStatus.MISS:
            self._report.bad_keys.setdefault(logical, "miss")
        else:
            self._report.bad_keys.setdefault(logical, "error")

    def _reject(self, tier: Tier, why: Rejection, n: int) -> None:
        if n > 0:
            rejected = self._report.rejected
            rejected[(tier, why)] = rejected.get((tier, why), 0) + n

    def _count_remote_rejections(self) -> None:
        """The remote client's bad tags and corrupt values since the last call, into the report:
        a bad tag reads as a plain miss, so only the client knows it happened. Read after the
        fetches and loads that read the remote tier are collected (one lock, only then)."""
        if not self._remote_read or self.store is None or self.store.remote is None:
            return
        self._remote_read = False
        stats = self.store.remote.stats()
        seen, self._remote_seen = self._remote_seen, (stats.bad_tags, stats.corrupt)
        self._reject(Tier.REMOTE, Rejection.BAD_TAG, stats.bad_tags - seen[0])
        self._reject(Tier.REMOTE, Rejection.CORRUPT, stats.corrupt - seen[1])

    def poll(self) -> set[str]:
        """Collect finished transfers; returns request ids whose async loads are complete.
        A load past its deadline is cancelled (fenced: nothing more is written into its blocks)
        and reported failed, so vLLM recomputes instead of waiting forever."""
        now = time.monotonic()
        still: list[_Pending] = []
        for p in self._jobs:
            try:
                if not p.handle.done():
                    still.append(p)
                    continue
                results = p.handle.result()
                if p.move is MoveKind.FETCH:
                    self._fetch_done(p, results, now)
                elif p.move is MoveKind.UPLOAD:
                    self._upload_done(p, results, now)
                else:
                    self._job_done(p, results, now)
            except Exception:  # collected once, as failed: never retried into the same fault
                log.exception("agentkv: collecting job %d failed; reported failed", p.job_id)
                self._collect_failed(p)
        self._jobs = still
        still = []
        for p in self._loads:
            assert p.load is not None
            try:
                if not p.handle.done():
                    if now < p.deadline:
                        still.append(p)
                        continue
                    log.warning("agentkv: load for %s timed out; vLLM recomputes", p.load.req_id)
                    p.handle.cancel()
                    self._collect_failed(p)
                    continue
                self._load_done(p, p.handle.result(), now)
            except Exception:
                log.exception("agentkv: collecting the load for %s failed", p.load.req_id)
                self._collect_failed(p)
        self._loads = still
        self._count_remote_rejections()
        done, self._recving_done = self._recving_done, set()
        return done

    def _collect_failed(self, p: _Pending) -> None:
        """A transfer that timed out or could not be collected: failed, reported once (a load's
        blocks are load errors and its request finished, so vLLM recomputes, never waits)."""
        if p.load is not None:
            self._load_errors.update(b.block_id for b in p.load.blocks)
            self._recving_done.add(p.load.req_id)
        if p.job_id in self._report.jobs_done:  # the fault came after it was counted
            self._report.jobs_failed.add(p.job_id)
        else:
            self._done(p.job_id, ok=False)

    def _fetch_done(self, p: _Pending, results: list[Any], now: float) -> None:
        """Best effort: blocks the remote tier lacks are this rank's misses, not a failed job
        (the manager indexes the rest)."""
        self._remote_read = True
        missing = [k for r, k in zip(results, p.keys, strict=True) if not r.ok]
        if missing:
            self._report.fetch_missing[p.job_id] = missing
        self._done(p.job_id, ok=True)
        got = len(results) - len(missing)
        if got:
            nbytes = got * (self.views.block_bytes if self.views is not None else 0)
            self._report.transfers[p.ref] = (nbytes, p.seconds(now))

    def _upload_done(self, p: _Pending, results: list[Any], now: float) -> None:
        """The remote tier failed, not the local copy: nothing local is lost (the remote client
        logs the cause, rate-limited); the manager counts the failed job."""
        self._done(p.job_id, all(r.ok for r in results))
        if any(r.ok for r in results):
            sent = p.nbytes * sum(r.ok for r in results) // len(results)
            self._report.transfers[p.ref] = (sent, p.seconds(now))

    def _job_done(self, p: _Pending, results: list[Any], now: float) -> None:
        """A store, promote or demote finished: its bad keys, its result and its timing."""
        ok = all(r.ok for r in results)
        for r, logical in zip(results, p.keys, strict=True):
            if not r.ok:
                self._bad(logical, r)
        if not ok:
            log.warning(
                "agentkv: %s job %d: %d/%d blocks failed (%s)",
                p.move or p.ref.kind,
                p.job_id,
                sum(not r.ok for r in results),
                len(results),
                [str(r.error) for r in results if not r.ok][:1],
            )
        self._done(p.job_id, ok)
        self._report.transfers[p.ref] = (p.nbytes, p.seconds(now))

    def _load_done(self, p: _Pending, results: list[Any] | None, now: float) -> None:
        """A finished load: failed blocks go to ``load_error_block_ids`` (vLLM recomputes them),
        CUDA staging is scattered into the blocks, and the request is reported finished."""
        assert p.load is not None
        self._remote_read = True  # a load may have read blocks local tiers lacked remotely
        if results is None:  # cancelled before it started
            self._load_errors.update(b.block_id for b in p.load.blocks)
            self._done(p.job_id, ok=False)
            self._recving_done.add(p.load.req_id)
            return
        ok = True
        for r, b in zip(results, p.load.blocks, strict=True):
            if not r.ok:
                ok = False
                self._load_errors.add(b.block_id)
                self._bad(b.key, r)
        if p.staged is not None:
            try:  # queued on the engine's stream: the request's next forward runs after it
                p.staged.scatter([r.ok for r in results])
            except Exception as exc:
                log.warning("agentkv: scatter of load %s failed: %s", p.load.req_id, exc)
                ok = False
                self._load_errors.update(b.block_id for b in p.load.blocks)
        tier = Tier.DISK if any(r.tier == Tier.DISK for r in results) else Tier.HOST
        self._report.transfers[p.ref._replace(tier=tier)] = (
            p.nbytes,
            p.seconds(now),
        )
        self._done(p.job_id, ok)
        self._recving_done.add(p.load.req_id)

    def _fetch_pool(self) -> ThreadPoolExecutor:
        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="agentkv-fetch")
        return self._fetcher

    def _fetch_remote(self, keys: list[BlockKey]) -> list[Any]:
        """Remote -> host for a fetch job (a thread of its own: network I/O). One result per
        key; only verified blocks of this rank's exact size are stored."""
        try:
            return self._fetch_remote_into_host(keys)
        except Exception as exc:  # a tier fault costs a recompute, never the engine
            log.warning("agentkv: remote fetch failed: %s", exc)
            return [BlockResult(k, BlockStatus.ERROR, Tier.REMOTE, None) for k in keys]

    def _fetch_remote_into_host(self, keys: list[BlockKey]) -> list[Any]:
        store = self.store
        assert store is not None and store.remote is not None and self.views is not None
        size = self.views.block_bytes
        values = store.remote.fetch_many(keys, size)
        results: list[Any] = [v.result() for v in values]
        good = [
            i
            for i, v in enumerate(values)
            if v.status is BlockStatus.OK and v.payload is not None and len(v.payload) == size
        ]
        if good:
            stored = store.submit_store(
                [keys[i] for i in good],
                [np.frombuffer(values[i].payload, np.uint8) for i in good],  # type: ignore[arg-type]
                tier=Tier.HOST,
            ).result()
            for i, r in zip(good, stored, strict=True):
                results[i] = r
        good_set = set(good)
        for i, v in enumerate(values):
            if v.status is BlockStatus.OK and i not in good_set:  # another block size
                results[i] = BlockResult(keys[i], BlockStatus.ERROR, Tier.REMOTE, None)
        return results

    def load_error_block_ids(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def take_report(self) -> AgentKVWorkerReport | None:
        if not self._report:
            return None
        report, self._report = self._report, WorkerReport()
        return AgentKVWorkerReport(report)

    def shutdown(self) -> None:
        self.finish_step()
        for p in self._loads:
            p.handle.cancel()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True)
        if self.store is not None:
            self.store.close()
            if self.store.remote is not None:
                self.store.remote.close()
