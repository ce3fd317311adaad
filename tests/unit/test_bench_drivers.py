"""The generated workload's trajectory driver (``agentkv_bench.drivers``) against an
httpx.MockTransport fake of vLLM + agentkv: how it pauses for a tool wait (``PauseVia``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from agentkv_bench.drivers import AgentKVSession, PauseVia, run_trajectory
from agentkv_bench.workload import TrajectoryPlan, TurnPlan


def _turn(index: int, tool: str | None, fork: int = 0) -> TurnPlan:
    return TurnPlan(
        index=index,
        tool=tool,
        wait_s=0.0,
        expected_wait_s=2.0 if tool else None,
        observation=f"observation {index}",
        observation_tokens=3,
        action=f"action {index}",
        max_tokens=2,
        fork=fork,
        branch_observations=tuple(f"branch {index}.{i}" for i in range(fork)),
    )


# first turn, a pytest wait, a grep wait whose turn forks in 2, a final bash wait.
PLAN = TrajectoryPlan(
    "t-9",
    0.0,
    (_turn(1, None), _turn(2, "pytest"), _turn(3, "grep", fork=2), _turn(4, "bash")),
)


class Fake:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body: Any = json.loads(request.content) if request.content else None
        path = request.url.path
        self.calls.append((request.method, path, body))
        if path == "/v1/chat/completions":
            chunks = [
                {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": "x"}}]},
                {
                    "id": "c",
                    "model": "m",
                    "choices": [],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 2},
                },
            ]
            sse = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks)
            return httpx.Response(
                200,
                content=sse + b"data: [DONE]\n\n",
                headers={"content-type": "text/event-stream"},
            )
        if path.endswith("/pause"):
            return httpx.Response(200, json={"applied": True, "decision": {"action": "retain"}})
        if request.method == "GET":
            return httpx.Response(200, json={"turns": []})
        return httpx.Response(200, json={})

    def sequence(self) -> list[str]:
        """Each call as 'chat' (with the tool its pause_after names, if any), 'pause', 'resume'."""
        out = []
        for _, path, body in self.calls:
            if path == "/v1/chat/completions":
                after = body["kv_transfer_params"]["agentkv"].get("pause_after")
                out.append(f"chat:{after['tool']}" if after else "chat")
            elif path.endswith(("/pause", "/resume")):
                out.append(path.rsplit("/", 1)[1])
        return out


def _run(via: PauseVia) -> Fake:
    fake = Fake()

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as client:
            session = AgentKVSession.open(client, "http://s", "m", "system", "t-9", pause_via=via)
            await run_trajectory(PLAN, session, 0.0)

    asyncio.run(go())
    return fake


def test_routes_pause_and_resume_around_every_tool_wait() -> None:
    assert _run(PauseVia.ROUTES).sequence() == [
        "chat",
        *("pause", "resume", "chat"),  # pytest
        *("pause", "resume", "chat", "chat"),  # grep, then the turn's two branches
        *("pause", "resume", "chat"),  # bash
    ]


def test_by_request_the_turn_before_a_wait_declares_it_and_no_call_is_made() -> None:
    """--pause-via request: each turn names the next turn's tool (then_tool: pause_after) and
    that wait makes no control call; a fork's branches declare nothing, so the wait after the
    fork turn takes the routes."""
    assert _run(PauseVia.REQUEST).sequence() == [
        "chat:pytest",
        "chat:grep",  # the pytest wait: no call
        "chat",
        "chat",  # the grep turn's two branches
        *("pause", "resume", "chat"),  # bash, after the fork
    ]
