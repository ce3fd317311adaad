"""Layer-by-layer loads on a worker (``LoadJob.layerwise``): a step's host blocks copied into
vLLM's KV cache layer after layer while the model runs.

Primitives (``LayerwiseLoads``, a mixin of ``worker_side.WorkerSide``):
  _start_layerwise(loads)   pin the host copies in place (``TieredStore.acquire_host``), start
                            one copier thread writing them layer by layer in forward order;
                            blocks only disk holds are read whole (checksummed) first
  wait_for_layer(name)      block until ``name``'s segments of this step's loads are copied
  finish_step()             after the forward: wait for the copier, release its host pins,
                            report its jobs and its own copy time
  LayerwiseStep             one step's copy: per layer an event, the copier's future
  LAYER_WAIT_TIMEOUT_S      a layer copy slower than this is stuck: stop waiting, recompute

vLLM has already scheduled the request in this step, so a block missing from host, or any copy
error, goes to ``load_error_block_ids``: vLLM then discards the step's output for that request
and recomputes. Each attention layer waits only for its own layer. One batch for the whole step:
per layer, one copy call over every block of every job (one batched pointer copy on CUDA when
vLLM has it).

The mixin reads and writes the worker's state declared below (``WorkerSide`` defines it).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentkv.manager.jobs import LoadJob, TransferKind, TransferRef, WorkerReport
from agentkv.tier import Tier
from agentkv.tiers import HostRead, TieredStore
from agentkv.tiers.keys import BlockKey
from agentkv_vllm.device_copy import LayerCopier

if TYPE_CHECKING:
    from agentkv_vllm.block_copy import BlockViews

log = logging.getLogger("agentkv.worker")
# A layer copy that takes this long is stuck (host memcpy runs at GB/s): stop waiting, recompute.
LAYER_WAIT_TIMEOUT_S = 60.0


@dataclass
class LayerwiseStep:
    """This step's layer-by-layer loads: per layer, an event set once its segments are copied."""

    events: dict[str, threading.Event]
    future: Future[float]  # the copy's own duration (not the forward it overlaps)
    block_ids: list[int]
    nbytes: int
    started: float
    ref: str


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

    def _start_layerwise(self, loads: list[LoadJob]) -> None:
        assert self.store is not None and self.views is not None
        self.finish_step()  # never two steps' copies at once
        store = self.store
        table = self.views.table
        jobs: list[tuple[HostRead, list[int]]] = []
        block_ids: list[int] = []
        failed_jobs: set[int] = set()
        # Blocks the host does not hold but disk does (a prefetch still in flight): read whole,
        # checksummed, before the first layer is released.
        from_disk: list[tuple[BlockKey, int, bytes, int]] = []
        for load in loads:
            keys = [self.rank_key(b.key) for b in load.blocks]
            read = store.acquire_host(keys)
            ids = [b.block_id for b in load.blocks]
            for i in read.missing:
                if store.tier_of(keys[i]) is Tier.DISK:
                    from_disk.append((keys[i], ids[i], load.blocks[i].key, load.job_id))
                else:  # not where the scheduler said: vLLM recomputes it
                    self._load_errors.add(ids[i])
                    self._bad(load.blocks[i].key, None)
                    failed_jobs.add(load.job_id)
            jobs.append((read, ids))
            block_ids += ids
        # One batch for the whole step: per layer, one copy call over every block of every job.
        host_ids = [
            bid
            for read, ids in jobs
            for v, bid in zip(read.views, ids, strict=True)
            if v is not None
        ]
        host_views = [v for read, _ in jobs for v in read.views if v is not None]
        copier = LayerCopier(self.views.device, [name for name, _ in self._layers])
        events = copier.events  # CUDA: each also carries its layer's copy-done CUDA event
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="agentkv-layers")
        started = time.monotonic()
        nbytes = self.views.block_bytes * (len(from_disk) + len(host_ids))
        job_ids = [load.job_id for load in loads]

        def copy_layers() -> float:
            begin = time.monotonic()
            try:
                if from_disk:
                    results = store.submit_load(
                        [k for k, _, _, _ in from_disk],
                        [self.views.block(bid) for _, bid, _, _ in from_disk],  # type: ignore[union-attr]
                    ).result(timeout=LAYER_WAIT_TIMEOUT_S)
                    for r, (_, bid, logical, job_id) in zip(results, from_disk, strict=True):
                        if not r.ok:
                            self._load_errors.add(bid)
                            self._bad(logical, r)
                            failed_jobs.add(job_id)
                for name, segs in self._layers:
                    if host_ids:
                        copier.copy_runs(table, host_ids, host_views, [i for i, _, _ in segs])
                    events[name].set()
            except Exception:
                log.exception("agentkv: layer-by-layer load failed; vLLM recomputes")
                self._load_errors.update(block_ids)
                failed_jobs.update(job_ids)
            finally:
                for ev in events.values():
                    ev.set()  # a failure must not leave the forward pass waiting
                copier.synchronize()  # the DMA reads the host copies until it completes
                for read, _ in jobs:
                    store.release_host(read)
            return time.monotonic() - begin

        future = self._copier.submit(copy_layers)
        self._layerwise = LayerwiseStep(
            events, future, block_ids, nbytes, started, f"layerwise-{loads[0].req_id}"
        )
        self._layerwise_jobs = (job_ids, failed_jobs)

    def wait_for_layer(self, layer_name: str) -> None:
        """Block until this step's layerwise loads have copied ``layer_name``; must be fast."""
        step = self._layerwise
        if step is None:
            return
        event = step.events.get(layer_name)
        if event is None:
            # A layer we did not see at registration: wait for all of them to be safe.
            step.future.result(timeout=LAYER_WAIT_TIMEOUT_S)
            return
        if not event.wait(LAYER_WAIT_TIMEOUT_S):
            log.error("agentkv: layer %s not loaded in time; vLLM recomputes", layer_name)
            self._load_errors.update(step.block_ids)

    def finish_step(self) -> None:
        """Wait for the step's layer copier (all layers were waited for already) and clear it."""
        step, self._layerwise = self._layerwise, None
        if step is None:
            return
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
