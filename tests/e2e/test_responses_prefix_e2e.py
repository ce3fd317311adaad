"""A Responses run that resends its whole input (no ``previous_response_id``, no session id, no
``prompt_cache_key``: the OpenAI Agents SDK's default) is one trajectory, against the real
server (the shared ``server`` fixture stores responses), through the real ``openai`` client and
the real Agents SDK ``Runner`` with default settings (issue 42).

Before the conversation-prefix match every such request started a trajectory of its own,
paused once on its tool call and never resumed.

The embedded model has random weights: a step that must call the tool forces it by name; the
shared server runs xgrammar without free whitespace, so the forced arguments (an ``enum``)
parse. The Agents SDK fails a run whose reply is cut, so its agent has a structured output
(an ``enum`` again), which ends by itself.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Literal

import pytest

from agentkv.ids import TENANT_HEADER
from tests.e2e.conftest import Server, long_text, wait_until

pytestmark = pytest.mark.e2e

openai = pytest.importorskip("openai")

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["paris"]}},
    "required": ["city"],
}
MAX_TOKENS = 24


def _uid() -> str:
    return uuid.uuid4().hex[:8]


def _hooks(server: Server) -> dict[str, int]:
    return dict(server.status()["hooks"]["counters"])


def _delta(before: dict[str, int], after: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def _agentkv(obj: Any) -> dict[str, Any]:
    extra = obj.model_extra or {}
    return dict((extra.get("kv_transfer_params") or {}).get("agentkv") or {})


def _replayed(response: Any) -> list[dict[str, Any]]:
    """A response's output as the Agents SDK resends it (``to_input_item``)."""
    return [item.model_dump(exclude_unset=True) for item in response.output]


def _observed_waits(server: Server, tool: str) -> int:
    return int(server.status()["predictor"].get(tool) or 0)


def test_the_agents_sdk_default_run_is_one_trajectory_per_run(server: Server) -> None:
    """Two concurrent runs of one agent on one client, no per-run line at all: each is one
    trajectory (turns 1, 2), auto-paused on its tool call and resumed by its next request; the
    runs' histories differ after their first output, so they never merge."""
    pytest.importorskip("agents")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from pydantic import BaseModel

    set_tracing_disabled(True)  # no trace export to api.openai.com
    tool = f"prefix_weather_{_uid()}"

    class Answer(BaseModel):
        weather: Literal["sunny"]

    @function_tool(name_override=tool)
    def get_weather(city: Literal["paris"]) -> str:
        """The weather of a city."""
        return "sunny"

    client = openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0
    )
    agent = Agent(
        name="weather",
        instructions="You answer weather questions with the tool.",
        model=OpenAIResponsesModel(server.model, client),
        tools=[get_weather],
        output_type=Answer,
        # forced on the first step; the SDK resets it after a tool call (reset_tool_choice)
        model_settings=ModelSettings(tool_choice=tool, max_tokens=MAX_TOKENS),
    )

    async def both() -> list[Any]:
        prompt = "What is the weather in Paris? Answer after looking it up."
        return list(await asyncio.gather(Runner.run(agent, prompt), Runner.run(agent, prompt)))

    before = _hooks(server)
    results = asyncio.run(both())
    after = _hooks(server)
    for result in results:
        assert result.final_output == Answer(weather="sunny")
        assert len(result.raw_responses) == 2  # the tool call, then the answer
        tid = str(result.raw_responses[0].response_id)  # a new run's chain is named after it
        traj = server.trajectory(tid)
        assert [t["turn"] for t in traj["turns"]] == [1, 2], (tid, traj["turns"])
        assert traj["branches"]["main"]["tool"] == tool
    assert _delta(before, after, "identified.responses_chain") == 2, after
    assert _delta(before, after, "identified.responses_prefix") == 2, after
    assert _delta(before, after, "auto_pauses") == 2, after
    # Each run's pause was resumed by its next request: the engine observed one wait per run.
    wait_until(lambda: _observed_waits(server, tool) == 2, f"two waits of {tool}")
    for result in results:
        server.end(result.raw_responses[0].response_id)


def test_a_resent_history_continues_its_trajectory_until_it_is_deleted(server: Server) -> None:
    """Three turns through the plain client, the full input resent each time (the second
    streamed): one trajectory, turns 1-3, and the reply says the prefix named it. Another
    tenant resending the same history, or any request after a DELETE, starts afresh."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0)
    tool = f"prefix_tool_{_uid()}"
    tools = [{"type": "function", "name": tool, "description": "Weather", "parameters": SCHEMA}]
    forced = {"type": "function", "name": tool}
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather? " + long_text(29101, 120)}
    ]

    def create(**kw: Any) -> tuple[Any, str | None]:
        raw = client.responses.with_raw_response.create(
            model=server.model, input=history, tools=tools, max_output_tokens=32, **kw
        )
        return raw.parse(), raw.headers.get("x-agentkv-identified-by")

    r1, by1 = create(tool_choice=forced)
    tid = r1.id
    assert by1 == "responses_chain" and _agentkv(r1)["trajectory_id"] == tid
    call = next(o for o in r1.output if o.type == "function_call")
    history += [*_replayed(r1), {"type": "function_call_output", "call_id": call.call_id,
                                 "output": "sunny"}]  # fmt: skip
    with client.responses.with_streaming_response.create(
        model=server.model,
        input=history,
        tools=tools,
        tool_choice=forced,
        max_output_tokens=32,
        stream=True,
    ) as streamed:
        by2 = streamed.headers.get("x-agentkv-identified-by")
        events = list(streamed.parse())
    r2 = next(e.response for e in events if e.type == "response.completed")
    assert by2 == "responses_prefix"
    assert server.trajectory(tid)["branches"]["main"]["tool"] == tool
    call = next(o for o in r2.output if o.type == "function_call")
    history += [*_replayed(r2), {"type": "function_call_output", "call_id": call.call_id,
                                 "output": "still sunny"}]  # fmt: skip
    r3, by3 = create()
    stats = _agentkv(r3)
    assert by3 == "responses_prefix", by3
    assert stats["trajectory_id"] == tid and stats["turn"] == 3, stats
    assert stats["identified_by"] == "responses_prefix"
    traj = server.trajectory(tid)
    assert [t["turn"] for t in traj["turns"]] == [1, 2, 3], traj["turns"]
    wait_until(lambda: _observed_waits(server, tool) == 2, f"two waits of {tool}")

    # Another tenant resending this history never continues it.
    history += [*_replayed(r3), {"role": "user", "content": "thanks"}]
    salt = f"tenant-{_uid()}"
    other, by_other = create(extra_body={"cache_salt": salt})
    assert by_other == "responses_chain" and _agentkv(other)["trajectory_id"] == other.id
    # A DELETEd trajectory is not continued: the next request starts a new one.
    server.end(tid)
    fresh, by_fresh = create()
    stats = _agentkv(fresh)
    assert by_fresh == "responses_chain", by_fresh
    assert stats["trajectory_id"] == fresh.id != tid and stats["turn"] == 1, stats
    server.end(fresh.id)
    server.client.delete(f"/agentkv/v1/trajectories/{other.id}", headers={TENANT_HEADER: salt})
