"""A tool loop on the official ``openai`` client's **Responses API** (``client.responses.create``,
vLLM's ``/v1/responses``, what Codex-style agents speak), wrapped for agentkv in one line.

``harness_sdk.openai.wrap`` makes ``responses.create`` carry the trajectory id. No pause call is
written: a reply whose ``output`` holds ``function_call`` items pauses the trajectory on the
server (auto-pause, with every called tool), and the engine learns each tool's wait from when
the next turn arrives. The loop sends the whole conversation each turn (``store=False``, as
Codex does); with a response store on the server (``VLLM_ENABLE_RESPONSES_API_STORE=1``) a loop
that sends ``previous_response_id`` instead needs no wrapper at all: the chain is the trajectory.

The served model may have random weights (``agentkv serve`` with no MODEL), so each turn forces
a function call (``tool_choice`` of type ``function``) and the tools are scripted.

    agentkv serve --port 8000 --kv-space-gib 1 -- --enable-auto-tool-choice \\
        --tool-call-parser pythonic \\
        --structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}' &
    python examples/responses_agent_loop.py --base-url http://127.0.0.1:8000/v1 [--api-key KEY]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import agent_loop_common as common
from agent_loop_common import SCRIPT, SYSTEM, TASK, main

try:
    from openai import OpenAI, OpenAIError
except ImportError:  # pragma: no cover - the example needs the client
    sys.exit("this example needs the openai package: pip install 'vllm-agentkv[openai]'")

from harness_sdk.openai import wrap


def _tool(name: str, description: str, choices: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": name,
        "description": description,
        "parameters": common.target_schema(choices),
    }


TOOLS = [
    _tool("read_file", "Read a file", ["parser.py"]),
    _tool("run_tests", "Run pytest", ["tests"]),
]


def run(args: argparse.Namespace) -> None:
    raw = OpenAI(base_url=args.base_url, api_key=args.api_key or "EMPTY")
    model = args.model or raw.models.list().data[0].id
    items: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    with wrap(raw, args.trajectory_id) as client:
        print(f"trajectory {client.trajectory_id} on {model}")
        for turn, (name, seconds, output) in enumerate(SCRIPT, start=1):
            r = client.responses.create(
                model=model,
                instructions=SYSTEM,
                input=items,
                tools=TOOLS,
                tool_choice={"type": "function", "name": name},
                max_output_tokens=32,
                temperature=0,
                store=False,
            )
            common.print_turn(turn, r.usage.input_tokens, r)
            calls = [o for o in r.output if o.type == "function_call"]
            common.print_auto_pause(client)
            time.sleep(seconds)  # the tool runs; the engine learns this wait
            for call in calls:
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call.call_id,
                        "name": call.name,
                        "arguments": call.arguments,
                    }
                )
                items.append(
                    {"type": "function_call_output", "call_id": call.call_id, "output": output}
                )


if __name__ == "__main__":
    main(__doc__, run, OpenAIError)
