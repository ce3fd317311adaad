"""GPUDirect Storage: move a block file's payload straight between disk and device memory.

Primitives:
    gds_available()        True when kvikio imports and a CUDA device is visible; probed once,
                           lazily (importing this module imports neither kvikio nor torch).
    DevicePayloadIO        read/write the payload region of a block file (same format as
                           disk.BlockFiles, payload at HEADER_BYTES) from/to a device buffer.

Status: detection and the payload I/O are here; TieredStore still stages disk<->device copies
through host buffers (the vLLM plugin hands the store CPU buffers). The checksum is computed on
the host copy, so a direct device path must verify it before reporting a load as ok; wire this in
only together with a device-side checksum.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Any

from agentkv.errors import TierError
from agentkv.tiers.disk import HEADER_BYTES

log = logging.getLogger(__name__)


@functools.cache
def gds_available() -> bool:
    """Return True when kvikio and a CUDA device are usable. Cached; never raises."""
    try:
        kvikio = importlib.import_module("kvikio")
        cuda = importlib.import_module("cupy").cuda
        if cuda.runtime.getDeviceCount() < 1:
            return False
    except Exception as exc:  # absent or broken CUDA stacks all mean "stage through host"
        log.debug("GPUDirect Storage unavailable: %s", exc)
        return False
    log.info("GPUDirect Storage available (kvikio %s)", getattr(kvikio, "__version__", "?"))
    return True


class DevicePayloadIO:
    """Payload transfers between block files and device buffers through kvikio."""

    def __init__(self) -> None:
        """Raises TierError when GDS is unavailable (call gds_available() first)."""
        if not gds_available():
            raise TierError("GPUDirect Storage is not available on this machine")
        self._kvikio: Any = importlib.import_module("kvikio")

    def write_payload(self, path: str | os.PathLike[str], device_buffer: Any, nbytes: int) -> None:
        """Write ``nbytes`` from ``device_buffer`` at the payload offset of ``path``. Blocks."""
        with self._kvikio.CuFile(os.fspath(path), "r+") as handle:
            written = handle.pwrite(device_buffer, nbytes, HEADER_BYTES).get()
        if written != nbytes:
            raise TierError(f"GDS short write: {written} of {nbytes} bytes")

    def read_payload(self, path: str | os.PathLike[str], device_buffer: Any, nbytes: int) -> None:
        """Read ``nbytes`` of payload from ``path`` into ``device_buffer``. Blocks."""
        with self._kvikio.CuFile(os.fspath(path), "r") as handle:
            read = handle.pread(device_buffer, nbytes, HEADER_BYTES).get()
        if read != nbytes:
            raise TierError(f"GDS short read: {read} of {nbytes} bytes")
