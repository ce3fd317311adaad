"""OpenAI Agents SDK on agentkv: one agent, one shared client, a session id per run.

The one line is the run's ``RunConfig``: a header on the shared client would merge every
concurrent run into one trajectory. See docs/frameworks.md. Start the server (common.SERVE), then

    python examples/frameworks/openai_agents_agent.py --base-url http://127.0.0.1:8000/v1
"""

from typing import Literal

from common import MAX_TOKENS, QUESTION, parse_args, show


def main() -> None:
    args = parse_args(__doc__)
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace export to api.openai.com

    @function_tool
    def get_weather(city: Literal["paris"]) -> str:
        """The weather of a city."""
        return "sunny"

    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key)  # shared by all runs
    agent = Agent(
        name="weather",
        instructions="You answer weather questions with the tool.",
        model=OpenAIChatCompletionsModel(args.model, client),
        tools=[get_weather],
        # forced on the first step (a random-weight model); the SDK resets it after the call
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=MAX_TOKENS),
    )
    # The one line: this run's session id.
    per_run = ModelSettings(extra_headers={"x-session-id": args.session_id})
    result = Runner.run_sync(agent, QUESTION, run_config=RunConfig(model_settings=per_run))
    print("answer:", result.final_output)
    show(args)


if __name__ == "__main__":
    main()
