"""A cache_salt generation change of a trajectory releases its old trajectory (issue 41).

SkyRL 0.3 sends a per-weight-version ``cache_salt`` by default (``use_cache_salt``), and agentkv
keys a trajectory by its id in its salt's namespace: after a weight sync every trajectory id
comes back under a new salt, and its old-salt trajectory (device pins, host and disk copies)
stayed held until its lease or idle expiry. With ``salt_generations`` on, the first request of
an id under a new salt releases that id's trajectories under every other salt as a DELETE
would. Off (the default) the same id under two salts is two tenants (test_manager_tenants.py).
The rig: manager_helpers.py.
"""

from __future__ import annotations

import logging

import pytest

from agentkv.manager import BranchState
from tests.unit.manager_helpers import P1, SYS, branch, counted, keys_of
from tests.unit.sim_engine import Rig, key_of, make_rig

P2 = [*SYS, 5, 5, 5, 5, 6, 6, 6, 6, 2]  # another trajectory's prompt: the same system blocks


def _salted_keys(rig: Rig, tokens: list[int], salt: str | None) -> set[bytes]:
    return {key_of(h) for h in rig.eng.hashes(tokens, salt)}


def _offloaded(rig: Rig, traj: str, prompt: list[int], salt: str | None) -> None:
    """One finished turn of ``traj`` under ``salt``, its grace expired, its host copy written."""
    rig.run(rig.eng.new_request(traj, "main", prompt, max_new=0, salt=salt))
    rig.clock.advance(1.0)
    rig.settle()
    assert branch(rig, traj, tenant=salt).state is BranchState.OFFLOADED


def _retained(rig: Rig, traj: str, prompt: list[int], salt: str | None) -> None:
    """One finished turn of ``traj`` under ``salt``, paused for a short wait: its blocks stay
    pinned on the device (RETAINED)."""
    rig.run(rig.eng.new_request(traj, "main", prompt, max_new=0, salt=salt))
    code, body = rig.mgr.pause(traj, "main", "tool", 0.01, tenant=salt)
    assert code == 200 and body["decision"]["action"] == "retain", body
    rig.settle()
    assert branch(rig, traj, tenant=salt).state is BranchState.RETAINED


def test_a_trajectory_back_under_a_new_salt_releases_its_old_salts_trajectory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SkyRL's weight sync: t1 (retained, pinned on the device) and t2 (on host) ran under the
    version-1 salt; t1's next turn comes under the version-2 salt. t1's version-1 trajectory is
    released before the turn is served (pins off, host copies dropped but the system blocks t2
    still owns, GET 404); t2's version-1 trajectory stays until its own id comes back. One INFO
    line for the version-1 salt however many of its trajectories go."""
    rig = make_rig(salt_generations=True)
    _retained(rig, "t1", P1, "v1")
    _offloaded(rig, "t2", P2, "v1")
    old_t1 = _salted_keys(rig, P1, "v1") - _salted_keys(rig, P2, "v1")
    assert rig.mgr.pinned_blocks() == 4
    with caplog.at_level(logging.INFO, logger="agentkv.manager"):
        new = rig.run(rig.eng.new_request("t1", "main", P1, max_new=0, salt="v2"))
        rig.settle()
        assert new.stats is not None and new.stats["turn"] == 1  # a fresh trajectory
        assert rig.mgr.get("t1", tenant="v1")[0] == 404
        assert rig.mgr.get("t1", tenant="v2")[0] == 200
        assert rig.mgr.get("t2", tenant="v1")[0] == 200  # not yet back: kept
        assert not (old_t1 & rig.host_keys())
        assert _salted_keys(rig, P2, "v1") <= rig.host_keys()
        # the version-1 pins of t1 went; what is pinned now is t1@v2's grace hold
        assert rig.mgr.pinned_blocks() == len(branch(rig, "t1", tenant="v2").pinned)
        rig.run(rig.eng.new_request("t2", "main", P2, max_new=0, salt="v2"))
        rig.settle()
        assert rig.mgr.get("t2", tenant="v1")[0] == 404
    assert not (_salted_keys(rig, P2, "v1") & rig.host_keys())
    assert rig.mgr.status()["counters"]["salt_generation_releases"] == 2
    lines = [r for r in caplog.records if "cache_salt" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO, [r.getMessage() for r in lines]
    assert "v1" not in lines[0].getMessage()  # the salt itself is never logged, its digest is
    assert not rig.eng.violations
    assert counted(rig)["trajectories_salt_generation"] == 2


def test_an_unsalted_trajectory_back_under_a_salt_is_released_too() -> None:
    """A trainer that starts salting after its first rollout step: no salt is a generation."""
    rig = make_rig(salt_generations=True)
    _offloaded(rig, "t1", P1, None)
    rig.run(rig.eng.new_request("t1", "main", P1, max_new=0, salt="v2"))
    rig.settle()
    assert rig.mgr.get("t1")[0] == 404
    assert not (set(keys_of(rig, P1)) & rig.host_keys())
    assert rig.mgr.counters["salt_generation_releases"] == 1


def test_a_straggler_of_the_old_salt_runs_vanilla_and_keeps_the_new_trajectory() -> None:
    """A version-1 turn queued in vLLM before the version-2 turn released its trajectory, and
    looked up after it (SkyRL's pause keeps waiting requests), runs as a vanilla request: it
    neither re-creates the released trajectory nor releases the new one (it arrived before the
    new one existed). A version-1 turn sent later is the newest generation again and wins."""
    rig = make_rig(salt_generations=True)
    _offloaded(rig, "t1", P1, "v1")
    straggler = rig.eng.new_request("t1", "main", P1, max_new=0, salt="v1")  # queued, no lookup
    rig.clock.advance(0.01)
    rig.run(rig.eng.new_request("t1", "main", P1, max_new=0, salt="v2"))
    rig.run(straggler)
    rig.settle()
    assert straggler.status == "FINISHED" and straggler.stats is None  # vanilla
    assert rig.mgr.get("t1", tenant="v1")[0] == 404
    assert rig.mgr.get("t1", tenant="v2")[0] == 200
    assert rig.mgr.counters["salt_generation_releases"] == 1
    rig.clock.advance(0.01)
    rig.run(rig.eng.new_request("t1", "main", P1, max_new=0, salt="v1"))
    assert rig.mgr.get("t1", tenant="v2")[0] == 404
    assert rig.mgr.counters["salt_generation_releases"] == 2
    assert not rig.eng.violations


def test_a_running_old_salt_turn_finishes_for_its_client_and_keeps_nothing() -> None:
    """The old trajectory's request still runs when the new salt's first turn is looked up:
    it finishes normally but pins and stores nothing (a DELETE's tombstone rules)."""
    rig = make_rig(salt_generations=True)
    old = rig.eng.new_request("t1", "main", P1, max_new=2, salt="v1")
    rig.eng.schedule(old)
    rig.eng.step()
    rig.run(rig.eng.new_request("t1", "main", P2, max_new=0, salt="v2"))
    assert rig.mgr.get("t1", tenant="v1")[0] == 404
    rig.run(old)
    rig.clock.advance(1.0)
    rig.settle()
    assert old.status == "FINISHED"
    assert not rig.mgr.tombstones
    assert not (_salted_keys(rig, P1, "v1") & rig.host_keys())
    assert rig.mgr.pinned_blocks() == 0
    assert not rig.eng.violations


def test_off_by_default_the_same_id_under_another_salt_is_another_tenant() -> None:
    """On a multi-tenant server the same id under two salts is two tenants: releasing one from
    the other would be a cross-tenant action, so nothing is released unless asked."""
    rig = make_rig()
    _offloaded(rig, "t1", P1, "tenant-a")
    rig.run(rig.eng.new_request("t1", "main", P1, max_new=0, salt="tenant-b"))
    rig.settle()
    assert rig.mgr.get("t1", tenant="tenant-a")[0] == 200
    assert _salted_keys(rig, P1, "tenant-a") <= rig.host_keys()
    assert rig.mgr.status()["counters"]["salt_generation_releases"] == 0
