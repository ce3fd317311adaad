"""``agentkv decide`` and ``agentkv calibrate``: the pause decision and the numbers it rests on.

Primitives:
    register     add both commands to the root app
    decide_cmd   price one pause (reload, round trip, recompute, T*, hold cost) and pick an action
    calibrate_cmd  measure host copy, host<->device, disk and prefill rates; write the profile JSON

Heavy modules (numpy, torch, httpx, geometry) are imported inside the commands so that
``agentkv --help`` stays fast.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer

from agentkv.cli.common import fail


def _rate(text: str | None, flag: str) -> float | None:
    """A positive finite rate: a plain number (5e10) or a byte size per second (50GB, 12GiB)."""
    if text is None:
        return None
    from agentkv.errors import ConfigError
    from agentkv.units import parse_bytes

    try:
        value = float(text)
    except ValueError:
        try:
            value = float(parse_bytes(text))
        except ConfigError as exc:
            raise ConfigError(f"{flag}: {exc}") from exc
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{flag} must be a positive finite number, got {text!r}")
    return value


def _bytes(text: str | None, flag: str) -> int | None:
    if text is None:
        return None
    from agentkv.errors import ConfigError
    from agentkv.units import parse_bytes

    try:
        return parse_bytes(text)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from exc


def _fmt_seconds(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if math.isinf(value):
        return "inf"
    if value < 1.0:
        return f"{value * 1e3:,.1f} ms"
    return f"{value:,.3f} s"


def _resolve_inputs(
    *,
    tokens: int,
    model: Path | None,
    kv_dtype: str | None,
    tp: int,
    kv_bytes: str | None,
    params: float | None,
) -> tuple[int, float | None, int, int]:
    """(kv bytes, parameters, attention layers, hidden size) from either input form."""
    from agentkv.errors import ConfigError

    if tokens <= 0:
        raise ConfigError(f"--tokens must be a positive integer, got {tokens}")
    if params is not None and (not math.isfinite(params) or params <= 0):
        raise ConfigError(f"--params must be a positive number, got {params}")
    if model is not None and kv_bytes is not None:
        raise ConfigError("give either --model or --kv-bytes, not both")
    if model is not None:
        from agentkv.geometry import ModelGeometry

        geom = ModelGeometry.from_hf_config(model, kv_dtype=kv_dtype)
        m = geom.kv_bytes(tokens, tp=tp) + geom.state_bytes_per_sequence(tp=tp)
        p = params if params is not None else geom.num_parameters
        return m, p, geom.num_attention_layers, geom.hidden_size
    if kv_bytes is None:
        raise ConfigError("give --model CONFIG or --kv-bytes M (with --params P)")
    m_bytes = _bytes(kv_bytes, "--kv-bytes")
    assert m_bytes is not None
    return m_bytes, params, 0, 0


def decide_cmd(
    tokens: int = typer.Option(..., "--tokens", help="Tokens S of the paused trajectory."),
    model: Path | None = typer.Option(
        None,
        "--model",
        help="HF config.json (or its folder) of the served model: gives KV bytes, parameters, "
        "layers and hidden size. Excludes --kv-bytes.",
    ),
    kv_dtype: str | None = typer.Option(
        None, "--kv-dtype", help="KV element type with --model: bf16, fp16, fp8, int8, fp32."
    ),
    tp: int = typer.Option(
        1, "--tp", min=1, help="Tensor parallel ranks with --model: KV bytes per rank."
    ),
    kv_bytes: str | None = typer.Option(
        None, "--kv-bytes", help="KV bytes M held by the trajectory (10.7GB, 5GiB, 1e10)."
    ),
    params: float | None = typer.Option(
        None,
        "--params",
        help="Model parameters P (70.6e9); needed with --prefill-flops unless --model gives it.",
    ),
    prefill_flops: float | None = typer.Option(
        None,
        "--prefill-flops",
        help="Sustained prefill FLOP/s R: recompute = (2PS + 4LS^2d)/R. Excludes "
        "--prefill-tokens-per-s.",
    ),
    prefill_tokens_per_s: float | None = typer.Option(
        None,
        "--prefill-tokens-per-s",
        help="Measured prefill tokens/s T (agentkv calibrate --server): recompute = S/T.",
    ),
    link: str = typer.Option(
        ...,
        "--link-bytes-per-s",
        help="Device<->host bandwidth B per second (512e9, 50GB, 25GiB): reload = M/B.",
    ),
    wait: float = typer.Option(
        ..., "--wait", help="Expected tool wait W in seconds (inf for 'indefinitely')."
    ),
    pressure: float = typer.Option(
        1.0,
        "--pressure",
        help="Device KV pool use U in [0, 1]. Default 1: a constrained pool, where T* equals the "
        "round trip as in the reference's worked examples.",
    ),
    disk_write: str | None = typer.Option(
        None,
        "--disk-write-bytes-per-s",
        help="Disk write bandwidth per second; with --disk-read-bytes-per-s enables the disk tier.",
    ),
    disk_read: str | None = typer.Option(
        None, "--disk-read-bytes-per-s", help="Disk read bandwidth per second."
    ),
    host_free: str | None = typer.Option(
        None, "--host-free", help="Free bytes in the host tier (default: unlimited)."
    ),
    disk_free: str | None = typer.Option(
        None, "--disk-free", help="Free bytes in the disk tier (default: unlimited)."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the decision as JSON on stdout (nothing else)."
    ),
) -> None:
    """Price one pause and decide: retain, offload to host or disk, or drop and recompute."""
    from agentkv.costs import CostModel
    from agentkv.errors import ConfigError
    from agentkv.policy import decide

    try:
        if (prefill_flops is None) == (prefill_tokens_per_s is None):
            raise ConfigError("give exactly one of --prefill-flops and --prefill-tokens-per-s")
        for flag, value in (
            ("--prefill-flops", prefill_flops),
            ("--prefill-tokens-per-s", prefill_tokens_per_s),
        ):
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise ConfigError(f"{flag} must be a positive finite number, got {value}")
        if math.isnan(wait) or wait < 0:
            raise ConfigError(f"--wait must be a non-negative number of seconds, got {wait}")
        if math.isnan(pressure) or not 0.0 <= pressure <= 1.0:
            raise ConfigError(f"--pressure must lie in [0, 1], got {pressure}")
        if (disk_write is None) != (disk_read is None):
            raise ConfigError("give both --disk-write-bytes-per-s and --disk-read-bytes-per-s")
        m, p, layers, hidden = _resolve_inputs(
            tokens=tokens, model=model, kv_dtype=kv_dtype, tp=tp, kv_bytes=kv_bytes, params=params
        )
        if prefill_flops is not None and p is None:
            raise ConfigError("--prefill-flops needs the parameter count: pass --params")
        costs = CostModel(
            host_link_bytes_per_s=_rate(link, "--link-bytes-per-s"),
            disk_write_bytes_per_s=_rate(disk_write, "--disk-write-bytes-per-s"),
            disk_read_bytes_per_s=_rate(disk_read, "--disk-read-bytes-per-s"),
            prefill_tokens_per_s=prefill_tokens_per_s,
            prefill_flops_per_s=prefill_flops,
            model_params=p,
            num_layers=layers,
            hidden_size=hidden,
        )
        decision = decide(
            tokens=tokens,
            kv_bytes=m,
            wait=wait,
            costs=costs,
            pressure=pressure,
            host_free_bytes=_bytes(host_free, "--host-free"),
            disk_free_bytes=_bytes(disk_free, "--disk-free"),
        )
    except ConfigError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(decision.to_dict()))
        return
    _print_decision(decision.to_dict())


def _print_decision(d: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from agentkv.units import format_bytes

    table = Table(title=f"pause decision: [bold]{d['action']}[/bold]", show_header=False)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    ratio = d["recompute_over_reload"]
    rows = [
        ("tokens S", f"{d['tokens']:,}"),
        ("KV bytes M", format_bytes(int(d["kv_bytes"]), "auto")),
        ("wait W (p50)", _fmt_seconds(d["wait_p50_s"])),
        ("pool pressure U", f"{d['pressure']:.2f}"),
        ("reload M/B", _fmt_seconds(d["reload_s"])),
        ("round trip 2M/B", _fmt_seconds(d["round_trip_s"])),
        ("recompute", _fmt_seconds(d["recompute_s"])),
        ("recompute / reload", "inf" if ratio is None else f"{ratio:,.1f}x"),
        ("break-even wait T*", _fmt_seconds(d["break_even_wait_s"])),
        (
            "hold cost M*W",
            "-" if d["hold_cost_byte_s"] is None else f"{d['hold_cost_byte_s'] / 1e9:,.1f} GB·s",
        ),
        ("lease", _fmt_seconds(d["lease_s"])),
        ("prefetch at", _fmt_seconds(d["prefetch_at_s"])),
        ("resume stall (evicted)", _fmt_seconds(d["expected_resume_stall_s"])),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console = Console()
    console.print(table)
    console.print(d["rationale"], markup=False, soft_wrap=True)


def calibrate_cmd(
    disk_dir: Path | None = typer.Option(
        None,
        "--disk-dir",
        help="Directory to measure disk write/read in (use the disk tier's directory). "
        "Default: the profile's directory.",
    ),
    no_disk: bool = typer.Option(False, "--no-disk", help="Skip the disk measurement."),
    server: str | None = typer.Option(
        None,
        "--server",
        help="OpenAI-compatible server URL (http://127.0.0.1:8000) to measure prefill tokens/s.",
    ),
    model: str | None = typer.Option(
        None, "--model", help="Served model name for --server (default: the first listed)."
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="AGENTKV_API_KEY", help="API key for --server."
    ),
    prompt_tokens: int = typer.Option(
        2048, "--prompt-tokens", help="Length of the long prefill prompt (capped by the model)."
    ),
    size: str = typer.Option(
        "256MiB", "--size", help="Buffer and disk file size per measurement (256MiB, 1GiB)."
    ),
    output: Path | None = typer.Option(
        None,
        "--output",
        "-o",
        help="Where to write the profile. Default: $AGENTKV_PROFILE or "
        "~/.cache/agentkv/profile.json.",
    ),
    no_save: bool = typer.Option(False, "--no-save", help="Measure and print; write nothing."),
    as_json: bool = typer.Option(
        False, "--json", help="Print the profile as JSON on stdout (progress goes to stderr)."
    ),
    load: bool = typer.Option(
        False,
        "--load",
        help="With --server: measure the engine under load (prefill vs chunk and context, "
        "decode step vs batch and context, admission) and write an engine profile for "
        "`agentkv simulate --calibration` (docs/simulate.md) to --output.",
    ),
    max_batched_tokens: int = typer.Option(
        2048, "--max-batched-tokens", help="With --load: the server's max_num_batched_tokens."
    ),
    quick: bool = typer.Option(
        False, "--quick", help="With --load: short prompts and small batches (minutes)."
    ),
) -> None:
    """Measure this machine (host copy, host<->device, disk, prefill) and save the profile."""
    from rich.console import Console

    if load:
        from agentkv.cli.simulate_validate import calibrate_load

        if server is None:
            fail("--load needs --server")
        assert server is not None
        calibrate_load(server, model, max_batched_tokens, output, as_json, quick)
        return

    from agentkv.calibrate import calibrate
    from agentkv.errors import ConfigError, EngineUnavailableError
    from agentkv.profile import default_profile_path, save_profile

    err = Console(stderr=True)
    try:
        nbytes = _bytes(size, "--size")
        assert nbytes is not None
        target = output if output is not None else default_profile_path()
        directory: Path | None = None
        if not no_disk:
            directory = disk_dir if disk_dir is not None else target.parent
            if disk_dir is None:
                directory.mkdir(parents=True, exist_ok=True)
        with err.status("calibrating") as status:
            profile = calibrate(
                disk_dir=directory,
                server=server,
                model=model,
                api_key=api_key,
                nbytes=nbytes,
                prompt_tokens=prompt_tokens,
                progress=lambda line: status.update(f"measuring {line}"),
            )
        written = None if no_save else save_profile(profile, target)
    except (ConfigError, EngineUnavailableError, OSError) as exc:
        fail(str(exc))
    data = profile.to_dict()
    if as_json:
        typer.echo(json.dumps({"profile": data, "path": str(written) if written else None}))
        return
    _print_profile(data, written)


def _print_profile(data: dict[str, Any], written: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hardware profile", show_header=False)
    table.add_column("rate")
    table.add_column("value", justify="right")

    def gbps(v: float | None) -> str:
        return "not measured" if v is None else f"{v / 1e9:,.2f} GB/s"

    table.add_row("host copy", gbps(data["host_copy_bytes_per_s"]))
    table.add_row("host -> device", gbps(data["host_to_device_bytes_per_s"]))
    table.add_row("device -> host", gbps(data["device_to_host_bytes_per_s"]))
    direct = " (O_DIRECT)" if data["disk_direct_io"] else " (page cache dropped)"
    disk_note = direct if data["disk_dir"] else ""
    table.add_row("disk write" + disk_note, gbps(data["disk_write_bytes_per_s"]))
    table.add_row("disk read" + disk_note, gbps(data["disk_read_bytes_per_s"]))
    prefill = data["prefill_tokens_per_s"]
    table.add_row("prefill", "not measured" if prefill is None else f"{prefill:,.0f} tokens/s")
    console = Console()
    console.print(table)
    console.print(f"saved to {written}" if written else "not saved (--no-save)", markup=False)


def register(app: typer.Typer) -> None:
    """Add ``decide`` and ``calibrate`` to ``app``."""
    app.command("decide")(decide_cmd)
    app.command("calibrate")(calibrate_cmd)
