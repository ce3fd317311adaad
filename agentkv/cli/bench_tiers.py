"""``agentkv bench tiers``: tier bandwidth against this machine's copy and sequential-I/O baselines."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from agentkv.cli.common import fail

# The options (typer Annotated aliases; the defaults are in the signature).
DEFAULT_BLOCK_KIB = [256, 1024, 4096]  # never mutated: typer copies list options
DEFAULT_BATCH = [1, 8, 64, 512]
DiskDir = Annotated[
    Path | None,
    typer.Option(
        "--disk-dir",
        help="Directory for the disk tier and its baseline file. Default: the system temp directory.",
    ),
]
NoDisk = Annotated[bool, typer.Option("--no-disk", help="Measure the host tier only.")]
BlockKib = Annotated[
    list[int],
    typer.Option("--block-kib", help="Block size in KiB; repeat the flag for several sizes."),
]
TotalMib = Annotated[
    int, typer.Option("--total-mib", min=1, help="Bytes moved per measurement, in MiB.")
]
Workers = Annotated[int, typer.Option("--workers", min=1, help="Transfer threads of the store.")]
Repeats = Annotated[
    int, typer.Option("--repeats", min=1, help="Runs per measurement; the best one counts.")
]
Device = Annotated[
    str,
    typer.Option(
        "--device",
        help="Also measure the torch path the vLLM plugin uses, with KV blocks as tensors on this "
        "device: cpu, cuda, or none.",
    ),
]
Layers = Annotated[
    int,
    typer.Option(
        "--layers",
        min=1,
        help="With --device: layers per block (2 segments each, K and V, as in FlashAttention).",
    ),
]
Batch = Annotated[
    list[int],
    typer.Option(
        "--batch",
        help="With --device: blocks per call (shuffled block ids); repeat the flag for several. "
        "Batches larger than the blocks of one run (--total-mib / block size) are skipped.",
    ),
]
Remote = Annotated[
    str | None,
    typer.Option(
        "--remote",
        help="Also measure the remote tier on this Valkey/Redis URL (valkey://host:port/0, "
        "valkeys:// for TLS, options as ?query; see docs/remote-tier.md), or 'embedded' to start "
        "a private valkey-server for the run.",
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print only machine-readable JSON on stdout.")]


def tiers(
    disk_dir: DiskDir = None,
    no_disk: NoDisk = False,
    block_kib: BlockKib = DEFAULT_BLOCK_KIB,
    total_mib: TotalMib = 256,
    workers: Workers = 4,
    repeats: Repeats = 3,
    device: Device = "none",
    layers: Layers = 32,
    batch: Batch = DEFAULT_BATCH,
    remote: Remote = None,
    as_json: AsJson = False,
) -> None:
    """Measure host store/load and disk write/read GB/s, each next to a baseline from the same run.

    Baselines: one large in-memory copy (host) and sequential file I/O of the same size in the same
    mode, O_DIRECT or buffered (disk). With --device cpu|cuda, also device->host store and
    host->device load of torch-tensor blocks through the plugin's batched data path, in calls of
    --batch shuffled blocks, next to a memcpy (CPU) or a pinned torch copy (CUDA) of the same
    bytes (CPU: also the cpu ratio, bytes per CPU-second over the memcpy's, which other
    processes on the cores move less), and device<->disk next to sequential I/O. Targets: ratio >= 0.70 for blocks of 1 MiB
    and up (0.80 for device<->host at batches of 8+). With --remote, remote put/get next to a raw pipelined SET/GET of
    the same values with a plain client (no target: the link decides).
    """
    if any(size <= 0 for size in block_kib):
        fail("--block-kib values must be positive")
    if any(size <= 0 for size in batch):
        fail("--batch values must be positive")
    if device not in ("none", "cpu", "cuda"):
        fail(f"--device must be cpu, cuda or none, not {device!r}")
    directory = None if no_disk else (disk_dir or Path(tempfile.gettempdir()))
    server, remote_config = _remote(remote)
    try:
        report = _measure(
            [size << 10 for size in block_kib],
            total_mib << 20,
            directory,
            workers=workers,
            repeats=repeats,
            device=None if device == "none" else device,
            layers=layers,
            remote=remote_config,
            batches=batch,
        )
    except OSError as exc:
        fail(f"cannot benchmark the disk tier in {directory}: {exc.strerror or exc}")
    except (RuntimeError, MemoryError) as exc:
        fail(f"benchmark failed: {exc}")
    finally:
        if server is not None:
            server.stop()
    if as_json:
        typer.echo(json.dumps(dataclasses.asdict(report)))
        return
    _print_report(report, total_mib, workers, embedded=server is not None)


def _remote(remote: str | None) -> tuple[Any, Any]:
    """The private valkey-server (for 'embedded') and the remote tier's config, or Nones;
    a bad URL or a server that does not start is a one-line error."""
    from agentkv.errors import ConfigError
    from agentkv.tiers.remote import RemoteConfig
    from agentkv.tiers.valkey_server import ValkeyProcess

    try:
        if remote == "embedded":
            server = ValkeyProcess().start()
            return server, RemoteConfig.parse(server.url)
        if remote is not None:
            return None, RemoteConfig.parse(remote)
    except ConfigError as exc:
        fail(f"--remote: {exc}")
    except RuntimeError as exc:
        fail(f"--remote embedded: {exc}")
    return None, None


def _measure(block_sizes: list[int], total: int, directory: Path | None, **options: Any) -> Any:
    """run_tier_bench under a spinner on stderr that names the measurement running."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from agentkv.tiers.bench import run_tier_bench

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        task = progress.add_task("starting", total=None)
        return run_tier_bench(
            block_sizes,
            total,
            directory,
            progress=lambda label: progress.update(task, description=label),
            **options,
        )


def _print_report(report: Any, total_mib: int, workers: int, *, embedded: bool) -> None:
    """The measurements as a table, then the disk mode, the remote and the device path."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"agentkv tiers: {total_mib} MiB per run, {workers} workers")
    columns = (
        "operation",
        "block",
        "batch",
        "GB/s",
        "baseline",
        "baseline GB/s",
        "ratio",
        "cpu ratio",
        "target",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("operation", "baseline") else "right")
    for m in report.measurements:
        verdict = "-" if m.passed is None else ("[green]ok[/]" if m.passed else "[red]below[/]")
        table.add_row(
            m.operation,
            f"{m.block_bytes >> 10} KiB",
            "all" if m.batch is None else str(m.batch),
            f"{m.gbps:.2f}",
            m.baseline,
            f"{m.baseline_gbps:.2f}",
            f"{m.ratio:.2f}",
            "-" if m.cpu_ratio is None else f"{m.cpu_ratio:.2f}",
            f">= {m.target:.2f} {verdict}" if m.target is not None else "-",
        )
    console = Console()
    console.print(table)
    if report.disk_dir is not None:
        mode = "O_DIRECT" if report.direct_io else "buffered (O_DIRECT unsupported here)"
        console.print(f"disk tier in {report.disk_dir}: {mode}")
    if report.remote is not None:
        where = "a private valkey-server" if embedded else report.remote
        console.print(f"remote tier on {where}: no target (the network decides)")
    if report.device is not None:
        pinned = "pinned" if report.pinned_memory else "pageable"
        gds = {None: "n/a", True: "present", False: "absent"}[report.gds]
        console.print(
            f"device path: {report.device} tensors, {report.layers} layers x 2 segments per "
            f"block; host arena {pinned}; GPUDirect Storage {gds}; batch = blocks per call"
        )
        if report.native_copies is not None:
            how = "one native call per block (numba)" if report.native_copies else "numpy per run"
            console.print(
                f"cpu copies: {how}; cpu ratio = bytes per CPU-second of the process over the "
                "memcpy's (less sensitive to other processes on the cores)"
            )
        if report.skipped:
            console.print(f"skipped (raise --total-mib): {', '.join(report.skipped)}")


def register(app: typer.Typer) -> None:
    """Add ``tiers`` to the ``bench`` sub-app."""
    app.command("tiers")(tiers)
