"""What a caller of the tiered store holds while a transfer runs (store.py submits them).

Primitives:
    TransferHandle   completion of one submitted transfer: ``done()`` polls without blocking;
                     ``result()`` waits and returns one BlockResult per key, in order;
                     ``started_at`` is when a store worker first took it up, ``finished_at``
                     when the last block completed (time.monotonic(); the transfer's own time
                     between them, without its wait in the store's queue);
                     ``cancel()`` (loads) fences: once it returns, nothing more is written into
                     the caller's buffers; ``ok_prefix()`` counts the leading successes.
    HostRead         read-only views of pinned host blocks from ``TieredStore.acquire_host``;
                     the caller hands it back to ``release_host`` exactly once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentkv.tiers.buffers import ByteArray
from agentkv.tiers.keys import BlockKey
from agentkv.tiers.results import BlockResult


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
        # When a worker first took up the transfer, and when its last block completed: a caller
        # times the transfer itself with them, not the wait in the store's queue before it
        # (behind the step's other transfers) nor the engine step whose poll noticed the end.
        self.started_at: float | None = None
        self.finished_at: float | None = None
        if not self.keys:
            self.started_at = self.finished_at = time.monotonic()
            self._finished.set()

    def _begin(self) -> None:
        """A worker starts on this transfer (the store's runners call it first thing)."""
        if self.started_at is None:  # racing workers both stamp ~now; either stamp is right
            self.started_at = time.monotonic()

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

    def _set_many(self, results: dict[int, BlockResult]) -> None:
        """Set several blocks' results under one lock acquisition (a worker's share)."""
        with self._lock:
            for index, result in results.items():
                if self._results[index] is None:
                    self._remaining -= 1
                self._results[index] = result
            if self._remaining == 0 and not self._finished.is_set():
                self.finished_at = time.monotonic()
                self._finished.set()

    def _set(self, index: int, result: BlockResult) -> None:
        self._set_many({index: result})


@dataclass(frozen=True, slots=True)
class HostRead:
    """Views of pinned host blocks from ``acquire_host``; None where a key was not in host.
    ``addresses``: each view's first byte in the host arena (0 where None), for native batched
    copies (``BlockTable.host_batch``) that would otherwise ask numpy for it per view."""

    views: list[ByteArray | None]
    _blocks: list[Any]
    addresses: list[int]

    @property
    def missing(self) -> list[int]:
        return [i for i, v in enumerate(self.views) if v is None]
