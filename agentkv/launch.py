"""Start a vLLM OpenAI server process, with or without agentkv, and wait until it is ready.

Primitives:
  LaunchSpec                what to start: model, port, KV space and block cap, connector config
                            (None = vanilla vLLM with no plugin at all), extra args/env, API key
  build_launch_command()    -> (argv, env); pure, so the vanilla/agentkv difference is unit-tested
  free_port()               a port the OS just handed out on ``host``
  wait_healthy(url, proc, ...)  poll /health until 200 (or the process exits, or time is up)
  running_server(spec)      context manager: start, poll /health, yield RunningServer, kill the
                            process group on exit (also on error or Ctrl-C)

Both configurations run the same module (``vllm.entrypoints.openai.api_server``) with prefix
caching and per-request cached-token details, so a benchmark compares like with like. The
vanilla server gets ``VLLM_PLUGINS=""``: vLLM treats the variable as an allow-list
(``"".split(",") == [""]`` names no installed plugin), so neither the agentkv connector nor its
routes nor any other installed plugin load. vllm is never imported here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentkv.errors import EngineUnavailableError
from agentkv.serving import ServeOptions, build_server_command

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass
class LaunchSpec:
    """One server to start.

    ``connector_config`` None means vanilla vLLM (no agentkv, no plugin of any kind); a dict
    (possibly empty) means the agentkv connector and routes with that ``kv_connector_extra_config``.
    ``port`` None picks a free port. ``num_blocks`` caps vLLM's KV blocks
    (``--num-gpu-blocks-override``; 128 tokens per block on CPU) so memory pressure is
    reproducible whatever ``kv_space_gib`` allocates.
    """

    model: str
    connector_config: dict[str, Any] | None = None
    port: int | None = None
    host: str = "127.0.0.1"
    kv_space_gib: int | None = None
    num_blocks: int | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    enforce_eager: bool = True
    api_key: str | None = None
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    run_dir: Path | None = None
    python: str = sys.executable


@dataclass
class RunningServer:
    """A started, healthy server. ``model`` is the name requests must use."""

    base_url: str
    port: int
    model: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str]
    spec: LaunchSpec


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just assigned to a bound socket; free again once this returns."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _vllm_args(spec: LaunchSpec) -> list[str]:
    """The vLLM arguments both configurations share (everything but the connector)."""
    args: list[str] = []
    if spec.enforce_eager:
        args.append("--enforce-eager")
    if spec.num_blocks is not None:
        args += ["--num-gpu-blocks-override", str(spec.num_blocks)]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    if spec.served_model_name is not None:
        args += ["--served-model-name", spec.served_model_name]
    if spec.api_key is not None:
        args += ["--api-key", spec.api_key]
    return [*args, *spec.extra_args]


def build_launch_command(
    spec: LaunchSpec, port: int, base_env: Mapping[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Return argv and environment for ``spec`` on ``port``.

    An inherited ``VLLM_PLUGINS`` is discarded in both cases, so the two configurations differ
    only by the agentkv connector and routes, never by some other plugin the caller's shell
    happened to allow.
    """
    env = dict(os.environ if base_env is None else base_env)
    env.pop("VLLM_PLUGINS", None)
    env.update(spec.extra_env)
    if spec.run_dir is not None:
        env["AGENTKV_RUN_DIR"] = str(spec.run_dir)
    if spec.connector_config is not None:
        opts = ServeOptions(
            model=spec.model,
            host=spec.host,
            port=port,
            kv_space_gib=spec.kv_space_gib,
            connector_config=dict(spec.connector_config),
            extra_args=_vllm_args(spec),
            python=spec.python,
        )
        return build_server_command(opts, base_env=env)
    env["VLLM_PLUGINS"] = ""
    if spec.kv_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(spec.kv_space_gib)
    argv = [
        spec.python,
        "-m",
        SERVER_MODULE,
        "--model",
        spec.model,
        "--host",
        spec.host,
        "--port",
        str(port),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        *_vllm_args(spec),
    ]
    return argv, env


def _tail(path: Path, chars: int) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the id now names a group of another user's: not ours any more
        return False
    return True


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Stop the server's whole process group: SIGTERM, then SIGKILL after ``grace_s``.

    The server runs in its own session: its engine core and workers are in the same process
    group, and a plain terminate() of the front end would orphan them. The group is signalled
    even when the front end already exited (killed, crashed): its engine core may outlive it
    and would otherwise keep its memory, parented to init. Linux does not hand out a pid that
    is still an active process group id, so the group cannot be another program's."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is None or _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        proc.wait(timeout=grace_s)


def wait_healthy(
    base_url: str,
    proc: subprocess.Popen[bytes],
    log_path: Path,
    timeout_s: float,
    what: str = "vLLM server",
    poll_s: float = 1.0,
) -> None:
    """Poll ``GET {base_url}/health`` until it answers 200. Raises EngineUnavailableError with
    the log tail when ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise EngineUnavailableError(
                f"{what} exited with code {proc.returncode} before it was ready "
                f"(log {log_path}):\n{_tail(log_path, 4000)}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise EngineUnavailableError(
                f"{what} not ready after {timeout_s:.0f} s (log {log_path}):\n"
                f"{_tail(log_path, 4000)}"
            )
        time.sleep(poll_s)


@contextlib.contextmanager
def running_server(
    spec: LaunchSpec, ready_timeout_s: float = 600.0, poll_s: float = 1.0
) -> Iterator[RunningServer]:
    """Start ``spec``, wait until ``GET /health`` answers 200, yield it, stop it on exit.

    Raises EngineUnavailableError, with the tail of the server log, when the process exits
    before it is ready or does not become ready within ``ready_timeout_s``.
    """
    port = spec.port if spec.port is not None else free_port(spec.host)
    log_path = spec.log_path or Path(tempfile.mkstemp(prefix=f"vllm-{port}-", suffix=".log")[1])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv, env = build_launch_command(spec, port)
    base_url = f"http://{spec.host}:{port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            wait_healthy(base_url, proc, log_path, ready_timeout_s, "vLLM server", poll_s)
            yield RunningServer(
                base_url=base_url,
                port=port,
                model=spec.served_model_name or spec.model,
                proc=proc,
                log_path=log_path,
                argv=argv,
                spec=spec,
            )
        finally:
            _stop(proc)
