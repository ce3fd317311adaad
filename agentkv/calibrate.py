"""Measure this machine's rates so pause decisions rest on numbers, not constants.

Primitives:
    DiskBandwidth          write / read bytes per second of one directory, and whether O_DIRECT held
    PrefillMeasurement     a served model's prefill tokens per second and how it was measured
    measure_host_copy      large-buffer memcpy rate in host memory (numpy)
    measure_host_device    host->device and device->host rates (torch, pinned memory), None w/o GPU
    measure_disk           sequential write+fsync and read rates in a directory (O_DIRECT if allowed)
    measure_prefill        prefill rate of an OpenAI-compatible server (two /v1/completions calls)
    served_model           the model an OpenAI-compatible server serves and its max_model_len
    calibrate              all of the above into a HardwareProfile

Memory copies report the median of their repeats after a warm-up pass, so one scheduler hiccup
on a shared machine does not set the profile; the disk is measured once, on a file larger than
the drive's write cache when the size allows. Disk reads bypass the page cache
with O_DIRECT where the filesystem allows it; elsewhere (tmpfs, some overlays) the cache is
dropped for the file with posix_fadvise(DONTNEED) and ``direct_io`` says False. Prefill is
measured as the slope between a short and a long random prompt, which cancels HTTP, scheduling
and the one decoded token; random words plus a random ``cache_salt`` keep the prefix cache out.
"""

from __future__ import annotations

import mmap
import os
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agentkv.errors import ConfigError, EngineUnavailableError
from agentkv.profile import HardwareProfile, MachineInfo

Progress = Callable[[str], None]
"""Called with a short line before each measurement (the CLI shows it)."""

_ALIGN = 4096
_DISK_CHUNK = 8 * 2**20


def _noop(_: str) -> None:
    return None


@dataclass(frozen=True)
class DiskBandwidth:
    """Sequential rates of one directory's filesystem."""

    write_bytes_per_s: float
    read_bytes_per_s: float
    direct_io: bool
    directory: str


@dataclass(frozen=True)
class PrefillMeasurement:
    """Prefill throughput of a served model."""

    tokens_per_s: float
    model: str
    short_tokens: int
    long_tokens: int
    short_s: float
    long_s: float


def _check_size(nbytes: int, name: str) -> None:
    if nbytes < _ALIGN:
        raise ConfigError(f"{name} must be at least {_ALIGN} bytes, got {nbytes}")


def measure_host_copy(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes per second of copying an ``nbytes`` buffer into another in host memory.

    Contract: returns nbytes / median(copy time) over ``repeats`` copies after a warm-up (which
    also faults in every page). Raises ConfigError for sizes under 4 KiB or repeats < 1.
    """
    import numpy as np

    _check_size(nbytes, "buffer size")
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / max(statistics.median(times), 1e-9)


def measure_host_device(nbytes: int = 256 * 2**20, repeats: int = 5) -> tuple[float, float] | None:
    """(host->device, device->host) bytes per second with pinned host memory, or None.

    Contract: None when torch is missing or no CUDA device is visible; otherwise the median of
    ``repeats`` synchronized copies each way after a warm-up.
    """
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    _check_size(nbytes, "buffer size")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def timed(copy: Callable[[], Any]) -> float:
        copy()
        torch.cuda.synchronize()
        times = []
        for _ in range(max(repeats, 1)):
            start = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return nbytes / max(statistics.median(times), 1e-9)

    h2d = timed(lambda: device.copy_(host, non_blocking=True))
    d2h = timed(lambda: host.copy_(device, non_blocking=True))
    return h2d, d2h


def gpu_name() -> str | None:
    """The first CUDA device's name, or None (no torch, no GPU)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_name(0))


def _open_for_write(path: Path) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o600), True
        except OSError:
            pass
    return os.open(path, flags, 0o600), False


def _open_for_read(path: Path, direct: bool) -> int:
    flag = getattr(os, "O_DIRECT", 0) if direct else 0
    return os.open(path, os.O_RDONLY | flag)


def _drop_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _write_all(fd: int, view: memoryview, total: int, chunk: int) -> float:
    start = time.perf_counter()
    written = 0
    while written < total:
        written += os.write(fd, view[: min(chunk, total - written)])
    os.fsync(fd)
    return time.perf_counter() - start


def measure_disk(directory: str | os.PathLike[str], nbytes: int = 256 * 2**20) -> DiskBandwidth:
    """Sequential write (including fsync) and read rates of a scratch file in ``directory``.

    Contract: writes ``nbytes`` (rounded up to 4 KiB) in 8 MiB chunks from a page-aligned buffer,
    fsyncs, reads it back, deletes the file. Uses O_DIRECT when the filesystem accepts it (the
    result's ``direct_io`` says which). Raises ConfigError when the directory is missing or not
    writable.
    """
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"disk directory {folder} does not exist")
    _check_size(nbytes, "disk test size")
    total = -(-nbytes // _ALIGN) * _ALIGN
    chunk = min(_DISK_CHUNK, total)
    # mmap memory is page-aligned, as O_DIRECT requires of the user buffer.
    buffer = mmap.mmap(-1, chunk)
    buffer.write(secrets.token_bytes(chunk))
    view = memoryview(buffer)
    path = folder / f".agentkv-calibrate-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        try:
            fd, direct = _open_for_write(path)
        except OSError as exc:
            raise ConfigError(f"cannot write in disk directory {folder}: {exc}") from exc
        try:
            try:
                write_s = _write_all(fd, view, total, chunk)
            except OSError:
                if not direct:
                    raise
                # Some filesystems accept O_DIRECT at open and refuse it at write time.
                os.close(fd)
                fd, direct = os.open(path, os.O_WRONLY | os.O_TRUNC), False
                write_s = _write_all(fd, view, total, chunk)
            if not direct:
                _drop_cache(fd)
        finally:
            os.close(fd)
        try:
            rfd = _open_for_read(path, direct)
        except OSError:
            direct = False
            rfd = _open_for_read(path, False)
        try:
            if not direct:
                _drop_cache(rfd)
            start = time.perf_counter()
            read = 0
            while read < total:
                n = os.readv(rfd, [view[: min(chunk, total - read)]])
                if n <= 0:
                    break
                read += n
            read_s = time.perf_counter() - start
        finally:
            os.close(rfd)
    finally:
        view.release()
        buffer.close()
        path.unlink(missing_ok=True)
    return DiskBandwidth(
        write_bytes_per_s=total / max(write_s, 1e-9),
        read_bytes_per_s=read / max(read_s, 1e-9),
        direct_io=direct,
        directory=str(folder),
    )


# Short common words: each is one token in every mainstream tokenizer, so word count tracks
# token count, and random order defeats any cached prefix.
_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "be",
    "at",
    "by",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "an",
    "your",
    "which",
    "their",
    "said",
    "if",
    "do",
    "will",
    "each",
    "about",
    "how",
    "up",
    "out",
    "them",
    "then",
    "she",
    "many",
    "some",
    "so",
    "these",
    "would",
    "other",
    "into",
    "has",
    "more",
    "her",
    "two",
    "like",
    "him",
    "see",
    "time",
    "could",
    "no",
    "make",
    "than",
    "first",
    "been",
    "its",
    "who",
    "now",
    "people",
    "my",
    "made",
    "over",
    "did",
    "down",
    "only",
    "way",
    "find",
    "use",
    "may",
    "water",
    "long",
    "little",
    "very",
    "after",
    "words",
    "called",
    "just",
    "where",
    "most",
    "know",
    "get",
    "through",
    "back",
    "much",
    "before",
    "go",
    "good",
    "new",
    "write",
    "our",
    "used",
    "me",
    "man",
    "too",
    "any",
    "day",
    "same",
    "right",
    "look",
    "think",
    "also",
    "around",
    "another",
    "came",
]


def _random_prompt(words: int) -> str:
    return " ".join(secrets.choice(_WORDS) for _ in range(words))


def measure_prefill(
    server: str,
    *,
    model: str | None = None,
    prompt_tokens: int = 2048,
    api_key: str | None = None,
    timeout_s: float = 300.0,
    client: Any | None = None,
    progress: Progress = _noop,
) -> PrefillMeasurement:
    """Prefill tokens per second of the model served at ``server`` (OpenAI-compatible).

    Contract: sends a short and a long random prompt to ``/v1/completions`` with max_tokens=1 and
    a fresh ``cache_salt``, reads the true prompt lengths from ``usage.prompt_tokens`` and returns
    (long - short tokens) / (long - short seconds). ``model`` defaults to the first of
    ``/v1/models``; ``prompt_tokens`` is capped by the model's ``max_model_len`` when reported.
    Raises EngineUnavailableError when the server cannot be reached or answers an error.
    ``client`` (an httpx.Client) is for tests.
    """
    import httpx

    if prompt_tokens < 64:
        raise ConfigError(f"prompt tokens must be at least 64, got {prompt_tokens}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    owns = client is None
    http = client or httpx.Client(base_url=server.rstrip("/"), timeout=timeout_s, headers=headers)
    try:
        model, limit = served_model(http, server, model)
        target = prompt_tokens if not limit else min(prompt_tokens, int(limit) - 16)
        short_words = 16
        long_words = max(target - 8, short_words * 4)
        progress("prefill: warm-up")
        _timed_completion(http, server, model, short_words)
        progress(f"prefill: short prompt ({short_words} words)")
        short_n, short_s = _timed_completion(http, server, model, short_words)
        progress(f"prefill: long prompt ({long_words} words)")
        long_n, long_s = _timed_completion(http, server, model, long_words)
    finally:
        if owns:
            http.close()
    if long_n <= short_n:
        raise EngineUnavailableError(f"{server} reported no longer prompt for the long request")
    slope_s = long_s - short_s
    # On a tiny model the slope can drown in noise; the long request alone is a lower bound.
    seconds = slope_s if slope_s > 0 else long_s
    tokens = (long_n - short_n) if slope_s > 0 else long_n
    return PrefillMeasurement(
        tokens_per_s=tokens / max(seconds, 1e-9),
        model=model,
        short_tokens=short_n,
        long_tokens=long_n,
        short_s=short_s,
        long_s=long_s,
    )


def served_model(http: Any, server: str, model: str | None) -> tuple[str, int | None]:
    """(the model to measure, its ``max_model_len`` when ``/v1/models`` reports one); ``model``
    defaults to the first listed. EngineUnavailableError when the list cannot be read or is empty."""
    import httpx

    try:
        models = http.get("/v1/models").raise_for_status().json().get("data", [])
    except (httpx.HTTPError, ValueError) as exc:
        raise EngineUnavailableError(f"cannot list models at {server}: {exc}") from exc
    if model is None:
        if not models:
            raise EngineUnavailableError(f"{server} serves no model")
        model = str(models[0]["id"])
    limit = next(
        (m.get("max_model_len") for m in models if m.get("id") == model and m.get("max_model_len")),
        None,
    )
    return model, limit


def _timed_completion(http: Any, server: str, model: str, words: int) -> tuple[int, float]:
    """(prompt tokens the server counted, seconds) of one max_tokens=1 completion of a random
    ``words``-word prompt under a fresh ``cache_salt`` (nothing of it is cached)."""
    import httpx

    body = {
        "model": model,
        "prompt": _random_prompt(words),
        "max_tokens": 1,
        "temperature": 0.0,
        "cache_salt": secrets.token_hex(8),
    }
    start = time.perf_counter()
    try:
        response = http.post("/v1/completions", json=body).raise_for_status()
    except httpx.HTTPError as exc:
        raise EngineUnavailableError(f"completion request to {server} failed: {exc}") from exc
    elapsed = time.perf_counter() - start
    usage = response.json().get("usage") or {}
    return int(usage.get("prompt_tokens") or words), elapsed


def calibrate(
    *,
    disk_dir: str | os.PathLike[str] | None,
    server: str | None = None,
    model: str | None = None,
    api_key: str | None = None,
    nbytes: int = 256 * 2**20,
    prompt_tokens: int = 2048,
    measure_device: bool = True,
    progress: Progress = _noop,
) -> HardwareProfile:
    """Measure everything measurable here and return a profile with source='measured'.

    Contract: host copy always; host<->device when ``measure_device`` and a GPU is visible; disk
    when ``disk_dir`` is given; prefill when ``server`` is given. Unmeasured rates stay None.
    Raises ConfigError for a bad directory or size, EngineUnavailableError for a server failure.
    """
    progress(f"host copy: {nbytes / 2**20:.0f} MiB buffers")
    host_copy = measure_host_copy(nbytes)
    h2d = d2h = None
    gpu = None
    if measure_device:
        progress("host<->device: looking for a GPU")
        pair = measure_host_device(nbytes)
        if pair is not None:
            h2d, d2h = pair
            gpu = gpu_name()
    disk = None
    if disk_dir is not None:
        progress(f"disk: write+fsync and read {nbytes / 2**20:.0f} MiB in {disk_dir}")
        disk = measure_disk(disk_dir, nbytes)
    prefill = None
    if server is not None:
        prefill = measure_prefill(
            server, model=model, prompt_tokens=prompt_tokens, api_key=api_key, progress=progress
        )
    return HardwareProfile(
        host_copy_bytes_per_s=host_copy,
        host_to_device_bytes_per_s=h2d,
        device_to_host_bytes_per_s=d2h,
        disk_write_bytes_per_s=disk.write_bytes_per_s if disk else None,
        disk_read_bytes_per_s=disk.read_bytes_per_s if disk else None,
        disk_dir=disk.directory if disk else None,
        disk_direct_io=disk.direct_io if disk else False,
        prefill_tokens_per_s=prefill.tokens_per_s if prefill else None,
        prefill_model=prefill.model if prefill else None,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        machine=MachineInfo.current(gpu=gpu),
        source="measured",
    )
