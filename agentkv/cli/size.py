"""CLI commands ``agentkv size`` and ``agentkv plan``: KV footprint and node capacity.

Primitives:
    register       adds both commands to the root app
    size_cmd       model config + memory -> bytes per token, pool, trajectories per context
    plan_cmd       model config + target load -> GPUs and nodes (the inverse question)
The options are typer aliases in size_options.py.

Byte options accept '526e9', '480GiB' or '60GB'. In ``size`` every byte option is a total over
the ``--gpus`` devices (the reference's node-level figures); ``plan`` takes per-GPU figures
because the device count is what it solves for. Errors print one line on stderr and exit 2.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import typer

from agentkv.cli import size_options as opts
from agentkv.errors import AgentKVError, ConfigError

_DEFAULT_RUNTIME_FRACTION = 0.10  # vLLM's default gpu_memory_utilization=0.9 leaves 10%


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def _bytes_opt(text: str | None, flag: str) -> int | None:
    if text is None:
        return None
    from agentkv.units import parse_bytes

    try:
        value = parse_bytes(text)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from exc
    return value


def _contexts(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        part = part.strip().replace("_", "")
        if not part:
            continue
        try:
            number = float(part)
        except ValueError as exc:
            raise ConfigError(f"--context: {part!r} is not a token count") from exc
        if number <= 0 or number != int(number):
            raise ConfigError(f"--context: token counts must be positive integers, got {part}")
        values.append(int(number))
    if not values:
        raise ConfigError("--context: give at least one token count")
    return values


def _both_units(n: float | None) -> str:
    if n is None:
        return "-"
    from agentkv.units import format_bytes

    return f"{format_bytes(round(n), 'GB')} / {format_bytes(round(n), 'GiB')}"


def register(app: typer.Typer) -> None:
    """Add ``size`` and ``plan`` to ``app``."""
    app.command("size")(size_cmd)
    app.command("plan")(plan_cmd)


def size_cmd(
    config: opts.SizeConfig,
    context: opts.SizeContext = "8192,32768,131072",
    kv_dtype: opts.SizeKvDtype = None,
    tp: opts.SizeTp = 1,
    gpu: opts.SizeGpu = None,
    gpus: opts.SizeGpus = None,
    hbm_bytes: opts.SizeHbmBytes = None,
    weights_bytes: opts.SizeWeightsBytes = None,
    runtime_bytes: opts.SizeRuntimeBytes = None,
    pool_bytes: opts.SizePoolBytes = None,
    headroom: opts.SizeHeadroom = 0.0,
    output_tokens: opts.SizeOutputTokens = 0,
    shared_tokens: opts.SizeSharedTokens = 0,
    block_size: opts.SizeBlockSize = 16,
    static_max_tokens: opts.SizeStaticMaxTokens = None,
    sequences: opts.SizeSequences = None,
    as_json: opts.SizeAsJson = False,
) -> None:
    """KV bytes per token and how many trajectories fit, per context length."""
    _emit(_size_report, _print_size, **locals())  # every parameter, by name


def plan_cmd(
    config: opts.PlanConfig,
    context: opts.PlanContext,
    trajectories: opts.PlanTrajectories = None,
    arrival_rate: opts.PlanArrivalRate = None,
    gen_seconds: opts.PlanGenSeconds = 0.0,
    tool_seconds: opts.PlanToolSeconds = 0.0,
    kv_dtype: opts.PlanKvDtype = None,
    gpu: opts.PlanGpu = None,
    hbm_bytes_per_gpu: opts.PlanHbmBytesPerGpu = None,
    runtime_bytes_per_gpu: opts.PlanRuntimeBytesPerGpu = None,
    weights_bytes: opts.PlanWeightsBytes = None,
    tp: opts.PlanTp = None,
    pp: opts.PlanPp = 1,
    gpus_per_node: opts.PlanGpusPerNode = 8,
    headroom: opts.PlanHeadroom = 0.0,
    output_tokens: opts.PlanOutputTokens = 0,
    shared_tokens: opts.PlanSharedTokens = 0,
    as_json: opts.PlanAsJson = False,
) -> None:
    """How many GPUs and nodes hold N trajectories (or a tool-wait load) at a context length."""
    _emit(_plan_report, _print_plan, **locals())  # every parameter, by name


def _emit(
    build: Callable[..., dict[str, Any]],
    show: Callable[[dict[str, Any]], None],
    as_json: bool,
    **options: Any,
) -> None:
    """Build the report from the command's options; print it as JSON or as tables. A bad
    option (AgentKVError) prints one line and exits 2."""
    try:
        report = build(**options)
    except AgentKVError as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    show(report)


# ---- size ---------------------------------------------------------------------------------


def _size_report(
    *,
    config: Path,
    context: str,
    kv_dtype: str | None,
    tp: int,
    gpu: str | None,
    gpus: int | None,
    hbm_bytes: str | None,
    weights_bytes: str | None,
    runtime_bytes: str | None,
    pool_bytes: str | None,
    headroom: float,
    output_tokens: int,
    shared_tokens: int,
    block_size: int,
    static_max_tokens: int | None,
    sequences: int | None,
) -> dict[str, Any]:
    from agentkv.capacity import size_node
    from agentkv.geometry import ModelGeometry

    contexts = _contexts(context)
    geom = ModelGeometry.from_hf_config(config, kv_dtype=kv_dtype)
    geom.kv_heads_per_device(tp)  # validates TP against the heads before any arithmetic
    num_devices = tp if gpus is None else gpus
    if num_devices < 1:
        raise ConfigError(f"--gpus must be >= 1, got {num_devices}")
    if gpu is not None and hbm_bytes is not None:
        raise ConfigError("give either --gpu or --hbm-bytes, not both")
    if block_size < 1:
        raise ConfigError(f"--block-size must be >= 1, got {block_size}")
    if sequences is not None and sequences < 0:
        raise ConfigError(f"--sequences must not be negative, got {sequences}")

    pool, memory = _size_pool(
        geom, num_devices, tp, gpu, hbm_bytes, weights_bytes, runtime_bytes, pool_bytes
    )

    sizing = size_node(
        geom,
        contexts,
        pool_bytes=pool,
        num_devices=num_devices,
        tp=tp,
        headroom=headroom,
        output_tokens=output_tokens,
        shared_tokens=shared_tokens,
        block_size=block_size,
        static_max_tokens=static_max_tokens,
        num_sequences=sequences,
    )
    return _size_json(
        config, geom, sizing, tp, num_devices, memory, headroom, output_tokens, shared_tokens
    )


def _size_pool(
    geom: Any,
    num_devices: int,
    tp: int,
    gpu: str | None,
    hbm_bytes: str | None,
    weights_bytes: str | None,
    runtime_bytes: str | None,
    pool_bytes: str | None,
) -> tuple[int | None, dict[str, Any]]:
    """The KV pool over all devices (None: unknown) and where it came from: --pool-bytes, or
    device memory (--gpu or --hbm-bytes) minus weights and the runtime reserve."""
    from agentkv.capacity import kv_pool_bytes, weights_bytes_per_device
    from agentkv.hardware import get_preset

    memory: dict[str, Any] = {"source": None}
    pool = _bytes_opt(pool_bytes, "--pool-bytes")
    if pool is not None:
        if pool <= 0:
            raise ConfigError("--pool-bytes must be positive")
        memory["source"] = "--pool-bytes"
    else:
        device_total = _bytes_opt(hbm_bytes, "--hbm-bytes")
        if gpu is not None:
            preset = get_preset(gpu)
            device_total = preset.memory_bytes * num_devices
            memory["source"] = f"{num_devices} x {preset.name} ({preset.nominal} each)"
        elif device_total is not None:
            memory["source"] = "--hbm-bytes"
        if device_total is not None:
            if device_total <= 0:
                raise ConfigError("--hbm-bytes must be positive")
            weights = _bytes_opt(weights_bytes, "--weights-bytes")
            if weights is None:
                if geom.num_parameters is None:
                    raise ConfigError(
                        "parameter count unknown for this config; give --weights-bytes"
                    )
                weights = (
                    weights_bytes_per_device(geom.num_parameters, geom.weight_dtype_bytes, tp)
                    * num_devices
                )
            runtime = _bytes_opt(runtime_bytes, "--runtime-bytes")
            if runtime is None:
                runtime = math.floor(device_total * _DEFAULT_RUNTIME_FRACTION)
            memory.update(hbm_bytes=device_total, weights_bytes=weights, runtime_bytes=runtime)
            pool = kv_pool_bytes(device_total, weights, runtime)

    return pool, memory


def _size_json(
    config: Path,
    geom: Any,
    sizing: Any,
    tp: int,
    num_devices: int,
    memory: dict[str, Any],
    headroom: float,
    output_tokens: int,
    shared_tokens: int,
) -> dict[str, Any]:
    """The report ``size --json`` prints (and the table is drawn from)."""
    paged = sizing.paged
    return {
        "model": {
            "config": str(config),
            "model_type": geom.model_type,
            "attention": geom.attention,
            "num_layers": geom.num_layers,
            "num_attention_layers": geom.num_attention_layers,
            "num_state_layers": geom.num_state_layers,
            "num_kv_heads": geom.num_kv_heads,
            "head_dim": geom.head_dim,
            "mla_latent_dim": geom.mla_latent_dim,
            "sliding_windows": sorted({w for w in geom.layer_windows if w is not None}),
            "max_position_embeddings": geom.max_position_embeddings,
            "num_parameters": geom.num_parameters,
            "weight_dtype_bytes": geom.weight_dtype_bytes,
        },
        "kv_dtype": geom.kv_dtype,
        "tp": tp,
        "gpus": num_devices,
        "bytes_per_token": sizing.bytes_per_token,
        "bytes_per_token_per_device": sizing.bytes_per_token_per_device,
        "state_bytes_per_sequence": geom.state_bytes_per_sequence(),
        "memory": memory,
        "kv_pool_bytes": sizing.kv_pool_bytes,
        "usable_pool_bytes": sizing.usable_pool_bytes,
        "headroom": headroom,
        "output_tokens": output_tokens,
        "shared_tokens": shared_tokens,
        "shared_bytes": sizing.shared_bytes,
        "paged": None
        if paged is None
        else {
            "block_size": paged.block_size,
            "block_bytes_per_device": paged.block_bytes,
            "num_blocks_per_device": paged.num_blocks,
            "token_capacity_per_device": paged.token_capacity,
            "expected_tail_waste_tokens": paged.expected_tail_waste_tokens,
        },
        "contexts": [
            {
                "tokens": row.tokens,
                "bytes": row.bytes,
                "bytes_per_device": row.bytes_per_device,
                "max_trajectories": row.max_trajectories,
                "max_trajectories_shared": row.max_trajectories_shared,
                "static_max_requests": row.static_max_requests,
                "static_allocation_efficiency": row.static_allocation_efficiency,
                "tail_waste_bytes": row.tail_waste_bytes,
                "fragmentation_ratio": row.fragmentation_ratio,
                "beyond_max_position": row.beyond_max_position,
            }
            for row in sizing.contexts
        ],
        "warnings": sizing.warnings,
    }


def _print_size(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    err = Console(stderr=True)
    model = report["model"]
    console.print(
        f"[bold]{model['model_type']}[/] ({model['attention']}, {model['num_attention_layers']} "
        f"attention layers), KV {report['kv_dtype']}, TP={report['tp']}, {report['gpus']} device(s)"
    )
    console.print(
        f"KV per token: {report['bytes_per_token']:,} B whole model, "
        f"{report['bytes_per_token_per_device']:,} B per device"
    )
    if report["state_bytes_per_sequence"]:
        console.print(f"SSM state per sequence: {_both_units(report['state_bytes_per_sequence'])}")
    memory = report["memory"]
    if "hbm_bytes" in memory:
        console.print(
            f"Memory ({memory['source']}): {_both_units(memory['hbm_bytes'])} - weights "
            f"{_both_units(memory['weights_bytes'])} - runtime {_both_units(memory['runtime_bytes'])}"
        )
    if report["kv_pool_bytes"] is not None:
        console.print(
            f"KV pool: {_both_units(report['kv_pool_bytes'])}; usable after "
            f"{report['headroom']:.0%} headroom: {_both_units(report['usable_pool_bytes'])}"
        )
    table = Table(title="Per trajectory (GB = 10^9 B, GiB = 2^30 B)")
    table.add_column("context", justify="right")
    table.add_column("KV per trajectory (GB / GiB)", justify="right")
    table.add_column("max trajectories", justify="right")
    if report["shared_tokens"]:
        table.add_column(f"with {report['shared_tokens']:,} shared", justify="right")
    table.add_column("static reservation", justify="right")
    table.add_column("tail waste", justify="right")
    for row in report["contexts"]:
        cells = [f"{row['tokens']:,}", _both_units(row["bytes"]), _count(row["max_trajectories"])]
        if report["shared_tokens"]:
            cells.append(_count(row["max_trajectories_shared"]))
        if row["static_max_requests"] is None:
            cells.append("-")
        else:
            cells.append(
                f"{row['static_max_requests']} ({row['static_allocation_efficiency']:.1%} used)"
            )
        ratio = row["fragmentation_ratio"]
        cells.append("-" if ratio is None else f"{ratio:.2%}")
        table.add_row(*cells)
    console.print(table)
    for warning in report["warnings"]:
        err.print(f"[yellow]warning:[/] {warning}")


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


# ---- plan ---------------------------------------------------------------------------------


def _plan_report(
    *,
    config: Path,
    context: int,
    trajectories: int | None,
    arrival_rate: float | None,
    gen_seconds: float,
    tool_seconds: float,
    kv_dtype: str | None,
    gpu: str | None,
    hbm_bytes_per_gpu: str | None,
    runtime_bytes_per_gpu: str | None,
    weights_bytes: str | None,
    tp: int | None,
    pp: int,
    gpus_per_node: int,
    headroom: float,
    output_tokens: int,
    shared_tokens: int,
) -> dict[str, Any]:
    from agentkv.geometry import ModelGeometry
    from agentkv.hardware import get_preset

    if context <= 0:
        raise ConfigError(f"--context must be positive, got {context}")
    if shared_tokens > context:
        raise ConfigError(f"--shared-tokens {shared_tokens} is longer than --context {context}")
    if (trajectories is None) == (arrival_rate is None):
        raise ConfigError("give exactly one of --trajectories or --arrival-rate")
    if (gpu is None) == (hbm_bytes_per_gpu is None):
        raise ConfigError("give exactly one of --gpu or --hbm-bytes-per-gpu")
    if pp < 1:
        raise ConfigError(f"--pp must be >= 1, got {pp}")
    geom = ModelGeometry.from_hf_config(config, kv_dtype=kv_dtype)
    warnings = list(geom.warnings)
    if geom.max_position_embeddings is not None and context > geom.max_position_embeddings:
        warnings.append(
            f"context {context} exceeds max_position_embeddings {geom.max_position_embeddings}"
        )
    device = (
        get_preset(gpu).memory_bytes
        if gpu
        else _bytes_opt(hbm_bytes_per_gpu, "--hbm-bytes-per-gpu")
    )
    assert device is not None
    runtime = _bytes_opt(runtime_bytes_per_gpu, "--runtime-bytes-per-gpu")
    if runtime is None:
        runtime = math.floor(device * _DEFAULT_RUNTIME_FRACTION)
    weights = _bytes_opt(weights_bytes, "--weights-bytes")

    targets, littles_law = _plan_targets(trajectories, arrival_rate, gen_seconds, tool_seconds)
    degrees = [tp] if tp is not None else [d for d in (1, 2, 4, 8) if d <= gpus_per_node]
    plan = {
        "context_tokens": context,
        "device_bytes": device,
        "pp": pp,
        "runtime_bytes_per_device": runtime,
        "weights_bytes_per_replica": weights,
        "headroom": headroom,
        "output_tokens": output_tokens,
        "shared_tokens": shared_tokens,
        "devices_per_node": gpus_per_node,
    }
    answers = {
        label: _plan_answer(geom, target, degrees, plan) for label, target in targets.items()
    }
    return {
        "model_type": geom.model_type,
        "kv_dtype": geom.kv_dtype,
        "context_tokens": context,
        "output_tokens": output_tokens,
        "shared_tokens": shared_tokens,
        "device_bytes": device,
        "runtime_bytes_per_device": runtime,
        "bytes_per_trajectory": geom.kv_bytes(context + output_tokens)
        + geom.state_bytes_per_sequence(),
        "littles_law": littles_law,
        "plans": answers,
        "warnings": warnings,
    }


def _plan_targets(
    trajectories: int | None, arrival_rate: float | None, gen_seconds: float, tool_seconds: float
) -> tuple[dict[str, int], dict[str, Any] | None]:
    """Resident trajectories to plan for: --trajectories, or by Little's law from the arrival
    rate both without and with offload (then also the law's figures for the report)."""
    from agentkv.capacity import littles_law_concurrency

    if arrival_rate is None:
        assert trajectories is not None
        if trajectories <= 0:
            raise ConfigError(f"--trajectories must be positive, got {trajectories}")
        return {"without_offload": trajectories}, None
    wait = littles_law_concurrency(arrival_rate, gen_seconds, tool_seconds)
    targets = {
        "without_offload": max(1, math.ceil(wait.resident_without_offload)),
        "with_offload": max(1, math.ceil(wait.resident_with_offload)),
    }
    return targets, {
        "arrival_rate_per_s": arrival_rate,
        "gen_seconds": gen_seconds,
        "tool_seconds": tool_seconds,
        "in_flight": wait.in_flight,
        "paused": wait.paused,
        "resident_without_offload": wait.resident_without_offload,
        "resident_with_offload": wait.resident_with_offload,
    }


def _plan_answer(
    geom: Any, target: int, degrees: list[int], plan: dict[str, Any]
) -> dict[str, Any]:
    """The plan for ``target`` trajectories at each TP degree that fits, and the one with the
    fewest GPUs; ``plan`` holds plan_devices' other keyword arguments. Raises the last
    ConfigError when no degree fits."""
    from agentkv.capacity import PlanOption, plan_devices

    options: list[PlanOption] = []
    last_error: ConfigError | None = None
    for degree in degrees:
        try:
            geom.kv_heads_per_device(degree)
            options.append(plan_devices(geom, trajectories=target, tp=degree, **plan))
        except ConfigError as exc:
            last_error = exc
    if not options:
        raise last_error or ConfigError("no tensor-parallel degree fits")
    best = min(options, key=lambda o: (o.devices, o.tp))
    return {
        "target_trajectories": target,
        "best": _option_json(best),
        "options": [_option_json(o) for o in options],
    }


def _option_json(option: Any) -> dict[str, Any]:
    return {
        "tp": option.tp,
        "trajectories_per_replica": option.trajectories_per_replica,
        "replicas": option.replicas,
        "gpus": option.devices,
        "nodes": option.nodes,
        "usable_pool_bytes_per_replica": option.usable_pool_bytes_per_replica,
    }


def _print_plan(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[bold]{report['model_type']}[/], {report['context_tokens']:,}-token context, "
        f"{_both_units(report['bytes_per_trajectory'])} KV per trajectory "
        "(GB = 10^9 B, GiB = 2^30 B)"
    )
    wait = report["littles_law"]
    if wait is not None:
        console.print(
            f"Little's law: {wait['in_flight']:.1f} trajectories in flight, "
            f"{wait['paused']:.1f} paused on tools at any moment"
        )
    for label, answer in report["plans"].items():
        table = Table(
            title=f"{label.replace('_', ' ')}: {answer['target_trajectories']:,} resident trajectories"
        )
        for column in ("TP", "per replica", "replicas", "GPUs", "nodes"):
            table.add_column(column, justify="right")
        for option in answer["options"]:
            mark = " *" if option == answer["best"] else ""
            table.add_row(
                f"{option['tp']}{mark}",
                f"{option['trajectories_per_replica']:,}",
                f"{option['replicas']:,}",
                f"{option['gpus']:,}",
                f"{option['nodes']:,}",
            )
        console.print(table)
    err = Console(stderr=True)
    for warning in report["warnings"]:
        err.print(f"[yellow]warning:[/] {warning}")
