"""Real vLLM OpenAI servers with the agentkv plugin for the e2e tests.

``server`` (session scope): one server for the whole session, started through ``agentkv serve``
(the operator's path) on 127.0.0.1 with the embedded tiny model, enforce_eager (fast start), a
capped block count (so a few trajectories create memory pressure), an API key, a disk tier in a
temp folder, and dev mode for /reset_prefix_cache. Its OpenTelemetry export goes to a real
OTLP/HTTP receiver process (``otlp_receiver.py``) through the standard OTEL_* variables.

``start_server`` is the one start path; ``own_server`` (with ``own_connector``) starts a test
module's own server through it (weights, restart, TP=2, APIs). ``two_turns`` and
``tokens_and_logprobs`` are the turns and the exactness check those modules share.

Policy knobs the tests rely on (``disk_after_s`` 3): a declared ``expected_wait_s`` <= 2 is
offloaded to host, >= 5 to disk. Every pause names a tool of its own: the server learns waits per
tool, and a name another test already resumed would blend that test's observed waits into the
decision.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

API_KEY = "agentkv-test-key"
# The status route's cross-tenant operator view (``Server.status`` asks for it).
OPERATOR_KEY = "agentkv-test-operator-key"
OPERATOR_HEADER = "X-AgentKV-Operator-Key"
NUM_BLOCKS = 192  # x 128 tokens = 24,576 tokens of device KV
BLOCK_TOKENS = 128  # vLLM's CPU block size for this model

T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    probe: Callable[[], T | None], what: str, timeout: float = 20, interval: float = 0.1
) -> T:
    """Poll ``probe`` until it returns something truthy (a condition wait with a deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def full_blocks(tokens: int) -> int:
    """Tokens in the whole blocks of ``tokens`` tokens (what a prefix cache can hold)."""
    return max(0, tokens) // BLOCK_TOKENS * BLOCK_TOKENS


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Server:
    base_url: str
    model: str
    api_key: str | None
    disk_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes]
    otlp_out: Path | None = None
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.base_url, headers=self.headers, timeout=120)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def chat_body(
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
        return body

    def chat(self, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
        r = self.client.post("/v1/chat/completions", json=self.chat_body(messages, **kw))
        r.raise_for_status()
        return dict(r.json())

    def tokenize(self, messages: list[dict[str, Any]], gen: bool = True) -> list[int]:
        r = self.client.post(
            "/tokenize",
            json={"model": self.model, "messages": messages, "add_generation_prompt": gen},
        )
        r.raise_for_status()
        return list(r.json()["tokens"])

    def status(self) -> dict[str, Any]:
        """The operator's view (every tenant's ids, the learned waits)."""
        r = self.client.get("/agentkv/v1/status", headers={OPERATOR_HEADER: OPERATOR_KEY})
        r.raise_for_status()
        return dict(r.json())

    def counters(self) -> dict[str, int]:
        return dict(self.status()["counters"])

    def trajectory(self, tid: str) -> dict[str, Any]:
        r = self.client.get(f"/agentkv/v1/trajectories/{tid}")
        r.raise_for_status()
        return dict(r.json())

    def trajectory_code(self, tid: str) -> int:
        """HTTP status of GET /agentkv/v1/trajectories/{tid} (404: unknown or deleted)."""
        return self.client.get(f"/agentkv/v1/trajectories/{tid}").status_code

    def pause(
        self,
        tid: str,
        tool: str,
        wait: float | None,
        branch: str = "main",
        max_lease_s: float | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"tool": tool, "expected_wait_s": wait, "branch": branch}
        if max_lease_s is not None:
            body["max_lease_s"] = max_lease_s
        r = self.client.post(f"/agentkv/v1/trajectories/{tid}/pause", json=body)
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

    def clean(self, tiers: bool = True, timeout: float = 20) -> dict[str, Any]:
        """DELETE every trajectory the server knows, then wait until it holds nothing: no
        trajectory, no pinned device block and, with ``tiers``, no tier byte either."""
        for tid in self.status()["trajectory_ids"]:
            self.end(tid)
        kinds = ("device_pinned", "host", "disk") if tiers else ("device_pinned",)

        def idle() -> dict[str, Any] | None:
            s = self.status()
            held = [s["bytes_held"][k] for k in kinds]
            if s["trajectories"] == 0 and s.get("tombstones", 0) == 0 and not any(held):
                return s
            return None

        return wait_until(idle, f"the server to hold no {'/'.join(kinds)} bytes", timeout)

    def metrics_text(self) -> str:
        r = self.client.get("/metrics")
        r.raise_for_status()
        return r.text

    def otlp_records(self, signal: str) -> list[dict[str, Any]]:
        """What the OTLP receiver got so far for ``signal`` ("metrics" or "traces")."""
        assert self.otlp_out is not None, "this server exports no OTLP"
        out = []
        for line in self.otlp_out.read_text().splitlines():
            rec = json.loads(line)
            if rec["signal"] == signal:
                out.append(rec["body"])
        return out


def long_text(seed: int, words: int) -> str:
    """Distinct, deterministic filler: every seed gives another token sequence."""
    return " ".join(f"tok{seed}x{i}" for i in range(words))


def _otlp_receiver(work: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    """Start the OTLP/HTTP receiver process (it writes ``work``/otlp.jsonl) and point the
    server's OTEL_* variables in ``env`` at it."""
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
    env.update(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
            "OTEL_SERVICE_NAME": "agentkv-e2e",
            "OTEL_METRIC_EXPORT_INTERVAL": "1000",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
    )
    return receiver, otlp_out


def _serve_command(
    port: int, connector: dict[str, Any], vllm_args: tuple[str, ...], model: Path | None = None
) -> list[str]:
    """``agentkv serve`` with the tiny model (or ``model``, a folder), an API key and a capped
    block count."""
    return [
        sys.executable,
        "-m",
        "agentkv.cli",
        "serve",
        *([str(model)] if model is not None else []),
        "--port",
        str(port),
        "--kv-space-gib",
        "1",
        "--connector-config",
        json.dumps(connector),
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
        *vllm_args,
    ]


def _wait_healthy(
    proc: subprocess.Popen[bytes], base: str, log_path: Path, start_timeout: float
) -> None:
    """Wait for /health; RuntimeError with the log's tail when the server exits or is late."""
    deadline = time.monotonic() + start_timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server did not start in time:\n{log_path.read_text()[-4000:]}")
        time.sleep(1)


@contextlib.contextmanager
def start_server(
    work: Path,
    connector: dict[str, Any],
    *,
    vllm_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    otlp: bool = False,
    start_timeout: float = 420,
    model: Path | None = None,
) -> Iterator[Server]:
    """Start ``agentkv serve`` (tiny model, API key, dev mode) in ``work``; stop it on exit.

    ``model``: a model folder to serve (still named ``tiny``) instead of the embedded one.

    ``connector["disk_dir"]`` names the disk tier; ``otlp`` adds an OTLP/HTTP receiver process
    and points the server's OTEL_* variables at it.
    """
    port = _free_port()
    log_path = work / "server.log"
    full_env = dict(os.environ)
    full_env.update(
        {
            "VLLM_SERVER_DEV_MODE": "1",
            "AGENTKV_RUN_DIR": str(work / "run"),
            "AGENTKV_PROFILE": str(work / "no-profile.json"),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "AGENTKV_OPERATOR_KEY": OPERATOR_KEY,
        }
    )
    full_env.update(env or {})
    receiver, otlp_out = _otlp_receiver(work, full_env) if otlp else (None, None)
    cmd = _serve_command(port, connector, vllm_args, model)
    log = log_path.open("wb")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, log_path, start_timeout)
        yield Server(
            base,
            "tiny",
            API_KEY,
            Path(connector.get("disk_dir") or work / "disk"),
            log_path,
            proc,
            otlp_out,
        )
    finally:
        if receiver is not None:
            receiver.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def own_connector(work: Path, **overrides: Any) -> dict[str, Any]:
    """The connector of a test module's own server: a disk tier in ``work`` (1 GiB), a 0.5 GiB
    host tier, grace 0.3 s, declared waits <= 2 s to host and >= 5 s to disk (``disk_after_s``
    3); ``overrides`` add or replace keys."""
    return {
        "disk_dir": str(work / "disk"),
        "host_capacity_gib": 0.5,
        "disk_capacity_gib": 1,
        "grace_s": 0.3,
        "disk_after_s": 3,
        # Own servers test the copy and reload paths with pauses of seconds on an idle pool,
        # where the production rule ("forecast") would leave the blocks in vLLM's cache and
        # copy nothing; test_admission_e2e.py runs the production rule.
        "writeback": "eager",
        **overrides,
    }


@contextlib.contextmanager
def own_server(
    name: str,
    *,
    vllm_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    **overrides: Any,
) -> Iterator[Server]:
    """A server of a test module's own (``own_connector`` plus ``overrides``) in a new temp
    folder named after ``name``; for a module whose tests change the server (weights, TP,
    vLLM options) or would disturb the shared one."""
    work = Path(tempfile.mkdtemp(prefix=f"agentkv-e2e-{name}-"))
    with start_server(work, own_connector(work, **overrides), vllm_args=vllm_args, env=env) as srv:
        yield srv


def two_turns(
    seed: int, system_words: int = 400, observation_words: int = 60
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """A coding agent's first turn (a long system prompt) and its second (one observation more)."""
    first = [
        {"role": "system", "content": "You are a coding agent. " + long_text(seed, system_words)},
        {"role": "user", "content": "Fix the failing test."},
    ]
    observation = "Observation: " + long_text(seed + 1, observation_words)
    return first, [*first, {"role": "user", "content": observation}]


def tokens_and_logprobs(out: dict[str, Any]) -> list[tuple[str, float]]:
    """A chat completion's (token, logprob) pairs: equal only for bit-identical KV."""
    return [(c["token"], c["logprob"]) for c in out["choices"][0]["logprobs"]["content"]]


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    work = Path(tempfile.mkdtemp(prefix="agentkv-e2e-"))
    connector = {
        "disk_dir": str(work / "disk"),
        "host_capacity_gib": 0.5,
        "disk_capacity_gib": 2,
        "grace_s": 0.3,
        # Leases are predicted return + this margin: longer than any test's setup and traffic
        # on a slow, shared 2-core machine (a wall-clock lease must not decide a test's
        # outcome). Tests about a lease's end cap their own lease with `max_lease_s`.
        "lease_margin_s": 600,
        # Predicted median waits of 3 s or more go to disk: tests declare <= 2 s for host, >= 5 s
        # for disk.
        "disk_after_s": 3,
        "job_timeout_s": 20,
        # Every async tier load (disk) waits 1 s in the worker before it copies, so a test can
        # abort a request while its load is in flight.
        "debug_load_delay_s": 1.0,
        # These modules test the copy and reload paths with pauses of seconds on a pool that is
        # mostly idle between tests: the production rule (writeback "forecast") would leave
        # those blocks in vLLM's cache and copy nothing. test_admission_e2e.py's own server
        # runs the production rule.
        "writeback": "eager",
    }
    # Two additions test_apis_e2e.py needs (one server start fewer than a module server of its
    # own): the Responses API store (`previous_response_id` chains) and xgrammar without
    # free whitespace (with the random-weight model a forced tool's guided JSON arguments
    # otherwise run on as whitespace). Both act only on requests that ask for them.
    # And vLLM's token-in/token-out route `/inference/v1/generate` (SkyRL's call; without
    # --enable-scale-out vLLM answers 403 there): it only adds routes.
    outputs = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})
    with start_server(
        work,
        connector,
        otlp=True,
        vllm_args=("--structured-outputs-config", outputs, "--enable-scale-out"),
        env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"},
    ) as srv:
        yield srv
