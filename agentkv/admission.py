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
  FreeQueuePlaces      where paused contexts' unpinned blocks sit in the free queue (what
                       ``PoolTrend`` leaves out of the headroom and the fill)

Why counts, not a walk: the adapter builds it each step from what its hooks already see (the
head request the scheduler looked up but never allocated for, ``preempted_req_ids``, the block
pool's free count), so it is O(1) per step whatever the queue's length.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")


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
    hit_blocks: float = 0.0
    """Cached blocks this step's newly scheduled requests hit: vLLM takes them off the free
    queue wherever they sit (its touch). The manager tells its placed paused contexts' hits
    from the rest (``DeferredWritebacks.take_hits``): those do not count as fill."""

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
    fill (blocks taken off the free queue per second whose place in it nobody tracks: new KV
    from its head, prefix-cache hits of requests no paused context placed).

    ``seconds_to_eviction`` forecasts when a block unpinned now is evicted. vLLM's free queue is
    LRU: a freed block joins its tail, every new block is taken from its head, evicting what
    that block cached, and a hit takes its blocks out from wherever they sit. The paused
    contexts the caller placed in the queue (``ahead``) are either resumed first (their hit
    takes them off the queue) or evicted first: either way they never stand between a block and
    its eviction for longer than the rest do, so a block freed now goes once the other free
    blocks ahead of it (less what the waiting requests need, less ``ahead``) have been written
    over: headroom over the fill, not over the net drain (a pool in steady churn keeps its free
    count and still evicts). Placed contexts' hits (``placed_hits``) advance the clock
    (``filled_total``, against which the caller keys each context's place) but not the rates:
    counted as fill, they ran the forecast 2-3x early in an agent workload, where most of what
    leaves the free queue is resumes hitting their own contexts, and copied contexts nobody read
    (issue 26). 0 when the queue is blocked now or no step was seen yet (unknown: assume
    eviction), inf when nothing is being written. The write-back rule (``policy.decide``'s
    ``eviction_in_s``) reads it to tell a copy that will be needed (eviction before the resume)
    from one nobody will read (``writebacks_unread``).
    """

    alpha: float = 0.2
    rate: float = 0.0
    fill: float = 0.0
    filled_total: float = 0.0
    """Blocks taken off the free queue since the start, hits included: a block freed when this
    was F with A free blocks ahead of it is evicted about when it reaches F + A (less the placed
    contexts still ahead of it then)."""
    last: tuple[float, int] | None = None

    def observe(
        self, now: float, free_blocks: int, filled_blocks: float = 0.0, placed_hits: float = 0.0
    ) -> None:
        """One step: the free blocks now, the blocks it took off the free queue whose place is
        not tracked (new KV, other hits) and the placed contexts' hits."""
        written, placed = max(0.0, filled_blocks), max(0.0, placed_hits)
        self.filled_total += written + placed
        if self.last is not None:
            dt = now - self.last[0]
            if dt > 0:
                sample = (self.last[1] - free_blocks - placed) / dt
                self.rate += self.alpha * (sample - self.rate)
                self.fill += self.alpha * (written / dt - self.fill)
        self.last = (now, free_blocks)

    def seconds_to_write(self, blocks: float) -> float:
        """Seconds until ``blocks`` more blocks are written (inf: nothing is being written)."""
        if blocks <= 0:
            return 0.0
        speed = max(self.rate, self.fill)
        return blocks / speed if speed > 0 else float("inf")

    def seconds_to_eviction(self, admission: Admission, ahead: float = 0.0) -> float:
        """When a block freed now is evicted; ``ahead``: placed contexts' blocks in the queue."""
        if admission.blocked or self.last is None:
            return 0.0
        headroom = admission.free_blocks - admission.blocks_needed - max(0.0, ahead)
        if headroom <= 0:
            return 0.0
        return self.seconds_to_write(headroom)


class FreeQueuePlaces(Generic[K]):
    """Paused contexts whose unpinned blocks sit in vLLM's free queue, each at its place: the
    ``PoolTrend.filled_total`` at which it is evicted, with how many blocks it had cached.

    Primitives:
      place(key, at, blocks)   its blocks just joined the queue's tail (``at``: the clock there
                               plus the free blocks ahead of it)
      unplace(key)             pinned again, resumed or gone: its place, or None
      resumed(at, blocks)      a placed context's hit took ``blocks`` out at ``at``: the clock
                               advances for everyone, so the places ahead of it move up by as
                               much (they did not move), and the hit is kept for ``take_hits``
                               (``hit=False``: pinned, not hit; the caller advances the clock)
      ahead(at, clock)         blocks of the placed contexts before ``at`` (not its own)
      take_hits(hit_blocks)    of a step's hits, those of placed contexts' resumes

    ``PoolTrend`` leaves the placed contexts out of the headroom and their hits out of the fill
    (see its docstring). A context the clock has passed (its place plus its blocks) was evicted,
    whatever was hit ahead of it, and drops out (a context paused for hours would otherwise
    stand ahead of every later one). The manager keys branches, the simulator trajectories.
    """

    def __init__(self) -> None:
        self.places: dict[K, tuple[float, int]] = {}
        self._order: tuple[list[float], list[int], float] | None = None
        self._hits = 0

    def __len__(self) -> int:
        return len(self.places)

    def __contains__(self, key: object) -> bool:
        return key in self.places

    def place(self, key: K, at: float, blocks: int) -> None:
        self.places[key] = (at, max(0, blocks))
        self._order = None

    def unplace(self, key: K) -> float | None:
        got = self.places.pop(key, None)
        if got is None:
            return None
        self._order = None
        return got[0]

    def resumed(self, at: float, blocks: int, hit: bool = True) -> None:
        if blocks <= 0:
            return
        if hit:
            self._hits += blocks
        self.places = {
            k: (d + blocks, n) if d < at else (d, n) for k, (d, n) in self.places.items()
        }
        self._order = None

    def ahead(self, at: float, clock: float) -> int:
        """O(log n); a placement, a resume or a placed context's eviction re-sorts, once."""
        if self._order is None or self._order[2] <= clock:
            self._sort(clock)
        assert self._order is not None
        ats, sums, _ = self._order
        i = bisect.bisect_left(ats, at)
        return sums[i - 1] if i > 0 else 0

    def take_hits(self, hit_blocks: float) -> float:
        placed = min(float(self._hits), max(0.0, hit_blocks))
        self._hits = 0
        return placed

    def _sort(self, clock: float) -> None:
        for k in [k for k, (d, n) in self.places.items() if d + n <= clock]:
            del self.places[k]
        entries = sorted(self.places.values())
        sums = list(itertools.accumulate(n for _, n in entries))
        end = min((d + n for d, n in entries), default=math.inf)
        self._order = ([d for d, _ in entries], sums, end)
