"""The manager under device pressure and a blocked queue (the queue loan), on the simulated
engine. The rig: manager_helpers.py.
"""

from __future__ import annotations

from agentkv.manager import BranchState, DemotedBy
from tests.unit.manager_helpers import (
    P1,
    assert_answers,
    branch,
    counted,
    in_thread,
    offloaded,
)
from tests.unit.sim_engine import Rig, make_rig

# ============================================================================ (3) pressure


def _three_retained(rig: Rig) -> list[str]:
    ids = []
    for i in range(3):
        tid = f"t{i}"
        rig.turn(tid, [10 + i] * 12 + [1])  # 3 blocks each, nothing shared
        code, body = rig.mgr.pause(tid, "main", "fast", 0.001)
        assert code == 200 and body["state"] == "retained", body
        ids.append(tid)
    return ids


def test_one_spike_with_write_back_offloads_in_flight_demotes_exactly_one_branch() -> None:
    rig = make_rig(blocks=20, high_water=0.75)
    ids = _three_retained(rig)
    assert rig.mgr.pinned_blocks() == 9
    assert rig.eng.spike(8)  # 17 of 20 blocks used: 2 blocks over the high-water mark
    for _ in range(5):  # several steps; the store jobs (holding their pins) never finish
        rig.eng.step()
        rig.eng.deliver_reports()
    assert rig.mgr.counters["pressure_demotions"] == 1
    states = sorted(branch(rig, t).state.value for t in ids)
    assert states == ["offloading", "retained", "retained"]
    assert counted(rig) == {"pressure_demotions": 1, "store_blocks": 3, "stores": 1}


def test_control_thread_ticks_do_not_cascade_before_the_engine_unpins() -> None:
    # No host room: a demotion only unpins, and unpins wait for the engine thread.
    rig = make_rig(blocks=20, high_water=0.75, host=0)
    ids = _three_retained(rig)
    assert rig.eng.spike(8)
    for _ in range(4):
        in_thread(rig.mgr.tick)
    assert rig.mgr.counters["pressure_demotions"] == 1
    rig.eng.step()  # the engine applies the unpins: the spike is absorbed
    rig.eng.step()
    assert rig.mgr.counters["pressure_demotions"] == 1
    assert sum(branch(rig, t).state is BranchState.RETAINED for t in ids) == 2
    assert counted(rig) == {"pressure_demotions": 1}


def test_a_blocked_queue_demotes_retained_branches_in_the_same_step() -> None:
    # Pool use stays under high water: only the scheduler's queue shows the shortage.
    rig = make_rig(blocks=20, high_water=0.99)
    ids = _three_retained(rig)
    assert rig.eng.spike(8)  # 17 of 20 used, 3 free
    assert not rig.eng.spike(6)  # a plain request the scheduler cannot admit: 3 blocks short
    rig.eng.step()
    assert rig.eng.last_admission is not None and rig.eng.last_admission.shortfall == 3
    assert rig.mgr.counters["queue_demotions"] == 1  # one 3-block branch covers it
    assert rig.mgr.counters["pressure_demotions"] == 0
    states = sorted(branch(rig, t).state.value for t in ids)
    assert states == ["offloading", "retained", "retained"]
    demoted = next(t for t in ids if branch(rig, t).state is BranchState.OFFLOADING)
    assert branch(rig, demoted).demoted_by is DemotedBy.QUEUE_BLOCKED
    rig.settle()  # the write-back completes and hands the blocks back
    assert rig.eng.spike(6)  # the waiting request is admitted now
    assert rig.eng.violations == []
    assert counted(rig) == {"queue_demotions": 1, "store_blocks": 3, "stores": 1}
    assert_answers(rig, "t0", "t1", "t2")


def test_a_blocked_queue_ends_grace_pins_early() -> None:
    rig = make_rig(blocks=20, high_water=0.99, grace=30.0)
    rig.turn("t0", [10] * 12 + [1])  # HELD for 30 s, 3 blocks pinned
    assert branch(rig, "t0").state is BranchState.HELD
    assert rig.eng.spike(16)  # 19 of 20 used
    assert not rig.eng.spike(3)
    rig.eng.step()
    assert rig.mgr.counters["grace_shortened"] == 1
    assert branch(rig, "t0").state is not BranchState.HELD
    assert branch(rig, "t0").demoted_by is DemotedBy.QUEUE_BLOCKED
    assert rig.eng.violations == []
    assert counted(rig) == {"grace_shortened": 1, "store_blocks": 3, "stores": 1}


def test_a_pause_while_the_queue_is_blocked_does_not_retain() -> None:
    rig = make_rig(blocks=20, high_water=0.99)
    rig.turn("t0", [10] * 12 + [1])
    assert rig.eng.spike(16)
    assert not rig.eng.spike(3)
    rig.eng.step()
    code, body = rig.mgr.pause("t0", "main", "fast", 0.001)  # retains on a free pool
    assert code == 200 and body["decision"]["action"] != "retain"
    assert "retain would delay waiting requests" in body["decision"]["rationale"]
    assert counted(rig) == {"grace_shortened": 1, "store_blocks": 3, "stores": 1}


def test_writebacks_unread_counts_copies_that_left_without_a_load() -> None:
    rig = make_rig()
    offloaded(rig)  # a write-back of 4 blocks nobody reads
    assert rig.mgr.status()["counters"]["writebacks_unread"] == 0
    rig.mgr.delete("t1")
    rig.settle()
    assert rig.mgr.status()["counters"]["writebacks_unread"] == 4
    assert counted(rig) == {
        "grace_expired": 1,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_deleted": 1,
    }


def test_a_write_back_a_load_read_is_not_counted_unread() -> None:
    rig = make_rig()
    offloaded(rig)
    rig.flush()  # vLLM's cache lost the blocks: the turn loads them from host
    rig.turn("t1", [*P1, 4, 4, 4])
    assert rig.mgr.counters["loads"] >= 1
    rig.mgr.delete("t1")
    rig.settle()
    assert rig.mgr.status()["counters"]["writebacks_unread"] == 0
    assert counted(rig) == {
        "grace_expired": 1,
        "load_blocks": 4,
        "loads": 1,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_deleted": 1,
    }


# ============================================================================ (4) host eviction


def test_making_room_in_host_drops_copies_disk_also_holds_first() -> None:
    """A full host tier drops idle copies that disk also holds before host-only ones (those
    would lose the block), each group least recently used first."""
    from agentkv.manager import ResidencyIndex
    from agentkv.tier import Tier

    rig = make_rig(host=4, disk=8)
    index: ResidencyIndex = rig.mgr.index
    a, b, c, d = (bytes([i]) * 16 for i in range(4))  # least recently used first
    for key in (a, b, c, d):
        index.begin_write(key, Tier.HOST, "t1")
        assert index.end_write(key, Tier.HOST, True)
    for key in (c, b):  # disk also holds b and c (written in the other order)
        index.begin_write(key, Tier.DISK, "t1")
        assert index.end_write(key, Tier.DISK, True)
    assert rig.mgr.transitions.make_room(Tier.HOST, 1) == 1
    assert [op.keys for op in rig.mgr.outbox.drops] == [[b]]
    assert rig.mgr.transitions.make_room(Tier.HOST, 3) == 3  # 1 free: 2 more go
    assert [op.keys for op in rig.mgr.outbox.drops] == [[b], [c], [a]]
    assert index.keys_in(Tier.HOST) == [d] and index.keys_in(Tier.DISK) == [c, b]
    assert rig.mgr.counters["evictions_host"] == 3
    assert counted(rig) == {"evictions_host": 3}


def test_a_nearly_full_host_copies_its_least_recently_used_blocks_down_to_disk() -> None:
    """Host at 90% of its slots after a store: the least recently used host-only blocks are
    copied down until host-only use would be 80%, so making room later drops copies disk holds."""
    from agentkv.tier import Tier

    rig = make_rig(host=10, disk=32)
    for i in range(5):
        offloaded(rig, f"t{i}", [20 + i] * 8 + [1])  # 2 blocks each
    t0, t1 = (set(branch(rig, t).keys) for t in ("t0", "t1"))
    # t4's store filled host to 10 of 10 slots: 10 - 8 = 2 blocks go down, t0's (the oldest).
    assert rig.disk_keys() == t0
    assert rig.host_keys() >= t0 | t1
    index = rig.mgr.index
    assert set(index.keys_in(Tier.DISK)) == t0
    assert all(index.get(k).host for k in t0)  # type: ignore[union-attr]
    assert counted(rig) == {"grace_expired": 5, "store_blocks": 10, "stores": 5}
    offloaded(rig, "t5", [30] * 8 + [1])  # no room: the copies disk also holds leave host
    assert not rig.host_keys() & t0 and rig.disk_keys() >= t0
    assert rig.mgr.counters["evictions_host"] == 2 and rig.eng.violations == []


def test_a_new_trajectory_waits_for_admission_above_high_water_at_most_five_seconds() -> None:
    rig = make_rig(admission_wait=True, high_water=0.5)
    rig.turn("old", P1)
    assert rig.eng.spike(rig.pool.num_free() - 4)  # far above high water
    req = rig.eng.new_request("new", "main", [40] * 9)
    assert not rig.eng.schedule(req) and req.status == "WAITING"
    assert not rig.eng.schedule(req)
    assert rig.mgr.counters["admission_waits"] == 2
    rig.clock.advance(5.0)  # waited long enough: it evicts rather than wait any longer
    assert rig.eng.schedule(req)
    assert rig.mgr.counters["admission_waits"] == 2
    again = rig.eng.new_request("old", "main", [*P1, 4])  # a trajectory with turns never waits
    assert rig.eng.schedule(again)
    assert rig.mgr.counters["admission_waits"] == 2


def test_a_full_disk_tier_drops_its_least_recently_used_idle_copies() -> None:
    """The host copy-down near full needs disk slots: a full disk drops its idle copies."""
    rig = make_rig(host=10, disk=2)
    rig.turn("d", [50] * 8 + [1])
    code, body = rig.mgr.pause("d", "main", "human", 400.0)
    assert code == 200 and body["decision"]["action"] == "offload_disk", body
    rig.settle()
    on_disk = set(branch(rig, "d").keys)
    assert rig.disk_keys() == on_disk and rig.mgr.index.free("disk") == 0
    for i in range(5):
        offloaded(rig, f"t{i}", [20 + i] * 8 + [1])  # host fills: t0's blocks go down
    assert rig.disk_keys() == set(branch(rig, "t0").keys)
    assert all(rig.mgr.index.usable(k) is None for k in on_disk)  # d recomputes next time
    assert rig.eng.violations == []
    assert counted(rig) == {
        "evictions_disk": 2,
        "grace_expired": 5,
        "store_blocks": 12,  # d's 2 to disk, 5 x 2 to host
        "stores": 6,
    }
