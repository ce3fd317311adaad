"""``agentkv serve``: vLLM's OpenAI server with the agentkv plugin enabled."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from agentkv.cli.common import fail, json_object


def serve(
    ctx: typer.Context,
    model: str | None = typer.Argument(
        None, help="Model folder or name. Default: the embedded tiny model (built on first use)."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    kv_space_gib: int | None = typer.Option(
        None,
        "--kv-space-gib",
        help="KV cache size in whole GiB on the CPU backend (VLLM_CPU_KVCACHE_SPACE). Small values create memory pressure.",
    ),
    preset: str = typer.Option(
        "tiny", "--preset", help="Embedded model preset used when MODEL is omitted: tiny or small."
    ),
    connector_config: str = typer.Option(
        "{}",
        "--connector-config",
        help='JSON object passed to the connector as kv_connector_extra_config (e.g. \'{"disk_dir": "/var/tmp/agentkv"}\').',
    ),
    rl: bool = typer.Option(
        False,
        "--rl",
        help="Serve an RL trainer's rollouts (verl, SkyRL, OpenRLHF, ROLL, AReaL): a plain "
        "reset_prefix_cache() invalidates the tier copies too (reset_invalidates_tiers), every "
        "finished turn of a trajectory is a pause (implicit_pause) and a trajectory id back under "
        "a new cache_salt releases its old one (salt_generations). Sets the connector's rl "
        "setting; any of these in --connector-config wins. Not for a multi-tenant server. "
        "docs/rl.md.",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the command and environment instead of starting the server."
    ),
) -> None:
    """Start the vLLM OpenAI server with the agentkv connector, routes and metrics enabled.

    Prefix caching and per-request cached-token details are switched on. Arguments after `--`
    go to vLLM unchanged, e.g. `agentkv serve -- --enforce-eager --max-model-len 16384`.
    """
    from agentkv.errors import AgentKVError
    from agentkv.serving import ServeOptions, build_server_command, preflight

    extra_args = list(ctx.args)
    if model is not None and model.startswith("-"):
        # click hands the first token after `--` to MODEL when MODEL was omitted
        extra_args.insert(0, model)
        model = None
    extra = json_object(connector_config, "--connector-config")
    try:
        if model is None:
            from agentkv import modelgen

            model = str(modelgen.ensure_model(preset))
        elif Path(model).expanduser().exists():
            model = str(Path(model).expanduser().resolve())
        opts = ServeOptions(
            model=model,
            host=host,
            port=port,
            kv_space_gib=kv_space_gib,
            connector_config=extra,
            rl=rl,
            extra_args=extra_args,
        )
        if not dry_run:
            preflight(opts)
    except AgentKVError as exc:
        fail(str(exc))
    argv, env = build_server_command(opts)
    if dry_run:
        shown = {k: env[k] for k in ("VLLM_PLUGINS", "VLLM_CPU_KVCACHE_SPACE") if k in env}
        typer.echo(json.dumps({"argv": argv, "env": shown}, indent=2))
        return
    typer.echo(
        f"agentkv: serving {model} on http://{host}:{port} (plugin: {env['VLLM_PLUGINS']})",
        err=True,
    )
    # exec so that signals (Ctrl-C, SIGTERM from a supervisor) reach vLLM directly.
    os.execvpe(argv[0], argv, env)


def register(app: typer.Typer) -> None:
    app.command(
        "serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
    )(serve)
