"""Worker side of AgentKVConnector: moves whole blocks between vLLM's KV cache and the tiers.

Primitives:
  WorkerSide.register_kv_caches(kv_caches)   find the block layout, open this rank's TieredStore
  WorkerSide.start_step(meta)                submit the step's stores/loads/drops; must not block
  WorkerSide.wait_for_layer(name)            layer-by-layer loads: block until ``name``'s
                                             segments of this step's layerwise loads are copied
  WorkerSide.finish_step()                   after the forward: the layer copier is done, its
                                             host pins are released
  WorkerSide.poll(finished_req_ids)          (finished_sending, finished_recving) request ids
  WorkerSide.take_report()                   AgentKVWorkerReport for the scheduler, or None
  WorkerSide.load_error_block_ids()          engine block ids whose load failed -> recompute

Each TP rank keeps its own store under ``<disk_dir>/rank<r>`` with keys salted by its rank
fingerprint, so shards never mix. Loads of a request are reported finished only when every block
has a result; a failed block is also reported through ``load_error_block_ids`` so vLLM recomputes
it instead of reading garbage.

Layer-by-layer loads (``LoadJob.layerwise``): vLLM has already scheduled the request in this step.
The host copies are pinned in place (``TieredStore.acquire_host``) and one copier thread writes
them layer after layer in forward order while the model runs; each attention layer waits only
for its own layer (``wait_for_layer``). A block missing from host, or any copy error, goes to
``load_error_block_ids``: vLLM then discards the step's output for that request and recomputes.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agentkv.tiers import HostRead, TieredStore, TransferHandle
from agentkv.tiers.keys import KEY_BYTES, BlockKey, ModelFingerprint
from agentkv_vllm.block_copy import BlockViews
from agentkv_vllm.metadata import AgentKVStepMetadata, AgentKVWorkerReport, LoadJob, StoreJob
from agentkv_vllm.settings import ConnectorSettings

log = logging.getLogger("agentkv.worker")
GiB = 1 << 30
# A layer copy that takes this long is stuck (host memcpy runs at GB/s): stop waiting, recompute.
LAYER_WAIT_TIMEOUT_S = 60.0


def _copy(dest: Any, src: np.ndarray) -> None:
    if isinstance(dest, np.ndarray):
        np.copyto(dest, src)
    else:  # a device tensor (CUDA)
        import torch

        dest.copy_(torch.from_numpy(src), non_blocking=False)


@dataclass
class _LayerwiseStep:
    """This step's layer-by-layer loads: per layer, an event set once its segments are copied."""

    events: dict[str, threading.Event]
    future: Future[None]
    block_ids: list[int]
    nbytes: int
    started: float
    ref: str


@dataclass
class _Pending:
    handle: TransferHandle
    started: float
    nbytes: int
    job: StoreJob | None = None
    load: LoadJob | None = None


@dataclass
class WorkerSide:
    settings: ConnectorSettings
    model_id: str
    tp_rank: int
    tp_size: int
    num_blocks: int
    views: BlockViews | None = None
    store: TieredStore | None = None
    fingerprint: ModelFingerprint | None = None
    _stores: list[_Pending] = field(default_factory=list)
    _loads: list[_Pending] = field(default_factory=list)
    _recving_done: set[str] = field(default_factory=set)
    _load_errors: set[int] = field(default_factory=set)
    _report: AgentKVWorkerReport = field(default_factory=AgentKVWorkerReport)
    _report_dirty: bool = False
    _key_cache: dict[bytes, BlockKey] = field(default_factory=dict)
    _layerwise: _LayerwiseStep | None = None
    _copier: ThreadPoolExecutor | None = None
    _layers: list[tuple[str, list[tuple[int, int, int]]]] = field(default_factory=list)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.views = BlockViews(kv_caches, self.num_blocks)
        self._layers = self.views.layer_slices()
        self.fingerprint = ModelFingerprint(
            model_id=self.model_id,
            dtype=self.views.dtype,
            block_size=0,
            num_layers=len(self.views.layer_names),
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            layout=self.views.layout,
        )
        disk_dir = None
        if self.settings.disk_dir:
            disk_dir = Path(self.settings.disk_dir) / f"rank{self.tp_rank}"
            disk_dir.mkdir(parents=True, exist_ok=True)
        self.store = TieredStore(
            host_capacity_bytes=int(self.settings.host_capacity_gib * GiB),
            disk_dir=disk_dir,
            disk_capacity_bytes=int(self.settings.disk_capacity_gib * GiB),
            block_bytes=self.views.block_bytes,
            workers=self.settings.io_threads,
        )
        import os

        self._report.hello[self.tp_rank] = os.getpid()
        self._report_dirty = True
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
            fp = self.fingerprint.digest()
            digest = hashlib.blake2b(
                logical + fp, digest_size=KEY_BYTES, person=b"agentkv-rank-v1"
            ).digest()
            key = BlockKey(digest, fp)
            if len(self._key_cache) > 1_000_000:
                self._key_cache.clear()
            self._key_cache[logical] = key
        return key

    def start_step(self, meta: AgentKVStepMetadata) -> None:
        """Submit this step's transfers to the store's thread pool. Must not block."""
        if self.store is None or self.views is None:
            return
        if meta.drop_keys:
            self.store.drop([self.rank_key(k) for k in meta.drop_keys])
        if meta.promote_keys:
            self.store.promote([self.rank_key(k) for k in meta.promote_keys])
        now = time.monotonic()
        for job in meta.stores:
            keys = [self.rank_key(b.key) for b in job.blocks]
            buffers = [self.views.segments(b.block_id) for b in job.blocks]
            lease = now + job.lease_until_s if job.lease_until_s else None
            try:
                handle = self.store.submit_store(
                    keys,
                    buffers,
                    tier="disk" if job.tier == "disk" else "host",
                    lease_until=lease,
                    owner=job.owner,
                )
            except Exception as exc:  # a tier fault must never take the engine down
                log.warning("agentkv: store job %d failed to start: %s", job.job_id, exc)
                self._report.stores_failed.add(job.job_id)
                self._report.stores_done[job.job_id] = 1
                self._report_dirty = True
                continue
            self._stores.append(_Pending(handle, now, len(keys) * self.views.block_bytes, job=job))
        layerwise = [load for load in meta.loads if load.layerwise]
        if layerwise:
            self._start_layerwise(layerwise)
        for load in meta.loads:
            if load.layerwise:
                continue
            keys = [self.rank_key(b.key) for b in load.blocks]
            buffers = [self.views.segments(b.block_id) for b in load.blocks]
            try:
                handle = self.store.submit_load(keys, buffers)
            except Exception as exc:
                log.warning("agentkv: load for %s failed to start: %s", load.req_id, exc)
                self._load_errors.update(b.block_id for b in load.blocks)
                self._recving_done.add(load.req_id)
                continue
            self._loads.append(_Pending(handle, now, len(keys) * self.views.block_bytes, load=load))

    def _start_layerwise(self, loads: list[LoadJob]) -> None:
        assert self.store is not None and self.views is not None
        self.finish_step()  # never two steps' copies at once
        store = self.store
        jobs: list[tuple[HostRead, list[Any], list[int]]] = []
        block_ids: list[int] = []
        # Blocks the host does not hold but disk does (a prefetch still in flight): read whole,
        # checksummed, before the first layer is released.
        from_disk: list[tuple[BlockKey, Any, int, bytes]] = []
        for load in loads:
            keys = [self.rank_key(b.key) for b in load.blocks]
            read = store.acquire_host(keys)
            ids = [b.block_id for b in load.blocks]
            dests = [self.views.segments(bid) for bid in ids]
            for i in read.missing:
                if store.tier_of(keys[i]) == "disk":
                    from_disk.append((keys[i], dests[i], ids[i], load.blocks[i].key))
                else:  # evicted since the scheduler looked: vLLM recomputes it
                    self._load_errors.add(ids[i])
                    self._report.missing_keys.add(load.blocks[i].key)
                    self._report_dirty = True
            jobs.append((read, dests, ids))
            block_ids += ids
        events = {name: threading.Event() for name, _ in self._layers}
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="agentkv-layers")
        started = time.monotonic()
        nbytes = self.views.block_bytes * (
            len(from_disk) + sum(v is not None for read, _, _ in jobs for v in read.views)
        )

        def copy_layers() -> None:
            try:
                if from_disk:
                    results = store.submit_load(
                        [k for k, _, _, _ in from_disk], [d for _, d, _, _ in from_disk]
                    ).result(timeout=LAYER_WAIT_TIMEOUT_S)
                    for r, (_, _, bid, logical) in zip(results, from_disk, strict=True):
                        if not r.ok:
                            self._load_errors.add(bid)
                            self._report.missing_keys.add(logical)
                for name, segs in self._layers:
                    for read, dests, _ in jobs:
                        for view, dest in zip(read.views, dests, strict=True):
                            if view is None:
                                continue
                            for index, offset, size in segs:
                                _copy(dest[index], view[offset : offset + size])
                    events[name].set()
            except Exception:
                log.exception("agentkv: layer-by-layer load failed; vLLM recomputes")
                self._load_errors.update(block_ids)
            finally:
                for ev in events.values():
                    ev.set()  # a failure must not leave the forward pass waiting
                for read, _, _ in jobs:
                    store.release_host(read)

        future = self._copier.submit(copy_layers)
        self._layerwise = _LayerwiseStep(
            events, future, block_ids, nbytes, started, f"layerwise-{loads[0].req_id}"
        )

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
        try:
            step.future.result(timeout=LAYER_WAIT_TIMEOUT_S)
        except Exception:
            self._load_errors.update(step.block_ids)
        self._report.transfers[("reload", "host", step.ref)] = (
            step.nbytes,
            time.monotonic() - step.started,
        )
        self._report_dirty = True

    def poll(self) -> set[str]:
        """Collect finished transfers; returns request ids whose loads are complete."""
        now = time.monotonic()
        still: list[_Pending] = []
        for p in self._stores:
            if not p.handle.done():
                still.append(p)
                continue
            assert p.job is not None
            results = p.handle.result()
            ok = all(r.ok for r in results)
            if not ok:
                self._report.stores_failed.add(p.job.job_id)
                errors = [str(r.error) for r in results if not r.ok][:1]
                log.warning(
                    "agentkv: store job %d: %d/%d blocks failed (%s)",
                    p.job.job_id,
                    sum(not r.ok for r in results),
                    len(results),
                    errors,
                )
            self._report.stores_done[p.job.job_id] = (
                self._report.stores_done.get(p.job.job_id, 0) + 1
            )
            self._report.transfers[("offload", p.job.tier, f"job-{p.job.job_id}")] = (
                p.nbytes,
                now - p.started,
            )
            self._report_dirty = True
        self._stores = still
        still = []
        for p in self._loads:
            if not p.handle.done():
                still.append(p)
                continue
            assert p.load is not None
            results = p.handle.result()
            for r, b in zip(results, p.load.blocks, strict=True):
                if not r.ok:
                    self._load_errors.add(b.block_id)
                    self._report.missing_keys.add(b.key)
            tier = "disk" if any(r.tier == "disk" for r in results) else "host"
            self._report.transfers[("reload", tier, f"req-{p.load.req_id}")] = (
                p.nbytes,
                now - p.started,
            )
            self._report_dirty = True
            self._recving_done.add(p.load.req_id)
        self._loads = still
        done, self._recving_done = self._recving_done, set()
        return done

    def load_error_block_ids(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def take_report(self) -> AgentKVWorkerReport | None:
        if not self._report_dirty:
            return None
        report, self._report = self._report, AgentKVWorkerReport()
        self._report_dirty = False
        return report

    @property
    def busy(self) -> bool:
        return bool(self._stores or self._loads)

    def shutdown(self) -> None:
        self.finish_step()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        if self.store is not None:
            self.store.close()
