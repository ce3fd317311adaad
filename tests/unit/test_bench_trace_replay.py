"""The replay's closed loop, request by request: what each configuration sends, in what order,
and what it records. The server here is an httpx.MockTransport that answers like vLLM (SSE
completions with a usage chunk) and the agentkv routes; the real servers are in
tests/e2e/test_bench_trace.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from agentkv.traces import TraceRound, TraceSession, TraceWorkload
from agentkv_bench.drivers import PauseVia
from agentkv_bench.trace_prompts import build_prompts
from agentkv_bench.trace_replay import replay

SESSION = TraceSession("s-1", 0.0, (TraceRound(0, 300, 3, 0.01), TraceRound(303, 40, 2, 0.0)))
WORKLOAD = TraceWorkload((SESSION,), "t")


class FakeServer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.completions = 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        body: Any = json.loads(request.content) if request.content else None
        self.calls.append((request.method, request.url.path, body))
        path = request.url.path
        if path == "/v1/completions":
            self.completions += 1
            cached = 256 if self.completions == 2 else 0
            chunks = [
                {"choices": [{"index": 0, "text": "x"}]},
                {
                    "choices": [],
                    "usage": {
                        "prompt_tokens": len(body["prompt"]),
                        "completion_tokens": body["max_tokens"],
                        "prompt_tokens_details": {"cached_tokens": cached},
                    },
                },
            ]
            sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
        if path.endswith("/pause"):
            decision = {
                "action": "offload_host",
                "writeback_deferred": False,
                "eviction_in_s": 4.5,
                "wait_p90_s": 12.0,
            }
            return httpx.Response(200, json={"decision": decision})
        if path.endswith("/resume"):
            return httpx.Response(200, json={"state": "offloaded"})
        if request.method == "GET":
            turns = [
                {"turn": 1, "branch": "main", "prompt_tokens": 300, "device_hit_tokens": 0},
                {
                    "turn": 2,
                    "branch": "main",
                    "prompt_tokens": 343,
                    "device_hit_tokens": 0,
                    "tier_hit_tokens": 256,
                    "tier": "host",
                },
            ]
            return httpx.Response(200, json={"turns": turns})
        if request.method == "DELETE":
            return httpx.Response(200, json={"released": 1})
        return httpx.Response(404, json={"detail": "no route"})


def _run(mode: str, pause_via: PauseVia = PauseVia.ROUTES) -> tuple[FakeServer, list[Any]]:
    server = FakeServer()
    prompts = build_prompts(WORKLOAD)

    async def go() -> list[Any]:
        transport = httpx.MockTransport(server.handler)
        async with httpx.AsyncClient(transport=transport) as client:
            return await replay(
                WORKLOAD, prompts, mode, client, "http://s", "m", "7", pause_via=pause_via
            )

    return server, asyncio.run(go())


def test_agentkv_pauses_waits_resumes_then_reads_stats_and_deletes() -> None:
    server, sessions = _run("agentkv")
    prompts = build_prompts(WORKLOAD)[0]
    tid = "trace-7-0"
    route = f"/agentkv/v1/trajectories/{tid}"
    assert [(m, p) for m, p, _ in server.calls] == [
        ("POST", "/v1/completions"),
        ("POST", route + "/pause"),
        ("POST", route + "/resume"),
        ("POST", "/v1/completions"),
        ("GET", route),
        ("DELETE", route),
    ]
    first, second = server.calls[0][2], server.calls[3][2]
    assert first["prompt"] == list(prompts[0].prompt) and first["max_tokens"] == 3
    assert second["prompt"] == list(prompts[1].prompt) and second["max_tokens"] == 2
    assert second["prompt"][:303] == list(prompts[0].prompt + prompts[0].reply)
    for body in (first, second):
        assert body["kv_transfer_params"] == {"agentkv": {"trajectory_id": tid}}
        assert body["ignore_eos"] is True and body["stream"] is True
    assert server.calls[1][2] == {"tool": "trace-tool"}  # no expected wait: not known live
    (rec,) = sessions
    r0, r1 = rec.rounds
    assert (r0.kind, r1.kind) == ("first", "resume")
    assert r1.wait_before_s == 0.01 and r1.decision == "offload_host"
    # why the copy went out at the pause: the forecast eviction (4.5 s) before the wait's p90
    assert (r1.writeback_deferred, r1.eviction_in_s, r1.wait_p90_s) == (False, 4.5, 12.0)
    assert r0.writeback_deferred is None and r0.to_dict()["eviction_in_s"] is None
    assert (r1.prompt_tokens, r1.cached_tokens, r1.completion_tokens) == (343, 256, 2)
    assert (r1.tier_hit_tokens, r1.tier, r1.device_hit_tokens) == (256, "host", 0)
    assert r1.reusable_tokens == 300  # the previous prompt; its reply was never computed
    assert r1.planned_prefix == 303
    assert r1.sent_at_s - r0.sent_at_s >= r0.latency_s + 0.01  # closed loop: reply, then wait
    assert rec.jct_s >= r1.sent_at_s - r0.sent_at_s


def test_paused_by_request_the_driver_makes_no_control_call_per_wait() -> None:
    """--pause-via request: the round before a wait names its pause (pause_after), the next
    round's request resumes; only the end-of-session GET and DELETE remain."""
    server, sessions = _run("agentkv", PauseVia.REQUEST)
    tid = "trace-7-0"
    route = f"/agentkv/v1/trajectories/{tid}"
    assert [(m, p) for m, p, _ in server.calls] == [
        ("POST", "/v1/completions"),
        ("POST", "/v1/completions"),
        ("GET", route),
        ("DELETE", route),
    ]
    first, second = server.calls[0][2], server.calls[1][2]
    assert first["kv_transfer_params"] == {
        "agentkv": {"trajectory_id": tid, "pause_after": {"tool": "trace-tool"}}
    }
    # The last round has no wait after it: nothing to pause for.
    assert second["kv_transfer_params"] == {"agentkv": {"trajectory_id": tid}}
    (rec,) = sessions
    assert rec.rounds[1].control_s is None  # no call on the agent's path
    assert rec.rounds[1].sent_at_s - rec.rounds[0].sent_at_s >= rec.rounds[0].latency_s + 0.01


@pytest.mark.parametrize("mode", ["vanilla", "oracle"])
def test_vanilla_and_oracle_send_only_plain_completions(mode: str) -> None:
    server, sessions = _run(mode)
    assert [(m, p) for m, p, _ in server.calls] == [("POST", "/v1/completions")] * 2
    assert all("kv_transfer_params" not in body for _, _, body in server.calls)
    r1 = sessions[0].rounds[1]
    assert r1.decision is None and r1.tier_hit_tokens is None
    assert r1.writeback_deferred is None and r1.wait_p90_s is None


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        _run("lmcache")


@pytest.mark.parametrize("mode", ["retain-always", "offload-always"])
def test_fixed_action_configs_drive_trajectories_like_agentkv(mode: str) -> None:
    # The fixed policies differ from agentkv only on the server (policy_override), never in
    # what the client sends: same calls, same trajectory params.
    server, _ = _run(mode)
    reference, _ = _run("agentkv")
    assert [(m, p) for m, p, _ in server.calls] == [(m, p) for m, p, _ in reference.calls]
    assert server.calls[0][2]["kv_transfer_params"] == {"agentkv": {"trajectory_id": "trace-7-0"}}
