"""The hooks continue a Responses run that resends its whole input without
``previous_response_id`` (the Agents SDK's default) by its conversation prefix; against a fake
vLLM app (``tests.unit.test_hooks``'s harness). The matcher itself is in
test_responses_prefix.py; the real server in tests/e2e/test_responses_prefix_e2e.py."""

from __future__ import annotations

import itertools
import json
from typing import Any

from agentkv_vllm.hooks import AgentKVHooks, HookState

RESPONSES = "/v1/responses"
USER = {"role": "user", "content": "What is the weather?"}
_ids = itertools.count(1)


class Vllm:
    """A fake Responses server: the response id is the request's ``request_id`` (or a new one);
    each reply calls ``tool`` (a fresh call id) unless ``tool`` is None."""

    def __init__(self, tool: str | None = "get_weather", sse: bool = False) -> None:
        self.tool, self.sse = tool, sse
        self.bodies: list[dict[str, Any]] = []
        self.replies: list[dict[str, Any]] = []

    def output(self) -> list[dict[str, Any]]:
        n = next(_ids)
        if self.tool is None:
            text = {"type": "output_text", "text": "ok", "annotations": [], "logprobs": None}
            return [{"id": f"msg_{n}", "type": "message", "role": "assistant", "content": [text]}]
        return [
            {
                "id": f"fc_{n}",
                "type": "function_call",
                "call_id": f"call_{n}",
                "name": self.tool,
                "arguments": "{}",
                "status": "completed",
            }
        ]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raw = b""
        while True:
            m = await receive()
            raw += m.get("body", b"")
            if not m.get("more_body"):
                break
        body = json.loads(raw)
        self.bodies.append(body)
        rid = body.get("request_id") or f"resp_v{next(_ids)}"
        reply = {"id": rid, "object": "response", "output": self.output()}
        reply["kv_transfer_params"] = {"agentkv": {"cached_tokens": 0}}
        self.replies.append(reply)
        ctype = b"text/event-stream" if self.sse else b"application/json"
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]}
        )
        if not self.sse:
            await send({"type": "http.response.body", "body": json.dumps(reply).encode()})
            return
        # vLLM's stream: the completed event carries the whole response, whose output (not the
        # streamed items') the Agents SDK keeps.
        events = [
            {"type": "response.created", "response": {"id": rid, "output": []}},
            {"type": "response.output_item.done", "output_index": 0, "item": {"type": "x"}},
            {"type": "response.completed", "response": reply},
        ]
        for e in events:
            chunk = f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Server:
    """The middleware in front of ``Vllm`` with a response store; ``engine``: the trajectories
    the engine holds (what ``known`` answers from)."""

    def __init__(self, app: Vllm) -> None:
        self.app = app
        self.pauses: list[tuple[str, str, list[str]]] = []
        self.engine: set[str] = set()
        self.asked: list[tuple[str, str | None]] = []
        self.state = HookState(enabled=True, responses_chains=True, pause=self._pause)
        self.state.known = self._known
        self.mw = AgentKVHooks(app, self.state)

    async def _pause(self, tid: str, branch: str, tools: list[str], *_: Any) -> None:
        self.pauses.append((tid, branch, tools))

    async def _known(self, tid: str, salt: str | None) -> bool:
        self.asked.append((tid, salt))
        return tid in self.engine

    async def create(
        self, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[dict[str, Any], dict[bytes, bytes]]:
        """(the reply vLLM wrote, with the hooks' fields; the reply headers). The trajectory the
        request named is in ``app.bodies[-1]``; the engine learns it."""
        raw = json.dumps({"model": "m", **body}).encode()
        hdrs = [(b"content-type", b"application/json")]
        hdrs += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        scope = {"type": "http", "method": "POST", "path": RESPONSES, "headers": hdrs}
        incoming = [{"type": "http.request", "body": raw, "more_body": False}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return incoming.pop(0) if incoming else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await self.mw(scope, receive, send)
        if (tid := trajectory(self.app.bodies[-1])) is not None:
            self.engine.add(tid)
        reply = self.app.replies[-1]
        if not self.app.sse:
            reply = json.loads(sent[-1]["body"])
        return reply, dict(sent[0]["headers"])


def trajectory(body: dict[str, Any]) -> str | None:
    agentkv = (body.get("kv_transfer_params") or {}).get("agentkv") or {}
    return agentkv.get("trajectory_id")


def resent(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The reply's output as the Agents SDK resends it, then the tool's output per call."""
    items = [{k: v for k, v in o.items() if k != "created_by"} for o in reply["output"]]
    outs = [
        {"type": "function_call_output", "call_id": o["call_id"], "output": "sunny"}
        for o in reply["output"]
        if o["type"] == "function_call"
    ]
    return [*items, *outs]


async def test_a_resent_history_is_one_trajectory_paused_and_continued() -> None:
    """Three requests of one run, each the whole conversation so far, no chain, no hint: one
    trajectory (the first response's id), each reply says the prefix named it, and the auto-
    pause of every turn is on that trajectory."""
    server = Server(Vllm())
    history: list[dict[str, Any]] = [USER]
    r1, h1 = await server.create({"input": history})
    tid = r1["id"]
    assert trajectory(server.app.bodies[0]) == tid and h1[b"x-agentkv-identified-by"] == (
        b"responses_chain"
    )
    for turn in (2, 3):
        history = [*history, *resent(server.app.replies[-1])]
        reply, headers = await server.create({"input": history})
        body = server.app.bodies[-1]
        assert trajectory(body) == tid, turn
        assert "request_id" not in body  # vLLM names the response; the trajectory is the run's
        assert headers[b"x-agentkv-identified-by"] == b"responses_prefix"
        assert reply["kv_transfer_params"]["agentkv"]["identified_by"] == "responses_prefix"
    assert server.pauses == [(tid, "main", ["get_weather"])] * 3
    assert server.asked == [(tid, None)] * 2
    counters = server.state.counters
    assert counters["identified.responses_chain"] == 1
    assert counters["identified.responses_prefix"] == 2
    assert "responses_prefix" in server.state.view()["precedence"]


async def test_a_streamed_reply_is_remembered_by_its_completed_response() -> None:
    server = Server(Vllm(sse=True))
    await server.create({"input": "hi", "stream": True})
    tid = trajectory(server.app.bodies[0])
    history = [{"role": "user", "content": "hi"}, *resent(server.app.replies[-1])]
    _, headers = await server.create({"input": history, "stream": True})
    assert trajectory(server.app.bodies[-1]) == tid
    assert headers[b"x-agentkv-identified-by"] == b"responses_prefix"


async def test_two_runs_with_different_histories_stay_two_trajectories() -> None:
    server = Server(Vllm())
    await server.create({"input": [USER]})
    a = server.app.replies[-1]
    await server.create({"input": [USER]})
    b = server.app.replies[-1]
    assert a["id"] != b["id"]
    await server.create({"input": [USER, *resent(b)]})
    await server.create({"input": [USER, *resent(a)]})
    assert [trajectory(x) for x in server.app.bodies] == [a["id"], b["id"], b["id"], a["id"]]


async def test_a_deleted_trajectory_is_not_continued() -> None:
    server = Server(Vllm())
    r1, _ = await server.create({"input": [USER]})
    server.engine.clear()  # DELETEd, or expired after its idle TTL
    r2, headers = await server.create({"input": [USER, *resent(r1)]})
    assert trajectory(server.app.bodies[-1]) == r2["id"] != r1["id"]
    assert headers[b"x-agentkv-identified-by"] == b"responses_chain"
    assert server.state.counters["responses_prefix_gone"] == 1
    # The new trajectory is the run's from now on.
    await server.create({"input": [USER, *resent(r1), *resent(r2)]})
    assert trajectory(server.app.bodies[-1]) == r2["id"]


async def test_identical_histories_of_two_runs_continue_neither() -> None:
    """Text replies of a deterministic model (only their ids differ): two runs' conversations
    are the same, and the next request could be either's. Neither is continued (never merged);
    counted."""
    server = Server(Vllm(tool=None))
    r1, _ = await server.create({"input": [USER]})
    r2, _ = await server.create({"input": [USER]})
    r3, headers = await server.create({"input": [USER, *r1["output"], USER]})
    assert trajectory(server.app.bodies[-1]) == r3["id"] not in (r1["id"], r2["id"])
    assert headers[b"x-agentkv-identified-by"] == b"responses_chain"
    assert server.state.counters["responses_prefix_ambiguous"] == 1
    assert server.asked == []  # refused before asking the engine


async def test_a_hint_a_chain_another_tenant_or_no_store_is_not_a_prefix_match() -> None:
    server = Server(Vllm())
    r1, _ = await server.create({"input": [USER]})
    tid = r1["id"]
    history = [USER, *resent(r1)]
    # Every explicit hint outranks the prefix.
    await server.create({"input": history}, {"x-session-id": "mine"})
    assert trajectory(server.app.bodies[-1]) == "mine"
    await server.create({"input": history, "prompt_cache_key": "key"})
    assert trajectory(server.app.bodies[-1]) == "key"
    # A chained request's history is in vLLM's store: the chain names it.
    await server.create({"input": resent(r1)[-1:], "previous_response_id": tid})
    assert trajectory(server.app.bodies[-1]) == tid
    # Another tenant never continues this one's run.
    await server.create({"input": history, "cache_salt": "tenant-b"})
    other = server.app.replies[-1]["id"]
    assert trajectory(server.app.bodies[-1]) == other != tid
    assert server.state.counters["identified.responses_prefix"] == 0
    # Without a response store there are no chains and no prefix match either.
    server.state.responses_chains = False
    await server.create({"input": history})
    assert trajectory(server.app.bodies[-1]) is None


async def test_an_unanswered_check_continues_the_run() -> None:
    """The engine's answer is a guard against continuing a forgotten trajectory; when it cannot
    answer (busy, no connector) the run continues, as a chain does."""
    server = Server(Vllm())

    async def broken(tid: str, salt: str | None) -> bool:
        raise RuntimeError("control channel down")

    server.state.known = broken
    r1, _ = await server.create({"input": [USER]})
    await server.create({"input": [USER, *resent(r1)]})
    assert trajectory(server.app.bodies[-1]) == r1["id"]
    assert server.state.counters["responses_prefix_check_failed"] == 1


def test_the_known_op_answers_whether_a_trajectory_is_still_held() -> None:
    """What ``known`` asks the engine (routes' ``_known``): per tenant, and no longer after a
    DELETE."""
    from tests.unit.test_control import _status_side

    side, _ = _status_side()

    def known(tid: str, salt: str | None = None) -> int:
        req = {"op": "known", "trajectory_id": tid, **({"cache_salt": salt} if salt else {})}
        return int(side.handle(req)[0])

    assert known("a-private-run", "tenant-a") == 200 and known("plain-run") == 200
    assert known("a-private-run") == 404 and known("a-private-run", "tenant-b") == 404
    assert known("never") == 404
    assert side.handle({"op": "end", "trajectory_id": "plain-run"})[0] == 200
    assert known("plain-run") == 404
