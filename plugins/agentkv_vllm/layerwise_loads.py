"""Layer-by-layer loads on a worker (``LoadJob.layerwise``): a step's host blocks copied into
vLLM's KV cache layer after layer while the model runs.

Primitives (``LayerwiseLoads``, a mixin of ``worker_side.WorkerSide``):
  _start_layerwise(loads)   pin the host copies in place (``TieredStore.acquire_host``), start
                            one copier thread writing them layer by layer in forward order;
                            blocks only disk holds are read whole (checksummed) first. A small
                            CPU step (up to SYNC_COPY_MAX_BYTES, all in host) is instead copied
                            right there, one native call, before the forward starts
  wait_for_layer(name)      block until ``name``'s segments of this step's loads are copied
  finish_step()             after the forward: wait for the copier, release its host pins,
                            report its jobs and its own copy time
  LayerwiseStep             one step's copy: per layer an event, the copier's future
  ReloadStamps              one step's milestones (perf_counter), hence its ReloadPhase
                            seconds, reported with the step (``agentkv_reload_phase_seconds``)
  LAYER_WAIT_TIMEOUT_S      a layer copy slower than this is stuck: stop waiting, recompute

vLLM has already scheduled the request in this step, so a block missing from host, or any copy
error, goes to ``load_error_block_ids``: vLLM then discards the step's output for that request
and recomputes. Each attention layer waits only for its own layer. One batch for the whole step:
per layer, one copy call over every block of every job (CPU: one native call with the addresses
computed once per step, ``BlockTable.host_batch``; CUDA: one batched pointer copy when vLLM has
it).

The mixin reads and writes the worker's state declared below (``WorkerSide`` defines it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from agentkv.manager.jobs import LoadJob, ReloadPhase, TransferKind, TransferRef, WorkerReport
from agentkv.tier import Tier
from agentkv.tiers import HostRead, TieredStore
from agentkv.tiers.batched import HostBatch
from agentkv.tiers.keys import BlockKey
from agentkv_vllm.device_copy import LayerCopier

if TYPE_CHECKING:
    from agentkv_vllm.block_copy import BlockViews

log = logging.getLogger("agentkv.worker")
# A layer copy that takes this long is stuck (host memcpy runs at GB/s): stop waiting, recompute.
LAYER_WAIT_TIMEOUT_S = 60.0
# A CPU step whose host blocks total at most this is copied on the engine thread inside
# ``start_step`` (one native call, ~0.1 ms per MiB) instead of by the copier thread. Why: the copy
# is CPU work either way, and on the few cores of a CPU server the thread competes with the
# forward pass it was meant to overlap; what it costs next to the copy itself (a thread wake-up,
# per-layer events and Python, the GIL handed back and forth with the engine thread) was ~380 us
# next to a ~170 us copy of 2 MiB (reload_phases bench, docs/tiers.md), more than the overlap
# can save. Larger steps keep the thread: their first layers reach the forward before the last
# ones are copied.
SYNC_COPY_MAX_BYTES = 8 << 20


@dataclass
class ReloadStamps:
    """One layer-by-layer reload step's milestones, ``time.perf_counter()`` seconds (0.0: not
    reached), and the copying thread's CPU seconds during the copy. Written by the engine
    thread, and by the copier thread before its future completes (read after it)."""

    entered: float  # start_step
    layerwise: float = 0.0  # the layerwise loads' turn in start_step
    prepared: float = 0.0  # keys, pins, addresses and the batch done
    copy_start: float = 0.0
    disk_done: float = 0.0  # blocks only disk held read (== copy_start when none)
    copy_end: float = 0.0
    released: float = 0.0
    returned: float = 0.0  # start_step returned: the forward starts
    finishing: float = 0.0  # finish_step entered: the forward is over
    finished: float = 0.0
    copy_cpu: float = 0.0

    def phases(self) -> dict[ReloadPhase, float]:
        """Seconds per phase (ReloadPhase); a phase whose end was not reached (the copy failed,
        the step never returned) is left out, and none is negative. COPY_CPU (the copying
        thread's CPU time over disk + copy + release) comes with COPY."""
        spans = {
            ReloadPhase.BEFORE: (self.entered, self.layerwise),
            ReloadPhase.PREPARE: (self.layerwise, self.prepared),
            ReloadPhase.HANDOFF: (self.prepared, self.copy_start),
            ReloadPhase.DISK: (self.copy_start, self.disk_done),
            ReloadPhase.COPY: (self.disk_done, self.copy_end),
            ReloadPhase.RELEASE: (self.copy_end, self.released),
            ReloadPhase.FORWARD: (self.returned, self.finishing),
            ReloadPhase.FINISH: (self.finishing, self.finished),
        }
        out = {p: max(0.0, end - start) for p, (start, end) in spans.items() if start and end}
        if ReloadPhase.COPY in out:
            out[ReloadPhase.COPY_CPU] = self.copy_cpu
        return out


@dataclass
class _StepCopy:
    """What one step's layer-by-layer copy moves: pinned host reads, disk-only blocks, and the
    CPU batch of the host blocks (None: per-layer ``LayerCopier.copy_runs``, CUDA)."""

    job_ids: list[int]
    stamps: ReloadStamps
    reads: list[HostRead] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    host_ids: list[int] = field(default_factory=list)
    host_views: list[np.ndarray] = field(default_factory=list)
    from_disk: list[tuple[BlockKey, int, bytes, int]] = field(default_factory=list)
    failed_jobs: set[int] = field(default_factory=set)
    nbytes: int = 0
    batch: HostBatch | None = None
    copier: LayerCopier | None = None  # None: copied synchronously on the engine thread


@dataclass
class LayerwiseStep:
    """This step's layer-by-layer loads: per layer, an event set once its segments are copied
    (none when the step was copied in ``start_step``: its future is already done)."""

    events: dict[str, threading.Event]
    future: Future[float]  # the copy's own duration (not the forward it overlaps)
    block_ids: list[int]
    nbytes: int
    started: float
    ref: str
    stamps: ReloadStamps
    failed: bool = False  # a layer wait gave up: the step's blocks are load errors already


class LayerwiseLoads:
    """This step's layer-by-layer loads (a mixin: see the module docstring)."""

    store: TieredStore | None
    views: BlockViews | None
    _load_errors: set[int]
    _report: WorkerReport
    _layerwise: LayerwiseStep | None
    _copier: ThreadPoolExecutor | None
    _layers: list[tuple[str, list[tuple[int, int, int]]]]
    _layerwise_jobs: tuple[list[int], set[int]]

    def rank_key(self, logical: bytes) -> BlockKey:
        raise NotImplementedError

    def _bad(self, logical: bytes, result: Any) -> None:
        raise NotImplementedError

    def _done(self, job_id: int, ok: bool) -> None:
        raise NotImplementedError

    def _start_layerwise(self, loads: list[LoadJob], entered: float) -> None:
        assert self.store is not None and self.views is not None
        self.finish_step()  # never two steps' copies at once
        started = time.monotonic()
        stamps = ReloadStamps(entered, layerwise=time.perf_counter())
        copy = self._pin_layerwise(loads, stamps)
        stamps.prepared = time.perf_counter()
        if copy.batch is not None and not copy.from_disk and copy.nbytes <= SYNC_COPY_MAX_BYTES:
            # Small, CPU, all in host: copied here, before the forward starts (see SYNC_COPY_...).
            seconds: Future[float] = Future()
            seconds.set_result(self._copy_layers(copy))  # never raises; releases the pins
            events: dict[str, threading.Event] = {}
        else:
            try:
                copier = LayerCopier(self.views.device, [name for name, _ in self._layers])
                copy.copier = copier
                events = copier.events  # CUDA: each also carries its layer's copy-done CUDA event
                if self._copier is None:
                    self._copier = ThreadPoolExecutor(1, thread_name_prefix="agentkv-layers")
                seconds = self._copier.submit(self._copy_layers, copy)
            except Exception:
                # No copier owns the pins: release them; start_step fails the loads.
                for read in copy.reads:
                    self.store.release_host(read)
                raise
        self._layerwise = LayerwiseStep(
            events,
            seconds,
            copy.block_ids,
            copy.nbytes,
            started,
            f"layerwise-{loads[0].req_id}",
            stamps,
        )
        self._layerwise_jobs = (copy.job_ids, copy.failed_jobs)

    def _pin_layerwise(self, loads: list[LoadJob], stamps: ReloadStamps) -> _StepCopy:
        """Pin the host copies of the step's loads; blocks only disk holds are read whole later,
        blocks no tier holds fail now (vLLM recomputes them)."""
        assert self.store is not None and self.views is not None
        store = self.store
        copy = _StepCopy(job_ids=[load.job_id for load in loads], stamps=stamps)
        try:
            self._pin_each(loads, copy)
        except Exception:
            for read in copy.reads:  # a fault part way: no step owns these pins
                store.release_host(read)
            raise
        return copy

    def _pin_each(self, loads: list[LoadJob], copy: _StepCopy) -> None:
        assert self.store is not None and self.views is not None
        store = self.store
        hosts: list[int] = []  # the host blocks' arena addresses, for the CPU batch
        for load in loads:
            keys = [self.rank_key(b.key) for b in load.blocks]
            read = store.acquire_host(keys)
            copy.reads.append(read)  # at once: a fault below still releases it
            ids = [b.block_id for b in load.blocks]
            for i in read.missing:
                if store.tier_of(keys[i]) is Tier.DISK:
                    copy.from_disk.append((keys[i], ids[i], load.blocks[i].key, load.job_id))
                else:  # not where the scheduler said: vLLM recomputes it
                    self._load_errors.add(ids[i])
                    self._bad(load.blocks[i].key, None)
                    copy.failed_jobs.add(load.job_id)
            copy.block_ids += ids
            for view, address, bid in zip(read.views, read.addresses, ids, strict=True):
                if view is not None:
                    copy.host_ids.append(bid)
                    copy.host_views.append(view)
                    hosts.append(address)
        copy.nbytes = self.views.block_bytes * (len(copy.from_disk) + len(copy.host_ids))
        if copy.host_ids:
            with contextlib.suppress(IndexError):  # the copy raises it again, as a failed load
                copy.batch = self.views.table.host_batch(copy.host_ids, hosts)

    def _copy_layers(self, copy: _StepCopy) -> float:
        """The step's copy (the copier thread's, or the engine thread's for a small one): blocks
        read from disk first, then layer by layer in forward order; returns its own duration."""
        assert self.store is not None
        store = self.store
        stamps = copy.stamps
        # The thread's CPU clock is read outside the timed span: it is a system call, and on
        # return the kernel may hand a core whose slice is used up to another task (EEVDF
        # checks the slice there): measured inside, that wait landed in the copy's time.
        cpu = time.thread_time()
        begin = time.monotonic()
        stamps.copy_start = time.perf_counter()
        copier = copy.copier
        try:
            if copy.from_disk:
                self._load_from_disk(copy)
            stamps.disk_done = time.perf_counter()
            if copier is None:  # the synchronous path: every run of every block, one call
                assert copy.batch is not None
                copy.batch.copy()
            else:
                self._copy_each_layer(copy, copier)
            stamps.copy_end = time.perf_counter()
        except Exception:
            log.exception("agentkv: layer-by-layer load failed; vLLM recomputes")
            self._load_errors.update(copy.block_ids)
            copy.failed_jobs.update(copy.job_ids)
        finally:
            if copier is not None:
                for ev in copier.events.values():
                    ev.set()  # a failure must not leave the forward pass waiting
                copier.synchronize()  # the DMA reads the host copies until it completes
            for read in copy.reads:
                store.release_host(read)
            stamps.released = time.perf_counter()
        seconds = time.monotonic() - begin
        stamps.copy_cpu = time.thread_time() - cpu
        return seconds

    def _copy_each_layer(self, copy: _StepCopy, copier: LayerCopier) -> None:
        """Per layer in forward order: its runs of every host block, then its event."""
        assert self.views is not None
        table = self.views.table
        for name, segs in self._layers:
            runs = [i for i, _, _ in segs]
            if copy.batch is not None:
                copy.batch.copy(np.array(runs, np.int64))
            elif copy.host_ids:
                copier.copy_runs(table, copy.host_ids, copy.host_views, runs)
            copier.events[name].set()

    def _load_from_disk(self, copy: _StepCopy) -> None:
        """Blocks the host lacks but disk holds (a prefetch still in flight): read whole,
        checksummed, before the first layer is released."""
        assert self.store is not None and self.views is not None
        views = self.views
        results = self.store.submit_load(
            [k for k, _, _, _ in copy.from_disk],
            [views.block(bid) for _, bid, _, _ in copy.from_disk],
        ).result(timeout=LAYER_WAIT_TIMEOUT_S)
        for r, (_, bid, logical, job_id) in zip(results, copy.from_disk, strict=True):
            if not r.ok:
                self._load_errors.add(bid)
                self._bad(logical, r)
                copy.failed_jobs.add(job_id)

    def wait_for_layer(self, layer_name: str) -> None:
        """Block until this step's layerwise loads have copied ``layer_name``; must be fast.
        Never raises: a wait that times out or fails fails the step's loads (``fail_layerwise``)
        and the step's later layers no longer wait."""
        step = self._layerwise
        if step is None or step.failed:
            return
        try:
            event = step.events.get(layer_name)
            if event is None:
                # Copied in start_step (no events), or a layer we did not see at registration:
                # wait for all of them to be safe.
                step.future.result(timeout=LAYER_WAIT_TIMEOUT_S)
                return
            if event.wait(LAYER_WAIT_TIMEOUT_S):
                return
            log.error("agentkv: layer %s not loaded in time; vLLM recomputes", layer_name)
        except Exception:
            log.exception("agentkv: waiting for layer %s failed; vLLM recomputes", layer_name)
        self.fail_layerwise()

    def fail_layerwise(self) -> None:
        """This step's layerwise loads failed: their blocks are load errors (vLLM discards the
        step's output for those requests and recomputes) and their jobs are reported failed."""
        step = self._layerwise
        if step is None:
            return
        step.failed = True
        self._load_errors.update(step.block_ids)
        job_ids, failed = self._layerwise_jobs
        failed.update(job_ids)

    def finish_step(self) -> None:
        """Wait for the step's layer copier (all layers were waited for already) and clear it."""
        step, self._layerwise = self._layerwise, None
        if step is None:
            return
        step.stamps.finishing = time.perf_counter()
        job_ids, failed = self._layerwise_jobs
        self._layerwise_jobs = ([], set())
        try:
            seconds = step.future.result(timeout=LAYER_WAIT_TIMEOUT_S)
        except Exception:
            self._load_errors.update(step.block_ids)
            failed = set(job_ids)
            seconds = time.monotonic() - step.started
        for job_id in job_ids:
            self._done(job_id, ok=job_id not in failed)
        # Timed by the copier itself: the step's wall time includes the forward it overlaps,
        # and the online bandwidth estimate must not read that as a slow link.
        self._report.transfers[TransferRef(TransferKind.RELOAD, Tier.HOST, step.ref)] = (
            step.nbytes,
            seconds,
        )
        step.stamps.finished = time.perf_counter()
        phases = self._report.reload_phases
        for phase, spent in step.stamps.phases().items():
            phases[phase] = phases.get(phase, 0.0) + spent
