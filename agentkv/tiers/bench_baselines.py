"""The baselines the tier bench (bench.py) sets each tier against, measured in the same run.

Primitives:
    memory_copy_baseline       GB/s of one large numpy copy (the host tier's bar).
    sequential_file_baseline   write and read GB/s of one file in 8 MiB chunks, O_DIRECT or
                               buffered like the disk tier (its bar).
    raw_remote_baseline        SET and GET GB/s of the same values with a plain pipelined client
                               on one connection (the remote tier's reference: no target).
    torch_copy_baseline        device->host and host->device GB/s of one raw torch copy (pinned
                               host memory on CUDA; the device path's bar there).
    gbps, best_of, touched_buffer
                               GB/s of bytes over seconds, best of repeats, a buffer with every
                               page faulted in (shared with bench.py's measurements).
Blocking and CPU-heavy: run from a command, never from the engine loop.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from agentkv.tiers.remote import RemoteConfig

_SEQUENTIAL_CHUNK = 8 << 20


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def best_of(repeats: int, run: Callable[[], float]) -> float:
    return min(run() for _ in range(max(1, repeats)))


def best_with_cpu(repeats: int, run: Callable[[], float]) -> tuple[float, float]:
    """(best wall seconds ``run`` returns, least process CPU seconds of a run), over repeats."""
    walls, cpus = [], []
    for _ in range(max(1, repeats)):
        cpu = time.process_time()
        walls.append(run())
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def touched_buffer(nbytes: int, fill: int = 0) -> np.ndarray:
    array = np.empty(nbytes, np.uint8)
    array.fill(fill)  # fault every page in before timing
    return array


def memory_copy_baseline(total_bytes: int, repeats: int) -> float:
    """Return GB/s of one large numpy copy between two already-touched buffers (best of repeats)."""
    return memory_copy_rates(total_bytes, repeats)[0]


def memory_copy_rates(total_bytes: int, repeats: int) -> tuple[float, float]:
    """(GB/s, GB per CPU-second) of one large numpy copy between two already-touched buffers."""
    source, destination = touched_buffer(total_bytes, 1), touched_buffer(total_bytes)

    def once() -> float:
        start = time.perf_counter()
        np.copyto(destination, source)
        return time.perf_counter() - start

    wall, cpu = best_with_cpu(repeats, once)
    return gbps(total_bytes, wall), gbps(total_bytes, cpu)


def sequential_file_baseline(
    directory: Path, total_bytes: int, direct_io: bool, repeats: int
) -> tuple[float, float]:
    """Return (write GB/s, read GB/s) of one file written then read in 8 MiB chunks, same I/O mode."""
    flags = getattr(os, "O_DIRECT", 0) if direct_io else 0
    chunk = mmap.mmap(-1, _SEQUENTIAL_CHUNK)
    chunk.write(os.urandom(_SEQUENTIAL_CHUNK))
    view = memoryview(chunk)
    size = -(-total_bytes // _SEQUENTIAL_CHUNK) * _SEQUENTIAL_CHUNK
    path = directory / f".baseline-{uuid.uuid4().hex}"

    def write_once() -> float:
        start = time.perf_counter()
        fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | flags, 0o600)
        try:
            for offset in range(0, size, _SEQUENTIAL_CHUNK):
                os.pwrite(fd, view, offset)
        finally:
            os.close(fd)
        return time.perf_counter() - start

    def read_once() -> float:
        start = time.perf_counter()
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            for offset in range(0, size, _SEQUENTIAL_CHUNK):
                os.preadv(fd, [view], offset)
        finally:
            os.close(fd)
        return time.perf_counter() - start

    try:
        write_s = best_of(repeats, write_once)
        read_s = best_of(repeats, read_once)
    finally:
        path.unlink(missing_ok=True)
        view.release()
        chunk.close()
    return gbps(size, write_s), gbps(size, read_s)


def raw_remote_baseline(
    config: RemoteConfig, block_bytes: int, total_bytes: int, repeats: int
) -> tuple[float, float]:
    """Return (SET GB/s, GET GB/s) of ``total_bytes`` in values of ``block_bytes`` with a plain
    client on one connection, pipelined in batches of ``max_batch_bytes`` (best of repeats)."""
    import valkey

    count = max(1, total_bytes // block_bytes)
    per_batch = max(1, config.max_batch_bytes // block_bytes)
    value = touched_buffer(block_bytes, 3).tobytes()
    names = [f"{config.key_prefix}:raw:{i}" for i in range(count)]
    client = valkey.Valkey(
        host=config.host,
        port=config.port,
        db=config.db,
        username=config.username,
        password=config.resolved_password(),
        ssl=config.tls,
        ssl_ca_certs=config.tls_ca,
        ssl_certfile=config.tls_cert,
        ssl_keyfile=config.tls_key,
        ssl_check_hostname=config.tls_check_hostname,
        socket_timeout=config.op_timeout_s,
        single_connection_client=True,
    )

    def run(queue: Callable[[Any, str], object]) -> float:
        start = time.perf_counter()
        for first in range(0, count, per_batch):
            pipe = client.pipeline(transaction=False)
            for name in names[first : first + per_batch]:
                queue(pipe, name)
            pipe.execute()
        return time.perf_counter() - start

    try:
        set_s = best_of(repeats, lambda: run(lambda pipe, name: pipe.set(name, value, px=600_000)))
        get_s = best_of(repeats, lambda: run(lambda pipe, name: pipe.get(name)))
        for first in range(0, count, 1000):
            client.delete(*names[first : first + 1000])
    finally:
        client.close()
    nbytes = count * block_bytes
    return gbps(nbytes, set_s), gbps(nbytes, get_s)


def torch_copy_baseline(
    torch: Any, device: str, total_bytes: int, repeats: int
) -> tuple[float, float]:
    """Return (device->host GB/s, host->device GB/s) of one raw torch copy of ``total_bytes``
    between a device tensor and host memory (pinned on CUDA), best of ``repeats``."""
    on_device = torch.ones(total_bytes, dtype=torch.uint8, device=device)
    host = torch.zeros(total_bytes, dtype=torch.uint8, pin_memory=device == "cuda")

    def timed(destination: Any, source: Any) -> Callable[[], float]:
        def once() -> float:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            destination.copy_(source, non_blocking=True)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        return once

    down = best_of(repeats, timed(host, on_device))
    up = best_of(repeats, timed(on_device, host))
    return gbps(total_bytes, down), gbps(total_bytes, up)
