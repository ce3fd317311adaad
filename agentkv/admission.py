"""The admission picture: what vLLM's scheduler could not admit this step, for lack of blocks.

Primitives:
  Admission            waiting requests the scheduler tried and could not allocate for, the
                       blocks they need, the pool's free blocks (cached-but-unreferenced ones
                       included: vLLM evicts those on demand), requests preempted this step
  Admission.shortfall  blocks the queue lacks now (0: nothing waits on blocks)
  Admission.blocked    the queue is blocked on blocks (a shortfall or a preemption)
  Admission.describe   one line for a decision's rationale
  NO_QUEUE             nothing waits (the default before an adapter reports)

Why counts, not a walk: the adapter builds it each step from what its hooks already see (the
head request the scheduler looked up but never allocated for, ``preempted_req_ids``, the block
pool's free count), so it is O(1) per step whatever the queue's length.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    waiting: int = 0
    """Requests the scheduler could not admit this step (0 when none was left waiting)."""
    blocks_needed: int = 0
    """Device blocks those requests need beyond their prefix-cache hit."""
    free_blocks: int = 0
    """Free blocks in the pool now (evictable cached blocks count as free)."""
    preempted: int = 0
    """Running requests vLLM preempted this step for lack of blocks."""

    @property
    def shortfall(self) -> int:
        """Blocks the waiting queue lacks; a preemption counts as at least one block short."""
        short = max(0, self.blocks_needed - self.free_blocks) if self.waiting > 0 else 0
        return max(short, 1 if self.preempted > 0 else 0)

    @property
    def blocked(self) -> bool:
        return self.shortfall > 0

    def describe(self) -> str:
        text = f"{self.waiting} waiting need {self.blocks_needed} blocks, {self.free_blocks} free"
        if self.preempted:
            text += f", {self.preempted} preempted"
        return text


NO_QUEUE = Admission()
