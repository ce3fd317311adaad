"""Deterministic regression tests of the TrajectoryManager, on the simulated engine.

Each test pins down one fixed behaviour (the numbers follow the issue's list; the other topics
are in test_manager_pressure.py (3), test_manager_bugs.py (B1.., bugs the stateful test found),
test_manager_net.py (remote fetch, salts, status), test_manager_mutants.py (mutants that
survived) and test_manager_tenants.py (tenants, memory, DELETE is final)). The rig: manager_helpers.py.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from agentkv.manager import BranchState, DemotedBy
from agentkv.manager.state import Branch
from agentkv.policy import Action, PolicyParams, lease_seconds
from tests.unit.manager_helpers import (
    P1,
    SYS,
    assert_answers,
    branch,
    counted,
    disk_offloaded,
    in_thread,
    keys_of,
    offloaded,
)
from tests.unit.sim_engine import key_of, make_rig

# ============================================================================ (1) abort + load


def test_abort_during_async_load_pins_only_the_device_hit_and_stores_nothing_unloaded() -> None:
    rig = make_rig()
    offloaded(rig)
    rig.flush()
    rig.turn("t2", [*SYS, 3])  # the shared prefix is back on the device: a 2-block device hit
    req = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4])
    rig.eng.schedule(req)
    assert req.status == "WAITING_FOR_REMOTE_KVS"
    assert req.device_hit == 8 and req.load_n == 2
    loading = req.blocks[2:4]
    rig.eng.step()
    rig.eng.abort(req)  # the client gave up while the load was in flight
    # Nothing of the aborted turn is pinned; the branch keeps its last context and tier copy.
    assert branch(rig).pinned == []
    assert rig.mgr._pins == Counter(branch(rig, "t2").pinned)
    assert rig.mgr.counters["aborted_loads"] == 1
    assert branch(rig).state is BranchState.OFFLOADED
    assert all(rig.mgr.index.usable(k) for k in branch(rig).keys)
    # The load fails on the worker: those blocks never held anything.
    for p in rig.workers.completable():
        rig.workers.complete(p, ok=False)
    rig.eng.deliver_reports()
    assert all(
        rig.pool.content[0][b] != h for b, h in zip(loading, rig.eng.hashes(P1)[2:4], strict=True)
    )
    rig.clock.advance(1.0)  # grace expires: write-back of what the branch holds
    plans = [rig.eng.step() for _ in range(3)]
    stored = {t.block_id for plan in plans for job in plan.stores for t in job.blocks}
    assert not stored & set(loading)
    rig.settle()
    # The next turn loads nothing bogus and ends with the true KV.
    rig.flush()
    nxt = rig.turn("t1", [*P1, 4, 4, 4, 5, 5])
    assert nxt.status == "FINISHED"
    assert not rig.eng.violations
    for tier in ("host", "disk"):
        for key, content in rig.workers.tiers[0][tier].items():
            assert content is not None and key_of(content) == key
    assert counted(rig) == {
        "aborted_loads": 1,
        "grace_expired": 2,
        "load_blocks": 6,
        "load_failures": 1,
        "loads": 3,
        "store_blocks": 4,
        "stores": 1,
        "tier_misses": 2,
    }
    assert_answers(rig, "t1", "t2")


# ============================================================================ (2) fail closed


def test_fail_load_queues_a_load_covering_every_counted_block_with_unheld_keys() -> None:
    rig = make_rig()
    offloaded(rig)
    rig.flush()
    req = rig.eng.new_request("t1", "main", [*P1, 4])
    answer = rig.mgr.on_lookup(req.req_id, req.params, req.prompt, rig.eng.hashes(req.tokens), 0)
    assert answer.tokens == 16
    blocks = rig.pool.allocate([], 5)
    assert blocks is not None
    rig.mgr.fail_load(req.req_id, blocks, 16)  # the adapter hit an error after the lookup
    plan = rig.mgr.take_step()
    (load,) = plan.loads
    assert [t.block_id for t in load.blocks] == blocks[:4]
    held = rig.host_keys() | rig.disk_keys()
    assert all(t.key not in held for t in load.blocks)
    rig.workers.deliver(plan)
    for p in rig.workers.completable():
        rig.workers.complete(p)
    report = rig.workers.take_reports()
    assert report is not None and load.job_id in report.jobs_failed
    rig.mgr.on_report(report)
    assert rig.mgr.index.usable(keys_of(rig, P1)[0]) == "host"  # an empty key loses nothing
    assert counted(rig) == {
        "failed_closed_loads": 1,
        "grace_expired": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_plan_mismatch_fails_closed_over_every_counted_block() -> None:
    rig = make_rig()
    offloaded(rig)
    rig.flush()
    req = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4, 4, 4])
    hashes = rig.eng.hashes(req.tokens)
    answer = rig.mgr.on_lookup(req.req_id, req.params, req.prompt, hashes, 0)
    assert answer.tokens == 16
    blocks = rig.pool.allocate([], 6)
    assert blocks is not None
    rig.mgr.on_alloc(req.req_id, blocks, 20)  # vLLM counted one block more than the plan
    (load,) = rig.mgr.take_step().loads
    assert [t.block_id for t in load.blocks] == blocks[:5]
    assert all(t.key == b"" for t in load.blocks)
    assert all(rig.mgr.index.get(k).readers == 0 for k in keys_of(rig, P1))  # type: ignore[union-attr]
    assert counted(rig) == {
        "failed_closed_loads": 1,
        "grace_expired": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_too_few_blocks_for_the_counted_tokens_fail_closed() -> None:
    """Mutant requests.RequestTable.alloc__mutmut_56 (``or`` -> ``and``): blocks that cannot
    hold every counted block must fail the load closed, not load into fewer blocks."""
    rig = make_rig()
    offloaded(rig)
    rig.flush()
    req = rig.eng.new_request("t1", "main", [*P1, 4])
    hashes = rig.eng.hashes(req.tokens)
    assert rig.mgr.on_lookup(req.req_id, req.params, req.prompt, hashes, 0).tokens == 16
    blocks = rig.pool.allocate([], 3)  # one block short of the 4 counted
    assert blocks is not None
    rig.mgr.on_alloc(req.req_id, blocks, 16)
    (load,) = rig.mgr.take_step().loads
    assert [t.block_id for t in load.blocks] == blocks
    assert all(t.key == b"" for t in load.blocks)  # fail closed: vLLM recomputes them
    assert counted(rig) == {
        "failed_closed_loads": 1,
        "grace_expired": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_take_step_returns_queued_loads_when_the_tick_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = make_rig()
    offloaded(rig)
    rig.flush()
    req = rig.eng.new_request("t1", "main", [*P1, 4])
    rig.eng.schedule(req)

    def boom(now: float) -> None:
        raise RuntimeError("timer bug")

    monkeypatch.setattr(rig.mgr, "_check_pressure", boom)
    plan = rig.mgr.take_step()
    assert [job.req_id for job in plan.loads] == [req.req_id]
    assert rig.mgr.counters["internal_errors"] == 1
    assert counted(rig) == {
        "grace_expired": 1,
        "internal_errors": 1,
        "load_blocks": 4,
        "loads": 1,
        "store_blocks": 4,
        "stores": 1,
    }


# ============================================================================ (4) co-ownership


def test_prefix_blocks_in_flight_for_a_are_owned_by_b_and_survive_deleting_a() -> None:
    rig = make_rig(grace=0.0)
    rig.turn("A", [*SYS, 1], jobs=False)  # A's grace is 0: its store job is in flight
    shared = keys_of(rig, SYS)
    assert all("host" in rig.mgr.index.get(k).writing for k in shared)  # type: ignore[union-attr]
    rig.turn("B", [*SYS, 2], jobs=False)
    assert all(rig.mgr.index.owners(k) == {"A", "B"} for k in shared)
    assert set(shared) <= rig.mgr.table["B"].owned
    assert rig.mgr.delete("A")[0] == 200
    rig.settle()
    assert all(rig.mgr.index.usable(k) == "host" for k in shared)
    assert set(shared) <= rig.host_keys()
    assert rig.mgr.delete("B")[0] == 200
    rig.settle()
    assert len(rig.mgr.index) == 0 and not rig.host_keys()
    assert counted(rig) == {"store_blocks": 2, "stores": 1, "trajectories_deleted": 2}


def test_delete_drops_keys_a_trajectory_wrote_itself() -> None:
    rig = make_rig()
    offloaded(rig)
    assert rig.mgr.table["t1"].owned == set(keys_of(rig, P1))
    code, body = rig.mgr.delete("t1")
    assert code == 200 and body["dropped_tier_blocks"] == 4
    rig.settle()
    assert len(rig.mgr.index) == 0 and not rig.host_keys()
    assert counted(rig) == {
        "grace_expired": 1,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_deleted": 1,
    }


# ============================================================================ (5) DELETE mid-request


def test_delete_while_a_request_runs_pins_and_stores_nothing_and_never_comes_back() -> None:
    rig = make_rig(grace=0.0)
    offloaded(rig)
    req = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4])
    rig.eng.schedule(req)
    rig.eng.step()
    assert rig.mgr.delete("t1")[0] == 200
    assert rig.mgr.get("t1")[0] == 404
    assert len(rig.mgr.tombstones) == 1
    rig.run(req)
    assert req.status == "FINISHED"
    assert rig.mgr.get("t1")[0] == 404 and "t1" not in rig.mgr.table
    assert not rig.mgr.tombstones
    assert rig.mgr.pinned_blocks() == 0 and not any(rig.pool.pins)
    plans = [rig.eng.step() for _ in range(3)]
    assert not any(plan.stores for plan in plans)
    rig.settle()
    assert len(rig.mgr.index) == 0 and not rig.host_keys()
    assert counted(rig) == {"store_blocks": 4, "stores": 1, "trajectories_deleted": 1}


# ============================================================================ (6) index == stores


def test_the_manager_evicts_and_the_stores_follow_the_index_exactly() -> None:
    rig = make_rig(host=6, tp=2)
    for i in range(5):
        offloaded(rig, f"t{i}", [20 + i] * 8 + [1])  # 2 blocks each, 10 blocks > 6 slots
    assert rig.mgr.counters["evictions_host"] >= 4
    index_host = {k for k in rig.mgr.index if rig.mgr.index.get(k).host}  # type: ignore[union-attr]
    for rank in range(2):
        assert rig.host_keys(rank) == index_host
        assert len(rig.host_keys(rank)) <= 6
    assert not rig.eng.violations
    assert counted(rig) == {
        "evictions_host": 4,
        "grace_expired": 5,
        "store_blocks": 10,
        "stores": 5,
    }


def test_prefetch_outcome_is_scored_from_the_promote_completion_time() -> None:
    rig = make_rig(disk=32)
    paused = disk_offloaded(rig)
    b = branch(rig)
    assert b.prefetch_due is not None
    rig.clock.t = b.prefetch_due + 0.01
    rig.eng.step()  # the prefetch fires: a promote goes out
    (move,) = [m for m in rig.workers.pending if m.kind == "move"]
    assert move.job.kind == "promote"
    rig.clock.advance(5.0)  # the promote takes 5 s
    rig.workers.complete(move)
    rig.eng.deliver_reports()
    done = rig.clock.now()
    assert b.prefetch_done_at == done
    rig.clock.advance(0.5)
    resumed = rig.mgr.resume("t1", "main")
    assert rig.mgr.prefetch_outcomes.counts()["on_time"] == 1  # from the queue time: 'early'
    assert counted(rig) == {"prefetches": 1, "store_blocks": 4, "stores": 1}
    assert_answers(rig, "t1", pause=paused, resume=resumed)


def test_a_resume_during_the_promote_is_late_not_done() -> None:
    rig = make_rig(disk=32)
    disk_offloaded(rig)
    rig.clock.t = branch(rig).prefetch_due + 0.01  # type: ignore[operator]
    rig.eng.step()
    assert rig.mgr.counters["prefetches"] == 1
    rig.clock.advance(0.2)
    rig.mgr.resume("t1", "main")  # the promote is still copying
    assert rig.mgr.prefetch_outcomes.counts()["late"] == 1
    assert counted(rig) == {"prefetches": 1, "store_blocks": 4, "stores": 1}


# ============================================================================ (7) bounded


def test_idle_trajectories_expire_and_the_table_is_capped() -> None:
    rig = make_rig(idle_ttl_s=60.0, max_trajectories=3)
    offloaded(rig, "old")
    rig.clock.advance(61.0)
    in_thread(rig.mgr.tick)
    assert rig.mgr.get("old")[0] == 404
    assert rig.mgr.counters["trajectories_expired"] == 1
    rig.settle()
    assert len(rig.mgr.index) == 0
    for i in range(5):
        rig.turn(f"c{i}", [30 + i] * 5)
        assert len(rig.mgr.table) <= 3
    assert rig.mgr.counters["trajectories_capacity"] == 2
    assert list(rig.mgr.table) == ["c2", "c3", "c4"]
    assert counted(rig) == {
        "grace_expired": 1,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_capacity": 2,
        "trajectories_expired": 1,
    }
    assert_answers(rig, "c2", "c3", "c4")


def test_per_step_work_never_touches_idle_branches(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(blocks=64, host=0, grace=0.0)
    for i in range(2000):
        rig.turn(f"idle{i}", [i % 50 + 1] * 5)
    idle = {id(b) for t in rig.mgr.table.values() for b in t.branches.values()}
    assert len(idle) == 2000
    touched: set[int] = set()
    original = Branch.__getattribute__

    def spy(self: Branch, name: str) -> Any:
        touched.add(id(self))
        return original(self, name)

    monkeypatch.setattr(Branch, "__getattribute__", spy)
    live = rig.eng.new_request("busy", "main", [99] * 9, max_new=2)
    for _ in range(6):
        rig.run(live, steps=1)
        rig.mgr.take_step()
        rig.clock.advance(0.1)
    monkeypatch.setattr(Branch, "__getattribute__", original)
    assert live.status == "FINISHED"
    assert not touched & idle
    assert counted(rig) == {}


# ============================================================================ (8) timers


def test_a_control_thread_tick_fires_the_prefetch_at_its_due_time() -> None:
    rig = make_rig(disk=32)
    disk_offloaded(rig)
    due = branch(rig).prefetch_due
    assert due is not None
    assert rig.mgr.next_deadline() == pytest.approx(due - rig.clock.now())
    rig.clock.t = due - 0.01
    in_thread(rig.mgr.tick)
    assert not rig.mgr.engine_work_pending()
    rig.clock.t = due
    in_thread(rig.mgr.tick)
    assert rig.mgr.engine_work_pending()
    (move,) = rig.mgr.take_step().moves
    assert move.kind == "promote" and set(move.keys) == set(keys_of(rig, P1))
    assert counted(rig) == {"prefetches": 1, "store_blocks": 4, "stores": 1}


def test_a_control_thread_tick_expires_a_lease() -> None:
    rig = make_rig()
    rig.turn("t1", P1)
    _code, body = rig.mgr.pause("t1", "main", "fast", 0.001)
    assert body["state"] == "retained"
    lease_until = branch(rig).lease_until
    assert rig.mgr.next_deadline() == pytest.approx(lease_until - rig.clock.now())
    rig.clock.t = lease_until
    in_thread(rig.mgr.tick)
    assert rig.mgr.engine_work_pending()
    assert branch(rig).demoted_by is DemotedBy.LEASE_EXPIRED
    plan = rig.mgr.take_step()
    assert [t.block_id for job in plan.stores for t in job.blocks] == branch(rig).block_ids
    assert counted(rig) == {"lease_expired_demotions": 1, "store_blocks": 4, "stores": 1}


# ============================================================================ (10) late pause


def test_a_late_retain_repins_the_blocks_still_cached() -> None:
    rig = make_rig()
    offloaded(rig)
    code, body = rig.mgr.pause("t1", "main", "fast", 0.001)
    assert code == 200 and body["applied"] and body["state"] == "retained"
    assert rig.mgr.pinned_blocks() == 0  # pinned by the engine thread, at its next hook
    rig.eng.step()
    assert branch(rig).pinned == branch(rig).block_ids and len(branch(rig).pinned) == 4
    assert rig.mgr._pins == Counter(branch(rig).block_ids)
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


def test_a_late_retain_after_eviction_is_not_applied_and_says_why() -> None:
    rig = make_rig()
    offloaded(rig)
    rig.flush()
    code, body = rig.mgr.pause("t1", "main", "fast", 0.001)
    assert code == 200 and not body["applied"] and "evicted" in body["reason"]
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}
    assert_answers(rig, "t1", pause=body)


def test_a_late_disk_decision_copies_host_copies_down_then_drops_them_from_host() -> None:
    rig = make_rig(disk=32)
    offloaded(rig)
    keys = set(keys_of(rig, P1))
    assert rig.host_keys() == keys
    code, body = rig.mgr.pause("t1", "main", "human", 400.0)
    assert code == 200 and body["applied"] and body["decision"]["action"] == "offload_disk"
    plan = rig.eng.step()
    assert [(m.kind, set(m.keys)) for m in plan.moves] == [("demote", keys)]
    rig.settle()
    assert rig.disk_keys() == keys
    assert not rig.host_keys() & keys
    assert all(rig.mgr.index.usable(k) == "disk" for k in keys)
    assert branch(rig).state is BranchState.OFFLOADED and branch(rig).tier == "disk"
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


def test_two_late_retains_pin_once() -> None:
    rig = make_rig()
    offloaded(rig)
    assert rig.mgr.pause("t1", "main", "fast", 0.001)[1]["state"] == "retained"
    assert rig.mgr.pause("t1", "main", "slow", None)[1]["state"] == "offloaded"
    assert rig.mgr.pause("t1", "main", "fast", 0.001)[1]["state"] == "retained"
    rig.eng.step()  # two repins queued: the second finds the branch pinned
    assert rig.mgr._pins == Counter(branch(rig).block_ids)
    rig.turn("t1", [*P1, 3])
    assert rig.mgr._pins == Counter(branch(rig).pinned)
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


# ============================================================================ (13) lease


@pytest.mark.parametrize("wait", [0.0, 0.001, 0.05])
def test_the_lease_is_policy_lease_seconds(wait: float) -> None:
    policy = PolicyParams(disk_after_s=100.0, lease_margin_s=0.02)
    rig = make_rig(policy=policy)
    rig.turn("t1", P1)
    now = rig.clock.now()
    _code, body = rig.mgr.pause("t1", "main", "tool", wait)
    decision = body["decision"]
    assert decision["action"] == "retain"
    expected = lease_seconds(decision["break_even_wait_s"], decision["wait_p50_s"], policy)
    assert decision["lease_s"] == pytest.approx(expected)
    assert branch(rig).lease_until - now == pytest.approx(expected)
    assert counted(rig) == {}


def test_a_client_retention_ttl_caps_the_lease() -> None:
    policy = PolicyParams(disk_after_s=100.0, lease_margin_s=5.0)
    rig = make_rig(policy=policy)
    rig.turn("t1", P1)
    now = rig.clock.now()
    _code, body = rig.mgr.pause("t1", "main", "tool", 0.001, max_lease_s=0.5)
    assert body["decision"]["action"] == "retain"
    assert body["decision"]["lease_s"] == 0.5  # the policy alone would give >= 5 s
    assert branch(rig).lease_until - now == pytest.approx(0.5)
    assert counted(rig) == {}


def test_a_pause_is_logged_with_its_decision(caplog: pytest.LogCaptureFixture) -> None:
    """Operators read pauses in the server log: trajectory/branch, tool and the action."""
    rig = make_rig()
    rig.turn("t1", P1)
    with caplog.at_level("INFO", logger="agentkv"):
        _code, body = rig.mgr.pause("t1", "main", "fast", 0.001)
    lines = [r.getMessage() for r in caplog.records if "pause" in r.getMessage()]
    assert any(
        "t1/main" in x and "tool=fast" in x and body["decision"]["action"] in x for x in lines
    )
    assert counted(rig) == {}


def test_a_late_offload_after_the_engine_dropped_the_branch_is_not_applied() -> None:
    """An offload decided after the grace period already dropped the branch cannot copy what is
    gone: it answers applied false with the reason (it must never be taken for a drop, which
    applies)."""
    rig = make_rig(default_action=Action.DROP, policy_override=Action.OFFLOAD_HOST)
    rig.turn("t1", P1)
    rig.clock.advance(1.0)
    rig.settle()
    assert branch(rig).state is BranchState.DROPPED
    code, body = rig.mgr.pause("t1", "main", "human", 60.0)
    assert code == 200 and body["decision"]["action"] == "offload_host", body
    assert body["applied"] is False
    assert "released before the decision" in body["reason"]
    assert branch(rig).state is BranchState.DROPPED
    assert counted(rig) == {"grace_expired": 1}


def test_a_pause_while_the_branch_runs_is_applied_when_the_request_finishes() -> None:
    rig = make_rig()
    rig.turn("t1", P1)
    req = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4], max_new=2)
    assert rig.eng.schedule(req)
    code, body = rig.mgr.pause("t1", "main", "human", 300.0)
    assert (code, body["applied"], body["state"]) == (200, False, "active")
    assert body["reason"] == "a request of this branch is running: applied when it finishes"
    assert body["decision"]["action"] == "offload_host" and branch(rig).pending is not None
    rig.run(req)
    assert branch(rig).pending is None
    assert branch(rig).state is BranchState.OFFLOADING  # no grace: the decision, at once
    rig.settle()
    assert branch(rig).state is BranchState.OFFLOADED and branch(rig).tier == "host"
    assert counted(rig) == {"store_blocks": 5, "stores": 1}  # 22 tokens: 5 full blocks


def test_a_fixed_disk_policy_without_a_disk_tier_offloads_to_host() -> None:
    rig = make_rig(policy_override=Action.OFFLOAD_DISK)
    rig.turn("t1", P1)
    code, body = rig.mgr.pause("t1", "main", "fast", 0.001)
    assert code == 200 and body["decision"]["action"] == "offload_host"
    assert body["decision"]["rationale"].startswith("offload_disk (fixed by policy_override")
    assert rig.mgr.status()["decisions"] == {"offload_host": 1}
    rig.settle()
    assert branch(rig).state is BranchState.OFFLOADED and branch(rig).tier == "host"


def test_a_pause_of_an_unknown_branch_is_a_404_that_names_it() -> None:
    rig = make_rig()
    rig.turn("t1", P1)
    assert rig.mgr.pause("t1", "side", "grep", 1.0) == (
        404,
        {"detail": "trajectory 't1' has no branch 'side'"},
    )
    assert rig.mgr.pause("t9", "main", "grep", 1.0) == (404, {"detail": "unknown trajectory 't9'"})
    assert rig.mgr.resume("t1", "side") == (
        404,
        {"detail": "unknown trajectory or branch 't1'"},
    )
    assert rig.mgr.status()["decisions"] == {} and branch(rig).tool is None


def test_a_disk_decision_during_the_host_store_is_applied_when_the_store_completes() -> None:
    rig = make_rig(disk=32)
    rig.turn("t1", P1)
    rig.clock.advance(1.0)
    rig.eng.step()  # grace expired: the host store is in flight
    assert branch(rig).state is BranchState.OFFLOADING
    code, body = rig.mgr.pause("t1", "main", "human", 400.0)
    assert (code, body["applied"], body["state"]) == (200, True, "offloading")
    assert body["reason"] == "applied when the copy in flight completes"
    rig.settle()  # the host store completes, then the pending disk decision copies down
    assert branch(rig).pending is None
    assert branch(rig).state is BranchState.OFFLOADED and branch(rig).tier == "disk"
    assert rig.disk_keys() == set(keys_of(rig, P1)) and not rig.host_keys()
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


def test_a_late_drop_decision_releases_the_tier_copy() -> None:
    from agentkv.costs import CostModel

    rig = make_rig()
    offloaded(rig)
    rig.mgr.costs = CostModel(host_link_bytes_per_s=1e8, prefill_tokens_per_s=1e9)  # recompute
    code, body = rig.mgr.pause("t1", "main", "tool", 5.0)
    assert (code, body["applied"], body["state"]) == (200, True, "dropped")
    assert body["decision"]["action"] == "drop" and "reason" not in body
    assert branch(rig).tier is None and not rig.mgr.table["t1"].owned
    rig.settle()
    assert len(rig.mgr.index) == 0 and not rig.host_keys()
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


def test_a_branch_with_two_requests_running_is_held_only_when_both_finished() -> None:
    rig = make_rig()
    first = rig.eng.new_request("t1", "main", P1, max_new=1)
    second = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4], max_new=1)
    assert rig.eng.schedule(first) and rig.eng.schedule(second)
    rig.run(first)
    assert branch(rig).state is BranchState.ACTIVE and len(branch(rig).running) == 1
    assert rig.mgr.status()["branches_by_state"]["held"] == 0
    rig.run(second)
    assert branch(rig).state is BranchState.HELD and not branch(rig).running
    assert len(branch(rig).keys) == 5 and rig.mgr.table["t1"].turn_count == 2
    # Two requests of one branch at once: told, not merged silently (issue 42)
    assert second.stats is not None and second.stats["concurrent_turns"] == 1
    assert rig.eng.violations == [] and counted(rig) == {"concurrent_turns": 1}
