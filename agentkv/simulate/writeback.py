"""Deferred host write-backs in the simulated replica: the plugin's ``writeback: forecast``.

Primitives:
  Writeback         FORECAST (the plugin's default: an offload_host copy waits until the pool
                    forecasts the blocks' eviction) | EAGER (copy at the pause)
  WritebackMixin    the replica's write-back operations:
    _writeback_init(mode)        the pool's trend (``agentkv.admission.PoolTrend``), the heap
    _observe_pool()              once per engine segment: feed the trend (free blocks, blocks
                                 written since), then copy every deferred trajectory whose
                                 eviction is now due (``_check_writebacks``)
    _eviction_forecast()         what ``policy.decide`` gets as ``eviction_in_s`` at a pause
                                 (0 in EAGER mode: every copy is made at once)
    _defer_writeback(tid, n)     an offload_host decision with ``writeback_deferred``: the
                                 blocks stay in vLLM's cache (the LRU), no copy yet
    _writeback_cancel(tid)       the trajectory's next turn (or its end) came first
  ``writebacks`` counts deferred / copied / lost trajectories and lost_blocks.

The manager's own rule, on the simulated pool (``agentkv.manager.writeback``): a deferred
trajectory's eviction is forecast at the pool's fill count when it was paused plus the free
blocks ahead of it (vLLM's free queue is LRU); its copy is made once the trend says that count
is within ``PolicyParams.writeback_horizon_s`` of writing, or at once when the waiting queue is
short of blocks or pool use is above the policy's high water. A burst that writes faster than
the trend forecast (one large prompt admitted at once) evicts the blocks before the copy: the
leading blocks that survive are copied, the rest are lost (``lost_blocks``; a trajectory with
none left is ``lost``), and the resume recomputes them, as on the real engine. The trend is
observed once per simulated segment (a run of identical steps), where the plugin observes every
step; the waiting queue's need is its head's (the sim admits FCFS, so the head is what blocks).

Kept apart from replica.py like the admission and prefetch mixins; ``Replica`` is its only user.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from enum import StrEnum
from typing import Any

from agentkv.admission import Admission as AdmissionPicture
from agentkv.admission import PoolTrend
from agentkv.policy import PolicyParams


class Writeback(StrEnum):
    """When an offload_host decision's host copy is made (the plugin's ``writeback`` setting;
    plugins/agentkv_vllm/settings.py defines the same two values for the connector)."""

    FORECAST = "forecast"
    """The copy waits, the blocks unpinned in vLLM's cache, until eviction is forecast."""
    EAGER = "eager"
    """Every offload_host decision copies at once (the plugin before issue 26)."""


class WritebackMixin:
    # The replica's (declared for the type checker; Replica sets them).
    env: Any
    pool: Any
    policy: Any
    host: Any
    remote: Any
    waiting: Any
    copy_blocks: dict[str, int]

    def _writeback_init(self, mode: Writeback) -> None:
        self.writeback_mode = Writeback(mode)
        self.writebacks: Counter[str] = Counter()
        self.trend = PoolTrend()
        self._wb_on = self.writeback_mode is Writeback.FORECAST and bool(
            getattr(self.policy, "defers_writeback", False)
        )
        self._wb_token: dict[str, int] = {}
        self._wb_heap: list[tuple[float, int, str]] = []
        self._wb_seq = itertools.count(1)
        self._wb_filled = 0
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
        self.trend.observe(self.env.now, pool.empty + pool.cached_free, float(filled))
        if self._wb_heap:
            self._check_writebacks()

    def _eviction_forecast(self) -> float:
        if not self._wb_on:
            return 0.0
        return self.trend.seconds_to_eviction(self._picture())

    def _defer_writeback(self, tid: str) -> None:
        token = next(self._wb_seq)
        self._wb_token[tid] = token
        pic = self._picture()
        own = self.pool.lru.get(tid, 0)
        ahead = 0
        if self.trend.last is not None:
            ahead = max(0, pic.free_blocks - own - pic.blocks_needed)
        heapq.heappush(self._wb_heap, (self.trend.filled_total + ahead, token, tid))
        self.writebacks["deferred"] += 1

    def _writeback_cancel(self, tid: str) -> None:
        self._wb_token.pop(tid, None)

    def _check_writebacks(self) -> None:
        heap = self._wb_heap
        trend = self.trend
        high_water = self.policy.high_water or 1.0
        everything = self._picture().blocked or self.pool.usage() > high_water
        params: PolicyParams = getattr(self.policy, "params", PolicyParams())
        while heap:
            due, token, tid = heap[0]
            live = self._wb_token.get(tid) == token
            if (
                live
                and not everything
                and trend.seconds_to_write(due - trend.filled_total) > params.writeback_horizon_s
            ):
                break
            heapq.heappop(heap)
            if live:
                self._write_back(tid)

    def _write_back(self, tid: str) -> None:
        """Copy what vLLM still caches of the trajectory (a prefix of its context)."""
        del self._wb_token[tid]
        pool = self.pool
        want = self.copy_blocks.get(tid, 0)
        have = min(want, pool.private.get(tid, 0)) if tid in pool.lru else 0
        if have < want:
            self.writebacks["lost_blocks"] += want - have
        if have == 0:
            self.writebacks["lost"] += 1
            return
        now = self.env.now
        if self.host is not None and self.host.store(tid, have, now) is not None:
            self.writebacks["copied"] += 1
            if self.remote is not None:
                self.remote.store(tid, have, now)
