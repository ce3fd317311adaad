"""Pins on the engine's device blocks: the manager's ledger over the BlockPinner port.

Primitives:
  PinOp                 UNPIN | REPIN: engine work queued by a thread that is not the engine's
  PinLedger.pin_now / unpin_now   engine thread only: take or drop one reference per block
  PinLedger.unpin_later           any thread: queue the unpin for the engine thread
  PinLedger.unpin                 now on the engine thread, queued on any other
  PinLedger.queue_repin           any thread: re-pin a branch's blocks (a late retain decision)
  PinLedger.queue_writeback       any thread: a deferred write-back's copy (pins, then stores)
  PinLedger.take_ops              engine thread: apply queued unpins, return queued repins and
                                  write-backs
  PinLedger.still_cached          how many leading blocks of a context the pool still holds
  PinLedger.pressure              pool use minus pinned blocks already on their way out
  PinLedger.held                  block id -> pins held (all reasons); balances to zero

Why a ledger: vLLM's block pool is not thread-safe, so only the engine thread touches it; every
other thread queues. ``held`` mirrors what the pool counts, so tests can check pins balance.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from agentkv.manager.ports import BlockPinner
from agentkv.manager.state import Branch


class PinOp(enum.StrEnum):
    UNPIN = "unpin"  # argument: the block ids
    REPIN = "repin"  # argument: (trajectory, branch)
    WRITEBACK = "writeback"  # argument: (trajectory, branch, tier): a deferred copy, now


class PinLedger:
    def __init__(self, pinner: BlockPinner) -> None:
        self.pinner = pinner
        self.held: Counter[int] = Counter()  # block id -> pins held (all reasons)
        self.ops: list[tuple[PinOp, Any]] = []  # queued by non-engine threads
        self.releasing = 0  # pinned blocks of store jobs in flight (about to be unpinned)
        self.unpins_queued = 0  # pinned blocks whose unpin waits for the engine thread
        self.engine_ident: int | None = None

    def total(self) -> int:
        return sum(self.held.values())

    def pin_now(self, ids: Sequence[int]) -> None:
        if ids:
            self.pinner.pin(ids)
            self.held.update(ids)

    def unpin_now(self, ids: Sequence[int]) -> None:
        if ids:
            # Reverse order: vLLM evicts the tail of a freed run first, keeping the shared head.
            self.pinner.unpin(list(reversed(ids)))
            self.held.subtract(ids)
            for b in ids:
                if self.held[b] <= 0:
                    del self.held[b]

    def unpin_later(self, ids: Sequence[int]) -> None:
        if ids:
            self.ops.append((PinOp.UNPIN, list(ids)))
            self.unpins_queued += len(ids)

    def unpin(self, ids: Sequence[int]) -> None:
        """Now on the engine thread, queued on any other (the pool is not thread-safe)."""
        if threading.get_ident() == self.engine_ident:
            self.unpin_now(ids)
        else:
            self.unpin_later(ids)

    def queue_repin(self, ref: Any) -> None:
        self.ops.append((PinOp.REPIN, ref))

    def queue_writeback(self, ref: Any) -> None:
        """A CACHED branch's deferred copy (pins its still-cached blocks: engine thread)."""
        self.ops.append((PinOp.WRITEBACK, ref))

    def take_ops(self) -> list[tuple[PinOp, Any]]:
        """Engine thread: apply the queued unpins; return the queued repins and write-backs in
        order (the caller checks each branch still wants its pins)."""
        self.engine_ident = threading.get_ident()
        if not self.ops:
            return []
        ops, self.ops = self.ops, []
        repins: list[tuple[PinOp, Any]] = []
        for op, arg in ops:
            if op is PinOp.UNPIN:
                self.unpins_queued -= len(arg)
                self.unpin_now(arg)
            else:
                repins.append((op, arg))
        return repins

    def still_cached(self, branch: Branch) -> int:
        """How many leading blocks of the branch's context the pool still holds."""
        n = 0
        for bid, h in zip(branch.block_ids, branch.hashes, strict=False):
            if not self.pinner.holds(bid, h):
                break
            n += 1
        return n

    def pressure(self) -> float:
        """Pool use, minus the pinned blocks already on their way out (store jobs in flight,
        unpins queued for the engine thread): a demotion is counted once, not again on every
        tick until the engine applies it."""
        total = max(1, self.pinner.total_blocks())
        return max(0.0, self.pinner.usage() - (self.releasing + self.unpins_queued) / total)
