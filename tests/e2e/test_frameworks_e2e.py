"""Agent frameworks as their users write them, with their own released packages (the
``frameworks`` extra), against the real server (the shared ``server`` fixture): the OpenAI Agents
SDK (Responses), LangGraph with LangChain's ``ChatOpenAI`` (chat) and pydantic-ai (chat);
mini-swe-agent and smolagents are in ``test_frameworks2_e2e.py``, on the helpers here.

Each test runs one agent -- one framework client, one agent object -- twice at once, a 2-turn
tool loop per run (the model calls the tool, the tool answers at once, the model replies), with
the one documented line that gives each *run* its session id: one run through the
``x-session-id`` header knob, the other through ``prompt_cache_key`` (issue 42). The server
must see two trajectories, each with exactly turns 1 and 2 (not merged), auto-paused on its tool
call with the right tool, and resumed by its next request (the engine observed the wait).

After a cache flush the next turn is served from agentkv's tier: the tool itself (it runs
between the two turns) waits until its run's paused branch is ``offloaded`` (the shared server
writes back eagerly) and flushes vLLM's prefix cache (``POST /reset_prefix_cache``), so the
second turn's prefix can only come from agentkv's tier (``tier_hit_tokens > 0``). The agents'
instructions are long enough (``instructions``) for whole blocks of a shared prefix.

The embedded model has random weights: the first step forces the tool by name (each
framework's own way), and the shared server runs xgrammar without free whitespace, so the
forced arguments (an ``enum``) parse. Replies are cut at a few tokens; the Agents SDK fails a
Responses run whose reply is cut (``response.incomplete``), so its agent has a structured
output (an ``enum`` again), which ends by itself.
"""

# No ``from __future__ import annotations``: the frameworks read the tools' type hints, which
# name classes imported inside the tests (a run context's type, LangChain's RunnableConfig).
import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import pytest

from tests.e2e.conftest import Server, long_text, wait_until

pytestmark = pytest.mark.e2e

openai = pytest.importorskip("openai")

# Enough for the forced arguments ({"city":"paris"}: a cut one is no tool call), few enough
# that the random text of the last turn ends soon.
MAX_TOKENS = 24
PROMPT = "What is the weather in Paris? Answer after looking it up."
# A few hundred tokens: whole 128-token blocks of the prefix the two turns share.
INSTRUCTIONS = "You answer weather questions with the tool. " + long_text(4200, 60)


def instructions(sid: str) -> str:
    """A run's instructions, its id first: two runs share no block of the prefix (with the same
    first block, the other run's turn would bring the flushed blocks back to the device)."""
    return f"Run {sid}. {INSTRUCTIONS}"


def _uid() -> str:
    return uuid.uuid4().hex[:8]


def _client(server: Server) -> Any:
    """One client for every run, as frameworks share theirs."""
    return openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0
    )


def _to_tier(server: Server, sid: str) -> None:
    """Called by a tool, between a run's two turns (blocking: from a thread in async code):
    once the run's paused branch has its copy in agentkv's tier, flush vLLM's prefix cache,
    so the next turn can only get its prefix from the tier."""
    server.wait_state(sid, {"offloaded"}, timeout=60)
    server.reset_prefix_cache()


def _hooks(server: Server) -> dict[str, int]:
    return dict(server.status()["hooks"]["counters"])


def _delta(before: dict[str, int], after: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


async def _two_runs(
    server: Server,
    tool: str,
    run: Callable[[str, bool], Awaitable[Any]],
    *,
    last_tool: str | None = None,
) -> tuple[str, str]:
    """Two concurrent runs of one agent, ``run(session_id, by_cache_key)``; checks each became
    its own trajectory, paused on ``tool`` and resumed, its second turn served from the tier
    (the tool called ``_to_tier``). ``last_tool``: the tool the second turn calls too (how
    mini-swe-agent and smolagents end a run), paused on and never resumed."""
    by_header, by_key = f"fw-{_uid()}-header", f"fw-{_uid()}-key"
    before = _hooks(server)
    observed = server.status()["predictor"].get(tool, 0)
    await asyncio.gather(run(by_header, False), run(by_key, True))
    after = _hooks(server)
    for tid in (by_header, by_key):
        traj = server.trajectory(tid)
        turns = traj["turns"]
        assert [t["turn"] for t in turns] == [1, 2], (tid, turns)
        # The flush between the turns left the prefix in agentkv's tier only.
        assert turns[1]["tier_hit_tokens"] > 0 and turns[1]["tier"] is not None, turns
        branch = traj["branches"]["main"]
        assert branch["tool"] == (last_tool or tool) and branch["decision"] is not None, branch
    # Each run auto-paused on its tool call and was resumed by its next request: the engine
    # observed one wait of ``tool`` per run.
    assert _delta(before, after, "auto_pauses") == (2 if last_tool is None else 4), after
    wait_until(
        lambda: server.status()["predictor"].get(tool, 0) - observed == 2, f"two waits of {tool}"
    )
    # Which knob named which run (two requests each).
    assert _delta(before, after, "identified.x-session-id") == 2, after
    assert _delta(before, after, "identified.prompt_cache_key") == 2, after
    for tid in (by_header, by_key):
        server.end(tid)
    return by_header, by_key


def test_openai_agents_sdk(server: Server) -> None:
    pytest.importorskip("agents")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        RunConfig,
        RunContextWrapper,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from pydantic import BaseModel

    set_tracing_disabled(True)  # no trace export to api.openai.com
    tool = f"get_weather_{_uid()}"

    class Answer(BaseModel):
        weather: Literal["sunny"]

    @function_tool(name_override=tool)
    async def get_weather(ctx: RunContextWrapper[str], city: Literal["paris"]) -> str:
        """The weather of a city."""
        await asyncio.to_thread(_to_tier, server, ctx.context)  # the run's context: its id
        return "sunny"

    agent = Agent[str](
        name="weather",
        instructions=lambda ctx, agent: instructions(ctx.context),
        model=OpenAIResponsesModel(server.model, _client(server)),
        tools=[get_weather],
        output_type=Answer,
        # forced on the first step; the SDK resets it after a tool call (reset_tool_choice)
        model_settings=ModelSettings(tool_choice=tool, max_tokens=MAX_TOKENS),
    )

    async def run(sid: str, by_cache_key: bool) -> Any:
        # The one line: per run, not per client.
        per_run = (
            ModelSettings(extra_args={"prompt_cache_key": sid})
            if by_cache_key
            else ModelSettings(extra_headers={"x-session-id": sid})
        )
        result = await Runner.run(
            agent, PROMPT, context=sid, run_config=RunConfig(model_settings=per_run)
        )
        calls = [i for i in result.new_items if i.type == "tool_call_item"]
        assert [getattr(c.raw_item, "name", None) for c in calls] == [tool]
        assert result.final_output == Answer(weather="sunny")
        return result

    asyncio.run(_two_runs(server, tool, run))


def test_langgraph_with_langchain_chat_openai(server: Server) -> None:
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import ToolMessage
    from langchain_core.runnables import RunnableConfig
    from langchain_core.tools import tool as lc_tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition
    from pydantic import SecretStr

    tool = f"get_weather_{_uid()}"

    @lc_tool(tool)
    async def get_weather(city: Literal["paris"], config: RunnableConfig) -> str:
        """The weather of a city."""
        await asyncio.to_thread(_to_tier, server, config["configurable"]["thread_id"])
        return "sunny"

    llm = ChatOpenAI(
        model=server.model,
        base_url=server.base_url + "/v1",
        api_key=SecretStr(str(server.api_key)),
        max_completion_tokens=MAX_TOKENS,
        max_retries=0,
    )
    first, later = llm.bind_tools([get_weather], tool_choice=tool), llm.bind_tools([get_weather])

    async def agent(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        model = later if isinstance(state["messages"][-1], ToolMessage) else first
        thread = config["configurable"]["thread_id"]
        # The one line: the run's LangGraph thread id names its trajectory.
        if config["configurable"].get("by_cache_key"):
            model = model.bind(prompt_cache_key=thread)
        else:
            model = model.bind(extra_headers={"x-session-id": thread})
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([get_weather]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    app = graph.compile()

    async def run(sid: str, by_cache_key: bool) -> Any:
        config: Any = {"configurable": {"thread_id": sid, "by_cache_key": by_cache_key}}
        inputs: Any = {"messages": [("system", instructions(sid)), ("user", PROMPT)]}
        out = await app.ainvoke(inputs, config)
        assert [type(m).__name__ for m in out["messages"]] == [
            "SystemMessage",
            "HumanMessage",
            "AIMessage",
            "ToolMessage",
            "AIMessage",
        ]
        return out

    asyncio.run(_two_runs(server, tool, run))


def test_pydantic_ai(server: Server) -> None:
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    tool = f"get_weather_{_uid()}"
    model = OpenAIChatModel(server.model, provider=OpenAIProvider(openai_client=_client(server)))

    def per_step(ctx: RunContext[str]) -> Any:
        # pydantic-ai's way to force a tool on the first step only
        return {"max_tokens": MAX_TOKENS, "tool_choice": [tool] if ctx.run_step <= 1 else "none"}

    agent = Agent(model, deps_type=str, model_settings=per_step)

    @agent.instructions
    def run_instructions(ctx: RunContext[str]) -> str:
        return instructions(ctx.deps)

    @agent.tool(name=tool)
    async def get_weather(ctx: RunContext[str], city: Literal["paris"]) -> str:
        """The weather of a city."""
        await asyncio.to_thread(_to_tier, server, ctx.deps)  # the run's deps: its id
        return "sunny"

    @agent.tool_plain
    def get_time(city: Literal["paris"]) -> str:
        """The local time of a city."""
        return "noon"

    async def run(sid: str, by_cache_key: bool) -> Any:
        # The one line: per run, not per agent or client.
        settings: Any = (
            {"openai_prompt_cache_key": sid}
            if by_cache_key
            else {"extra_headers": {"x-session-id": sid}}
        )
        result = await agent.run(PROMPT, deps=sid, model_settings=settings)
        names = [
            p.tool_name
            for m in result.all_messages()
            for p in m.parts
            if isinstance(p, ToolCallPart)
        ]
        assert names == [tool]
        return result

    asyncio.run(_two_runs(server, tool, run))


def _forced_chat(server: Server, tool: str, **body: Any) -> dict[str, Any]:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["paris"]}},
        "required": ["city"],
    }
    return {
        "model": server.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "tools": [{"type": "function", "function": {"name": tool, "parameters": schema}}],
        "tool_choice": {"type": "function", "function": {"name": tool}},
        **body,
    }


def test_prompt_cache_key_names_the_trajectory_and_the_reply_says_so(server: Server) -> None:
    """Issue 42: OpenAI's ``prompt_cache_key`` is a session hint (below ``x-session-id``), an
    unknown ``prompt_cache_retention`` is ignored without making the request vanilla, and the
    reply names the hint that named its trajectory."""
    key, tool = f"pck-{_uid()}", f"lookup_{_uid()}"
    r = server.client.post(
        "/v1/chat/completions",
        json=_forced_chat(server, tool, prompt_cache_key=key, prompt_cache_retention="24h"),
    )
    r.raise_for_status()
    stats = r.json()["kv_transfer_params"]["agentkv"]
    assert stats["trajectory_id"] == key and stats["identified_by"] == "prompt_cache_key", stats
    assert r.headers["x-agentkv-identified-by"] == "prompt_cache_key"
    assert server.trajectory(key)["branches"]["main"]["tool"] == tool  # auto-paused
    # An unknown retention value: ignored, the request keeps its trajectory (no error).
    r = server.client.post(
        "/v1/chat/completions",
        json=_forced_chat(server, tool, prompt_cache_key=key, prompt_cache_retention="forever"),
    )
    r.raise_for_status()
    stats = r.json()["kv_transfer_params"]["agentkv"]
    assert "error" not in stats and stats["turn"] == 2, stats
    assert "x-agentkv-error" not in r.headers
    # x-session-id outranks the cache key (a key may be shared by several conversations).
    sid = f"sid-{_uid()}"
    r = server.client.post(
        "/v1/chat/completions",
        json=_forced_chat(server, tool, prompt_cache_key=key),
        headers={"x-session-id": sid},
    )
    stats = r.json()["kv_transfer_params"]["agentkv"]
    assert (stats["trajectory_id"], stats["identified_by"]) == (sid, "x-session-id"), stats
    # A Responses run that resends its input without previous_response_id (the Agents SDK's
    # default) stays one trajectory under its key, where the chain would start one per request.
    rkey = f"pck-resp-{_uid()}"
    for _ in range(2):
        r = server.client.post(
            "/v1/responses",
            json={
                "model": server.model,
                "input": PROMPT,
                "max_output_tokens": 4,
                "prompt_cache_key": rkey,
            },
        )
        r.raise_for_status()
        assert r.headers["x-agentkv-identified-by"] == "prompt_cache_key"
    assert [t["turn"] for t in server.trajectory(rkey)["turns"]] == [1, 2]
    for tid in (key, sid, rkey):
        server.end(tid)
