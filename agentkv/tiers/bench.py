"""Tier bandwidth next to this machine's own baselines, measured in the same run.

Primitives:
    Measurement        one operation at one block size: achieved GB/s, the baseline's GB/s, their
                       ratio and whether it meets the target (None when no target applies).
    TierBenchReport    every measurement plus the setup (bytes moved, I/O mode, workers, device).
    run_tier_bench     host store/load against a large plain memory copy; disk write/read against
                       sequential I/O of the same size in the same mode (O_DIRECT or buffered).
                       With ``device`` ('cpu' or 'cuda'), also the data path the vLLM plugin
                       uses (batched.py): blocks held as torch tensors in a FlashAttention-style
                       layout (``[2, num_blocks, ...]`` per layer, so 2 x layers runs per block),
                       moved in calls of 1, 8, 64, 512 shuffled block ids (``batches``), stored
                       to and loaded from the host tier against a memcpy of the same bytes (CPU)
                       (re-measured next to each run) or a raw pinned torch copy between device
                       and host (CUDA), and to and from
                       the disk tier against sequential I/O. On CUDA with GPUDirect Storage
                       present, the disk runs are measured both staged and through GDS.
                       With ``remote`` (a RemoteConfig), the remote tier: put (store to tier
                       'remote') and get (a load that falls back to remote) through a store with no
                       local tiers, against a raw pipelined SET/GET of values of the same size
                       with a plain client on one connection (no header, checksum or gather), so
                       the ratio is agentkv's overhead, not the network. Keys live under a private
                       ``<key_prefix>:bench:<random>`` prefix and are deleted afterwards.

The baselines are in bench_baselines.py.

Targets (issue 5): ratio >= 0.7 for blocks of 1 MiB and up (host and disk; the remote tier has no
target: its link decides); issue 27: device<->host >= 0.8 at 1 MiB and up in batches of 8+. GB/s means 1e9 bytes per second.
Blocking and CPU-heavy: run it from a command, never from the engine loop.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agentkv.tier import Tier
from agentkv.tiers.batched import BlockTable, Run, StagedBlocks, staging_budget
from agentkv.tiers.bench_baselines import (
    best_of,
    best_with_cpu,
    gbps,
    memory_copy_baseline,
    memory_copy_rates,
    raw_remote_baseline,
    sequential_file_baseline,
    torch_copy_baseline,
    touched_buffer,
)
from agentkv.tiers.disk import ALIGN, probe_direct_io
from agentkv.tiers.keys import BlockKey, ModelFingerprint, block_keys
from agentkv.tiers.remote import RemoteBlocks, RemoteConfig
from agentkv.tiers.store import TieredStore

TARGET_RATIO = 0.7


def _bench_keys(fp: ModelFingerprint, salt: str, count: int) -> list[BlockKey]:
    """``count`` distinct keys under the real key scheme (stand-in block hashes per salt)."""
    return block_keys(fp, [f"{salt}|{i}".encode() for i in range(count)])


TARGET_MIN_BLOCK_BYTES = 1 << 20
DEVICE_TARGET_RATIO = 0.8  # issue 27: device<->host at 1 MiB+, batches of 8+ blocks per call
DEVICE_TARGET_MIN_BATCH = 8
BATCHES = (1, 8, 64, 512)


@dataclass(frozen=True, slots=True)
class Measurement:
    operation: str
    block_bytes: int
    gbps: float
    baseline: str
    baseline_gbps: float
    ratio: float
    target: float | None
    passed: bool | None
    batch: int | None = None
    """Blocks per call (the device path); None for one call of every block."""
    cpu_ratio: float | None = None
    """Device path on CPU: bytes per CPU-second of this process (every thread) over the
    memcpy's, best run of each. Other processes taking the cores move it less than the
    wall-clock ratio (the copy's cost, not its share of the cores); ones taking memory bandwidth
    still move it."""


@dataclass(slots=True)
class TierBenchReport:
    total_bytes: int
    workers: int
    disk_dir: str | None
    direct_io: bool | None
    measurements: list[Measurement] = field(default_factory=list)
    device: str | None = None
    layers: int | None = None
    pinned_memory: bool | None = None
    gds: bool | None = None
    remote: str | None = None
    """The remote tier's URL (no credentials), when measured."""
    skipped: list[str] = field(default_factory=list)
    """Device-path batch sizes larger than the blocks one run holds (raise total_bytes)."""
    native_copies: bool | None = None
    """Device path on CPU: whether blocks moved through the native batched copy (numba)."""


def _measure_store(
    store: TieredStore, block_bytes: int, total_bytes: int, tier: str, repeats: int, salt: str
) -> tuple[float, float]:
    # The remote tier skips blocks already on the server, so each store run starts without them.
    drop_tier: Tier | None = Tier.REMOTE if tier == Tier.REMOTE else None
    count = max(1, total_bytes // block_bytes)
    keys = _bench_keys(ModelFingerprint("bench", "uint8", 16, 1), salt, count)
    source = touched_buffer(count * block_bytes, 7).reshape(count, block_bytes)
    destination = touched_buffer(count * block_bytes).reshape(count, block_bytes)
    nbytes = count * block_bytes

    def store_once() -> float:
        store.drop(keys, tier=drop_tier)  # stores of present keys are skipped: start empty
        start = time.perf_counter()
        results = store.submit_store(keys, list(source), tier=tier).result()  # type: ignore[arg-type]
        elapsed = time.perf_counter() - start
        if not all(result.ok for result in results):
            raise RuntimeError(f"bench store failed: {next(r for r in results if not r.ok)}")
        return elapsed

    def load_once() -> float:
        start = time.perf_counter()
        results = store.submit_load(keys, list(destination)).result()
        elapsed = time.perf_counter() - start
        if not all(result.ok for result in results):
            raise RuntimeError(f"bench load failed: {next(r for r in results if not r.ok)}")
        return elapsed

    store_s = best_of(repeats, store_once)
    load_s = best_of(repeats, load_once)
    if not np.array_equal(source, destination):
        raise RuntimeError("bench round trip was not bit-exact")
    store.drop(keys, tier=drop_tier)
    return gbps(nbytes, store_s), gbps(nbytes, load_s)


def _measure_remote(
    config: RemoteConfig,
    block_sizes: Sequence[int],
    total_bytes: int,
    workers: int,
    repeats: int,
    step: Callable[[str], None],
    report: TierBenchReport,
) -> None:
    # A private prefix: the bench never reads, overwrites or deletes a deployment's blocks.
    prefix = f"{config.key_prefix}:bench:{uuid.uuid4().hex[:8]}"
    config = dataclasses.replace(config, key_prefix=prefix)
    report.remote = config.url
    with RemoteBlocks(config) as client:
        if not client.ping():
            raise RuntimeError(f"the remote tier at {config.url} does not answer PING")
        for block_bytes in block_sizes:
            step(f"raw client baseline ({block_bytes >> 10} KiB values)")
            raw_set, raw_get = raw_remote_baseline(config, block_bytes, total_bytes, repeats)
            step(f"remote tier, {block_bytes >> 10} KiB blocks")
            with TieredStore(0, None, 0, block_bytes, workers=workers, remote=client) as store:
                put, get = _measure_store(
                    store, block_bytes, total_bytes, "remote", repeats, "remote"
                )
            report.measurements.append(
                _measurement("remote put", block_bytes, put, "raw pipelined SET", raw_set, False)
            )
            report.measurements.append(
                _measurement("remote get", block_bytes, get, "raw pipelined GET", raw_get, False)
            )


class _DeviceBlocks:
    """``count`` blocks in device memory, FlashAttention-style: per layer one ``[2, count, seg]``
    uint8 tensor (K and V halves), random bytes in ``source``, zeros in ``destination``; each as a
    BlockTable (2 x layers runs per block), the way the plugin describes vLLM's KV cache."""

    def __init__(self, torch: Any, device: str, count: int, block_bytes: int, layers: int) -> None:
        self.torch = torch
        self.device = device
        segment = block_bytes // (2 * layers)
        generator = torch.Generator(device=device).manual_seed(0)
        self.source = [
            torch.randint(
                0, 256, (2, count, segment), dtype=torch.uint8, device=device, generator=generator
            )
            for _ in range(layers)
        ]
        self.destination = [torch.zeros_like(layer) for layer in self.source]

    @staticmethod
    def table(kv: list[Any]) -> BlockTable:
        runs: list[Run] = []
        for layer in kv:
            for half in (0, 1):
                runs.append(Run(layer[half], sum(r.size for r in runs)))
        return BlockTable(runs)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def exact(self) -> bool:
        return all(
            bool(self.torch.equal(a, b)) for a, b in zip(self.source, self.destination, strict=True)
        )


def _layers_for(block_bytes: int, layers: int) -> int:
    """The most layers <= ``layers`` that split a block into equal K/V segments."""
    layers = max(1, min(layers, block_bytes // 2))
    while layers > 1 and block_bytes % (2 * layers):
        layers -= 1
    return layers


def _batches(count: int, batch: int, seed: int) -> list[list[int]]:
    """A shuffled order of ``count`` block ids cut into calls of ``batch`` (the engine's block
    ids are scattered, so contiguous runs would flatter the copy)."""
    order = np.random.default_rng(seed).permutation(count).tolist()
    return [order[i : i + batch] for i in range(0, count, batch)]


def _submit_store(
    store: TieredStore, table: BlockTable, keys: list[Any], ids: list[int], tier: str
) -> Any:
    """One call the way the worker makes it: staged on CUDA, BlockRefs elsewhere."""
    if staging_budget(table, len(ids)) == len(ids):
        staged = StagedBlocks.gather(table, ids)
        return store.submit_store(keys, staged.rows, tier=tier), staged  # type: ignore[arg-type]
    return store.submit_store(keys, [table.block(i) for i in ids], tier=tier), None  # type: ignore[arg-type]


def _measure_device(
    store: TieredStore,
    torch: Any,
    device: str,
    block_bytes: int,
    total_bytes: int,
    tier: str,
    repeats: int,
    layers: int,
    salt: str,
    batch: int,
) -> tuple[float, float, float, float]:
    """(store GB/s, load GB/s, store and load GB per CPU-second) moving every block in calls of
    ``batch`` shuffled block ids, each call submitted and waited for in turn, through the
    plugin's data path (batched.py)."""
    count = max(1, total_bytes // block_bytes)
    keys = _bench_keys(ModelFingerprint("bench", "uint8", 16, layers), salt, count)
    kv = _DeviceBlocks(torch, device, count, block_bytes, _layers_for(block_bytes, layers))
    source, destination = kv.table(kv.source), kv.table(kv.destination)
    calls = _batches(count, batch, seed=count)
    nbytes = count * block_bytes
    kv.sync()

    def check(results: list[Any], what: str) -> None:
        if not all(result.ok for result in results):
            raise RuntimeError(f"bench {what} failed: {next(r for r in results if not r.ok)}")

    def store_once() -> float:
        store.drop(keys)
        start = time.perf_counter()
        for ids in calls:
            handle, _staged = _submit_store(store, source, [keys[i] for i in ids], ids, tier)
            check(handle.result(), "store")
        return time.perf_counter() - start

    def load_once() -> float:
        start = time.perf_counter()
        for ids in calls:
            call_keys = [keys[i] for i in ids]
            if staging_budget(destination, len(ids)) == len(ids):
                staged = StagedBlocks.for_load(destination, ids)
                check(store.submit_load(call_keys, staged.rows).result(), "load")  # type: ignore[arg-type]
                staged.scatter([True] * len(ids))
            else:
                refs = [destination.block(i) for i in ids]
                check(store.submit_load(call_keys, refs).result(), "load")  # type: ignore[arg-type]
        kv.sync()
        return time.perf_counter() - start

    store_s, store_cpu = best_with_cpu(repeats, store_once)
    load_s, load_cpu = best_with_cpu(repeats, load_once)
    kv.sync()
    if not kv.exact():
        raise RuntimeError("bench device round trip was not bit-exact")
    store.drop(keys)
    return (
        gbps(nbytes, store_s),
        gbps(nbytes, load_s),
        gbps(nbytes, store_cpu),
        gbps(nbytes, load_cpu),
    )


def _device_torch(device: str) -> Any:
    if device not in ("cpu", "cuda"):
        raise RuntimeError(f"unknown device {device!r} (cpu or cuda)")
    try:
        import torch
    except ImportError as exc:
        raise RuntimeError("the device benchmark needs torch") from exc
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    return torch


def _measurement(
    operation: str,
    block_bytes: int,
    gbps: float,
    baseline: str,
    baseline_gbps: float,
    has_target: bool = True,
    *,
    batch: int | None = None,
    target_ratio: float = TARGET_RATIO,
) -> Measurement:
    ratio = gbps / baseline_gbps if baseline_gbps > 0 else 0.0
    target = target_ratio if has_target and block_bytes >= TARGET_MIN_BLOCK_BYTES else None
    return Measurement(
        operation,
        block_bytes,
        gbps,
        baseline,
        baseline_gbps,
        ratio,
        target,
        None if target is None else ratio >= target,
        batch,
    )


def _measure_device_host(
    torch: Any,
    device: str,
    block_sizes: Sequence[int],
    total_bytes: int,
    batches: Sequence[int],
    baselines: tuple[str, float, str, float],
    options: tuple[int, int, int],
    step: Callable[[str], None],
    report: TierBenchReport,
) -> None:
    """device->host store and host->device load at every block size and batch size."""
    workers, repeats, layers = options
    down_name, down_gbps, up_name, up_gbps = baselines
    for block_bytes in block_sizes:
        count = max(1, total_bytes // block_bytes)
        with TieredStore(count * block_bytes, None, 0, block_bytes, workers=workers) as store:
            report.pinned_memory = store.stats().pinned_memory
            for batch in batches:
                if batch > count:
                    report.skipped.append(f"{block_bytes >> 10} KiB x {batch} blocks per call")
                    continue
                step(f"host tier from {device} tensors, {block_bytes >> 10} KiB x {batch}")
                stored, loaded, stored_cpu, loaded_cpu = _measure_device(
                    store,
                    torch,
                    device,
                    block_bytes,
                    total_bytes,
                    "host",
                    repeats,
                    layers,
                    "dh",
                    batch,
                )
                target = batch >= DEVICE_TARGET_MIN_BATCH
                copy_cpu = 0.0
                if device == "cpu":  # re-measured next to each run: shared machines drift
                    down_gbps, copy_cpu = memory_copy_rates(total_bytes, repeats)
                    up_gbps = down_gbps
                for operation, gbps, cpu_gbps, name, base in (
                    ("device->host store", stored, stored_cpu, down_name, down_gbps),
                    ("host->device load", loaded, loaded_cpu, up_name, up_gbps),
                ):
                    measured = _measurement(
                        operation,
                        block_bytes,
                        gbps,
                        name,
                        base,
                        target,
                        batch=batch,
                        target_ratio=DEVICE_TARGET_RATIO,
                    )
                    if copy_cpu > 0:
                        measured = dataclasses.replace(measured, cpu_ratio=cpu_gbps / copy_cpu)
                    report.measurements.append(measured)


def _disk_store(
    work: Path,
    count: int,
    block_bytes: int,
    workers: int,
    direct_io: bool,
    gds: bool | None = None,
) -> TieredStore:
    """A disk-only store in ``work``/tier with room for ``count`` block files (a file: the
    header page plus the payload rounded up to whole pages)."""
    file_bytes = ALIGN + -(-block_bytes // ALIGN) * ALIGN
    return TieredStore(
        0,
        work / "tier",
        count * file_bytes,
        block_bytes,
        workers=workers,
        direct_io=direct_io,
        gds=gds,
    )


def _measure_host(
    block_sizes: Sequence[int],
    total_bytes: int,
    workers: int,
    repeats: int,
    copy_gbps: float,
    step: Callable[[str], None],
    report: TierBenchReport,
) -> None:
    """Host store and load at each block size, next to a memory copy."""
    for block_bytes in block_sizes:
        step(f"host tier, {block_bytes >> 10} KiB blocks")
        count = max(1, total_bytes // block_bytes)
        with TieredStore(count * block_bytes, None, 0, block_bytes, workers=workers) as store:
            stored, loaded = _measure_store(
                store, block_bytes, total_bytes, "host", repeats, "host"
            )
        report.measurements.append(
            _measurement("host store", block_bytes, stored, "memory copy", copy_gbps)
        )
        report.measurements.append(
            _measurement("host load", block_bytes, loaded, "memory copy", copy_gbps)
        )


def _measure_disk(
    work: Path,
    block_bytes: int,
    total_bytes: int,
    direct_io: bool,
    knobs: tuple[int, int, int],
    step: Callable[[str], None],
    report: TierBenchReport,
) -> tuple[float, float]:
    """Disk write and read at one block size next to sequential file I/O of the same size;
    returns that baseline (write, read GB/s) for the device->disk rows."""
    workers, repeats, _ = knobs
    # The baseline is re-measured next to each tier run: shared disks drift within seconds.
    step(f"sequential file baseline ({block_bytes >> 10} KiB run)")
    seq_write, seq_read = sequential_file_baseline(work, total_bytes, direct_io, repeats)
    step(f"disk tier, {block_bytes >> 10} KiB blocks")
    count = max(1, total_bytes // block_bytes)
    with _disk_store(work, count, block_bytes, workers, direct_io) as store:
        wrote, read = _measure_store(store, block_bytes, total_bytes, "disk", repeats, "disk")
    report.measurements.append(
        _measurement("disk write", block_bytes, wrote, "sequential write", seq_write)
    )
    report.measurements.append(
        _measurement("disk read", block_bytes, read, "sequential read", seq_read)
    )
    return seq_write, seq_read


def _measure_device_disk(
    torch: Any,
    device: str,
    disk: tuple[Path, bool, tuple[float, float]],
    block_bytes: int,
    total_bytes: int,
    batches: Sequence[int],
    knobs: tuple[int, int, int],
    step: Callable[[str], None],
    report: TierBenchReport,
) -> None:
    """Device tensors to disk and back at one block size (also through GDS when CUDA has it),
    next to the sequential baseline ``disk`` carries (work dir, O_DIRECT, write/read GB/s)."""
    work, direct_io, (seq_write, seq_read) = disk
    workers, repeats, layers = knobs
    count = max(1, total_bytes // block_bytes)
    gds_modes: list[bool | None] = [False]
    if device == "cuda":
        from agentkv.tiers.gds import gds_available

        report.gds = gds_available()
        if report.gds:
            gds_modes.append(True)
    disk_batch = max([b for b in batches if b <= count] or [count])
    for gds in gds_modes:
        label = " (gds)" if gds else ""
        step(f"disk tier from {device} tensors{label}, {block_bytes >> 10} KiB blocks")
        with _disk_store(work, count, block_bytes, workers, direct_io, gds) as store:
            wrote, read, _, _ = _measure_device(
                store,
                torch,
                device,
                block_bytes,
                total_bytes,
                "disk",
                repeats,
                layers,
                "dd",
                disk_batch,
            )
        report.measurements.append(
            _measurement(
                f"device->disk store{label}",
                block_bytes,
                wrote,
                "sequential write",
                seq_write,
                batch=disk_batch,
            )
        )
        report.measurements.append(
            _measurement(
                f"disk->device load{label}",
                block_bytes,
                read,
                "sequential read",
                seq_read,
                batch=disk_batch,
            )
        )


def run_tier_bench(
    block_sizes: Sequence[int],
    total_bytes: int,
    disk_dir: Path | None,
    *,
    workers: int = 4,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
    device: str | None = None,
    layers: int = 32,
    remote: RemoteConfig | None = None,
    batches: Sequence[int] = BATCHES,
) -> TierBenchReport:
    """Measure every tier at every block size; ``disk_dir=None`` skips the disk tier.

    ``device`` ('cpu' or 'cuda') adds the torch path (see module docstring) with ``layers``
    layers per block; ``remote`` adds the remote tier (RuntimeError when it does not answer). Blocks for seconds. Creates and removes a private subdirectory of
    ``disk_dir``. Raises OSError when ``disk_dir`` is not writable and RuntimeError when a
    transfer fails, a round trip is not bit-exact or the device is unusable.
    """
    step = progress or (lambda _label: None)
    report = TierBenchReport(total_bytes, workers, str(disk_dir) if disk_dir else None, None)
    torch = _device_torch(device) if device is not None else None
    step("memory copy baseline")
    copy_gbps = memory_copy_baseline(total_bytes, repeats)
    if torch is not None and device is not None:
        report.device, report.layers = device, layers
        if device == "cpu":  # compile the batched copy now: the runs measure the steady state
            from agentkv.tiers import native_copy

            native_copy.warm_up(background=False)
            report.native_copies = native_copy.available()
        if device == "cuda":
            step("pinned torch copy baseline (cuda)")
            down_gbps, up_gbps = torch_copy_baseline(torch, device, total_bytes, repeats)
            baselines = ("pinned copy device->host", down_gbps, "pinned copy host->device", up_gbps)
        else:  # the bytes never leave host memory: the bar is a plain memcpy
            baselines = ("memory copy", copy_gbps, "memory copy", copy_gbps)
        _measure_device_host(
            torch,
            device,
            block_sizes,
            total_bytes,
            batches,
            baselines,
            (workers, repeats, layers),
            step,
            report,
        )
    _measure_host(block_sizes, total_bytes, workers, repeats, copy_gbps, step, report)
    if remote is not None:
        _measure_remote(remote, block_sizes, total_bytes, workers, repeats, step, report)
    if disk_dir is None:
        return report
    disk_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="agentkv-bench-", dir=disk_dir))
    try:
        direct_io = probe_direct_io(work)
        report.direct_io = direct_io
        for block_bytes in block_sizes:
            knobs = (workers, repeats, layers)
            baseline = _measure_disk(work, block_bytes, total_bytes, direct_io, knobs, step, report)
            if torch is not None and device is not None:
                disk = (work, direct_io, baseline)
                _measure_device_disk(
                    torch, device, disk, block_bytes, total_bytes, batches, knobs, step, report
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report
