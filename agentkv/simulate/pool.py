"""One replica's paged KV pool at block-group granularity: prefix sharing, pins, LRU eviction.

Primitives:
  BlockPool                  ``capacity`` blocks: held by running requests, pinned (agentkv's
                             retain), cached-free (evictable, LRU) or empty
  BlockPool.device_hit       blocks of a prompt the pool serves: the longest cached prefix
  BlockPool.admit            allocate a request's blocks (hits reused, the rest taken from empty
                             blocks, evicting least recently freed ones); False when it cannot fit
  BlockPool.release          a finished request frees its blocks: private ones either cached
                             (LRU, most recent) or pinned, the shared prefix when its last user ends
  BlockPool.pin / unpin      hold a trajectory's cached blocks out of eviction, and give them back
  BlockPool.drop             forget a trajectory's cached blocks (deleted, or superseded)

How vLLM behaves and how that is kept here without tracking single blocks: a request's blocks are
freed tail first into the free queue and eviction takes the least recently freed block, so what
survives of a trajectory is always a prefix of its context. A trajectory's private blocks are one
"segment" (a count), and the shared system prefix of each group another; the LRU is an ordered
dict of segments, and evicting n blocks shortens the oldest segments from their tail. Blocks
shared by running requests are reference counted (the prefix group) and never evictable. A block
is cached only when full (``floor(tokens / block)``). Recomputed blocks replace older cached
copies of the same content (the stale copies are dropped, not double counted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

PREFIX = "\x00prefix:"


@dataclass(slots=True)
class Allocation:
    """What ``admit`` did for one request."""

    blocks: int
    """Blocks the request holds while it runs."""
    prefix_blocks: int
    private_hit: int
    prefix_hit: int
    evicted: int
    borrowed: int = 0
    """Private hits on blocks another trajectory holds (a fork's branch on its parent's
    history): used in place, neither taken nor freed by this request."""


class BlockPool:
    """Block accounting of one replica (see the module docstring)."""

    def __init__(
        self, capacity: int, on_evict: Callable[[str, int, int], None] | None = None
    ) -> None:
        if capacity < 1:
            raise ValueError("a pool needs at least one block")
        self.capacity = capacity
        self.active = 0
        """Blocks held by running requests."""
        self.pinned = 0
        self.cached_free = 0
        self.lru: OrderedDict[str, int] = OrderedDict()
        self.private: dict[str, int] = {}
        """Cached private blocks per trajectory (in the LRU, pinned, or held by its request)."""
        self.pins: dict[str, int] = {}
        self.prefix_cached: dict[str, int] = {}
        self.prefix_refs: dict[str, int] = {}
        self.evicted_blocks = 0
        self.filled = 0
        """Blocks ever given new content (taken empty or evicted): the pool's fill count, what
        vLLM's free-queue head advances by (``agentkv.admission.PoolTrend`` reads it)."""
        self.hit = 0
        """Of ``filled``, the cached blocks taken out of the LRU by hits and pins (wherever
        they sat in it: the trend counts them apart)."""
        self.on_evict = on_evict
        self.before_evict: Callable[[int], None] | None = None
        """Called with the number of blocks about to be evicted, before any is."""
        """Called with (trajectory id, blocks left, blocks evicted) when eviction shortens a
        trajectory's private segment."""

    # -- queries ---------------------------------------------------------------------------
    @property
    def empty(self) -> int:
        return self.capacity - self.active - self.pinned - self.cached_free

    @property
    def used(self) -> int:
        """Blocks vLLM would report in use: held by requests or pinned."""
        return self.active + self.pinned

    def usage(self) -> float:
        return self.used / self.capacity

    def device_hit(
        self, tid: str, group: str, prefix_blocks: int, reusable_private: int
    ) -> tuple[int, int]:
        """(prefix blocks hit, private blocks hit): the longest cached prefix of the prompt."""
        pre = min(self.prefix_cached.get(group, 0), prefix_blocks) if prefix_blocks else 0
        if pre < prefix_blocks:
            return pre, 0
        return pre, min(self.private.get(tid, 0), reusable_private)

    # -- internals ---------------------------------------------------------------------------
    def _take_from_lru(self, key: str) -> int:
        n = self.lru.pop(key, 0)
        self.cached_free -= n
        return n

    def _evict(self, need: int) -> int:
        """Free ``need`` blocks from the LRU head (oldest first, each segment from its tail)."""
        if self.before_evict is not None and need > 0 and self.lru:
            self.before_evict(need)
        got = 0
        while got < need and self.lru:
            key, n = next(iter(self.lru.items()))
            take = min(n, need - got)
            got += take
            self.cached_free -= take
            if take == n:
                del self.lru[key]
            else:
                self.lru[key] = n - take
            if key.startswith(PREFIX):
                group = key[len(PREFIX) :]
                self.prefix_cached[group] = self.prefix_cached.get(group, 0) - take
            else:
                left = self.private.get(key, 0) - take
                if left > 0:
                    self.private[key] = left
                else:
                    self.private.pop(key, None)
                if self.on_evict is not None:
                    self.on_evict(key, max(left, 0), take)
        self.evicted_blocks += got
        return got

    # -- operations --------------------------------------------------------------------------
    def admit(
        self,
        tid: str,
        group: str,
        total_blocks: int,
        prefix_blocks: int,
        prefix_hit: int,
        private_hit: int,
        extra_hit: int = 0,
    ) -> Allocation | None:
        """Give a request ``total_blocks`` blocks, reusing the hits; None when they do not fit
        (the pool does not change then). ``extra_hit`` private blocks come from a tier load
        (they need fresh blocks but no compute)."""
        own_lru = self.lru.get(tid, 0)
        pre_in_lru = self.lru.get(PREFIX + group, 0) if prefix_hit else 0
        # Blocks reused in place: hits taken out of the LRU or already held by other requests.
        new_blocks = total_blocks - prefix_hit - private_hit
        # A stale cached copy of this trajectory's blocks beyond the hit is dropped (its content
        # is recomputed or reloaded into fresh blocks), which frees its LRU room.
        available = self.empty + self.cached_free - pre_in_lru - min(own_lru, private_hit)
        if new_blocks > available:
            return None
        # Take the hits out of the LRU: they belong to the request now.
        if own_lru:
            self._take_from_lru(tid)
        if pre_in_lru:
            self._take_from_lru(PREFIX + group)
        self.private.pop(tid, None)
        # Prefix blocks held by other running requests are shared, not counted twice; so are
        # private hits on another trajectory's blocks (a fork's branch: ``borrowed``).
        borrowed = max(0, private_hit - own_lru)
        self.active += private_hit - borrowed + pre_in_lru
        evicted = 0
        if new_blocks > self.empty:
            evicted = self._evict(new_blocks - self.empty)
        self.active += new_blocks
        # The fill as the plugin measures it: the request's new blocks and its hits, which
        # leave the LRU as surely as evicted blocks do (scheduler_side._sample_step).
        self.filled += new_blocks + prefix_hit + private_hit
        self.hit += prefix_hit + private_hit
        if prefix_blocks:
            self.prefix_refs[group] = self.prefix_refs.get(group, 0) + 1
            self.prefix_cached[group] = max(self.prefix_cached.get(group, 0), prefix_blocks)
        return Allocation(
            total_blocks, prefix_blocks, private_hit + extra_hit, prefix_hit, evicted, borrowed
        )

    def release(
        self,
        tid: str,
        group: str,
        alloc: Allocation,
        cached_private: int,
        pin: bool = False,
    ) -> None:
        """A request ended: its ``cached_private`` full, reusable private blocks stay cached
        (pinned when ``pin``), every other block it held becomes empty; the shared prefix goes
        to the LRU when no running request uses it any more."""
        held_private = alloc.blocks - alloc.prefix_blocks - alloc.borrowed
        keep = max(0, min(cached_private - alloc.borrowed, held_private))
        self.active -= held_private
        if keep:
            if pin:
                self.pinned += keep
                self.pins[tid] = keep
            else:
                self.lru[tid] = keep
                self.cached_free += keep
            self.private[tid] = keep
        if alloc.prefix_blocks:
            refs = self.prefix_refs.get(group, 1) - 1
            if refs <= 0:
                self.prefix_refs.pop(group, None)
                cached = self.prefix_cached.get(group, 0)
                self.active -= cached
                if cached:
                    self.lru[PREFIX + group] = cached
                    self.lru.move_to_end(PREFIX + group)
                    self.cached_free += cached
            else:
                self.prefix_refs[group] = refs

    def pin(self, tid: str) -> int:
        """Pin a trajectory's cached private blocks (those still in the LRU); returns them."""
        n = self._take_from_lru(tid)
        if n:
            self.pinned += n
            self.pins[tid] = n
        return n

    def fill_pinned(self, tid: str, n: int, group: str = "", prefix_blocks: int = 0) -> bool:
        """A device prefetch: ``n`` fresh private blocks now hold the trajectory's context,
        pinned (a shorter cached copy is superseded), after its group's ``prefix_blocks``
        shared blocks, which are cached again where evicted (most recent in the LRU). False,
        and nothing changes, when they do not fit in empty and evictable blocks or the
        trajectory is pinned already."""
        key = PREFIX + group
        held = group in self.prefix_refs  # running requests hold the whole prefix
        missing = (
            0 if held or not prefix_blocks else prefix_blocks - self.prefix_cached.get(group, 0)
        )
        missing = max(0, missing)
        own = self.lru.get(tid, 0)
        if n <= 0 or tid in self.pins or n + missing > self.empty + self.cached_free - own:
            return False
        self._take_from_lru(tid)
        if key in self.lru:
            self.lru.move_to_end(key)  # evicted last
        if n + missing > self.empty:
            self._evict(n + missing - self.empty)
        if missing:
            self.lru[key] = self.lru.get(key, 0) + missing
            self.lru.move_to_end(key)
            self.cached_free += missing
            self.prefix_cached[group] = prefix_blocks
        self.filled += n + missing
        self.hit += n
        self.pinned += n
        self.pins[tid] = n
        self.private[tid] = n
        return True

    def unpin(self, tid: str) -> int:
        """Give a trajectory's pinned blocks back to the LRU (most recent end)."""
        n = self.pins.pop(tid, 0)
        if n:
            self.pinned -= n
            self.lru[tid] = n
            self.cached_free += n
        return n

    def take_pinned(self, tid: str) -> int:
        """A pinned trajectory's next request starts: its pin becomes the request's hit (the
        blocks leave the pinned count; ``admit`` holds them)."""
        n = self.pins.pop(tid, 0)
        if n:
            self.pinned -= n
            self.lru[tid] = n
            self.cached_free += n
        return n

    def drop(self, tid: str) -> None:
        """Forget a trajectory's cached blocks (pinned or in the LRU): they become empty."""
        n = self.pins.pop(tid, 0)
        self.pinned -= n
        self.cached_free -= self.lru.pop(tid, 0)
        self.private.pop(tid, None)

    def check(self) -> None:
        """Internal consistency (tests)."""
        assert self.cached_free == sum(self.lru.values()), "LRU total drifted"
        assert self.pinned == sum(self.pins.values()), "pin total drifted"
        assert self.active >= 0 and self.empty >= 0, (self.active, self.empty)
