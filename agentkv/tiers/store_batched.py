"""Batched host-tier transfers of KV cache blocks on CPU (a mixin of TieredStore, store.py).

Primitives:
    BatchedTransfers._batch_table
                      the one BlockTable every block of a transfer belongs to when the whole
                      transfer can move as native batch copies (CPU cache, kernel compiled);
                      None: the block-by-block path of store_local.py.
    copy_threads      how many shares a batch is cut into at most (the cores we may run on).
    _store_host_batch / _load_host_batch
                      one worker's share of a transfer: the index updated for all its blocks
                      under one lock, all their bytes moved in one native call between the
                      cache and their host arena slots (streaming stores), results set at once.

Why: a block copied on its own pays two lock round trips, its index entry and result, numpy
address arrays and the kernel's dispatch, and the store's threads queue on the GIL for it; per
worker share most of it is paid once (a store call of 512 blocks of 4 KiB: 5.05 ms block by
block, 1.74 ms in shares, docs/tiers.md). Blocks the batch
cannot serve from host (disk-only, missing) fall back to the per-block load, which also counts
them; the index invariants are the per-block path's (store.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from agentkv.errors import TierError, TierFullError
from agentkv.tiers.batched import BlockRef, BlockTable
from agentkv.tiers.buffers import Segments
from agentkv.tiers.keys import BlockKey
from agentkv.tiers.results import BlockResult, BlockStatus, Tier
from agentkv.tiers.store_index import StoredBlock
from agentkv.tiers.store_local import LocalTransfers
from agentkv.tiers.transfer import TransferHandle

BlockIds = npt.NDArray[np.int64]


def copy_threads() -> int:
    """How many worker shares a batched copy is cut into at most: the cores this process may
    run on. A memory copy gains nothing from more threads than cores, and every share costs a
    thread wake-up and a GIL handoff (the disk tier's I/O waits are why the pool has more)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


class BatchedTransfers(LocalTransfers):
    """Host-tier stores and loads of whole KV cache blocks, one native copy per worker share."""

    @staticmethod
    def _batch_table(segments: Sequence[Segments]) -> tuple[BlockTable, BlockIds] | None:
        """The table every block belongs to and their cache block ids, or None (per block)."""
        first = segments[0] if segments else None
        if not isinstance(first, BlockRef) or not first.on_host:
            return None
        table = first.table
        if not table.copies_natively:
            return None
        ids: list[int] = []
        for s in segments:
            if not isinstance(s, BlockRef) or s.table is not table:
                return None
            ids.append(s.block_id)
        return table, np.array(ids, np.int64)

    def _store_host_batch(
        self, handle: TransferHandle, table: BlockTable, ids: BlockIds, indices: list[int]
    ) -> dict[int, BlockResult]:
        keys = handle.keys
        results: dict[int, BlockResult] = {}
        moving: list[int] = []
        slots: list[int] = []
        full: list[int] = []
        with self._lock:
            for index in indices:
                self._counters["stores"] += 1
                block = self._blocks.get(keys[index])
                if block is not None and block.host_slot is not None:  # content addressed
                    results[index] = BlockResult(keys[index], BlockStatus.OK, Tier.HOST)
                    continue
                slot = self._arena.alloc()
                if slot is None:
                    full.append(index)
                    continue
                moving.append(index)
                slots.append(slot)
        for index in full:
            error = TierFullError("host tier full (eviction is the caller's)")
            results[index] = self._failed(keys[index], error)
        if not moving:
            return results
        try:
            table.copy_blocks(ids[moving], self._arena.addresses(slots), to_host=True)
        except BaseException:
            with self._lock:
                for slot in slots:
                    self._arena.free(slot)
            raise
        with self._lock:
            for index, slot in zip(moving, slots, strict=True):
                block = self._publish(keys[index])
                if block.host_slot is not None:  # a concurrent store of the same key won
                    self._arena.free(slot)
                else:
                    block.host_slot = slot
                    self._host_order.add(block)
                results[index] = BlockResult(keys[index], BlockStatus.OK, Tier.HOST)
        return results

    def _load_host_batch(
        self,
        handle: TransferHandle,
        table: BlockTable,
        ids: BlockIds,
        segments: Sequence[Segments],
        indices: list[int],
    ) -> dict[int, BlockResult]:
        keys = handle.keys
        results: dict[int, BlockResult] = {}
        if not handle._enter():
            return {i: self._failed(keys[i], TierError("load cancelled")) for i in indices}
        try:
            hits, rest = self._pin_host_hits(keys, indices)
            try:
                if hits:
                    slots = [block.host_slot or 0 for _, block in hits]  # pinned: never None
                    moving = ids[[index for index, _ in hits]]
                    table.copy_blocks(moving, self._arena.addresses(slots), to_host=False)
            finally:
                with self._lock:
                    for _, block in hits:
                        self._unpin_host(block)
            with self._lock:
                self._counters["hits_host"] += len(hits)
            for index, _ in hits:
                results[index] = BlockResult(keys[index], BlockStatus.OK, Tier.HOST)
        finally:
            handle._leave()
        for index in rest:  # disk-only or missing: the per-block path reads and counts them
            if not handle._enter():
                results[index] = self._failed(keys[index], TierError("load cancelled"))
                continue
            try:
                results[index] = self._load_one(keys[index], segments[index])
            finally:
                handle._leave()
        return results

    def _pin_host_hits(
        self, keys: Sequence[BlockKey], indices: list[int]
    ) -> tuple[list[tuple[int, StoredBlock]], list[int]]:
        """(index, block) of the keys in host, each pinned and counted as a load; the others'
        indices (not counted: the per-block path does)."""
        hits: list[tuple[int, StoredBlock]] = []
        rest: list[int] = []
        with self._lock:
            for index in indices:
                block = self._blocks.get(keys[index])
                if block is None or block.host_slot is None:
                    rest.append(index)
                    continue
                self._counters["loads"] += 1
                self._host_order.pin(block)
                hits.append((index, block))
        return hits, rest
