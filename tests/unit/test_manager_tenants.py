"""Tenants as namespaces, memory after DELETE and the cap, DELETE is final (issue 25), on the
simulated engine. The rig: manager_helpers.py.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

from agentkv.manager.state import scoped_id
from tests.unit.manager_helpers import (
    P1,
    SYS,
    counted,
    offloaded,
)
from tests.unit.sim_engine import Rig, key_of, make_rig

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
    assert counted(rig) == {"grace_expired": 2, "store_blocks": 8, "stores": 2}


def test_control_ops_of_another_tenant_never_reach_the_trajectory() -> None:
    rig = make_rig()
    secret = [*SYS, 1, 2, 3, 4, 5, 6, 7, 8, 1]
    _tenant_a_offloaded(rig, secret)
    a_keys = {key_of(h) for h in rig.eng.hashes(secret, "tenant-a")}
    for tenant in ("tenant-b", None):
        assert rig.mgr.get("t1", tenant=tenant)[0] == 404
        # The answers name the id as the client sent it, never its namespaced table key.
        code, body = rig.mgr.pause("t1", "main", "tool", 1.0, tenant=tenant)
        assert code == 404 and body["detail"] == "unknown trajectory 't1'"
        code, body = rig.mgr.resume("t1", "main", tenant=tenant)
        assert code == 404 and body["detail"] == "unknown trajectory or branch 't1'"
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
    assert counted(rig) == {
        "grace_expired": 1,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_deleted": 1,
    }


def test_status_and_stats_name_trajectories_by_their_client_id_never_the_salt() -> None:
    rig = make_rig()
    req = rig.run(rig.eng.new_request("t1", "main", P1, max_new=0, salt="s3cret"))
    assert req.stats is not None and req.stats["trajectory_id"] == "t1"
    status = rig.mgr.status()
    assert status["trajectory_ids"] == ["t1"]
    assert "s3cret" not in repr(status) and "s3cret" not in repr(dict(rig.mgr.table))
    assert counted(rig) == {}


def test_scoped_ids_never_collide_across_namespaces() -> None:
    from agentkv.manager.state import split_scoped, tenant_digest

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
    assert rig.mgr.counters["trajectories_capacity"] == 6
    for i in range(6, 10):
        assert rig.mgr.delete(f"d{i}")[0] == 200
    rig.settle()
    assert len(rig.mgr.timers) >= 10  # the timers are still in the heap (they go stale)...
    assert _live(refs) == 0  # ...but reference no trajectory
    assert counted(rig) == {
        "trajectories_capacity": 6,
        "trajectories_deleted": 4,
    }


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
    assert rig.mgr.counters["trajectories_capacity"] == 4
    assert list(rig.mgr.table)[-2:] == ["c4", "c5"]
    assert counted(rig) == {"trajectories_capacity": 4}


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
    assert counted(rig) == {
        "grace_expired": 1,
        "remote_fetched_blocks": 4,
        "remote_fetches": 2,
        "remote_missed_blocks": 4,
        "remote_uploaded_blocks": 4,
        "requests_of_deleted_trajectories": 1,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_deleted": 2,
    }


def test_a_request_waiting_for_its_remote_fetch_outlives_a_cap_eviction() -> None:
    """Mutant ownership.Namespace.release__mutmut_62 (a cap eviction treated as final): only a
    DELETE orphans the requests that wait for a trajectory. One evicted by the cap is merely
    forgotten, so its waiting request runs as its turn again (counted, GET answers)."""
    from agentkv.manager import LookupStatus

    rig = make_rig(remote_enabled=True, max_trajectories=2)
    offloaded(rig)
    rig.settle()  # uploaded to the shared remote tier
    rig.mgr.delete("t1")
    rig.eng.step()
    rig.flush()
    req = rig.eng.new_request("elsewhere", "main", P1)
    hashes = rig.eng.hashes(P1)
    assert rig.mgr.on_lookup(req.req_id, req.params, P1, hashes, 0).status is LookupStatus.PENDING
    for i in range(2):  # two newer trajectories: the cap evicts "elsewhere"
        rig.turn(f"c{i}", [30 + i] * 5)
    assert rig.mgr.counters["trajectories_capacity"] >= 1 and not rig.mgr.knows("elsewhere")
    rig.settle()
    rig.run(req, steps=16)
    assert req.status == "FINISHED" and req.stats is not None
    assert rig.mgr.counters["requests_of_deleted_trajectories"] == 0
    assert rig.mgr.get("elsewhere")[0] == 200
    assert not rig.eng.violations
    assert counted(rig) == {
        "grace_expired": 1,
        "remote_fetched_blocks": 4,
        "remote_fetches": 4,
        "remote_missed_blocks": 6,
        "remote_uploaded_blocks": 4,
        "store_blocks": 4,
        "stores": 1,
        "trajectories_capacity": 2,
        "trajectories_deleted": 1,
    }
