"""Device prefetch (agentkv/manager/prefetch.py) on the simulated engine: at the predicted
return an internal prefill-only request loads the paused branch's context into device blocks,
which the manager pins until the real turn arrives (on time), the lease ends (wasted), or the
turn came first (late). Each "never worse" skip rule has its own test."""

from __future__ import annotations

import pytest

from agentkv.manager import BranchState
from agentkv.manager.prefetch import PrefetchState
from agentkv.policy import PolicyParams
from tests.unit.manager_helpers import assert_answers, counted
from tests.unit.sim_engine import Rig, SimRequest, make_rig
from tests.unit.test_manager import P1, branch

NEXT = [*P1, 5, 5, 5, 5, 5]  # the next turn: P1's 4 full blocks, then the tool's result


def _offloaded(rig: Rig, wait: float | None = 2.0, tool: str = "build") -> None:
    """One turn of t1, paused on ``tool`` with a declared wait, offloaded to a tier, and its
    device blocks flushed from vLLM's prefix cache by other traffic."""
    rig.turn("t1", P1)
    code, body = rig.mgr.pause("t1", "main", tool, wait)
    assert code == 200 and body["decision"]["action"] in ("offload_host", "offload_disk"), body
    rig.clock.advance(0.05)
    rig.settle()
    assert branch(rig).state is BranchState.OFFLOADED
    rig.flush()
    assert rig.mgr.pins.still_cached(branch(rig)) == 0


def _due(rig: Rig) -> list[SimRequest]:
    """The clock reaches the prefetch's due time; the engine steps; the pump issues orders."""
    due = branch(rig).prefetch_due
    assert due is not None
    rig.clock.t = max(rig.clock.t, due + 0.01)
    rig.eng.step()
    return rig.eng.issue_prefetches()


def _prefetched() -> Rig:
    """t1 offloaded to host, its device prefetch due, issued and run: the branch RETAINED with
    the prefetch READY."""
    rig = make_rig(device_prefetch=True)
    _offloaded(rig)
    (pre,) = _due(rig)
    rig.run(pre)
    return rig


def _outcomes(rig: Rig) -> dict[str, int]:
    view = rig.mgr.status()["device_prefetch"]
    return {k: view[k] for k in ("on_time", "late", "wasted")}


@pytest.mark.parametrize("disk", [False, True])
def test_a_resume_after_the_prefetch_is_a_device_hit(disk: bool) -> None:
    rig = make_rig(device_prefetch=True, disk=32 if disk else 0)
    _offloaded(rig, 400.0 if disk else 2.0, "human" if disk else "build")
    assert branch(rig).tier == ("disk" if disk else "host")
    (pre,) = _due(rig)
    assert pre.prompt == P1 and pre.max_new == 1
    assert rig.mgr.counters["device_prefetch_orders"] == 1
    assert rig.mgr.counters["device_prefetch_repins"] == 0
    rig.run(pre)
    b = branch(rig)
    assert b.state is BranchState.RETAINED and len(b.pinned) == 4
    assert b.device_prefetch is not None and b.device_prefetch.state is PrefetchState.READY
    assert rig.mgr.table["t1"].turn_count == 1  # the internal request is never a turn
    assert rig.mgr.get("t1")[1]["branches"]["main"]["prefetch"]["device"] == "ready"
    rig.clock.advance(0.5)
    stats = rig.turn("t1", NEXT).stats
    assert stats is not None
    assert (stats["device_hit_tokens"], stats["tier_hit_tokens"]) == (16, 0)
    assert stats["prefetch"] == "on_time"
    assert _outcomes(rig) == {"on_time": 1, "late": 0, "wasted": 0}
    per_tool = rig.mgr.status()["device_prefetch"]["per_tool"]
    assert per_tool["human" if disk else "build"]["on_time"] == 1
    assert not rig.eng.violations
    assert counted(rig) == {
        "device_prefetch_on_time": 1,
        "device_prefetch_orders": 1,
        "device_prefetch_ready": 1,
        "load_blocks": 4,
        "loads": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_without_the_prefetch_the_same_resume_reloads_from_the_tier() -> None:
    """The control: the same scenario with device prefetch off is a tier hit."""
    rig = make_rig(device_prefetch=False)
    _offloaded(rig)
    assert _due(rig) == []
    rig.clock.advance(0.5)
    stats = rig.turn("t1", NEXT).stats
    assert stats is not None and stats["tier_hit_tokens"] == 16
    assert counted(rig) == {"load_blocks": 4, "loads": 1, "store_blocks": 4, "stores": 1}


def test_a_resume_before_the_prefetch_is_due_is_late_and_loads_exact_kv() -> None:
    rig = make_rig(device_prefetch=True)
    _offloaded(rig)
    stats = rig.turn("t1", NEXT).stats  # 0.05 s after the pause, due at ~0.9 s
    assert stats is not None and stats["tier_hit_tokens"] == 16
    assert stats["prefetch"] == "late"
    assert _outcomes(rig) == {"on_time": 0, "late": 1, "wasted": 0}
    assert rig.eng.issue_prefetches() == []
    assert not rig.eng.violations
    assert counted(rig) == {
        "device_prefetch_late": 1,
        "load_blocks": 4,
        "loads": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_a_resume_during_the_prefetch_load_cancels_it_and_pins_nothing_for_it() -> None:
    rig = make_rig(device_prefetch=True)
    _offloaded(rig)
    (pre,) = _due(rig)
    rig.eng.schedule(pre)  # looked up: its load is in flight
    assert pre.status == "WAITING_FOR_REMOTE_KVS"
    assert branch(rig).device_prefetch.state is PrefetchState.LOADING  # type: ignore[union-attr]
    real = rig.eng.new_request("t1", "main", NEXT, max_new=0)
    rig.run(real)
    assert real.stats is not None and real.stats["tier_hit_tokens"] == 16
    assert _outcomes(rig)["late"] == 1
    rig.eng.issue_prefetches()  # the pump aborts the cancelled request
    rig.settle()
    assert pre.status == "FINISHED"
    b = branch(rig)
    assert b.device_prefetch is None and b.state is not BranchState.RETAINED
    assert rig.mgr.pinned_blocks() == len(b.pinned)
    assert not rig.eng.violations
    assert counted(rig) == {
        "device_prefetch_late": 1,
        "device_prefetch_orders": 1,
        "load_blocks": 8,
        "loads": 2,
        "store_blocks": 4,
        "stores": 1,
    }


def test_a_cancelled_prefetch_request_waits_to_be_aborted_and_never_computes() -> None:
    rig = make_rig(device_prefetch=True)
    _offloaded(rig)
    (pre,) = _due(rig)
    rig.mgr.resume("t1", "main")  # the tool returned before the request was looked up
    for _ in range(3):
        assert not rig.eng.schedule(pre)  # PENDING until the pump aborts it
    assert rig.mgr.prefetcher.take_cancels() == [pre.params.prefetch]
    assert counted(rig) == {
        "device_prefetch_late": 1,
        "device_prefetch_orders": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_an_unused_prefetch_is_demoted_when_its_lease_ends() -> None:
    rig = _prefetched()
    b = branch(rig)
    lease_until = b.lease_until
    assert lease_until == pytest.approx(b.paused_at + 4.0 + 1.0)  # type: ignore[operator]
    rig.clock.t = lease_until
    plan = rig.eng.step()
    assert plan.stores == []  # the tier copy still holds it: nothing is written
    rig.settle()
    assert b.state is BranchState.OFFLOADED and b.tier == "host" and b.pinned == []
    assert _outcomes(rig) == {"on_time": 0, "late": 0, "wasted": 1}
    assert rig.mgr.pinned_blocks() == 0
    stats = rig.turn("t1", NEXT).stats  # still exact: a device or tier hit
    assert stats is not None and stats["hit_tokens"] == 16
    assert counted(rig) == {
        "device_prefetch_orders": 1,
        "device_prefetch_ready": 1,
        "device_prefetch_wasted": 1,
        "lease_expired_demotions": 1,
        "load_blocks": 4,
        "loads": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_pool_pressure_demotes_a_prefetched_branch_first_class() -> None:
    rig = make_rig(device_prefetch=True, blocks=24, high_water=0.75)
    _offloaded(rig)
    (pre,) = _due(rig)
    rig.run(pre)
    assert branch(rig).state is BranchState.RETAINED
    assert rig.eng.spike(15)  # other traffic: 4 pinned + 15 > 0.75 * 24
    rig.eng.step()
    rig.settle()
    assert branch(rig).state is BranchState.OFFLOADED
    assert _outcomes(rig)["wasted"] == 1
    assert counted(rig) == {
        "device_prefetch_orders": 1,
        "device_prefetch_ready": 1,
        "device_prefetch_wasted": 1,
        "load_blocks": 4,
        "loads": 1,
        "pressure_demotions": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_a_context_still_cached_on_the_device_is_repinned_without_a_request() -> None:
    rig = make_rig(device_prefetch=True)
    rig.turn("t1", P1)
    rig.mgr.pause("t1", "main", "build", 2.0)
    rig.clock.advance(0.05)
    rig.settle()  # offloaded; its device copy is still in vLLM's prefix cache
    assert _due(rig) == []
    rig.settle()
    b = branch(rig)
    assert b.state is BranchState.RETAINED and len(b.pinned) == 4
    assert rig.mgr.counters["device_prefetch_repins"] == 1
    rig.flush()  # pinned: other traffic cannot take them
    stats = rig.turn("t1", NEXT).stats
    assert stats is not None and stats["device_hit_tokens"] == 16
    assert _outcomes(rig)["on_time"] == 1
    assert counted(rig) == {
        "device_prefetch_on_time": 1,
        "device_prefetch_repins": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_delete_cancels_an_ordered_prefetch() -> None:
    rig = make_rig(device_prefetch=True)
    _offloaded(rig)
    rig.clock.t = branch(rig).prefetch_due + 0.01  # type: ignore[operator]
    rig.eng.step()
    b = branch(rig)
    ticket = b.device_prefetch.ticket  # type: ignore[union-attr]
    rig.mgr.delete("t1")
    orders, cancels = rig.mgr.take_prefetch_work()
    assert orders == [] and cancels == [ticket]
    assert counted(rig) == {
        "device_prefetch_orders": 1,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_deleted": 1,
    }


def test_a_forged_ticket_is_served_as_a_vanilla_request() -> None:
    rig = make_rig(device_prefetch=True)
    _offloaded(rig)
    forged = rig.eng.new_request("t1", "main", P1, max_new=1, prefetch="f" * 32)
    rig.run(forged)
    assert forged.status == "FINISHED" and forged.stats is None
    assert rig.mgr.table["t1"].turn_count == 1
    assert branch(rig).state is BranchState.OFFLOADED
    assert counted(rig) == {"store_blocks": 4, "stores": 1}


# ---------------------------------------------------------------- the "never worse" rules


def _skipped(rig: Rig) -> dict[str, int]:
    return dict(rig.mgr.status()["device_prefetch"]["skipped"])


def test_skip_a_wide_prediction_spread_and_keep_the_disk_promote() -> None:
    rig = make_rig(device_prefetch=True, disk=32)
    _offloaded(rig, 400.0, "human")
    rig.mgr.policy = PolicyParams(disk_after_s=100.0, device_prefetch_max_spread=3.0)
    assert _due(rig) == []  # a declared wait's p90 / p10 is 4
    assert _skipped(rig) == {"spread": 1}
    per_tool = rig.mgr.status()["device_prefetch"]["per_tool"]
    assert per_tool["human"]["skipped"] == {"spread": 1}  # under the pause's tool
    assert rig.mgr.counters["prefetches"] == 1  # disk -> host still runs
    assert counted(rig) == {
        "device_prefetch_skipped_spread": 1,
        "prefetches": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_skip_when_the_queue_waits_on_blocks() -> None:
    rig = make_rig(device_prefetch=True, blocks=24)
    _offloaded(rig)
    assert not rig.eng.spike(40)  # a request the scheduler cannot admit
    assert _due(rig) == []
    assert _skipped(rig) == {"queue": 1}
    assert counted(rig) == {"device_prefetch_skipped_queue": 1, "store_blocks": 4, "stores": 1}


def test_skip_when_the_prefetch_would_pass_high_water() -> None:
    rig = make_rig(device_prefetch=True, blocks=24, high_water=0.75)
    _offloaded(rig)
    assert rig.eng.spike(14)  # running work: 14 + 5 blocks > 0.75 * 24
    assert _due(rig) == []
    assert _skipped(rig) == {"headroom": 1}
    assert counted(rig) == {"device_prefetch_skipped_headroom": 1, "store_blocks": 4, "stores": 1}


def test_skip_a_running_branch_and_a_deleted_trajectory_orders_nothing() -> None:
    rig = make_rig(device_prefetch=True)
    _offloaded(rig)
    b = branch(rig)
    traj = rig.mgr.table["t1"]
    rig.mgr.delete("t1")
    assert not rig.mgr.prefetcher.start(traj, b, rig.clock.now())
    assert _skipped(rig) == {"busy": 1}
    assert counted(rig) == {
        "device_prefetch_skipped_busy": 1,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_deleted": 1,
    }


def test_the_clients_resume_counts_the_outcome_and_the_next_turn_reports_it() -> None:
    rig = _prefetched()
    rig.mgr.resume("t1", "main")  # the tool returned: on time (its blocks are pinned)
    assert _outcomes(rig)["on_time"] == 1
    stats = rig.turn("t1", NEXT).stats
    assert stats is not None and stats["prefetch"] == "on_time"
    assert stats["device_hit_tokens"] == 16
    assert _outcomes(rig)["on_time"] == 1  # counted once
    assert counted(rig) == {
        "device_prefetch_on_time": 1,
        "device_prefetch_orders": 1,
        "device_prefetch_ready": 1,
        "load_blocks": 4,
        "loads": 1,
        "store_blocks": 4,
        "stores": 1,
    }
    assert_answers(rig, "t1")


# ---------------------------------------------------------------- the shared rule, alone


def test_the_rule_checks_alive_context_spread_queue_headroom_in_that_order() -> None:
    from agentkv.predict import WaitEstimate
    from agentkv.prefetch_rule import SkipReason, device_prefetch_skip

    declared = WaitEstimate(1.0, 2.0, 4.0, "declared")
    ok = dict(
        alive=True,
        blocks=4,
        estimate=declared,
        max_spread=8.0,
        queue_blocked=False,
        pool_usage=0.5,
        total_blocks=40,
        high_water=0.88,
    )
    assert device_prefetch_skip(**ok) is None  # type: ignore[arg-type]
    cases = [
        ({"alive": False}, SkipReason.BUSY),
        ({"blocks": 0}, SkipReason.NO_CONTEXT),
        ({"estimate": None}, SkipReason.SPREAD),
        ({"estimate": WaitEstimate(0.5, 5.0, 60.0, "prior")}, SkipReason.SPREAD),
        ({"estimate": WaitEstimate(0.0, 0.0, 0.0, "declared")}, SkipReason.SPREAD),
        ({"queue_blocked": True}, SkipReason.QUEUE),
        ({"pool_usage": 0.8}, SkipReason.HEADROOM),  # 0.8 + 5/40 > 0.88
    ]
    for change, why in cases:
        assert device_prefetch_skip(**{**ok, **change}) is why, change  # type: ignore[arg-type]


def test_a_prefetch_aborted_during_its_load_pins_nothing_and_counts_failed() -> None:
    rig = make_rig(device_prefetch=True)
    _offloaded(rig)
    (pre,) = _due(rig)
    rig.eng.schedule(pre)
    assert pre.status == "WAITING_FOR_REMOTE_KVS"  # its tier load is in flight
    rig.eng.abort(pre)  # the engine ends it before any block was loaded or computed
    rig.settle()
    b = branch(rig)
    assert b.device_prefetch is None and b.state is BranchState.OFFLOADED and b.pinned == []
    assert rig.mgr.pinned_blocks() == 0
    stats = rig.turn("t1", NEXT).stats  # the real turn loads from the tier
    assert stats is not None and (stats["tier_hit_tokens"], stats["prefetch"]) == (16, None)
    assert not rig.eng.violations
    assert counted(rig) == {
        "device_prefetch_failed": 1,
        "device_prefetch_orders": 1,
        "load_blocks": 8,  # the prefetch's load, then the turn's
        "loads": 2,
        "store_blocks": 4,
        "stores": 1,
    }


def test_a_new_pause_while_the_prefetch_is_ready_counts_it_wasted() -> None:
    rig = _prefetched()
    assert branch(rig).device_prefetch.state is PrefetchState.READY  # type: ignore[union-attr]
    assert rig.mgr.pause("t1", "main", "build", 2.0)[0] == 200  # no turn since: a new pause
    assert branch(rig).device_prefetch is None
    assert _outcomes(rig) == {"on_time": 0, "late": 0, "wasted": 1}
    assert rig.mgr.status()["device_prefetch"]["per_tool"]["build"]["wasted"] == 1
    assert counted(rig) == {
        "device_prefetch_orders": 1,
        "device_prefetch_ready": 1,
        "device_prefetch_wasted": 1,
        "load_blocks": 4,
        "loads": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_a_disk_context_still_cached_is_repinned_and_not_promoted_too() -> None:
    """Mutant prefetch.DevicePrefetcher.start__mutmut_48 (a repin reported as a skip): the
    PREFETCH timer then also promoted the disk copy to host, a copy nobody needs."""
    rig = make_rig(device_prefetch=True, disk=32)
    rig.turn("t1", P1)
    assert rig.mgr.pause("t1", "main", "human", 400.0)[1]["decision"]["action"] == "offload_disk"
    rig.settle()  # on disk; its device copy is still in vLLM's prefix cache
    assert branch(rig).tier == "disk"
    assert _due(rig) == []
    assert branch(rig).state is BranchState.RETAINED and len(branch(rig).pinned) == 4
    assert not any(p.kind == "move" for p in rig.workers.pending) and not rig.host_keys()
    assert counted(rig) == {"device_prefetch_repins": 1, "store_blocks": 4, "stores": 1}


def test_every_prefetch_order_counts() -> None:
    """Mutant prefetch.DevicePrefetcher.start__mutmut_70 (the orders counter set to 1)."""
    rig = make_rig(device_prefetch=True)
    for tid in ("t1", "t2"):
        rig.turn(tid, P1 if tid == "t1" else [3] * 16 + [1])
        assert rig.mgr.pause(tid, "main", "build", 2.0)[0] == 200
    rig.clock.advance(0.05)
    rig.settle()
    rig.flush()
    rig.clock.advance(2.0)  # both prefetches are due
    rig.eng.step()
    assert len(rig.eng.issue_prefetches()) == 2
    assert rig.mgr.counters["device_prefetch_orders"] == 2
