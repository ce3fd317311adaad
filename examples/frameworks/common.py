"""What the framework examples share: their arguments, and what the server made of the run."""

from __future__ import annotations

import argparse
import uuid

import httpx

# Run `agentkv serve` with the embedded random-weight model like this (each example forces its
# tool by name on the first step; xgrammar without free whitespace keeps forced arguments short):
SERVE = (
    "agentkv serve --port 8000 --kv-space-gib 1 -- --enable-auto-tool-choice "
    "--tool-call-parser pythonic --structured-outputs-config "
    """'{"backend": "xgrammar", "disable_any_whitespace": true}'"""
)
QUESTION = "What is the weather in Paris? Answer after looking it up."
MAX_TOKENS = 32


def parse_args(doc: str | None) -> argparse.Namespace:
    """``--base-url``, ``--model``, ``--api-key`` and ``--session-id`` (a new one by default)."""
    parser = argparse.ArgumentParser(
        description=(doc or "").strip().splitlines()[0], epilog=f"Server: {SERVE}"
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI base URL")
    parser.add_argument("--model", default="tiny", help="served model name (default: tiny)")
    parser.add_argument("--api-key", default="EMPTY", help="vLLM's --api-key, if set")
    parser.add_argument("--session-id", help="this run's session id (default: a new one)")
    args = parser.parse_args()
    args.session_id = args.session_id or f"run-{uuid.uuid4().hex[:8]}"
    return args


def show(args: argparse.Namespace) -> None:
    """Print the run's trajectory as the server saw it: turns, hits and the pause."""
    root = args.base_url.rstrip("/").removesuffix("/v1")
    r = httpx.get(
        f"{root}/agentkv/v1/trajectories/{args.session_id}",
        headers={"Authorization": f"Bearer {args.api_key}"},
    )
    if r.status_code != 200:
        print(f"no trajectory {args.session_id}: {r.status_code} {r.text[:200]}")
        return
    traj = r.json()
    for t in traj["turns"]:
        print(
            f"turn {t['turn']}: prompt {t['prompt_tokens']} tokens, from vLLM "
            f"{t['device_hit_tokens']}, from tier {t['tier_hit_tokens']}"
        )
    branch = traj["branches"]["main"]
    print(f"trajectory {args.session_id}: {branch['state']}, last paused on {branch['tool']}")
