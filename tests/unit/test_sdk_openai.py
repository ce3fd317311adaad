"""harness_sdk.openai: the real ``openai`` client (sync and async) wrapped for a trajectory,
against an httpx.MockTransport fake of vLLM + agentkv (pure logic, no server)."""

from __future__ import annotations

import json
import logging
import warnings
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")

from harness_sdk import DegradedWarning, InvalidIdError, TrajectoryClosedError  # noqa: E402
from harness_sdk.openai import AsyncOpenAITrajectory, OpenAITrajectory, wrap  # noqa: E402
from tests.unit.test_sdk_trajectory import FakeServer  # noqa: E402

BASE = "http://127.0.0.1:8000/v1"
MSGS = [{"role": "user", "content": "hi"}]


class Recorder(FakeServer):
    """FakeServer that also keeps each request's headers, and serves /v1/models."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.headers: list[httpx.Headers] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.headers.append(request.headers)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}]})
        if request.url.path == "/v1/completions":
            self.calls.append(("POST", request.url.path, json.loads(request.content)))
            choice = {"index": 0, "text": "x", "finish_reason": "length"}
            return httpx.Response(
                200,
                json={
                    "id": "c",
                    "object": "text_completion",
                    "created": 0,
                    "model": "tiny",
                    "choices": [choice],
                },
            )
        return super().__call__(request)

    def chat_headers(self) -> list[httpx.Headers]:
        return [h for (_, p, _), h in zip(self.calls, self.headers, strict=False) if "chat" in p]


def sync_client(server: Recorder, **kw: Any) -> OpenAITrajectory:
    raw = openai.OpenAI(
        base_url=BASE, api_key="k", http_client=httpx.Client(transport=httpx.MockTransport(server))
    )
    routes = httpx.AsyncClient(transport=httpx.MockTransport(server))
    wrapped = wrap(raw, kw.pop("trajectory_id", "oa-1"), http_client=routes, **kw)
    assert isinstance(wrapped, OpenAITrajectory)
    return wrapped


def async_client(server: Recorder, **kw: Any) -> AsyncOpenAITrajectory:
    raw = openai.AsyncOpenAI(
        base_url=BASE,
        api_key="k",
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(server)),
    )
    routes = httpx.AsyncClient(transport=httpx.MockTransport(server))
    wrapped = wrap(raw, kw.pop("trajectory_id", "oa-2"), http_client=routes, **kw)
    assert isinstance(wrapped, AsyncOpenAITrajectory)
    return wrapped


def test_sync_wrapper_adds_identity_and_tool_waits() -> None:
    server = Recorder()
    with sync_client(server) as client:
        r = client.chat.completions.create(
            model="tiny",
            messages=MSGS,
            extra_headers={"x-trace": "1"},
            extra_body={"kv_transfer_params": {"agentkv": {"zones": [{"name": "system"}]}}},
        )
        assert r.choices[0].message.content == "reply 1"
        assert r.model_extra["kv_transfer_params"]["agentkv"]["trajectory_id"] == "oa-1"
        with client.tool("run_tests", expected_s=2.0) as call:
            call.observe("3 passed")
        assert call.decision == {"action": "retain", "lease_s": 30.0}
        assert client.observations == [{"role": "user", "content": "[run_tests] 3 passed"}]
        client.chat.completions.create(model="tiny", messages=MSGS)
        assert [m.id for m in client.models.list().data] == ["tiny"]  # delegated
    chats = server.chats()
    assert chats[0]["kv_transfer_params"] == {
        "agentkv": {"zones": [{"name": "system"}], "trajectory_id": "oa-1", "branch": "main"}
    }
    assert chats[1]["kv_transfer_params"] == {
        "agentkv": {"trajectory_id": "oa-1", "branch": "main"}
    }
    hdrs = server.chat_headers()
    assert [h.get("x-session-id") for h in hdrs] == ["oa-1", "oa-1"]
    assert hdrs[0].get("x-trace") == "1"
    pause = next(b for m, p, b in server.calls if p.endswith("/pause"))
    # the routing contract: control calls name the session and model in the body (vllm-router
    # drops headers on routes it does not know), chat calls carry the same hint
    assert pause == {
        "tool": "run_tests",
        "expected_wait_s": 2.0,
        "branch": "main",
        "model": "tiny",
        "agent_hint": {"session_id": "oa-1"},
    }
    assert all(c["agent_hint"] == {"session_id": "oa-1"} for c in chats)
    assert server.paths("POST")[-2:] == [
        "/agentkv/v1/trajectories/oa-1/resume",
        "/v1/chat/completions",
    ]
    assert server.paths("DELETE") == ["/agentkv/v1/trajectories/oa-1"]
    with pytest.raises(TrajectoryClosedError):
        client.chat.completions.create(model="tiny", messages=MSGS)


async def test_async_wrapper() -> None:
    server = Recorder()
    async with async_client(server, branch="b2") as client:
        await client.chat.completions.create(model="tiny", messages=MSGS)
        async with client.tool("grep") as call:
            pass
        assert call.pause_response is not None and call.duration_s is not None
        r = await client.completions.create(model="tiny", prompt="x")  # legacy endpoint too
        assert r is not None
        assert await client.server_status() is not None
    bodies = [b for _, p, b in server.calls if p in ("/v1/chat/completions", "/v1/completions")]
    assert all(
        b["kv_transfer_params"]["agentkv"] == {"trajectory_id": "oa-2", "branch": "b2"}
        for b in bodies
    )
    assert server.paths("DELETE") == ["/agentkv/v1/trajectories/oa-2"]


def test_header_only_and_a_random_id() -> None:
    server = Recorder()
    client = sync_client(server, trajectory_id=None, send_params=False)
    assert client.trajectory_id.startswith("traj-")
    client.chat.completions.create(model="tiny", messages=MSGS)
    assert "kv_transfer_params" not in server.chats()[0]
    assert server.chat_headers()[0]["x-session-id"] == client.trajectory_id
    client.close()
    client.close()  # idempotent


def test_ids_follow_the_grammar() -> None:
    raw = openai.OpenAI(base_url=BASE, api_key="k")
    with pytest.raises(InvalidIdError):
        wrap(raw, "a/b")
    with pytest.raises(InvalidIdError):
        wrap(raw, "ok", branch="has space")


def test_a_server_without_routes_degrades() -> None:
    server = Recorder(plugin=False)
    client = sync_client(server)
    client.chat.completions.create(model="tiny", messages=MSGS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with client.tool("run_tests", expected_s=1) as call:
            pass
    assert call.pause_response is None
    assert any(issubclass(w.category, DegradedWarning) for w in caught)
    assert client.routes_available is False
    client.close()


def test_error_in_the_tool_body_still_resumes() -> None:
    server = Recorder()
    client = sync_client(server)
    client.chat.completions.create(model="tiny", messages=MSGS)
    with pytest.raises(ValueError), client.tool("flaky"):
        raise ValueError("tool failed")
    assert server.paths("POST")[-1] == "/agentkv/v1/trajectories/oa-1/resume"
    client.close()


def test_stream_kwargs_pass_through() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        sse = (
            'data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"tiny",'
            '"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
            "data: [DONE]\n\n"
        )
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    raw = openai.OpenAI(
        base_url=BASE, api_key="k", http_client=httpx.Client(transport=httpx.MockTransport(handler))
    )
    client = wrap(raw, "st-1")
    chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, stream=True))
    assert chunks[0].choices[0].delta.content == "hi"
    assert seen[0]["stream"] is True
    assert seen[0]["kv_transfer_params"]["agentkv"]["trajectory_id"] == "st-1"


def test_sync_tool_waits_keep_one_otel_context(caplog: pytest.LogCaptureFixture) -> None:
    """Enter and exit of a blocking tool wait run in one contextvars context: the span's
    context token detaches cleanly (no 'Failed to detach context'), for the wrapper and for
    SyncTrajectory, which share run_tool_wait."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from harness_sdk import SyncTrajectory

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    server = Recorder()
    with caplog.at_level(logging.ERROR):
        client = sync_client(server, tracer_provider=tp)
        client.chat.completions.create(model="tiny", messages=MSGS)
        with client.tool("run_tests", expected_s=1):
            pass
        client.close()
        routes = httpx.AsyncClient(transport=httpx.MockTransport(server))
        with SyncTrajectory(
            BASE, "tiny", api_key="k", http_client=routes, system="s", tracer_provider=tp
        ) as traj:
            traj.complete("hi")
            with traj.tool("grep"):
                pass
    assert not [r for r in caplog.records if "detach" in r.getMessage()]
    assert [s.name for s in exporter.get_finished_spans() if s.name.startswith("tool_wait")] == [
        "tool_wait run_tests",
        "tool_wait grep",
    ]
