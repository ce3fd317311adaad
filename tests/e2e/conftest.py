"""One real vLLM OpenAI server with the agentkv plugin for the whole test session.

Started through ``agentkv serve`` (the operator's path) on 127.0.0.1 with the embedded tiny
model, enforce_eager (fast start), a capped block count (so a few trajectories create memory
pressure), an API key, a disk tier in a temp folder, and dev mode for /reset_prefix_cache.
Its OpenTelemetry export goes to a real OTLP/HTTP receiver process (``otlp_receiver.py``) through
the standard OTEL_* variables.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

API_KEY = "agentkv-test-key"
NUM_BLOCKS = 192  # x 128 tokens = 24,576 tokens of device KV


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    base_url: str
    model: str
    api_key: str | None
    disk_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes]
    otlp_out: Path
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=120)

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        trajectory: str | None = None,
        branch: str | None = None,
        salt: str | None = None,
        max_tokens: int = 4,
        extra_params: Any = None,
        **kw: Any,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": True,
            "ignore_eos": True,
            **kw,
        }
        if trajectory is not None:
            params: dict[str, Any] = {"trajectory_id": trajectory}
            if branch:
                params["branch"] = branch
            body["kv_transfer_params"] = {"agentkv": params}
        if extra_params is not None:
            body["kv_transfer_params"] = extra_params
        if salt:
            body["cache_salt"] = salt
        r = self.client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return dict(r.json())

    def status(self) -> dict[str, Any]:
        r = self.client.get("/agentkv/v1/status")
        r.raise_for_status()
        return dict(r.json())

    def trajectory(self, tid: str) -> dict[str, Any]:
        r = self.client.get(f"/agentkv/v1/trajectories/{tid}")
        r.raise_for_status()
        return dict(r.json())

    def pause(
        self, tid: str, tool: str, wait: float | None, branch: str = "main"
    ) -> dict[str, Any]:
        r = self.client.post(
            f"/agentkv/v1/trajectories/{tid}/pause",
            json={"tool": tool, "expected_wait_s": wait, "branch": branch},
        )
        r.raise_for_status()
        return dict(r.json())

    def wait_state(
        self, tid: str, states: set[str], branch: str = "main", timeout: float = 20
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            b = self.trajectory(tid)["branches"][branch]
            if b["state"] in states:
                return dict(b)
            if time.monotonic() > deadline:
                raise AssertionError(f"{tid}/{branch} stuck in {b['state']}, wanted {states}")
            time.sleep(0.1)

    def reset_prefix_cache(self, timeout: float = 30) -> None:
        """Evict everything vLLM's own prefix cache holds (retries while blocks are in use)."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.client.post("/reset_prefix_cache")
            if r.status_code == 200 and r.json().get("success", True) is not False:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"reset_prefix_cache kept failing: {r.status_code} {r.text}")
            time.sleep(0.2)

    def end(self, tid: str) -> None:
        self.client.delete(f"/agentkv/v1/trajectories/{tid}")

    def metrics_text(self) -> str:
        r = self.client.get("/metrics")
        r.raise_for_status()
        return r.text

    def otlp_records(self, signal: str) -> list[dict[str, Any]]:
        """What the OTLP receiver got so far for ``signal`` ("metrics" or "traces")."""
        out = []
        for line in self.otlp_out.read_text().splitlines():
            rec = json.loads(line)
            if rec["signal"] == signal:
                out.append(rec["body"])
        return out


def long_text(seed: int, words: int) -> str:
    """Distinct, deterministic filler: every seed gives another token sequence."""
    return " ".join(f"tok{seed}x{i}" for i in range(words))


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    port = _free_port()
    work = Path(tempfile.mkdtemp(prefix="agentkv-e2e-"))
    disk_dir = work / "disk"
    log_path = work / "server.log"
    otlp_port, otlp_out = _free_port(), work / "otlp.jsonl"
    receiver = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("otlp_receiver.py")),
            "--port",
            str(otlp_port),
            "--out",
            str(otlp_out),
        ],
        start_new_session=True,
    )
    env = dict(os.environ)
    env.update(
        {
            "VLLM_SERVER_DEV_MODE": "1",
            "AGENTKV_RUN_DIR": str(work / "run"),
            "AGENTKV_PROFILE": str(work / "no-profile.json"),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
            "OTEL_SERVICE_NAME": "agentkv-e2e",
            "OTEL_METRIC_EXPORT_INTERVAL": "1000",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
    )
    connector = json.dumps(
        {
            "disk_dir": str(disk_dir),
            "host_capacity_gib": 0.5,
            "disk_capacity_gib": 2,
            "grace_s": 0.3,
            # Leases are predicted return + this margin: long enough for a test to set up
            # several retained trajectories before the first lease ends.
            "lease_margin_s": 8,
        }
    )
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
        "--num-gpu-blocks-override",
        str(NUM_BLOCKS),
        "--api-key",
        API_KEY,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "pythonic",
        "--served-model-name",
        "tiny",
    ]
    log = log_path.open("wb")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 420
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start in time:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield Server(base, "tiny", API_KEY, disk_dir, log_path, proc, otlp_out)
    finally:
        receiver.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
