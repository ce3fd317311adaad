"""What the three agent-loop examples share (openai_agent_loop.py, responses_agent_loop.py,
anthropic_agent_loop.py): the coding agent's prompt and task, the scripted tool turns, the line
each turn prints, and the command line. Each example keeps only its API's own calls.

Primitives:
    SYSTEM, TASK      the system prompt (long, so the prefix cache matters) and the first message.
    SCRIPT            (tool the model is made to call, seconds the tool takes, its output).
    target_schema     a tool's JSON schema: one ``target`` argument from a fixed list (an enum
                      keeps the forced arguments of a random-weight model short).
    agentkv_stats     the ``kv_transfer_params.agentkv`` stats of a reply (empty without them).
    print_turn        one line a turn: prompt tokens, tokens from vLLM's cache, from a tier.
    print_auto_pause  what the server's auto-pause made of the reply (branch state and tool).
    main              --base-url, --api-key, --model, --trajectory-id; runs the loop and turns
                      the client's error into a one-line exit.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

SYSTEM = (
    "You are a careful coding agent working in a Python repository. Read before you edit and "
    "run the tests after every change. "
    + " ".join(f"guideline-{i}: prefer small, reviewed, reversible steps." for i in range(40))
)
TASK = "The test tests/test_parser.py::test_empty fails. Fix it."
SCRIPT = [
    ("read_file", 0.2, "parser.py: def parse(s): return s.split(',')"),
    ("run_tests", 1.5, "FAILED tests/test_parser.py::test_empty - [''] != []"),
    ("run_tests", 1.5, "12 passed in 1.79s"),
]


def target_schema(choices: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"target": {"type": "string", "enum": choices}},
        "required": ["target"],
    }


def agentkv_stats(reply: Any) -> dict[str, Any]:
    """The agentkv stats vLLM returns in the reply's ``kv_transfer_params``."""
    extra = getattr(reply, "model_extra", None) or {}
    return dict((extra.get("kv_transfer_params") or {}).get("agentkv") or {})


def print_turn(turn: int, prompt_tokens: int, reply: Any, cached: int | None = None) -> None:
    stats = agentkv_stats(reply)
    shown = "" if cached is None else f"  cached {cached:>5}"
    print(
        f"turn {turn}: prompt {prompt_tokens:>5}{shown}  "
        f"from vLLM {stats.get('device_hit_tokens', 0):>5}  "
        f"from tier {stats.get('tier_hit_tokens', 0):>5} ({stats.get('tier') or '-'})"
    )


def print_auto_pause(client: Any) -> None:
    """The main branch as the server sees it after a reply with tool calls."""
    state = client.server_state() or {}
    branch = (state.get("branches") or {}).get("main") or {}
    print(f"  auto-paused on {branch.get('tool')}: {branch.get('state')}")


def main(
    description: str,
    run: Callable[[argparse.Namespace], None],
    error: type[Exception],
    base_url: str = "http://127.0.0.1:8000/v1",
) -> None:
    p = argparse.ArgumentParser(description=description.split("\n\n")[0])
    p.add_argument("--base-url", default=base_url)
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--trajectory-id", default=None, help="default: a random one")
    args = p.parse_args()
    try:
        run(args)
    except error as exc:
        sys.exit(f"request failed: {exc}")
