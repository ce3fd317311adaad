"""A control op wakes vLLM's engine loop only when the loop may be blocked (issue 26).

A wake-up is a utility call: the engine thread answers it between steps (~0.4 ms of its CPU,
more of the API server's). On this project's 2-core CPU machines that CPU comes out of the
forward pass, so a pause and a resume that woke a stepping engine every time slowed every
running request. The engine side says whether the op left work only a step applies while no
request is live (``SchedulerSide.wake_needed``); the route wakes the loop only then, and an
engine that does not say is woken as before."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from agentkv_vllm import routes
from agentkv_vllm.control_ops import WAKE_FIELD
from agentkv_vllm.scheduler_side import SchedulerSide
from agentkv_vllm.settings import ConnectorSettings
from tests.unit.test_engine_config import _vllm_config


def _plain(rid: str) -> Any:
    return SimpleNamespace(request_id=rid, kv_transfer_params=None, num_tokens=40)


@pytest.fixture
def side(monkeypatch: pytest.MonkeyPatch) -> SchedulerSide:
    side = SchedulerSide(*_vllm_config("cpu"), ConnectorSettings())
    work = {"pending": False}
    # The manager's predicate is tested with the manager; here: what the adapter makes of it.
    monkeypatch.setattr(side.manager, "engine_work_pending", lambda: work["pending"])
    side.work = work  # type: ignore[attr-defined]
    return side


def test_no_wake_without_engine_work(side: Any) -> None:
    assert not side.wake_needed()


def test_work_on_an_engine_with_no_live_request_wakes_it(side: Any) -> None:
    side.work["pending"] = True
    assert side.wake_needed()


def test_a_live_request_keeps_the_loop_stepping_so_work_needs_no_wake(side: Any) -> None:
    side.work["pending"] = True
    req = _plain("r1")
    side.lookup(req, 0)
    assert not side.wake_needed()
    side.lookup(req, 0)  # looked up again (it waited a step): still one live request
    side.finish(req, [])
    assert side.wake_needed()  # its last step is done: the loop may block now


def test_the_route_ops_answer_whether_to_wake_and_the_others_do_not(side: Any) -> None:
    side.work["pending"] = True
    status, body = side.handle({"op": "status"})
    assert status == 200 and body[WAKE_FIELD] is True
    status, body = side.handle({"op": "get", "trajectory_id": "nobody"})
    assert status == 404 and body[WAKE_FIELD] is True
    for op in ("tick", "ping", "metrics"):
        _, body = side.handle({"op": op})
        assert WAKE_FIELD not in body


class _Rank:
    def __init__(self, wake: bool | None) -> None:
        self.wake = wake

    async def call(self, op: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        body: dict[str, Any] = {"trajectory_id": fields.get("trajectory_id")}
        if self.wake is not None:
            body[WAKE_FIELD] = self.wake
        return 200, body


class _Engine:
    def __init__(self) -> None:
        self.calls = 0

    async def is_sleeping(self) -> bool:
        self.calls += 1
        return False


@pytest.mark.parametrize(("wake", "woken"), [(True, 1), (False, 0), (None, 1)])
async def test_the_route_wakes_the_engine_only_when_its_answer_asks(
    monkeypatch: pytest.MonkeyPatch, wake: bool | None, woken: int
) -> None:
    rank, engine = _Rank(wake), _Engine()
    monkeypatch.setattr(routes._State, "client", rank)
    monkeypatch.setattr(routes._State, "clients", [rank])
    monkeypatch.setattr(routes._State, "engine_client", engine)
    response = await routes._call("resume", nudge=True, trajectory_id="t1")
    assert response.status_code == 200
    assert WAKE_FIELD.encode() not in bytes(response.body)  # internal: never shown to a client
    await asyncio.gather(*routes._State.background)
    assert engine.calls == woken


async def test_an_auto_pause_over_dp_ranks_wakes_when_any_rank_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = _Engine()
    monkeypatch.setattr(routes._State, "engine_client", engine)
    monkeypatch.setattr(routes._State, "hooks_clients", [_Rank(False), _Rank(False)])
    await routes._auto_pause("t1", "main", ["grep"], None)
    await asyncio.gather(*routes._State.background)
    assert engine.calls == 0
    monkeypatch.setattr(routes._State, "hooks_clients", [_Rank(False), _Rank(True)])
    await routes._auto_pause("t1", "main", ["grep"], None)
    await asyncio.gather(*routes._State.background)
    assert engine.calls == 1
