"""agentkv's /metrics collector does not block the API server's event loop: the hooks middleware
refreshes the engine's metrics (an awaited control call) before a scrape reaches vLLM's app, and
the collector's synchronous fetch serves that snapshot."""

from __future__ import annotations

from typing import Any

import pytest

from agentkv_vllm.control import ControlUnavailable
from agentkv_vllm.hooks import AgentKVHooks, HookState
from agentkv_vllm.metrics_snapshot import MetricsSnapshot


class _Engine:
    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.async_calls = 0
        self.sync_calls = 0

    async def call(self, op: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        assert op == "metrics"
        self.async_calls += 1
        return self.status, {"n": self.async_calls} if self.status == 200 else {"detail": "x"}

    def call_sync(
        self, op: str, timeout_s: float | None = None, **fields: Any
    ) -> tuple[int, dict[str, Any]]:
        self.sync_calls += 1
        return self.status, {"sync": self.sync_calls}


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def test_a_refreshed_snapshot_is_served_without_a_blocking_call() -> None:
    engine, clock = _Engine(), _Clock()
    snap = MetricsSnapshot(engine, fresh_s=1.0, clock=clock)
    await snap.refresh()
    clock.t += 0.5
    assert snap.fetch() == {"n": 1} and engine.sync_calls == 0
    clock.t += 1.0  # a scrape that did not go through the middleware: one blocking call
    assert snap.fetch() == {"sync": 1}


async def test_a_failed_refresh_makes_the_scrape_unreachable_without_a_second_wait() -> None:
    engine, clock = _Engine(status=503), _Clock()
    snap = MetricsSnapshot(engine, clock=clock)
    await snap.refresh()  # never raises
    with pytest.raises(ControlUnavailable, match="503"):
        snap.fetch()
    assert engine.sync_calls == 0


async def test_the_middleware_refreshes_before_get_metrics_only() -> None:
    refreshed: list[str] = []
    reached: list[str] = []

    async def before() -> None:
        refreshed.append("refresh")

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(f"{scope['method']} {scope['path']} after {len(refreshed)}")

    mw = AgentKVHooks(app, HookState(enabled=True, before_metrics=before))

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        pass

    for method, path in (("GET", "/metrics"), ("GET", "/metrics/"), ("GET", "/health")):
        await mw({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
    assert reached == ["GET /metrics after 1", "GET /metrics/ after 2", "GET /health after 2"]
