"""A small scripted coding agent against `agentkv serve`, printing per-turn prefix-cache hit rates.

Decisions are scripted (the served model has random weights); what matters is the shape of the
workload: a stable system prompt and tool list, tool waits of a few seconds between turns (the
engine decides to retain, offload or drop the paused KV), and a fork into two candidate fixes
that share the prefix, of which one is joined back.

    agentkv serve --port 8000 &
    python examples/coding_agent.py --base-url http://127.0.0.1:8000 [--model NAME] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import httpx

from harness_sdk import HarnessError, Trajectory, TurnResult

SYSTEM = (
    "You are a careful coding agent working in a Python repository. Read before you edit, keep "
    "patches minimal, run the tests after every change and explain failures precisely. "
    + " ".join(f"guideline-{i}: prefer small, reviewed, reversible steps." for i in range(40))
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
        },
    }
    for name, desc in [
        ("read_file", "Read a file"),
        ("run_tests", "Run pytest"),
        ("apply_patch", "Apply a diff"),
    ]
]
SCRIPT = [  # (tool, expected wait in s, real wait in s, observation)
    ("read_file", 0.5, 0.5, "parser.py: def parse(s): return s.split(',')"),
    ("run_tests", 3.0, 3.0, "FAILED tests/test_parser.py::test_empty - assert [''] == []"),
    ("apply_patch", 1.0, 1.0, "patched parser.py: if not s: return []"),
    ("run_tests", 3.0, 2.5, "12 passed in 2.41s"),
]


def report(label: str, r: TurnResult) -> None:
    engine = r.engine or {}
    ratio = f"{r.hit_ratio:.0%}" if r.hit_ratio is not None else "n/a"
    print(
        f"{label:<26} turn {r.turn:>2}  prompt {r.prompt_tokens:>5}  cached {r.cached_tokens:>5}  "
        f"hit {ratio:>4}  tier {engine.get('tier', '-')}"
    )


async def default_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])


async def run(args: argparse.Namespace) -> None:
    model = args.model or await default_model(args.base_url, args.api_key)
    async with Trajectory(
        args.base_url,
        model,
        api_key=args.api_key,
        system=SYSTEM,
        tools=TOOLS,
        max_tokens=8,
        temperature=0,
    ) as agent:
        print(f"trajectory {agent.trajectory_id} on {model}")
        agent.remember("Repository: a CSV parser. Tests live in tests/; run them with pytest -q.")
        report("task", await agent.complete("Fix the failing test in tests/test_parser.py."))
        for tool, expected, real, output in SCRIPT[:2]:
            async with agent.tool(tool, expected_s=expected) as call:
                await asyncio.sleep(real)  # the tool "runs"
                call.observe(output)
            action = (call.decision or {}).get("action", "skipped")
            report(f"after {tool} ({action})", await agent.complete())

        # Two candidate fixes explored in parallel: both branches reuse the cached prefix.
        a, b = agent.fork(2)
        ra, rb = await asyncio.gather(
            a.complete("Candidate A: return [] for empty input."),
            b.complete("Candidate B: filter out empty fields."),
        )
        report(f"fork {a.branch}", ra)
        report(f"fork {b.branch}", rb)
        b.prune()
        agent.join(a)

        for tool, expected, real, output in SCRIPT[2:]:
            async with agent.tool(tool, expected_s=expected) as call:
                await asyncio.sleep(real)
                call.observe(output)
            action = (call.decision or {}).get("action", "skipped")
            report(f"after {tool} ({action})", await agent.complete())

        hits = [r.hit_ratio or 0.0 for r in agent.results[1:]]
        print(f"mean hit ratio after turn 1: {sum(hits) / max(1, len(hits)):.0%}")
        state = await agent.server_state()
        if state is not None:
            print(f"server-side prefix hit ratio: {state.get('prefix_hit_ratio')}")
        released = await agent.close()
        if released is not None:
            print(
                f"closed: released {released['released_blocks']} device blocks, "
                f"dropped {released['dropped_tier_blocks']} tier blocks"
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--model", default=None, help="served model name (default: the first of /v1/models)"
    )
    p.add_argument("--api-key", default=None)
    args = p.parse_args()
    try:
        asyncio.run(run(args))
    except (HarnessError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
