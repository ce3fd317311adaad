"""Deterministic regression tests of the TrajectoryManager, on the simulated engine.

Each test pins down one fixed behaviour (the numbers follow the issue's list; B1.. are bugs the
stateful test found). The rig: 4-token blocks, a 40-block pool, 1 MiB blocks (a 4-block context
reloads from host in 0.04 s and recomputes in 0.17 s), grace 0.5 s, job timeout 10 s.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections import Counter
from typing import Any

import pytest

from agentkv.manager import BranchState
from agentkv.manager.state import Branch, scoped_id
from agentkv.policy import CostModel, PolicyParams, lease_seconds
from tests.unit.sim_engine import GARBAGE, Rig, key_of, make_rig

SYS = [7, 7, 7, 7, 9, 9, 9, 9]  # two blocks every trajectory shares
P1 = [*SYS, 1, 2, 3, 4, 5, 6, 7, 8, 1]  # 17 tokens: 4 full blocks


def keys_of(rig: Rig, tokens: list[int]) -> list[bytes]:
    return [key_of(h) for h in rig.eng.hashes(tokens)]


def in_thread(fn: Any, *args: Any) -> Any:
    """Run ``fn`` on another thread (the control channel), return its result."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def offloaded(rig: Rig, traj: str = "t1", prompt: list[int] = P1) -> None:
    """One finished turn of ``traj``, its grace expired, its host copy written."""
    rig.turn(traj, prompt)
    rig.clock.advance(1.0)
    rig.settle()
    assert rig.mgr.table[traj].branches["main"].state is BranchState.OFFLOADED


def branch(rig: Rig, traj: str = "t1", name: str = "main", tenant: str | None = None) -> Branch:
    return rig.mgr.table[scoped_id(traj, tenant)].branches[name]


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
    assert branch(rig, demoted).demoted_by == "queue_blocked"
    rig.settle()  # the write-back completes and hands the blocks back
    assert rig.eng.spike(6)  # the waiting request is admitted now
    assert rig.eng.violations == []


def test_a_blocked_queue_ends_grace_pins_early() -> None:
    rig = make_rig(blocks=20, high_water=0.99, grace=30.0)
    rig.turn("t0", [10] * 12 + [1])  # HELD for 30 s, 3 blocks pinned
    assert branch(rig, "t0").state is BranchState.HELD
    assert rig.eng.spike(16)  # 19 of 20 used
    assert not rig.eng.spike(3)
    rig.eng.step()
    assert rig.mgr.counters["grace_shortened"] == 1
    assert branch(rig, "t0").state is not BranchState.HELD
    assert branch(rig, "t0").demoted_by == "queue_blocked"
    assert rig.eng.violations == []


def test_a_pause_while_the_queue_is_blocked_does_not_retain() -> None:
    rig = make_rig(blocks=20, high_water=0.99)
    rig.turn("t0", [10] * 12 + [1])
    assert rig.eng.spike(16)
    assert not rig.eng.spike(3)
    rig.eng.step()
    code, body = rig.mgr.pause("t0", "main", "fast", 0.001)  # retains on a free pool
    assert code == 200 and body["decision"]["action"] != "retain"
    assert "retain would delay waiting requests" in body["decision"]["rationale"]


def test_writebacks_unread_counts_copies_that_left_without_a_load() -> None:
    rig = make_rig()
    offloaded(rig)  # a write-back of 4 blocks nobody reads
    assert rig.mgr.status()["counters"]["writebacks_unread"] == 0
    rig.mgr.delete("t1")
    rig.settle()
    assert rig.mgr.status()["counters"]["writebacks_unread"] == 4


def test_a_write_back_a_load_read_is_not_counted_unread() -> None:
    rig = make_rig()
    offloaded(rig)
    rig.flush()  # vLLM's cache lost the blocks: the turn loads them from host
    rig.turn("t1", [*P1, 4, 4, 4])
    assert rig.mgr.counters["loads"] >= 1
    rig.mgr.delete("t1")
    rig.settle()
    assert rig.mgr.status()["counters"]["writebacks_unread"] == 0


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


def test_delete_drops_keys_a_trajectory_wrote_itself() -> None:
    rig = make_rig()
    offloaded(rig)
    assert rig.mgr.table["t1"].owned == set(keys_of(rig, P1))
    code, body = rig.mgr.delete("t1")
    assert code == 200 and body["dropped_tier_blocks"] == 4
    rig.settle()
    assert len(rig.mgr.index) == 0 and not rig.host_keys()


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


def _disk_offloaded(rig: Rig, wait: float = 400.0) -> dict[str, Any]:
    rig.turn("t1", P1)
    code, body = rig.mgr.pause("t1", "main", "human", wait)
    assert code == 200 and body["decision"]["action"] == "offload_disk", body
    rig.settle()
    assert branch(rig).state is BranchState.OFFLOADED and branch(rig).tier == "disk"
    return body


def test_prefetch_outcome_is_scored_from_the_promote_completion_time() -> None:
    rig = make_rig(disk=32)
    _disk_offloaded(rig)
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
    rig.mgr.resume("t1", "main")
    assert rig.mgr.prefetch_outcomes.counts()["on_time"] == 1  # from the queue time: 'early'


def test_a_resume_during_the_promote_is_late_not_done() -> None:
    rig = make_rig(disk=32)
    _disk_offloaded(rig)
    rig.clock.t = branch(rig).prefetch_due + 0.01  # type: ignore[operator]
    rig.eng.step()
    assert rig.mgr.counters["prefetches"] == 1
    rig.clock.advance(0.2)
    rig.mgr.resume("t1", "main")  # the promote is still copying
    assert rig.mgr.prefetch_outcomes.counts()["late"] == 1


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
    assert rig.mgr.counters["trajectories_evicted_cap"] == 2
    assert list(rig.mgr.table) == ["c2", "c3", "c4"]


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


# ============================================================================ (8) timers


def test_a_control_thread_tick_fires_the_prefetch_at_its_due_time() -> None:
    rig = make_rig(disk=32)
    _disk_offloaded(rig)
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
    assert branch(rig).demoted_by == "lease_expired"
    plan = rig.mgr.take_step()
    assert [t.block_id for job in plan.stores for t in job.blocks] == branch(rig).block_ids


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


def test_a_late_retain_after_eviction_is_not_applied_and_says_why() -> None:
    rig = make_rig()
    offloaded(rig)
    rig.flush()
    code, body = rig.mgr.pause("t1", "main", "fast", 0.001)
    assert code == 200 and not body["applied"] and "evicted" in body["reason"]


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


def test_a_client_retention_ttl_caps_the_lease() -> None:
    policy = PolicyParams(disk_after_s=100.0, lease_margin_s=5.0)
    rig = make_rig(policy=policy)
    rig.turn("t1", P1)
    now = rig.clock.now()
    _code, body = rig.mgr.pause("t1", "main", "tool", 0.001, max_lease_s=0.5)
    assert body["decision"]["action"] == "retain"
    assert body["decision"]["lease_s"] == 0.5  # the policy alone would give >= 5 s
    assert branch(rig).lease_until - now == pytest.approx(0.5)


# ============================================================================ bugs the state machine found


def test_b1_a_key_revived_while_its_store_is_in_flight_is_not_written_twice() -> None:
    """A branch's new context drops its old keys (doomed while their store runs); the next
    turn wants them again: they are revived, not written a second time (which raised)."""
    rig = make_rig(grace=0.0)
    rig.turn("t1", [*SYS, 1], jobs=False)  # store of the SYS blocks in flight
    rig.turn("t1", [1], jobs=False)  # the branch's context no longer holds them
    assert all(rig.mgr.index.get(k).doomed for k in keys_of(rig, SYS))  # type: ignore[union-attr]
    rig.turn("t1", [*SYS, 2], jobs=False)  # wants them again
    assert all(not rig.mgr.index.get(k).doomed for k in keys_of(rig, SYS))  # type: ignore[union-attr]
    rig.settle()
    assert all(rig.mgr.index.usable(k) == "host" for k in keys_of(rig, SYS))
    assert rig.mgr.pinned_blocks() == 0 and not any(rig.pool.pins)


def test_b2_a_store_failed_on_one_rank_leaves_no_copy_on_the_others() -> None:
    rig = make_rig(tp=2, grace=0.0)
    rig.turn("t1", P1, jobs=False)
    rig.eng.step()
    stores = [p for p in rig.workers.pending if p.kind == "store"]
    rig.workers.complete(next(p for p in stores if p.rank == 0), ok=False)
    rig.workers.complete(next(p for p in stores if p.rank == 1), ok=True)
    assert rig.host_keys(1) == set(keys_of(rig, P1))
    rig.eng.deliver_reports()
    rig.eng.step()
    assert not rig.host_keys(0) and not rig.host_keys(1)
    assert rig.mgr.index.reserved("host") == 0


def test_b3_late_ranks_each_get_their_copies_dropped_and_slots_stay_taken_until_then() -> None:
    rig = make_rig(tp=2, grace=0.0, host=4)
    rig.workers.silent.add(1)
    rig.turn("t1", P1, jobs=False)
    rig.eng.step()
    for p in rig.workers.completable():  # rank 0 finishes in time, rank 1 is stuck
        rig.workers.complete(p)
    rig.clock.advance(11.0)
    rig.eng.step()  # the store times out
    rig.eng.deliver_reports()  # rank 0's report arrives after the timeout
    rig.eng.step()
    assert not rig.host_keys(0)
    assert rig.mgr.index.reserved("host") == 4  # rank 1 may still write those 4 blocks
    assert rig.mgr.index.free("host") == 0
    rig.workers.wake(1)  # rank 1 writes late and reports
    assert rig.host_keys(1) == set(keys_of(rig, P1))
    rig.eng.deliver_reports()
    rig.eng.step()
    assert not rig.host_keys(1)
    assert rig.mgr.index.reserved("host") == 0
    assert not rig.mgr._poisoned and not rig.mgr._timed_out


def test_b4_a_lost_key_spoils_its_write_in_flight() -> None:
    """A drop of a key overtakes its write: ranks that wrote lose the copy, so the write never
    becomes readable (the index would list a copy rank 0 lacks)."""
    rig = make_rig(tp=2, grace=0.0)
    rig.turn("t1", P1, jobs=False)
    rig.eng.step()
    key = keys_of(rig, P1)[0]
    rank0 = next(p for p in rig.workers.pending if p.kind == "store" and p.rank == 0)
    rig.workers.complete(rank0)
    rig.eng.deliver_reports()
    from agentkv.manager import WorkerReport

    rig.mgr.on_report(WorkerReport(bad_keys={key: "corrupt"}))  # e.g. another job's read
    rig.eng.step()  # the drop reaches both ranks
    for p in rig.workers.completable():
        rig.workers.complete(p)
    rig.eng.deliver_reports()
    rig.eng.step()
    assert rig.mgr.index.usable(key) is None
    assert key not in rig.host_keys(0) and key not in rig.host_keys(1)
    others = set(keys_of(rig, P1)[1:])
    assert rig.host_keys(0) == rig.host_keys(1) == others


def test_b5_no_new_write_of_a_key_a_late_rank_may_still_publish() -> None:
    """A disk store timed out (rank 1 stuck; its source blocks are unpinned and reused since).
    A copy-down of the same keys must wait for rank 1's report, or rank 1's late write of
    garbage lands on top of a copy the index lists."""
    rig = make_rig(tp=2, disk=32)
    offloaded(rig)  # t1's blocks on host
    rig.turn("t2", P1)  # same content; t2 goes to disk while t1's copy sits on host
    rig.workers.silent.add(1)
    assert rig.mgr.pause("t2", "main", "human", 400.0)[1]["decision"]["action"] == "offload_disk"
    rig.settle()
    rig.clock.advance(11.0)
    rig.settle()
    assert rig.mgr.counters["store_timeouts"] == 1
    keys = set(keys_of(rig, P1))
    assert keys <= set(rig.mgr._poisoned)
    _code, body = rig.mgr.pause("t1", "main", "human", 400.0)  # t1 goes to disk too
    assert body["decision"]["action"] == "offload_disk"
    plan = rig.eng.step()
    assert not any(set(m.keys) & keys for m in plan.moves)
    rig.settle()
    rig.flush()  # the timed-out store's blocks are reused
    rig.workers.wake(1, newest_first=True)  # rank 1 writes what they hold now, late
    rig.settle()
    assert not rig.mgr._poisoned
    for rank in range(2):
        for tier in ("host", "disk"):
            for key, content in rig.workers.tiers[rank][tier].items():
                e = rig.mgr.index.get(key)
                assert e is not None and e.has(tier)  # type: ignore[arg-type]
                assert content is not None and key_of(content) == key, (rank, tier)


def test_b6_a_stray_late_write_never_reaches_a_load() -> None:
    rig = make_rig(tp=2, grace=0.0)
    rig.workers.silent.add(1)
    rig.turn("t1", P1, jobs=False)
    rig.eng.step()
    rig.clock.advance(11.0)
    rig.settle()  # the store timed out; its blocks were unpinned
    rig.flush()  # and reused
    rig.workers.wake(1)  # the late rank copies whatever the blocks hold now
    assert GARBAGE in rig.workers.tiers[1]["host"].values()
    req = rig.eng.new_request("t1", "main", [*P1, 1])
    rig.run(req)
    assert req.status == "FINISHED" and not rig.eng.violations
    rig.settle()
    assert GARBAGE not in rig.workers.tiers[1]["host"].values()


def test_b7_a_pending_decision_does_not_outlive_the_pause_it_was_for() -> None:
    rig = make_rig(disk=32)
    rig.turn("t1", P1)
    rig.clock.advance(1.0)
    rig.eng.step()  # grace expired: the host store is in flight
    assert branch(rig).state is BranchState.OFFLOADING
    _code, body = rig.mgr.pause("t1", "main", "human", 400.0)
    assert body["applied"] and "completes" in body["reason"]
    assert branch(rig).pending is not None
    req = rig.eng.new_request("t1", "main", [*P1, 2, 2])  # the agent is back before that
    rig.eng.schedule(req)
    assert branch(rig).pending is None
    rig.run(req)
    assert branch(rig).state is BranchState.HELD  # a fresh grace period, not the old decision
    assert not any(p.kind == "store" and p.job.tier == "disk" for p in rig.workers.pending)


def test_b8_a_drop_releases_the_tier_copies_only_the_branch_held() -> None:
    rig = make_rig()
    offloaded(rig)  # t1's context on host
    fast = CostModel(host_link_bytes_per_s=1e8, prefill_tokens_per_s=1e9)  # recompute wins
    rig.mgr.costs = fast
    rig.turn("t1", [*P1, 2, 2, 2])
    _code, body = rig.mgr.pause("t1", "main", "tool", 5.0)
    assert body["decision"]["action"] == "drop" and body["state"] == "dropped"
    assert not rig.mgr.table["t1"].owned
    rig.settle()
    assert len(rig.mgr.index) == 0 and not rig.host_keys()


@pytest.mark.parametrize("via", ["fail_load", "mismatch"])
def test_b9_a_fail_closed_load_is_layerwise_when_the_lookup_said_so(via: str) -> None:
    """The lookup answered load_async=False (a layerwise host load): vLLM runs the forward this
    step, so the failing load must fail inside it, not arrive later as an async job."""
    rig = make_rig(layerwise=True)
    offloaded(rig)
    rig.flush()
    req = rig.eng.new_request("t1", "main", [*P1, 4])
    hashes = rig.eng.hashes(req.tokens)
    answer = rig.mgr.on_lookup(req.req_id, req.params, req.prompt, hashes, 0)
    assert answer.tokens == 16 and not answer.load_async
    blocks = rig.pool.allocate([], 5)
    assert blocks is not None
    if via == "fail_load":
        rig.mgr.fail_load(req.req_id, blocks, 16)
    else:
        rig.mgr.on_alloc(req.req_id, blocks, 20)
    (load,) = rig.mgr.take_step().loads
    assert load.layerwise and all(t.key == b"" for t in load.blocks)


def test_b9_the_engine_recomputes_what_a_layerwise_fail_closed_load_covered() -> None:
    rig = make_rig(layerwise=True)
    offloaded(rig)
    rig.flush()
    req = rig.eng.new_request("t1", "main", [*P1, 4])
    rig.eng.schedule(req, adapter_error=True)
    rig.run(req)
    assert req.status == "FINISHED" and not rig.eng.violations


def test_a_pause_on_parallel_tools_predicts_and_learns_the_longest() -> None:
    rig = make_rig()
    for _ in range(10):
        rig.mgr.predictor.observe("grep", 0.2)
        rig.mgr.predictor.observe("build", 30.0)
    rig.turn("t1", P1)
    code, body = rig.mgr.pause("t1", "main", ["grep", "build"], None)
    assert code == 200
    assert body["tools"] == ["grep", "build"] and body["predicted_tool"] == "build"
    assert body["wait_estimate"]["p50"] > 10  # build's wait, not grep's
    assert branch(rig).tool == "build"  # the resume's observed wait teaches build
    code, body = rig.mgr.pause("t1", "main", "grep", None)
    assert code == 200 and "tools" not in body and branch(rig).tool == "grep"


# ============================================================================ remote fetch wait


def test_a_trajectory_never_seen_waits_pending_for_its_remote_fetch_then_loads_from_host() -> None:
    """The wait for a remote fetch is the manager's: the lookup of a trajectory this replica
    does not know answers PENDING until the fetch completes, then HIT from host."""
    from agentkv.manager import LookupStatus

    rig = make_rig(remote_enabled=True)
    offloaded(rig)  # its first lookup asked the (empty) remote tier too
    fetches = rig.mgr.counters["remote_fetches"]
    rig.settle()  # the upload of the confirmed host copies
    assert rig.mgr.counters["remote_uploaded_blocks"] == 4
    rig.mgr.delete("t1")  # its local copies go; the shared remote tier keeps them
    rig.eng.step()
    rig.flush()
    assert not rig.host_keys()
    req = rig.eng.new_request("elsewhere", "main", P1)
    hashes = rig.eng.hashes(P1)
    params = req.params
    first = rig.mgr.on_lookup(req.req_id, params, P1, hashes, 0)
    assert first.status is LookupStatus.PENDING
    assert rig.mgr.counters["remote_fetches"] == fetches + 1
    again = rig.mgr.on_lookup(req.req_id, params, P1, hashes, 0)
    assert again.status is LookupStatus.PENDING  # the fetch is still in flight
    rig.settle()  # the fetch completes: 4 blocks into host
    assert rig.mgr.counters["remote_fetched_blocks"] == 4
    assert len(rig.host_keys()) == 4
    hit = rig.mgr.on_lookup(req.req_id, params, P1, hashes, 0)
    assert hit.status is LookupStatus.HIT and hit.tokens == 16
    assert rig.mgr.counters["remote_fetches"] == fetches + 1  # asked once per request


# ============================================================================ net (issue 24)


def test_two_salts_with_the_same_tokens_share_no_key_and_no_block() -> None:
    """vLLM's cache_salt isolates tenants: the same tokens under another salt hit neither the
    device prefix cache nor a tier copy, and their blocks and keys are their own."""
    rig = make_rig()
    rig.turn("t1", P1)
    rig.clock.advance(1.0)
    rig.settle()  # t1's context on host, its device blocks still cached
    salted = rig.eng.new_request("t2", "main", [*P1, 4], salt="tenant-b")
    rig.run(salted)
    assert salted.device_hit == 0 and salted.load_n == 0
    plain = rig.eng.new_request("t3", "main", [*P1, 4])  # the control: no salt hits both
    rig.eng.schedule(plain)
    assert plain.device_hit + plain.load_n * 4 >= 16
    rig.run(plain)
    salted_keys = {key_of(h) for h in rig.eng.hashes(salted.tokens, "tenant-b")}
    assert not salted_keys & set(keys_of(rig, plain.tokens))
    assert set(branch(rig, "t2", tenant="tenant-b").keys) == salted_keys
    assert not set(branch(rig, "t2", tenant="tenant-b").pinned) & set(branch(rig, "t3").pinned)
    assert not rig.eng.violations


def test_a_trajectory_that_changes_salt_reuses_nothing_of_its_old_context() -> None:
    rig = make_rig()
    offloaded(rig)
    req = rig.eng.new_request("t1", "main", [*P1, 4], salt="tenant-b")
    rig.run(req)
    assert req.device_hit == 0 and req.load_n == 0 and req.status == "FINISHED"
    assert not rig.eng.violations


def test_a_load_a_silent_rank_never_reports_waits_for_the_workers_deadline() -> None:
    """The manager timing out its load job tells vLLM nothing (no adapter code fails it): the
    request waits until the stuck rank's worker cancels the load at its own deadline, then
    vLLM recomputes the blocks and the turn finishes with true KV."""
    rig = make_rig(tp=2)
    offloaded(rig)
    rig.flush()
    rig.workers.silent.add(1)
    req = rig.eng.new_request("t1", "main", [*P1, 4])
    rig.eng.schedule(req)
    assert req.status == "WAITING_FOR_REMOTE_KVS" and req.load_n == 4
    rig.clock.advance(1.0)  # the workers start the load a second after the manager's job
    rig.eng.step()
    for p in rig.workers.completable():
        rig.workers.complete(p)
    rig.eng.deliver_reports()
    rig.clock.advance(9.5)
    rig.eng.step()  # the manager's job timed out
    assert rig.mgr.counters["job_timeouts"] == 1 and not rig.mgr.jobs
    rig.eng.deliver_reports()
    assert req.status == "WAITING_FOR_REMOTE_KVS"  # rank 1 has not answered: vLLM waits
    rig.clock.advance(1.0)
    rig.eng.step()  # rank 1's worker cancels the load at its own deadline
    rig.eng.deliver_reports()
    assert req.status == "RUNNING" and req.num_computed == 0  # everything is recomputed
    rig.run(req)
    assert req.status == "FINISHED" and not rig.eng.violations
    assert not rig.mgr.jobs


def test_a_damaged_disk_copy_is_reported_corrupt_and_recomputed() -> None:
    rig = make_rig(disk=32)
    rig.turn("t1", P1)
    assert rig.mgr.pause("t1", "main", "human", 400.0)[1]["decision"]["action"] == "offload_disk"
    rig.settle()
    rig.flush()
    key = keys_of(rig, P1)[1]
    assert rig.workers.damage(0, key)
    req = rig.eng.new_request("t1", "main", [*P1, 4])
    rig.run(req, steps=16)
    assert req.status == "FINISHED" and not rig.eng.violations
    assert rig.mgr.counters["tier_corrupt_blocks"] == 1
    assert rig.mgr.index.usable(key) is None and key not in rig.disk_keys()


class _Spans:
    """The manager's OTel port: pause spans started and ended, with their attributes."""

    def __init__(self) -> None:
        self.started: dict[tuple[str, str], dict[str, Any]] = {}
        self.ended: dict[tuple[str, str], dict[str, Any]] = {}

    def start_pause(self, key: tuple[str, str], attrs: dict[str, Any]) -> None:
        self.started[key] = attrs

    def end_pause(self, key: tuple[str, str], attrs: dict[str, Any]) -> None:
        self.ended[key] = attrs


def test_get_status_metrics_and_spans_say_what_happened_to_a_turn() -> None:
    """What operators read (GET, /status, the metrics, the pause span) matches one scripted
    turn exactly: a 4-block host hit, a pause, a resume."""
    from agentkv import metrics as m
    from agentkv.metrics import counter_value

    rig = make_rig()
    spans = _Spans()
    rig.mgr.otel = spans
    offloaded(rig)  # t1: 4 blocks on host
    rig.flush()
    req = rig.turn("t1", [*P1, 4])  # 18 prompt tokens: 16 from host, nothing from the device
    assert req.status == "FINISHED"
    snap = rig.mgr.metrics.snapshot()
    assert counter_value(snap, m.CACHED_TOKENS.name, source="host") == 16
    assert counter_value(snap, m.CACHED_TOKENS.name, source="device") == 0
    assert counter_value(snap, m.PROMPT_TOKENS.name) == 17 + 18
    (ratio,) = [r for r in snap["histogram"][m.PREFIX_HIT_RATIO.name]]
    assert ratio[-1] == 2 and ratio[-2] == pytest.approx(0 / 17 + 16 / 18)

    code, body = rig.mgr.pause("t1", "main", "grep", 30.0)
    assert code == 200
    action = body["decision"]["action"]
    snap = rig.mgr.metrics.snapshot()
    assert counter_value(snap, m.DECISIONS.name, action=action) == 1
    (pred,) = snap["histogram"][m.TOOL_WAIT_PREDICTED.name]
    assert pred[0] == "grep" and pred[-1] == 1
    attrs = spans.started[("t1", "main")]
    assert attrs["agentkv.trajectory_id"] == "t1" and attrs["agentkv.branch"] == "main"
    assert attrs["agentkv.tool"] == "grep" and attrs["agentkv.expected_wait_s"] == 30.0
    assert attrs["agentkv.action"] == action
    assert attrs["agentkv.kv_tokens"] == branch(rig).kv_tokens > 0
    assert attrs["agentkv.kv_bytes"] == len(branch(rig).keys) * (1 << 20)

    rig.settle()
    code, view = rig.mgr.get("t1")
    assert code == 200 and view["trajectory_id"] == "t1"
    t1 = rig.mgr.table["t1"]
    assert view["prefix_hit_ratio"] == round(t1.prefix_hit_ratio, 6) > 0
    assert [t["tier_hit_tokens"] for t in view["turns"]] == [0, 16]
    on_host = {k for k in rig.mgr.index if rig.mgr.index.usable(k) == "host"}
    assert on_host and t1.owned <= on_host
    assert view["bytes_held"]["host"] == len(t1.owned) * (1 << 20)
    assert view["bytes_held"]["device_pinned"] == len(branch(rig).pinned) * (1 << 20)
    res = view["branches"]["main"]["residency_blocks"]
    assert res.get("host", 0) == len(set(branch(rig).keys) & on_host) > 0

    status = rig.mgr.status()
    assert status["pool"]["usage"] == round(rig.pool.usage(), 6)
    assert status["pool"]["total_blocks"] == 40
    assert status["pool"]["pinned_blocks"] == sum(rig.pool.pins)
    assert status["tiers"]["host"]["blocks"] == rig.mgr.index.count("host") > 0
    assert status["tiers"]["host"]["bytes"] == rig.mgr.index.count("host") * (1 << 20)
    assert status["tiers"]["host"]["capacity_bytes"] == 32 * (1 << 20)
    assert status["trajectories"] == 1 and status["trajectory_ids"] == ["t1"]
    assert status["decisions"] == {action: 1}
    assert status["counters"]["loads"] == 1

    rig.clock.advance(5.0)
    rig.mgr.resume("t1", "main")
    ended = spans.ended[("t1", "main")]
    assert ended["agentkv.outcome"] == "resumed" and ended["agentkv.observed_wait_s"] == 5.0
    (obs,) = rig.mgr.metrics.snapshot()["histogram"][m.TOOL_WAIT_OBSERVED.name]
    assert obs[0] == "grep" and obs[-1] == 1 and obs[-2] == 5.0


def test_the_index_knows_its_remote_copies_until_their_ttl_and_does_not_upload_them_again() -> None:
    """Remote copies are in the residency index (external, with a TTL): an upload this replica
    made is not sent again while the remote tier keeps it, and is once the TTL has passed."""
    from agentkv.tier import Tier

    rig = make_rig(remote_enabled=True, remote_ttl_s=100.0)
    offloaded(rig)
    rig.settle()
    keys = branch(rig).keys
    assert rig.mgr.counters["remote_uploaded_blocks"] == 4
    now = rig.clock.now()
    assert all(rig.mgr.index.external(k, now) for k in keys)
    assert all(rig.mgr.index.get(k).has(Tier.REMOTE) for k in keys)  # type: ignore[union-attr]
    assert not any(rig.mgr.index.get(k).has(Tier.DISK) for k in keys)  # type: ignore[union-attr]
    rig.mgr.transitions.upload(keys)
    assert not rig.mgr.jobs  # known to be there: nothing sent
    rig.clock.advance(101.0)
    assert not any(rig.mgr.index.external(k, rig.clock.now()) for k in keys)
    rig.mgr.transitions.upload(keys)
    assert [job.kind for job in rig.mgr.jobs.values()] == ["upload"]


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


def test_a_prefetch_no_one_came_back_for_is_counted_wasted_on_delete() -> None:
    from agentkv import metrics as m
    from agentkv.metrics import counter_value

    rig = make_rig(disk=32)
    _disk_offloaded(rig)
    rig.clock.t = branch(rig).prefetch_due + 0.01  # type: ignore[operator]
    rig.settle()
    assert branch(rig).prefetch_done_at is not None
    rig.mgr.delete("t1")
    assert rig.mgr.prefetch_outcomes.counts()["wasted"] == 1
    snap = rig.mgr.metrics.snapshot()
    assert counter_value(snap, m.PREFETCH_OUTCOMES.name, outcome="wasted") == 1


def test_a_disk_hit_turn_says_disk() -> None:
    rig = make_rig(disk=32)
    _disk_offloaded(rig)
    rig.flush()
    rig.turn("t1", [*P1, 4], steps=16)
    (turn1, turn2) = rig.mgr.get("t1")[1]["turns"]
    assert turn2["tier"] == "disk" and turn2["tier_hit_tokens"] == 16
    assert turn2["hit_ratio"] == round(16 / 18, 6) and turn1["hit_ratio"] == 0.0


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


def test_store_jobs_in_flight_are_releasing_until_they_complete() -> None:
    rig = make_rig(grace=0.0)
    rig.turn("t1", P1, jobs=False)
    rig.eng.step()
    assert rig.mgr.status()["pool"]["releasing_blocks"] == 4
    rig.settle()
    assert rig.mgr.status()["pool"]["releasing_blocks"] == 0


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


def test_a_fail_closed_load_is_counted() -> None:
    rig = make_rig()
    rig.mgr.on_alloc("r-unknown", [1, 2, 3], 8)  # not ours, yet vLLM counted tokens
    assert rig.mgr.counters["failed_closed_loads"] == 1


def test_get_says_why_the_engine_moved_a_branch() -> None:
    rig = make_rig()
    offloaded(rig)  # grace expired with no pause decision
    assert rig.mgr.get("t1")[1]["branches"]["main"]["demoted_by"] == "grace_expired"


def test_the_paused_gauge_is_labelled_by_state() -> None:
    from agentkv import metrics as m

    rig = make_rig()
    offloaded(rig)
    rows = {(spec.name, tuple(sorted(labels.items()))): v for spec, labels, v in rig.mgr.gauges()}
    assert rows[(m.PAUSED_TRAJECTORIES.name, (("state", "offloaded"),))] == 1
    assert rows[(m.TRAJECTORIES.name, ())] == 1


def test_a_second_pause_of_a_disk_branch_still_prefetches() -> None:
    """A decision that changes no state (offload_host for a branch already offloaded) still arms
    its prefetch timer."""
    rig = make_rig(disk=32)
    _disk_offloaded(rig)
    _code, body = rig.mgr.pause("t1", "main", "human", 400.0)
    assert body["state"] == "offloaded"
    due = branch(rig).prefetch_due
    assert due is not None
    rig.clock.t = due + 0.01
    rig.settle()
    assert rig.mgr.counters["prefetches"] == 1 and branch(rig).prefetch_done_at is not None


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
    }
    assert pool["eviction_forecast_s"] == 0.0


# ============================================================================ tenants (issue 25, 3)


def _tenant_a_offloaded(rig: Rig, secret: list[int]) -> None:
    """Tenant A (cache_salt "tenant-a") ran trajectory "t1"; its context is on host."""
    rig.run(rig.eng.new_request("t1", "main", secret, max_new=0, salt="tenant-a"))
    rig.clock.advance(1.0)
    rig.settle()
    assert rig.mgr.get("t1", tenant="tenant-a")[1]["branches"]["main"]["state"] == "offloaded"


def test_another_tenant_naming_the_same_id_learns_nothing_and_drops_nothing() -> None:
    """The oracle attack: tenant B names A's trajectory id with a guessed prompt. On a shared
    namespace B's turn stats carried A's first_divergence_token (the length of the common prefix
    with A's context: A's prompt recovered a token per request) and B's finished turn replaced
    A's context and dropped A's tier copies. Tenants are namespaces: B gets its own "t1"."""
    rig = make_rig()
    secret = [*SYS, 1, 2, 3, 4, 5, 6, 7, 8, 1]
    _tenant_a_offloaded(rig, secret)
    a_keys = {key_of(h) for h in rig.eng.hashes(secret, "tenant-a")}
    assert a_keys <= rig.host_keys()
    divergences = []
    for guess in ([*SYS, 1, 2, 3, 9, 9, 9, 9, 9, 9], [*SYS, 1, 2, 3, 4, 5, 9, 9, 9, 9]):
        probe = rig.run(rig.eng.new_request("t1", "main", guess, max_new=0, salt="tenant-b"))
        assert probe.status == "FINISHED" and probe.stats is not None
        assert probe.stats["trajectory_id"] == "t1"
        divergences.append(probe.stats["first_divergence_token"])
    # The first probe is B's first turn (no divergence); the second diverges from B's own first
    # probe at 11 (A's secret would say 13).
    assert divergences == [None, 11]
    rig.clock.advance(1.0)
    rig.settle()
    assert a_keys <= rig.host_keys()  # A's copies survive B's turns
    code, a_view = rig.mgr.get("t1", tenant="tenant-a")
    assert code == 200 and len(a_view["turns"]) == 1
    assert len(rig.mgr.get("t1", tenant="tenant-b")[1]["turns"]) == 2
    assert rig.mgr.get("t1")[0] == 404  # the unsalted namespace holds no "t1"
    assert not rig.eng.violations


def test_control_ops_of_another_tenant_never_reach_the_trajectory() -> None:
    rig = make_rig()
    secret = [*SYS, 1, 2, 3, 4, 5, 6, 7, 8, 1]
    _tenant_a_offloaded(rig, secret)
    a_keys = {key_of(h) for h in rig.eng.hashes(secret, "tenant-a")}
    for tenant in ("tenant-b", None):
        assert rig.mgr.get("t1", tenant=tenant)[0] == 404
        assert rig.mgr.pause("t1", "main", "tool", 1.0, tenant=tenant)[0] == 404
        assert rig.mgr.resume("t1", "main", tenant=tenant)[0] == 404
        code, body = rig.mgr.delete("t1", tenant=tenant)
        assert code == 404 and body["detail"] == "unknown trajectory 't1'"
        assert not rig.mgr.knows("t1", tenant=tenant)
    rig.settle()
    assert a_keys <= rig.host_keys()
    assert rig.mgr.knows("t1", tenant="tenant-a")
    code, body = rig.mgr.delete("t1", tenant="tenant-a")
    assert code == 200 and body == {
        "trajectory_id": "t1",
        "released_blocks": 0,
        "dropped_tier_blocks": 4,
    }
    rig.settle()
    assert not rig.host_keys() and len(rig.mgr.index) == 0


def test_status_and_stats_name_trajectories_by_their_client_id_never_the_salt() -> None:
    rig = make_rig()
    req = rig.run(rig.eng.new_request("t1", "main", P1, max_new=0, salt="s3cret"))
    assert req.stats is not None and req.stats["trajectory_id"] == "t1"
    status = rig.mgr.status()
    assert status["trajectory_ids"] == ["t1"]
    assert "s3cret" not in repr(status) and "s3cret" not in repr(dict(rig.mgr.table))


def test_scoped_ids_never_collide_across_namespaces() -> None:
    from agentkv.manager.state import scoped_id, split_scoped, tenant_digest

    ids = ["t", "t\x00", "t\x00" + tenant_digest("a"), "t\x00x"]
    keys = {(i, t): scoped_id(i, t) for i in ids for t in (None, "", "a", "b")}
    distinct = {(i, t or None) for i, t in keys}
    assert len(set(keys.values())) == len(distinct)
    for (i, t), key in keys.items():
        assert split_scoped(key) == (i, tenant_digest(t) if t else None)


# ============================================================================ memory (issue 25, 6)


def _live(refs: list[Any]) -> int:
    gc.collect()
    return sum(r() is not None for r in refs)


def test_deleted_and_cap_evicted_trajectories_are_freed_at_once() -> None:
    """Timers never keep a trajectory alive: its IDLE timer (idle_ttl_s, a day by default) and
    its branch timers hold it weakly; once deleted or evicted nothing references it."""
    rig = make_rig(idle_ttl_s=86400.0, max_trajectories=4, grace=30.0)
    refs = []
    for i in range(10):
        rig.turn(f"d{i}", [40 + i] * 9)  # HELD: a 30 s GRACE timer armed too
        refs.append(weakref.ref(rig.mgr.table[f"d{i}"]))
    assert rig.mgr.counters["trajectories_evicted_cap"] == 6
    for i in range(6, 10):
        assert rig.mgr.delete(f"d{i}")[0] == 200
    rig.settle()
    assert len(rig.mgr.timers) >= 10  # the timers are still in the heap (they go stale)...
    assert _live(refs) == 0  # ...but reference no trajectory


def test_the_cap_holds_while_the_oldest_trajectory_runs() -> None:
    """The least recently active trajectory has a running request: the oldest idle one is
    evicted instead of going over the cap."""
    rig = make_rig(max_trajectories=3)
    busy = rig.eng.new_request("busy", "main", [50] * 9, max_new=50)
    rig.eng.schedule(busy)
    rig.eng.step()
    for i in range(6):
        rig.turn(f"c{i}", [30 + i] * 5)
        assert len(rig.mgr.table) <= 3
    assert "busy" in rig.mgr.table
    assert rig.mgr.counters["trajectories_evicted_cap"] == 4
    assert list(rig.mgr.table)[-2:] == ["c4", "c5"]


# ============================================================================ DELETE is final (25, 5)


def test_a_request_waiting_for_its_remote_fetch_at_delete_never_recreates_the_trajectory() -> None:
    """A request looked up before the DELETE (PENDING on its remote fetch) runs as a vanilla
    request afterwards: GET stays 404, it loads, pins and stores nothing, no host block stays."""
    from agentkv.manager import LookupStatus

    rig = make_rig(remote_enabled=True)
    offloaded(rig)
    rig.settle()  # uploaded to the shared remote tier
    rig.mgr.delete("t1")
    rig.eng.step()
    rig.flush()
    req = rig.eng.new_request("elsewhere", "main", P1)
    hashes = rig.eng.hashes(P1)
    first = rig.mgr.on_lookup(req.req_id, req.params, P1, hashes, 0)
    assert first.status is LookupStatus.PENDING
    assert rig.mgr.get("elsewhere")[0] == 200  # the fetch created it
    assert rig.mgr.delete("elsewhere")[0] == 200
    rig.settle()  # the fetch completes after the DELETE
    again = rig.mgr.on_lookup(req.req_id, req.params, P1, hashes, 0)
    assert again.status is LookupStatus.MISS
    assert rig.mgr.get("elsewhere")[0] == 404
    rig.run(req)
    assert req.status == "FINISHED" and req.stats is None
    rig.clock.advance(5.0)
    rig.settle()
    assert rig.mgr.get("elsewhere")[0] == 404 and not rig.mgr.table
    assert not rig.host_keys() and len(rig.mgr.index) == 0
    assert rig.mgr.pinned_blocks() == 0 and not any(rig.pool.pins)
    assert rig.mgr.counters["requests_of_deleted_trajectories"] == 1
    assert not rig.eng.violations
