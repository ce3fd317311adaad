"""The plugin's CUDA-aware data path: layer-by-layer loads with per-layer completion, and the
step's device staging region for batched whole-block stores and loads.

Primitives:
  LayerCopier(device, layer_names)  one step's copier; create it on the thread that runs the
                                    model (it orders the copies after that thread's queued work)
  .copy_runs(table, ids, sources, runs)
                                    copy runs ``runs`` (one layer's) of blocks ``ids`` from their
                                    host images ``sources`` into the KV cache: one batched call
  .events[name]                     a LayerEvent per layer: the copier thread ``set()``s it once
                                    the layer's copies are queued; ``wait()`` returns when that
                                    layer, and only that layer, is usable by the model
  .synchronize()                    block until every copy queued so far is done (before the
                                    host copies are unpinned)

CUDA: the copies are ``copy_(..., non_blocking=True)`` on one dedicated stream per device; a
layer's ``set()`` records a CUDA event on that stream after its copies, and ``wait()`` makes the
waiting thread's current stream wait for that event on the GPU (no host sync): the attention
kernels of layer L queue behind layer L's copies only, while later layers still transfer.
CPU: the same calls copy synchronously with numpy, and events are plain threading events.

  StagedBlocks.gather(table, ids)   CUDA stores: one ``index_select`` per run gathers blocks
                                    ``ids`` into a fresh device staging region ``[n, block_bytes]``
                                    on the copy stream (after the engine's queued work); ``rows``
                                    are one-segment DeviceSegments carrying that event, which the
                                    store copies to the pinned host arena with one DMA each.
  StagedBlocks.for_load(table, ids) CUDA loads: the store DMAs each block into its staging row;
  .scatter(ok)                      then, on the engine's stream (so the next forward is ordered
                                    after it), one ``index_copy_`` per run writes the rows whose
                                    load succeeded into the KV cache.
  staging_budget(table, count)      how many blocks of a step go through staging (the rest
                                    through per-block BlockRefs): bounded, the region is device
                                    memory vLLM did not budget for.

Status: the CUDA branch has not run on a GPU yet (tests/gpu covers it).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from agentkv.tiers.batched import BlockTable
from agentkv.tiers.device import DeviceSegments

# Device memory one step's staging may take (stores and loads each); blocks beyond it take the
# per-block path. vLLM sized the KV cache to the GPU, so this must stay small next to it.
STAGING_BYTES = 256 << 20

_streams: dict[torch.device, Any] = {}
_streams_lock = threading.Lock()


def _stream(device: torch.device) -> Any:
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            _streams[device] = stream
        return stream


class LayerEvent(threading.Event):
    """A threading.Event that, on CUDA, also carries the layer's copy-completion CUDA event."""

    def __init__(self, copier: LayerCopier) -> None:
        super().__init__()
        self._copier = copier
        self._cuda_event: Any = None

    def set(self) -> None:
        if not self.is_set():
            self._cuda_event = self._copier._record()
        super().set()

    def wait(self, timeout: float | None = None) -> bool:
        if not super().wait(timeout):
            return False
        event = self._cuda_event
        if event is not None:
            torch.cuda.current_stream(self._copier.device).wait_event(event)
        return True


class LayerCopier:
    """Copies of one step's layer-by-layer loads (see module docstring)."""

    def __init__(self, device: torch.device | str, layer_names: list[str]) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._stream: Any = None
        if self._cuda:
            self._stream = _stream(self.device)
            # KV blocks handed to this load may still be read by work already queued: wait for it.
            engine = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(engine)
            # The copier thread's own transfers (whole blocks read from disk through the store)
            # are ordered after the work queued on its current stream, the default stream: make
            # that wait for the engine's queued work too.
            default = torch.cuda.default_stream(self.device)
            if default != engine:
                default.wait_stream(engine)
        self.events: dict[str, threading.Event] = {name: LayerEvent(self) for name in layer_names}

    def copy_runs(
        self, table: BlockTable, ids: list[int], sources: list[np.ndarray], runs: list[int]
    ) -> None:
        """Copy runs ``runs`` of blocks ``ids`` from host images ``sources`` into the KV cache
        (CUDA: queued on the copy stream; the caller keeps ``sources`` until ``synchronize``)."""
        if not self._cuda:
            table.copy_runs_from_host(ids, sources, runs)
            return
        with torch.cuda.stream(self._stream):
            table.copy_runs_from_host(ids, sources, runs)

    def _record(self) -> Any:
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def synchronize(self) -> None:
        """Return once every copy queued so far has completed (the thread sleeps, no spinning)."""
        if self._cuda:
            done = torch.cuda.Event(blocking=True)
            done.record(self._stream)
            done.synchronize()


def staging_budget(table: BlockTable, count: int) -> int:
    """How many of ``count`` blocks one step stages on the device (0 off CUDA)."""
    if not table.is_cuda:
        return 0
    return min(count, max(1, STAGING_BYTES // table.block_bytes))


class StagedBlocks:
    """A step's batch of whole blocks in a device staging region (see module docstring)."""

    def __init__(
        self,
        table: BlockTable,
        ids: list[int],
        staging: torch.Tensor,
        rows: list[DeviceSegments] | None = None,
    ) -> None:
        self.table = table
        self.ids = ids
        self.staging = staging  # kept alive here until the store's copies of it are done
        self.rows = rows if rows is not None else [DeviceSegments([r]) for r in staging.unbind(0)]

    def slice(self, start: int, stop: int) -> StagedBlocks:
        """Blocks ``start:stop`` of this batch (one job's share), same staging memory."""
        return StagedBlocks(
            self.table, self.ids[start:stop], self.staging[start:stop], self.rows[start:stop]
        )

    @classmethod
    def gather(cls, table: BlockTable, ids: list[int]) -> StagedBlocks:
        """Blocks ``ids`` gathered on the copy stream; each row's ready event orders the store's
        DMA after the gather (and the gather after the engine's queued work)."""
        device = table.device
        engine = torch.cuda.current_stream(device)
        stream = _stream(device)
        staging = torch.empty((len(ids), table.block_bytes), dtype=torch.uint8, device=device)
        with torch.cuda.stream(stream):
            stream.wait_stream(engine)
            table.gather(ids, staging)
            ready = stream.record_event()
        staging.record_stream(stream)
        staged = cls(table, ids, staging)
        for row in staged.rows:
            row.ready = ready
        return staged

    @classmethod
    def for_load(cls, table: BlockTable, ids: list[int]) -> StagedBlocks:
        staging = torch.empty((len(ids), table.block_bytes), dtype=torch.uint8, device=table.device)
        return cls(table, ids, staging)

    def scatter(self, ok: list[bool]) -> None:
        """Write the rows whose load succeeded into their blocks, on the current stream (call
        it on the engine thread before reporting the load finished)."""
        rows = [i for i, good in enumerate(ok) if good]
        if not rows:
            return
        if len(rows) == len(self.ids):
            self.table.scatter(self.ids, self.staging)
            return
        index = torch.tensor(rows, dtype=torch.int64).to(self.staging.device)
        self.table.scatter([self.ids[i] for i in rows], self.staging.index_select(0, index))
