"""The local tiers' block index: which blocks the host arena and the disk directory hold, how
many transfers pin each, and the bytes/slots they use (the base of TieredStore, store.py).

Primitives:
    StoredBlock   one key's local copies: its host slot, whether a disk file holds it, dropped.
    Residents     the blocks one tier holds and their pin counts (a pinned block keeps its slot
                  until its last reader is done, even when dropped meanwhile).
    BlockIndex    the store's shared state (declared here, built by TieredStore.__init__) and the
                  bookkeeping every transfer uses: publish / forget a block, reserve and release a
                  host slot or disk bytes, unpin, count a failure. All of it runs under the
                  store's lock unless a method says otherwise; none of it copies bytes.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from agentkv.errors import TierError, TierFullError
from agentkv.tiers.disk import BlockFiles
from agentkv.tiers.host import HostArena
from agentkv.tiers.keys import BlockKey
from agentkv.tiers.remote import RemoteBlocks
from agentkv.tiers.results import BlockResult, BlockStatus


@dataclass(eq=False, slots=True)
class StoredBlock:
    # eq=False: blocks are identity-hashed, so a dropped block still pinned by a reader and a new
    # block stored under the same key never collide in the residents sets.
    key: BlockKey
    host_slot: int | None = None
    on_disk: bool = False
    dropped: bool = False


class Residents:
    """The blocks one tier holds, and how many transfers read each right now: a pinned block
    keeps its slot until its last reader is done, even when dropped meanwhile. Not thread-safe
    (the store calls it under its lock)."""

    def __init__(self) -> None:
        self._pins: dict[StoredBlock, int] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, block: StoredBlock) -> None:
        self._pins.setdefault(block, 0)

    def remove(self, block: StoredBlock) -> None:
        self._pins.pop(block, None)

    def pin(self, block: StoredBlock) -> None:
        """Raises KeyError when ``block`` is not resident."""
        self._pins[block] += 1

    def unpin(self, block: StoredBlock) -> None:
        """No-op when the block was removed meanwhile."""
        if self._pins.get(block, 0) > 0:
            self._pins[block] -= 1

    def pinned(self, block: StoredBlock) -> bool:
        return self._pins.get(block, 0) > 0


class BlockIndex:
    """The state TieredStore shares with its transfer mixins, and the index bookkeeping."""

    block_bytes: int
    _lock: threading.Lock
    _blocks: dict[BlockKey, StoredBlock]
    _host_order: Residents
    _disk_order: Residents
    _counters: dict[str, int]
    _arena: HostArena
    _files: BlockFiles | None
    _disk_capacity: int
    _disk_used: int
    _pool: ThreadPoolExecutor
    _workers: int
    _remote: RemoteBlocks | None
    _closed: bool

    def _failed(self, key: BlockKey, error: TierError) -> BlockResult:
        with self._lock:
            self._counters["errors"] += 1
        return BlockResult(key, BlockStatus.ERROR, None, error)

    def _publish(self, key: BlockKey) -> StoredBlock:
        block = self._blocks.get(key)
        if block is None:
            block = StoredBlock(key)
            self._blocks[key] = block
        return block

    def _reserve_disk_bytes(self) -> None:
        assert self._files is not None
        with self._lock:
            if self._disk_used + self._files.file_bytes > self._disk_capacity:
                self._counters["disk_full"] += 1
                raise TierFullError("disk tier full (eviction is the caller's)")
            self._disk_used += self._files.file_bytes

    def _release_disk_bytes(self) -> None:
        assert self._files is not None
        self._disk_used -= self._files.file_bytes

    def _reserve_host_slot(self) -> int:
        """A free host slot. Raises TierFullError (eviction is the caller's)."""
        with self._lock:
            slot = self._arena.alloc()
        if slot is None:
            raise TierFullError("host tier full (eviction is the caller's)")
        return slot

    def _release_host(self, block: StoredBlock) -> None:
        """Free ``block``'s host slot (caller holds the lock and checked it is unpinned)."""
        if block.host_slot is not None:
            self._arena.free(block.host_slot)
            block.host_slot = None
        self._host_order.remove(block)
        if not block.on_disk and not block.dropped:
            self._remove_block(block)

    def _unpin_host(self, block: StoredBlock) -> None:
        self._host_order.unpin(block)
        if block.dropped and not self._host_order.pinned(block):
            self._release_host(block)

    def _remove_block(self, block: StoredBlock) -> None:
        if self._blocks.get(block.key) is block:
            del self._blocks[block.key]

    def _forget(self, block: StoredBlock) -> bool:
        """Drop ``block`` from the index (lock held); returns True when its file must be unlinked."""
        self._remove_block(block)
        block.dropped = True
        on_disk = block.on_disk
        if on_disk:
            block.on_disk = False
            self._disk_order.remove(block)
            self._release_disk_bytes()
        if block.host_slot is not None and not self._host_order.pinned(block):
            self._release_host(block)
        return on_disk

    def _unlink(self, keys: list[BlockKey]) -> None:
        if self._files is not None:
            for key in keys:
                self._files.remove(key)
