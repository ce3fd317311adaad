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
    prune_disk(keep)           after a restart, once: the disk tier keeps only ``keep`` (the
                               manager's restored plan, jobs.KeepPlan) and deletes every other
                               file of its folder.

Where the parts live: this module is the facade (the public methods above, StoreStats,
TierUsage); transfer.py holds TransferHandle and HostRead; store_index.py the block index and its
bookkeeping; store_local.py the per-block host/disk transfers on the thread pool;
store_batched.py the host-tier transfers of whole CPU KV cache blocks (BlockRefs of one table),
one native copy per worker share; store_remote.py the batched remote transfers. TieredStore
inherits the four as one chain of mixins sharing the state store_index.BlockIndex declares.

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

import os
import threading
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from agentkv.errors import ConfigError, TierError
from agentkv.tiers.buffers import BlockBuffer, ByteArray
from agentkv.tiers.disk import BlockFiles
from agentkv.tiers.host import HostArena
from agentkv.tiers.keys import BlockKey
from agentkv.tiers.remote import RemoteBlocks, RemoteStats
from agentkv.tiers.results import BlockResult, BlockStatus, Tier
from agentkv.tiers.store_batched import copy_threads
from agentkv.tiers.store_index import Residents, StoredBlock
from agentkv.tiers.store_remote import RemoteTransfers
from agentkv.tiers.transfer import HostRead, TransferHandle

__all__ = [
    "BlockResult",
    "BlockStatus",
    "HostRead",
    "StoreStats",
    "Tier",
    "TierUsage",
    "TieredStore",
    "TransferHandle",
]


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


class TieredStore(RemoteTransfers):
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
        self._blocks: dict[BlockKey, StoredBlock] = {}
        self._host_order = Residents()
        self._disk_order = Residents()
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

    def prune_disk(self, keep: Collection[BlockKey]) -> tuple[int, int]:
        """An engine's restart, before the first job touches the disk tier: keep the disk blocks
        in ``keep`` and delete the rest (indexed blocks of other keys or identities, and files
        the index never took: temp leftovers, broken headers, other block sizes); returns
        (kept, removed). What the disk holds is then what the manager believes it holds."""
        if self._files is None:
            return 0, 0
        with self._lock:
            gone = [b.key for b in self._blocks.values() if b.on_disk and b.key not in keep]
        self.drop(gone, tier=Tier.DISK)
        kept, removed = self._files.prune(lambda info: info.key in keep)
        return kept, removed + len(gone)

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
        batch = self._batch_table(segments) if tier == Tier.HOST else None
        if batch is not None:
            table, ids = batch
            self._run_chunks(
                handle,
                lambda chunk: self._store_host_batch(handle, table, ids, chunk),
                copy_threads(),
            )
            return handle

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
        batch = self._batch_table(segments)
        if batch is not None:
            table, ids = batch
            self._run_chunks(
                handle,
                lambda chunk: self._load_host_batch(handle, table, ids, segments, chunk),
                copy_threads(),
            )
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
        addresses: list[int] = []
        arena = self._arena
        with self._lock:
            for key in keys:
                self._counters["loads"] += 1
                block = self._blocks.get(key)
                if block is None or block.host_slot is None:
                    self._counters["misses"] += 1
                    views.append(None)
                    blocks.append(None)
                    addresses.append(0)
                    continue
                self._host_order.pin(block)
                view = arena.slot(block.host_slot).view()
                view.flags.writeable = False
                views.append(view)
                blocks.append(block)
                addresses.append(arena.address(block.host_slot))
                self._counters["hits_host"] += 1
        return HostRead(views, blocks, addresses)

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
