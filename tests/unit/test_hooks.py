"""The API-server hooks (``agentkv_vllm.hooks``): trajectory identity from session hints, the
body rewrite, tool-call detection in JSON and SSE responses, and the auto-pause ordering.

Pure logic against a fake ASGI app; no server, no engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest

from agentkv_vllm import hooks
from agentkv_vllm.hooks import (
    AgentKVHooks,
    HookState,
    SSEToolScanner,
    inject_identity,
    resolve_identity,
    tool_names_from_json,
)

CHAT = "/v1/chat/completions"


def ctx(**kw: Any) -> dict[str, Any]:
    return {"vllm_xargs": {"agentic_context": json.dumps(kw)}}


# ------------------------------------------------------------------------------------ identity


def test_precedence_explicit_params_win_and_are_not_rewritten() -> None:
    body = {
        "kv_transfer_params": {"agentkv": {"trajectory_id": "explicit", "branch": "b1"}},
        "session_id": "body-sid",
        **ctx(session_id="ctx-sid", expected_resume=3),
    }
    ident, problems = resolve_identity(body, {"x-session-id": "hdr"})
    assert ident is not None and not problems
    assert (ident.trajectory_id, ident.branch, ident.source, ident.inject) == (
        "explicit",
        "b1",
        "kv_transfer_params",
        False,
    )
    assert ident.expected_wait_s == 3.0  # the declared wait applies whatever named the trajectory


@pytest.mark.parametrize(
    ("body", "headers", "want", "source"),
    [
        ({"session_id": "s1", **ctx(session_id="c1")}, {"x-session-id": "h1"}, "s1", "session_id"),
        (ctx(session_id="c1"), {"x-session-id": "h1"}, "h1", "x-session-id"),
        (
            {
                "vllm_xargs": {
                    "agentic_context": json.dumps({"session_id": "c1"}),
                    "session_id": "x",
                }
            },
            {},
            "c1",
            "agentic_context",
        ),
        ({"vllm_xargs": {"session_id": "x1"}}, {}, "x1", "vllm_xargs.session_id"),
    ],
)
def test_precedence_of_hints(
    body: dict[str, Any], headers: dict[str, str], want: str, source: str
) -> None:
    ident, problems = resolve_identity(body, headers)
    assert not problems
    assert ident is not None
    assert (ident.trajectory_id, ident.branch, ident.source, ident.inject) == (
        want,
        "main",
        source,
        True,
    )


def test_no_hint_is_vanilla() -> None:
    assert resolve_identity({"model": "m", "messages": []}, {}) == (None, [])
    assert resolve_identity([1, 2], {"x-session-id": "s"}) == (None, [])
    # Other connectors' params without an agentkv key: still a hint-named trajectory.
    ident, _ = resolve_identity({"kv_transfer_params": {"x": 1}}, {"x-session-id": "s"})
    assert ident is not None and ident.trajectory_id == "s"
    # kv_transfer_params of the wrong type: vLLM answers 400 itself, nothing to name.
    assert resolve_identity({"kv_transfer_params": "x"}, {"x-session-id": "s"}) == (None, [])


def test_malformed_explicit_params_stay_vanilla_without_a_hook_warning() -> None:
    body = {"kv_transfer_params": {"agentkv": {"trajectory_id": "a/b"}}}
    assert resolve_identity(body, {"x-session-id": "fine"}) == (None, [])


@pytest.mark.parametrize(
    ("headers", "body", "kind"),
    [
        ({"x-session-id": "has space"}, {}, "character"),
        ({"x-session-id": ""}, {}, "empty"),
        ({"x-session-id": "x" * 300}, {}, "length"),
        ({"x-session-id": ".."}, {}, "dots"),
        ({}, {"session_id": 7}, "type"),
        ({}, ctx(session_id="a/b"), "character"),
    ],
)
def test_malformed_ids_are_vanilla_with_a_problem(
    headers: dict[str, str], body: dict[str, Any], kind: str
) -> None:
    ident, problems = resolve_identity(body, headers)
    assert ident is None
    assert [p.kind for p in problems] == [kind]
    assert "is not a trajectory id" in problems[0].message


def test_a_malformed_higher_hint_does_not_fall_through() -> None:
    ident, problems = resolve_identity(ctx(session_id="ok"), {"x-session-id": "bad id"})
    assert ident is None and problems[0].source == "x-session-id"


@pytest.mark.parametrize(
    ("xargs", "kind"),
    [
        ({"agentic_context": "{not json"}, "json"),
        ({"agentic_context": "[1, 2]"}, "type"),
        ({"agentic_context": 5}, "type"),
    ],
)
def test_malformed_agentic_context(xargs: dict[str, Any], kind: str) -> None:
    ident, problems = resolve_identity({"vllm_xargs": xargs}, {})
    assert ident is None
    assert [(p.source, p.kind) for p in problems] == [("agentic_context", kind)]


def test_agentic_context_numbers() -> None:
    ident, problems = resolve_identity(
        ctx(session_id="s", expected_resume="2.5", kv_retention_ttl_seconds=600), {}
    )
    assert not problems and ident is not None
    assert (ident.expected_wait_s, ident.lease_cap_s) == (2.5, 600.0)
    # A bad number is ignored with a problem; the session still names the trajectory.
    ident, problems = resolve_identity(ctx(session_id="s", expected_resume=-1), {})
    assert ident is not None and ident.expected_wait_s is None
    assert [(p.source, p.kind) for p in problems] == [("agentic_context", "expected_resume")]
    ident, problems = resolve_identity(ctx(session_id="s", kv_retention_ttl_seconds=True), {})
    assert ident is not None and ident.lease_cap_s is None and len(problems) == 1
    # A dict (not a JSON string) is accepted too.
    ident, _ = resolve_identity({"vllm_xargs": {"agentic_context": {"session_id": "d"}}}, {})
    assert ident is not None and ident.trajectory_id == "d"


def test_warn_once_per_kind_of_problem(caplog: pytest.LogCaptureFixture) -> None:
    state = HookState()
    with caplog.at_level(logging.WARNING, logger="agentkv.hooks"):
        for bad in ("a b", "c d", "e f"):
            for p in resolve_identity({}, {"x-session-id": bad})[1]:
                state.warn_once(p)
        for p in resolve_identity({}, {"x-session-id": ""})[1]:
            state.warn_once(p)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2, msgs
    assert "'a b'" in msgs[0] and "vanilla" in msgs[0]
    assert state.counters["malformed.x-session-id"] == 4


# ------------------------------------------------------------------------------------ rewrite


def test_inject_splices_before_the_closing_brace() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "h\\u00e9"}]}\n'
    body = json.loads(raw)
    ident, _ = resolve_identity(body, {"x-session-id": "s1"})
    assert ident is not None
    out = inject_identity(raw, body, ident)
    assert out.startswith(raw.rstrip()[:-1])  # the original bytes are kept as sent
    assert json.loads(out) == {
        **body,
        "kv_transfer_params": {"agentkv": {"trajectory_id": "s1", "branch": "main"}},
    }
    empty = inject_identity(b"{ }", {}, ident)
    assert json.loads(empty) == {
        "kv_transfer_params": {"agentkv": {"trajectory_id": "s1", "branch": "main"}}
    }


def test_inject_merges_other_connectors_params() -> None:
    body = {"model": "m", "kv_transfer_params": {"do_remote_prefill": True}}
    ident, _ = resolve_identity(body, {"x-session-id": "s1"})
    assert ident is not None
    out = json.loads(inject_identity(json.dumps(body).encode(), body, ident))
    assert out["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "agentkv": {"trajectory_id": "s1", "branch": "main"},
    }


# ------------------------------------------------------------------------------------ tool calls


def chat_json(*names: str, stats: bool = False) -> bytes:
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": "{}"}}
        for i, n in enumerate(names)
    ]
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    if calls:
        msg["tool_calls"] = calls
    payload: dict[str, Any] = {"id": "x", "choices": [{"index": 0, "message": msg}]}
    if stats:  # what the engine returns for a trajectory's request
        payload["kv_transfer_params"] = {"agentkv": {"cached_tokens": 0}}
    return json.dumps(payload).encode()


def sse_events(*names: str, content: str = "") -> list[bytes]:
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": content}}]}]
    for i, n in enumerate(names):
        events.append(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [
                                {
                                    "index": i,
                                    "id": f"c{i}",
                                    "function": {"name": n, "arguments": ""},
                                }
                            ]
                        },
                    }
                ]
            }
        )
        events.append(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"tool_calls": [{"index": i, "function": {"arguments": "{}"}}]},
                    }
                ]
            }
        )
    out = [f"data: {json.dumps(e)}\n\n".encode() for e in events]
    out.append(b"data: [DONE]\n\n")
    return out


def test_tool_names_from_json() -> None:
    assert tool_names_from_json(chat_json("run_tests", "grep")) == ["run_tests", "grep"]
    assert tool_names_from_json(chat_json()) == []
    assert tool_names_from_json(b"not json tool_calls") == []
    assert tool_names_from_json(b'{"choices": [{"message": {"tool_calls": null}}]}') == []


def test_sse_scanner_across_chunk_boundaries() -> None:
    blob = b"".join(sse_events("run_tests", "grep"))
    for size in (1, 7, 64, len(blob)):
        scanner = SSEToolScanner()
        for i in range(0, len(blob), size):
            scanner.feed(blob[i : i + size])
        assert scanner.names == ["run_tests", "grep"] and scanner.done
    scanner = SSEToolScanner()
    scanner.feed(b"data: {broken tool_calls\r\n\r\n: comment\n")
    assert scanner.names == [] and not scanner.done


# ------------------------------------------------------------------------------------ middleware


class FakeApp:
    """Reads the whole request (as FastAPI does), then sends a configured response."""

    def __init__(self, chunks: list[bytes], sse: bool = False, status: int = 200) -> None:
        self.chunks, self.sse, self.status = chunks, sse, status
        self.body = b""
        self.scope: dict[str, Any] = {}
        self.after: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scope = dict(scope)
        while True:
            m = await receive()
            self.body += m.get("body", b"")
            if not m.get("more_body"):
                break
        ctype = b"text/event-stream; charset=utf-8" if self.sse else b"application/json"
        await send(
            {
                "type": "http.response.start",
                "status": self.status,
                "headers": [(b"content-type", ctype)],
            }
        )
        if self.sse:
            for c in self.chunks:
                await send({"type": "http.response.body", "body": c, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"".join(self.chunks)})


class Harness:
    def __init__(self, app: FakeApp, *, auto_pause: bool = True, pause: Any = None) -> None:
        self.events: list[Any] = []
        self.caps: list[float | None] = []
        self.state = HookState(enabled=True, auto_pause=auto_pause, pause=pause or self._pause)
        self.app = app
        self.mw = AgentKVHooks(app, self.state)

    async def _pause(
        self, tid: str, branch: str, tools: list[str], wait: float | None, cap: float | None = None
    ) -> None:
        # one tool: its name (most tests); several: the list
        self.events.append(("pause", tid, branch, tools[0] if len(tools) == 1 else tools, wait))
        self.caps.append(cap)

    async def request(
        self,
        body: bytes | dict[str, Any],
        headers: dict[str, str] | None = None,
        *,
        path: str = CHAT,
        method: str = "POST",
        split: int = 0,
        tail: list[dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        hdrs += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        scope = {"type": "http", "method": method, "path": path, "headers": hdrs}
        parts = [raw[i : i + split] for i in range(0, len(raw), split)] if split else [raw]
        incoming = [
            {"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
            for i, p in enumerate(parts)
        ] + list(tail or [{"type": "http.disconnect"}])

        async def receive() -> dict[str, Any]:
            return incoming.pop(0)

        async def send(message: dict[str, Any]) -> None:
            self.events.append(("send", message))

        await self.mw(scope, receive, send)
        return [e[1] for e in self.events if e[0] == "send"]

    def pauses(self) -> list[tuple[Any, ...]]:
        return [e for e in self.events if e[0] == "pause"]

    def content_length(self) -> int:
        values = [v for k, v in self.app.scope["headers"] if k == b"content-length"]
        assert len(values) == 1
        return int(values[0])


async def test_rewrite_reaches_the_app_with_the_right_length() -> None:
    h = Harness(FakeApp([chat_json()]))
    body = {"model": "m", "messages": [{"role": "user", "content": "é" * 50}]}
    await h.request(body, {"X-Session-ID": "sess-1"}, split=16)
    got = json.loads(h.app.body)
    assert got["kv_transfer_params"] == {"agentkv": {"trajectory_id": "sess-1", "branch": "main"}}
    assert got["messages"] == body["messages"]
    assert h.content_length() == len(h.app.body)
    assert h.state.counters["identified.x-session-id"] == 1


async def test_vanilla_requests_pass_byte_for_byte() -> None:
    raw = b'{"model": "m",  "messages": []}'
    for kw in (
        {},
        {"path": "/v1/embeddings", "headers": {"x-session-id": "s"}},
        {"method": "GET", "headers": {"x-session-id": "s"}},
    ):
        h = Harness(FakeApp([chat_json("t")]))
        await h.request(raw, **kw)  # type: ignore[arg-type]
        assert h.app.body == raw and h.content_length() == len(raw)
        assert not h.pauses()
    # Not JSON, and a malformed hint: untouched too (vLLM answers the bad JSON itself).
    for sent, headers in ((b"{nope", {"x-session-id": "s"}), (raw, {"x-session-id": "a b"})):
        h = Harness(FakeApp([chat_json("t")]))
        await h.request(sent, headers)
        assert h.app.body == sent and not h.pauses()


async def test_disabled_state_passes_through() -> None:
    h = Harness(FakeApp([chat_json("t")]))
    h.state.enabled = False
    raw = json.dumps({"model": "m"}).encode()
    await h.request(raw, {"x-session-id": "s"})
    assert h.app.body == raw and not h.pauses()


async def test_disconnect_is_replayed_after_the_body() -> None:
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            m = await receive()
            seen.append(m["type"])
            if m["type"] == "http.disconnect":
                return

    h = Harness(FakeApp([]))
    h.mw = AgentKVHooks(app, h.state)
    await h.request({"model": "m"}, {"x-session-id": "s"})
    assert seen == ["http.request", "http.disconnect"]


async def test_json_tool_call_pauses_before_the_body_goes_out() -> None:
    h = Harness(FakeApp([chat_json("run_tests", "grep")]))
    await h.request({"model": "m", **ctx(session_id="t1", expected_resume=4)})
    kinds = [e[0] if e[0] == "pause" else e[1]["type"] for e in h.events]
    # a hint-named JSON reply is held to its end (it gets ``identified_by``): the pause goes
    # out before any of it
    assert kinds == ["pause", "http.response.start", "http.response.body"]
    # several calls pause with all their tools (the engine predicts the longest)
    assert h.pauses() == [("pause", "t1", "main", ["run_tests", "grep"], 4.0)]
    assert h.state.counters["auto_pauses"] == 1


async def test_retention_ttl_hint_caps_the_auto_pause_lease() -> None:
    h = Harness(FakeApp([chat_json("run_tests")]))
    await h.request({"model": "m", **ctx(session_id="t1", kv_retention_ttl_seconds=30)})
    assert h.caps == [30.0]


async def test_explicit_params_branch_is_paused() -> None:
    h = Harness(FakeApp([chat_json("run_tests")]))
    body = {"kv_transfer_params": {"agentkv": {"trajectory_id": "t2", "branch": "main.1"}}}
    raw = json.dumps(body).encode()
    await h.request(raw)
    assert h.app.body == raw  # explicit params are never rewritten
    assert h.pauses() == [("pause", "t2", "main.1", "run_tests", None)]


@pytest.mark.parametrize("sse", [False, True])
async def test_a_request_that_names_its_pause_is_not_auto_paused_again(sse: bool) -> None:
    """The engine paused the branch at the request's finish (pause_after), before the reply's
    last bytes: the hook's auto-pause would decide the same wait a second time."""
    app = FakeApp(sse_events("run_tests"), sse=True) if sse else FakeApp([chat_json("run_tests")])
    h = Harness(app)
    agentkv = {"trajectory_id": "t2", "pause_after": {"tool": "run_tests"}}
    await h.request({"model": "m", "stream": sse, "kv_transfer_params": {"agentkv": agentkv}})
    assert h.pauses() == []
    assert h.state.counters["auto_pause_skipped_pause_after"] == 1
    # The name elsewhere in the body is not a declared pause.
    h = Harness(FakeApp([chat_json("run_tests")]))
    body = {
        "metadata": {"pause_after": "x"},
        "kv_transfer_params": {"agentkv": {"trajectory_id": "t2"}},
    }
    await h.request(body)
    assert h.pauses() == [("pause", "t2", "main", "run_tests", None)]


async def test_sse_tool_call_pauses_before_done() -> None:
    h = Harness(FakeApp(sse_events("run_tests"), sse=True))
    await h.request({"model": "m", "stream": True}, {"x-session-id": "t3"})
    order = []
    for e in h.events:
        if e[0] == "pause":
            order.append("pause")
        elif e[1].get("body") == b"data: [DONE]\n\n":
            order.append("done")
    assert order == ["pause", "done"]
    assert h.pauses() == [("pause", "t3", "main", "run_tests", None)]


@pytest.mark.parametrize(
    ("app", "kw"),
    [
        (lambda: FakeApp([chat_json()]), {}),  # no tool call
        (lambda: FakeApp(sse_events(content="hi"), sse=True), {}),
        (lambda: FakeApp([chat_json("t")], status=400), {}),  # an error response
        (lambda: FakeApp([chat_json("t")]), {"path": "/v1/completions"}),  # no tools there
    ],
)
async def test_no_pause_without_tool_calls(app: Callable[[], FakeApp], kw: dict[str, Any]) -> None:
    h = Harness(app())
    sent = await h.request({"model": "m"}, {"x-session-id": "t4"}, **kw)
    assert not h.pauses() and sent[-1]["type"] == "http.response.body"


async def test_auto_pause_off() -> None:
    h = Harness(FakeApp([chat_json("t")]), auto_pause=False)
    await h.request({"model": "m"}, {"x-session-id": "t5"})
    assert not h.pauses()
    assert json.loads(h.app.body)["kv_transfer_params"]["agentkv"]["trajectory_id"] == "t5"


async def test_a_failing_or_slow_pause_never_fails_the_response() -> None:
    async def boom(*_: Any) -> None:
        raise RuntimeError("engine gone")

    async def slow(*_: Any) -> None:
        await asyncio.sleep(5)

    for fn in (boom, slow):
        h = Harness(FakeApp([chat_json("t")]), pause=fn)
        h.state.pause_timeout_s = 0.05
        sent = await h.request({"model": "m"}, {"x-session-id": "t6"})
        assert sent[-1]["body"] == chat_json("t")
        assert h.state.counters["auto_pause_failed"] == 1


async def test_a_hook_bug_passes_the_request_through(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: Any) -> Any:
        raise KeyError("bug")

    monkeypatch.setattr(hooks, "resolve_identity", broken)
    h = Harness(FakeApp([chat_json("t")]))
    raw = json.dumps({"model": "m"}).encode()
    sent = await h.request(raw, {"x-session-id": "t7"})
    assert h.app.body == raw and not h.pauses() and sent[-1]["body"] == chat_json("t")


async def test_long_tool_names_are_cut_to_the_route_limit() -> None:
    h = Harness(FakeApp([chat_json("f" * 300)]))
    await h.request({"model": "m"}, {"x-session-id": "t8"})
    assert h.pauses()[0][3] == "f" * 128


# ------------------------------------------------------------------------------------ with FastAPI


def test_fastapi_sees_the_injected_params(monkeypatch: pytest.MonkeyPatch) -> None:
    """The middleware as the routes install it, in front of a real FastAPI route."""
    pytest.importorskip("vllm")
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient

    from agentkv_vllm import routes

    state = HookState(enabled=True)
    paused: list[tuple[Any, ...]] = []

    async def pause(*args: Any) -> None:
        paused.append(args)

    state.pause = pause
    monkeypatch.setattr(routes._State, "hooks", state)
    app = FastAPI()

    async def chat(request: Any) -> JSONResponse:
        body = await request.json()
        call = {"function": {"name": "lookup", "arguments": "{}"}}
        return JSONResponse(
            {
                "seen": body.get("kv_transfer_params"),
                "choices": [{"message": {"tool_calls": [call]}}],
            }
        )

    app.router.add_route("/v1/chat/completions", chat, methods=["POST"])

    routes.AgentKVRoutes().attach_router(app)
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={"model": "m"}, headers={"x-session-id": "fa"})
        assert r.status_code == 200
        assert r.json()["seen"] == {"agentkv": {"trajectory_id": "fa", "branch": "main"}}
        assert paused == [("fa", "main", ["lookup"], None, None)]
        r = c.post("/v1/chat/completions", json={"model": "m"})
        assert r.json()["seen"] is None and len(paused) == 1


def test_auto_pause_setting() -> None:
    pytest.importorskip("vllm")
    from agentkv_vllm.routes import _auto_pause_setting
    from agentkv_vllm.settings import ConnectorSettings

    assert _auto_pause_setting(ConnectorSettings(), {}) is True
    assert _auto_pause_setting(ConnectorSettings(auto_pause=False), {}) is False


async def test_explicit_params_are_parsed_only_for_a_tool_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trajectory request with explicit params and no hint costs a substring search: its ids
    are read only when the reply has tool calls."""
    parsed: list[bytes] = []
    real = hooks.resolve_deferred

    def spy(raw: bytes) -> Any:
        parsed.append(raw)
        return real(raw)

    monkeypatch.setattr(hooks, "resolve_deferred", spy)
    body = {"kv_transfer_params": {"agentkv": {"trajectory_id": "t9"}}}
    h = Harness(FakeApp([chat_json(stats=True)]))
    await h.request(body)
    assert parsed == [] and not h.pauses()
    h = Harness(FakeApp([chat_json("t", stats=True)]))
    await h.request(body)
    assert len(parsed) == 1 and h.pauses() == [("pause", "t9", "main", "t", None)]
    assert not any(k.startswith("identified.") for k in h.state.counters)  # hints only
    # Malformed explicit params: no pause (the engine serves the request as vanilla).
    h = Harness(FakeApp([chat_json("t")]))
    await h.request({"kv_transfer_params": {"agentkv": {"trajectory_id": "a b"}}})
    assert not h.pauses()


# ------------------------------------------------- issue 42: what a framework already sends


@pytest.mark.parametrize(
    ("body", "headers", "want", "source"),
    [
        # every hint that names a session by intent outranks the cache-routing key
        ({"session_id": "s1", "prompt_cache_key": "k1"}, {}, "s1", "session_id"),
        ({"prompt_cache_key": "k1"}, {"x-session-id": "h1"}, "h1", "x-session-id"),
        ({**ctx(session_id="c1"), "prompt_cache_key": "k1"}, {}, "c1", "agentic_context"),
        (
            {"vllm_xargs": {"session_id": "x1"}, "prompt_cache_key": "k1"},
            {},
            "x1",
            "vllm_xargs.session_id",
        ),
        ({"prompt_cache_key": "agents-sdk:run:abc"}, {}, "agents-sdk:run:abc", "prompt_cache_key"),
    ],
)
def test_prompt_cache_key_is_a_hint_below_the_session_ids(
    body: dict[str, Any], headers: dict[str, str], want: str, source: str
) -> None:
    ident, problems = resolve_identity(body, headers)
    assert not problems and ident is not None
    assert (ident.trajectory_id, ident.branch, ident.source, ident.inject) == (
        want,
        "main",
        source,
        True,
    )


def test_prompt_cache_key_outranks_the_responses_chain() -> None:
    """A Responses run that resends its input (no ``previous_response_id``) stays one
    trajectory: the key names it, not a new chain per request."""
    from agentkv_vllm.chains import ResponseChains

    chains = ResponseChains()
    for _ in range(2):
        ident, _ = resolve_identity({"prompt_cache_key": "conv-1", "input": "x"}, {}, chains)
        assert ident is not None and (ident.trajectory_id, ident.source) == (
            "conv-1",
            "prompt_cache_key",
        )
        assert ident.request_id is None  # no chain started
    ident, _ = resolve_identity({"input": "x"}, {}, chains)
    assert ident is not None and ident.source == "responses_chain"


def test_a_malformed_prompt_cache_key_is_vanilla_with_a_problem() -> None:
    ident, problems = resolve_identity({"prompt_cache_key": "user 42/task"}, {})
    assert ident is None
    assert [(p.source, p.kind, p.vanilla) for p in problems] == [
        ("prompt_cache_key", "character", True)
    ]


def test_the_byte_test_knows_the_cache_key() -> None:
    assert hooks.might_carry_hint(b'{"model":"m","prompt_cache_key":"k"}', {})
    assert hooks.might_carry_hint(b'{"model":"m","prompt_cache_retention":"24h"}', {})
    assert not hooks.might_carry_hint(b'{"model":"m","prompt_cache":"k"}', {})


@pytest.mark.parametrize(
    ("retention", "ttl", "cap"),
    [("in_memory", None, 3600.0), ("24h", None, 86400.0), ("24h", 600, 600.0)],
)
def test_prompt_cache_retention_caps_the_lease(
    retention: str, ttl: float | None, cap: float
) -> None:
    extra = ctx(kv_retention_ttl_seconds=ttl) if ttl is not None else {}
    body = {"prompt_cache_key": "k", "prompt_cache_retention": retention, **extra}
    ident, problems = resolve_identity(body, {})
    assert not problems and ident is not None and ident.lease_cap_s == cap
    # whichever source named the trajectory (explicit params too)
    explicit = {"kv_transfer_params": {"agentkv": {"trajectory_id": "t"}}, **body}
    ident, _ = resolve_identity(explicit, {})
    assert ident is not None and ident.lease_cap_s == cap


async def test_an_unknown_retention_is_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ident, problems = resolve_identity({"prompt_cache_key": "k", "prompt_cache_retention": 7}, {})
    assert ident is not None and ident.trajectory_id == "k" and ident.lease_cap_s is None
    assert [(p.source, p.kind, p.vanilla) for p in problems] == [
        ("prompt_cache_retention", "value", False)
    ]
    h = Harness(FakeApp([chat_json("run_tests", stats=True)]))
    with caplog.at_level(logging.WARNING, logger="agentkv.hooks"):
        sent = await h.request({"prompt_cache_key": "k", "prompt_cache_retention": "forever"})
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "'forever'" in msgs[0] and "keeps its trajectory" in msgs[0]
    assert h.pauses() == [("pause", "k", "main", "run_tests", None)] and h.caps == [None]
    agentkv = json.loads(sent[-1]["body"])["kv_transfer_params"]["agentkv"]
    assert "error" not in agentkv  # the request was not vanilla
    assert h.state.counters["malformed.prompt_cache_retention"] == 1


async def test_a_cache_key_request_is_rewritten_paused_and_says_its_hint() -> None:
    h = Harness(FakeApp([chat_json("run_tests", stats=True)]))
    sent = await h.request({"model": "m", "prompt_cache_key": "pck-1", "messages": []})
    assert json.loads(h.app.body)["kv_transfer_params"] == {
        "agentkv": {"trajectory_id": "pck-1", "branch": "main"}
    }
    assert h.pauses() == [("pause", "pck-1", "main", "run_tests", None)]
    assert h.state.counters["identified.prompt_cache_key"] == 1
    start, body = sent
    assert (b"x-agentkv-identified-by", b"prompt_cache_key") in start["headers"]
    agentkv = json.loads(body["body"])["kv_transfer_params"]["agentkv"]
    assert agentkv == {"cached_tokens": 0, "identified_by": "prompt_cache_key"}
    assert dict(start["headers"])[b"content-length"] == str(len(body["body"])).encode()
    # a stream says it in the header
    h = Harness(FakeApp(sse_events("run_tests"), sse=True))
    sent = await h.request({"model": "m", "stream": True}, {"x-session-id": "s1"})
    assert (b"x-agentkv-identified-by", b"x-session-id") in sent[0]["headers"]
    # explicit params name themselves: nothing added
    h = Harness(FakeApp([chat_json(stats=True)]))
    raw = chat_json(stats=True)
    sent = await h.request({"kv_transfer_params": {"agentkv": {"trajectory_id": "t9"}}})
    assert sent[-1]["body"] == raw
    assert all(k != b"x-agentkv-identified-by" for k, _ in sent[0]["headers"])
