"""Block-by-block transfers of the local tiers (host arena, disk files) on the store's thread
pool (a mixin of TieredStore, store.py; the facade's public methods call these).

Primitives:
    LocalTransfers._run / _run_chunks
                      split a handle's blocks into one contiguous chunk per worker (at most a
                      ``limit`` of chunks: memory copies gain nothing past the cores); a failure
                      (TierError or a bug) completes the block as an error, never hangs the handle.
    _store_one / _load_one / _promote_one / _demote_one / _copy_down_one
                      one block into host or disk, out of host else disk, disk -> host,
                      host -> disk (freeing the slot), host -> disk (keeping it).
    _read_disk / _write_disk
                      read a disk-pinned block (verifying it; a corrupt file is deleted and
                      reported) / reserve room and write a file.
    _rebuild_disk_index
                      at start: index the files found, oldest dropped past capacity.
Bytes are copied outside the lock; the index changes under it (store_index.py).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence

from agentkv.errors import CorruptBlockError, TierError, TierFullError
from agentkv.tiers import device
from agentkv.tiers.buffers import BlockBuffer, Segments, as_segments, gather_into, scatter_from
from agentkv.tiers.keys import BlockKey
from agentkv.tiers.results import BlockResult, BlockStatus, Tier
from agentkv.tiers.store_index import BlockIndex, StoredBlock
from agentkv.tiers.transfer import TransferHandle

log = logging.getLogger("agentkv.tiers.store")


class LocalTransfers(BlockIndex):
    """Per-block copies into and out of the host arena and the disk files."""

    def _segments(
        self, keys: Sequence[BlockKey], buffers: Sequence[BlockBuffer], *, writable: bool
    ) -> list[Segments]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        blocks = [as_segments(buffer, self.block_bytes, writable=writable) for buffer in buffers]
        device.mark_ready(blocks)  # on the caller's thread: copies wait for its queued work
        return blocks

    def _chunks(self, handle: TransferHandle, limit: int | None = None) -> list[tuple[int, int]]:
        """Contiguous [start, stop) runs of the handle's blocks, one per worker (at most
        ``limit``): a pool task per block would cost more than a 1 MiB copy. Raises TierError
        once the store is closed."""
        if self._closed:
            raise TierError("the store is closed")
        count = len(handle.keys)
        if count == 0:
            return []
        chunks = min(count, self._workers, limit or count)
        return list(itertools.pairwise(count * i // chunks for i in range(chunks + 1)))

    def _run(self, handle: TransferHandle, one: Callable[[int], BlockResult]) -> None:
        def run_chunk(start: int, stop: int) -> None:
            handle._begin()
            for index in range(start, stop):
                try:
                    result = one(index)
                except TierError as exc:
                    result = self._failed(handle.keys[index], exc)
                except Exception as exc:  # a bug must still complete the handle, never hang it
                    log.exception("tier transfer failed")
                    result = self._failed(handle.keys[index], TierError(f"internal error: {exc!r}"))
                handle._set(index, result)

        for start, stop in self._chunks(handle):
            self._pool.submit(run_chunk, start, stop)

    def _run_chunks(
        self,
        handle: TransferHandle,
        chunk: Callable[[list[int]], dict[int, BlockResult]],
        limit: int | None = None,
    ) -> None:
        """Like ``_run``, for transfers that batch their blocks (the remote tier): ``chunk`` gets
        a contiguous run of indices and returns their results; a run it leaves out or fails is
        completed with errors, so the handle always finishes."""

        def run(start: int, stop: int) -> None:
            handle._begin()
            indices = list(range(start, stop))
            results: dict[int, BlockResult] = {}
            try:
                results = chunk(indices)
            except TierError as exc:
                error: TierError = exc
            except Exception as exc:  # a bug must still complete the handle, never hang it
                log.exception("tier transfer failed")
                error = TierError(f"internal error: {exc!r}")
            else:
                error = TierError("internal error: no result")
            for index in indices:
                if index not in results:
                    results[index] = self._failed(handle.keys[index], error)
            handle._set_many(results)

        for start, stop in self._chunks(handle, limit):
            self._pool.submit(run, start, stop)

    def _store_one(
        self,
        key: BlockKey,
        segments: Segments,
        tier: Tier,
    ) -> BlockResult:
        with self._lock:
            self._counters["stores"] += 1
            block = self._blocks.get(key)
            if block is not None and (
                block.host_slot is not None if tier == Tier.HOST else block.on_disk
            ):
                return BlockResult(key, BlockStatus.OK, tier)
        if tier == Tier.DISK:
            self._write_disk(key, segments)
            with self._lock:
                block = self._publish(key)
                if block.on_disk:  # a concurrent store of the same key won the race
                    self._release_disk_bytes()
                else:
                    block.on_disk = True
                    self._disk_order.add(block)
            return BlockResult(key, BlockStatus.OK, Tier.DISK)
        slot = self._reserve_host_slot()
        gather_into(self._arena.slot(slot), segments)
        with self._lock:
            block = self._publish(key)
            if block.host_slot is not None:
                self._arena.free(slot)
            else:
                block.host_slot = slot
                self._host_order.add(block)
        return BlockResult(key, BlockStatus.OK, Tier.HOST)

    def _load_one(self, key: BlockKey, segments: Segments, count_miss: bool = True) -> BlockResult:
        with self._lock:
            self._counters["loads"] += 1
            block = self._blocks.get(key)
            source: Tier | None = None
            if block is not None and block.host_slot is not None:
                source = Tier.HOST
                self._host_order.pin(block)
            elif block is not None and block.on_disk:
                source = Tier.DISK
                self._disk_order.pin(block)
            if block is None or source is None:
                if count_miss:  # with a remote tier, the remote read decides hit or miss
                    self._counters["misses"] += 1
                return BlockResult(key, BlockStatus.MISS)
        if source == Tier.HOST:
            try:
                scatter_from(self._arena.slot(block.host_slot), segments)  # type: ignore[arg-type]
            finally:
                with self._lock:
                    self._unpin_host(block)
                    self._counters["hits_host"] += 1
            return BlockResult(key, BlockStatus.OK, Tier.HOST)
        return self._read_disk(block, segments, count_miss=count_miss)

    def _read_disk(
        self, block: StoredBlock, segments: Segments, *, count: bool = True, count_miss: bool = True
    ) -> BlockResult:
        """Read a disk-pinned block (unpins it). ``count=False``: not a load (no hit/miss)."""
        assert self._files is not None
        error: TierError | None = None
        found = False
        try:
            found = self._files.read_into(block.key, segments)
        except TierError as exc:
            error = exc
        with self._lock:
            self._disk_order.unpin(block)
            if found:
                if count:
                    self._counters["hits_disk"] += 1
                return BlockResult(block.key, BlockStatus.OK, Tier.DISK)
            # Absent or corrupt: the file is gone (read_into deleted a corrupt one); fix the index.
            if block.on_disk:
                block.on_disk = False
                self._disk_order.remove(block)
                self._release_disk_bytes()
                if block.host_slot is None:
                    self._remove_block(block)
            if error is None:
                if count and count_miss:
                    self._counters["misses"] += 1
                return BlockResult(block.key, BlockStatus.MISS)
            self._counters["corrupt" if isinstance(error, CorruptBlockError) else "errors"] += 1
            return BlockResult(block.key, BlockStatus.ERROR, Tier.DISK, error)

    def _promote_one(self, key: BlockKey) -> BlockResult:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None and block.host_slot is not None:
                return BlockResult(key, BlockStatus.OK, Tier.HOST)
            if block is None or not block.on_disk:
                self._counters["misses"] += 1
                return BlockResult(key, BlockStatus.MISS)
            self._disk_order.pin(block)
        try:
            slot = self._reserve_host_slot()
        except TierError:
            with self._lock:
                self._disk_order.unpin(block)
            raise
        result = self._read_disk(block, [self._arena.slot(slot)])
        with self._lock:
            if not result.ok or block.dropped or block.host_slot is not None:
                self._arena.free(slot)
            else:
                block.host_slot = slot
                self._host_order.add(block)
                self._counters["promotions"] += 1
        return BlockResult(
            key, result.status, Tier.HOST if result.ok else result.tier, result.error
        )

    def _demote_one(self, key: BlockKey) -> BlockResult:
        with self._lock:
            block = self._blocks.get(key)
            if block is None or (block.host_slot is None and not block.on_disk):
                self._counters["misses"] += 1
                return BlockResult(key, BlockStatus.MISS)
            if block.host_slot is None:
                return BlockResult(key, BlockStatus.OK, Tier.DISK)
            self._host_order.pin(block)
        written = False
        try:
            written = self._copy_host_to_disk(block)
        finally:
            with self._lock:
                self._unpin_host(block)
                if written and block.host_slot is not None and not self._host_order.pinned(block):
                    self._release_host(block)
        if not written:
            return BlockResult(key, BlockStatus.MISS)
        return BlockResult(key, BlockStatus.OK, Tier.DISK)

    def _copy_down_one(self, key: BlockKey) -> BlockResult:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None and block.on_disk:
                return BlockResult(key, BlockStatus.OK, Tier.DISK)
            if block is None or block.host_slot is None:
                self._counters["misses"] += 1
                return BlockResult(key, BlockStatus.MISS)
            self._host_order.pin(block)
        try:
            written = self._copy_host_to_disk(block)
        finally:
            with self._lock:
                self._unpin_host(block)
        return BlockResult(key, BlockStatus.OK if written else BlockStatus.MISS, Tier.DISK)

    def _copy_host_to_disk(self, block: StoredBlock) -> bool:
        """Write a pinned host block to disk unless it is there; False when dropped meanwhile."""
        with self._lock:
            if block.on_disk:
                return True
        assert block.host_slot is not None
        self._write_disk(block.key, [self._arena.slot(block.host_slot)])
        with self._lock:
            if block.dropped:
                self._release_disk_bytes()
                dropped = True
            else:
                dropped = False
                if block.on_disk:
                    self._release_disk_bytes()
                else:
                    block.on_disk = True
                    self._disk_order.add(block)
                    self._counters["demotions"] += 1
        if dropped:
            assert self._files is not None
            self._files.remove(block.key)
            return False
        return True

    def _write_disk(self, key: BlockKey, segments: Segments) -> None:
        """Reserve room, then write; releases the reservation when the write fails."""
        assert self._files is not None
        self._reserve_disk_bytes()
        try:
            self._files.write(key, segments)
        except TierError as exc:
            with self._lock:
                self._release_disk_bytes()
                if isinstance(exc, TierFullError):
                    self._counters["disk_full"] += 1
            raise

    def _rebuild_disk_index(self) -> None:
        assert self._files is not None
        infos = self._files.scan()
        # Oldest first: past capacity (a smaller limit than last run), the oldest files go.
        excess = max(0, len(infos) * self._files.file_bytes - self._disk_capacity)
        while excess > 0 and infos:
            stale = infos.pop(0)
            self._files.remove(stale.key)
            excess -= self._files.file_bytes
        for info in infos:
            block = self._publish(info.key)
            block.on_disk = True
            self._disk_order.add(block)
            self._disk_used += self._files.file_bytes
        if infos:
            log.info("disk tier: %d blocks found in %s", len(infos), self._files.directory)
