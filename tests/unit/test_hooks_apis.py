"""The hooks on the Responses and Messages APIs, Responses chains, escaped hint keys, several
tool calls, and the error a vanilla-served request gets back. Pure logic against a fake ASGI
app (``tests.unit.test_hooks``'s harness); the real server is in tests/e2e/test_apis_e2e.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentkv_vllm.hooks import HookState
from agentkv_vllm.params import parse_request_params
from agentkv_vllm.tool_calls import Api, SSEToolScanner, tool_names_from_json
from tests.unit.test_hooks import FakeApp, Harness, chat_json, sse_events

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"


def responses_json(*names: str, rid: str = "resp_1", stats: bool = True) -> bytes:
    output: list[dict[str, Any]] = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]}
    ]
    output += [
        {"type": "function_call", "name": n, "call_id": f"c{i}", "arguments": "{}", "id": f"f{i}"}
        for i, n in enumerate(names)
    ]
    payload: dict[str, Any] = {"id": rid, "object": "response", "output": output}
    if stats:
        payload["kv_transfer_params"] = {"agentkv": {"cached_tokens": 0}}
    return json.dumps(payload).encode()


def responses_sse(*names: str, rid: str = "resp_s") -> list[bytes]:
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {"id": rid, "status": "in_progress"}},
        {"type": "response.output_text.delta", "delta": "hello"},
    ]
    for i, n in enumerate(names):
        item = {"type": "function_call", "name": n, "call_id": f"c{i}", "arguments": ""}
        events.append({"type": "response.output_item.added", "output_index": i + 1, "item": item})
        events.append(
            {"type": "response.function_call_arguments.delta", "output_index": i + 1, "delta": "{}"}
        )
        done = {**item, "arguments": "{}"}
        events.append({"type": "response.output_item.done", "output_index": i + 1, "item": done})
    events.append({"type": "response.completed", "response": {"id": rid, "status": "completed"}})
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]


def messages_json(*names: str) -> bytes:
    content: list[dict[str, Any]] = [{"type": "text", "text": "x"}]
    content += [
        {"type": "tool_use", "id": f"t{i}", "name": n, "input": {}} for i, n in enumerate(names)
    ]
    return json.dumps({"id": "msg_1", "type": "message", "content": content}).encode()


def messages_sse(*names: str) -> list[bytes]:
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"id": "msg_1", "content": []}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "a"}},
        {"type": "content_block_stop", "index": 0},
    ]
    for i, n in enumerate(names, start=1):
        block = {"type": "tool_use", "id": f"t{i}", "name": n, "input": {}}
        events.append({"type": "content_block_start", "index": i, "content_block": block})
        events.append(
            {
                "type": "content_block_delta",
                "index": i,
                "delta": {"type": "input_json_delta", "partial_json": "{}"},
            }
        )
        events.append({"type": "content_block_stop", "index": i})
    events.append({"type": "message_delta", "delta": {"stop_reason": "tool_use"}})
    events.append({"type": "message_stop"})
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]


def order(h: Harness, last_marker: bytes) -> list[str]:
    """'pause' and 'last' (the chunk holding the API's final event) in the order they happened."""
    out = []
    for e in h.events:
        if e[0] == "pause":
            out.append("pause")
        elif e[1]["type"] == "http.response.body" and last_marker in e[1].get("body", b""):
            out.append("last")
    return out


# ------------------------------------------------------------------------- tool names per API


def test_tool_names_in_each_api_json() -> None:
    assert tool_names_from_json(responses_json("a", "b"), Api.RESPONSES) == ["a", "b"]
    assert tool_names_from_json(responses_json(), Api.RESPONSES) == []
    assert tool_names_from_json(messages_json("a", "b"), Api.MESSAGES) == ["a", "b"]
    assert tool_names_from_json(messages_json(), Api.MESSAGES) == []
    assert tool_names_from_json(b'{"content": "tool_use"}', Api.MESSAGES) == []


@pytest.mark.parametrize(
    ("api", "chunks", "rid"),
    [
        (Api.RESPONSES, responses_sse("run_tests", "grep"), "resp_s"),
        (Api.MESSAGES, messages_sse("run_tests", "grep"), None),
    ],
)
def test_sse_scanner_per_api_across_chunk_boundaries(
    api: Api, chunks: list[bytes], rid: str | None
) -> None:
    blob = b"".join(chunks)
    head = SSEToolScanner(api)
    head.feed(b"".join(chunks[:-1]))
    assert not head.done  # only the API's last event ends the stream
    for size in (1, 13, len(blob)):
        scanner = SSEToolScanner(api)
        for i in range(0, len(blob), size):
            scanner.feed(blob[i : i + size])
        # added + done of one call count once; the stream's last event ends it
        assert scanner.names == ["run_tests", "grep"] and scanner.done
        assert scanner.response_id == rid


# ------------------------------------------------------------------------- auto-pause per API


async def test_responses_json_pauses_with_every_called_tool() -> None:
    h = Harness(FakeApp([responses_json("run_tests", "grep")]))
    await h.request({"model": "m", "input": "hi"}, {"x-session-id": "r1"}, path=RESPONSES)
    assert h.pauses() == [("pause", "r1", "main", ["run_tests", "grep"], None)]
    assert json.loads(h.app.body)["kv_transfer_params"]["agentkv"]["trajectory_id"] == "r1"


async def test_responses_stream_pauses_before_response_completed() -> None:
    h = Harness(FakeApp(responses_sse("lookup"), sse=True))
    await h.request({"model": "m", "stream": True, "session_id": "r2"}, path=RESPONSES)
    assert order(h, b"response.completed") == ["pause", "last"]
    assert h.pauses() == [("pause", "r2", "main", "lookup", None)]


async def test_messages_json_and_stream_pause_with_tool_use() -> None:
    h = Harness(FakeApp([messages_json("get_weather")]))
    await h.request({"model": "m", "max_tokens": 8}, {"x-session-id": "m1"}, path=MESSAGES)
    assert h.pauses() == [("pause", "m1", "main", "get_weather", None)]
    h = Harness(FakeApp(messages_sse("a", "b"), sse=True))
    await h.request({"model": "m", "stream": True}, {"x-session-id": "m2"}, path=MESSAGES)
    assert order(h, b"message_stop") == ["pause", "last"]
    assert h.pauses() == [("pause", "m2", "main", ["a", "b"], None)]


async def test_no_tool_call_no_pause_on_the_new_apis() -> None:
    for path, reply in ((RESPONSES, responses_json()), (MESSAGES, messages_json())):
        h = Harness(FakeApp([reply]))
        sent = await h.request({"model": "m"}, {"x-session-id": "n"}, path=path)
        assert not h.pauses()
        got, want = json.loads(sent[-1]["body"]), json.loads(reply)
        if "kv_transfer_params" in want:  # the stats say which hint named the trajectory
            want["kv_transfer_params"]["agentkv"]["identified_by"] = "x-session-id"
        assert got == want


# ------------------------------------------------------------------------- escaped hint keys


async def test_a_json_escaped_hint_key_is_a_hint() -> None:
    """Issue 25 item 8: ``"session\\u005fid"`` is the key ``session_id`` once parsed; a byte
    pattern missed it and served the request as vanilla, silently."""
    raw = b'{"model": "m", "session\\u005fid": "esc-1"}'
    assert json.loads(raw)["session_id"] == "esc-1"
    h = Harness(FakeApp([chat_json("t")]))
    await h.request(raw)
    assert json.loads(h.app.body)["kv_transfer_params"]["agentkv"]["trajectory_id"] == "esc-1"
    assert h.pauses() == [("pause", "esc-1", "main", "t", None)]


async def test_escaped_explicit_params_are_read_too() -> None:
    raw = b'{"kv_transfer_params": {"agent\\u006bv": {"trajectory_id": "esc-2"}}}'
    h = Harness(FakeApp([chat_json("t", stats=True)]))
    await h.request(raw)
    assert h.pauses() == [("pause", "esc-2", "main", "t", None)]


# ------------------------------------------------------------------------- Responses chains


async def test_a_previous_response_id_chain_is_one_trajectory() -> None:
    state = HookState(enabled=True, responses_chains=True)
    seen: list[dict[str, Any]] = []
    paused: list[Any] = []

    async def pause(tid: str, branch: str, tools: list[str], *_: Any) -> None:
        paused.append((tid, branch, tools))

    state.pause = pause

    async def turn(body: dict[str, Any], reply_id: str | None) -> str:
        app = FakeApp([])
        h = Harness(app, pause=pause)
        h.state = state
        h.mw.state = state
        sent_body: dict[str, Any] = {}

        async def respond(scope: Any, receive: Any, send: Any) -> None:
            raw = b""
            while True:
                m = await receive()
                raw += m.get("body", b"")
                if not m.get("more_body"):
                    break
            sent_body.update(json.loads(raw))
            rid = reply_id or sent_body["request_id"]  # vLLM: the response id is request_id
            reply = responses_json("tool", rid=rid)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": reply})

        h.mw.app = respond
        await h.request(body, path=RESPONSES)
        seen.append(sent_body)
        return str(sent_body.get("request_id") or reply_id)

    first = await turn({"model": "m", "input": "go"}, None)
    tid = seen[0]["kv_transfer_params"]["agentkv"]["trajectory_id"]
    assert tid == first and first.startswith("resp_")  # a new chain is named after its response
    second = await turn({"model": "m", "previous_response_id": first}, "resp_second")
    third = await turn({"model": "m", "previous_response_id": second}, "resp_third")
    assert third == "resp_third"
    ids = [b["kv_transfer_params"]["agentkv"]["trajectory_id"] for b in seen]
    assert ids == [tid, tid, tid]
    assert [p[0] for p in paused] == [tid, tid, tid]
    # A chain this process never saw: the named response is the trajectory from here on.
    await turn({"model": "m", "previous_response_id": "resp_elsewhere"}, "resp_x")
    assert seen[-1]["kv_transfer_params"]["agentkv"]["trajectory_id"] == "resp_elsewhere"
    # store: false cannot be continued: no chain, served as sent.
    await turn({"model": "m", "store": False, "request_id": "resp_nostore"}, None)
    assert "kv_transfer_params" not in seen[-1]
    # A hint beats the chain.
    await turn({"model": "m", "previous_response_id": first, "session_id": "mine"}, "resp_y")
    assert seen[-1]["kv_transfer_params"]["agentkv"]["trajectory_id"] == "mine"


async def test_without_a_response_store_there_is_no_chain() -> None:
    h = Harness(FakeApp([responses_json("t")]))
    await h.request({"model": "m", "input": "go"}, path=RESPONSES)
    assert b"kv_transfer_params" not in h.app.body and not h.pauses()


# ------------------------------------------------------------------------- why vanilla


async def test_malformed_params_are_vanilla_and_the_reply_says_why() -> None:
    params = {"agentkv": {"trajectory_id": "a/b"}}
    expected = parse_request_params(params).warning
    assert expected and "trajectory_id" in expected
    reply = chat_json()  # the engine served it as vanilla: no agentkv stats
    h = Harness(FakeApp([reply]))
    sent = await h.request({"model": "m", "kv_transfer_params": params})
    start, body = sent[0], sent[-1]["body"]
    assert json.loads(body)["kv_transfer_params"]["agentkv"]["error"] == expected
    headers = dict(start["headers"])
    assert int(headers[b"content-length"]) == len(body)
    assert headers[b"x-agentkv-error"].decode() == expected
    assert not h.pauses()


async def test_a_malformed_hint_is_reported_in_the_reply() -> None:
    h = Harness(FakeApp([chat_json("t")]))
    sent = await h.request({"model": "m", "session_id": "has space"})
    error = json.loads(sent[-1]["body"])["kv_transfer_params"]["agentkv"]["error"]
    assert "session_id 'has space' is not a trajectory id" in error
    assert not h.pauses()


async def test_a_streamed_malformed_request_gets_the_error_header() -> None:
    h = Harness(FakeApp(sse_events(), sse=True))
    body = {"model": "m", "stream": True, "kv_transfer_params": {"agentkv": {"branch": "x"}}}
    sent = await h.request(body)
    error = dict(sent[0]["headers"])[b"x-agentkv-error"].decode()
    assert error == parse_request_params(body["kv_transfer_params"]).warning


async def test_a_valid_trajectory_reply_is_not_rewritten() -> None:
    reply = chat_json(stats=True)
    h = Harness(FakeApp([reply]))
    sent = await h.request({"kv_transfer_params": {"agentkv": {"trajectory_id": "ok"}}})
    assert sent[-1]["body"] == reply
    assert b"x-agentkv-error" not in dict(sent[0]["headers"])


async def test_an_error_reply_is_passed_through() -> None:
    h = Harness(FakeApp([b'{"error": "bad"}'], status=400))
    sent = await h.request({"model": "m", "session_id": "a b"})
    assert sent[-1]["body"] == b'{"error": "bad"}'


# ------------------------------------------------------------------------- routes


def test_pause_body_takes_a_tool_or_a_list(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from pydantic import ValidationError

    from agentkv_vllm.routes import PauseBody, _responses_store_enabled

    assert PauseBody.model_validate({"tools": ["a", "b"]}).tools == ["a", "b"]
    assert PauseBody.model_validate({"tool": "a"}).tool == "a"
    for bad in ({}, {"tools": []}, {"tools": [""]}, {"tools": ["x" * 129]}):
        with pytest.raises(ValidationError):
            PauseBody.model_validate(bad)
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
    assert _responses_store_enabled()
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "0")
    assert not _responses_store_enabled()
    monkeypatch.delenv("VLLM_ENABLE_RESPONSES_API_STORE")
    assert not _responses_store_enabled()


def test_the_chain_table_is_bounded_and_keeps_active_chains() -> None:
    from agentkv_vllm.chains import ResponseChains

    chains = ResponseChains(max_entries=2)
    chains.record("r1", "t1", "main")
    chains.record("r2", "t2", "main")
    assert chains.lookup("r1") == ("t1", "main")  # r1 used: r2 is now the oldest
    chains.record("r3", "t3", "b")
    assert len(chains) == 2 and chains.lookup("r2") is None
    assert chains.lookup("r1") == ("t1", "main") and chains.lookup("r3") == ("t3", "b")


async def test_a_held_reply_too_large_to_rewrite_goes_out_intact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agentkv_vllm import hooks

    monkeypatch.setattr(hooks, "MAX_JSON_RESPONSE", 16)
    reply = chat_json()
    h = Harness(FakeApp([reply]))
    sent = await h.request({"kv_transfer_params": {"agentkv": {"trajectory_id": "a b"}}})
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[-1]["body"] == reply


# ------------------------------------------------------------------- tenants of stored responses


async def test_another_tenants_stored_response_is_not_found() -> None:
    """Issue 40 item 5: vLLM serves a stored response (GET /v1/responses/{id}) and continues it
    (previous_response_id, rendering its conversation into the prompt) for anyone; a salted
    chain is its tenant's only: another tenant gets vLLM's own 404 and vLLM never sees it."""
    state = HookState(enabled=True, responses_chains=True)

    async def served(
        body: dict[str, Any] | None, *, method: str = "POST", path: str = RESPONSES, **kw: Any
    ) -> tuple[int, bool]:
        """(status, whether vLLM got the request)."""
        app = FakeApp([responses_json(rid=str((body or {}).get("request_id") or "resp_n"))])
        h = Harness(app)
        h.state = h.mw.state = state
        raw = json.dumps(body).encode() if body is not None else b""
        headers = [(k.lower().encode(), v.encode()) for k, v in kw.get("headers", {}).items()]
        scope = {
            "type": "http",
            "method": method,
            "path": path,
            "headers": headers,
            "query_string": kw.get("query", b""),
        }
        sent: list[dict[str, Any]] = []
        incoming = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return incoming.pop(0) if incoming else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await h.mw(scope, receive, send)
        return int(sent[0]["status"]), bool(app.scope)

    ok, refused = (200, True), (404, False)
    salted = {"model": "m", "input": "go", "request_id": "resp_a", "cache_salt": "tenant-a"}
    assert await served(salted) == ok
    plain = {"model": "m", "input": "go", "request_id": "resp_plain"}
    assert await served(plain) == ok
    for salt in ("tenant-b", None):
        cont = {"model": "m", "previous_response_id": "resp_a", "request_id": "resp_n"}
        cont = {**cont, "cache_salt": salt} if salt else cont
        assert await served(cont) == refused
        # Whatever names the trajectory: an explicit one or a hint refers to the same store.
        assert await served({**cont, "session_id": "mine"}) == refused
        tenant = {"X-AgentKV-Cache-Salt": salt} if salt else {}
        assert await served(None, method="GET", path=f"{RESPONSES}/resp_a", headers=tenant) == (
            refused
        )
        cancel = f"{RESPONSES}/resp_a/cancel"
        assert await served(None, path=cancel, headers=tenant) == refused
    own = {"model": "m", "previous_response_id": "resp_a", "cache_salt": "tenant-a"}
    assert await served({**own, "request_id": "resp_a2"}) == ok
    get = f"{RESPONSES}/resp_a"
    assert await served(None, method="GET", path=get, query=b"cache_salt=tenant-a") == ok
    mine = {"X-AgentKV-Cache-Salt": "tenant-a"}
    assert await served(None, method="GET", path=get, headers=mine) == ok
    # A salted response outside any trajectory (an id the chain cannot name) is kept too.
    assert await served({"model": "m", "request_id": "bad id", "cache_salt": "tenant-a"}) == ok
    assert state.chains.foreign("bad id", "tenant-b") and state.chains.lookup("bad id") is None
    # The continuation is A's too; an unsalted response is everyone's, as in vLLM.
    assert await served(None, method="GET", path=f"{RESPONSES}/resp_a2") == refused
    assert await served(None, method="GET", path=f"{RESPONSES}/resp_plain") == ok
    hdr = {"X-AgentKV-Cache-Salt": "tenant-b"}
    assert await served(None, method="GET", path=f"{RESPONSES}/resp_plain", headers=hdr) == ok
    assert state.counters["foreign_chain_refused"] == 4
    assert state.counters["foreign_response_refused"] == 5


def test_the_chain_table_keeps_a_tenant_digest_never_the_salt() -> None:
    from agentkv_vllm.chains import ResponseChains

    chains = ResponseChains()
    chains.record("r1", "t1", "main", "s3cret-salt")
    chains.record("r2", None, "", "s3cret-salt")  # a vanilla salted response: its tenant only
    assert chains.lookup("r1") == ("t1", "main") and chains.lookup("r2") is None
    assert not chains.foreign("r1", "s3cret-salt") and chains.foreign("r2", "other")
    assert chains.foreign("r1", None) and not chains.foreign("unknown", "x")
    assert "s3cret-salt" not in repr(chains._of)
