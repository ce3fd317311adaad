"""harness_sdk.Trajectory against an httpx.MockTransport fake of the agentkv server (pure logic)."""

from __future__ import annotations

import asyncio
import json
import warnings
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from harness_sdk import (
    AuthenticationError,
    ConfigError,
    DegradedWarning,
    HarnessWarning,
    InvalidIdError,
    LayoutError,
    NotFoundError,
    PauseNotAppliedWarning,
    StableZoneChangedWarning,
    SyncTrajectory,
    Trajectory,
    TrajectoryClosedError,
    TrajectoryNotFoundWarning,
    TransportError,
    VolatileContentWarning,
)


class FakeServer:
    """Records every request; answers like vLLM + the agentkv plugin (or without it)."""

    def __init__(self, *, plugin: bool = True, api_key: str | None = "k") -> None:
        self.plugin = plugin
        self.api_key = api_key
        self.calls: list[tuple[str, str, Any]] = []
        self.turns: dict[str, int] = {}
        self.fail_next_chat: int | None = None
        self.pause_applied = True
        self.pause_state = "retained"

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body: Any = json.loads(request.content) if request.content else {}
        path = request.url.path
        self.calls.append((request.method, path, body))
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return httpx.Response(401, json={"detail": "missing or wrong API key"})
        if path == "/v1/chat/completions":
            return self._chat(body)
        if not self.plugin or not path.startswith("/agentkv/v1/"):
            return httpx.Response(404, json={"detail": "Not Found"})
        tid = path.split("/")[4] if path.startswith("/agentkv/v1/trajectories/") else None
        if path.endswith("/pause"):
            return httpx.Response(
                200,
                json={
                    "trajectory_id": tid,
                    "branch": body["branch"],
                    "applied": self.pause_applied,
                    "state": self.pause_state,
                    "decision": {"action": "retain", "lease_s": 30.0},
                    "wait_estimate": {"p50": 1.0},
                },
            )
        if path.endswith("/resume"):
            return httpx.Response(
                200,
                json={
                    "trajectory_id": tid,
                    "branch": body["branch"],
                    "state": "active",
                    "observed_wait_s": 0.1,
                },
            )
        if request.method == "DELETE":
            return httpx.Response(
                200, json={"trajectory_id": tid, "released_blocks": 3, "dropped_tier_blocks": 1}
            )
        if request.method == "GET" and tid:
            return httpx.Response(404, json={"detail": f"unknown trajectory {tid!r}"})
        return httpx.Response(
            200, json={"bytes_held": {"device_pinned": 0, "host": 0, "disk": 0}, "trajectories": 0}
        )

    def _chat(self, body: dict[str, Any]) -> httpx.Response:
        """A chat completion: ``fail_next_chat`` once, else a reply whose cached tokens are half
        the prompt after the branch's first turn (and the plugin's per-turn stats)."""
        if self.fail_next_chat:
            code, self.fail_next_chat = self.fail_next_chat, None
            return httpx.Response(code, json={"error": {"message": "boom"}})
        prompt = sum(len(json.dumps(m)) for m in body["messages"])
        key = body.get("kv_transfer_params", {}).get("agentkv", {}).get("branch", "-")
        turn = self.turns[key] = self.turns.get(key, 0) + 1
        cached = 0 if turn == 1 else prompt // 2
        out: dict[str, Any] = {
            "id": f"chatcmpl-{turn}",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"reply {turn}"},
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": 4,
                "total_tokens": prompt + 4,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
        if self.plugin and "kv_transfer_params" in body:
            p = body["kv_transfer_params"]["agentkv"]
            out["kv_transfer_params"] = {
                "agentkv": {
                    "turn": turn,
                    "branch": p["branch"],
                    "trajectory_id": p["trajectory_id"],
                    "prompt_tokens": prompt,
                    "device_hit_tokens": cached,
                    "tier_hit_tokens": 0,
                    "hit_tokens": cached,
                    "tier": "device",
                    "hit_ratio": cached / prompt,
                    "prefix_hit_ratio": cached / prompt,
                    "first_divergence_token": None if turn == 1 else prompt - 3,
                    "divergence_zone": None if turn == 1 else "observation",
                }
            }
            if "pause_after" in p:  # the engine paused the branch as the turn finished
                out["kv_transfer_params"]["agentkv"]["pause"] = {
                    "applied": True,
                    "state": "cached",
                    "decision": {"action": "offload_host", "tool": p["pause_after"]["tool"]},
                }
        return httpx.Response(200, json=out)

    def paths(self, method: str | None = None) -> list[str]:
        return [p for m, p, _ in self.calls if method is None or m == method]

    def chats(self) -> list[dict[str, Any]]:
        return [b for _, p, b in self.calls if p == "/v1/chat/completions"]


@pytest.fixture
def otel() -> tuple[TracerProvider, InMemorySpanExporter, MeterProvider, InMemoryMetricReader]:
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    return tp, exporter, MeterProvider(metric_readers=[reader]), reader


def make(server: FakeServer, otel: Any = None, api_key: str | None = "k", **kw: Any) -> Trajectory:
    client = httpx.AsyncClient(transport=httpx.MockTransport(server))
    extra: dict[str, Any] = {}
    if otel is not None:
        extra = {"tracer_provider": otel[0], "meter_provider": otel[2]}
    kw.setdefault("system", "You are a coding agent.")
    return Trajectory(
        "http://127.0.0.1:8000/v1",
        "tiny",
        api_key=api_key,
        trajectory_id="t-1",
        http_client=client,
        max_tokens=8,
        temperature=0,
        **extra,
        **kw,
    )


def metric_points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    data = reader.get_metrics_data()
    assert data is not None
    return [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == name
        for p in m.data.data_points
    ]


async def test_turns_send_kv_transfer_params_and_report_stats(otel: Any) -> None:
    server = FakeServer()
    tools = [{"type": "function", "function": {"name": "pytest", "parameters": {"type": "object"}}}]
    async with make(server, otel, tools=tools) as traj:
        r1 = await traj.complete("fix the bug")
        r2 = await traj.complete("now run the tests")
        assert traj.turn == 2 and len(traj.results) == 2
    assert r1.content == "reply 1" and r1.cached_tokens == 0 and r1.turn == 1
    assert r2.cached_tokens > 0 and r2.hit_ratio == pytest.approx(
        r2.cached_tokens / r2.prompt_tokens
    )
    assert r2.engine is not None and r2.engine["divergence_zone"] == "observation"
    assert r2.client_divergence_message is None  # turn 2 extends turn 1 exactly
    body = server.chats()[1]
    agentkv = body["kv_transfer_params"]["agentkv"]
    assert agentkv["trajectory_id"] == "t-1" and agentkv["branch"] == "main"
    zones = {z["name"]: (z["start_message"], z["end_message"]) for z in agentkv["zones"]}
    assert zones == {
        "system": (0, 1),
        "tools": (1, 1),
        "memory": (1, 1),
        "recent": (1, 3),
        "observation": (3, 4),
    }
    assert body["tools"][0]["function"]["name"] == "pytest"
    assert body["max_tokens"] == 8 and body["temperature"] == 0
    assert [m["content"] for m in body["messages"]] == [
        "You are a coding agent.",
        "fix the bug",
        "reply 1",
        "now run the tests",
    ]
    assert server.paths("DELETE") == ["/agentkv/v1/trajectories/t-1"]
    spans = [s for s in otel[1].get_finished_spans() if s.name == "chat tiny"]
    assert len(spans) == 2
    a = spans[1].attributes
    assert a is not None
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny"
    assert (
        a["gen_ai.conversation.id"] == "t-1" and a["gen_ai.usage.input_tokens"] == r2.prompt_tokens
    )
    assert a["gen_ai.usage.cache_read.input_tokens"] == r2.cached_tokens
    assert a["agentkv.prefix_hit_ratio"] == pytest.approx(r2.hit_ratio)
    assert a["agentkv.first_divergence_token"] == r2.engine["first_divergence_token"]
    assert a["agentkv.divergence_zone"] == "observation"
    assert a["server.address"] == "127.0.0.1" and a["server.port"] == 8000
    points = metric_points(otel[3], "agentkv.sdk.prefix_hit_ratio")
    assert sum(p.count for p in points) == 2
    assert points[0].attributes["gen_ai.conversation.id"] == "t-1"


async def test_tool_wait_pauses_measures_and_resumes(otel: Any) -> None:
    server = FakeServer()
    traj = make(server, otel)
    await traj.complete("hi")
    async with traj.tool("pytest", expected_s=45) as call:
        await asyncio.sleep(0.05)
        call.observe("3 passed")
    assert call.decision == {"action": "retain", "lease_s": 30.0}
    assert call.duration_s is not None and call.duration_s >= 0.05
    pause = next(b for m, p, b in server.calls if p.endswith("/pause"))
    assert pause == {
        "tool": "pytest",
        "expected_wait_s": 45,
        "branch": "main",
        "model": "tiny",
        "agent_hint": {"session_id": "t-1"},
    }
    chat = server.chats()[-1]
    assert chat["agent_hint"] == {"session_id": "t-1"} and chat["model"] == "tiny"
    assert server.paths()[-1] == "/agentkv/v1/trajectories/t-1/resume"
    assert traj.context.observation[-1]["content"] == "[pytest] 3 passed"
    span = next(s for s in otel[1].get_finished_spans() if s.name == "tool_wait pytest")
    assert span.attributes is not None
    assert (
        span.attributes["agentkv.tool.name"] == "pytest"
        and span.attributes["agentkv.pause.action"] == "retain"
    )
    assert span.attributes["agentkv.tool.duration_s"] >= 0.05
    waits = metric_points(otel[3], "agentkv.sdk.tool_wait.duration")
    assert waits[0].count == 1 and waits[0].attributes["agentkv.tool.name"] == "pytest"
    await traj.close()


async def test_a_turn_that_names_its_tool_makes_that_tool_wait_free(otel: Any) -> None:
    """``complete(then_tool=...)``: the request carries pause_after, the tool wait that follows
    makes no pause and no resume call (the engine paused at finish; the next turn resumes),
    and its decision is the one the reply carried."""
    server = FakeServer()
    traj = make(server, otel)
    await traj.complete("hi", then_tool="pytest", then_expected_s=45)
    agentkv = server.chats()[-1]["kv_transfer_params"]["agentkv"]
    assert agentkv["pause_after"] == {"tool": "pytest", "expected_wait_s": 45}
    async with traj.tool("pytest") as call:
        call.observe("3 passed")
    assert call.declared
    assert call.decision == {"action": "offload_host", "tool": "pytest"}
    assert not [p for p in server.paths() if p.endswith(("/pause", "/resume"))]
    await traj.complete()
    assert "pause_after" not in server.chats()[-1]["kv_transfer_params"]["agentkv"]
    # A tool wait of another tool, or a second one, pauses by the route as before.
    await traj.complete(then_tool="pytest")
    async with traj.tool("grep"):
        pass
    async with traj.tool("pytest"):
        pass
    assert server.paths().count("/agentkv/v1/trajectories/t-1/pause") == 2
    assert server.paths().count("/agentkv/v1/trajectories/t-1/resume") == 2
    with pytest.raises(ConfigError):
        await traj.complete(then_tool="")
    await traj.close()


async def test_tool_that_raises_still_resumes_and_reraises(otel: Any) -> None:
    server = FakeServer()
    traj = make(server, otel)
    await traj.complete("hi")
    with pytest.raises(RuntimeError, match="tests crashed"):
        async with traj.tool("pytest", expected_s=1):
            raise RuntimeError("tests crashed")
    assert server.paths()[-2:] == [
        "/agentkv/v1/trajectories/t-1/pause",
        "/agentkv/v1/trajectories/t-1/resume",
    ]
    span = next(s for s in otel[1].get_finished_spans() if s.name == "tool_wait pytest")
    assert span.status.status_code is StatusCode.ERROR
    assert any(e.name == "exception" for e in span.events)
    assert traj.tool_waits[-1].error is not None
    r = await traj.complete("after the crash")  # the trajectory keeps working
    assert r.turn == 2
    await traj.close()


async def test_changed_stable_zone_is_warned_and_traced(otel: Any) -> None:
    server = FakeServer()
    traj = make(server, otel)
    await traj.complete("q1")
    traj.set_system("You are a coding agent. Be terse.")
    with pytest.warns(StableZoneChangedWarning, match="system"):
        r = await traj.complete("q2")
    assert [c.zone for c in r.zone_changes] == ["system"]
    assert "Be terse" in r.zone_changes[0].diff
    assert r.client_divergence_message == 0 and r.client_divergence_zone == "system"
    span = [s for s in otel[1].get_finished_spans() if s.name == "chat tiny"][-1]
    assert span.attributes is not None
    assert list(span.attributes["agentkv.zone_changed"]) == ["system"]
    assert span.attributes["agentkv.client_divergence_message"] == 0
    event = next(e for e in span.events if e.name == "agentkv.zone_changed")
    assert event.attributes is not None and "Be terse" in str(event.attributes["agentkv.diff"])
    await traj.close()


async def test_volatile_content_in_stable_zone_warns_once() -> None:
    server = FakeServer()
    traj = make(server, system="You are an agent. Session 123e4567-e89b-12d3-a456-426614174000.")
    with pytest.warns(VolatileContentWarning, match="uuid"):
        r = await traj.complete("q1")
    assert [f.kind for f in r.lint] == ["uuid"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", VolatileContentWarning)
        await traj.complete("q2")  # the same finding is not warned twice
    await traj.close()


async def test_degrades_without_plugin() -> None:
    server = FakeServer(plugin=False)
    traj = make(server)
    r = await traj.complete("hi")
    assert r.engine is None and r.hit_ratio == 0.0
    with pytest.warns(DegradedWarning):
        async with traj.tool("grep", expected_s=2) as call:
            pass
    assert call.decision is None and traj.routes_available is False
    async with traj.tool("grep"):  # no more control calls once known absent
        pass
    assert server.paths().count("/agentkv/v1/trajectories/t-1/pause") == 1
    assert "/agentkv/v1/trajectories/t-1/resume" not in server.paths()
    assert await traj.server_status() is None
    assert (await traj.complete("again")).turn == 2
    assert await traj.close() is None


async def test_errors_map_to_the_exception_tree() -> None:
    server = FakeServer()
    traj = make(server, api_key="wrong")
    with pytest.raises(AuthenticationError) as info:
        await traj.complete("hi")
    assert info.value.status_code == 401
    with pytest.raises(AuthenticationError):
        async with traj.tool("pytest"):
            pass
    await traj.close()
    traj = make(server)
    server.fail_next_chat = 404
    with pytest.raises(NotFoundError):
        await traj.complete("hi")

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    broken = Trajectory(
        "http://127.0.0.1:1",
        "tiny",
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(down)),
    )
    with pytest.raises(TransportError):
        await broken.complete("hi")
    await broken.close()


async def test_closed_trajectory_refuses_turns() -> None:
    server = FakeServer()
    traj = make(server)
    await traj.complete("hi")
    released = await traj.close()
    assert released == {"trajectory_id": "t-1", "released_blocks": 3, "dropped_tier_blocks": 1}
    assert await traj.close() is None  # idempotent
    with pytest.raises(TrajectoryClosedError):
        await traj.complete("again")
    with pytest.raises(TrajectoryClosedError):
        async with traj.tool("x"):
            pass


async def test_fork_prune_join() -> None:
    server = FakeServer()
    traj = make(server)
    await traj.complete("plan")
    a, b = traj.fork(2)
    assert (a.branch, b.branch) == (
        "main.1",
        "main.2",
    ) and a.trajectory_id == b.trajectory_id == "t-1"
    ra, rb = await asyncio.gather(a.complete("try A"), b.complete("try B"))
    assert ra.turn == rb.turn == 2
    bodies = server.chats()[-2:]
    assert {x["kv_transfer_params"]["agentkv"]["branch"] for x in bodies} == {"main.1", "main.2"}
    assert bodies[0]["messages"][:3] == bodies[1]["messages"][:3]  # shared prefix
    async with a.tool("pytest", expected_s=0.1):
        pass
    assert any(b2.get("branch") == "main.1" for _, p, b2 in server.calls if p.endswith("/resume"))
    b.prune()
    with pytest.raises(TrajectoryClosedError):
        await b.complete("more")
    traj.join(a)
    assert traj.turn == 2 and traj.children == []
    assert a.pruned and traj.context.turns[-1][0]["content"] == "try A"
    r = await traj.complete("continue on main")
    assert r.turn == 3 and r.branch == "main"
    with pytest.raises(LayoutError):
        traj.fork(0)
    with pytest.raises(LayoutError):
        traj.prune()
    await traj.close()
    assert server.paths("DELETE") == ["/agentkv/v1/trajectories/t-1"]


def test_sync_trajectory() -> None:
    server = FakeServer()
    client = httpx.AsyncClient(transport=httpx.MockTransport(server))
    with SyncTrajectory(
        "http://127.0.0.1:8000",
        "tiny",
        api_key="k",
        trajectory_id="t-s",
        http_client=client,
        system="sys",
    ) as traj:
        assert traj.complete("one").turn == 1
        with pytest.raises(ValueError, match="bad"), traj.tool("lint", expected_s=0.5):
            raise ValueError("bad")
        (child,) = traj.fork(1)
        assert child.complete("two").branch == "main.1"
        traj.join(child)
        assert traj.complete("three").turn == 3
    assert server.paths()[-1] == "/agentkv/v1/trajectories/t-s"
    assert "/agentkv/v1/trajectories/t-s/resume" in server.paths()


@pytest.mark.parametrize(
    "factory",
    [
        lambda: Trajectory("ftp://x", "m"),
        lambda: Trajectory("http://x", ""),
        lambda: Trajectory("http://x", "m", trajectory_id="bad id"),
    ],
)
def test_config_errors(factory: Callable[[], Trajectory]) -> None:
    with pytest.raises(ValueError):
        factory()


def test_import_hygiene() -> None:
    """harness_sdk never imports vllm, and only the OTel API (not the SDK) at import."""
    import subprocess
    import sys

    code = (
        "import sys, harness_sdk; bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch') "
        "or m.startswith('opentelemetry.sdk')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


async def test_streamed_turn_reassembles_reply_usage_and_ttft() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if request.url.path != "/v1/chat/completions":
            return httpx.Response(404, json={"detail": "Not Found"})
        chunks: list[dict[str, Any]] = [
            {
                "id": "c1",
                "model": "tiny",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            },
            {"id": "c1", "model": "tiny", "choices": [{"index": 0, "delta": {"content": "hel"}}]},
            {
                "id": "c1",
                "model": "tiny",
                "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}],
            },
            {
                "id": "c1",
                "model": "tiny",
                "choices": [],
                "usage": {
                    "prompt_tokens": 300,
                    "completion_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": 256},
                },
            },
        ]
        return httpx.Response(
            200, content=_sse(chunks), headers={"content-type": "text/event-stream"}
        )

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    traj = Trajectory("http://127.0.0.1:8000", "tiny", http_client=client, trajectory_id="s-1")
    r = await traj.complete("go", max_tokens=2, stream=True)
    assert seen[0]["stream"] is True and seen[0]["stream_options"] == {"include_usage": True}
    assert r.content == "hello" and r.finish_reasons == ["length"]
    assert r.prompt_tokens == 300 and r.cached_tokens == 256 and r.usage.output_tokens == 2
    assert r.ttft_s is not None and 0 <= r.ttft_s <= r.latency_s
    assert r.engine is None
    # The streamed reply is committed like a non-streamed one.
    assert traj.context.turns[-1][-1] == {"role": "assistant", "content": "hello"}
    r2 = await traj.complete("again")  # default stays non-streamed
    assert "stream" not in seen[-1] and r2.ttft_s is None


async def test_streamed_turn_error_maps_to_exception_tree() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"message": "model nope does not exist"}})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    traj = Trajectory("http://127.0.0.1:8000", "nope", http_client=client)
    with pytest.raises(NotFoundError):
        await traj.complete("go", stream=True)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"trajectory_id": "team/run-1"}, "trajectory_id 'team/run-1' has the character '/'"),
        ({"trajectory_id": ""}, "trajectory_id '' must not be empty"),
        ({"trajectory_id": "t\n"}, "'\\\\n'"),
        ({"trajectory_id": "x" * 257}, "257 characters"),
        ({"trajectory_id": "tr\u00e9"}, "position 2"),
        ({"branch": "main/retry"}, "branch 'main/retry' has the character '/'"),
        ({"branch": ".."}, "'.' or '..'"),
    ],
)
async def test_invalid_ids_raise_before_any_request(kw: dict[str, Any], named: str) -> None:
    """The SDK uses the server's grammar (agentkv.ids): an id the routes could not serve is
    refused at construction, not discovered as a 404 that reads like 'no agentkv routes'."""
    server = FakeServer()
    client = httpx.AsyncClient(transport=httpx.MockTransport(server))
    with pytest.raises(InvalidIdError, match=named) as info:
        Trajectory("http://127.0.0.1:8000", "tiny", http_client=client, **kw)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
    from agentkv.ids import InvalidIdError as CoreInvalidIdError

    assert isinstance(info.value, CoreInvalidIdError)
    assert server.calls == []
    await client.aclose()


async def test_fork_names_stay_in_the_grammar() -> None:
    server = FakeServer()
    traj = make(server, branch="b" * 255)
    with pytest.raises(InvalidIdError, match="257 characters"):
        traj.fork(1)  # "bbb...b.1" is 257 characters
    assert server.calls == []
    await traj.close()


async def test_pause_not_applied_warns_once_per_trajectory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = FakeServer()
    server.pause_applied, server.pause_state = False, "active"
    traj = make(server)
    await traj.complete("hi")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        async with traj.tool("pytest", expected_s=1) as first:
            pass
        async with traj.tool("pytest", expected_s=1):
            pass
        (child,) = traj.fork(1)
        async with child.tool("grep"):  # another branch of the same trajectory
            pass
    not_applied = [w for w in seen if issubclass(w.category, PauseNotAppliedWarning)]
    assert len(not_applied) == 1, [str(w.message) for w in seen]
    msg = str(not_applied[0].message)
    assert "did not apply the pause decision (retain)" in msg
    assert "'t-1'" in msg and "state='active'" in msg
    assert sum("did not apply" in r.getMessage() for r in caplog.records) == 1
    assert first.pause_response is not None and first.pause_response["applied"] is False
    assert server.paths().count("/agentkv/v1/trajectories/t-1/pause") == 3  # still paused
    await traj.close()
    # a second trajectory warns again: once per trajectory, not once per process
    other = make(server)
    await other.complete("hi")
    with pytest.warns(PauseNotAppliedWarning):
        async with other.tool("pytest"):
            pass
    await other.close()


async def test_applied_pause_does_not_warn() -> None:
    server = FakeServer()
    traj = make(server)
    await traj.complete("hi")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PauseNotAppliedWarning)
        async with traj.tool("pytest", expected_s=1):
            pass
    await traj.close()


# --- the tenant (issue 40 items 6 and 7) ---------------------------------------------------


class TenantServer(FakeServer):
    """FakeServer whose control routes know the trajectory only in its tenant's namespace (the
    ``X-AgentKV-Cache-Salt`` header or the body's ``cache_salt``), as the plugin does."""

    def __init__(self, salt: str | None) -> None:
        super().__init__()
        self.salt = salt
        self.tenants: list[tuple[str, str | None, str | None]] = []  # (method path, hdr, body)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if not path.startswith("/agentkv/v1/trajectories/"):
            return super().__call__(request)
        body = json.loads(request.content) if request.content else {}
        header = request.headers.get("x-agentkv-cache-salt")
        self.tenants.append((f"{request.method} {path}", header, body.get("cache_salt")))
        if (header or body.get("cache_salt")) != self.salt:
            self.calls.append((request.method, path, body))
            return httpx.Response(
                404, json={"detail": f"unknown trajectory {path.split('/')[4]!r}"}
            )
        return super().__call__(request)


async def test_the_cache_salt_option_names_the_tenant_on_every_call() -> None:
    """Item 6: turns could carry cache_salt (extra_body) but pause, resume, GET and DELETE went
    without it, got 404 and the SDK swallowed it: the salted trajectory was never paused or
    deleted."""
    server = TenantServer("tenant-a")
    with warnings.catch_warnings():
        warnings.simplefilter("error", HarnessWarning)
        async with make(server, cache_salt="tenant-a") as traj:
            assert traj.cache_salt == "tenant-a"
            await traj.complete("go")
            async with traj.tool("pytest", expected_s=1.0) as call:
                pass
            assert call.decision is not None and call.resume_response is not None
            await traj.server_state()
            closed = await traj.close()
    assert closed is not None and closed["released_blocks"] == 3
    assert [c["cache_salt"] for c in server.chats()] == ["tenant-a"]
    assert [t[0].split()[0] for t in server.tenants] == ["POST", "POST", "GET", "DELETE"]
    assert all(hdr == body == "tenant-a" for _, hdr, body in server.tenants)


async def test_a_404_of_a_call_the_sdk_expected_to_apply_warns() -> None:
    """The trajectory's turns went to another tenant than its control calls (the salt only in
    extra_body is refused now; here the server forgot it): a 404 is not silence."""
    server = TenantServer("other")
    traj = make(server, cache_salt="tenant-a")
    await traj.complete("go")
    with pytest.warns(TrajectoryNotFoundWarning, match="cache_salt 'tenant-a'"):
        async with traj.tool("pytest", expected_s=1.0) as call:
            pass
    assert call.pause_response is None
    with pytest.warns(TrajectoryNotFoundWarning, match="DELETE"):
        assert await traj.close() is None
    assert traj.routes_available is not False  # a 404 of a known route is not "no routes"


async def test_a_salt_only_in_extra_body_or_a_different_one_is_a_config_error() -> None:
    server = TenantServer("tenant-a")
    traj = make(server)
    with pytest.raises(ConfigError, match="cache_salt= option"):
        await traj.complete("go", extra_body={"cache_salt": "tenant-a"})
    salted = make(server, cache_salt="tenant-a")
    with pytest.raises(ConfigError, match="differs"):
        await salted.complete("go", extra_body={"cache_salt": "tenant-b"})
    await salted.complete("go", extra_body={"cache_salt": "tenant-a", "top_k": 1})
    assert server.chats()[-1]["top_k"] == 1
    with pytest.raises(ConfigError, match="non-empty"):
        make(server, cache_salt="")
    assert not [c for c in server.calls if c[1].startswith("/agentkv/")]
