"""mini-swe-agent (through litellm) and smolagents as their users write them, with their own
released packages (the ``frameworks`` extra), against the shared server: the same two
concurrent runs as ``test_frameworks_e2e.py`` (one named by ``x-session-id``, the other by
``prompt_cache_key``), each a 2-turn tool loop whose tool flushes vLLM's prefix cache once its
branch is in agentkv's tier, so the second turn loads from the tier.

Both frameworks build one client per model object and take the per-call options on the model,
so the per-run line is "one model per run" (not a shared one). Both finish a run with a tool
call of their own (mini-swe-agent's submit command, smolagents' ``final_answer``), so the
second turn pauses too, on that tool, and is never resumed (``last_tool``).

The five framework examples (examples/frameworks/) run here too, against the same server.
"""

# No ``from __future__ import annotations``: smolagents reads the tools' type hints.
import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.e2e.conftest import Server
from tests.e2e.test_frameworks_e2e import MAX_TOKENS, PROMPT, _to_tier, _two_runs, instructions

pytestmark = pytest.mark.e2e


def _named(tool: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool}}


def test_mini_swe_agent_through_litellm(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """mini-swe-agent 2.4.6's ``DefaultAgent`` with its ``LitellmModel``, one model per run:
    every call is ``litellm.completion(model=..., messages=..., tools=[BASH_TOOL],
    **(self.config.model_kwargs | kwargs))`` (minisweagent/models/litellm_model.py:66-71), so
    the run's ``model_kwargs`` carry its id (``extra_headers`` or ``prompt_cache_key``, which
    litellm forwards to an ``openai/`` model).

    Its one tool is ``bash`` (``{"command": string}``), forced by name on every call as
    mini-swe-agent's own loop expects a tool call each step. A random-weight model writes an
    endless command string, so ``logit_bias`` favours the ``"`` token (the string closes at
    once). The environment is mini-swe-agent's ``LocalEnvironment`` with the random command
    not run: the first action answers (after the tier flush), the second prints the submit
    marker, and the environment's own ``_check_finished`` (environments/local.py) ends the run.
    """
    monkeypatch.setenv("MSWEA_SILENT_STARTUP", "1")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no cost map download
    pytest.importorskip("minisweagent")
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    litellm = pytest.importorskip("litellm")
    monkeypatch.setattr(litellm, "suppress_debug_info", True)  # its cost lookup's banner

    r = server.client.post(
        "/tokenize", json={"model": server.model, "prompt": '"', "add_special_tokens": False}
    )
    r.raise_for_status()
    (quote,) = r.json()["tokens"]

    class ScriptedEnvironment(LocalEnvironment):
        def __init__(self, sid: str) -> None:
            super().__init__()
            self.sid, self.commands = sid, 0

        def execute(self, action: dict[str, Any], cwd: str = "", **kw: Any) -> dict[str, Any]:
            self.commands += 1
            if self.commands == 1:
                _to_tier(server, self.sid)  # between the turns: a blocking tool, its own thread
                out = "sunny\n"
            else:
                out = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\nsunny\n"
            output = {"output": out, "returncode": 0, "exception_info": ""}
            self._check_finished(output)  # raises Submitted on the marker
            return output

    def run(sid: str, by_cache_key: bool) -> dict[str, Any]:
        # The one line: per run, in the run's model.
        per_run = (
            {"prompt_cache_key": sid} if by_cache_key else {"extra_headers": {"x-session-id": sid}}
        )
        model = LitellmModel(
            model_name=f"openai/{server.model}",
            cost_tracking="ignore_errors",
            model_kwargs={
                "api_base": server.base_url + "/v1",
                "api_key": server.api_key,
                "max_tokens": MAX_TOKENS,
                "tool_choice": _named("bash"),
                "logit_bias": {str(quote): 100},
                **per_run,
            },
        )
        env = ScriptedEnvironment(sid)
        agent = DefaultAgent(
            model,
            env,
            system_template=instructions(sid),
            instance_template="{{task}}",
            step_limit=4,
        )
        result = agent.run(PROMPT)
        assert result["exit_status"] == "Submitted" and env.commands == 2, agent.messages
        return result

    async def both(sid: str, by_cache_key: bool) -> Any:
        return await asyncio.to_thread(run, sid, by_cache_key)

    asyncio.run(_two_runs(server, "bash", both, last_tool="bash"))


def test_smolagents(server: Server) -> None:
    """smolagents 1.26's ``ToolCallingAgent`` with ``OpenAIServerModel``, one model per run:
    the model's own keyword arguments override every call's (smolagents/models.py:546-550) and
    go to ``self.client.chat.completions.create(**completion_kwargs)`` (models.py:1780), so the
    run's model carries its id (``extra_headers`` or ``prompt_cache_key``).

    The model's ``tool_choice`` forces the weather tool on the first step; a step callback
    (``step_callbacks``, called after each step) forces ``final_answer`` for the second, which
    ends the run. Both tools take an ``enum`` (a ``Literal``), which the random model's forced
    arguments fill in a few tokens."""
    pytest.importorskip("smolagents")
    pytest.importorskip("openai")
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool
    from smolagents.monitoring import LogLevel

    name = f"get_weather_{os.urandom(4).hex()}"

    @tool
    def final_answer(answer: Literal["sunny"]) -> str:
        """Gives the final answer.

        Args:
            answer: The weather.
        """
        return answer

    def run(sid: str, by_cache_key: bool) -> Any:
        # The one line: per run, in the run's model.
        per_run: dict[str, Any] = (
            {"prompt_cache_key": sid} if by_cache_key else {"extra_headers": {"x-session-id": sid}}
        )
        model = OpenAIServerModel(
            server.model,
            api_base=server.base_url + "/v1",
            api_key=server.api_key,
            client_kwargs={"max_retries": 0},
            max_tokens=MAX_TOKENS,
            tool_choice=_named(name),
            **per_run,
        )

        @tool
        def get_weather(city: Literal["paris"]) -> str:
            """The weather of a city.

            Args:
                city: The city.
            """
            _to_tier(server, sid)  # between the turns: smolagents runs tools in its thread
            return "sunny"

        get_weather.name = name

        def after_step(step: Any, agent: Any) -> None:
            model.kwargs["tool_choice"] = _named("final_answer")

        agent = ToolCallingAgent(
            tools=[get_weather, final_answer],
            model=model,
            instructions=instructions(sid),
            max_steps=2,
            step_callbacks=[after_step],
            verbosity_level=LogLevel.OFF,
        )
        assert agent.run(PROMPT) == "sunny"
        calls = [c.name for s in agent.memory.steps for c in getattr(s, "tool_calls", None) or []]
        assert calls == [name, "final_answer"], calls
        return agent

    async def both(sid: str, by_cache_key: bool) -> Any:
        return await asyncio.to_thread(run, sid, by_cache_key)

    asyncio.run(_two_runs(server, name, both, last_tool="final_answer"))


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "frameworks"


@pytest.mark.parametrize(
    ("example", "tool"),
    [
        ("openai_agents_agent.py", "get_weather"),
        ("langgraph_agent.py", "get_weather"),
        ("pydantic_ai_agent.py", "get_weather"),
        ("mini_swe_agent.py", "bash"),
        ("smolagents_agent.py", "final_answer"),
    ],
)
def test_the_framework_examples_run(server: Server, example: str, tool: str) -> None:
    """Each example in examples/frameworks/ (docs/frameworks.md) runs against the server as a
    user runs it: its run is one trajectory of several turns, paused on its tool, and the
    example prints what the server made of it."""
    sid = f"fw-example-{os.urandom(4).hex()}"
    args = ["--base-url", server.base_url + "/v1", "--model", server.model, "--session-id", sid]
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / example), *args, "--api-key", str(server.api_key)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    traj = server.trajectory(sid)
    turns = [t["turn"] for t in traj["turns"]]
    assert len(turns) >= 2 and turns == list(range(1, len(turns) + 1)), traj["turns"]
    assert traj["branches"]["main"]["tool"] == tool, traj["branches"]["main"]
    assert f"turn {len(turns)}: prompt" in done.stdout and f"last paused on {tool}" in done.stdout
    server.end(sid)
