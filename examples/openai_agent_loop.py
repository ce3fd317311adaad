"""A plain tool loop on the official ``openai`` client, wrapped for agentkv in one line.

The loop is what any agent framework does: send the conversation with the tool list, run the
tool calls the model asks for, append their results, repeat. ``harness_sdk.openai.wrap`` makes
the client carry the trajectory id (``x-session-id`` and ``kv_transfer_params``) on every call;
``client.tool(...)`` tells the engine how long the tool is expected to take (pause), measures it
and resumes. Without ``client.tool`` the server still pauses by itself on each reply with tool
calls (auto-pause) and learns the wait per tool; with it, the harness's own estimate is used.

The served model may have random weights (``agentkv serve`` with no MODEL), so each turn forces
a tool call with a named ``tool_choice`` (vLLM then constrains the output to that call) and the
tools are scripted. Against a real model drop ``tool_choice`` and start vLLM with
``--enable-auto-tool-choice --tool-call-parser PARSER``.

    agentkv serve --port 8000 --kv-space-gib 1 -- --enable-auto-tool-choice --tool-call-parser pythonic &
    python examples/openai_agent_loop.py --base-url http://127.0.0.1:8000/v1 [--api-key KEY]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from agent_loop_common import SYSTEM, TASK, main, print_turn

try:
    from openai import OpenAI, OpenAIError
except ImportError:  # pragma: no cover - the example needs the client
    sys.exit("this example needs the openai package: pip install 'vllm-agentkv[openai]'")

from harness_sdk.openai import wrap


def _tool(name: str, description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
        },
    }


TOOLS = [
    _tool("read_file", "Read a file"),
    _tool("run_tests", "Run pytest"),
    _tool("apply_patch", "Apply a diff"),
]


def _fake(seconds: float, output: str) -> Callable[[], str]:
    def run() -> str:
        time.sleep(seconds)
        return output

    return run


# (tool the model is made to call, expected wait declared to the engine, the scripted tool)
SCRIPT: list[tuple[str, float, Callable[[], str]]] = [
    ("read_file", 0.2, _fake(0.2, "parser.py: def parse(s): return s.split(',')")),
    ("run_tests", 2.0, _fake(2.0, "FAILED tests/test_parser.py::test_empty - [''] != []")),
    ("apply_patch", 0.5, _fake(0.5, "patched parser.py: if not s: return []")),
    ("run_tests", 2.0, _fake(1.8, "12 passed in 1.79s")),
]


def report(turn: int, r: Any) -> None:
    details = getattr(r.usage, "prompt_tokens_details", None)
    cached = (getattr(details, "cached_tokens", None) or 0) if details else 0
    print_turn(turn, r.usage.prompt_tokens, r, cached)


def run(args: argparse.Namespace) -> None:
    raw = OpenAI(base_url=args.base_url, api_key=args.api_key or "EMPTY")
    model = args.model or raw.models.list().data[0].id
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": TASK},
    ]
    with wrap(raw, args.trajectory_id) as client:
        print(f"trajectory {client.trajectory_id} on {model}")
        for turn, (name, expected_s, tool) in enumerate(SCRIPT, start=1):
            r = client.chat.completions.create(
                model=model,
                messages=messages,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": name}},
                max_tokens=16,
                temperature=0,
            )
            report(turn, r)
            calls = r.choices[0].message.tool_calls or []
            messages.append(
                {
                    "role": "assistant",
                    "content": r.choices[0].message.content or "",
                    "tool_calls": [
                        # The random-weight model's arguments may be cut off: echo valid JSON.
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.function.name, "arguments": "{}"},
                        }
                        for c in calls
                    ],
                }
            )
            for call in calls:
                with client.tool(call.function.name, expected_s=expected_s) as wait:
                    output = tool()
                decision = wait.decision or {}
                print(
                    f"  {call.function.name}: {wait.duration_s:.2f} s, engine decided "
                    f"{decision.get('action', '-')} (predicted {decision.get('wait_p50_s', '-')} s)"
                )
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        final = client.chat.completions.create(
            model=model, messages=messages, max_tokens=16, temperature=0
        )
        report(len(SCRIPT) + 1, final)
        state = client.server_state()
        if state is not None:
            print("server view:", json.dumps(state["branches"]["main"]["decision"])[:200])


if __name__ == "__main__":
    main(__doc__, run, OpenAIError)
