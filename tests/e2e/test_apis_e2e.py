"""Auto-pause on the OpenAI Responses API and the Anthropic Messages API, against the real
server, through the real ``openai`` and ``anthropic`` client packages; the error a malformed
request gets back; an escaped hint key; the agent-loop examples.

The three agent-loop examples (examples/*_agent_loop.py) run against it as a user runs them.

The shared session server (conftest.py) carries the two additions these tests need:
``VLLM_ENABLE_RESPONSES_API_STORE=1`` (``previous_response_id`` chains) and
``--structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}'``:
with the random-weight model a forced tool on ``/v1/messages`` otherwise fails inside vLLM
(400: the guided JSON arguments run on as whitespace). Tool schemas use an ``enum`` so the
forced arguments stay short. Every test uses tool and trajectory names of its own.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server, long_text

pytestmark = pytest.mark.e2e

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["paris"]}},
    "required": ["city"],
}


@pytest.fixture
def api_server(server: Server) -> Server:
    return server


def _uid() -> str:
    return uuid.uuid4().hex[:8]


def _agentkv(obj: Any) -> dict[str, Any]:
    """``kv_transfer_params.agentkv`` of a client object (vLLM's extra response field)."""
    extra = obj.model_extra or {}
    return dict((extra.get("kv_transfer_params") or {}).get("agentkv") or {})


def _branch(server: Server, tid: str) -> dict[str, Any]:
    return dict(server.trajectory(tid)["branches"]["main"])


def _tool_use(block: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}


def _to_tier(server: Server, tid: str) -> None:
    """The paused trajectory's blocks reach a tier, then vLLM's own cache forgets them: the next
    turn can only get its prefix from agentkv's tier."""
    server.wait_state(tid, {"offloaded"})
    server.reset_prefix_cache()


def _openai(server: Server) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0)


def _anthropic(server: Server) -> Any:
    return anthropic.Anthropic(base_url=server.base_url, auth_token=server.api_key, max_retries=0)


def test_messages_tool_use_auto_pauses_and_the_next_turn_loads_from_the_tier(
    api_server: Server,
) -> None:
    from harness_sdk.anthropic import wrap

    tool = f"get_weather_{_uid()}"
    tools = [{"name": tool, "description": "Weather of a city", "input_schema": SCHEMA}]
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather? " + long_text(29001, 250)}
    ]
    with wrap(_anthropic(api_server), f"apis-msg-{_uid()}") as client:
        msg = client.messages.create(
            model=api_server.model,
            max_tokens=32,
            messages=msgs,
            tools=tools,
            tool_choice={"type": "tool", "name": tool},
        )
        calls = [b for b in msg.content if b.type == "tool_use"]
        assert [c.name for c in calls] == [tool] and calls[0].input == {"city": "paris"}
        first = _agentkv(msg)
        assert first["trajectory_id"] == client.trajectory_id and first["turn"] == 1
        # auto-paused before the reply went out: visible at once, with the called tool
        branch = _branch(api_server, client.trajectory_id)
        assert branch["tool"] == tool and branch["state"] != "active", branch
        _to_tier(api_server, client.trajectory_id)
        msgs += [
            {"role": "assistant", "content": [_tool_use(c) for c in calls]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "sun"}],
            },
        ]
        nxt = client.messages.create(
            model=api_server.model, max_tokens=4, messages=msgs, tools=tools
        )
        stats = _agentkv(nxt)
        assert stats["turn"] == 2 and stats["tier"] in ("host", "disk"), stats
        assert stats["tier_hit_tokens"] >= 256, stats  # the previous context, from the tier


def test_streamed_messages_tool_use_pauses(api_server: Server) -> None:
    tid, tool = f"apis-msgs-{_uid()}", f"lookup_{_uid()}"
    client = _anthropic(api_server)
    with client.messages.stream(
        model=api_server.model,
        max_tokens=32,
        messages=[{"role": "user", "content": "Look it up. " + long_text(29002, 200)}],
        tools=[{"name": tool, "description": "Look up", "input_schema": SCHEMA}],
        tool_choice={"type": "tool", "name": tool},
        extra_headers={"x-session-id": tid},
    ) as stream:
        final = stream.get_final_message()
    assert [b.name for b in final.content if b.type == "tool_use"] == [tool]
    assert _branch(api_server, tid)["tool"] == tool


def test_a_responses_chain_is_one_trajectory_that_resumes_from_the_tier(
    api_server: Server,
) -> None:
    """No hint at all: the first response names the trajectory, ``previous_response_id``
    continues it; the function call auto-pauses it."""
    client = _openai(api_server)
    tool = f"get_weather_{_uid()}"
    tools = [{"type": "function", "name": tool, "description": "Weather", "parameters": SCHEMA}]
    r1 = client.responses.create(
        model=api_server.model,
        input="What is the weather? " + long_text(29003, 250),
        tools=tools,
        tool_choice={"type": "function", "name": tool},
        max_output_tokens=32,
        temperature=0,
    )
    calls = [o for o in r1.output if o.type == "function_call"]
    assert [c.name for c in calls] == [tool]
    assert _agentkv(r1)["trajectory_id"] == r1.id  # the chain is named after its first response
    assert _branch(api_server, r1.id)["tool"] == tool
    _to_tier(api_server, r1.id)
    r2 = client.responses.create(
        model=api_server.model,
        previous_response_id=r1.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sun"}],
        max_output_tokens=4,
        temperature=0,
    )
    stats = _agentkv(r2)
    assert stats["trajectory_id"] == r1.id and stats["turn"] == 2, stats
    assert stats["tier"] in ("host", "disk") and stats["tier_hit_tokens"] >= 256, stats
    r3 = client.responses.create(
        model=api_server.model, previous_response_id=r2.id, input="thanks", max_output_tokens=2
    )
    assert _agentkv(r3)["trajectory_id"] == r1.id and _agentkv(r3)["turn"] == 3


def test_streamed_responses_through_the_drop_in_pause(api_server: Server) -> None:
    from harness_sdk.openai import wrap

    tool = f"stream_tool_{_uid()}"
    with wrap(_openai(api_server), f"apis-rs-{_uid()}") as client:
        stream = client.responses.create(
            model=api_server.model,
            input="Call the tool. " + long_text(29004, 200),
            tools=[{"type": "function", "name": tool, "parameters": SCHEMA}],
            tool_choice={"type": "function", "name": tool},
            max_output_tokens=32,
            stream=True,
            store=False,
        )
        kinds = [event.type for event in stream]
        assert "response.output_item.added" in kinds and kinds[-1] == "response.completed"
        branch = _branch(api_server, client.trajectory_id)
        assert branch["tool"] == tool and branch["state"] != "active"


def test_parallel_tools_pause_as_the_longest(api_server: Server) -> None:
    """What an auto-pause with several tool calls sends, through the route: the engine predicts
    (and will learn) the tool with the longest predicted wait."""
    tid = f"apis-par-{_uid()}"
    api_server.chat([{"role": "user", "content": long_text(29005, 150)}], trajectory=tid)
    fast, slow = f"fast_{_uid()}", f"slow_{_uid()}"
    for tool, run_s in ((fast, 0.0), (slow, 1.0)):  # one observed wait each
        api_server.pause(tid, tool, None)
        time.sleep(run_s)  # the tool's run: the wait the engine observes at the resume
        r = api_server.client.post(f"/agentkv/v1/trajectories/{tid}/resume", json={})
        assert r.status_code == 200, r.text
    r = api_server.client.post(
        f"/agentkv/v1/trajectories/{tid}/pause", json={"tools": [fast, slow]}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tools"] == [fast, slow] and body["predicted_tool"] == slow
    assert _branch(api_server, tid)["tool"] == slow
    api_server.end(tid)


def test_malformed_params_are_served_and_say_why(api_server: Server) -> None:
    client = _openai(api_server)
    r = client.chat.completions.create(
        model=api_server.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"kv_transfer_params": {"agentkv": {"trajectory_id": "a/b"}}},
    )
    error = _agentkv(r)["error"]
    assert "trajectory_id" in error and "'/'" in error
    raw = client.chat.completions.with_raw_response.create(
        model=api_server.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_headers={"x-session-id": "has space"},
    )
    assert "is not a trajectory id" in raw.headers["x-agentkv-error"]
    msg = _anthropic(api_server).messages.create(
        model=api_server.model,
        max_tokens=2,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"kv_transfer_params": {"agentkv": {"branch": "main"}}},
    )
    assert "trajectory_id" in _agentkv(msg)["error"]


def test_an_escaped_hint_key_names_the_trajectory(api_server: Server) -> None:
    tid = f"apis-esc-{_uid()}"
    raw = (
        '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], '
        f'"session\\u005fid": "{tid}"}}'
    ).encode()
    r = httpx.post(
        api_server.base_url + "/v1/chat/completions",
        content=raw,
        headers={**api_server.headers, "content-type": "application/json"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["kv_transfer_params"]["agentkv"]["trajectory_id"] == tid
    assert api_server.trajectory_code(tid) == 200  # the escaped key named a live trajectory


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("example", "path", "turns"),
    [
        ("openai_agent_loop.py", "/v1", 5),
        ("responses_agent_loop.py", "/v1", 3),
        ("anthropic_agent_loop.py", "", 3),
    ],
)
def test_the_agent_loop_examples_run_and_reuse_their_prefix(
    api_server: Server, example: str, path: str, turns: int
) -> None:
    """The three examples in examples/ (one shared skeleton, agent_loop_common.py) run against
    the server as a user would run them, every turn after the first reuses its prefix, and the
    loop's end deletes the trajectory."""
    tid = f"apis-example-{_uid()}"
    args = ["--base-url", api_server.base_url + path, "--trajectory-id", tid]
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / example), *args, "--api-key", str(api_server.api_key)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    hits = re.findall(r"^turn \d+: .*from vLLM +(\d+) +from tier +(\d+)", done.stdout, re.M)
    assert len(hits) == turns, done.stdout
    assert all(int(device) + int(tier) > 0 for device, tier in hits[1:]), done.stdout
    assert api_server.trajectory_code(tid) == 404  # the wrapper's exit DELETEs the trajectory


def test_another_tenants_response_chain_is_refused(api_server: Server) -> None:
    """Issue 40 item 5: with the Responses store on, a salted chain's id (its first response
    id) was served by ``GET /v1/responses/{id}`` and continued by ``previous_response_id`` for
    anyone. Another tenant (or none) now gets vLLM's own 404; the chain's tenant still works."""
    uid = _uid()
    mine, theirs = f"resp-b-{uid}", f"resp-a-{uid}"
    client = _openai(api_server)
    r1 = client.responses.create(
        model=api_server.model,
        input="Secret plans. " + long_text(29100, 40),
        max_output_tokens=2,
        temperature=0,
        extra_body={"cache_salt": mine},
    )
    try:
        get = f"/v1/responses/{r1.id}"
        for tenant in ({"X-AgentKV-Cache-Salt": theirs}, {}):
            r = api_server.client.get(get, headers=tenant)
            assert r.status_code == 404 and "not found" in r.text, r.text
        assert api_server.client.get(get, params={"cache_salt": mine}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            client.responses.create(
                model=api_server.model,
                previous_response_id=r1.id,
                input="what were the plans?",
                max_output_tokens=2,
                extra_body={"cache_salt": theirs},
            )
        r2 = client.responses.create(
            model=api_server.model,
            previous_response_id=r1.id,
            input="go on",
            max_output_tokens=2,
            extra_body={"cache_salt": mine},
        )
        assert _agentkv(r2)["trajectory_id"] == r1.id
    finally:
        api_server.client.delete(
            f"/agentkv/v1/trajectories/{r1.id}", headers={"X-AgentKV-Cache-Salt": mine}
        )
