"""The control channel's client keeps its REQ sockets (issue 26): N calls open one socket, and a
call that did not end in a reply (timed out, cancelled) closes its socket, so a late reply never
answers the next call. Over a real ControlServer on an ipc socket."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("zmq")

from agentkv_vllm.control import (
    POOL_MAX,
    ControlClient,
    ControlServer,
    ControlUnavailable,
)


class Engine:
    """The engine side: echoes each request; a request with ``hold`` waits for ``release``."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.seen: list[str] = []

    def handle(self, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.seen.append(str(req["op"]))
        if req.get("hold"):
            self.arrived.set()
            assert self.release.wait(30)
        return 200, {"op": req["op"], "n": req.get("n")}


@pytest.fixture
def engine() -> Iterator[tuple[Engine, ControlServer]]:
    eng = Engine()
    # A short ipc path: socket paths are limited to ~100 bytes.
    server = ControlServer(f"ipc://{tempfile.mkdtemp(prefix='akv-')}/c.sock", eng.handle)
    try:
        yield eng, server
    finally:
        eng.release.set()
        server.close()


def test_sequential_sync_calls_reuse_one_socket(engine: tuple[Engine, ControlServer]) -> None:
    _, server = engine
    client = ControlClient(server.endpoint, timeout_s=30)
    for n in range(20):
        assert client.call_sync("tick", n=n) == (200, {"op": "tick", "n": n})
    assert client.opened == 1
    client.close()


def test_sequential_async_calls_reuse_one_socket(engine: tuple[Engine, ControlServer]) -> None:
    _, server = engine
    client = ControlClient(server.endpoint, timeout_s=30)

    async def calls() -> list[tuple[int, dict[str, Any]]]:
        return [await client.call("tick", n=n) for n in range(20)]

    assert asyncio.run(calls()) == [(200, {"op": "tick", "n": n}) for n in range(20)]
    assert client.opened == 1
    # A new event loop (a test's asyncio.run, a restarted server loop) gets a socket of its own.
    assert asyncio.run(client.call("tick", n=0)) == (200, {"op": "tick", "n": 0})
    assert client.opened == 2
    client.close()


def test_a_late_reply_never_answers_the_next_sync_call(
    engine: tuple[Engine, ControlServer],
) -> None:
    eng, server = engine
    client = ControlClient(server.endpoint, timeout_s=30)
    assert client.call_sync("ping") == (200, {"op": "ping", "n": None})  # a pooled socket
    with pytest.raises(ControlUnavailable):
        client.call_sync("slow", timeout_s=0.05, hold=True, n=1)
    assert eng.arrived.wait(30)
    eng.release.set()  # the engine answers "slow" now, to a socket that is gone
    assert client.call_sync("next", n=2) == (200, {"op": "next", "n": 2})
    assert client.call_sync("again", n=3) == (200, {"op": "again", "n": 3})
    assert client.opened == 2  # the timed-out socket was closed, its successor kept
    assert eng.seen == ["ping", "slow", "next", "again"]


def test_a_timed_out_or_cancelled_async_call_does_not_poison_the_next(
    engine: tuple[Engine, ControlServer],
) -> None:
    eng, server = engine
    client = ControlClient(server.endpoint, timeout_s=0.05)

    async def scenario() -> None:
        with pytest.raises(ControlUnavailable):
            await client.call("slow", hold=True, n=1)
        eng.release.set()
        assert await client.call("next", n=2) == (200, {"op": "next", "n": 2})
        # A call cancelled while it waits for its reply (the route's request went away).
        eng.release.clear()
        eng.arrived.clear()
        client.timeout_ms = 30_000
        task = asyncio.get_running_loop().create_task(client.call("held", hold=True, n=3))
        assert await asyncio.get_running_loop().run_in_executor(None, eng.arrived.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        eng.release.set()
        assert await client.call("after", n=4) == (200, {"op": "after", "n": 4})

    asyncio.run(scenario())
    assert client.opened == 3  # one per call that ended without its reply, plus the live one
    client.close()


def test_sync_calls_from_many_threads_each_get_their_own_answer(
    engine: tuple[Engine, ControlServer],
) -> None:
    _, server = engine
    client = ControlClient(server.endpoint, timeout_s=30)
    answers: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    start = threading.Barrier(6)

    def worker(w: int) -> None:
        start.wait(30)
        answers[w] = [client.call_sync("metrics", n=w * 100 + i) for i in range(25)]

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for w in range(6):
        assert answers[w] == [(200, {"op": "metrics", "n": w * 100 + i}) for i in range(25)]
    assert 1 <= client.opened <= 6  # at most one socket per concurrent call, never per call
    client.close()


def test_the_pool_keeps_at_most_pool_max_idle_sockets(
    engine: tuple[Engine, ControlServer],
) -> None:
    _, server = engine
    client = ControlClient(server.endpoint, timeout_s=30)

    async def burst() -> None:
        n = POOL_MAX + 4
        got = await asyncio.gather(*(client.call("status", n=i) for i in range(n)))
        assert got == [(200, {"op": "status", "n": i}) for i in range(n)]
        assert len(client._free) == POOL_MAX

    asyncio.run(burst())
    client.close()


# --- the status op's views (issue 40 item 5) --------------------------------------------------


def _status_side() -> tuple[Any, Any]:
    """ControlOps over a real manager on the simulated engine: tenant A ("tenant-a") and the
    unsalted namespace each hold a paused trajectory (A's pause teaches the tool "a-secret-tool")."""
    from agentkv.idempotency import ReplayCache
    from agentkv_vllm.control_ops import ControlOps
    from tests.unit.sim_engine import make_rig

    rig = make_rig()

    class Side(ControlOps):
        manager = rig.mgr
        replays = ReplayCache(rig.clock.now)

        def status(self) -> dict[str, Any]:
            return rig.mgr.status()

        def wake_needed(self) -> bool:
            return False

    prompt = [7, 7, 7, 7, 9, 9, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 1]
    rig.run(rig.eng.new_request("a-private-run", "main", prompt, max_new=0, salt="tenant-a"))
    rig.run(rig.eng.new_request("plain-run", "main", prompt, max_new=0))
    side = Side()
    for tid, salt in (("a-private-run", "tenant-a"), ("plain-run", None)):
        req = {"op": "pause", "trajectory_id": tid, "tool": f"{tid}-tool", "expected_wait_s": 1.0}
        assert side.handle({**req, **({"cache_salt": salt} if salt else {})})[0] == 200
        resume = {"op": "resume", "trajectory_id": tid, **({"cache_salt": salt} if salt else {})}
        assert side.handle(resume)[0] == 200  # the predictor learns the tool's wait
    return side, rig


def test_status_shows_a_tenant_only_its_own_trajectories_and_no_learned_tools() -> None:
    """Issue 40 item 5: /status listed every tenant's trajectory ids and the tools learned from
    all of them to any caller."""
    side, _ = _status_side()
    _, full = side.handle({"op": "status", "operator": True})
    assert set(full["trajectory_ids"]) == {"a-private-run", "plain-run"}
    assert "a-private-run-tool" in full["predictor"] and full["view"] == "operator"
    for salt, own in (("tenant-a", ["a-private-run"]), ("tenant-b", []), (None, ["plain-run"])):
        req = {"op": "status", **({"cache_salt": salt} if salt else {})}
        status, body = side.handle(req)
        assert status == 200 and body["view"] == "tenant"
        assert body["trajectory_ids"] == own
        text = repr(body)
        for other in {"a-private-run", "plain-run"} - set(own):
            assert other not in text  # neither its id nor its tool's name
        assert "predictor" not in body and "per_tool" not in body["device_prefetch"]
        assert body["trajectories"] == 2  # aggregates stay
        assert body["counters"] == full["counters"]


def test_status_operator_flag_must_be_true_not_just_present() -> None:
    side, _ = _status_side()
    _, body = side.handle({"op": "status", "operator": "yes"})
    assert body["view"] == "tenant" and body["trajectory_ids"] == ["plain-run"]


def test_tenant_view_drops_the_last_unblocked_request_id() -> None:
    from agentkv_vllm.control_ops import tenant_view

    body = {"pool": {"last_unblocked": {"request_id": "resp_x", "blocked_at_step": 3}}}
    out = tenant_view(body, [])
    assert out["pool"]["last_unblocked"] == {"blocked_at_step": 3}
    assert body["pool"]["last_unblocked"]["request_id"] == "resp_x"  # the input is not changed
