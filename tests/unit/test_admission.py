"""The adapter's admission picture: what the scheduler's hooks saw this step, in O(1)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from agentkv.admission import Admission
from agentkv_vllm.scheduler_side import SchedulerSide, VllmBlockPinner


class _Pool:
    def __init__(self, free: int) -> None:
        self.free = free

    def get_num_free_blocks(self) -> int:
        return self.free


def _side(free: int) -> Any:
    side = SchedulerSide.__new__(SchedulerSide)  # only the parts the picture reads
    side.block_size = 16
    side._params = {}
    side._unadmitted = None
    side._live = set()
    side._step_tokens = 0
    side._step_hit_blocks = 0
    side._blocked = None
    side.last_unblocked = None
    side.manager = SimpleNamespace(steps=0)
    side.pinner = VllmBlockPinner()
    side.pinner.pool = _Pool(free)
    side.cpu = SimpleNamespace(add=lambda *a: None)
    return side


def _plain(rid: str, tokens: int) -> Any:
    return SimpleNamespace(request_id=rid, kv_transfer_params=None, num_tokens=tokens)


def test_a_request_looked_up_and_never_allocated_is_the_blocked_head() -> None:
    side = _side(free=3)
    side.lookup(_plain("a", 100), 32)  # 7 blocks, 2 hit: 5 needed
    adm = side.admission_of(SimpleNamespace(preempted_req_ids=set()))
    assert adm == Admission(waiting=1, blocks_needed=5, free_blocks=3, preempted=0)
    assert adm.shortfall == 2
    # The next step starts clean.
    assert side.admission_of(None) == Admission(free_blocks=3)


def test_an_allocated_request_is_not_waiting_and_preemptions_count() -> None:
    side = _side(free=10)
    req = _plain("a", 40)
    side.lookup(req, 0)
    side.plan_load(req, None, 0)  # vLLM allocated it
    adm = side.admission_of(SimpleNamespace(preempted_req_ids={"b", "c"}))
    assert adm == Admission(waiting=0, blocks_needed=0, free_blocks=10, preempted=2)
    assert adm.blocked


def test_the_step_scheduled_tokens_are_the_pool_fill() -> None:
    side = _side(free=10)
    side._step_sample = None
    side.online = SimpleNamespace(observe_prefill=lambda *a: None)
    side._sample_step(SimpleNamespace(num_scheduled_tokens={"a": 40, "b": 1, "c": 7}))
    assert side.admission_of(None).filled_blocks == 48 / 16


def test_a_new_request_s_prefix_hit_is_reported_apart_from_the_fill() -> None:
    """A first-scheduled request takes its cached blocks off the free queue: the picture
    reports them (hit_blocks) beside the new KV, for the manager to tell its placed contexts'
    hits from the rest (the forecast ran late without them, early with all of them as fill)."""
    side = _side(free=10)
    side._step_sample = None
    side.online = SimpleNamespace(observe_prefill=lambda *a: None)
    new = [SimpleNamespace(num_computed_tokens=64), SimpleNamespace(num_computed_tokens=20)]
    step = SimpleNamespace(num_scheduled_tokens={"a": 16, "b": 8}, scheduled_new_reqs=new)
    side._sample_step(step)
    picture = side.admission_of(None)
    assert (picture.filled_blocks, picture.hit_blocks) == (24 / 16, 4 + 1)
    side._sample_step(SimpleNamespace(num_scheduled_tokens={"a": 1}, scheduled_new_reqs=[]))
    picture = side.admission_of(None)
    assert (picture.filled_blocks, picture.hit_blocks) == (1 / 16, 0)  # the next step is clean


def test_status_tells_after_how_many_steps_a_blocked_head_was_admitted() -> None:
    side = _side(free=3)
    req = _plain("a", 100)
    side.lookup(req, 0)
    side.admission_of(None)  # step 1: blocked
    side.manager.steps = 1
    side.lookup(req, 0)
    side.admission_of(None)  # step 2: still blocked (first seen at step 1)
    side.manager.steps = 2
    side.lookup(req, 0)
    side.plan_load(req, None, 0)  # step 3's schedule allocates it
    assert side.last_unblocked == {"request_id": "a", "blocked_at_step": 1, "admitted_at_step": 3}


def test_cached_hit_blocks_in_the_free_list_count_as_needed() -> None:
    """vLLM's allocate_slots takes a hit's unreferenced cached blocks off the free list too: 6
    free blocks, a head needing 3 new blocks and hitting 4 free cached ones is short 1 (the
    retain-always stall of the pool-12 sweep: nothing looked short, nothing was demoted)."""
    side = _side(free=6)
    cached = {b"h0": 0, b"h1": 0, b"h2": 0, b"h3": 0, b"h4": 2}  # hash -> ref count
    pool = side.pinner.pool
    pool.get_cached_block = lambda h, groups: (
        [SimpleNamespace(ref_cnt=cached[h])] if h in cached else None
    )
    req = SimpleNamespace(
        request_id="a",
        kv_transfer_params=None,
        num_tokens=7 * 16,
        block_hashes=[b"h0", b"h1", b"h2", b"h3", b"h4", b"h5"],
    )
    side.lookup(req, 4 * 16)  # vLLM's own hit: 4 blocks, all free in its cache
    adm = side.admission_of(None)
    assert adm.blocks_needed == 3 + 4 and adm.shortfall == 1 and adm.blocked
    side.lookup(req, 5 * 16)  # a referenced hit block does not count
    assert side.admission_of(None).blocks_needed == 2 + 4
