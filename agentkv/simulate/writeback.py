"""Deferred host write-backs in the simulated replica: the plugin's ``writeback: forecast``.

Primitives:
  Writeback         ``agentkv.policy.Writeback``: FORECAST (the plugin's default: an
                    offload_host copy waits until the pool forecasts the blocks' eviction) |
                    EAGER (copy at the pause)
  WritebackMixin    the replica's write-back operations:
    _writeback_init(mode)        the pool's trend (``agentkv.admission.PoolTrend``), the heap
    _observe_pool()              once per engine segment: feed the trend (free blocks, blocks
                                 written since), then copy every deferred trajectory whose
                                 eviction is now due (``_check_writebacks``)
    _eviction_forecast()         what ``policy.decide`` gets as ``eviction_in_s`` at a pause
                                 (0 in EAGER mode: every copy is made at once)
    _defer_writeback(tid, p90)   an offload_host decision with ``writeback_deferred``: the
                                 blocks stay in vLLM's cache (the LRU), no copy yet; ``p90``:
                                 the pause's wait p90 (its resume is predicted by then)
    _writeback_placed(tid)       its blocks just went back, unpinned, to the LRU's tail (any
                                 pause that does not pin, a demotion, a grace's end): where
                                 they sit, for its resume (the manager's ``placed``)
    _writeback_pinned(tid)       its blocks were pinned again (a retain, a grace): off the LRU
    _writeback_resumed(tid, n)   its next turn was admitted, hitting n of its blocks: the
                                 deferred trajectories ahead of it keep their place (the
                                 manager's rule), whether its own copy was deferred or made
    _writeback_cancel(tid)       the trajectory's next turn was scheduled (or it ended) first:
                                 while that turn waits in the queue the copy can still be due
    _before_evict(need)          the pool is about to evict ``need`` blocks at once: replay the
                                 manager's per-step ticks over the steps vLLM takes to write
                                 them, for each deferred trajectory they reach
  ``writebacks`` counts deferred / copied / lost trajectories and lost_blocks.

The manager's own rule, on the simulated pool (``agentkv.manager.writeback``): a deferred
trajectory's eviction is forecast at the pool's fill count when it was paused plus the free
blocks ahead of it (vLLM's free queue is LRU); its copy is made once the trend says that count
is within ``PolicyParams.writeback_horizon_s`` of writing and its resume is not predicted first
(``policy.defer_writeback`` on the wait's p90 left), or at once when the waiting queue is
short of blocks or pool use is above the policy's high water. A burst that writes faster than
the trend forecast (one large prompt admitted at once) evicts the blocks before the copy: the
leading blocks that survive are copied, the rest are lost (``lost_blocks``; a trajectory with
none left is ``lost``), and the resume recomputes them, as on the real engine. The trend is
observed once per simulated segment (a run of identical steps), where the plugin observes every
step; the waiting queue's need is its head's (the sim admits FCFS, so the head is what blocks).
A simulated admission takes a request's blocks at once where vLLM writes at most one chunk
(``max_batched_tokens`` tokens) per step and the manager ticks between steps, so when an
allocation would evict a deferred trajectory's blocks, the ticks are replayed step by step (a
chunk per step, each step the time of a full chunk) on a copy of the trend: the copy is made
at the first tick that finds the eviction due within the horizon, saving the blocks not yet
overwritten by then; a trajectory the replay does not catch in time is lost.

Kept apart from replica.py like the admission and prefetch mixins; ``Replica`` is its only user.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import replace
from typing import Any

from agentkv.admission import Admission as AdmissionPicture
from agentkv.admission import FreeQueuePlaces, PoolTrend
from agentkv.policy import PolicyParams, Writeback, defer_writeback


class WritebackMixin:
    # The replica's (declared for the type checker; Replica sets them).
    env: Any
    pool: Any
    policy: Any
    host: Any
    remote: Any
    waiting: Any
    costs: Any
    copy_blocks: dict[str, int]
    prefix_of: dict[str, tuple[str, int]]

    def _writeback_init(self, mode: Writeback) -> None:
        self.writeback_mode = Writeback(mode)
        self.writebacks: Counter[str] = Counter()
        self.trend = PoolTrend()
        self._wb_on = self.writeback_mode is Writeback.FORECAST and bool(
            getattr(self.policy, "defers_writeback", False)
        )
        self._wb_token: dict[str, int] = {}
        self._wb_due: dict[str, float] = {}
        self._wb_want: dict[str, int] = {}
        """Each deferred trajectory's private blocks in the LRU when deferred: what its copy
        loses is measured against these (its context's blocks include the shared prefix,
        which is never private: counted, every copy lost it)."""
        self._wb_place: FreeQueuePlaces[str] = FreeQueuePlaces()
        """Where each paused trajectory's unpinned blocks sit in the LRU (its due if deferred)."""
        self._wb_resume_by: dict[str, float] = {}
        """When each deferred trajectory's resume is predicted by (pause + the wait's p90)."""
        if self._wb_on:
            self.pool.before_evict = self._before_evict
        self._wb_heap: list[tuple[float, int, str]] = []
        self._wb_seq = itertools.count(1)
        self._wb_filled = 0
        self._wb_hit = 0
        self.head_need = 0
        """Blocks the head of the waiting queue lacked at the last admission (0: none left)."""

    def _picture(self) -> AdmissionPicture:
        pool = self.pool
        need = self.head_need if self.waiting else 0
        return AdmissionPicture(
            waiting=1 if need else 0,
            blocks_needed=need,
            free_blocks=pool.empty + pool.cached_free,
        )

    def _observe_pool(self) -> None:
        if not self._wb_on:
            return
        pool = self.pool
        filled = pool.filled - self._wb_filled
        self._wb_filled = pool.filled
        placed = self._wb_place.take_hits(float(pool.hit - self._wb_hit))
        self._wb_hit = pool.hit
        self.trend.observe(self.env.now, pool.empty + pool.cached_free, filled - placed, placed)
        if self._wb_heap:
            self._check_writebacks()

    def _eviction_forecast(self) -> float:
        if not self._wb_on:
            return 0.0
        ahead = self._wb_place.ahead(math.inf, self.trend.filled_total)
        return self.trend.seconds_to_eviction(self._picture(), ahead)

    def _tail(self, tid: str) -> float:
        """The fill count at which ``tid``'s blocks, near the LRU's tail, are evicted: the free
        blocks ahead of them. Not behind them: its request's shared prefix was freed after its
        private blocks (vLLM frees a request's blocks tail first), and the manager, whose
        branch pins its whole context until the decision, never counts those."""
        pic = self._picture()
        lru = self.pool.lru
        own = lru.get(tid, 0)
        behind = 0
        if tid in lru:
            for key in reversed(lru):
                if key == tid:
                    break
                behind += lru[key]
        ahead = 0
        if self.trend.last is not None:
            ahead = max(0, pic.free_blocks - own - behind - pic.blocks_needed)
        return self.trend.filled_total + ahead

    def _writeback_placed(self, tid: str) -> None:
        if self._wb_on:
            self._wb_place.place(tid, self._tail(tid), self.pool.lru.get(tid, 0))

    def _writeback_pinned(self, tid: str) -> None:
        """The manager's rule: a placed trajectory pinned again left the LRU from where it sat;
        the clock advances past its blocks, the ones ahead keep their place."""
        place = self._wb_place.unplace(tid)
        blocks = self.pool.lru.get(tid, 0)
        if place is None or blocks <= 0:
            return
        self.trend.filled_total += blocks
        self._wb_place.resumed(place, blocks, hit=False)
        self._keep_ahead(place, blocks)

    def _keep_ahead(self, place: float, blocks: int) -> None:
        """Blocks taken out at ``place`` advanced the clock: the deferred trajectories ahead of
        it did not move, so their dues move up by as much."""
        heap = self._wb_heap
        for i, (d, token, other) in enumerate(heap):
            if d < place:
                heap[i] = (d + blocks, token, other)
        heapq.heapify(heap)
        for other, d in self._wb_due.items():
            if d < place:
                self._wb_due[other] = d + blocks

    def _evicted_in(self, due: float) -> float:
        """The manager's forecast: the free blocks ahead that no placed context holds."""
        trend = self.trend
        ahead = self._wb_place.ahead(due, trend.filled_total)
        return trend.seconds_to_write(due - trend.filled_total - ahead)

    def _defer_writeback(self, tid: str, wait_p90_s: float) -> None:
        token = next(self._wb_seq)
        self._wb_token[tid] = token
        self._wb_resume_by[tid] = self.env.now + wait_p90_s
        due = self._tail(tid)
        self._wb_due[tid] = due
        cached = self.pool.lru.get(tid, 0)
        self._wb_place.place(tid, due, cached)
        self._wb_want[tid] = cached
        heapq.heappush(self._wb_heap, (due, token, tid))
        self.writebacks["deferred"] += 1

    def _writeback_cancel(self, tid: str) -> None:
        self._wb_token.pop(tid, None)
        self._wb_due.pop(tid, None)
        self._wb_want.pop(tid, None)
        self._wb_resume_by.pop(tid, None)
        self._wb_place.unplace(tid)

    def _writeback_resumed(self, tid: str, hit_blocks: int) -> None:
        """The trajectory's next turn was admitted, hitting ``hit_blocks`` of its own blocks: as
        the manager does (``agentkv.manager.writeback``), the deferred trajectories ahead of it
        in the LRU keep their place."""
        place = self._wb_place.unplace(tid)
        self._writeback_cancel(tid)
        if place is None or hit_blocks <= 0:
            return
        self._wb_place.resumed(place, hit_blocks)
        self._keep_ahead(place, hit_blocks)

    def _resume_first(self, tid: str, now: float, evicted_in: float, params: PolicyParams) -> bool:
        """The manager's tick rule: the copy can still wait (the resume is predicted first)."""
        left = self._wb_resume_by.get(tid, math.nan) - now
        return defer_writeback(left, evicted_in, params)

    def _check_writebacks(self) -> None:
        heap = self._wb_heap
        high_water = self.policy.high_water or 1.0
        everything = self._picture().blocked or self.pool.usage() > high_water
        params: PolicyParams = getattr(self.policy, "params", PolicyParams())
        now = self.env.now
        kept: list[tuple[float, int, str]] = []
        while heap:
            due, token, tid = heap[0]
            live = self._wb_token.get(tid) == token
            evicted_in = self._evicted_in(due)
            if live and not everything and evicted_in > params.writeback_horizon_s:
                break
            heapq.heappop(heap)
            if not live:
                continue
            if not everything and self._resume_first(tid, now, evicted_in, params):
                kept.append((due, token, tid))
            else:
                self._write_back(tid)
        for entry in kept:
            heapq.heappush(heap, entry)

    def _write_back(self, tid: str, saved: int | None = None) -> None:
        """Copy what vLLM still caches of the trajectory (a prefix of its context), or its
        first ``saved`` blocks (the rest is being overwritten)."""
        del self._wb_token[tid]
        self._wb_due.pop(tid, None)
        self._wb_resume_by.pop(tid, None)
        pool = self.pool
        want = self.copy_blocks.get(tid, 0)
        have = min(want, pool.private.get(tid, 0)) if tid in pool.lru else 0
        if saved is not None:
            have = min(have, saved)
        cached = min(want, self._wb_want.pop(tid, want))
        if have < cached:
            self.writebacks["lost_blocks"] += cached - have
        if have == 0:
            self.writebacks["lost"] += 1
            return
        # The plugin copies the context's leading blocks vLLM still caches: its shared prefix
        # too, when still cached whole (a tier covers a context from its first block).
        group, prefix = self.prefix_of.get(tid, ("", 0))
        if prefix and pool.prefix_cached.get(group, 0) >= prefix:
            have = min(want, have + prefix)
        now = self.env.now
        if self.host is not None and self.host.store(tid, have, now) is not None:
            self.writebacks["copied"] += 1
            if self.remote is not None:
                self.remote.store(tid, have, now)

    def _before_evict(self, need: int) -> None:
        if not self._wb_token:
            return
        pool = self.pool
        empty = pool.empty
        reached: list[tuple[str, int, int]] = []  # (tid, blocks written before it, its blocks)
        ahead = empty
        for key, n in pool.lru.items():
            if ahead >= empty + need:
                break
            if key in self._wb_token:
                reached.append((key, ahead, n))
            ahead += n
        for tid, start, n in reached:
            self._write_back(tid, self._saved_by_ticks(tid, start, n))

    def _saved_by_ticks(self, tid: str, start: int, n: int) -> int:
        """Blocks of a deferred trajectory (``n``, after ``start`` others in the free queue)
        that the manager's ticks copy before vLLM, a chunk per step, overwrites them."""
        if self._picture().blocked or self.pool.usage() > (self.policy.high_water or 1.0):
            return n  # the manager copies every deferred trajectory at once
        c = self.costs
        per_step = max(1, c.max_batched_tokens // c.block_tokens)
        dt = c.step_s(c.prefill_s(c.max_batched_tokens, 0))
        params: PolicyParams = getattr(self.policy, "params", PolicyParams())
        trend = replace(self.trend)
        due = self._wb_due[tid]
        due -= self._wb_place.ahead(due, trend.filled_total)  # as the manager's forecast
        now = self.env.now
        free = self.pool.empty + self.pool.cached_free
        written = 0
        while written < start + n:
            evicted_in = trend.seconds_to_write(due - trend.filled_total)
            if evicted_in <= params.writeback_horizon_s and not self._resume_first(
                tid, now, evicted_in, params
            ):
                return n - max(0, written - start)
            now += dt
            written += per_step
            trend.observe(now, free - written, float(per_step))
        return 0
