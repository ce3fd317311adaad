"""A tool loop on the official ``anthropic`` client against vLLM's Messages API (``/v1/messages``,
what Claude-Code-style agents can be pointed at), wrapped for agentkv in one line.

``harness_sdk.anthropic.wrap`` makes ``messages.create`` carry the trajectory id
(``x-session-id`` and ``kv_transfer_params``). No pause call is written: the server pauses the
trajectory by itself when a reply has ``tool_use`` blocks (auto-pause, with every called tool)
and learns each tool's wait from when the next turn arrives. ``client.tool(...)`` would add the
harness's own estimate.

The served model may have random weights (``agentkv serve`` with no MODEL), so each turn forces
a tool call (``tool_choice`` of type ``tool``) and the tools are scripted; the tool's schema uses
an ``enum`` to keep the forced arguments short. vLLM then needs compact guided JSON:

    agentkv serve --port 8000 --kv-space-gib 1 -- --enable-auto-tool-choice \\
        --tool-call-parser pythonic \\
        --structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}' &
    python examples/anthropic_agent_loop.py --base-url http://127.0.0.1:8000 [--api-key KEY]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import agent_loop_common as common
import httpx
from agent_loop_common import SCRIPT, SYSTEM, TASK, main

try:
    from anthropic import Anthropic, AnthropicError
except ImportError:  # pragma: no cover - the example needs the client
    sys.exit("this example needs the anthropic package: pip install 'vllm-agentkv[anthropic]'")

from harness_sdk.anthropic import wrap


def _tool(name: str, description: str, choices: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "description": description,
        "input_schema": common.target_schema(choices),
    }


TOOLS = [
    _tool("read_file", "Read a file", ["parser.py"]),
    _tool("run_tests", "Run pytest", ["tests"]),
]


def prompt_tokens(msg: Any) -> int:
    u = msg.usage  # Anthropic splits the prompt: uncached + written to cache + read from it
    return int(
        u.input_tokens + (u.cache_creation_input_tokens or 0) + (u.cache_read_input_tokens or 0)
    )


def first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def run(args: argparse.Namespace) -> None:
    args.model = args.model or first_model(args.base_url, args.api_key)
    # vLLM checks Authorization: Bearer, which the anthropic client sends for auth_token
    raw = Anthropic(base_url=args.base_url, auth_token=args.api_key or "EMPTY")
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    with wrap(raw, args.trajectory_id) as client:
        print(f"trajectory {client.trajectory_id} on {args.model}")
        for turn, (name, seconds, output) in enumerate(SCRIPT, start=1):
            msg = client.messages.create(
                model=args.model,
                system=SYSTEM,
                messages=messages,
                tools=TOOLS,
                tool_choice={"type": "tool", "name": name},
                max_tokens=32,
            )
            common.print_turn(turn, prompt_tokens(msg), msg)
            calls = [b for b in msg.content if b.type == "tool_use"]
            messages.append(
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": c.id, "name": c.name, "input": c.input}
                        for c in calls
                    ],
                }
            )
            common.print_auto_pause(client)
            time.sleep(seconds)  # the tool runs; the engine learns this wait
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": c.id, "content": output}
                        for c in calls
                    ],
                }
            )


if __name__ == "__main__":
    main(__doc__, run, AnthropicError, base_url="http://127.0.0.1:8000")
