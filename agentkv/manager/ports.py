"""The manager's view of the engine: small ports an adapter implements.

Primitives:
  BlockPinner   the engine's device block pool: pin/unpin by reference count, whether a block
                still holds given content, pool use. Called only from the engine thread.
  Clock         monotonic seconds
  MonotonicClock  the real one

The job sink is the manager's own outbox (``TrajectoryManager.take_step``): the adapter ships it
to the workers each engine step and feeds their reports back (``on_report``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol


class BlockPinner(Protocol):
    def pin(self, block_ids: Sequence[int]) -> None:
        """Take one reference on each block: vLLM will not evict or reuse it while referenced."""

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Drop one reference each; at zero the block returns to vLLM's prefix cache (still
        reusable by hash until vLLM needs the memory)."""

    def holds(self, block_id: int, block_hash: bytes) -> bool:
        """Whether ``block_id`` still holds the content named by ``block_hash`` (not evicted and
        reused since). Must not block."""

    def usage(self) -> float:
        """Fraction of the pool in use (referenced blocks), 0..1."""

    def total_blocks(self) -> int:
        """Usable blocks in the pool."""


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()
