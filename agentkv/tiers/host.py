"""Host tier memory: a preallocated arena of fixed-size block slots, pinned when CUDA is in use.

Primitives:
    allocate_host        ``size`` bytes of page-aligned, pre-faulted host memory; pinned (page-
                         locked, registered with CUDA) when asked to, or by default when torch is
                         already imported and CUDA is present. Used for the arena and the disk
                         tier's staging buffers, so device copies are true asynchronous DMA.
    HostArena            ``capacity_bytes // block_bytes`` slots allocated once at start (page
                         faults taken up front, so the first store is as fast as the last).
    HostArena.alloc      take a free slot in O(1); returns None when every slot is taken.
    HostArena.free       give a slot back in O(1).
    HostArena.slot       the slot's bytes as a writable uint8 view (no copy).
    HostArena.addresses  the slots' memory addresses (native batched copies, batched.py);
                         ``address(slot)`` one of them as an int.

The arena knows nothing about keys, pins or eviction; the store decides which slot holds what.

Pinning: an anonymous mmap (exactly the bytes asked for) registered with ``cudaHostRegister``
through torch's cudart bindings; when that is unavailable, ``torch.empty(pin_memory=True)``
(torch's pinned allocator may round the size up); when neither works, plain memory and a
warning. Importing agentkv never imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from agentkv.errors import ConfigError
from agentkv.tiers.buffers import ByteArray
from agentkv.tiers.device import loaded_torch

log = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process


def _cuda_present() -> bool:
    torch = loaded_torch()
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken CUDA install reads as "no CUDA"
        return False


def _anonymous_buffer(size: int) -> tuple[ByteArray, mmap.mmap]:
    flags = (
        mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(mmap, "MAP_POPULATE", 0)
    )
    region = mmap.mmap(-1, size, flags=flags)
    array = np.frombuffer(region, dtype=np.uint8)
    array[:: mmap.PAGESIZE] = 0  # MAP_POPULATE is Linux-only; touching each page does the same
    return array, region


def _unregister(cudart: Any, pointer: int) -> None:
    with contextlib.suppress(Exception):  # at interpreter shutdown CUDA may be gone already
        cudart.cudaHostUnregister(pointer)


@dataclass(eq=False)
class HostBuffer:
    """Host memory from ``allocate_host``: ``array`` is the uint8 view, ``pinned`` whether CUDA
    sees it as page-locked. Keep the object alive as long as the memory is used."""

    array: ByteArray
    owner: Any
    pinned: bool


def _registered(size: int) -> HostBuffer | None:
    torch = loaded_torch()
    array, region = _anonymous_buffer(size)
    try:
        cudart = torch.cuda.cudart()
        pointer = int(array.ctypes.data)
        status = cudart.cudaHostRegister(pointer, size, _CUDA_HOST_REGISTER_PORTABLE)
        if int(status) != 0:
            raise RuntimeError(f"cudaHostRegister returned {status}")
    except Exception as exc:
        log.info("cudaHostRegister unavailable (%s); trying torch's pinned allocator", exc)
        return None
    buffer = HostBuffer(array, region, True)
    weakref.finalize(buffer, _unregister, cudart, pointer)
    if size >= 1 << 30:
        log.info("pinned %.1f GiB of host memory for the KV tiers", size / (1 << 30))
    return buffer


def _torch_pinned(size: int) -> HostBuffer | None:
    torch = loaded_torch()
    try:
        tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        tensor.zero_()
    except Exception as exc:  # a broken CUDA setup must not stop the store: plain memory works
        log.warning("pinned host memory unavailable (%s); using plain memory", exc)
        return None
    return HostBuffer(tensor.numpy(), tensor, True)


def allocate_host(size: int, pin_memory: bool | None = None) -> HostBuffer:
    """Allocate ``size`` (>= 1) bytes of page-aligned host memory, faulted in now.

    ``pin_memory=None`` pins only when torch is already imported and CUDA is present; True asks
    for pinning and warns when it is not possible; False never pins. Never raises for pinning.
    """
    size = max(size, 1)
    if pin_memory is not False and _cuda_present():
        pinned = _registered(size) or _torch_pinned(size)
        if pinned is not None:
            return pinned
    elif pin_memory:
        log.warning("pinned host memory requested but torch/CUDA is not loaded; using plain memory")
    array, region = _anonymous_buffer(size)
    return HostBuffer(array, region, False)


class HostArena:
    """Fixed-size slots in one preallocated buffer. Thread-safe; alloc and free are O(1)."""

    def __init__(
        self, capacity_bytes: int, block_bytes: int, *, pin_memory: bool | None = None
    ) -> None:
        """Allocate the arena now. ``pin_memory=None`` pins only when torch+CUDA are already loaded.

        Raises ConfigError when the capacity cannot hold a single block.
        """
        if block_bytes <= 0:
            raise ConfigError("block_bytes must be positive")
        self.block_bytes = block_bytes
        self.num_slots = capacity_bytes // block_bytes
        if self.num_slots < 1 and capacity_bytes > 0:
            raise ConfigError(
                f"host capacity {capacity_bytes} B is smaller than one block ({block_bytes} B)"
            )
        size = max(self.num_slots * block_bytes, 1)
        self._buffer = allocate_host(size, pin_memory if self.num_slots else False)
        self.pinned = self._buffer.pinned
        self._memory = self._buffer.array
        self._base = int(self._memory.ctypes.data)  # fixed: the buffer never moves
        self._slots = self._memory[: self.num_slots * block_bytes].reshape(
            self.num_slots, block_bytes
        )
        # A stack of free slot numbers: pop and append are O(1) and reuse recently warm slots.
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    def alloc(self) -> int | None:
        """Take a free slot; returns None when the arena is full. Must not block."""
        with self._lock:
            return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        """Return ``slot`` to the free list. The caller guarantees nobody still reads or writes it."""
        with self._lock:
            self._free.append(slot)

    def addresses(self, slots: Sequence[int]) -> npt.NDArray[np.int64]:
        """The memory address of each slot's first byte (for native batched copies)."""
        return self._base + np.asarray(slots, np.int64) * self.block_bytes

    def address(self, slot: int) -> int:
        """``addresses`` of one slot, as a Python int (no numpy call)."""
        return self._base + slot * self.block_bytes

    def slot(self, slot: int) -> ByteArray:
        """Return the slot's bytes as a writable view of the arena (no copy)."""
        return self._slots[slot]
