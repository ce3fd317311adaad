"""Tests that kill mutants which survived the manager's suite (docs/testing.md, mutation
testing), on the simulated engine. The rig: manager_helpers.py.
"""

from __future__ import annotations

import json

import pytest

from agentkv.manager import BranchState, DemotedBy
from tests.unit.manager_helpers import (
    P1,
    assert_answers,
    branch,
    counted,
    disk_offloaded,
    in_thread,
    keys_of,
    offloaded,
)
from tests.unit.sim_engine import make_rig

# ---------------------------------------------------------------- mutants that survived (docs/testing.md)


def test_an_expired_lease_is_counted_and_measured_as_a_lease_expiry() -> None:
    from agentkv import metrics as m
    from agentkv.metrics import counter_value

    rig = make_rig()
    rig.turn("t1", P1)
    assert rig.mgr.pause("t1", "main", "fast", 0.001)[1]["state"] == "retained"
    rig.clock.t = branch(rig).lease_until
    rig.eng.step()
    assert rig.mgr.counters["lease_expired_demotions"] == 1
    snap = rig.mgr.metrics.snapshot()
    assert counter_value(snap, m.DEMOTIONS.name, reason="lease_expired") == 1
    assert counted(rig) == {"lease_expired_demotions": 1, "store_blocks": 4, "stores": 1}


def test_a_prefetch_no_one_came_back_for_is_counted_wasted_on_delete() -> None:
    from agentkv import metrics as m
    from agentkv.metrics import counter_value

    rig = make_rig(disk=32)
    disk_offloaded(rig)
    rig.clock.t = branch(rig).prefetch_due + 0.01  # type: ignore[operator]
    rig.settle()
    assert branch(rig).prefetch_done_at is not None
    rig.mgr.delete("t1")
    assert rig.mgr.prefetch_outcomes.counts()["wasted"] == 1
    snap = rig.mgr.metrics.snapshot()
    assert counter_value(snap, m.PREFETCH_OUTCOMES.name, outcome="wasted") == 1
    assert counted(rig) == {
        "prefetches": 1,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_deleted": 1,
    }


def test_a_disk_hit_turn_says_disk() -> None:
    rig = make_rig(disk=32)
    disk_offloaded(rig)
    rig.flush()
    rig.turn("t1", [*P1, 4], steps=16)
    (turn1, turn2) = rig.mgr.get("t1")[1]["turns"]
    assert turn2["tier"] == "disk" and turn2["tier_hit_tokens"] == 16
    assert turn2["hit_ratio"] == round(16 / 18, 6) and turn1["hit_ratio"] == 0.0
    assert counted(rig) == {"load_blocks": 4, "loads": 1, "store_blocks": 4, "stores": 1}
    assert_answers(rig, "t1")


def test_a_remote_fetch_is_counted() -> None:
    rig = make_rig(remote_enabled=True)
    keys = keys_of(rig, P1)
    for k, h in zip(keys, rig.eng.hashes(P1), strict=True):
        rig.workers.remote[0][k] = h  # another replica uploaded this context
    job = rig.mgr.fetch_remote("t9", [*keys, b"\xee" * 16])
    assert job is not None and rig.mgr.job_pending(job)
    assert rig.mgr.counters["remote_fetches"] == 1
    rig.settle()
    assert not rig.mgr.job_pending(job)
    assert rig.mgr.counters["remote_fetched_blocks"] == 4
    assert rig.mgr.counters["remote_missed_blocks"] == 1
    assert rig.mgr.fetch_remote("t9", keys) is None  # all on host now: nothing to fetch
    assert counted(rig) == {
        "remote_fetched_blocks": 4,
        "remote_fetches": 1,
        "remote_missed_blocks": 1,
    }


def test_has_work_while_a_job_is_in_flight_or_pins_wait() -> None:
    rig = make_rig(grace=0.0)
    rig.turn("t1", P1, jobs=False)  # the grace-0 offload: a store job
    rig.eng.step()
    assert rig.mgr.jobs and not rig.mgr.engine_work_pending()
    assert rig.mgr.has_work()  # only the job in flight
    rig.settle()
    assert not rig.mgr.has_work()
    rig.turn("t2", P1)
    rig.mgr.pause("t2", "main", "fast", 0.001)  # retained: pinned
    rig.settle()
    in_thread(rig.mgr.delete, "t2")  # the unpins wait for the engine thread
    assert not rig.mgr.jobs and rig.mgr.has_work()
    assert counted(rig) == {"store_blocks": 4, "stores": 1, "trajectories_deleted": 1}


def test_worker_report_is_truthy_only_with_content() -> None:
    from agentkv.manager import WorkerReport

    assert not WorkerReport()
    for rep in (
        WorkerReport(jobs_done={1: 1}),
        WorkerReport(jobs_failed={1}),
        WorkerReport(bad_keys={b"k": "miss"}),
        WorkerReport(hello={0: 1}),
        WorkerReport(transfers={("offload", "host", "1"): (1, 0.1)}),
    ):
        assert rep


def test_the_residency_index_refuses_a_second_write_of_a_key() -> None:
    from agentkv.manager import ResidencyIndex

    index = ResidencyIndex({"host": 4, "disk": 4})
    index.begin_write(b"k", "host", "t1")
    with pytest.raises(ValueError):
        index.begin_write(b"k", "host", "t1")  # writing
    assert index.end_write(b"k", "host", True)
    with pytest.raises(ValueError):
        index.begin_write(b"k", "host", "t1")  # held
    index.begin_write(b"k", "disk", "t1")  # another tier is fine


def test_a_retained_branch_that_runs_again_is_no_pressure_victim() -> None:
    """A retained branch whose agent is back (a request runs) leaves the pressure candidates:
    pressure must not demote a branch that is not retained any more."""
    rig = make_rig(high_water=0.5)
    rig.turn("t1", P1)
    assert rig.mgr.pause("t1", "main", "fast", 0.001)[1]["state"] == "retained"
    req = rig.eng.new_request("t1", "main", [*P1, 4], max_new=2)
    assert rig.eng.schedule(req)
    assert branch(rig).state is BranchState.ACTIVE
    assert rig.eng.spike(rig.pool.num_free() - 2)  # usage far above high water
    rig.eng.step()
    assert rig.mgr.counters["pressure_demotions"] == 0
    assert branch(rig).state is BranchState.ACTIVE
    rig.eng.release_spike()
    rig.run(req)
    assert req.status == "FINISHED" and not rig.eng.violations
    assert branch(rig).state is BranchState.HELD  # its grace period, pinned again
    assert rig.eng.spike(rig.pool.num_free() - 1)
    rig.eng.step()
    assert rig.mgr.counters["pressure_demotions"] == 0  # grace decides, not pressure
    assert branch(rig).state is BranchState.HELD and branch(rig).pinned
    assert counted(rig) == {}


def test_store_jobs_in_flight_are_releasing_until_they_complete() -> None:
    rig = make_rig(grace=0.0)
    rig.turn("t1", P1, jobs=False)
    rig.eng.step()
    assert rig.mgr.status()["pool"]["releasing_blocks"] == 4
    rig.settle()
    assert rig.mgr.status()["pool"]["releasing_blocks"] == 0
    assert counted(rig) == {"store_blocks": 4, "stores": 1}


def test_an_abort_after_a_confirmed_load_keeps_the_loaded_blocks() -> None:
    """The load reported ok: its blocks are trusted even if the request is then aborted."""
    rig = make_rig()
    offloaded(rig)
    rig.flush()
    req = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4, 4], max_new=3)
    rig.eng.schedule(req)
    assert req.status == "WAITING_FOR_REMOTE_KVS"
    rig.eng.step()
    for p in rig.workers.completable():
        rig.workers.complete(p)
    rig.eng.deliver_reports()
    assert req.status == "RUNNING"
    assert rig.eng.compute(req)
    rig.eng.abort(req)
    assert rig.mgr.counters["aborted_loads"] == 0
    assert len(branch(rig).pinned) >= 4  # the loaded context, not only the device hit (none)
    assert counted(rig) == {
        "grace_expired": 1,
        "load_blocks": 4,
        "loads": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_every_failed_load_is_counted_and_serves_no_tier_tokens() -> None:
    rig = make_rig()
    offloaded(rig)
    for n in (1, 2):
        rig.flush()
        req = rig.eng.new_request("t1", "main", [*P1, 4], max_new=0)
        rig.eng.schedule(req)
        rig.eng.step()
        for p in rig.workers.completable():
            rig.workers.complete(p, "io_error")
        rig.eng.deliver_reports()
        rig.run(req)
        assert rig.mgr.counters["load_failures"] == n
        assert rig.mgr.get("t1")[1]["turns"][-1]["tier_hit_tokens"] == 0
        offloaded(rig, prompt=[*P1, 4])
    assert counted(rig) == {
        "grace_expired": 3,
        "load_blocks": 8,
        "load_failures": 2,
        "loads": 2,
        "store_blocks": 12,
        "stores": 3,
        "tier_misses": 8,
    }


def test_a_fail_closed_load_is_counted() -> None:
    rig = make_rig()
    rig.mgr.on_alloc("r-unknown", [1, 2, 3], 8)  # not ours, yet vLLM counted tokens
    assert rig.mgr.counters["failed_closed_loads"] == 1
    assert counted(rig) == {"failed_closed_loads": 1}


def test_get_says_why_the_engine_moved_a_branch() -> None:
    rig = make_rig()
    offloaded(rig)  # grace expired with no pause decision
    assert rig.mgr.get("t1")[1]["branches"]["main"]["demoted_by"] == "grace_expired"
    assert branch(rig).demoted_by is DemotedBy.GRACE_EXPIRED
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


def test_demoted_by_is_the_plain_string_on_the_wire() -> None:
    """The reason is a StrEnum inside; GET's JSON carries its value, as before the enum."""
    rig = make_rig()
    offloaded(rig)
    text = json.dumps(rig.mgr.get("t1")[1])  # a non-str enum would raise here
    assert '"demoted_by": "grace_expired"' in text
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


def test_the_paused_gauge_is_labelled_by_state() -> None:
    from agentkv import metrics as m

    rig = make_rig()
    offloaded(rig)
    rows = {(spec.name, tuple(sorted(labels.items()))): v for spec, labels, v in rig.mgr.gauges()}
    assert rows[(m.PAUSED_TRAJECTORIES.name, (("state", "offloaded"),))] == 1
    assert rows[(m.TRAJECTORIES.name, ())] == 1
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


def test_a_second_pause_of_a_disk_branch_still_prefetches() -> None:
    """A decision that changes no state (offload_host for a branch already offloaded) still arms
    its prefetch timer."""
    rig = make_rig(disk=32)
    disk_offloaded(rig)
    _code, body = rig.mgr.pause("t1", "main", "human", 400.0)
    assert body["state"] == "offloaded"
    due = branch(rig).prefetch_due
    assert due is not None
    rig.clock.t = due + 0.01
    rig.settle()
    assert rig.mgr.counters["prefetches"] == 1 and branch(rig).prefetch_done_at is not None
    assert counted(rig) == {"prefetches": 1, "store_blocks": 4, "stores": 1}


def test_a_layerwise_load_is_counted_and_the_turn_stats_carry_the_hit_ratio() -> None:
    rig = make_rig(layerwise=True)
    offloaded(rig)
    rig.flush()
    req = rig.eng.new_request("t1", "main", [*P1, 4], max_new=0)
    rig.run(req)
    assert rig.mgr.counters["layerwise_loads"] == 1
    rig.turn("t1", [*P1, 4, 4])
    stats = rig.mgr.on_finish(
        "r-none", [], computed_tokens=0, token_ids=[], block_hashes=[], aborted=False
    )
    assert stats is None
    t1 = rig.mgr.table["t1"]
    req3 = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4], max_new=0)
    rig.eng.schedule(req3)
    rig.eng.step()
    rig.eng.compute(req3)
    out = rig.eng.finish(req3)
    assert out is not None and out["prefix_hit_ratio"] == round(t1.prefix_hit_ratio, 6) > 0
    assert counted(rig) == {
        "grace_expired": 1,
        "layerwise_loads": 3,
        "load_blocks": 12,
        "loads": 3,
        "store_blocks": 4,
        "stores": 1,
    }
    assert_answers(rig, "t1")


def test_pool_trend_forecasts_eviction_from_the_free_block_drain() -> None:
    from agentkv.admission import Admission, PoolTrend

    trend = PoolTrend(alpha=1.0)
    trend.observe(0.0, 100)
    trend.observe(1.0, 90)  # 10 blocks a second leave the free list
    assert trend.seconds_to_eviction(Admission(free_blocks=90)) == pytest.approx(9.0)
    assert trend.seconds_to_eviction(Admission(waiting=1, blocks_needed=95, free_blocks=90)) == 0
    trend.observe(2.0, 95)  # growing again: no eviction ahead
    assert trend.seconds_to_eviction(Admission(free_blocks=95)) == float("inf")


def test_status_shows_the_admission_picture_and_forecast() -> None:
    rig = make_rig(blocks=20)
    assert rig.eng.spike(16)
    assert not rig.eng.spike(8)
    rig.eng.step()
    pool = rig.mgr.status()["pool"]
    assert pool["admission"] == {
        "waiting": 1,
        "blocks_needed": 8,
        "free_blocks": 4,
        "preempted": 0,
        "filled_blocks": 16.0,  # the spike wrote 16 blocks
        "hit_blocks": 0.0,
    }
    assert pool["eviction_forecast_s"] == 0.0
    assert counted(rig) == {}


def test_a_load_that_fails_midway_serves_the_blocks_before_the_failure() -> None:
    """Mutant jobtable._load_done__mutmut_26 (tier tokens of a partly failed load divided, not
    multiplied, by the block size): vLLM recomputes from the first failed block, so the turn
    counts exactly the blocks before it as served from the tier."""
    rig = make_rig()
    offloaded(rig)
    rig.flush()
    lost = keys_of(rig, P1)[2]
    del rig.workers.stores[0]["host"][lost]  # rank 0's host copy of block 2 is gone
    rig.turn("t1", [*P1, 4])
    turn = rig.mgr.get("t1")[1]["turns"][-1]
    assert rig.mgr.counters["load_failures"] == 1
    assert turn["tier_hit_tokens"] == 2 * 4 and turn["tier"] == "host"
    assert counted(rig) == {
        "grace_expired": 1,
        "load_blocks": 4,
        "load_failures": 1,
        "loads": 1,
        "store_blocks": 4,
        "stores": 1,
        "tier_misses": 1,
    }


def test_status_lists_the_tools_the_predictor_learned() -> None:
    """Mutant views._status_view__mutmut_90 (the predictor's key renamed in /status)."""
    rig = make_rig()
    rig.turn("t1", P1)
    assert rig.mgr.pause("t1", "main", "pytest", expected_wait_s=0.2)[0] == 200
    rig.clock.advance(0.2)
    assert rig.mgr.resume("t1", "main")[0] == 200
    assert rig.mgr.status()["predictor"] == {"pytest": 1}
    assert counted(rig) == {"store_blocks": 4, "stores": 1}


# ---------------------------------------------------------------- sample E (seed 41, docs/testing.md)


def test_a_pause_with_an_empty_tool_list_is_learned_as_unknown() -> None:
    """Mutant core.pause__mutmut_6 (the placeholder name changed): a pause naming no tool is
    predicted, shown and learned under "unknown", the name the prefetch stats give no tool."""
    rig = make_rig()
    rig.turn("t1", P1)
    code, body = rig.mgr.pause("t1", "main", [], 30.0)
    assert code == 200 and "tools" not in body
    assert branch(rig).tool == "unknown"
    assert rig.mgr.get("t1")[1]["branches"]["main"]["tool"] == "unknown"
    assert counted(rig) == {"store_blocks": 4, "stores": 1}


def test_a_new_trajectory_arms_no_timer_that_is_already_due() -> None:
    """Mutant ownership.Namespace.for_request__mutmut_20 (the idle timer armed at now - ttl):
    the control thread sleeps ``next_deadline()`` seconds, so a new trajectory's idle timer
    must come up after its TTL, not at once (a spurious wake-up per new trajectory)."""
    rig = make_rig(idle_ttl_s=600.0)
    req = rig.eng.new_request("t1", "main", P1, max_new=0)
    assert rig.mgr.next_deadline() is None
    rig.eng.schedule(req)  # the lookup creates t1
    assert rig.mgr.knows("t1")
    assert rig.mgr.next_deadline() == pytest.approx(600.0)
    assert counted(rig) == {}


def test_a_new_pause_forgets_why_the_engine_moved_the_branch_last_time() -> None:
    """Mutant pauses.Pauses._note_pause__mutmut_5 (``demoted_by = ""``): GET says null, not an
    empty reason, once the branch is paused again."""
    rig = make_rig()
    offloaded(rig)  # grace expired: demoted_by grace_expired
    assert branch(rig).demoted_by is DemotedBy.GRACE_EXPIRED
    assert rig.mgr.pause("t1", "main", "grep", 30.0)[0] == 200
    assert branch(rig).demoted_by is None
    assert rig.mgr.get("t1")[1]["branches"]["main"]["demoted_by"] is None
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


def test_status_names_the_block_size_in_bytes() -> None:
    """Mutant views._status_view__mutmut_65 (the ``block_bytes`` key renamed)."""
    rig = make_rig()
    assert rig.mgr.status()["pool"]["block_bytes"] == 1 << 20
    assert counted(rig) == {}


# ---------------------------------------------------------------- sample F (seed 43, docs/testing.md)


def test_an_offload_counts_one_store_of_its_blocks() -> None:
    """Mutant transitions.Transitions.offload__mutmut_97 (the ``stores`` counter counts down)."""
    rig = make_rig()
    offloaded(rig)
    assert (rig.mgr.counters["stores"], rig.mgr.counters["store_blocks"]) == (1, 4)
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


def test_a_delete_says_how_many_pinned_blocks_it_released() -> None:
    """Mutant ownership.Namespace.release__mutmut_31 (released blocks counted down)."""
    rig = make_rig()
    rig.turn("t1", P1)
    assert rig.mgr.pause("t1", "main", "fast", 0.001)[1]["state"] == "retained"
    assert len(branch(rig).pinned) == 4
    code, body = rig.mgr.delete("t1")
    assert code == 200 and body["released_blocks"] == 4
    assert counted(rig) == {"trajectories_deleted": 1}


def test_a_failed_upload_is_counted_once_and_uploads_nothing() -> None:
    """Mutants jobtable.JobTable._upload_done__mutmut_12 and _16 (a failed upload counted as
    uploaded blocks, or under another name)."""
    rig = make_rig(remote_enabled=True)
    rig.turn("t1", P1)
    rig.clock.advance(1.0)
    for _ in range(4):  # grace expires, the host copy is written; the remote tier is down
        rig.eng.step()
        for p in rig.workers.completable():
            upload = getattr(p.job, "kind", None) == "upload"
            rig.workers.complete(p, "io_error" if upload else "ok")
        rig.eng.deliver_reports()
    assert branch(rig).state is BranchState.OFFLOADED
    assert rig.mgr.counters["remote_upload_failures"] == 1
    assert rig.mgr.counters["remote_uploaded_blocks"] == 0
    assert counted(rig) == {
        "grace_expired": 1,
        "remote_fetches": 1,
        "remote_missed_blocks": 4,
        "remote_upload_failures": 1,
        "store_blocks": 4,
        "stores": 1,
    }
    assert_answers(rig, "t1")


def test_the_residency_index_by_itself() -> None:
    """The index's own contract, one call at a time: what each call does to the counts, the LRU,
    the change log, and that calls about a key it does not hold change nothing."""
    from agentkv.manager import ResidencyIndex
    from agentkv.tier import Tier

    index = ResidencyIndex({Tier.HOST: 3, Tier.DISK: 2})
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    for key in (a, b, c, b"?"):  # nothing known: every call is a no-op
        index.end_read(key)
        index.touch(key)
        index.remove_copy(key, None)
        assert not index.end_write(key, Tier.HOST, True)
        assert index.usable(key) is None and index.owners(key) == frozenset()
    assert index.take_changes() == []  # not recording yet
    index.record_changes()
    index.begin_write(a, Tier.HOST, "t1")
    assert (index.reserved(Tier.HOST), index.count(Tier.HOST), index.free(Tier.HOST)) == (1, 0, 2)
    assert index.usable(a) is None  # not readable before every rank wrote it
    assert index.end_write(a, Tier.HOST, True) and index.usable(a) is Tier.HOST
    index.begin_write(a, Tier.DISK, None)
    assert not index.end_write(a, Tier.DISK, False)  # a failed write frees its slot
    assert (index.reserved(Tier.DISK), index.get(a).has(Tier.DISK)) == (0, False)  # type: ignore[union-attr]
    for key in (b, c):
        index.begin_write(key, Tier.HOST, "t2")
        index.end_write(key, Tier.HOST, True)
    assert index.keys_in(Tier.HOST) == [a, b, c] and index.free(Tier.HOST) == 0
    index.touch(a)  # used again: the most recently used
    assert index.keys_in(Tier.HOST) == [b, c, a]
    assert index.victims(Tier.HOST, 0) == [] and index.victims(Tier.HOST, 2) == [b, c]
    index.begin_read(b)
    assert index.victims(Tier.HOST, 2) == [c, a]  # a key being read is never a victim
    index.end_read(b)
    index.end_read(b)  # one more end than begins: stays at zero readers
    assert index.get(b).readers == 0  # type: ignore[union-attr]
    index.hold_late(Tier.HOST, 2)
    assert index.reserved(Tier.HOST) == 5 and index.free(Tier.HOST) == 0
    index.release_late(Tier.HOST, 5)
    assert index.reserved(Tier.HOST) == 3
    index.begin_write(c, Tier.DISK, "t2")
    assert index.end_write(c, Tier.DISK, True) and index.usable(c) is Tier.HOST
    index.remove_copy(c, Tier.HOST)
    assert index.usable(c) is Tier.DISK and index.keys_in(Tier.DISK) == [c]
    index.note_external(c, 50.0)
    index.note_external(c, 20.0)  # an earlier expiry never shortens what is known
    assert index.external(c, 49.0) and not index.external(c, 50.0)
    assert index.get(c).has(Tier.REMOTE) and not index.get(a).has(Tier.REMOTE)  # type: ignore[union-attr]
    assert index.owners(a) == frozenset({"t1"}) and index.owners(b) == frozenset({"t2"})
    assert index.take_changes() == [
        (a, Tier.HOST, True),
        (b, Tier.HOST, True),
        (c, Tier.HOST, True),
        (c, Tier.DISK, True),
        (c, Tier.HOST, False),
    ]
    assert index.take_changes() == []
    assert index.disown([a, b, c], "t2") == [b, c]  # t1 still owns a
    assert len(index) == 1 and list(index) == [a]
    assert index.take_changes() == [(b, Tier.HOST, False), (c, Tier.DISK, False)]
    assert index.unread_dropped == 2  # c's host and disk copies; b was read (begin_read)
