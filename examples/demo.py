"""`make demo`: a real vLLM with the agentkv plugin serving an agent trajectory with tool waits.

Builds the embedded tiny model (offline), starts `agentkv serve` on 127.0.0.1, then runs one
trajectory: a short tool wait (the engine retains the KV), a long one (it offloads to host RAM),
vLLM's cache is flushed (as memory pressure would), and the next turn comes back from the tier.
Prints the cached tokens of each turn and the decisions with their numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

console = Console()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int, work: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "AGENTKV_RUN_DIR": str(work / "run")}
    connector = json.dumps({"disk_dir": str(work / "disk"), "host_capacity_gib": 1, "grace_s": 0.5})
    cmd = [
        sys.executable,
        "-m",
        "agentkv.cli",
        "serve",
        "--port",
        str(port),
        "--kv-space-gib",
        "1",
        "--connector-config",
        connector,
        "--",
        "--enforce-eager",
        "--max-model-len",
        "8192",
        "--served-model-name",
        "tiny",
    ]
    log = (work / "server.log").open("wb")
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    with console.status("starting vLLM with the agentkv plugin (about 30 s)..."):
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                console.print(log.read_text()[-3000:])
                raise SystemExit(f"server exited with code {proc.returncode}; log: {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(1)
    raise SystemExit(f"server did not start; log: {log}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--base-url",
        help="use a running `agentkv serve` (with VLLM_SERVER_DEV_MODE=1) instead of starting one",
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="agentkv-demo-"))
    proc = None
    base = args.base_url
    if base is None:
        with console.status("building the embedded tiny model (offline, seeded)..."):
            subprocess.run(
                [sys.executable, "-m", "agentkv.cli", "model", "build-tiny"],
                check=True,
                capture_output=True,
            )
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = start_server(port, work)
        wait_ready(base, proc, work / "server.log")
    try:
        run(base)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


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

    def turn(label: str, before: str) -> None:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": model,
                "messages": messages,
                "max_tokens": 16,
                "temperature": 0,
                "kv_transfer_params": {"agentkv": {"trajectory_id": "demo-1"}},
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
        messages.append(
            {"role": "assistant", "content": out["choices"][0]["message"]["content"] or ""}
        )

    def pause(tool: str, wait: float) -> str:
        d = c.post(
            "/agentkv/v1/trajectories/demo-1/pause", json={"tool": tool, "expected_wait_s": wait}
        ).json()["decision"]
        console.print(
            f"[bold]pause[/] {tool} (expected {wait:g} s) -> [cyan]{d['action']}[/]: {d['rationale']}"
        )
        return str(d["action"])

    turn("1", "-")
    action = pause("grep", 0.001)
    messages.append({"role": "user", "content": "grep output: src/module_7.py:12: def helper_7()"})
    turn("2", f"short tool wait -> {action}")
    action = pause("pytest", 45)
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
    turn("3", f"long tool wait -> {action}; vLLM cache flushed")
    console.print(table)
    status = c.get("/agentkv/v1/status").json()
    console.print(
        f"tiers: host {status['tiers']['host']['blocks']} blocks, decisions {status['decisions']}"
    )
    c.delete("/agentkv/v1/trajectories/demo-1")


if __name__ == "__main__":
    main()
