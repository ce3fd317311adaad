"""invalidate_tiers on the simulated engine: after a reset or a weight update (a new generation of
keys), no tier copy written before loads, every copy and pin is released, stores still in flight
never surface, and the result is clean only when no stale load is in flight."""

from __future__ import annotations

import hashlib
from collections import Counter

from agentkv.manager import BranchState
from agentkv.manager.invalidation import invalidate_tiers
from tests.unit.manager_helpers import counted
from tests.unit.sim_engine import Rig, make_rig

SYS = [7, 7, 7, 7, 9, 9, 9, 9]
P1 = [*SYS, 1, 2, 3, 4, 5, 6, 7, 8, 1]  # 4 full blocks


def _switch_generation(rig: Rig, generation: bytes) -> None:
    """What the adapter does under the manager's lock: new keys, then invalidate."""
    rig.mgr.key_of = lambda h: hashlib.blake2b(generation + h, digest_size=16).digest()


def _offloaded(rig: Rig, traj: str) -> None:
    rig.turn(traj, P1 if traj == "t1" else [*SYS, 5, 5, 5, 5, 1])
    rig.clock.advance(1.0)
    rig.settle()
    assert rig.mgr.table[traj].branches["main"].state is BranchState.OFFLOADED


def test_after_invalidation_nothing_loads_and_nothing_is_held() -> None:
    rig = make_rig()
    _switch_generation(rig, b"g0")
    _offloaded(rig, "t1")
    rig.turn("t2", [*SYS, 6, 6, 6, 6, 1])  # held: pinned on the device, grace running
    assert rig.host_keys() and rig.mgr._pins
    with rig.mgr.lock:
        _switch_generation(rig, b"g1")
        result = invalidate_tiers(rig.mgr, "reset")
    assert result.clean and result.trajectories == 2 and result.dropped_blocks > 0
    rig.settle()
    assert rig.host_keys() == set() and rig.disk_keys() == set()
    assert rig.mgr._pins == Counter() and len(rig.mgr.index) == 0
    assert rig.mgr.get("t1")[0] == 404
    rig.flush()
    again = rig.turn("t1", [*P1, 4, 4, 4])
    assert again.status == "FINISHED" and again.load_n == 0  # recomputed, nothing stale loaded
    assert not rig.eng.violations
    assert counted(rig) == {
        "grace_expired": 1,
        "invalidations_reset": 1,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_reset": 2,
    }


def test_a_store_in_flight_at_invalidation_never_becomes_loadable() -> None:
    rig = make_rig()
    _switch_generation(rig, b"g0")
    rig.turn("t1", P1)
    rig.clock.advance(1.0)
    rig.eng.step()  # the grace expired: the store job is out, not finished
    assert rig.workers.pending
    with rig.mgr.lock:
        _switch_generation(rig, b"g1")
        invalidate_tiers(rig.mgr, "weights")
    rig.settle()  # the store completes now
    assert rig.host_keys() == set()  # its copies were dropped when it reported
    assert len(rig.mgr.index) == 0
    assert counted(rig) == {
        "grace_expired": 1,
        "invalidations_weights": 1,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_weights": 1,
    }


def test_a_load_in_flight_makes_the_invalidation_unclean_until_it_ends() -> None:
    rig = make_rig()
    _switch_generation(rig, b"g0")
    _offloaded(rig, "t1")
    rig.flush()
    req = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4])
    rig.eng.schedule(req)
    assert req.status == "WAITING_FOR_REMOTE_KVS" and req.load_n > 0
    rig.eng.step()
    with rig.mgr.lock:
        _switch_generation(rig, b"g1")
        first = invalidate_tiers(rig.mgr, "reset")
    assert not first.clean and first.stale_loads == 1
    rig.run(req, steps=30)
    assert req.status == "FINISHED"
    with rig.mgr.lock:
        _switch_generation(rig, b"g2")
        second = invalidate_tiers(rig.mgr, "reset")
    assert second.clean
    rig.settle()
    assert rig.host_keys() == set() and rig.mgr._pins == Counter()
    assert counted(rig) == {
        "grace_expired": 1,
        "invalidations_reset": 2,
        "load_blocks": 4,
        "loads": 1,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_reset": 1,
    }


def test_a_planned_load_vllm_could_not_allocate_for_leaves_the_invalidation_clean() -> None:
    """Issue 40 item 4: a lookup planned a host load, vLLM could not allocate for it (the pool is
    full) and, paused (pause_generation wait/keep), never asks again: nothing was copied, so the
    reset is clean (``reset_cache()`` True; counting the plan as stale refused every reset while
    paused). The plan's read pins go, and the request's next lookup derives its keys under the
    new generation: it loads nothing stale."""
    rig = make_rig()
    _switch_generation(rig, b"g0")
    _offloaded(rig, "t1")
    rig.flush()
    assert rig.eng.spike(rig.pool.num_free() - 1)  # other traffic: no room for the request
    req = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4])
    assert not rig.eng.schedule(req)  # looked up (a host hit planned), not allocated
    planned = rig.mgr.requests[req.req_id]
    assert planned.load_state == "planned" and planned.plan is not None
    assert any(e.readers for k in planned.plan.keys if (e := rig.mgr.index.get(k)) is not None)
    with rig.mgr.lock:
        _switch_generation(rig, b"g1")
        result = invalidate_tiers(rig.mgr, "reset")
    assert result.clean and result.stale_loads == 0
    assert planned.plan is None and planned.load_state == "none"
    rig.settle()
    assert rig.host_keys() == set() and len(rig.mgr.index) == 0  # the planned copies went too
    rig.eng.release_spike()
    rig.run(req, steps=30)
    assert req.status == "FINISHED" and req.load_n == 0  # recomputed, nothing stale loaded
    assert rig.mgr.counters["loads"] == 0 and not rig.eng.violations
    assert rig.mgr.counters["loads_cancelled"] == 1


def test_an_upload_queued_before_an_invalidation_publishes_its_own_generations_kv() -> None:
    """The engine idle past the job timeout: an upload queued before the switch times out in the
    manager and ships after it. Its copies stay pinned (invalidate_tiers leaves them to the job),
    so it publishes the old generation's keys with that generation's KV (true: no lookup of the
    new generation derives them), then they are dropped; nothing of it loads again."""
    rig = make_rig(grace=0.0, remote_enabled=True)
    derived: dict[bytes, bytes] = {}  # key -> the generation it was derived under

    def switch(generation: bytes) -> None:
        def key_of(h: bytes) -> bytes:
            key = hashlib.blake2b(generation + h, digest_size=16).digest()
            derived[key] = generation
            return key

        rig.mgr.key_of = key_of

    def true_in_its_generation(key: bytes, content: bytes) -> bool:
        generation = derived.get(key)
        return (
            generation is not None
            and hashlib.blake2b(generation + content, digest_size=16).digest() == key
        )

    rig.workers.published_truth = true_in_its_generation
    switch(b"g0")
    rig.turn("t1", P1)
    rig.mgr.pause("t1", "main", "tool", None)
    for _ in range(3):  # the store ships and completes: its upload is queued, not shipped
        rig.eng.step()
        for p in rig.workers.completable():
            rig.workers.complete(p, True)
        rig.eng.deliver_reports()
        if rig.mgr._outbox.moves:
            break
    (upload,) = rig.mgr._outbox.moves
    old_keys = set(upload.keys)
    assert old_keys and old_keys <= rig.host_keys()
    rig.clock.advance(20.0)  # no engine step: the control thread's tick times the upload out
    rig.mgr.tick()
    assert not rig.mgr.jobs
    with rig.mgr.lock:
        switch(b"g1")
        assert invalidate_tiers(rig.mgr, "weights").clean
    rig.settle()  # the upload ships late and reports: its copies are dropped
    assert set(rig.workers.remote[0]) == old_keys
    assert not rig.eng.violations
    assert rig.host_keys() == set() and len(rig.mgr.index) == 0
    again = rig.turn("t1", [*P1, 4, 4, 4])
    assert again.status == "FINISHED" and again.load_n == 0  # recomputed, nothing stale loaded
    rig.mgr.pause("t1", "main", "tool", None)
    rig.settle()
    new_keys = set(rig.workers.remote[0]) - old_keys
    assert new_keys and all(derived[k] == b"g1" for k in new_keys)
    assert not rig.eng.violations
    assert counted(rig) == {
        "invalidations_weights": 1,
        "job_timeouts": 1,
        "remote_fetches": 2,
        "remote_missed_blocks": 5,
        "remote_upload_failures": 1,
        "remote_uploaded_blocks": 5,
        "store_blocks": 9,
        "stores": 2,
        "trajectories_weights": 1,
    }
