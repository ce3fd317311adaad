"""The memcpy baselines a reload is measured against (the trace report's stall table).

Primitives:
  memcpy_seconds(nbytes)    best of 5 numpy copies of one buffer that size: source and
                            destination in cache (the report's second column)
  ColdMemcpy                (nbytes) -> seconds: best of 5 copies of that many bytes block by
                            block between shuffled slots of two pools twice the last-level cache,
                            no slot used twice between sweeps: source and destination in memory,
                            as a reload's are (the target's baseline)
  CopyBaseline              one size's (cold_s, hot_s)
  MemcpyTimer(block_bytes)  (nbytes) -> CopyBaseline, measured once per distinct size
  last_level_cache_bytes()  the largest CPU cache sysfs reports

Why cold is the target's baseline: a reload reads host arena slots written when the context was
paused, long before (other requests' steps, stores and reloads ran since), and writes KV cache
blocks other requests used last; a copy of one buffer five times in a row times the cache, not
memory. On the 2-core dev VM a cold copy of the same 2 MiB took ~1.5x the hot one (docs/tiers.md).
"""

from __future__ import annotations

import glob
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Best of ``repeats`` numpy copies of ``nbytes`` between two touched buffers: the source
    and destination hot in cache (the second column of the report, not the target's)."""
    import numpy as np

    if nbytes <= 0:
        return 0.0
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # fault both in before timing
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


# One cold copy: per block, (source slot, destination slot, bytes).
ColdPlan = list[tuple[int, int, int]]
COLD_POOL_MIN_BYTES = 256 << 20
LLC_FALLBACK_BYTES = 32 << 20


def last_level_cache_bytes() -> int:
    """This machine's largest CPU cache (sysfs), LLC_FALLBACK_BYTES where it does not say."""
    sizes = [LLC_FALLBACK_BYTES]
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = Path(path).read_text().strip().upper()  # e.g. "491520K"
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes)


class ColdMemcpy:
    """``(nbytes) -> seconds``: the best of ``repeats`` copies of ``nbytes`` block by block (the
    last piece short) from shuffled source slots to shuffled destination slots, where no slot is
    used twice until the pools are swept again (``evict``): every copy reads and writes lines no
    earlier copy brought into the cache, as a resume's reload does (arena slots written long
    before, into KV cache blocks the other requests' steps used).

    ``copy(plan)`` moves the bytes of one plan; ``in_memory`` builds the numpy one."""

    def __init__(
        self,
        block_bytes: int,
        *,
        src_slots: int,
        dst_slots: int,
        copy: Callable[[ColdPlan], None],
        evict: Callable[[], None],
        repeats: int = 5,
        clock: Callable[[], float] = time.perf_counter,
        seed: int = 0,
    ) -> None:
        self.block_bytes, self.repeats = block_bytes, repeats
        self.slots = (src_slots, dst_slots)
        self.copy, self.evict, self.clock = copy, evict, clock
        self.rng = random.Random(seed)
        self.free: tuple[list[int], list[int]] = ([], [])
        self.sweeps = 0

    def _deal(self, n: int) -> tuple[list[int], list[int]]:
        """``n`` unused source and destination slots, in shuffled order."""
        if n > min(self.slots):
            raise ValueError(f"{n} blocks do not fit pools of {self.slots} slots")
        if n > min(len(self.free[0]), len(self.free[1])):
            self.evict()  # every slot is out of the cache again
            self.sweeps += 1
            src_slots, dst_slots = self.slots
            self.free = (
                self.rng.sample(range(src_slots), src_slots),
                self.rng.sample(range(dst_slots), dst_slots),
            )
        src, dst = self.free
        out = (src[-n:], dst[-n:])
        del src[-n:], dst[-n:]
        return out

    def plan(self, nbytes: int) -> ColdPlan:
        pieces = [self.block_bytes] * (nbytes // self.block_bytes)
        if nbytes % self.block_bytes:
            pieces.append(nbytes % self.block_bytes)
        src, dst = self._deal(len(pieces))
        return list(zip(src, dst, pieces, strict=True))

    def __call__(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        best = math.inf
        for _ in range(self.repeats):
            plan = self.plan(nbytes)
            t0 = self.clock()
            self.copy(plan)
            best = min(best, self.clock() - t0)
        return best

    @classmethod
    def in_memory(
        cls,
        block_bytes: int,
        llc_bytes: int | None = None,
        min_pool_bytes: int = COLD_POOL_MIN_BYTES,
    ) -> ColdMemcpy:
        """Numpy pools of twice the last-level cache each (at least ``min_pool_bytes``): the
        source written first, then the destination, which pushes it out of the cache; the
        destination's slots are its first part, which its own last LLC's worth pushed out."""
        import numpy as np

        llc = llc_bytes or last_level_cache_bytes()
        pool = max(min_pool_bytes, 2 * llc) // block_bytes * block_bytes
        src = np.empty(pool, dtype=np.uint8)
        dst = np.empty(pool, dtype=np.uint8)

        def evict() -> None:
            src.fill(1)
            dst.fill(0)

        def copy(plan: ColdPlan) -> None:
            for s, d, size in plan:
                so, do = s * block_bytes, d * block_bytes
                np.copyto(dst[do : do + size], src[so : so + size])

        return cls(
            block_bytes,
            src_slots=pool // block_bytes,
            dst_slots=max(1, (pool - llc) // block_bytes),
            copy=copy,
            evict=evict,
        )


@dataclass(frozen=True)
class CopyBaseline:
    """A memcpy of a reload's bytes, two ways: ``cold_s`` (the target's baseline: sources and
    destinations in memory, as a reload's are) and ``hot_s`` (one buffer, in cache)."""

    cold_s: float
    hot_s: float


class MemcpyTimer:
    """Both baselines, measured once per distinct size (rounds share block counts); the cold
    pools are built at the first measurement (``cold``: ColdMemcpy.in_memory by default)."""

    def __init__(
        self,
        block_bytes: int,
        cold: Callable[[int], float] | None = None,
        hot: Callable[[int], float] = memcpy_seconds,
    ) -> None:
        self.block_bytes = block_bytes
        self.cold, self.hot = cold, hot
        self.cache: dict[int, CopyBaseline] = {}

    def __call__(self, nbytes: int) -> CopyBaseline:
        if nbytes <= 0:
            return CopyBaseline(0.0, 0.0)
        if nbytes not in self.cache:
            if self.cold is None:
                self.cold = ColdMemcpy.in_memory(self.block_bytes)
            self.cache[nbytes] = CopyBaseline(self.cold(nbytes), self.hot(nbytes))
        return self.cache[nbytes]
