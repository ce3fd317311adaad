"""LangGraph with LangChain's ChatOpenAI on agentkv: the thread id names the run's trajectory.

The one line binds the session id in the model node, per run (a header on the shared
``ChatOpenAI`` would merge concurrent threads). See docs/frameworks.md. Start the server
(common.SERVE), then

    python examples/frameworks/langgraph_agent.py --base-url http://127.0.0.1:8000/v1
"""

from typing import Any, Literal

from common import MAX_TOKENS, QUESTION, parse_args, show


def main() -> None:
    args = parse_args(__doc__)
    from langchain_core.messages import ToolMessage
    from langchain_core.runnables import RunnableConfig
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition
    from pydantic import SecretStr

    @tool
    def get_weather(city: Literal["paris"]) -> str:
        """The weather of a city."""
        return "sunny"

    llm = ChatOpenAI(
        model=args.model,
        base_url=args.base_url,
        api_key=SecretStr(args.api_key),
        max_completion_tokens=MAX_TOKENS,
    )
    # forced on the first step (a random-weight model), free after the tool's answer
    first, later = (
        llm.bind_tools([get_weather], tool_choice="get_weather"),
        llm.bind_tools([get_weather]),
    )

    def agent(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        model = later if isinstance(state["messages"][-1], ToolMessage) else first
        # The one line: the run's thread id is its session id.
        model = model.bind(extra_headers={"x-session-id": config["configurable"]["thread_id"]})
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([get_weather]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    config: Any = {"configurable": {"thread_id": args.session_id}}
    inputs: Any = {"messages": [("user", QUESTION)]}
    out = graph.compile().invoke(inputs, config)
    print("answer:", out["messages"][-1].content)
    show(args)


if __name__ == "__main__":
    main()
