"""Batched transfers to and from the shared remote tier (a mixin of TieredStore, store.py).

Primitives:
    RemoteTransfers._submit_remote_store   store blocks on the server, one pipeline per batch.
    _load_chunk      local loads block by block, then one batched remote read for the misses
                     (a local error stays the result when the remote misses too).
    _copy_up_chunk   host or disk -> remote, keeping the local copies; a disk copy is verified
                     before it is sent, so a corrupt file never reaches the shared tier.
    _count_remote    the store's counters for remote results.
Remote failures are error results, never exceptions (remote.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from agentkv.errors import ConfigError, CorruptBlockError, TierError
from agentkv.tiers.buffers import BlockBuffer, Segments
from agentkv.tiers.keys import BlockKey
from agentkv.tiers.results import BlockResult, BlockStatus, Tier
from agentkv.tiers.store_batched import BatchedTransfers
from agentkv.tiers.store_index import StoredBlock
from agentkv.tiers.transfer import TransferHandle


class RemoteTransfers(BatchedTransfers):
    """The remote tier's side of the store's transfers (batched: one round trip per batch)."""

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
        pinned: list[StoredBlock] = []
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
