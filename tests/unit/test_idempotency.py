"""Retried control calls are idempotent (issue 25 item 5): a pause, resume or DELETE that names an
idempotency key is applied once; a retry with the same key (same tenant) answers the first
answer again. The engine-side glue (``SchedulerSide.handle``) runs over a real manager on the
simulated engine; the cache's own rules (window, bound, tenants, 5xx) on a bare ReplayCache.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest

from agentkv.idempotency import KEY_FIELD, MAX_KEY_LEN, ReplayCache, validate_key
from agentkv.manager import BranchState
from tests.unit.sim_engine import FakeClock, Rig, make_rig

SYS = [7, 7, 7, 7, 9, 9, 9, 9]
P1 = [*SYS, 1, 2, 3, 4, 5, 6, 7, 8, 1]


def _side(rig: Rig) -> Any:
    pytest.importorskip("vllm")
    from agentkv_vllm.scheduler_side import SchedulerSide

    side = SchedulerSide.__new__(SchedulerSide)  # only the parts the control ops read
    side.manager = rig.mgr
    side.replays = ReplayCache(rig.clock.now)
    side._live = set()
    side._lease_until = OrderedDict()
    return _as_routes_see_it(side)


def _as_routes_see_it(side: Any) -> Any:
    """The answers without the wake-up flag, which the route pops (it is recomputed per call,
    not part of a replayed answer; ``test_engine_wake`` covers it)."""
    from agentkv_vllm.control_ops import WAKE_FIELD

    handle = side.handle

    def answer(req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        status, body = handle(req)
        body.pop(WAKE_FIELD, None)
        return status, body

    side.handle = answer
    return side


def _held(rig: Rig, traj: str = "t1", salt: str | None = None) -> None:
    rig.run(rig.eng.new_request(traj, "main", P1, max_new=0, salt=salt))


def _pause(key: str | None = None, tid: str = "t1", **extra: Any) -> dict[str, Any]:
    req = {"op": "pause", "trajectory_id": tid, "tool": "pytest", "expected_wait_s": 1.0, **extra}
    return {**req, KEY_FIELD: key} if key else req


def test_a_retried_pause_with_the_same_key_is_applied_once_and_answers_the_same() -> None:
    rig = make_rig()
    side = _side(rig)
    _held(rig)
    status, first = side.handle(_pause("k1"))
    assert status == 200 and first["decision"]["action"] == "offload_host"
    decided = sum(rig.mgr.decisions.values())
    rig.settle()
    status, again = side.handle(_pause("k1"))
    assert status == 200
    assert again.pop("_idempotent_replayed") is True
    assert again == first
    assert sum(rig.mgr.decisions.values()) == decided  # no second decision
    # Without a key the same call is a second pause (a second decision): the key is what
    # made the retry harmless.
    side.handle(_pause())
    assert sum(rig.mgr.decisions.values()) == decided + 1


def test_a_retried_delete_with_the_same_key_answers_200_not_404() -> None:
    rig = make_rig()
    side = _side(rig)
    _held(rig)
    rig.clock.advance(1.0)
    rig.settle()
    end = {"op": "end", "trajectory_id": "t1", KEY_FIELD: "del-1"}
    status, first = side.handle(dict(end))
    assert status == 200 and first["dropped_tier_blocks"] == 4
    status, again = side.handle(dict(end))
    assert status == 200 and again.pop("_idempotent_replayed") is True and again == first
    assert side.handle({"op": "end", "trajectory_id": "t1"})[0] == 404  # no key: 404 as before
    # A new trajectory of the same id, then a retry of the old DELETE: the answer is replayed
    # and the new trajectory is not deleted. (Its turn arrives after the DELETEs: a turn that
    # arrived before one is served vanilla, test_delete_queued.py.)
    rig.clock.advance(0.01)
    _held(rig)
    assert side.handle(dict(end))[0] == 200
    assert rig.mgr.knows("t1")


def test_the_same_key_for_another_request_is_422_and_applies_nothing() -> None:
    rig = make_rig()
    side = _side(rig)
    _held(rig)
    _held(rig, "t2")
    assert side.handle(_pause("k"))[0] == 200
    decided = sum(rig.mgr.decisions.values())
    for other in (_pause("k", tid="t2"), _pause("k", expected_wait_s=9.0)):
        status, body = side.handle(other)
        assert status == 422 and "k" in body["detail"]
    status, body = side.handle({"op": "end", "trajectory_id": "t1", KEY_FIELD: "k"})
    assert status == 422
    assert sum(rig.mgr.decisions.values()) == decided
    assert rig.mgr.knows("t1")


def test_keys_are_scoped_to_the_tenant() -> None:
    """Tenant B reusing A's key neither gets A's answer (a leak) nor is refused: it is B's own
    call, in B's namespace (where "t1" is unknown)."""
    rig = make_rig()
    side = _side(rig)
    _held(rig, salt="tenant-a")
    assert side.handle(_pause("shared", cache_salt="tenant-a"))[0] == 200
    status, b = side.handle(_pause("shared", cache_salt="tenant-b"))
    assert status == 404 and "_idempotent_replayed" not in b
    assert rig.mgr.knows("t1", tenant="tenant-a")


def test_a_failed_call_is_not_remembered() -> None:
    cache = ReplayCache(FakeClock().now)
    calls = []

    def fails() -> tuple[int, dict[str, Any]]:
        calls.append(1)
        return 500, {"detail": "boom"}

    assert cache.run("k", None, {"op": "pause"}, fails) == (500, {"detail": "boom"}, False)
    assert cache.run("k", None, {"op": "pause"}, fails)[2] is False
    assert len(calls) == 2 and len(cache) == 0


def test_answers_are_forgotten_after_the_window_and_beyond_the_bound() -> None:
    clock = FakeClock()
    cache = ReplayCache(clock.now, window_s=60.0, max_keys=3)
    n = [0]

    def apply() -> tuple[int, dict[str, Any]]:
        n[0] += 1
        return 200, {"n": n[0]}

    assert cache.run("a", None, {"op": "end"}, apply) == (200, {"n": 1}, False)
    clock.advance(59.0)
    assert cache.run("a", None, {"op": "end"}, apply) == (200, {"n": 1}, True)
    clock.advance(1.0)  # 60 s after the first call: forgotten
    assert cache.run("a", None, {"op": "end"}, apply) == (200, {"n": 2}, False)
    for key in ("b", "c", "d"):
        cache.run(key, None, {"op": "end"}, apply)
    assert len(cache) == 3  # "a" (the oldest) went first
    assert cache.run("a", None, {"op": "end"}, apply)[2] is False


@pytest.mark.parametrize("bad", ["", "a b", "x" * (MAX_KEY_LEN + 1), "é", 7])
def test_key_grammar(bad: Any) -> None:
    with pytest.raises(ValueError):
        validate_key(bad)
    assert validate_key("0b6f3c7e-5d1a-4c1e-9a8e-3f1d2c4b5a69") != ""


def test_a_replayed_resume_learns_the_wait_once() -> None:
    """A retried resume answers the first answer, with the wait it observed (a second resume
    without a key answers ``observed_wait_s`` None: the pause had already ended)."""
    rig = make_rig()
    side = _side(rig)
    _held(rig)
    side.handle(_pause("p"))
    rig.settle()
    assert rig.mgr.table["t1"].branches["main"].state is BranchState.OFFLOADED
    rig.clock.advance(2.0)
    resume = {"op": "resume", "trajectory_id": "t1", KEY_FIELD: "r"}
    status, first = side.handle(dict(resume))
    assert status == 200
    rig.clock.advance(5.0)
    status, again = side.handle(dict(resume))
    assert status == 200 and again.pop("_idempotent_replayed") and again == first
    assert first["observed_wait_s"] == 2.0
    assert side.handle({"op": "resume", "trajectory_id": "t1"})[1]["observed_wait_s"] is None


def test_a_delete_whose_answer_timed_out_is_answered_on_retry() -> None:
    """The route's 503 on a control timeout does not mean the engine did not apply the call:
    the first DELETE times out at the client while the engine is busy, the engine applies it
    anyway, and the retry with the same key over the real control channel gets its 200."""
    import tempfile
    import threading

    pytest.importorskip("zmq")
    from agentkv_vllm.control import ControlClient, ControlServer, ControlUnavailable

    rig = make_rig()
    side = _side(rig)
    _held(rig)
    busy = threading.Event()  # the engine is busy until the client has given up
    applied: list[int] = []

    def handler(req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not applied:
            assert busy.wait(30)
        status, body = side.handle(req)
        applied.append(status)
        return status, body

    # A short ipc path: socket paths are limited to ~100 bytes.
    server = ControlServer(f"ipc://{tempfile.mkdtemp(prefix='akv-')}/c.sock", handler)
    try:
        end = {"trajectory_id": "t1", KEY_FIELD: "del-timeout"}
        with pytest.raises(ControlUnavailable):
            ControlClient(server.endpoint, timeout_s=0.2).call_sync("end", **end)
        busy.set()
        status, body = ControlClient(server.endpoint, timeout_s=30).call_sync("end", **end)
        assert applied[0] == 200  # the timed-out call was applied
        assert status == 200 and body.pop("_idempotent_replayed") is True
        assert body["trajectory_id"] == "t1"
        assert (
            ControlClient(server.endpoint, timeout_s=30).call_sync("get", trajectory_id="t1")[0]
            == 404
        )
    finally:
        server.close()
