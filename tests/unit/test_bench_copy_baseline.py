"""The trace report's memcpy baselines (agentkv_bench.copy_baseline): the cold copy's contract
(block pieces, shuffled slots never reused until the pools are swept, best of the repeats), with
the copy and the clock injected; then the numpy pools on a small scale."""

from __future__ import annotations

import itertools

import pytest

from agentkv_bench.copy_baseline import (
    LLC_FALLBACK_BYTES,
    ColdMemcpy,
    ColdPlan,
    last_level_cache_bytes,
)

BLOCK = 1000


class _Rig:
    """A ColdMemcpy whose copies are recorded and whose clock advances by the given spans."""

    def __init__(self, spans: list[float], src_slots: int = 40, dst_slots: int = 30) -> None:
        self.plans: list[ColdPlan] = []
        self.evictions = 0
        ticks = itertools.accumulate(x for span in spans for x in (0.0, span))
        self.cold = ColdMemcpy(
            BLOCK,
            src_slots=src_slots,
            dst_slots=dst_slots,
            copy=self.plans.append,
            evict=self._evict,
            clock=lambda: next(ticks),
        )

    def _evict(self) -> None:
        self.evictions += 1


def test_a_cold_copy_is_the_best_of_its_repeats_block_by_block() -> None:
    rig = _Rig([5.0, 3.0, 4.0, 9.0, 6.0])
    assert rig.cold(2500) == 3.0  # the best of the 5 repeats
    assert len(rig.plans) == 5
    for plan in rig.plans:  # 2 whole blocks and the rest: 2500 bytes in each repeat
        assert [size for _, _, size in plan] == [BLOCK, BLOCK, 500]
    assert rig.cold(0) == 0.0 and len(rig.plans) == 5  # nothing copied for nothing


def test_no_slot_is_read_or_written_twice_until_the_pools_are_swept() -> None:
    rig = _Rig([1.0] * 100, src_slots=40, dst_slots=30)
    rig.cold(3 * BLOCK)  # 5 repeats x 3 blocks: 15 slots of each pool
    assert rig.evictions == 1  # the pools swept (out of the cache) before the first copy
    src = [s for plan in rig.plans for s, _, _ in plan]
    dst = [d for plan in rig.plans for _, d, _ in plan]
    assert len(set(src)) == len(set(dst)) == 15  # never twice: no copy finds a line in cache
    assert all(0 <= s < 40 for s in src) and all(0 <= d < 30 for d in dst)
    assert src != sorted(src) and dst != sorted(dst)  # shuffled, as a resume's slots are
    rig.cold(3 * BLOCK)  # 15 more: the destination pool (30) is used up, not yet swept
    assert rig.evictions == 1
    assert len({d for plan in rig.plans for _, d, _ in plan}) == 30
    rig.plans.clear()
    rig.cold(BLOCK)  # none left: swept again before reusing any slot
    assert rig.evictions == 2
    with pytest.raises(ValueError, match="do not fit"):
        rig.cold(31 * BLOCK)


def test_the_numpy_pools_copy_and_the_cache_size_is_read() -> None:
    assert last_level_cache_bytes() >= LLC_FALLBACK_BYTES
    cold = ColdMemcpy.in_memory(4096, llc_bytes=64 << 10, min_pool_bytes=1 << 20)
    assert cold.slots == (256, 256 - 16)  # destination slots: the part its last LLC evicted
    assert 0 < cold(3 * 4096 + 100) < 1.0
