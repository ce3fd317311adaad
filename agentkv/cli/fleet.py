"""``agentkv fleet up``: several vLLM + agentkv replicas behind vllm-router, with a shared remote
tier on Valkey (see agentkv.fleet and the README's "Several replicas")."""

from __future__ import annotations

import json
import shlex
import threading
from pathlib import Path

import typer

from agentkv.cli.common import fail

fleet_app = typer.Typer(
    help="Several agentkv replicas behind vllm-router (kv_aware, session affinity, remote tier).",
    no_args_is_help=True,
)


@fleet_app.command("up")
def up(
    model: str | None = typer.Argument(
        None, help="Model folder or name. Default: the embedded tiny model (built on first use)."
    ),
    replicas: int = typer.Option(2, "--replicas", min=1, help="vLLM + agentkv servers to start."),
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
        None, "--kv-space-gib", help="KV cache per replica in GiB (CPU backend)."
    ),
    connector_config: str = typer.Option(
        "{}", "--connector-config", help="JSON kv_connector_extra_config for every replica."
    ),
    work_dir: Path = typer.Option(
        Path("agentkv-fleet"), "--work-dir", help="Logs (replica-N.log, router.log) and run dirs."
    ),
    preset: str = typer.Option("tiny", "--preset", help="Embedded preset when MODEL is omitted."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the router command an operator would run, start nothing."
    ),
) -> None:
    """Start Valkey (unless given), REPLICAS servers with KV events, and vllm-router wired to
    them; print the router URL; Ctrl-C stops everything this started."""
    from agentkv import modelgen
    from agentkv.errors import AgentKVError
    from agentkv.fleet import FleetSpec, router_command, running_fleet

    try:
        config = json.loads(connector_config)
    except json.JSONDecodeError as exc:
        fail(f"--connector-config is not JSON: {exc}")
    if not isinstance(config, dict):
        fail("--connector-config must be a JSON object")
    try:
        spec = FleetSpec(
            model=model or str(modelgen.ensure_model(preset)),
            replicas=replicas,
            port=port,
            policy=policy,
            affinity_ttl_s=affinity_ttl_s or None,
            remote_url=None if remote in ("embedded", "none") else remote,
            remote=remote != "none",
            connector_config=config,
            kv_space_gib=kv_space_gib,
            work_dir=work_dir,
        )
        if dry_run:
            pairs = [
                (f"http://127.0.0.1:{8001 + i}", f"tcp://127.0.0.1:{5557 + i}")
                for i in range(replicas)
            ]
            typer.echo(shlex.join(router_command(spec, port, pairs)))
            return
        typer.echo(f"starting {replicas} replicas and vllm-router (logs in {work_dir}) ...")
        with running_fleet(spec) as fleet:
            typer.echo(f"router:   {fleet.router_url}")
            for url, events in zip(fleet.replica_urls, fleet.events, strict=True):
                typer.echo(f"replica:  {url}  (KV events {events})")
            if fleet.remote_url:
                typer.echo(f"remote:   {fleet.remote_url}")
            typer.echo("Ctrl-C stops everything.")
            threading.Event().wait()
    except KeyboardInterrupt:
        typer.echo("stopping")
    except AgentKVError as exc:
        fail(str(exc))


def register(app: typer.Typer) -> None:
    app.add_typer(fleet_app, name="fleet")
