"""harness_sdk against the real vLLM OpenAI server with the agentkv plugin (``server`` fixture).

Small prompts (~1-2k tokens; the server's blocks hold 128 tokens), max_tokens <= 8, temperature 0.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from harness_sdk import AuthenticationError, StableZoneChangedWarning, Trajectory, TurnResult
from tests.e2e.conftest import full_blocks

pytestmark = pytest.mark.e2e

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def system_prompt(seed: int, words: int = 300) -> str:
    """A distinct, deterministic system prompt of roughly 1-2k tokens."""
    return "You are a careful coding agent. " + " ".join(f"rule{seed}x{i}" for i in range(words))


def new_traj(server: Any, seed: int, **kw: Any) -> Trajectory:
    kw.setdefault("system", system_prompt(seed))
    return Trajectory(
        server.base_url,
        server.model,
        api_key=server.api_key,
        trajectory_id=f"sdk-e2e-{seed}-{uuid.uuid4().hex[:8]}",
        tools=TOOLS,
        max_tokens=8,
        temperature=0,
        **kw,
    )


def hit_tokens(r: TurnResult) -> int:
    engine = r.engine or {}
    return max(r.cached_tokens, int(engine.get("hit_tokens") or 0))


def hits_previous_context(r: TurnResult, prev: TurnResult) -> bool:
    """``r`` reused every full block of ``prev``'s prompt (but the last few template tokens):
    the SDK re-rendered the history byte for byte, so the prefix cache could serve all of it."""
    return hit_tokens(r) >= full_blocks(prev.prompt_tokens - 8) > 0


def raw_client(server: Any) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    return httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=60)


async def test_three_turns_with_tool_wait_hit_the_cache(server: Any) -> None:
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    async with new_traj(server, 1, tracer_provider=tp) as traj:
        r1 = await traj.complete("The test test_parse fails. What do you do first?")
        assert (
            r1.prompt_tokens > 256
            and r1.engine is not None
            and r1.engine["trajectory_id"] == traj.trajectory_id
        )
        results = [r1]
        for turn in (2, 3):
            async with traj.tool("run_tests", expected_s=1.0) as call:
                await asyncio.sleep(1.0)
                call.observe(f"run {turn}: 1 failed, 12 passed")
            assert call.pause_response is not None and call.decision is not None
            assert call.resume_response is not None
            assert call.duration_s is not None and call.duration_s >= 1.0
            results.append(await traj.complete(f"Turn {turn}: continue."))
        assert traj.routes_available is True
    for prev, r in itertools.pairwise(results):
        assert hits_previous_context(r, prev), (prev, r)
        assert r.hit_ratio is not None and r.hit_ratio > 0
        assert r.zone_changes == [] and r.client_divergence_message is None
    turn_spans = [s for s in exporter.get_finished_spans() if s.name == f"chat {server.model}"]
    assert len(turn_spans) == 3
    last = turn_spans[-1].attributes
    assert last is not None
    assert (
        last["gen_ai.operation.name"] == "chat"
        and last["gen_ai.conversation.id"] == traj.trajectory_id
    )
    assert last["gen_ai.usage.input_tokens"] == results[-1].prompt_tokens
    assert last["gen_ai.usage.cache_read.input_tokens"] == results[-1].cached_tokens
    assert "agentkv.prefix_hit_ratio" in last
    assert len([s for s in exporter.get_finished_spans() if s.name == "tool_wait run_tests"]) == 2


async def test_declared_tool_waits_pause_with_the_turn_and_still_hit_the_cache(
    server: Any,
) -> None:
    """``then_tool``: the engine pauses the branch as each turn finishes (the reply carries the
    decision), the tool wait makes no control call, the next turn resumes and hits."""
    async with new_traj(server, 7) as traj:
        tool = f"run_tests_{uuid.uuid4().hex[:6]}"
        results = [await traj.complete("The test fails.", then_tool=tool, then_expected_s=1.0)]
        for turn in (2, 3):
            state = (await traj.server_state() or {})["branches"]["main"]
            assert state["tool"] == tool and state["state"] != "active", state
            async with traj.tool(tool) as call:
                await asyncio.sleep(0.5)
                call.observe(f"run {turn}: 1 failed")
            assert call.declared and call.resume_response is None
            assert call.decision is not None and call.decision["action"], call.pause_response
            last = turn == 3
            results.append(await traj.complete(f"Turn {turn}.", then_tool=None if last else tool))
    for prev, r in itertools.pairwise(results):
        assert hits_previous_context(r, prev), (prev, r)


async def test_changed_stable_zone_is_reported(server: Any) -> None:
    async with new_traj(server, 2) as traj:
        await traj.complete("First question.")
        traj.set_system(system_prompt(2) + " Current time: 2025-05-01T10:00:00Z")
        with pytest.warns(StableZoneChangedWarning, match="system"):
            r = await traj.complete("Second question.")
    assert [c.zone for c in r.zone_changes] == ["system"]
    assert "2025-05-01T10:00:00Z" in r.zone_changes[0].diff
    assert r.client_divergence_message == 0 and r.client_divergence_zone == "system"
    assert any(f.kind == "iso_timestamp" for f in r.lint)


async def test_tool_that_raises_still_resumes(server: Any) -> None:
    async with new_traj(server, 3) as traj:
        r1 = await traj.complete("Run the flaky tool.")
        wait = traj.tool("flaky_tool", expected_s=5)
        with pytest.raises(RuntimeError, match="tool crashed"):
            async with wait:
                await asyncio.sleep(0.3)
                raise RuntimeError("tool crashed")
        assert wait.pause_response is not None and wait.resume_response is not None
        assert (
            wait.resume_response["observed_wait_s"] is not None
            and wait.resume_response["observed_wait_s"] >= 0.2
        )
        state = await traj.server_state()
        assert state is not None and "main" in state["branches"]  # still known, not ended
        traj.observe("[flaky_tool] crashed")
        r = await traj.complete("What now?")
        assert hits_previous_context(r, r1), (r1, r)


async def test_fork_branches_share_the_prefix(server: Any) -> None:
    async with new_traj(server, 4) as traj:
        r1 = await traj.complete("Plan the fix.")
        a, b = traj.fork(2)
        ra, rb = await asyncio.gather(a.complete("Option A."), b.complete("Option B."))
        assert ra.branch == "main.1" and rb.branch == "main.2"
        assert hits_previous_context(ra, r1) and hits_previous_context(rb, r1), (r1, ra, rb)
        state = await traj.server_state()
        assert state is not None and {"main.1", "main.2"} <= set(state["branches"])
        b.prune()
        traj.join(a)
        r = await traj.complete("Go with A.")
        assert r.turn == 3 and hits_previous_context(r, ra), (ra, r)


async def test_close_leaves_nothing_held(server: Any) -> None:
    server.clean()  # the only trajectory from here on is this one: bytes_held is all its own
    traj = new_traj(server, 5)
    await traj.complete("Hello.")
    async with raw_client(server) as client:

        async def until(probe: Any, what: str, timeout: float = 15) -> Any:
            deadline = time.monotonic() + timeout
            while not (got := await probe()):
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.1)
            return got

        async def offloaded() -> dict[str, Any] | None:
            status = (await client.get("/agentkv/v1/status")).json()
            return status if status["bytes_held"]["host"] > 0 else None

        async with traj.tool("run_suite", expected_s=2):  # offload_host
            held = await until(offloaded, "the tool wait's offload to reach the host tier")
        assert held["trajectory_ids"] == [traj.trajectory_id]
        released = await traj.close()
        assert released is not None and released["trajectory_id"] == traj.trajectory_id
        r = await client.get(f"/agentkv/v1/trajectories/{traj.trajectory_id}")
        assert r.status_code == 404

        async def nothing_held() -> dict[str, Any] | None:
            status = (await client.get("/agentkv/v1/status")).json()
            return status if not any(status["bytes_held"].values()) else None

        status = await until(nothing_held, "close to release every tier")
        assert status["bytes_held"] == {"device_pinned": 0, "host": 0, "disk": 0}
        assert status["trajectories"] == 0 and traj.trajectory_id not in status["trajectory_ids"]


async def test_wrong_api_key_raises(server: Any) -> None:
    if not server.api_key:
        pytest.skip("server runs without an API key")
    async with Trajectory(
        server.base_url, server.model, api_key="wrong-key", system="s", max_tokens=4
    ) as traj:
        with pytest.raises(AuthenticationError):
            await traj.complete("hi")


async def test_a_salted_trajectory_is_paused_and_deleted(server: Any) -> None:
    """Issue 40 item 6: the SDK's pause, resume, GET and DELETE went without the tenant, got 404
    and swallowed it: a salted trajectory was never paused or deleted. ``cache_salt`` (one
    option) now rides on every call."""
    salt = f"sdk-tenant-{uuid.uuid4().hex[:8]}"
    traj = new_traj(server, 6, cache_salt=salt)
    tid = traj.trajectory_id
    await traj.complete("Hello.")
    async with raw_client(server) as client:
        path = f"/agentkv/v1/trajectories/{tid}"
        assert (await client.get(path)).status_code == 404  # not in the unsalted namespace
        tool = f"salted_suite_{uuid.uuid4().hex[:6]}"
        async with traj.tool(tool, expected_s=2) as call:
            assert call.pause_response is not None and call.decision is not None
            deadline = time.monotonic() + 15
            while True:  # the pause reached the salted trajectory on the server
                state = await traj.server_state()
                assert state is not None  # the SDK's GET names the tenant too
                if state["branches"]["main"].get("tool") == tool:
                    break
                assert time.monotonic() < deadline, state
                await asyncio.sleep(0.1)
        assert call.resume_response is not None and call.resume_response["trajectory_id"] == tid
        released = await traj.close()
        assert released is not None and released["trajectory_id"] == tid
        r = await client.get(path, headers={"X-AgentKV-Cache-Salt": salt})
        assert r.status_code == 404  # deleted in its own namespace
