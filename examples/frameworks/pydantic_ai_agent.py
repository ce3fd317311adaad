"""pydantic-ai on agentkv: one agent, a session id per ``agent.run``.

The one line is the run's ``model_settings`` (settings on the agent or its client would merge
concurrent runs). See docs/frameworks.md. Start the server (common.SERVE), then

    python examples/frameworks/pydantic_ai_agent.py --base-url http://127.0.0.1:8000/v1
"""

from typing import Any, Literal

from common import MAX_TOKENS, QUESTION, parse_args, show


def main() -> None:
    args = parse_args(__doc__)
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=args.base_url, api_key=args.api_key)

    def per_step(ctx: RunContext[None]) -> Any:
        # forced on the first step (a random-weight model), none after the tool's answer
        return {
            "max_tokens": MAX_TOKENS,
            "tool_choice": ["get_weather"] if ctx.run_step <= 1 else "none",
        }

    agent = Agent(
        OpenAIChatModel(args.model, provider=provider),
        instructions="You answer weather questions with the tool.",
        model_settings=per_step,
    )

    @agent.tool_plain
    def get_weather(city: Literal["paris"]) -> str:
        """The weather of a city."""
        return "sunny"

    @agent.tool_plain  # a second tool: naming all tools would be "required", not one forced
    def get_time(city: Literal["paris"]) -> str:
        """The local time of a city."""
        return "noon"

    # The one line: this run's session id.
    settings: Any = {"extra_headers": {"x-session-id": args.session_id}}
    result = agent.run_sync(QUESTION, model_settings=settings)
    print("answer:", result.output)
    show(args)


if __name__ == "__main__":
    main()
