"""DELETE is final against requests queued before it (issue 40 item 9): a turn sitting in vLLM's
waiting queue, never looked up, when its trajectory is DELETEd runs as a vanilla request once
scheduled (no trajectory, no pins, no copies); a turn sent after the DELETE starts a fresh one.
On the simulated engine, which stamps each request's arrival as the adapter does (vLLM's
``Request.arrival_time``)."""

from __future__ import annotations

from agentkv.manager.requests import DELETE_MARK_TTL_S, MAX_DELETE_MARKS
from tests.unit.sim_engine import Rig, SimRequest, make_rig

P1 = [7, 7, 7, 7, 9, 9, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 1]  # 4 full blocks


def _deleted_with_a_turn_queued(rig: Rig, salt: str | None = None) -> SimRequest:
    rig.run(rig.eng.new_request("t1", "main", P1, max_new=0, salt=salt))
    rig.clock.advance(1.0)
    rig.settle()  # the grace ended: the context is on host
    assert rig.host_keys()
    queued = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4], max_new=1, salt=salt)
    rig.clock.advance(0.5)  # it waits in vLLM's queue, never looked up
    assert queued.req_id not in rig.mgr.requests
    assert rig.mgr.delete("t1", tenant=salt)[0] == 200
    rig.settle()
    return queued


def test_a_turn_queued_before_the_delete_runs_vanilla_and_holds_nothing() -> None:
    rig = make_rig()
    queued = _deleted_with_a_turn_queued(rig)
    rig.run(queued)
    assert queued.status == "FINISHED" and queued.stats is None
    assert queued.load_n == 0  # nothing of the deleted one loads
    rig.clock.advance(5.0)
    rig.settle()
    assert rig.mgr.get("t1")[0] == 404 and "t1" not in rig.mgr.table
    assert rig.mgr._pins == {} and rig.host_keys() == set() and len(rig.mgr.index) == 0
    assert rig.mgr.counters["requests_of_deleted_trajectories"] == 1
    assert not rig.eng.violations


def test_a_turn_sent_after_the_delete_starts_a_fresh_trajectory() -> None:
    rig = make_rig()
    queued = _deleted_with_a_turn_queued(rig)
    rig.clock.advance(0.01)
    fresh = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4], max_new=1)
    rig.run(fresh)
    assert fresh.stats is not None and fresh.stats["turn"] == 1  # a new trajectory's first
    rig.run(queued)
    assert queued.stats is None  # never joins the fresh one
    assert rig.mgr.table["t1"].turn_count == 1
    assert not rig.eng.violations


def test_the_mark_is_per_tenant() -> None:
    rig = make_rig()
    other = rig.eng.new_request("t1", "main", [5, 5, 5, 5, 1], max_new=1, salt="tenant-b")
    queued = _deleted_with_a_turn_queued(rig)
    rig.run(other)  # another tenant's t1, queued before the DELETE of the unsalted t1
    assert other.stats is not None
    rig.run(queued)
    assert queued.stats is None


def test_a_delete_this_rank_answers_404_still_marks() -> None:
    """DP: the routes fan a DELETE out to every rank; the trajectory's turn queued on a rank
    that never saw it must not create it there."""
    rig = make_rig()
    queued = rig.eng.new_request("t9", "main", P1, max_new=1)
    assert rig.mgr.delete("t9")[0] == 404
    rig.run(queued)
    assert queued.stats is None and "t9" not in rig.mgr.table


def test_marks_are_bounded_by_time_and_count() -> None:
    rig = make_rig()
    queued = rig.eng.new_request("t1", "main", P1, max_new=1)
    rig.mgr.delete("t1")
    rig.clock.advance(DELETE_MARK_TTL_S + 1.0)
    rig.mgr.delete("other")  # a mark past its time goes when the next one is made
    assert "t1" not in rig.mgr.reqs._deleted_at
    rig.run(queued)  # looked up past the bound: served as before the fix, a new trajectory
    assert queued.stats is not None
    for i in range(MAX_DELETE_MARKS + 10):
        rig.mgr.reqs.mark_deleted(f"x{i}")
    assert len(rig.mgr.reqs._deleted_at) == MAX_DELETE_MARKS
    assert "x0" not in rig.mgr.reqs._deleted_at and f"x{MAX_DELETE_MARKS + 9}" in (
        rig.mgr.reqs._deleted_at
    )


def test_the_adapter_puts_vllms_arrival_time_on_the_managers_clock() -> None:
    """vLLM stamps ``Request.arrival_time`` with the wall clock in the API server; the manager
    compares on its own (monotonic) clock: how long ago the request arrived carries over."""
    import time
    from types import SimpleNamespace

    from agentkv_vllm.scheduler_side import SchedulerSide
    from tests.unit.sim_engine import FakeClock

    clock = FakeClock()
    side = SimpleNamespace(manager=SimpleNamespace(clock=clock))
    at = SchedulerSide._arrived_at(side, SimpleNamespace(arrival_time=time.time() - 2.0))  # type: ignore[arg-type]
    assert at is not None and clock.now() - 2.5 < at <= clock.now() - 2.0
    ahead = SimpleNamespace(arrival_time=time.time() + 5.0)  # another host's clock, ahead
    assert SchedulerSide._arrived_at(side, ahead) == clock.now()  # type: ignore[arg-type]
    assert SchedulerSide._arrived_at(side, SimpleNamespace()) is None  # type: ignore[arg-type]
