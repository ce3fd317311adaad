"""Provider adapters against recorded, schema-accurate Anthropic Messages and OpenAI chat
responses served by a local stdlib HTTP server (127.0.0.1, in a thread)."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from harness_sdk import AnthropicAdapter, AuthenticationError, OpenAIAdapter, Trajectory
from harness_sdk.zones import Context

# Recorded shapes (ids and text shortened) of real responses.
ANTHROPIC_TURNS: list[dict[str, Any]] = [
    {
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-20250514",
        "content": [{"type": "text", "text": "I'll start by reading the failing test."}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 21,
            "cache_creation_input_tokens": 2051,
            "cache_read_input_tokens": 0,
            "output_tokens": 12,
            "service_tier": "standard",
            "cache_creation": {"ephemeral_5m_input_tokens": 2051, "ephemeral_1h_input_tokens": 0},
        },
    },
    {
        "id": "msg_01Aq9w938a90dw8q",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-20250514",
        "content": [{"type": "text", "text": "The fix is in parser.py."}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 35,
            "cache_creation_input_tokens": 48,
            "cache_read_input_tokens": 2051,
            "output_tokens": 8,
            "service_tier": "standard",
            "cache_creation": {"ephemeral_5m_input_tokens": 48, "ephemeral_1h_input_tokens": 0},
        },
    },
]
OPENAI_TURNS: list[dict[str, Any]] = [
    {
        "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
        "object": "chat.completion",
        "created": 1741570283,
        "model": "gpt-4.1-2025-04-14",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Reading the test.",
                    "refusal": None,
                    "annotations": [],
                },
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 1117,
            "completion_tokens": 5,
            "total_tokens": 1122,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
        "service_tier": "default",
        "system_fingerprint": "fp_b42ec6ec0b",
    },
    {
        "id": "chatcmpl-B9MHE0f1Qw8Dk2",
        "object": "chat.completion",
        "created": 1741570290,
        "model": "gpt-4.1-2025-04-14",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Patched.",
                    "refusal": None,
                    "annotations": [],
                },
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": 1160,
            "completion_tokens": 3,
            "total_tokens": 1163,
            "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
        "service_tier": "default",
        "system_fingerprint": "fp_b42ec6ec0b",
    },
]
ANTHROPIC_AUTH_ERROR = {
    "type": "error",
    "error": {"type": "authentication_error", "message": "invalid x-api-key"},
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run pytest",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "apply_patch",
            "description": "Apply a diff",
            "parameters": {"type": "object", "properties": {"diff": {"type": "string"}}},
        },
    },
]


class Recorded:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], Any]] = []
        self.replies: dict[str, list[dict[str, Any]]] = {}


@pytest.fixture
def provider() -> Iterator[tuple[str, Recorded]]:
    rec = Recorded()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
            rec.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            queue = rec.replies.get(self.path) or []
            if self.path == "/v1/messages" and self.headers.get("x-api-key") != "sk-ant-test":
                status, payload = 401, ANTHROPIC_AUTH_ERROR
            elif queue:
                status, payload = 200, queue.pop(0)
            else:
                status, payload = 404, {"error": {"message": "not found"}}
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", rec
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.fixture
def spans() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    return tp, exporter


def _breakpoints(body: dict[str, Any]) -> list[str]:
    """Where cache_control sits: 'tools[i]', 'system[i]', 'messages[i].content[j]'."""
    out = [f"tools[{i}]" for i, t in enumerate(body.get("tools", [])) if "cache_control" in t]
    out += [f"system[{i}]" for i, b in enumerate(body.get("system", [])) if "cache_control" in b]
    for i, m in enumerate(body["messages"]):
        out += [
            f"messages[{i}].content[{j}]"
            for j, b in enumerate(m["content"])
            if "cache_control" in b
        ]
    return out


async def test_anthropic_breakpoints_usage_and_spans(
    provider: tuple[str, Recorded], spans: Any
) -> None:
    url, rec = provider
    rec.replies["/v1/messages"] = copy.deepcopy(ANTHROPIC_TURNS)
    traj = Trajectory(
        url,
        "claude-sonnet-4-20250514",
        api_key="sk-ant-test",
        adapter=AnthropicAdapter(),
        trajectory_id="t-a",
        system="You are a coding agent.",
        tools=TOOLS,
        memory=[{"role": "user", "content": "Repo: a parser."}],
        recent_turns=1,
        max_tokens=64,
        tracer_provider=spans[0],
    )
    async with traj:
        r1 = await traj.complete("Fix test_parse.")
        traj.observe("[run_tests] 1 failed")
        r2 = await traj.complete("Go on.")
    assert [p for p, _, _ in rec.requests] == [
        "/v1/messages",
        "/v1/messages",
    ]  # no agentkv routes on a hosted API
    _, headers, body = rec.requests[1]
    assert headers["x-api-key"] == "sk-ant-test" and headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in headers
    assert body["model"] == "claude-sonnet-4-20250514" and body["max_tokens"] == 64
    assert [t["name"] for t in body["tools"]] == ["apply_patch", "run_tests"]  # frozen order
    assert body["tools"][0]["input_schema"]["properties"] == {"diff": {"type": "string"}}
    assert body["system"][0]["text"] == "You are a coding agent."
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    # zone ends: last tool, system, memory (repo fact), recent (turn-1 reply); the observation is uncached
    assert _breakpoints(body) == [
        "tools[1]",
        "system[0]",
        "messages[0].content[0]",
        "messages[1].content[0]",
    ]
    assert body["messages"][0]["content"][0] == {
        "type": "text",
        "text": "Repo: a parser.",
        "cache_control": {"type": "ephemeral"},
    }
    assert "cache_control" not in body["messages"][2]["content"][-1]
    assert len(_breakpoints(body)) <= 4
    assert "kv_transfer_params" not in body and "prompt_cache_key" not in body
    assert r1.content == "I'll start by reading the failing test."
    assert (
        r1.usage.cache_creation_tokens == 2051
        and r1.cached_tokens == 0
        and r1.prompt_tokens == 21 + 2051
    )
    assert (
        r2.cached_tokens == 2051
        and r2.prompt_tokens == 35 + 48 + 2051
        and r2.finish_reasons == ["max_tokens"]
    )
    assert r2.hit_ratio == pytest.approx(2051 / (35 + 48 + 2051))
    span = [s for s in spans[1].get_finished_spans() if s.name.startswith("chat ")][-1]
    a = span.attributes
    assert a is not None
    assert a["gen_ai.provider.name"] == "anthropic" and a["gen_ai.conversation.id"] == "t-a"
    assert (
        a["gen_ai.usage.cache_read.input_tokens"] == 2051
        and a["gen_ai.usage.cache_creation.input_tokens"] == 48
    )
    assert (
        a["gen_ai.usage.input_tokens"] == 35 + 48 + 2051
        and a["gen_ai.response.id"] == "msg_01Aq9w938a90dw8q"
    )


async def test_anthropic_auth_error(provider: tuple[str, Recorded]) -> None:
    url, _ = provider
    async with Trajectory(
        url, "claude-x", api_key="wrong", adapter=AnthropicAdapter(), system="s"
    ) as traj:
        with pytest.raises(AuthenticationError, match="invalid x-api-key"):
            await traj.complete("hi")


def test_anthropic_breakpoints_never_exceed_four_and_skip_empty_zones() -> None:
    ctx = Context(
        "sys", TOOLS, [{"role": "user", "content": "m"}], recent_turns=2, tools_as="message"
    )
    for i in range(4):
        ctx.observe(f"q{i}")
        ctx.commit_turn({"role": "assistant", "content": f"a{i}"})
    ctx.observe("now")
    body = AnthropicAdapter().build_request(
        ctx.render(),
        model="m",
        trajectory_id="t",
        branch="main",
        max_tokens=None,
        temperature=None,
        extra=None,
    )
    assert len(_breakpoints(body)) == 4 and body["max_tokens"] == 1024
    assert len(body["system"]) == 2  # system + tools-as-message
    one = AnthropicAdapter(max_breakpoints=1).build_request(
        Context("sys").render(),
        model="m",
        trajectory_id="t",
        branch="main",
        max_tokens=5,
        temperature=0.0,
        extra={"top_k": 1},
    )
    assert _breakpoints(one) == ["system[0]"] and one["messages"] == [] and one["top_k"] == 1
    ttl = AnthropicAdapter(ttl="1h").build_request(
        Context("sys").render(),
        model="m",
        trajectory_id="t",
        branch="main",
        max_tokens=5,
        temperature=None,
        extra=None,
    )
    assert ttl["system"][0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}


async def test_openai_prompt_cache_key_and_cached_tokens(
    provider: tuple[str, Recorded], spans: Any
) -> None:
    url, rec = provider
    rec.replies["/v1/chat/completions"] = copy.deepcopy(OPENAI_TURNS)
    async with Trajectory(
        url + "/v1",
        "gpt-4.1",
        api_key="sk-test",
        adapter=OpenAIAdapter(),
        trajectory_id="t-o",
        system="You are a coding agent.",
        tools=TOOLS,
        tracer_provider=spans[0],
    ) as traj:
        r1 = await traj.complete("Fix test_parse.")
        r2 = await traj.complete("Go on.")
    assert [p for p, _, _ in rec.requests] == ["/v1/chat/completions"] * 2
    _, headers, body = rec.requests[1]
    assert headers["authorization"] == "Bearer sk-test"
    assert body["prompt_cache_key"] == "t-o" and "kv_transfer_params" not in body
    assert [t["function"]["name"] for t in body["tools"]] == ["apply_patch", "run_tests"]
    assert r1.cached_tokens == 0 and r1.prompt_tokens == 1117 and r1.content == "Reading the test."
    assert (
        r2.cached_tokens == 1024
        and r2.hit_ratio == pytest.approx(1024 / 1160)
        and r2.engine is None
    )
    a = [s for s in spans[1].get_finished_spans() if s.name.startswith("chat ")][-1].attributes
    assert a is not None
    assert (
        a["gen_ai.provider.name"] == "openai" and a["gen_ai.usage.cache_read.input_tokens"] == 1024
    )
    assert a["gen_ai.response.model"] == "gpt-4.1-2025-04-14" and list(
        a["gen_ai.response.finish_reasons"]
    ) == ["length"]
    assert a["agentkv.prefix_hit_ratio"] == pytest.approx(1024 / 1160)
