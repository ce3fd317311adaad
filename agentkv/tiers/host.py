"""Host tier memory: a preallocated arena of fixed-size block slots.

Primitives:
    HostArena            ``capacity_bytes // block_bytes`` slots allocated once at start (page
                         faults taken up front, so the first store is as fast as the last).
    HostArena.alloc      take a free slot in O(1); returns None when every slot is taken.
    HostArena.free       give a slot back in O(1).
    HostArena.slot       the slot's bytes as a writable uint8 view (no copy).

The arena knows nothing about keys, pins or eviction; the store decides which slot holds what.
Pinned memory (through torch) is used only when torch is already imported and CUDA is present, so
importing agentkv never imports torch.
"""

from __future__ import annotations

import logging
import mmap
import sys
import threading
from typing import Any

import numpy as np

from agentkv.errors import ConfigError
from agentkv.tiers.buffers import ByteArray

log = logging.getLogger(__name__)


def _pinned_buffer(size: int) -> tuple[ByteArray, Any] | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        tensor.zero_()
    except Exception as exc:  # a broken CUDA setup must not stop the store: plain memory works
        log.warning("pinned host memory unavailable (%s); using plain memory", exc)
        return None
    return tensor.numpy(), tensor


def _anonymous_buffer(size: int) -> tuple[ByteArray, Any]:
    flags = (
        mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(mmap, "MAP_POPULATE", 0)
    )
    region = mmap.mmap(-1, size, flags=flags)
    array = np.frombuffer(region, dtype=np.uint8)
    array[:: mmap.PAGESIZE] = 0  # MAP_POPULATE is Linux-only; touching each page does the same
    return array, region


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
        pinned = _pinned_buffer(size) if pin_memory is not False else None
        if pinned is None and pin_memory:
            log.warning(
                "pinned host memory requested but torch/CUDA is not loaded; using plain memory"
            )
        self.pinned = pinned is not None
        self._memory, self._owner = pinned if pinned is not None else _anonymous_buffer(size)
        self._slots = self._memory[: self.num_slots * block_bytes].reshape(
            self.num_slots, block_bytes
        )
        # A stack of free slot numbers: pop and append are O(1) and reuse recently warm slots.
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """Take a free slot; returns None when the arena is full. Must not block."""
        with self._lock:
            return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        """Return ``slot`` to the free list. The caller guarantees nobody still reads or writes it."""
        with self._lock:
            self._free.append(slot)

    def slot(self, slot: int) -> ByteArray:
        """Return the slot's bytes as a writable view of the arena (no copy)."""
        return self._slots[slot]
