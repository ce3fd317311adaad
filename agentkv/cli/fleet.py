"""``agentkv fleet up``: several vLLM + agentkv replicas behind vllm-router, with a shared remote
tier on Valkey (see agentkv.fleet and the README's "Several replicas").

With no sizes it fits the machine (``agentkv.fleet_plan``): on CPU two replicas, each with an
explicit KV share of the free memory; on CUDA one replica per GPU (``--gpus-per-replica`` for
tensor parallel replicas). It says what it chose. Logs and run dirs go to a per-user state dir.
"""

from __future__ import annotations

import json
import shlex
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from agentkv.cli.common import fail

if TYPE_CHECKING:
    from agentkv.fleet import RunningFleet

fleet_app = typer.Typer(
    help="Several agentkv replicas behind vllm-router (kv_aware, session affinity, remote tier).",
    no_args_is_help=True,
)

WATCH_S = 2.0


@fleet_app.command("up")
def up(
    model: str | None = typer.Argument(
        None, help="Model folder or name. Default: the embedded tiny model (built on first use)."
    ),
    replicas: int | None = typer.Option(
        None,
        "--replicas",
        min=1,
        help="vLLM + agentkv servers to start. Default: 2 on CPU, one per GPU group on CUDA.",
    ),
    port: int = typer.Option(8000, "--port", help="The router's port: clients talk to this one."),
    remote: str = typer.Option(
        "embedded",
        "--remote",
        help="Shared remote tier: a valkey:// / redis:// URL, 'embedded' (start a private "
        "valkey-server) or 'none'.",
    ),
    policy: str = typer.Option(
        "kv_aware", "--policy", help="vllm-router policy: kv_aware, cache_aware, round_robin, ..."
    ),
    affinity_ttl_s: int = typer.Option(
        600, "--affinity-ttl-s", help="Session affinity idle TTL (x-session-id); 0 turns it off."
    ),
    kv_space_gib: int | None = typer.Option(
        None,
        "--kv-space-gib",
        help="KV cache per replica in GiB (CPU backend). Default: a share of the free memory.",
    ),
    gpus_per_replica: int = typer.Option(
        1, "--gpus-per-replica", min=1, help="CUDA: devices per replica (tensor parallel)."
    ),
    connector_config: str = typer.Option(
        "{}", "--connector-config", help="JSON kv_connector_extra_config for every replica."
    ),
    work_dir: Path | None = typer.Option(
        None,
        "--work-dir",
        help="Logs (replica-N.log, router.log) and run dirs. Default: "
        "$XDG_STATE_HOME/agentkv/fleet-PORT (~/.local/state/agentkv/fleet-PORT).",
    ),
    restart: bool = typer.Option(
        False,
        "--restart",
        help="Start a replica again (same ports) when its server dies; its trajectories stay "
        "reachable through the remote tier meanwhile.",
    ),
    router_arg: list[str] = typer.Option(
        [], "--router-arg", help="One more vllm-router argument (repeat for several)."
    ),
    preset: str = typer.Option("tiny", "--preset", help="Embedded preset when MODEL is omitted."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the plan and the router command, start nothing."
    ),
) -> None:
    """Start Valkey (unless given), REPLICAS servers with KV events, and vllm-router wired to
    them; print the router URL; Ctrl-C stops everything this started."""
    from agentkv import modelgen
    from agentkv.errors import AgentKVError
    from agentkv.fleet import FleetSpec, router_command, running_fleet
    from agentkv.fleet_plan import (
        available_memory_gib,
        detect_gpus,
        model_gib,
        plan_fleet,
        state_dir,
    )

    try:
        config = json.loads(connector_config)
    except json.JSONDecodeError as exc:
        fail(f"--connector-config is not JSON: {exc}")
    if not isinstance(config, dict):
        fail("--connector-config must be a JSON object")
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
            pairs = [
                (f"http://127.0.0.1:{8001 + i}", f"tcp://127.0.0.1:{5557 + i}")
                for i in range(plan.replicas)
            ]
            typer.echo(shlex.join(router_command(spec, port, pairs)))
            return
        typer.echo(f"starting {plan.replicas} replicas and vllm-router (logs in {logs}) ...")
        with running_fleet(spec) as fleet:
            typer.echo(f"router:   {fleet.router_url}")
            for url, events in zip(fleet.replica_urls, fleet.events, strict=True):
                typer.echo(f"replica:  {url}  (KV events {events})")
            if fleet.remote_url:
                typer.echo(f"remote:   {fleet.remote_url}")
            typer.echo("Ctrl-C stops everything.")
            _watch(fleet, restart)
    except KeyboardInterrupt:
        typer.echo("stopping")
    except AgentKVError as exc:
        fail(str(exc))


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
