"""``agentkv fleet up``: several vLLM + agentkv replicas behind vllm-router, with a shared remote
tier on Valkey (see agentkv.fleet and docs/reference.md's "Several replicas").

With no sizes it fits the machine (``agentkv.fleet_plan``): on CPU two replicas, each with an
explicit KV share of the free memory; on CUDA one replica per GPU (``--gpus-per-replica`` for
tensor parallel replicas). It says what it chose. Logs and run dirs go to a per-user state dir.
"""

from __future__ import annotations

import shlex
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from agentkv.cli.common import fail, json_object

if TYPE_CHECKING:
    from agentkv.fleet import FleetSpec, RunningFleet

fleet_app = typer.Typer(
    help="Several agentkv replicas behind vllm-router (kv_aware, session affinity, remote tier).",
    no_args_is_help=True,
)

WATCH_S = 2.0


# The options of ``up`` (typer Annotated aliases; the defaults are in the signature).
NO_ROUTER_ARGS: list[str] = []  # never mutated: typer copies list options
Model = Annotated[
    str | None,
    typer.Argument(
        help="Model folder or name. Default: the embedded tiny model (built on first use)."
    ),
]
Replicas = Annotated[
    int | None,
    typer.Option(
        "--replicas",
        min=1,
        help="vLLM + agentkv servers to start. Default: 2 on CPU, one per GPU group on CUDA.",
    ),
]
Port = Annotated[int, typer.Option("--port", help="The router's port: clients talk to this one.")]
Remote = Annotated[
    str,
    typer.Option(
        "--remote",
        help="Shared remote tier: a valkey:// / redis:// URL, 'embedded' (start a private "
        "valkey-server) or 'none'.",
    ),
]
Policy = Annotated[
    str,
    typer.Option("--policy", help="vllm-router policy: kv_aware, cache_aware, round_robin, ..."),
]
AffinityTtlS = Annotated[
    int,
    typer.Option(
        "--affinity-ttl-s", help="Session affinity idle TTL (x-session-id); 0 turns it off."
    ),
]
KvSpaceGib = Annotated[
    int | None,
    typer.Option(
        "--kv-space-gib",
        help="KV cache per replica in GiB (CPU backend). Default: a share of the free memory.",
    ),
]
GpusPerReplica = Annotated[
    int,
    typer.Option("--gpus-per-replica", min=1, help="CUDA: devices per replica (tensor parallel)."),
]
ConnectorConfig = Annotated[
    str,
    typer.Option("--connector-config", help="JSON kv_connector_extra_config for every replica."),
]
WorkDir = Annotated[
    Path | None,
    typer.Option(
        "--work-dir",
        help="Logs (replica-N.log, router.log) and run dirs. Default: "
        "$XDG_STATE_HOME/agentkv/fleet-PORT (~/.local/state/agentkv/fleet-PORT).",
    ),
]
Restart = Annotated[
    bool,
    typer.Option(
        "--restart",
        help="Start a replica again (same ports) when its server dies; its trajectories stay "
        "reachable through the remote tier meanwhile.",
    ),
]
RouterArg = Annotated[
    list[str],
    typer.Option("--router-arg", help="One more vllm-router argument (repeat for several)."),
]
Preset = Annotated[str, typer.Option("--preset", help="Embedded preset when MODEL is omitted.")]
DryRun = Annotated[
    bool, typer.Option("--dry-run", help="Print the plan and the router command, start nothing.")
]


@fleet_app.command("up")
def up(
    model: Model = None,
    replicas: Replicas = None,
    port: Port = 8000,
    remote: Remote = "embedded",
    policy: Policy = "kv_aware",
    affinity_ttl_s: AffinityTtlS = 600,
    kv_space_gib: KvSpaceGib = None,
    gpus_per_replica: GpusPerReplica = 1,
    connector_config: ConnectorConfig = "{}",
    work_dir: WorkDir = None,
    restart: Restart = False,
    router_arg: RouterArg = NO_ROUTER_ARGS,
    preset: Preset = "tiny",
    dry_run: DryRun = False,
) -> None:
    """Start Valkey (unless given), REPLICAS servers with KV events, and vllm-router wired to
    them; print the router URL; Ctrl-C stops everything this started."""
    from agentkv import modelgen
    from agentkv.errors import AgentKVError
    from agentkv.fleet import FleetSpec
    from agentkv.fleet_plan import (
        available_memory_gib,
        detect_gpus,
        model_gib,
        plan_fleet,
        state_dir,
    )

    config = json_object(connector_config, "--connector-config")
    try:
        model_path = model or str(modelgen.ensure_model(preset))
        plan = plan_fleet(
            replicas=replicas,
            kv_space_gib=kv_space_gib,
            gpus_per_replica=gpus_per_replica,
            gpus=detect_gpus(),
            available_gib=available_memory_gib,
            weights_gib=model_gib(model_path),
        )
        logs = work_dir or state_dir() / f"fleet-{port}"
        spec = FleetSpec(
            model=model_path,
            replicas=plan.replicas,
            port=port,
            policy=policy,
            affinity_ttl_s=affinity_ttl_s or None,
            remote_url=None if remote in ("embedded", "none") else remote,
            remote=remote != "none",
            connector_config=config,
            kv_space_gib=plan.kv_space_gib,
            device_groups=plan.device_groups,
            router_args=tuple(router_arg),
            work_dir=logs,
        )
        typer.echo(plan.note)
        if dry_run:
            _print_router_command(spec, port)
            return
        typer.echo(f"starting {plan.replicas} replicas and vllm-router (logs in {logs}) ...")
        stop_on_terminate()
        _run(spec, restart)
    except KeyboardInterrupt:
        typer.echo("stopping")
    except AgentKVError as exc:
        fail(str(exc))


def stop_on_terminate() -> None:
    """SIGTERM and SIGHUP (a service manager's stop, a closed terminal, ``kill``) stop the fleet
    as Ctrl-C does: the running fleet's context exits and takes every process group it started
    down with it. Python's default for SIGTERM ends the process at once and would leave the
    replicas, the router and Valkey running."""
    import signal

    def _interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)


def _print_router_command(spec: FleetSpec, port: int) -> None:
    """--dry-run: the vllm-router command the fleet would run (replicas on 8001.., events 5557..)."""
    from agentkv.fleet import router_command

    pairs = [
        (f"http://127.0.0.1:{8001 + i}", f"tcp://127.0.0.1:{5557 + i}")
        for i in range(spec.replicas)
    ]
    typer.echo(shlex.join(router_command(spec, port, pairs)))


def _run(spec: FleetSpec, restart: bool) -> None:
    """Start the fleet, print where it answers, watch it until Ctrl-C; stop it on the way out."""
    from agentkv.fleet import running_fleet

    with running_fleet(spec) as fleet:
        typer.echo(f"router:   {fleet.router_url}")
        for url, events in zip(fleet.replica_urls, fleet.events, strict=True):
            typer.echo(f"replica:  {url}  (KV events {events})")
        if fleet.remote_url:
            typer.echo(f"remote:   {fleet.remote_url}")
        typer.echo("Ctrl-C (or SIGTERM) stops everything.")
        _watch(fleet, restart)


def _watch(fleet: RunningFleet, restart: bool) -> None:
    """Until Ctrl-C: report a replica whose server died; with ``restart``, start it again."""
    from agentkv.errors import AgentKVError

    reported: set[int] = set()
    stop = threading.Event()
    while not stop.wait(WATCH_S):
        for i in fleet.dead():
            url = fleet.replica_urls[i]
            if not restart:
                if i not in reported:
                    reported.add(i)
                    typer.echo(
                        f"replica {i} ({url}) exited (log {fleet.replicas[i].log_path}); its "
                        "trajectories resume on the others from the remote tier. --restart "
                        "brings a dead replica back."
                    )
                continue
            typer.echo(f"replica {i} ({url}) exited; restarting it ...")
            try:
                fleet.restart(i)
                typer.echo(f"replica {i} is back on {url}")
            except AgentKVError as exc:
                typer.echo(f"replica {i} did not come back: {exc}")


def register(app: typer.Typer) -> None:
    app.add_typer(fleet_app, name="fleet")
