"""The admission picture: what vLLM's scheduler could not admit this step, for lack of blocks.

Primitives:
  Admission            waiting requests the scheduler tried and could not allocate for, the
                       blocks they need, the pool's free blocks (cached-but-unreferenced ones
                       included: vLLM evicts those on demand), requests preempted this step
  Admission.shortfall  blocks the queue lacks now (0: nothing waits on blocks)
  Admission.blocked    the queue is blocked on blocks (a shortfall or a preemption)
  Admission.describe   one line for a decision's rationale
  NO_QUEUE             nothing waits (the default before an adapter reports)
  PoolTrend            the free-block drain and fill rates over steps; ``seconds_to_eviction``
                       forecasts when vLLM evicts a block freed now (0: the queue is blocked now
                       or nothing is known yet; inf: nothing is being written)

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
    """Blocks those requests take off the free list: new ones beyond their prefix-cache hit,
    plus the hit's cached blocks that sit unreferenced in the free list (vLLM counts both
    against the free blocks when it allocates)."""
    free_blocks: int = 0
    """Free blocks in the pool now (evictable cached blocks count as free)."""
    preempted: int = 0
    """Running requests vLLM preempted this step for lack of blocks."""
    filled_blocks: float = 0.0
    """Blocks of new KV this step writes (its scheduled tokens over the block size): the rate at
    which vLLM takes blocks off its free queue's head, evicting what they cached."""

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


@dataclass
class PoolTrend:
    """The pool's free-block trend, from each step's admission picture: exponentially weighted
    rates of the free list's net drain (blocks per second; negative while it grows) and of the
    fill (blocks of new KV written per second, i.e. taken off the free queue's head).

    ``seconds_to_eviction`` forecasts when a block unpinned now is evicted. vLLM's free queue is
    LRU: a freed block joins its tail and every new block is taken from its head, evicting what
    that block cached, so a block freed now goes once the blocks ahead of it (the free blocks,
    less what the waiting requests need) have been written over. That is headroom over the fill
    rate, not over the net drain: a pool in steady churn keeps its free count and still evicts.
    0 when the queue is blocked now or no step was seen yet (unknown: assume eviction), inf when
    nothing is being written. The write-back rule (``policy.decide``'s ``eviction_in_s``) reads
    it to tell a copy that will be needed (eviction before the resume) from one nobody will read
    (``writebacks_unread``).
    """

    alpha: float = 0.2
    rate: float = 0.0
    fill: float = 0.0
    filled_total: float = 0.0
    """Blocks written since the start: a block freed when this was F is evicted about when it
    reaches F plus the free blocks ahead of it (``blocks_until``)."""
    last: tuple[float, int] | None = None

    def observe(self, now: float, free_blocks: int, filled_blocks: float = 0.0) -> None:
        self.filled_total += max(0.0, filled_blocks)
        if self.last is not None:
            dt = now - self.last[0]
            if dt > 0:
                sample = (self.last[1] - free_blocks) / dt
                self.rate += self.alpha * (sample - self.rate)
                self.fill += self.alpha * (max(0.0, filled_blocks) / dt - self.fill)
        self.last = (now, free_blocks)

    def seconds_to_write(self, blocks: float) -> float:
        """Seconds until ``blocks`` more blocks are written (inf: nothing is being written)."""
        if blocks <= 0:
            return 0.0
        speed = max(self.rate, self.fill)
        return blocks / speed if speed > 0 else float("inf")

    def seconds_to_eviction(self, admission: Admission) -> float:
        if admission.blocked or self.last is None:
            return 0.0
        headroom = admission.free_blocks - admission.blocks_needed
        if headroom <= 0:
            return 0.0
        speed = max(self.rate, self.fill)
        if speed <= 0:
            return float("inf")
        return headroom / speed
