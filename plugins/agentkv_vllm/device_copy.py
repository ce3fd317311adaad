"""Layer-by-layer copies from pinned host blocks into the KV cache, with per-layer completion.

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

CUDA: the copies are ``copy_(..., non_blocking=True)`` on one dedicated stream per device
(``batched.copy_stream(device, "layers")``); a layer's ``set()`` records a CUDA event on that
stream after its copies, and ``wait()`` makes the waiting thread's current stream wait for that
event on the GPU (no host sync): the attention kernels of layer L queue behind layer L's copies
only, while later layers still transfer.
CPU: the same calls copy synchronously with numpy, and events are plain threading events.

Whole-block stores and loads of a step are staged on the device by
agentkv.tiers.batched.StagedBlocks (shared with ``agentkv bench tiers``).

Status: the CUDA branch has not run on a GPU yet (tests/gpu covers it).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from agentkv.tiers.batched import BlockTable, copy_stream


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
            self._stream = copy_stream(self.device, "layers")
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
