"""Bugs the stateful test found (B1..B9), each pinned down as a deterministic test on the
simulated engine. The rig: manager_helpers.py.
"""

from __future__ import annotations

import pytest

from agentkv.costs import CostModel
from agentkv.manager import BranchState
from tests.unit.manager_helpers import (
    P1,
    SYS,
    branch,
    counted,
    keys_of,
    offloaded,
)
from tests.unit.sim_engine import GARBAGE, key_of, make_rig

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
    assert counted(rig) == {"store_blocks": 2, "stores": 1}


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
    assert counted(rig) == {"store_blocks": 4, "store_failures": 1, "stores": 1, "tier_misses": 4}


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
    assert counted(rig) == {"job_timeouts": 1, "store_blocks": 4, "store_timeouts": 1, "stores": 1}


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
    assert counted(rig) == {"store_blocks": 4, "stores": 1, "tier_corrupt_blocks": 1}


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
    assert counted(rig) == {
        "grace_expired": 1,
        "job_timeouts": 1,
        "store_blocks": 8,
        "store_timeouts": 1,
        "stores": 2,
    }


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
    assert counted(rig) == {"job_timeouts": 1, "store_blocks": 9, "store_timeouts": 1, "stores": 2}


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
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


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
    assert counted(rig) == {"grace_expired": 1, "store_blocks": 4, "stores": 1}


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
    assert counted(rig) == {
        "failed_closed_loads": 1,
        "grace_expired": 1,
        "store_blocks": 4,
        "stores": 1,
    }


def test_b9_the_engine_recomputes_what_a_layerwise_fail_closed_load_covered() -> None:
    rig = make_rig(layerwise=True)
    offloaded(rig)
    rig.flush()
    req = rig.eng.new_request("t1", "main", [*P1, 4])
    rig.eng.schedule(req, adapter_error=True)
    rig.run(req)
    assert req.status == "FINISHED" and not rig.eng.violations
    assert counted(rig) == {
        "failed_closed_loads": 1,
        "grace_expired": 1,
        "store_blocks": 4,
        "stores": 1,
    }


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
    assert counted(rig) == {"store_blocks": 4, "stores": 1}


def test_b10_an_aborted_turn_behind_a_finished_one_holds_that_turn_s_pins() -> None:
    """Two turns of one branch: the first waits for its host load, the second (device only)
    finishes and pins its context; the first is then aborted with its load unconfirmed. The
    branch keeps the finished turn's context, pinned: it is HELD (its grace runs, then its
    default action), not DROPPED still holding those pins (a paused branch placed in vLLM's
    free queue with pins of its own: stateful invariant 8b)."""
    rig = make_rig(grace=0.5)
    offloaded(rig)
    rig.flush()  # only host has the context
    waiting = rig.eng.new_request("t1", "main", [*P1, 4, 4, 4], max_new=1)
    assert rig.eng.schedule(waiting) and waiting.status == "WAITING_FOR_REMOTE_KVS"
    rig.eng.step()  # its load is out, not reported
    other = rig.run(rig.eng.new_request("t1", "main", [3, 3, 3, 3, 3, 1]), jobs=False)
    assert other.status == "FINISHED"
    b = branch(rig)
    assert b.state is BranchState.ACTIVE and b.pinned  # the first turn still runs
    rig.eng.abort(waiting)
    assert b.state is BranchState.HELD and b.pinned and len(b.pinned) == len(b.keys)
    assert b.keys[:1] == keys_of(rig, [3, 3, 3, 3])  # the finished turn's context
    rig.clock.advance(1.0)
    rig.settle()
    assert b.state is not BranchState.HELD and not rig.eng.violations
