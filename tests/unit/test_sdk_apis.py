"""harness_sdk drop-ins for the Responses API (``client.responses.create``) and the Anthropic
Messages API (``harness_sdk.anthropic.wrap``): the real client packages against an
httpx.MockTransport fake of vLLM + agentkv (pure logic, no server)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from harness_sdk import anthropic as sdk_anthropic  # noqa: E402
from harness_sdk.openai import wrap  # noqa: E402
from tests.unit.test_sdk_trajectory import FakeServer  # noqa: E402

RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "created_at": 0,
    "model": "tiny",
    "status": "completed",
    "output": [],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
}
MESSAGE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "tiny",
    "content": [{"type": "text", "text": "x"}],
    "stop_reason": "end_turn",
    "usage": {"input_tokens": 1, "output_tokens": 1},
}


class ApiServer(FakeServer):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, httpx.Headers, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path in ("/v1/responses", "/v1/messages"):
            if request.headers.get("authorization") != "Bearer k":
                return httpx.Response(401, json={"detail": "wrong key"})
            body = json.loads(request.content)
            self.seen.append((path, request.headers, body))
            return httpx.Response(200, json=RESPONSE if "responses" in path else MESSAGE)
        return super().__call__(request)


def httpx2_transport(server: ApiServer, asynchronous: bool = False) -> Any:
    """The fake server behind the ``httpx2`` transport the anthropic package requires."""
    httpx2 = pytest.importorskip("httpx2")

    def handler(req: Any) -> Any:
        r = server(
            httpx.Request(req.method, str(req.url), headers=dict(req.headers), content=req.content)
        )
        return httpx2.Response(r.status_code, headers=dict(r.headers), content=r.content)

    if asynchronous:

        async def ahandler(req: Any) -> Any:
            await req.aread()
            return handler(req)

        return httpx2.AsyncClient(transport=httpx2.MockTransport(ahandler))
    return httpx2.Client(transport=httpx2.MockTransport(handler))


def agentkv_of(body: dict[str, Any]) -> Any:
    return body["kv_transfer_params"]["agentkv"]


def test_responses_create_carries_the_trajectory() -> None:
    server = ApiServer()
    raw = openai.OpenAI(
        base_url="http://127.0.0.1:8000/v1",
        api_key="k",
        http_client=httpx.Client(transport=httpx.MockTransport(server)),
    )
    routes = httpx.AsyncClient(transport=httpx.MockTransport(server))
    with wrap(raw, "resp-traj", http_client=routes) as client:
        r = client.responses.create(model="tiny", input="hi", extra_body={"top_k": 1})
        assert r.id == "resp_1"
        with client.tool("run_tests", expected_s=2):
            pass
    path, headers, body = server.seen[0]
    assert path == "/v1/responses" and headers["x-session-id"] == "resp-traj"
    assert agentkv_of(body) == {"trajectory_id": "resp-traj", "branch": "main"}
    assert body["top_k"] == 1  # the caller's extra_body is kept
    ops = [(m, p) for m, p, _ in server.calls if p.startswith("/agentkv")]
    assert ops == [
        ("POST", "/agentkv/v1/trajectories/resp-traj/pause"),
        ("POST", "/agentkv/v1/trajectories/resp-traj/resume"),
        ("DELETE", "/agentkv/v1/trajectories/resp-traj"),
    ]


def test_anthropic_messages_create_carries_the_trajectory() -> None:
    server = ApiServer()
    raw = anthropic.Anthropic(
        base_url="http://127.0.0.1:8000",
        auth_token="k",  # vLLM checks Authorization: Bearer
        http_client=httpx2_transport(server),
    )
    routes = httpx.AsyncClient(transport=httpx.MockTransport(server))
    client = sdk_anthropic.wrap(raw, "msg-traj", branch="b1", http_client=routes)
    assert isinstance(client, sdk_anthropic.AnthropicTrajectory)
    msg = client.messages.create(
        model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )
    assert msg.content[0].text == "x"
    with client.tool("get_weather"):
        pass
    client.close()
    path, headers, body = server.seen[0]
    assert path == "/v1/messages" and headers["x-session-id"] == "msg-traj"
    assert agentkv_of(body) == {"trajectory_id": "msg-traj", "branch": "b1"}
    # the routes used the client's auth_token as the bearer key (else: 401 and no DELETE)
    assert [p for m, p, _ in server.calls if m == "DELETE"] == ["/agentkv/v1/trajectories/msg-traj"]


async def test_async_anthropic_wrapper() -> None:
    server = ApiServer()
    raw = anthropic.AsyncAnthropic(
        base_url="http://127.0.0.1:8000",
        auth_token="k",
        http_client=httpx2_transport(server, asynchronous=True),
    )
    routes = httpx.AsyncClient(transport=httpx.MockTransport(server))
    async with sdk_anthropic.wrap(raw, "amsg", http_client=routes) as client:
        assert isinstance(client, sdk_anthropic.AsyncAnthropicTrajectory)
        await client.messages.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert agentkv_of(server.seen[0][2])["trajectory_id"] == "amsg"
    assert server.calls[-1][:2] == ("DELETE", "/agentkv/v1/trajectories/amsg")
