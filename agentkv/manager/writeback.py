"""Deferred write-backs: CACHED branches, copied to host once the pool forecasts their eviction.

Primitives:
  DeferredWritebacks.track   set_state's bookkeeping: a branch entering or leaving CACHED
  DeferredWritebacks.note    a branch's blocks just joined the tail of vLLM's free queue: the fill
                             count at which they are evicted goes on a heap
  (track, placing)           a paused branch's unpinned blocks sit at a known place in the
                             free queue (CACHED, or OFFLOADED / DROPPED since its pins went
                             back): ``placed``, and ``ahead`` sums the placed blocks before a place
  (track, on a resume)       a placed branch resumed: its hit takes its blocks off the queue,
                             which moves only the branches behind it; the ones ahead keep their
                             place, and the hit is kept out of the trend's rates (``take_hits``)
  DeferredWritebacks.take_hits  the placed hits since the last step, for ``PoolTrend.observe``
  DeferredWritebacks.before_reset / after_reset
                             a plain prefix-cache reset (vLLM's own cache only): every CACHED
                             branch's copy is made at once from the blocks the reset unhashed
  DeferredWritebacks.check   each tick: queue the write-back of every branch whose eviction is
                             forecast within ``PolicyParams.writeback_horizon_s``, unless its
                             resume is still predicted first (``policy.defer_writeback`` on the
                             wait's p90 left: copies nobody reads are the cost this avoids); all
                             of them when the queue is blocked or pool use is over high water

Why a heap keyed by fill count: vLLM's free queue is LRU, so a branch cached when the pool had
written F blocks, with A free blocks ahead of it, is evicted about when the pool has written F + A.
The next branch to go is the heap's head; a tick looks at the head only (O(copies due)). Entries
of branches that left CACHED (a resume, a delete) go stale and are dropped when they surface, or
all at once when stale ones outnumber live ones (bounded memory). An entry names its branch by
``(id(trajectory), branch name)`` and a sequence number, never by reference: it is live only while
``cached`` holds the branch and ``_seq`` that number, so a deleted trajectory is held by no entry
(its memory goes at the DELETE, issue 40), and an id reused by a later trajectory matches no
stale entry.

Why a plain reset copies after vLLM's reset, not before: vLLM refuses a reset while any block is
referenced (``BlockPool.reset_prefix_cache``; the route answers ``{"success": false}``), and a
copy needs its blocks pinned until a later step's worker work has read them. But a reset only
drops the pool's hashes: the KV stays in the blocks until vLLM allocates them again, and nothing
allocates between the reset and the hook, which runs on the same engine thread. So the branches'
still-cached counts are read before the reset and, once it succeeded, those blocks are pinned by
id and stored as any deferred write-back (``writebacks_reset_copied``); the next turn loads them
from host. Without the copy the paused context would be lost while its branch still said
``cached``. Blocks already evicted before the reset count in ``writebacks_deferred_lost_blocks``.

Why placed contexts do not count as headroom: a paused context ahead of a deferred one is either
resumed first (its hit takes it out of the queue) or evicted first, so what stands between the
deferred blocks and the head is the other free blocks only; its forecast is those over the rate
of new KV (``PoolTrend``). Counting every resume's hit as fill instead ran the forecast 2-3x early
in an agent workload, where most of what leaves the free queue is resumes hitting their own
contexts: a 128-block replay copied at every pause and read none of it (issue 26).
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import TYPE_CHECKING

from agentkv.admission import FreeQueuePlaces
from agentkv.manager.state import Branch, BranchState, Trajectory
from agentkv.policy import defer_writeback
from agentkv.tier import Tier

if TYPE_CHECKING:
    from agentkv.manager.core import TrajectoryManager

Ref = tuple[int, str]
"""A branch, by ``(id(trajectory), branch name)``."""
Entry = tuple[float, int, Ref]
"""A heap entry: (the fill count at which the branch is evicted, sequence number, branch)."""


class DeferredWritebacks:
    def __init__(self, mgr: TrajectoryManager) -> None:
        self.m = mgr
        self.cached: dict[Ref, tuple[Trajectory, Branch]] = {}
        self.heap: list[Entry] = []
        self.due: dict[Ref, float] = {}
        """Each CACHED branch's live due (the heap's entry for it)."""
        self._seq_of: dict[Ref, int] = {}
        """Each CACHED branch's live heap entry (its sequence number): any other is stale."""
        self.placed: FreeQueuePlaces[Ref] = FreeQueuePlaces()
        """Paused branches whose unpinned blocks sit in vLLM's free queue: CACHED ones (at their
        ``due``) and OFFLOADED or DROPPED ones whose pins went back."""
        self._step_of: object = None
        """The admission picture (one per step) ``_placed_in_step`` counts for."""
        self._placed_in_step = 0
        self._seq = itertools.count()

    def track(self, traj: Trajectory, branch: Branch) -> None:
        ref = (id(traj), branch.name)
        state = branch.state
        if state is BranchState.CACHED and not traj.deleted:
            self.cached[ref] = (traj, branch)
            return
        self.cached.pop(ref, None)
        self._seq_of.pop(ref, None)
        was_cached = self.due.pop(ref, None) is not None
        if traj.deleted:
            self.placed.unplace(ref)
        elif state is BranchState.ACTIVE:
            place = self.placed.unplace(ref)
            if place is not None:
                self._resumed(place, self.m.pins.still_cached(branch))
        elif state in (BranchState.OFFLOADED, BranchState.DROPPED):
            # Its pins just went back to the free queue's tail, or (a host copy moved to disk)
            # its blocks kept the place they had.
            if ref not in self.placed:
                blocks = self.m.pins.still_cached(branch)
                self.placed.place(ref, self._tail(blocks), blocks)
        elif state in (BranchState.HELD, BranchState.RETAINED) or was_cached:
            # Pinned again (a grace, a lease, a deferred copy's store job): its blocks left the
            # queue from where they sat, as a hit takes them, but no step reports it. Unplaced
            # alone, the contexts behind it would count its blocks as headroom again.
            place = self.placed.unplace(ref)
            if place is not None:
                self._taken(place, self.m.pins.still_cached(branch))

    def ahead(self, place: float) -> int:
        """Blocks of the placed branches ahead of ``place`` in the free queue."""
        return self.placed.ahead(place, self.m.pool_trend.filled_total)

    def take_hits(self, hit_blocks: float) -> float:
        """Of a step's hits, the placed branches' resumes' (kept out of the trend's fill)."""
        return self.placed.take_hits(hit_blocks)

    def _taken(self, place: float, blocks: int) -> None:
        """A placed branch's blocks were pinned out of the free queue: the clock advances past
        them here (no step reports a pin), the ones ahead keep their place (``_resumed``)."""
        if blocks > 0:
            self.m.pool_trend.filled_total += blocks
            self._resumed(place, blocks, hit=False)

    def _resumed(self, place: float, blocks: int, hit: bool = True) -> None:
        """The adapter reports the resume's hit (``blocks``) with the step's; it advances the
        clock (``filled_total``) for every branch, but the ones ahead of it in the free queue
        (an earlier place) did not move: their dues move up by as much. O(paused branches) per
        resume of a placed branch."""
        if blocks <= 0:
            return
        self.placed.resumed(place, blocks, hit)
        for i, (d, seq, ref) in enumerate(self.heap):
            if d < place:
                self.heap[i] = (d + blocks, seq, ref)
        heapq.heapify(self.heap)
        self.due = {r: d + blocks if d < place else d for r, d in self.due.items()}

    def _tail(self, blocks: int) -> float:
        """The fill count at which ``blocks`` freed now are evicted: the blocks written so far
        plus the free ones ahead of them that the waiting queue does not take first, and the
        ones placed earlier in this step (the step's free count does not show them yet: two
        pauses in one step are queued one behind the other, not side by side)."""
        trend, adm = self.m.pool_trend, self.m.admission
        if adm is not self._step_of:
            self._step_of, self._placed_in_step = adm, 0
        ahead = max(0, adm.free_blocks - adm.blocks_needed) if trend.last is not None else 0
        at = trend.filled_total + ahead + self._placed_in_step
        self._placed_in_step += blocks
        return at

    def note(self, traj: Trajectory, branch: Branch) -> None:
        blocks = self.m.pins.still_cached(branch)
        due = self._tail(blocks)
        ref = (id(traj), branch.name)
        self.due[ref] = due
        self.placed.place(ref, due, blocks)
        seq = self._seq_of[ref] = next(self._seq)
        heapq.heappush(self.heap, (due, seq, ref))
        if len(self.heap) > 2 * len(self.cached) + 64:
            self.heap = [e for e in self.heap if self.live(e) is not None]
            heapq.heapify(self.heap)

    def live(self, entry: Entry) -> tuple[Trajectory, Branch] | None:
        """The CACHED branch a heap entry is live for, or None (a stale entry)."""
        _, seq, ref = entry
        held = self.cached.get(ref)
        if held is None or self._seq_of.get(ref) != seq:
            return None
        traj, branch = held
        if branch.state is not BranchState.CACHED or traj.deleted:
            return None
        return traj, branch

    def evicted_in(self, due: float) -> float:
        """Seconds until a branch placed at ``due`` is evicted: the free blocks ahead of it that
        are not placed contexts', over the rate of new KV."""
        trend = self.m.pool_trend
        return trend.seconds_to_write(due - trend.filled_total - self.ahead(due))

    def before_reset(self) -> list[tuple[Trajectory, Branch, int]]:
        """Engine thread, just before a plain prefix-cache reset: each CACHED branch and how many
        of its leading blocks the pool still holds (afterwards no block holds a hash)."""
        return [
            (traj, branch, self.m.pins.still_cached(branch))
            for traj, branch in self.cached.values()
            if branch.state is BranchState.CACHED and not traj.deleted
        ]

    def after_reset(self, kept: list[tuple[Trajectory, Branch, int]]) -> tuple[int, int]:
        """Engine thread, right after the reset succeeded and before vLLM allocates anything: the
        deferred copy of each branch ``before_reset`` saw, from the same block ids (their KV is
        still there). Returns (branches copied, blocks copied)."""
        copied = blocks = 0
        for traj, branch, n in kept:
            if traj.deleted or branch.state is not BranchState.CACHED:
                continue  # moved on between the two (a DELETE from the control thread)
            self.m.transitions.write_back(traj, branch, Tier.HOST, cached=n)
            if n > 0:
                copied += 1
                blocks += n
        self.m.counters["writebacks_reset_copied"] += copied
        return copied, blocks

    def check(self, now: float) -> None:
        if not self.heap:
            return
        m = self.m
        everything = m.admission.blocked or m.pins.pressure() > m.config.high_water
        horizon = m.policy.writeback_horizon_s
        kept: list[Entry] = []
        while self.heap:
            entry = self.heap[0]
            live = self.live(entry)
            evicted_in = self.evicted_in(entry[0])
            if live is not None and not everything and evicted_in > horizon:
                break
            heapq.heappop(self.heap)
            if live is None:
                continue
            traj, branch = live
            if not everything and defer_writeback(_wait_left(branch, now), evicted_in, m.policy):
                kept.append(entry)  # due soon, but its resume is predicted sooner still
            else:
                m.pins.queue_writeback((traj, branch, Tier.HOST))
        for entry in kept:
            heapq.heappush(self.heap, entry)


def _wait_left(branch: Branch, now: float) -> float:
    """The pause's wait p90 minus the time paused so far (NaN without a prediction)."""
    est = branch.estimate
    if est is None or branch.paused_at is None:
        return math.nan
    return branch.paused_at + est.p90 - now
