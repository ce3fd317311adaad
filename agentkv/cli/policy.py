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

from agentkv.cli import policy_options as options
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
    *,
    tokens: options.Tokens,
    model: options.Model = None,
    kv_dtype: options.KvDtype = None,
    tp: options.Tp = 1,
    kv_bytes: options.KvBytes = None,
    params: options.Params = None,
    prefill_flops: options.PrefillFlops = None,
    prefill_tokens_per_s: options.PrefillTokensPerS = None,
    link: options.Link,
    wait: options.Wait,
    pressure: options.Pressure = 1.0,
    disk_write: options.DiskWrite = None,
    disk_read: options.DiskRead = None,
    host_free: options.HostFree = None,
    disk_free: options.DiskFree = None,
    as_json: options.AsJson = False,
) -> None:
    """Price one pause and decide: retain, offload to host or disk, or drop and recompute."""
    from agentkv.costs import CostModel
    from agentkv.errors import ConfigError
    from agentkv.policy import decide

    try:
        _check_decide_flags(
            prefill_flops=prefill_flops,
            prefill_tokens_per_s=prefill_tokens_per_s,
            wait=wait,
            pressure=pressure,
            disk_write=disk_write,
            disk_read=disk_read,
        )
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


def _check_decide_flags(
    *,
    prefill_flops: float | None,
    prefill_tokens_per_s: float | None,
    wait: float,
    pressure: float,
    disk_write: str | None,
    disk_read: str | None,
) -> None:
    """ConfigError unless exactly one prefill rate, positive and finite, a wait >= 0, a pressure
    in [0, 1] and both disk bandwidths or neither were given."""
    from agentkv.errors import ConfigError

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
    disk_dir: options.DiskDir = None,
    no_disk: options.NoDisk = False,
    server: options.Server = None,
    model: options.CalibrateModel = None,
    api_key: options.ApiKey = None,
    prompt_tokens: options.PromptTokens = 2048,
    size: options.Size = "256MiB",
    output: options.Output = None,
    no_save: options.NoSave = False,
    as_json: options.CalibrateAsJson = False,
    load: options.Load = False,
    max_batched_tokens: options.MaxBatchedTokens = 2048,
    quick: options.Quick = False,
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
