"""GPUDirect Storage: move a block file's payload straight between disk and device memory.

Primitives:
    gds_available()        True when torch (already imported) sees CUDA, kvikio imports and
                           cuFile itself reports GDS usable (kvikio's POSIX compatibility mode does
                           not count). Probed once, lazily: importing this module imports neither
                           kvikio nor torch. ``AGENTKV_GDS=off`` turns it off.
    DevicePayloadIO        read/write the payload region of a block file (same format as
                           disk.BlockFiles, payload at HEADER_BYTES) from/to a contiguous device
                           buffer (a torch CUDA tensor, through ``__cuda_array_interface__``).

BlockFiles uses this for blocks held in device memory when ``gds_available()`` (see disk.py): the
header is written and read with ordinary I/O, the payload with cuFile, and the xxh3 checksum is
still computed on a host copy of the payload (no device-side xxh3 exists), so the file format and
checksums are the same as the staged path's and either path reads the other's files.

Status: written against kvikio's documented API and exercised only by tests marked ``gpu`` on a
machine with cuFile; it has not run on hardware yet.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Any

from agentkv.errors import TierError
from agentkv.tiers.device import loaded_torch
from agentkv.tiers.disk import HEADER_BYTES

log = logging.getLogger(__name__)

_probe_lock = threading.Lock()
_probe: bool | None = None


def _cufile_usable(kvikio: Any) -> bool:
    driver = getattr(kvikio, "cufile_driver", None)
    properties = getattr(driver, "properties", None)
    if properties is not None and hasattr(properties, "is_gds_available"):
        return bool(properties.is_gds_available)
    defaults = kvikio.defaults
    if hasattr(defaults, "is_compat_mode_preferred"):
        return not bool(defaults.is_compat_mode_preferred())
    mode = defaults.compat_mode()  # older kvikio: a bool or CompatMode (OFF == 0)
    return int(mode) == 0


def _probe_now() -> bool:
    if os.environ.get("AGENTKV_GDS", "").strip().lower() in ("0", "off", "false", "no"):
        log.info("GPUDirect Storage disabled by AGENTKV_GDS")
        return False
    torch = loaded_torch()
    try:
        if not torch.cuda.is_available():
            return False
        kvikio = importlib.import_module("kvikio")
        if not _cufile_usable(kvikio):
            log.info("kvikio present but cuFile is not usable here; disk I/O stages through host")
            return False
    except Exception as exc:  # absent or broken CUDA stacks all mean "stage through host"
        log.debug("GPUDirect Storage unavailable: %s", exc)
        return False
    log.info("GPUDirect Storage available (kvikio %s)", getattr(kvikio, "__version__", "?"))
    return True


def gds_available() -> bool:
    """Return True when GPUDirect Storage can move payloads. Never raises.

    False without probing (and without caching) while torch is not imported: device blocks are
    torch tensors, so there is nothing to move before torch is loaded.
    """
    global _probe
    if _probe is not None:
        return _probe
    if loaded_torch() is None:
        return False
    with _probe_lock:
        if _probe is None:
            _probe = _probe_now()
        return _probe


def reset_probe() -> None:
    """Forget the cached probe (tests, or after changing AGENTKV_GDS)."""
    global _probe
    with _probe_lock:
        _probe = None


class DevicePayloadIO:
    """Payload transfers between block files and contiguous device buffers through kvikio."""

    def __init__(self) -> None:
        """Raises TierError when GDS is unavailable (call gds_available() first)."""
        if not gds_available():
            raise TierError("GPUDirect Storage is not available on this machine")
        self._kvikio: Any = importlib.import_module("kvikio")

    def write_payload(self, path: str | os.PathLike[str], device_buffer: Any, nbytes: int) -> None:
        """Write ``nbytes`` from ``device_buffer`` at the payload offset of the existing file
        ``path``. Blocks until written; the buffer must be complete (stream-synchronised)."""
        try:
            with self._kvikio.CuFile(os.fspath(path), "r+") as handle:
                written = handle.pwrite(device_buffer, nbytes, HEADER_BYTES).get()
        except (OSError, RuntimeError) as exc:
            raise TierError(f"GDS write failed for {os.fspath(path)}: {exc}") from exc
        if written != nbytes:
            raise TierError(f"GDS short write: {written} of {nbytes} bytes")

    def read_payload(self, path: str | os.PathLike[str], device_buffer: Any, nbytes: int) -> None:
        """Read ``nbytes`` of payload from ``path`` into ``device_buffer``. Blocks until read."""
        try:
            with self._kvikio.CuFile(os.fspath(path), "r") as handle:
                read = handle.pread(device_buffer, nbytes, HEADER_BYTES).get()
        except (OSError, RuntimeError) as exc:
            raise TierError(f"GDS read failed for {os.fspath(path)}: {exc}") from exc
        if read != nbytes:
            raise TierError(f"GDS short read: {read} of {nbytes} bytes")
