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


def test_a_wrapped_client_names_its_tenant_on_every_request() -> None:
    """Issue 40 item 6: the ``cache_salt`` option goes in each request's body and on each
    agentkv route call (header and body), so the salted trajectory is paused and deleted."""
    server = Recorder()
    with sync_client(server, cache_salt="tenant-a", send_params=False) as client:
        client.chat.completions.create(model="tiny", messages=MSGS)
        with client.tool("pytest", expected_s=1.0):
            pass
    chat = server.chats()[-1]
    assert chat["cache_salt"] == "tenant-a" and "kv_transfer_params" not in chat
    control = [
        (m, p, b, h)
        for (m, p, b), h in zip(server.calls, server.headers, strict=False)
        if p.startswith("/agentkv/")
    ]
    assert [m for m, *_ in control] == ["POST", "POST", "DELETE"]
    assert all(b["cache_salt"] == h["x-agentkv-cache-salt"] == "tenant-a" for _, _, b, h in control)


# ------------------------------------------- issue 42: the call paths agent frameworks use

CHAT_REPLY = {
    "id": "c",
    "object": "chat.completion",
    "created": 0,
    "model": "tiny",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ],
}
MESSAGE_REPLY = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "tiny",
    "content": [{"type": "text", "text": "hi"}],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {"input_tokens": 1, "output_tokens": 1},
}
RESPONSES_SSE = (
    "event: response.completed\n"
    'data: {"type":"response.completed","sequence_number":0,"response":{"id":"resp_1",'
    '"object":"response","created_at":0,"model":"tiny","output":[],"status":"completed",'
    '"parallel_tool_calls":false,"tool_choice":"auto","tools":[]}}\n\n'
)


class PathRecorder:
    """A fake vLLM + agentkv for every generation path: records (path, headers, body)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, httpx.Headers, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.seen.append((request.url.path, request.headers, body))
        path = request.url.path
        if path.startswith("/agentkv/"):
            return httpx.Response(200, json={"released_blocks": 0})
        if path.endswith("/responses"):
            return httpx.Response(
                200, text=RESPONSES_SSE, headers={"content-type": "text/event-stream"}
            )
        if path.endswith("/messages"):
            return httpx.Response(200, json=MESSAGE_REPLY)
        return httpx.Response(200, json=CHAT_REPLY)

    def generations(self) -> list[tuple[str, httpx.Headers, Any]]:
        return [s for s in self.seen if not s[0].startswith("/agentkv/")]

    def assert_all_carry(self, tid: str, n: int, *, params: bool = True) -> None:
        gens = self.generations()
        assert len(gens) == n, [p for p, _, _ in gens]
        for path, headers, body in gens:
            assert headers.get("x-session-id") == tid, path
            if params:
                assert body["kv_transfer_params"]["agentkv"] == {
                    "trajectory_id": tid,
                    "branch": "main",
                }, path


def _transports(server: PathRecorder, is_async: bool) -> tuple[Any, httpx.AsyncClient]:
    mock = httpx.MockTransport(server)
    http = httpx.AsyncClient(transport=mock) if is_async else httpx.Client(transport=mock)
    return http, httpx.AsyncClient(transport=mock)


def test_openai_framework_paths_carry_the_trajectory() -> None:
    """LangChain's ChatOpenAI (``with_raw_response``), the Agents SDK's streamed Responses
    (``with_streaming_response``), retries (``with_options``) and the client-level views: each
    request carries the header and the params, and ``close`` DELETEs the trajectory."""
    server = PathRecorder()
    http, routes = _transports(server, is_async=False)
    raw = openai.OpenAI(base_url=BASE, api_key="k", http_client=http)
    client = wrap(raw, "fw-1", http_client=routes)
    reply = client.chat.completions.with_raw_response.create(model="tiny", messages=MSGS)
    assert reply.parse().choices[0].message.content == "hi"
    with client.responses.with_streaming_response.create(
        model="tiny", input="hi", stream=True
    ) as streamed:
        assert b"response.completed" in streamed.read()
    retried = client.with_options(max_retries=3, timeout=5.0)
    assert retried.trajectory_id == "fw-1" and retried.client is not raw
    retried.chat.completions.create(model="tiny", messages=MSGS)
    client.with_raw_response.chat.completions.create(model="tiny", messages=MSGS).parse()
    client.copy(max_retries=0).with_streaming_response.chat.completions.create(
        model="tiny", messages=MSGS
    ).__enter__().read()
    server.assert_all_carry("fw-1", 5)
    assert client.requests == 5  # counted together: close() knows the trajectory was used
    # A path the wrapper does not know still names the trajectory (the default header).
    client.post("/chat/completions", body={"model": "tiny"}, cast_to=httpx.Response)
    assert server.generations()[-1][1]["x-session-id"] == "fw-1"
    assert "x-session-id" not in raw.default_headers  # the caller's client is untouched
    retried.close()
    client.close()  # the same trajectory: closed once
    assert [p for p, _, _ in server.seen if p.startswith("/agentkv/")] == [
        "/agentkv/v1/trajectories/fw-1"
    ]


async def test_async_openai_framework_paths_carry_the_trajectory() -> None:
    server = PathRecorder()
    http, routes = _transports(server, is_async=True)
    raw = openai.AsyncOpenAI(base_url=BASE, api_key="k", http_client=http)
    client = wrap(raw, "fw-2", http_client=routes)
    reply = await client.chat.completions.with_raw_response.create(model="tiny", messages=MSGS)
    assert reply.parse().choices[0].message.content == "hi"
    async with client.responses.with_streaming_response.create(
        model="tiny", input="hi", stream=True
    ) as streamed:
        assert b"response.completed" in await streamed.read()
    await client.with_options(max_retries=2).chat.completions.create(model="tiny", messages=MSGS)
    await client.with_raw_response.responses.create(model="tiny", input="hi", stream=True)
    server.assert_all_carry("fw-2", 4)
    await client.close()
    assert server.seen[-1][0] == "/agentkv/v1/trajectories/fw-2"


@pytest.mark.parametrize("is_async", [False, True])
def test_anthropic_beta_messages_and_views_carry_the_trajectory(is_async: bool) -> None:
    """pydantic-ai's Anthropic model calls ``client.beta.messages.create``."""
    import asyncio

    anthropic = pytest.importorskip("anthropic")
    from harness_sdk.anthropic import wrap as wrap_anthropic
    from tests.unit.test_sdk_apis import httpx2_transport

    server = PathRecorder()
    _, routes = _transports(server, is_async)
    http = httpx2_transport(server, asynchronous=is_async)  # type: ignore[arg-type]
    cls = anthropic.AsyncAnthropic if is_async else anthropic.Anthropic
    raw = cls(base_url="http://127.0.0.1:8000", auth_token="k", http_client=http)
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "messages": MSGS}

    async def run() -> None:
        client = wrap_anthropic(raw, "fw-3", http_client=routes)

        async def done(x: Any) -> Any:
            return await x if is_async else x

        msg = await done(client.beta.messages.create(**kw))
        assert msg.content[0].text == "hi"
        await done(client.messages.with_raw_response.create(**kw))
        await done(client.beta.messages.with_raw_response.create(**kw))
        await done(client.with_options(max_retries=1).beta.messages.create(**kw))
        if is_async:
            await client.close()

    if is_async:
        asyncio.run(run())
    else:
        sync_client = wrap_anthropic(raw, "fw-3", http_client=routes)
        sync_client.beta.messages.create(**kw)
        sync_client.messages.with_raw_response.create(**kw)
        sync_client.beta.messages.with_raw_response.create(**kw)
        sync_client.with_options(max_retries=1).beta.messages.create(**kw)
        sync_client.close()
    server.assert_all_carry("fw-3", 4)
    assert server.seen[-1][0] == "/agentkv/v1/trajectories/fw-3"


def test_a_wrapper_that_decorated_nothing_says_so() -> None:
    from harness_sdk import openai as sdk_openai

    sdk_openai._warned.discard("unused:OpenAITrajectory")
    server = PathRecorder()
    http, routes = _transports(server, is_async=False)
    raw = openai.OpenAI(base_url=BASE, api_key="k", http_client=http)
    client = wrap(raw, "fw-4", http_client=routes)
    with pytest.warns(DegradedWarning, match="without decorating a request"):
        client.close()


def test_a_view_that_cannot_be_rebuilt_warns_once() -> None:
    from harness_sdk import openai as sdk_openai

    class Picky:
        def __init__(self, resource: Any, extra: Any) -> None:  # not the SDK's one-arg shape
            raise AssertionError("unreachable")

    class Resource:
        with_raw_response = Picky.__new__(Picky)

        def create(self, **kw: Any) -> Any:
            return kw

    class Client:
        base_url = BASE
        api_key = "k"
        chat = type("Chat", (), {"completions": Resource()})()

    sdk_openai._warned.clear()
    client = wrap(Client(), "fw-5")
    with pytest.warns(DegradedWarning, match="could not be wrapped"):
        view = client.chat.completions.with_raw_response
    assert isinstance(view, Picky)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        client.chat.completions.with_raw_response  # noqa: B018 - once only
    client.chat.completions.create(model="tiny")  # a request decorated: close() is quiet
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no routes behind this duck-typed client
        client.close()
