"""Deferred write-backs: CACHED branches, copied to host once the pool forecasts their eviction.

Primitives:
  DeferredWritebacks.track   set_state's bookkeeping: a branch entering or leaving CACHED
  DeferredWritebacks.note    a branch's blocks just joined the tail of vLLM's free queue: the fill
                             count at which they are evicted goes on a heap
  (track, on a resume)       a CACHED branch resumed: its hit takes its blocks off the queue,
                             which moves only the branches behind it; the ones ahead keep their
                             place (the trend's rates still count the hit: see ``_resumed``)
  DeferredWritebacks.check   each tick: queue the write-back of every branch whose eviction is
                             forecast within ``PolicyParams.writeback_horizon_s``, unless its
                             resume is still predicted first (``policy.defer_writeback`` on the
                             wait's p90 left: copies nobody reads are the cost this avoids); all
                             of them when the queue is blocked or pool use is over high water

Why a heap keyed by fill count: vLLM's free queue is LRU, so a branch cached when the pool had
written F blocks, with A free blocks ahead of it, is evicted about when the pool has written F + A.
The next branch to go is the heap's head; a tick looks at the head only (O(copies due)). Entries
of branches that left CACHED (a resume, a delete) go stale (timer token) and are dropped when they
surface, or all at once when stale ones outnumber live ones (bounded memory).
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import TYPE_CHECKING

from agentkv.manager.state import Branch, BranchState, Trajectory
from agentkv.policy import defer_writeback
from agentkv.tier import Tier

if TYPE_CHECKING:
    from agentkv.manager.core import TrajectoryManager


class DeferredWritebacks:
    def __init__(self, mgr: TrajectoryManager) -> None:
        self.m = mgr
        self.cached: dict[tuple[int, str], tuple[Trajectory, Branch]] = {}
        self.heap: list[tuple[float, int, Trajectory, Branch, int]] = []
        self.due: dict[tuple[int, str], float] = {}
        """Each CACHED branch's live due (the heap's entry for it, by reference)."""
        self._seq = itertools.count()

    def track(self, traj: Trajectory, branch: Branch) -> None:
        ref = (id(traj), branch.name)
        if branch.state is BranchState.CACHED and not traj.deleted:
            self.cached[ref] = (traj, branch)
            return
        self.cached.pop(ref, None)
        due = self.due.pop(ref, None)
        if due is not None and branch.state is BranchState.ACTIVE:
            self._resumed(due, self.m.pins.still_cached(branch))

    def _resumed(self, due: float, blocks: int) -> None:
        """The adapter counts the resume's hit (``blocks``) as fill for every branch; the ones
        ahead of it in the free queue (an earlier due) did not move: their due moves up by as
        much. O(heap) per resume of a deferred branch. The rates keep counting the hit (a rate
        per branch position is not known): leaving it out there too ran the forecast late for
        the branches behind, and in the simulator lost half again as many blocks to eviction."""
        if blocks <= 0:
            return
        for i, (d, seq, traj, branch, token) in enumerate(self.heap):
            if d < due:
                self.heap[i] = (d + blocks, seq, traj, branch, token)
        heapq.heapify(self.heap)
        self.due = {r: d + blocks if d < due else d for r, d in self.due.items()}

    def note(self, traj: Trajectory, branch: Branch) -> None:
        trend, adm = self.m.pool_trend, self.m.admission
        ahead = max(0, adm.free_blocks - adm.blocks_needed) if trend.last is not None else 0
        due = trend.filled_total + ahead
        self.due[(id(traj), branch.name)] = due
        entry = (due, next(self._seq), traj, branch, branch.timer_token)
        heapq.heappush(self.heap, entry)
        if len(self.heap) > 2 * len(self.cached) + 64:
            self.heap = [e for e in self.heap if _live(e)]
            heapq.heapify(self.heap)

    def check(self, now: float) -> None:
        if not self.heap:
            return
        m = self.m
        trend = m.pool_trend
        everything = m.admission.blocked or m.pins.pressure() > m.config.high_water
        horizon = m.policy.writeback_horizon_s
        kept: list[tuple[float, int, Trajectory, Branch, int]] = []
        while self.heap:
            entry = self.heap[0]
            live = _live(entry)
            evicted_in = trend.seconds_to_write(entry[0] - trend.filled_total)
            if live and not everything and evicted_in > horizon:
                break
            heapq.heappop(self.heap)
            if not live:
                continue
            if not everything and defer_writeback(_wait_left(entry[3], now), evicted_in, m.policy):
                kept.append(entry)  # due soon, but its resume is predicted sooner still
            else:
                m.pins.queue_writeback((entry[2], entry[3], Tier.HOST))
        for entry in kept:
            heapq.heappush(self.heap, entry)


def _wait_left(branch: Branch, now: float) -> float:
    """The pause's wait p90 minus the time paused so far (NaN without a prediction)."""
    est = branch.estimate
    if est is None or branch.paused_at is None:
        return math.nan
    return branch.paused_at + est.p90 - now


def _live(entry: tuple[float, int, Trajectory, Branch, int]) -> bool:
    _, _, traj, branch, token = entry
    return branch.state is BranchState.CACHED and branch.timer_token == token and not traj.deleted
