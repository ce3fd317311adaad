"""Tool-wait hooks with no client changes, against the real server (``server`` fixture):
auto-pause on tool calls (JSON and SSE), trajectory ids from ``x-session-id`` and vllm-router's
``agentic_context``, malformed hints served as vanilla, and the ``openai`` client wrapper.

The fixture starts vLLM with ``--enable-auto-tool-choice --tool-call-parser pythonic``: with a
named ``tool_choice`` vLLM forces the call, so the random-weight model emits one. Every test
uses tool names of its own (the server learns waits per tool name).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server, full_blocks, lcp, long_text, wait_until

pytestmark = pytest.mark.e2e

SLEEP_S = 1.0


def _uid() -> str:
    return uuid.uuid4().hex[:8]


def _tool(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "Look something up",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }


def _forced(name: str) -> dict[str, Any]:
    return {"tools": [_tool(name)], "tool_choice": {"type": "function", "function": {"name": name}}}


def _ctx(seed: int, words: int = 300) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a coding agent. " + long_text(seed, words)},
        {"role": "user", "content": "Find the failing test."},
    ]


def _after_tool(
    msgs: list[dict[str, Any]], reply: dict[str, Any], seed: int
) -> list[dict[str, Any]]:
    """The next turn of a plain tool loop: the assistant's call, then the tool's result."""
    call = reply["choices"][0]["message"]["tool_calls"][0]
    assistant = {
        "role": "assistant",
        "content": "",
        # Echo the call with valid JSON arguments (the random model's may be cut off).
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": "{}"},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": call["id"], "content": long_text(seed, 40)}
    return [*msgs, assistant, result]


def _tokens(server: Server, messages: list[dict[str, Any]], tool: str | None = None) -> list[int]:
    """The prompt's token ids as the chat request renders them (with its tools)."""
    body: dict[str, Any] = {"model": server.model, "messages": messages}
    if tool is not None:
        body["tools"] = [_tool(tool)]
    r = server.client.post("/tokenize", json=body)
    r.raise_for_status()
    return list(r.json()["tokens"])


def _post(server: Server, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    r = server.client.post("/v1/chat/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    return r.json()


def _hits(reply: dict[str, Any]) -> int:
    stats = (reply.get("kv_transfer_params") or {}).get("agentkv") or {}
    return int(stats.get("device_hit_tokens") or 0) + int(stats.get("tier_hit_tokens") or 0)


def _hooks(server: Server) -> dict[str, int]:
    return dict(server.status()["hooks"]["counters"])


def test_auto_pause_learns_the_tool_wait_and_keeps_the_prefix(server: Server) -> None:
    """No pause call anywhere: a forced tool call pauses the branch with that tool; three
    reply -> sleep -> request cycles teach the engine the wait; every turn reuses the previous
    context's full blocks (from vLLM's cache or a tier)."""
    tid, tool = f"hooks-auto-{_uid()}", f"lookup_{_uid()}"
    msgs = _ctx(17001)
    before = _hooks(server)
    reply = server.chat(msgs, trajectory=tid, max_tokens=8, **_forced(tool))
    calls = reply["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == tool
    # The pause was taken before the response went out: it is visible at once.
    branch = server.trajectory(tid)["branches"]["main"]
    assert branch["tool"] == tool and branch["decision"] is not None, branch
    assert branch["state"] != "active"
    assert _hooks(server).get("auto_pauses", 0) == before.get("auto_pauses", 0) + 1

    gaps: list[float] = []  # reply received -> next request sent: the tool wait, as sent
    received = time.monotonic()
    for cycle in range(3):
        nxt = _after_tool(msgs, reply, 17100 + cycle)
        expected = full_blocks(lcp(_tokens(server, msgs, tool), _tokens(server, nxt, tool)))
        time.sleep(max(0.0, received + SLEEP_S - time.monotonic()))  # the tool runs SLEEP_S
        gaps.append(time.monotonic() - received)
        reply = server.chat(nxt, trajectory=tid, max_tokens=8, **_forced(tool))
        received = time.monotonic()
        assert _hits(reply) == expected > 0, (cycle, reply.get("kv_transfer_params"))
        msgs = nxt

    branch = server.trajectory(tid)["branches"]["main"]
    decision = branch["decision"]
    assert branch["tool"] == tool
    assert decision["wait_source"] == "observed", decision
    assert server.status()["predictor"].get(tool) == 3
    p50 = decision["wait_p50_s"]
    # The engine sees each wait from the response it sent to the request it parsed: the
    # client's gap plus both ends' HTTP handling, which a loaded machine stretches.
    assert 0.8 * min(gaps) <= p50 <= max(gaps) + 0.35 * SLEEP_S, (p50, gaps)
    server.end(tid)


def test_auto_pause_on_a_streamed_tool_call(server: Server) -> None:
    tid, tool = f"hooks-sse-{_uid()}", f"stream_lookup_{_uid()}"
    body = server.chat_body(_ctx(17201), trajectory=tid, max_tokens=8, stream=True, **_forced(tool))
    body.pop("logprobs")
    names: list[str] = []
    with server.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or []:
                    for call in (choice.get("delta") or {}).get("tool_calls") or []:
                        if (call.get("function") or {}).get("name"):
                            names.append(call["function"]["name"])
    assert names and names[0] == tool
    branch = server.trajectory(tid)["branches"]["main"]
    assert branch["tool"] == tool and branch["decision"] is not None
    server.end(tid)


def test_x_session_id_alone_names_a_trajectory(server: Server) -> None:
    sid = f"hooks-hdr-{_uid()}"
    msgs = _ctx(17301)
    body = server.chat_body(msgs)
    assert "kv_transfer_params" not in body
    first = _post(server, body, {"x-session-id": sid})
    assert first["kv_transfer_params"]["agentkv"]["trajectory_id"] == sid
    nxt = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]
    second = _post(server, server.chat_body(nxt), {"x-session-id": sid})
    assert _hits(second) == full_blocks(lcp(server.tokenize(msgs), server.tokenize(nxt))) > 0
    view = server.trajectory(sid)
    assert [t["turn"] for t in view["turns"]] == [1, 2]
    assert view["turns"][1]["hit_tokens"] == _hits(second)
    server.end(sid)


def test_agentic_context_alone_names_a_trajectory_and_declares_the_wait(server: Server) -> None:
    sid, tool = f"hooks-ctx-{_uid()}", f"ctx_lookup_{_uid()}"
    context = {"session_id": sid, "expected_resume": 2.0, "kv_retention_ttl_seconds": 60}
    body = server.chat_body(
        _ctx(17401), max_tokens=8, vllm_xargs={"agentic_context": json.dumps(context)}
    )
    body.update(_forced(tool))
    reply = _post(server, body)
    assert reply["kv_transfer_params"]["agentkv"]["trajectory_id"] == sid
    view = server.trajectory(sid)
    assert len(view["turns"]) == 1
    decision = view["branches"]["main"]["decision"]
    assert view["branches"]["main"]["tool"] == tool
    assert (decision["wait_source"], decision["wait_p50_s"]) == ("declared", 2.0)
    server.end(sid)


def test_malformed_hints_are_vanilla_with_one_warning(server: Server) -> None:
    before_ids = set(server.status()["trajectory_ids"])
    before = _hooks(server)
    bad_ctx = {"vllm_xargs": {"agentic_context": json.dumps({"session_id": "a/b"})}}
    cases: list[tuple[dict[str, Any], dict[str, str]]] = [
        ({}, {"x-session-id": "bad session 1"}),
        ({}, {"x-session-id": "bad session 2"}),
        (bad_ctx, {}),
        ({"vllm_xargs": {"agentic_context": "{not json"}}, {}),
    ]
    for i, (extra, headers) in enumerate(cases):
        body = {**server.chat_body(_ctx(17501 + i, 60)), **extra}
        reply = _post(server, body, headers)
        assert reply["choices"][0]["message"]["content"] is not None
        # No stats (no trajectory), only the reason (issue 29)
        agentkv = (reply.get("kv_transfer_params") or {}).get("agentkv") or {}
        assert list(agentkv) == ["error"], agentkv
    assert set(server.status()["trajectory_ids"]) <= before_ids
    after = _hooks(server)
    for key, n in (("malformed.x-session-id", 2), ("malformed.agentic_context", 2)):
        assert after.get(key, 0) - before.get(key, 0) == n, (key, after)
    log = server.log_path.read_text(errors="replace")
    # Warned once per kind per process: other modules on this shared server (the APIs test's
    # 'has space') may have spent the x-session-id warning first, so count, don't name.
    warned = re.findall(r"x-session-id '[^']*' is not a trajectory id", log)
    assert len(warned) == 1, warned
    assert "'bad session 2'" not in log


def test_openai_client_wrapper_two_turns_and_a_tool_wait(server: Server) -> None:
    openai = pytest.importorskip("openai")
    from harness_sdk.openai import wrap

    tid, tool = f"hooks-oa-{_uid()}", f"oa_run_tests_{_uid()}"
    raw = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0)
    msgs = _ctx(17601)
    kw: dict[str, Any] = {"model": server.model, "max_tokens": 4, "temperature": 0}
    with wrap(raw, tid) as client:
        r1 = client.chat.completions.create(messages=msgs, extra_body={"ignore_eos": True}, **kw)
        assert r1.model_extra["kv_transfer_params"]["agentkv"]["trajectory_id"] == tid
        with client.tool(tool, expected_s=0.5) as call:
            time.sleep(0.5)
        assert call.pause_response is not None and call.decision is not None
        assert call.resume_response is not None
        nxt = [
            *msgs,
            {"role": "assistant", "content": r1.choices[0].message.content or ""},
            {"role": "user", "content": "[tests] 3 passed"},
        ]
        r2 = client.chat.completions.create(messages=nxt, extra_body={"ignore_eos": True}, **kw)
        stats = r2.model_extra["kv_transfer_params"]["agentkv"]
        hits = stats["device_hit_tokens"] + stats["tier_hit_tokens"]
        assert hits == full_blocks(lcp(server.tokenize(msgs), server.tokenize(nxt))) > 0
        state = client.server_state()
        assert state is not None and len(state["turns"]) == 2
        assert state["branches"]["main"]["tool"] == tool
        assert server.status()["predictor"].get(tool) == 1
    assert server.trajectory_code(tid) == 404  # close() deleted it
    with httpx.Client() as c:  # the wrapped client itself is still the caller's and usable
        assert c.get(server.base_url + "/health").status_code == 200


def test_a_request_that_names_its_pause_is_paused_at_finish_and_resumed_by_the_next(
    server: Server,
) -> None:
    """``pause_after`` in the request: no control call at all (issue 26: the pause and resume
    calls were the whole roomy-pool gap). The branch is paused with that tool when the
    request finishes, the reply carries the decision, the next request of the branch resumes
    it (the engine sees the wait) and reuses the context."""
    tid, tool = f"pause-after-{_uid()}", f"env_step_{_uid()}"
    msgs = _ctx(17501)
    params = {"agentkv": {"trajectory_id": tid, "pause_after": {"tool": tool}}}
    before = server.counters().get("request_pauses", 0)
    reply = server.chat(msgs, max_tokens=8, extra_params=params)
    pause = reply["kv_transfer_params"]["agentkv"]["pause"]
    assert pause["applied"] and pause["decision"]["action"], pause
    branch = server.trajectory(tid)["branches"]["main"]
    assert branch["tool"] == tool and branch["state"] != "active", branch
    assert branch["decision"]["action"] == pause["decision"]["action"]
    assert server.counters().get("request_pauses", 0) == before + 1

    nxt = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    expected = full_blocks(lcp(server.tokenize(msgs), server.tokenize(nxt)))
    time.sleep(SLEEP_S)
    reply = server.chat(nxt, trajectory=tid, max_tokens=8)
    assert "pause" not in reply["kv_transfer_params"]["agentkv"]  # this one named none
    assert _hits(reply) == expected > 0, reply.get("kv_transfer_params")
    assert server.status()["predictor"].get(tool) == 1  # the resume was observed: one wait
    server.end(tid)


def test_a_malformed_pause_after_serves_the_request_as_vanilla_and_says_why(
    server: Server,
) -> None:
    tid = f"pause-after-bad-{_uid()}"
    params = {"agentkv": {"trajectory_id": tid, "pause_after": {"expected_wait_s": -1}}}
    r = server.client.post(
        "/v1/chat/completions",
        json=server.chat_body(_ctx(17502, 40), max_tokens=2, extra_params=params),
    )
    assert r.status_code == 200
    error = r.json()["kv_transfer_params"]["agentkv"]["error"]
    assert "pause_after" in error and r.headers["x-agentkv-error"]
    assert server.trajectory_code(tid) == 404  # served as vanilla: no trajectory made


def _log_with(server: Server, marker: str) -> str | None:
    """The server log's text once it holds ``marker`` (the engine's lines arrive a bit later)."""
    text = server.log_path.read_text(errors="replace")
    return text if marker in text else None


def test_concurrent_runs_under_one_session_id_are_told_not_merged_silently(server: Server) -> None:
    """Frameworks share one client across runs, so a client-level ``x-session-id`` makes two
    concurrent runs one trajectory (issue 42). The request that starts while another of its
    branch still runs says so in its stats, the status counter rises, the server log warns once
    per trajectory; a request after the other ended is an ordinary next turn."""
    sid = f"hooks-conc-{_uid()}"
    hdr = {"x-session-id": sid}
    before = server.counters().get("concurrent_turns", 0)
    slow = server.chat_body(_ctx(17701, 60), max_tokens=4000, stream=True)
    slow.pop("logprobs")

    def running() -> int:
        if server.trajectory_code(sid) != 200:
            return 0
        return int(server.trajectory(sid)["branches"]["main"]["running_requests"])

    with (
        httpx.Client(base_url=server.base_url, headers={**server.headers, **hdr}, timeout=120) as c,
        c.stream("POST", "/v1/chat/completions", json=slow) as r,
    ):
        assert r.status_code == 200
        wait_until(lambda: running() == 1, "the slow run to be running")
        stats = _post(server, server.chat_body(_ctx(17702, 60)), hdr)["kv_transfer_params"]
        # 4000 tokens to go: the slow run still ran when the other was looked up
        assert running() == 1, "the slow run ended before the overlap was checked"
    agentkv = stats["agentkv"]
    assert agentkv["trajectory_id"] == sid and agentkv["concurrent_turns"] == 1, agentkv
    assert "session id" in agentkv["warning"]
    assert server.counters()["concurrent_turns"] == before + 1

    wait_until(lambda: running() == 0, "the slow run to end (its stream closed)")
    later = _post(server, server.chat_body(_ctx(17703, 60)), hdr)["kv_transfer_params"]["agentkv"]
    assert "concurrent_turns" not in later and "warning" not in later, later
    assert server.counters()["concurrent_turns"] == before + 1
    marker = f"concurrent turns of trajectory {sid} "
    log = wait_until(
        lambda: _log_with(server, marker), "the concurrent-turns warning in the server log"
    )
    assert log.count(marker) == 1
    server.end(sid)


def test_each_pause_decision_is_one_info_line_in_the_server_log(server: Server) -> None:
    """At vLLM's default log level (INFO) an auto-pause's decision shows in the server log:
    one compact line with the trajectory, the tool, the predicted wait, the action and why."""
    tid, tool = f"hooks-log-{_uid()}", f"logged_lookup_{_uid()}"
    server.chat(_ctx(17801), trajectory=tid, max_tokens=8, **_forced(tool))
    action = server.trajectory(tid)["branches"]["main"]["decision"]["action"]
    marker = f"agentkv: pause {tid}/main tool={tool} predicted_wait="
    log = wait_until(
        lambda: _log_with(server, marker), "the pause decision's line in the server log"
    )
    lines = [line for line in log.splitlines() if marker in line]
    assert len(lines) == 1, lines
    assert " INFO " in lines[0] and f"-> {action}; why: " in lines[0], lines[0]
    server.end(tid)
