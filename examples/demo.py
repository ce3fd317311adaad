"""`make demo`: a real vLLM with the agentkv plugin serving an agent trajectory with tool waits.

Builds the embedded tiny model (offline), starts vLLM with the plugin on a free port of 127.0.0.1
(`agentkv.launch`, the same wiring as `agentkv serve`), then runs one
trajectory: a short tool wait (the engine retains the KV), a long one (it offloads to host RAM),
vLLM's cache is flushed (as memory pressure would), and the next turn comes back from the tier.
Prints the cached tokens of each turn, the decisions with their numbers, and an excerpt of the
server's /metrics.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from agentkv import modelgen
from agentkv.errors import EngineUnavailableError
from agentkv.launch import LaunchSpec, running_server

console = Console()
TRAJECTORY = "demo-1"


def server_spec(work: Path) -> LaunchSpec:
    """vLLM + agentkv on a free port, 1 GiB of KV, a host and a disk tier, dev mode (for
    /reset_prefix_cache)."""
    return LaunchSpec(
        model=str(modelgen.ensure_model("tiny")),
        connector_config={
            "disk_dir": str(work / "disk"),
            "host_capacity_gib": 1,
            "grace_s": 0.5,
            # The demo's cache flush stands in for memory pressure, but a flush comes without
            # the warning real pressure gives: the default write-back rule ("forecast") would
            # still be waiting for an eviction forecast and copy nothing. "eager" copies at the
            # pause, so turn 3 shows the host tier.
            "writeback": "eager",
        },
        kv_space_gib=1,
        max_model_len=8192,
        served_model_name="tiny",
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
        run_dir=work / "run",
        log_path=work / "server.log",
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--base-url",
        help="use a running `agentkv serve` (with VLLM_SERVER_DEV_MODE=1) instead of starting one",
    )
    args = ap.parse_args()
    if args.base_url is not None:
        run(args.base_url)
        return
    work = Path(tempfile.mkdtemp(prefix="agentkv-demo-"))
    with console.status("building the embedded tiny model (offline, seeded)..."):
        spec = server_spec(work)
    with contextlib.ExitStack() as stack:
        with console.status("starting vLLM with the agentkv plugin (about 30 s)..."):
            try:
                server = stack.enter_context(running_server(spec))
            except EngineUnavailableError as exc:
                raise SystemExit(str(exc)) from None
        run(server.base_url)


def run(base: str) -> None:
    c = httpx.Client(base_url=base, timeout=120)
    model = c.get("/v1/models").json()["data"][0]["id"]
    system = "You are a coding agent. Repository map:\n" + "\n".join(
        f"src/module_{i}.py: helpers for feature {i}" for i in range(180)
    )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Fix the failing test."},
    ]
    table = turn_table()
    turn(c, model, messages, table, "1", "-")
    action = pause(c, "grep", 0.001)
    messages.append({"role": "user", "content": "grep output: src/module_7.py:12: def helper_7()"})
    turn(c, model, messages, table, "2", f"short tool wait -> {action}")
    action = pause(c, "pytest", 45)
    time.sleep(1.0)
    messages.append(
        {
            "role": "user",
            "content": "pytest output: 1 failed, 41 passed\n" + "E assert x == y\n" * 40,
        }
    )
    # Stand-in for memory pressure: vLLM forgets every cached block; only the tier still has them.
    while not c.post("/reset_prefix_cache").json().get("success", True):
        time.sleep(0.2)
    turn(c, model, messages, table, "3", f"long tool wait -> {action}; vLLM cache flushed")
    console.print(table)
    status = c.get("/agentkv/v1/status").json()
    console.print(
        f"tiers: host {status['tiers']['host']['blocks']} blocks, decisions {status['decisions']}"
    )
    # The same numbers as operators see them: Prometheus text on the server's own /metrics.
    wanted = ("agentkv_decisions_total", "agentkv_bytes_held", "agentkv_reload_bytes_count")
    lines = [ln for ln in c.get("/metrics").text.splitlines() if ln.startswith(wanted)]
    console.print("/metrics (excerpt):\n  " + "\n  ".join(lines))
    c.delete(f"/agentkv/v1/trajectories/{TRAJECTORY}")


def turn_table() -> Table:
    table = Table(title="one agent trajectory on vLLM + agentkv")
    for col in (
        "turn",
        "prompt tokens",
        "cached tokens",
        "from vLLM cache",
        "from agentkv tier",
        "before this turn",
    ):
        table.add_column(col)
    return table


def turn(
    c: httpx.Client,
    model: str,
    messages: list[dict[str, Any]],
    table: Table,
    label: str,
    before: str,
) -> None:
    """One turn of the trajectory: its row in ``table``, its reply appended to ``messages``."""
    r = c.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": messages,
            "max_tokens": 16,
            "temperature": 0,
            "kv_transfer_params": {"agentkv": {"trajectory_id": TRAJECTORY}},
        },
    )
    r.raise_for_status()
    out = r.json()
    stats = out.get("kv_transfer_params", {}).get("agentkv", {})
    table.add_row(
        label,
        str(out["usage"]["prompt_tokens"]),
        str(out["usage"]["prompt_tokens_details"]["cached_tokens"]),
        str(stats.get("device_hit_tokens", "-")),
        f"{stats.get('tier_hit_tokens', '-')} ({stats.get('tier') or '-'})",
        before,
    )
    messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"] or ""})


def pause(c: httpx.Client, tool: str, wait: float) -> str:
    """Declare a tool wait; print and return the engine's decision."""
    d = c.post(
        f"/agentkv/v1/trajectories/{TRAJECTORY}/pause",
        json={"tool": tool, "expected_wait_s": wait},
    ).json()["decision"]
    console.print(
        f"[bold]pause[/] {tool} (expected {wait:g} s) -> [cyan]{d['action']}[/]: {d['rationale']}"
    )
    return str(d["action"])


if __name__ == "__main__":
    main()
