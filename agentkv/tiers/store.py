"""The tiered block store: host arena first, disk files second, an optional shared remote tier
(Valkey/Redis, remote.py) third; transfers on a small thread pool.

Primitives:
    TieredStore.submit_store   copy blocks in (to 'host', 'disk' or 'remote'); returns a
                               TransferHandle at once. The caller keeps its buffers unchanged until
                               the handle is done.
    TieredStore.submit_load    copy blocks out (from host, else disk, else remote when the store has
                               one) into the caller's buffers; each result's tier says which.
    TieredStore.acquire_host / release_host
                               two-phase read of host blocks in place: pin them and hand out
                               read-only views (a layer-by-layer load copies pieces of them while
                               the model runs), then unpin. Must be paired.
    TieredStore.promote        disk -> host (prefetch before a tool returns).
    TieredStore.demote         host -> disk (a long pause; frees host slots).
    TieredStore.copy_to_disk   host -> disk, keeping the host copy (its owner frees it by drop).
    TieredStore.copy_to_remote host or disk -> remote, keeping the local copies; blocks already on
                               the server are not resent (their TTL is renewed).
    TieredStore.lookup_remote_prefix
                               how many leading keys the remote tier holds now: network I/O, so it
                               must not run on an engine thread.
    TransferHandle             ``done()`` polls without blocking; ``result()`` waits and returns one
                               BlockResult per key, in order; ``cancel()`` (loads) fences: once
                               it returns, nothing more is written into the caller's buffers.
    BlockResult                ok / miss / error for one block, the tier involved, and the error.
    lookup_prefix, tier_of     residency queries of the local tiers: cheap, never wait on I/O.
    drop (the local tiers, or one tier: 'remote' deletes on the server), stats, close.

The store executes, the caller decides: it never evicts on its own (a full tier fails the block
with TierFullError) and keeps no owners or leases; the one residency index is the manager's
(agentkv/manager/residency.py), which drops what leaves a tier before it writes anew.

Buffers (buffers.py): host buffers and CPU tensors are copied with numpy through zero-copy views;
torch tensors on a CUDA device are copied with torch on a per-thread CUDA stream into / out of the
host arena (pinned memory when CUDA is present) or the disk tier's pinned staging buffers, or
through GPUDirect Storage when available (disk.py, device.py). A transfer is ordered after the
work queued on the caller's current stream when it was submitted.

Invariants:
    - A block in flight is pinned in the tier it is read from, so a drop never frees it mid-copy;
      a block dropped while pinned keeps its slot until the last pin goes.
    - A block becomes visible (lookup_prefix, tier_of, loads) only after all its bytes are in a tier.
    - A load reports ok only for a buffer it fully wrote; a missing file is a miss, a corrupt one an
      error carrying CorruptBlockError (the file is deleted; the caller recomputes).
    - A full tier fails the block with TierFullError in its result; nothing is evicted.
    - Metadata lives under one lock that is never held across a copy or a file read/write.
    - The remote tier is shared (other replicas write it, TTLs expire it), so the store keeps no
      index of it: remote presence is always a live query, and ``drop(keys)`` never deletes
      remote blocks (only ``drop(keys, 'remote')`` does). Remote failures are error results, never exceptions (remote.py).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentkv.errors import ConfigError, CorruptBlockError, TierError, TierFullError
from agentkv.tiers import device
from agentkv.tiers.buffers import (
    BlockBuffer,
    ByteArray,
    Segments,
    as_segments,
    gather_into,
    scatter_from,
)
from agentkv.tiers.disk import BlockFiles
from agentkv.tiers.host import HostArena
from agentkv.tiers.keys import BlockKey
from agentkv.tiers.remote import RemoteBlocks, RemoteStats
from agentkv.tiers.results import BlockResult, BlockStatus, Tier

log = logging.getLogger(__name__)


class TransferHandle:
    """Completion of one submitted transfer; safe to poll from the engine loop."""

    def __init__(self, keys: Sequence[BlockKey]) -> None:
        self.keys = list(keys)
        self._results: list[BlockResult | None] = [None] * len(self.keys)
        self._remaining = len(self.keys)
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._cancelled = False
        self._writers = 0
        self._fence = threading.Condition()
        if not self.keys:
            self._finished.set()

    def cancel(self) -> None:
        """Stop writing into the caller's buffers: blocks not started yet complete as errors, and
        this returns only after blocks being written right now are done. Idempotent."""
        with self._fence:
            self._cancelled = True
            while self._writers:
                self._fence.wait()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def _enter(self) -> bool:
        with self._fence:
            if self._cancelled:
                return False
            self._writers += 1
            return True

    def _leave(self) -> None:
        with self._fence:
            self._writers -= 1
            self._fence.notify_all()

    def done(self) -> bool:
        """Return True when every block has a result. Must not block."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or ``timeout`` seconds pass; returns done()."""
        return self._finished.wait(timeout)

    def result(self, timeout: float | None = None) -> list[BlockResult]:
        """Return one BlockResult per key, in submit order; blocks until done.

        Raises TimeoutError when ``timeout`` passes first.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError("transfer not finished")
        return [result for result in self._results if result is not None]

    def ok_prefix(self) -> int:
        """Return how many leading blocks succeeded (0 while not done). Must not block."""
        if not self.done():
            return 0
        count = 0
        for result in self._results:
            if result is None or not result.ok:
                break
            count += 1
        return count

    def _set(self, index: int, result: BlockResult) -> None:
        with self._lock:
            if self._results[index] is None:
                self._remaining -= 1
            self._results[index] = result
            if self._remaining == 0:
                self._finished.set()


@dataclass(frozen=True, slots=True)
class HostRead:
    """Views of pinned host blocks from ``acquire_host``; None where a key was not in host."""

    views: list[ByteArray | None]
    _blocks: list[Any]

    @property
    def missing(self) -> list[int]:
        return [i for i, v in enumerate(self.views) if v is None]


@dataclass(frozen=True, slots=True)
class TierUsage:
    """Bytes and blocks one tier holds now."""

    used_bytes: int
    capacity_bytes: int
    blocks: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of the store: per-tier use and counters since start."""

    host: TierUsage
    disk: TierUsage | None
    block_bytes: int
    pinned_memory: bool
    direct_io: bool | None
    counters: dict[str, int]
    remote: RemoteStats | None = None
    """The remote client's counters (None without a remote tier)."""


@dataclass(eq=False, slots=True)
class _Block:
    # eq=False: blocks are identity-hashed, so a dropped block still pinned by a reader and a new
    # block stored under the same key never collide in the residents sets.
    key: BlockKey
    host_slot: int | None = None
    on_disk: bool = False
    dropped: bool = False


class _Residents:
    """The blocks one tier holds, and how many transfers read each right now: a pinned block
    keeps its slot until its last reader is done, even when dropped meanwhile. Not thread-safe
    (the store calls it under its lock)."""

    def __init__(self) -> None:
        self._pins: dict[_Block, int] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, block: _Block) -> None:
        self._pins.setdefault(block, 0)

    def remove(self, block: _Block) -> None:
        self._pins.pop(block, None)

    def pin(self, block: _Block) -> None:
        """Raises KeyError when ``block`` is not resident."""
        self._pins[block] += 1

    def unpin(self, block: _Block) -> None:
        """No-op when the block was removed meanwhile."""
        if self._pins.get(block, 0) > 0:
            self._pins[block] -= 1

    def pinned(self, block: _Block) -> bool:
        return self._pins.get(block, 0) > 0


class TieredStore:
    """Host arena + optional disk directory for fixed-size KV blocks (see module docstring)."""

    def __init__(
        self,
        host_capacity_bytes: int,
        disk_dir: str | os.PathLike[str] | None,
        disk_capacity_bytes: int,
        block_bytes: int,
        *,
        workers: int = 4,
        pin_memory: bool | None = None,
        direct_io: bool | None = None,
        gds: bool | None = None,
        remote: RemoteBlocks | None = None,
    ) -> None:
        """Allocate the host arena and, with ``disk_dir``, rebuild the disk index from its files.

        ``remote`` adds the shared remote tier (the caller builds it, owns it and closes it
        after the store; several stores may share one client).

        ``disk_capacity_bytes`` counts whole files (a 4 KiB header plus the payload rounded up to
        4 KiB). ``pin_memory=None`` pins the arena and staging buffers when torch+CUDA are
        loaded; ``gds=None`` moves device blocks to/from disk through GPUDirect Storage when it is
        available (False: always staged through pinned host memory). Raises ConfigError for
        sizes that cannot hold one block.
        """
        if block_bytes <= 0:
            raise ConfigError("block_bytes must be positive")
        if workers < 1:
            raise ConfigError("workers must be at least 1")
        self.block_bytes = block_bytes
        self._lock = threading.Lock()
        self._blocks: dict[BlockKey, _Block] = {}
        self._host_order = _Residents()
        self._disk_order = _Residents()
        self._counters = dict.fromkeys(
            (
                "stores",
                "loads",
                "hits_host",
                "hits_disk",
                "hits_remote",
                "stores_remote",
                "misses",
                "errors",
                "corrupt",
                "demotions",
                "promotions",
                "disk_full",
            ),
            0,
        )
        self._arena = HostArena(host_capacity_bytes, block_bytes, pin_memory=pin_memory)
        self._files: BlockFiles | None = None
        self._disk_capacity = 0
        self._disk_used = 0
        if disk_dir is not None:
            self._files = BlockFiles(
                disk_dir, block_bytes, direct_io=direct_io, pin_memory=pin_memory, gds=gds
            )
            self._disk_capacity = disk_capacity_bytes
            if disk_capacity_bytes < self._files.file_bytes:
                raise ConfigError(
                    f"disk capacity {disk_capacity_bytes} B is smaller than one block file ({self._files.file_bytes} B)"
                )
            self._rebuild_disk_index()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agentkv-tiers")
        self._workers = workers
        self._remote = remote
        self._closed = False

    # ----------------------------------------------------------------- queries (never wait on I/O)

    def lookup_prefix(self, keys: Iterable[BlockKey]) -> int:
        """Return how many leading ``keys`` are fully present in some tier. Must not block on I/O."""
        count = 0
        with self._lock:
            for key in keys:
                block = self._blocks.get(key)
                if block is None or (block.host_slot is None and not block.on_disk):
                    break
                count += 1
        return count

    def tier_of(self, key: BlockKey) -> Tier | None:
        """Return the fastest tier holding ``key``, or None when no tier does."""
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                return None
            if block.host_slot is not None:
                return Tier.HOST
            return Tier.DISK if block.on_disk else None

    def stats(self) -> StoreStats:
        """Return a consistent snapshot of use and counters."""
        with self._lock:
            host_blocks = len(self._host_order)
            disk = (
                TierUsage(self._disk_used, self._disk_capacity, len(self._disk_order))
                if self._files is not None
                else None
            )
            return StoreStats(
                host=TierUsage(
                    host_blocks * self.block_bytes, self._arena.capacity_bytes, host_blocks
                ),
                disk=disk,
                block_bytes=self.block_bytes,
                pinned_memory=self._arena.pinned,
                direct_io=self._files.direct_io if self._files is not None else None,
                counters=dict(self._counters),
                remote=self._remote.stats() if self._remote is not None else None,
            )

    @property
    def remote(self) -> RemoteBlocks | None:
        """The remote tier's client, or None."""
        return self._remote

    def lookup_remote_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Return how many leading ``keys`` the remote tier holds now (0 without one).

        Network I/O (one round trip per 512 keys): must not be called on an engine thread.
        Never raises; an unreachable server answers 0. A live answer, not a promise: a block
        may expire or be deleted before it is loaded (the load then misses).
        """
        if self._remote is None:
            return 0
        return self._remote.lookup_prefix(list(keys))

    # ---------------------------------------------------------------------------------- drop

    def drop(self, keys: Iterable[BlockKey], tier: Tier | None = None) -> int:
        """Remove ``keys`` from ``tier`` (None: host and disk); returns how many
        were present there. A host copy being read keeps its slot until the read ends.

        ``tier='remote'`` deletes the blocks on the shared server, for every replica (network
        I/O: not on an engine thread; never raises; 0 without a remote tier or when it cannot
        answer). None never touches the remote tier.
        """
        if tier == Tier.REMOTE:
            return self._remote.delete_many(list(keys)) if self._remote is not None else 0
        doomed: list[BlockKey] = []
        present = 0
        with self._lock:
            for key in keys:
                block = self._blocks.get(key)
                if block is None:
                    continue
                if tier is None:
                    present += 1
                    if self._forget(block):
                        doomed.append(key)
                elif tier == Tier.HOST and block.host_slot is not None:
                    present += 1
                    if not block.on_disk:
                        if self._forget(block):
                            doomed.append(key)
                    elif not self._host_order.pinned(block):
                        self._release_host(block)
                elif tier == Tier.DISK and block.on_disk:
                    present += 1
                    block.on_disk = False
                    self._disk_order.remove(block)
                    self._release_disk_bytes()
                    doomed.append(key)
                    if block.host_slot is None:
                        self._remove_block(block)
        self._unlink(doomed)
        return present

    # --------------------------------------------------------------------------------- transfers

    def submit_store(
        self,
        keys: Sequence[BlockKey],
        buffers: Sequence[BlockBuffer],
        tier: Tier = Tier.HOST,
    ) -> TransferHandle:
        """Start copying ``buffers`` (one per key; a block may be a list of segments) into ``tier``.

        Returns at once. Raises ValueError right away for mismatched counts or sizes, and
        ConfigError for tier='disk' or 'remote' without that tier. Keys already present in that
        tier are not copied again (content addressed). A full tier fails the block with
        TierFullError (the caller drops what should leave first).
        """
        if tier not in (Tier.HOST, Tier.DISK, Tier.REMOTE):
            raise ConfigError(f"unknown tier {tier!r}")
        if tier == Tier.DISK and self._files is None:
            raise ConfigError("this store has no disk tier")
        if tier == Tier.REMOTE:
            return self._submit_remote_store(keys, buffers)
        if tier == Tier.HOST and self._arena.num_slots == 0:
            if self._files is None:
                raise ConfigError("this store has neither host capacity nor a disk tier")
            tier = Tier.DISK
        segments = self._segments(keys, buffers, writable=False)
        handle = TransferHandle(keys)

        def store_one(index: int) -> BlockResult:
            return self._store_one(keys[index], segments[index], tier)

        self._run(handle, store_one)
        return handle

    def submit_load(
        self, keys: Sequence[BlockKey], out_buffers: Sequence[BlockBuffer]
    ) -> TransferHandle:
        """Start copying ``keys`` into ``out_buffers`` (writable), from host else disk. Returns at once.

        With a remote tier, blocks that are in neither (or whose disk copy is corrupt) are read
        from the server, batched; a block's result then carries tier 'remote' (a remote miss is a
        miss; a local error stays the result when the remote does not have the block either).
        Remote blocks are not copied into the local tiers.
        Raises ValueError right away for mismatched counts, sizes or read-only buffers.
        """
        segments = self._segments(keys, out_buffers, writable=True)
        handle = TransferHandle(keys)
        if self._remote is not None:
            self._run_chunks(handle, lambda indices: self._load_chunk(handle, segments, indices))
            return handle

        def load_one(index: int) -> BlockResult:
            if not handle._enter():
                return self._failed(keys[index], TierError("load cancelled"))
            try:
                return self._load_one(keys[index], segments[index])
            finally:
                handle._leave()

        self._run(handle, load_one)
        return handle

    def acquire_host(self, keys: Sequence[BlockKey]) -> HostRead:
        """Pin each key's host copy and return a read-only view of its bytes (None: not in host).

        The views stay valid, and the blocks unevictable (a drop waits for the pin), until
        ``release_host`` is called on the result, which the caller must do exactly once. Never
        blocks on I/O: a block only on disk is reported missing, not read.
        """
        views: list[ByteArray | None] = []
        blocks: list[Any] = []
        with self._lock:
            for key in keys:
                self._counters["loads"] += 1
                block = self._blocks.get(key)
                if block is None or block.host_slot is None:
                    self._counters["misses"] += 1
                    views.append(None)
                    blocks.append(None)
                    continue
                self._host_order.pin(block)
                view = self._arena.slot(block.host_slot)
                view = view.view()
                view.flags.writeable = False
                views.append(view)
                blocks.append(block)
                self._counters["hits_host"] += 1
        return HostRead(views, blocks)

    def release_host(self, read: HostRead) -> None:
        """Unpin what ``acquire_host`` pinned."""
        with self._lock:
            for block in read._blocks:
                if block is not None:
                    self._unpin_host(block)

    def promote(self, keys: Sequence[BlockKey]) -> TransferHandle:
        """Start copying disk-only ``keys`` into the host tier (blocks already in host are ok)."""
        handle = TransferHandle(keys)
        self._run(handle, lambda index: self._promote_one(keys[index]))
        return handle

    def demote(self, keys: Sequence[BlockKey]) -> TransferHandle:
        """Start moving host ``keys`` to disk and freeing their host slots (disk-only keys are ok)."""
        if self._files is None:
            raise ConfigError("this store has no disk tier")
        handle = TransferHandle(keys)
        self._run(handle, lambda index: self._demote_one(keys[index]))
        return handle

    def copy_to_disk(self, keys: Sequence[BlockKey]) -> TransferHandle:
        """Start writing host ``keys`` to disk, keeping their host copies (already there: ok)."""
        if self._files is None:
            raise ConfigError("this store has no disk tier")
        handle = TransferHandle(keys)
        self._run(handle, lambda index: self._copy_down_one(keys[index]))
        return handle

    def copy_to_remote(self, keys: Sequence[BlockKey]) -> TransferHandle:
        """Start copying local ``keys`` (host, else disk) to the remote tier, keeping the local
        copies. Blocks already on the server are not resent (their TTL is renewed). A key in no
        local tier is an error result. Raises ConfigError without a remote tier."""
        if self._remote is None:
            raise ConfigError("this store has no remote tier")
        handle = TransferHandle(keys)
        self._run_chunks(handle, lambda indices: self._copy_up_chunk(handle, indices))
        return handle

    def close(self) -> None:
        """Wait for transfers in flight, then stop the workers. Idempotent. The remote client is
        the caller's to close."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- internals

    def _segments(
        self, keys: Sequence[BlockKey], buffers: Sequence[BlockBuffer], *, writable: bool
    ) -> list[Segments]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        blocks = [as_segments(buffer, self.block_bytes, writable=writable) for buffer in buffers]
        device.mark_ready(blocks)  # on the caller's thread: copies wait for its queued work
        return blocks

    def _run(self, handle: TransferHandle, one: Callable[[int], BlockResult]) -> None:
        if self._closed:
            raise TierError("the store is closed")
        count = len(handle.keys)
        if count == 0:
            return
        # Contiguous chunks, one per worker: a pool task per block would cost more than a 1 MiB copy.
        chunks = min(count, self._workers)
        bounds = [count * i // chunks for i in range(chunks + 1)]

        def run_chunk(start: int, stop: int) -> None:
            for index in range(start, stop):
                try:
                    result = one(index)
                except TierError as exc:
                    result = self._failed(handle.keys[index], exc)
                except Exception as exc:  # a bug must still complete the handle, never hang it
                    log.exception("tier transfer failed")
                    result = self._failed(handle.keys[index], TierError(f"internal error: {exc!r}"))
                handle._set(index, result)

        for start, stop in itertools.pairwise(bounds):
            self._pool.submit(run_chunk, start, stop)

    def _run_chunks(
        self, handle: TransferHandle, chunk: Callable[[list[int]], dict[int, BlockResult]]
    ) -> None:
        """Like ``_run``, for transfers that batch their blocks (the remote tier): ``chunk`` gets
        a contiguous run of indices and returns their results; a run it leaves out or fails is
        completed with errors, so the handle always finishes."""
        if self._closed:
            raise TierError("the store is closed")
        count = len(handle.keys)
        if count == 0:
            return
        chunks = min(count, self._workers)
        bounds = [count * i // chunks for i in range(chunks + 1)]

        def run(start: int, stop: int) -> None:
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
                result = results.get(index)
                handle._set(index, result or self._failed(handle.keys[index], error))

        for start, stop in itertools.pairwise(bounds):
            self._pool.submit(run, start, stop)

    def _count_remote(self, results: Iterable[BlockResult], stored: bool) -> None:
        with self._lock:
            for result in results:
                if result.ok:
                    self._counters["stores_remote" if stored else "hits_remote"] += 1
                elif result.status is BlockStatus.MISS:
                    self._counters["misses"] += 1
                elif isinstance(result.error, CorruptBlockError):
                    self._counters["corrupt"] += 1
                else:
                    self._counters["errors"] += 1

    def _submit_remote_store(
        self, keys: Sequence[BlockKey], buffers: Sequence[BlockBuffer]
    ) -> TransferHandle:
        remote = self._remote
        if remote is None:
            raise ConfigError("this store has no remote tier")
        segments = self._segments(keys, buffers, writable=False)
        handle = TransferHandle(keys)

        def chunk(indices: list[int]) -> dict[int, BlockResult]:
            with self._lock:
                self._counters["stores"] += len(indices)
            results = remote.put_many([keys[i] for i in indices], [segments[i] for i in indices])
            self._count_remote(results, stored=True)
            return dict(zip(indices, results, strict=True))

        self._run_chunks(handle, chunk)
        return handle

    def _load_chunk(
        self, handle: TransferHandle, segments: Sequence[Segments], indices: list[int]
    ) -> dict[int, BlockResult]:
        """Local loads block by block, then one batched remote read for what they did not find."""
        remote = self._remote
        assert remote is not None
        keys = handle.keys
        results: dict[int, BlockResult] = {}
        fallback: list[tuple[int, BlockResult]] = []
        for index in indices:
            if not handle._enter():
                results[index] = self._failed(keys[index], TierError("load cancelled"))
                continue
            try:
                local = self._load_one(keys[index], segments[index], count_miss=False)
            finally:
                handle._leave()
            if local.ok:
                results[index] = local
            else:
                fallback.append((index, local))
        if not fallback:
            return results
        # A batch at a time: only one batch of fetched payloads is in memory per worker.
        step = self._remote_batch_blocks()
        for first in range(0, len(fallback), step):
            batch = fallback[first : first + step]
            if handle.cancelled:  # no network read for a load nobody waits for
                for index, _ in batch:
                    results[index] = self._failed(keys[index], TierError("load cancelled"))
                continue
            fetched = remote.fetch_many([keys[i] for i, _ in batch], self.block_bytes)
            delivered: list[BlockResult] = []
            for (index, local), value in zip(batch, fetched, strict=True):
                if not handle._enter():
                    results[index] = self._failed(keys[index], TierError("load cancelled"))
                    continue
                try:
                    result = remote.deliver(value, segments[index])
                finally:
                    handle._leave()
                if local.status is BlockStatus.ERROR and not result.ok:
                    results[index] = local  # already counted; the more telling error
                    continue
                delivered.append(result)
                results[index] = result
            self._count_remote(delivered, stored=False)
        return results

    def _remote_batch_blocks(self) -> int:
        assert self._remote is not None
        return max(1, self._remote.config.max_batch_bytes // self.block_bytes)

    def _copy_up_chunk(self, handle: TransferHandle, indices: list[int]) -> dict[int, BlockResult]:
        """Batch by batch: pin (host) or read (disk) each local copy, then one remote write."""
        results: dict[int, BlockResult] = {}
        step = self._remote_batch_blocks()
        for first in range(0, len(indices), step):
            results.update(self._copy_up_batch(handle, indices[first : first + step]))
        return results

    def _copy_up_batch(self, handle: TransferHandle, indices: list[int]) -> dict[int, BlockResult]:
        remote = self._remote
        assert remote is not None
        keys = handle.keys
        results: dict[int, BlockResult] = {}
        pinned: list[_Block] = []
        sources: list[tuple[int, Segments]] = []
        try:
            for index in indices:
                key = keys[index]
                with self._lock:
                    block = self._blocks.get(key)
                    source: Tier | None = None
                    if block is not None and block.host_slot is not None:
                        self._host_order.pin(block)
                        pinned.append(block)
                        source = Tier.HOST
                    elif block is not None and block.on_disk:
                        self._disk_order.pin(block)
                        source = Tier.DISK
                if block is None or source is None:
                    results[index] = self._failed(
                        key, TierError("block is in no local tier; nothing to copy to remote")
                    )
                elif source == Tier.HOST:
                    assert block.host_slot is not None
                    sources.append((index, [self._arena.slot(block.host_slot)]))
                else:
                    # The disk copy is read (and verified) into a scratch buffer first: a corrupt
                    # file must never reach the shared tier.
                    scratch = np.empty(self.block_bytes, np.uint8)
                    read = self._read_disk(block, [scratch], count=False)
                    if read.ok:
                        sources.append((index, [scratch]))
                    else:
                        results[index] = read
            if sources:
                with self._lock:
                    self._counters["stores"] += len(sources)
                written = remote.put_many([keys[i] for i, _ in sources], [s for _, s in sources])
                self._count_remote(written, stored=True)
                results.update(zip((i for i, _ in sources), written, strict=True))
        finally:
            with self._lock:
                for block in pinned:
                    self._unpin_host(block)
        return results

    def _failed(self, key: BlockKey, error: TierError) -> BlockResult:
        with self._lock:
            self._counters["errors"] += 1
        return BlockResult(key, BlockStatus.ERROR, None, error)

    def _publish(self, key: BlockKey) -> _Block:
        block = self._blocks.get(key)
        if block is None:
            block = _Block(key)
            self._blocks[key] = block
        return block

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
        self, block: _Block, segments: Segments, *, count: bool = True, count_miss: bool = True
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

    def _copy_host_to_disk(self, block: _Block) -> bool:
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

    def _release_host(self, block: _Block) -> None:
        """Free ``block``'s host slot (caller holds the lock and checked it is unpinned)."""
        if block.host_slot is not None:
            self._arena.free(block.host_slot)
            block.host_slot = None
        self._host_order.remove(block)
        if not block.on_disk and not block.dropped:
            self._remove_block(block)

    def _unpin_host(self, block: _Block) -> None:
        self._host_order.unpin(block)
        if block.dropped and not self._host_order.pinned(block):
            self._release_host(block)

    def _remove_block(self, block: _Block) -> None:
        if self._blocks.get(block.key) is block:
            del self._blocks[block.key]

    def _forget(self, block: _Block) -> bool:
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
