"""The store's device path: copies between torch tensors and host memory, CPU and CUDA alike.

Primitives:
    loaded_torch()         torch when it is already imported, else None (never imports it).
    flat_bytes(tensor)     a contiguous tensor's bytes as a flat uint8 tensor view (no copy);
                           ValueError when the tensor is not contiguous.
    DeviceSegments         one block held in device memory: its segments as flat uint8 tensors,
                           in order, all on one device.
    mark_ready(blocks)     remember where each device's current stream is now (call on the
                           thread that produced the bytes, at submit time): copies of these
                           blocks are ordered after it. A block that already carries a ready
                           event (a staging row gathered on a copy stream) keeps it.
    device_to_host         gather a block's segments into one host buffer; returns once the bytes
                           are there.
    host_to_device         scatter one host buffer into a block's segments; returns once written.
    gather_on_device /     the block as one contiguous device buffer and back (the GPUDirect
    scatter_on_device      Storage path reads and writes files from it).

CUDA: each (thread, device) pair has its own copy stream. A transfer first waits (on the GPU) for
the producer's stream as it was at submit time, then runs ``copy_(..., non_blocking=True)`` on the
copy stream; completion is one CUDA event per transfer, waited on with a blocking-sync event (the
thread sleeps, it does not spin). A block of several segments (one per layer, or per K/V half) is
first gathered on the device into a contiguous staging buffer with one ``torch.cat`` kernel, so it
crosses PCIe as one DMA; loads scatter the staging buffer back with ``torch._foreach_copy_`` (a
few fused kernels). Host buffers should be pinned (the host arena and the disk staging buffers are,
when CUDA is present) for the DMA to be asynchronous; pageable memory still copies correctly.

Any other device (CPU tensors handed over explicitly as DeviceSegments, as tests do) runs the same
functions synchronously with plain tensor copies. Importing this module never imports torch.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

_ByteArray: TypeAlias = npt.NDArray[np.uint8]
Tensor: TypeAlias = Any
"""A torch.Tensor (typed loosely: torch is never imported at module level)."""


def loaded_torch() -> Any:
    """Return the torch module when something already imported it, else None."""
    return sys.modules.get("torch")


def flat_bytes(tensor: Tensor) -> Tensor:
    """Return ``tensor``'s bytes as a 1-D uint8 tensor sharing its memory.

    Raises ValueError when ``tensor`` is not contiguous (a copy would silently lose loads).
    """
    torch = loaded_torch()
    if not tensor.is_contiguous():
        raise ValueError("block buffers must be C-contiguous")
    if tensor.dtype == torch.uint8 and tensor.dim() == 1 and not tensor.requires_grad:
        return tensor  # the common case: BlockViews hands out exactly this
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def host_tensor(array: _ByteArray) -> Tensor:
    """A torch view of a host uint8 array (no copy), writable even when the view was read-only."""
    torch = loaded_torch()
    if not array.flags.writeable:
        # torch warns about read-only arrays; the memory behind our read-only views (the host
        # arena) is writable, and torch only reads it here.
        view = array.view()
        try:
            view.flags.writeable = True
        except ValueError:
            view = array.copy()
        array = view
    return torch.from_numpy(array)


class DeviceSegments:
    """One block's segments on one device, as flat uint8 tensors in block order."""

    __slots__ = ("device", "nbytes", "ready", "tensors")

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        """Raises ValueError for an empty list, non-contiguous tensors or mixed devices."""
        if not tensors:
            raise ValueError("a block needs at least one segment")
        self.tensors = [flat_bytes(t) for t in tensors]
        devices = {t.device for t in self.tensors}
        if len(devices) != 1:
            raise ValueError(
                f"a block's segments must share one device, got {sorted(map(str, devices))}"
            )
        self.device = self.tensors[0].device
        self.nbytes = sum(int(t.numel()) for t in self.tensors)
        self.ready: Any = None  # a CUDA event on the producer's stream (mark_ready)

    @property
    def is_cuda(self) -> bool:
        return bool(self.device.type == "cuda")

    def sizes(self) -> list[int]:
        return [int(t.numel()) for t in self.tensors]


def mark_ready(blocks: Iterable[object]) -> None:
    """Record one event per CUDA device on its current stream and attach it to each device block.

    Call it where the blocks were handed over (the engine thread, at submit): the copy streams
    wait for it, so a copy never reads KV bytes a kernel is still writing, nor writes blocks a
    kernel still reads.
    """
    torch = loaded_torch()
    if torch is None:
        return
    events: dict[Any, Any] = {}
    for block in blocks:
        if isinstance(block, DeviceSegments) and block.is_cuda and block.ready is None:
            event = events.get(block.device)
            if event is None:
                event = torch.cuda.current_stream(block.device).record_event()
                events[block.device] = event
            block.ready = event


class _Lane:
    """A copy stream and a device staging buffer for one (thread, device) pair."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._staging: Tensor | None = None

    def staging(self, nbytes: int) -> Tensor:
        """A device uint8 buffer of at least ``nbytes``, reused by every transfer of this lane."""
        if self._staging is None or self._staging.numel() < nbytes:
            with self.torch.cuda.stream(self.stream):
                self._staging = self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)
        return self._staging[:nbytes]

    def done_event(self) -> Any:
        event = self.torch.cuda.Event(blocking=True)
        event.record(self.stream)
        return event


_lanes = threading.local()


def _lane(device: Any) -> _Lane:
    lanes: dict[Any, _Lane] | None = getattr(_lanes, "by_device", None)
    if lanes is None:
        lanes = {}
        _lanes.by_device = lanes
    lane = lanes.get(device)
    if lane is None:
        lane = _Lane(loaded_torch(), device)
        lanes[device] = lane
    return lane


def _scatter(torch: Any, source: Tensor, segments: DeviceSegments) -> None:
    """Copy contiguous ``source`` into the segments in order (same device, current stream)."""
    pieces = list(source.split(segments.sizes()))
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None and len(segments.tensors) > 1:
        foreach(segments.tensors, pieces)
        return
    for destination, piece in zip(segments.tensors, pieces, strict=True):
        destination.copy_(piece)


def device_to_host(destination: _ByteArray, segments: DeviceSegments) -> None:
    """Copy the block's segments back to back into ``destination`` (host, writable, >= nbytes).

    Returns once every byte is in ``destination``.
    """
    torch = loaded_torch()
    host = host_tensor(destination[: segments.nbytes])
    if not segments.is_cuda:
        offset = 0
        for tensor in segments.tensors:
            host[offset : offset + tensor.numel()].copy_(tensor)
            offset += tensor.numel()
        return
    lane = _lane(segments.device)
    with torch.cuda.stream(lane.stream):
        source = _gather_on_lane(torch, lane, segments)
        host.copy_(source, non_blocking=True)
        done = lane.done_event()
    done.synchronize()


def _gather_on_lane(torch: Any, lane: Any, segments: DeviceSegments) -> Tensor:
    """On ``lane``'s stream (the caller entered it): wait for the block's producer, then the block
    as one contiguous tensor (its only segment, or the lane's staging buffer)."""
    if segments.ready is not None:
        lane.stream.wait_event(segments.ready)
    if len(segments.tensors) == 1:
        return segments.tensors[0]
    source = lane.staging(segments.nbytes)
    torch.cat(segments.tensors, out=source)
    return source


def host_to_device(source: _ByteArray, segments: DeviceSegments) -> None:
    """Copy ``source`` (host, >= nbytes) into the block's segments in order.

    Returns once every segment is written.
    """
    torch = loaded_torch()
    host = host_tensor(source[: segments.nbytes])
    if not segments.is_cuda:
        offset = 0
        for tensor in segments.tensors:
            tensor.copy_(host[offset : offset + tensor.numel()])
            offset += tensor.numel()
        return
    lane = _lane(segments.device)
    with torch.cuda.stream(lane.stream):
        if segments.ready is not None:
            lane.stream.wait_event(segments.ready)
        if len(segments.tensors) == 1:
            segments.tensors[0].copy_(host, non_blocking=True)
        else:
            staging = lane.staging(segments.nbytes)
            staging.copy_(host, non_blocking=True)
            _scatter(torch, staging, segments)
        done = lane.done_event()
    done.synchronize()


def gather_on_device(segments: DeviceSegments) -> Tensor:
    """Return the block as one contiguous uint8 tensor on its device, complete when returned.

    A single-segment block is returned as is; otherwise this thread's staging buffer (valid until
    this thread's next transfer).
    """
    torch = loaded_torch()
    if len(segments.tensors) == 1 and segments.ready is None:
        return segments.tensors[0]
    if not segments.is_cuda:
        return torch.cat(segments.tensors)
    lane = _lane(segments.device)
    with torch.cuda.stream(lane.stream):
        source = _gather_on_lane(torch, lane, segments)
        done = lane.done_event()
    done.synchronize()
    return source


def device_buffer(segments: DeviceSegments) -> Tensor:
    """A contiguous device buffer of the block's size to read a payload into (this thread's
    staging buffer on CUDA), never one of the block's own segments."""
    torch = loaded_torch()
    if not segments.is_cuda:
        return torch.empty(segments.nbytes, dtype=torch.uint8, device=segments.device)
    return _lane(segments.device).staging(segments.nbytes)


def scatter_on_device(source: Tensor, segments: DeviceSegments) -> None:
    """Copy the contiguous device buffer ``source`` into the block's segments; returns when done."""
    torch = loaded_torch()
    if not segments.is_cuda:
        _scatter(torch, source, segments)
        return
    lane = _lane(segments.device)
    with torch.cuda.stream(lane.stream):
        if segments.ready is not None:
            lane.stream.wait_event(segments.ready)
        _scatter(torch, source, segments)
        done = lane.done_event()
    done.synchronize()


def copy_device_buffer_to_host(destination: _ByteArray, source: Tensor) -> None:
    """Copy a contiguous device buffer to host memory; returns when the bytes are there."""
    torch = loaded_torch()
    host = host_tensor(destination[: source.numel()])
    if source.device.type != "cuda":
        host.copy_(source)
        return
    lane = _lane(source.device)
    with torch.cuda.stream(lane.stream):
        host.copy_(source, non_blocking=True)
        done = lane.done_event()
    done.synchronize()
