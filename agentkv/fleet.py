"""Several vLLM + agentkv replicas behind vllm-router, with a shared remote tier on Valkey.

Primitives:
  FleetSpec                 what to start: model, replica count, router port and policy, session
                            affinity, the remote tier (a URL, or an embedded valkey-server), the
                            connector settings every replica shares, vanilla replicas for a
                            baseline
  ReplicaPorts              one replica's HTTP port and KV-event endpoint
  replica_spec(spec, ...)   -> the LaunchSpec of one replica (agentkv.launch starts it)
  router_command(spec, ...) -> vllm-router's argv: the same flags an operator types (README,
                            "Several replicas")
  running_fleet(spec)       context manager: Valkey (unless given), the replicas (started
                            concurrently), the router; yields RunningFleet; stops all it started,
                            in reverse order, on exit, error or Ctrl-C: each replica's whole
                            process group (its engine core and workers too, even when the API
                            server already died)
  RunningFleet.dead() / .restart(i)   replicas whose server exited; start one again on its
                            ports (the router keeps its URL; its remote-tier copies stay
                            reachable, so its trajectories resume on it or anywhere)

Sizes and devices default per machine (``agentkv.fleet_plan``): on CPU each replica gets an
explicit KV share of the free memory, on CUDA its own devices (``device_groups``). Logs and run
dirs default to a per-user state directory, never the current directory.

Wiring: each replica publishes vLLM's KV events on its own ZMQ endpoint (``--kv-events-config``),
device blocks from vLLM and host/disk copies from agentkv (medium CPU / STORAGE); the router
subscribes to each (``--kv-event-source URL=ENDPOINT``) and scores replicas with ``kv_aware``:
prefix held on the device, host and disk credited by ``--kv-penalty-host`` / ``--kv-penalty-disk``,
and session affinity by ``x-session-id`` (``--kv-aware-session-affinity-ttl-secs``). Every replica
writes its offloaded blocks to the remote tier too, so a trajectory whose replica died resumes
from Valkey on another one. Nothing here imports vllm.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentkv.errors import ConfigError
from agentkv.fleet_plan import state_dir
from agentkv.launch import LaunchSpec, RunningServer, free_port, running_server, wait_healthy

ROUTER_POLICIES = ("kv_aware", "cache_aware", "round_robin", "power_of_two", "random")
BLOCK_TOKENS_CPU = 128  # vLLM's block size on CPU; on CUDA pass the engine's --block-size


@dataclass
class FleetSpec:
    model: str
    replicas: int = 2
    host: str = "127.0.0.1"
    port: int | None = None  # the router's; None picks a free one
    policy: str = "kv_aware"
    affinity_ttl_s: int | None = 600  # None: no session affinity
    kv_penalty_host: float = 0.8
    kv_penalty_disk: float = 0.3
    block_size: int = BLOCK_TOKENS_CPU
    remote_url: str | None = None  # None: start an embedded valkey-server (agentkv replicas)
    remote: bool = True  # False: no remote tier at all
    vanilla: bool = False  # plain vLLM replicas (no plugin, no remote) for a baseline
    connector_config: dict[str, Any] = field(default_factory=dict)
    served_model_name: str | None = None
    num_blocks: int | None = None
    kv_space_gib: int | None = None
    max_model_len: int | None = None
    api_key: str | None = None
    extra_args: Sequence[str] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    router_args: Sequence[str] = ()  # more vllm-router flags (health checks, retries, ...)
    work_dir: Path = field(default_factory=lambda: state_dir() / "fleet")
    device_groups: Sequence[Sequence[str]] = ()  # CUDA: each replica's devices (empty: CPU)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas must be at least 1 (got {self.replicas})")
        if self.device_groups and len(self.device_groups) != self.replicas:
            raise ConfigError(
                f"{len(self.device_groups)} device groups for {self.replicas} replicas"
            )
        if self.policy not in ROUTER_POLICIES:
            raise ConfigError(
                f"unknown router policy {self.policy!r}; one of {', '.join(ROUTER_POLICIES)}"
            )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


@dataclass(frozen=True)
class ReplicaPorts:
    port: int
    events_port: int

    def url(self, host: str) -> str:
        return f"http://{host}:{self.port}"

    def events_endpoint(self, host: str) -> str:
        return f"tcp://{host}:{self.events_port}"


@dataclass
class _Replica:
    """One replica's launch and the context that owns its processes."""

    launch: LaunchSpec
    ready_timeout_s: float
    context: Any = None
    server: RunningServer | None = None

    def start(self) -> RunningServer:
        self.context = running_server(self.launch, self.ready_timeout_s)
        self.server = self.context.__enter__()
        return self.server

    def stop(self) -> None:
        context, self.context, self.server = self.context, None, None
        if context is not None:
            context.__exit__(None, None, None)


@dataclass
class RunningFleet:
    router_url: str
    replicas: list[RunningServer]
    events: list[str]  # each replica's KV-event endpoint, in replica order
    remote_url: str | None
    router_proc: subprocess.Popen[bytes]
    router_log: Path
    spec: FleetSpec
    handles: list[_Replica] = field(default_factory=list, repr=False)

    @property
    def replica_urls(self) -> list[str]:
        return [r.base_url for r in self.replicas]

    def dead(self) -> list[int]:
        """Indexes of replicas whose server process has exited."""
        return [i for i, r in enumerate(self.replicas) if r.proc.poll() is not None]

    def restart(self, index: int) -> RunningServer:
        """Stop what is left of replica ``index`` (its whole process group) and start it again
        on the same ports; waits until it is healthy. The router's worker URL and KV-event
        source stay the same, so it routes there again once the replica answers."""
        handle = self.handles[index]
        handle.stop()
        server = handle.start()
        self.replicas[index] = server
        return server


def kv_events_config(endpoint: str) -> str:
    """vLLM's ``--kv-events-config``: publish on ``endpoint`` (ZMQ PUB, bound by the engine)."""
    bind = endpoint.replace("127.0.0.1", "*") if endpoint.startswith("tcp://127.") else endpoint
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": bind})


def replica_spec(
    spec: FleetSpec, index: int, ports: ReplicaPorts, remote_url: str | None
) -> LaunchSpec:
    connector: dict[str, Any] | None = None
    if not spec.vanilla:
        connector = dict(spec.connector_config)
        if remote_url:
            connector.setdefault("remote_url", remote_url)
    args = list(spec.extra_args)
    args += ["--kv-events-config", kv_events_config(ports.events_endpoint(spec.host))]
    env = dict(spec.extra_env)
    if spec.device_groups:
        devices = list(spec.device_groups[index])
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        if len(devices) > 1:
            args += ["--tensor-parallel-size", str(len(devices))]
    return LaunchSpec(
        model=spec.model,
        connector_config=connector,
        port=ports.port,
        host=spec.host,
        kv_space_gib=spec.kv_space_gib,
        num_blocks=spec.num_blocks,
        served_model_name=spec.served_model_name,
        max_model_len=spec.max_model_len,
        api_key=spec.api_key,
        extra_args=args,
        extra_env=env,
        log_path=spec.work_dir / f"replica-{index}.log",
        run_dir=spec.work_dir / f"run-{index}",
    )


def router_binary() -> str:
    """The ``vllm-router`` executable next to this Python, else on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise ConfigError(
            "vllm-router is not installed: pip install 'vllm-agentkv[fleet]' (or vllm-router)"
        )
    return found


def router_command(
    spec: FleetSpec,
    port: int,
    replicas: Sequence[tuple[str, str]],
    metrics_port: int | None = None,
) -> list[str]:
    """vllm-router's argv for ``replicas`` given as (HTTP URL, KV-event endpoint) pairs.
    ``metrics_port``: its Prometheus listener (two routers on one host need two)."""
    argv = [
        router_binary(),
        "--host",
        spec.host,
        "--port",
        str(port),
        "--policy",
        spec.policy,
        "--worker-urls",
        *(url for url, _ in replicas),
    ]
    if spec.policy == "kv_aware":
        argv += [
            "--kv-event-block-size",
            str(spec.block_size),
            "--kv-event-model",
            spec.model_name,
            "--kv-penalty-host",
            str(spec.kv_penalty_host),
            "--kv-penalty-disk",
            str(spec.kv_penalty_disk),
        ]
        for url, endpoint in replicas:
            argv += ["--kv-event-source", f"{url}={endpoint}"]
        if spec.affinity_ttl_s is not None:
            argv += ["--kv-aware-session-affinity-ttl-secs", str(spec.affinity_ttl_s)]
    if spec.api_key:
        argv += ["--api-key", spec.api_key]
    if metrics_port is not None:
        argv += ["--prometheus-port", str(metrics_port)]
    return [*argv, *spec.router_args]


@contextlib.contextmanager
def _embedded_valkey(work_dir: Path) -> Iterator[str]:
    from agentkv.tiers.valkey_server import ValkeyProcess

    with ValkeyProcess() as server:
        yield server.url


def _wait_router(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    wait_healthy(url, proc, log, timeout_s, "vllm-router", poll_s=0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def running_fleet(spec: FleetSpec, ready_timeout_s: float = 900.0) -> Iterator[RunningFleet]:
    """Start Valkey (unless ``spec.remote_url`` or no remote), the replicas, then the router;
    stop everything this started on exit. Raises EngineUnavailableError with a log tail when a
    piece does not come up."""
    spec.work_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        remote_url = None
        if not spec.vanilla and spec.remote:
            remote_url = spec.remote_url or stack.enter_context(_embedded_valkey(spec.work_dir))
        ports = [
            ReplicaPorts(free_port(spec.host), free_port(spec.host)) for _ in range(spec.replicas)
        ]
        handles = [
            _Replica(replica_spec(spec, i, p, remote_url), ready_timeout_s)
            for i, p in enumerate(ports)
        ]
        # Stopped on exit (in reverse order, before Valkey), also the ones that did come up
        # when another failed; stop() of one never started is a no-op.
        for handle in handles:
            stack.callback(handle.stop)
        # Replicas start concurrently (model load and warm-up dominate).
        with ThreadPoolExecutor(max_workers=len(handles)) as pool:
            futures = [pool.submit(h.start) for h in handles]
            replicas: list[RunningServer] = []
            errors: list[BaseException] = []
            for fut in futures:
                try:
                    replicas.append(fut.result())
                except BaseException as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
        router_port = spec.port if spec.port is not None else free_port(spec.host)
        endpoints = [p.events_endpoint(spec.host) for p in ports]
        argv = router_command(
            spec,
            router_port,
            [(r.base_url, e) for r, e in zip(replicas, endpoints, strict=True)],
            metrics_port=free_port(spec.host),
        )
        router_log = spec.work_dir / "router.log"
        log = stack.enter_context(router_log.open("wb"))
        env = dict(os.environ)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        stack.callback(_stop, proc)
        url = f"http://{spec.host}:{router_port}"
        _wait_router(url, proc, router_log, timeout_s=60)
        yield RunningFleet(url, replicas, endpoints, remote_url, proc, router_log, spec, handles)
