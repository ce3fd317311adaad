"""smolagents on agentkv: one model per run carries its session id.

``OpenAIServerModel``'s keyword arguments go into every call it makes, so the one line is the
run's model (a model shared by concurrent runs would merge them). See docs/frameworks.md. Start
the server (common.SERVE), then

    python examples/frameworks/smolagents_agent.py --base-url http://127.0.0.1:8000/v1
"""

from typing import Any, Literal

from common import MAX_TOKENS, QUESTION, parse_args, show


def named(tool: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool}}


def main() -> None:
    args = parse_args(__doc__)
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool
    from smolagents.monitoring import LogLevel

    @tool
    def get_weather(city: Literal["paris"]) -> str:
        """The weather of a city.

        Args:
            city: The city.
        """
        return "sunny"

    @tool
    def final_answer(answer: Literal["sunny"]) -> str:
        """Gives the final answer.

        Args:
            answer: The weather.
        """
        return answer

    model = OpenAIServerModel(
        args.model,
        api_base=args.base_url,
        api_key=args.api_key,
        max_tokens=MAX_TOKENS,
        tool_choice=named("get_weather"),  # a random-weight model: each step's tool is forced
        # The one line: this run's session id.
        extra_headers={"x-session-id": args.session_id},
    )

    def then_answer(step: Any, agent: Any) -> None:
        model.kwargs["tool_choice"] = named("final_answer")

    agent = ToolCallingAgent(
        tools=[get_weather, final_answer],
        model=model,
        max_steps=2,
        step_callbacks=[then_answer],
        verbosity_level=LogLevel.OFF,
    )
    print("answer:", agent.run(QUESTION))
    show(args)


if __name__ == "__main__":
    main()
