"""Swap instead of recompute (issue 26): a preempted trajectory request's computed blocks are
copied to host before vLLM reuses them, and the rescheduled request loads them. On the simulated
engine (tests/unit/sim_engine.py): its ``preempt`` calls ``on_preempt`` with the blocks the
request held, as the adapter does from the blocks it noted in ``has_pending_block_frees``."""

from __future__ import annotations

from agentkv.manager.jobs import StepPlan
from tests.unit.manager_helpers import assert_answers, counted
from tests.unit.sim_engine import Rig, SimRequest, key_of, make_rig

P1 = [7, 7, 7, 7, 9, 9, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 1]  # 17 tokens: 4 full blocks


def _running(rig: Rig, prompt: list[int], computed: int | None = None) -> SimRequest:
    req = rig.eng.new_request("t1", "main", prompt, max_new=3)
    assert rig.eng.schedule(req)
    rig.eng.step()
    assert rig.eng.compute(req, computed)
    return req


def _preempt(rig: Rig, req: SimRequest) -> tuple[list[int], StepPlan]:
    held = list(req.blocks)
    plans: list[StepPlan] = []
    step = rig.eng.step
    rig.eng.step = lambda: plans.append(step()) or plans[-1]  # type: ignore[method-assign]
    try:
        rig.eng.preempt(req)
    finally:
        rig.eng.step = step  # type: ignore[method-assign]
    assert len(plans) <= 1
    return held, plans[0] if plans else StepPlan()


def test_preemption_saves_exactly_the_computed_blocks_and_the_reschedule_loads_them() -> None:
    rig = make_rig()
    req = _running(rig, P1)
    assert req.num_computed == 17
    held, plan = _preempt(rig, req)
    # One store of the 4 full computed blocks (the 17th token's block is partial), from the
    # blocks the request held, copied before the step's forward.
    (store,) = plan.stores
    assert store.before_forward
    assert [t.block_id for t in store.blocks] == held[:4]
    assert [t.key for t in store.blocks] == [key_of(h) for h in rig.eng.hashes(P1)[:4]]
    rig.eng.deliver_reports()
    assert rig.host_keys() == {t.key for t in store.blocks}
    counters = rig.mgr.status()["counters"]
    assert counters["preempt_saves"] == 1 and counters["preempt_saved_tokens"] == 16
    # Other traffic takes the freed blocks; the rescheduled request loads instead of recomputing.
    rig.flush()
    assert rig.eng.schedule(req)
    assert req.device_hit == 0 and req.load_n == 4
    rig.run(req)
    assert req.status == "FINISHED" and len(req.output) == 3
    assert rig.mgr.counters["loads"] == 1 and rig.mgr.counters["load_blocks"] == 4
    assert rig.eng.violations == []
    assert counted(rig) == {
        "load_blocks": 4,
        "loads": 1,
        "preempt_saved_blocks": 4,
        "preempt_saved_tokens": 16,
        "preempt_saves": 1,
    }
    assert_answers(rig, "t1")


def test_a_partly_computed_prompt_saves_only_its_full_computed_blocks() -> None:
    rig = make_rig()
    req = _running(rig, P1, computed=10)  # chunked prefill: 2 full blocks computed so far
    _, plan = _preempt(rig, req)
    (store,) = plan.stores
    assert [t.key for t in store.blocks] == [key_of(h) for h in rig.eng.hashes(P1)[:2]]
    rig.eng.deliver_reports()
    rig.flush()
    rig.run(req)
    assert req.status == "FINISHED" and rig.eng.violations == []
    assert counted(rig) == {
        "load_blocks": 2,
        "loads": 1,
        "preempt_saved_blocks": 2,
        "preempt_saved_tokens": 8,
        "preempt_saves": 1,
    }


def test_blocks_host_already_holds_are_not_copied_again() -> None:
    rig = make_rig()
    rig.turn("t1", P1)
    rig.clock.advance(1.0)
    rig.settle()  # grace expired: the context's 4 blocks are on host
    before = rig.mgr.counters["store_blocks"]
    req = _running(rig, [*P1, 4, 4, 4, 4, 4, 4, 4])  # 24 tokens: 6 full blocks
    _, plan = _preempt(rig, req)
    (store,) = plan.stores
    assert [t.key for t in store.blocks] == [
        key_of(h) for h in rig.eng.hashes([*P1, 4, 4, 4, 4, 4, 4, 4])[4:6]
    ]
    assert rig.mgr.counters["store_blocks"] == before
    assert rig.mgr.counters["preempt_saved_tokens"] == 8
    assert counted(rig) == {
        "grace_expired": 1,
        "preempt_saved_blocks": 2,
        "preempt_saved_tokens": 8,
        "preempt_saves": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_a_preemption_of_a_deleted_trajectory_saves_nothing() -> None:
    rig = make_rig()
    req = _running(rig, P1)
    rig.mgr.delete("t1")
    _, plan = _preempt(rig, req)
    assert plan.stores == [] and rig.mgr.counters["preempt_saves"] == 0
    assert counted(rig) == {"trajectories_deleted": 1}


def test_every_preemption_save_adds_its_tokens() -> None:
    """Mutant requests.RequestTable.preempt__mutmut_114 (the saved tokens set, not added): a
    request preempted twice saves 2 blocks, then the 2 it computed since."""
    rig = make_rig()
    req = _running(rig, P1, computed=10)  # 2 full blocks computed
    _preempt(rig, req)
    rig.eng.deliver_reports()
    assert rig.mgr.counters["preempt_saved_tokens"] == 8
    assert rig.eng.schedule(req)  # the device still caches the 2 blocks
    rig.eng.step()
    assert rig.eng.compute(req)
    _, plan = _preempt(rig, req)
    (store,) = plan.stores
    assert [t.key for t in store.blocks] == [key_of(h) for h in rig.eng.hashes(P1)[2:4]]
    counters = rig.mgr.counters
    assert counters["preempt_saves"] == 2 and counters["preempt_saved_tokens"] == 16
    rig.eng.deliver_reports()
    rig.run(req)
    assert req.status == "FINISHED" and rig.eng.violations == []
    assert counted(rig) == {
        "preempt_saved_blocks": 4,
        "preempt_saved_tokens": 16,
        "preempt_saves": 2,
    }
