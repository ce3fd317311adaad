"""Block buffers as callers hand them over: one buffer, or several segments concatenated in order.

Primitives:
    BlockBuffer    what a caller may pass for one block: a C-contiguous host buffer (numpy
                   array, bytearray, memoryview, ...), a contiguous torch tensor on any device,
                   a sequence of them (segments of one block, in order, e.g. one per layer),
                   a BlockRef (one block of a KV cache described once, batched.py), or
                   DeviceSegments (passed through as they are, their ready event kept).
    Segments       a normalised block: a list of flat uint8 numpy views (host memory), a host
                   BlockRef (copied in one pass by its table), or DeviceSegments (torch tensors
                   in device memory, see device.py).
    as_segments    normalise a BlockBuffer without copying: host buffers and CPU tensors become
                   numpy views of the same memory (a CPU tensor through ``.numpy()`` of a uint8
                   view); tensors on a device (CUDA) become DeviceSegments. Checks the total size
                   and, for loads, that host segments are writable.
    gather_into    copy a block into one contiguous host destination (store path; device blocks
                   are copied with torch on a CUDA stream, see device.py).
    scatter_from   copy one contiguous host source into a block (load path).

Device memory is only ever touched through torch: no numpy view and no memoryview of a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from agentkv.tiers import device
from agentkv.tiers.batched import BlockRef
from agentkv.tiers.device import DeviceSegments

ByteArray: TypeAlias = npt.NDArray[np.uint8]
BlockBuffer: TypeAlias = Any
"""A host buffer or torch tensor, or a sequence of them (segments of one block, in order)."""
Segments: TypeAlias = "list[ByteArray] | BlockRef | DeviceSegments"


def _on_host(tensor: Any) -> bool:
    """True when ``tensor`` lives in host memory and can be viewed as numpy (seam for tests)."""
    return bool(tensor.device.type == "cpu")


def _tensor_view(tensor: Any) -> ByteArray:
    array: ByteArray = device.flat_bytes(tensor).numpy()
    return array


def _flat(buffer: Any, *, writable: bool) -> ByteArray:
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("block buffers must be C-contiguous")
        array = buffer.reshape(-1).view(np.uint8)
    else:
        view = memoryview(buffer)
        if not view.c_contiguous:
            raise ValueError("block buffers must be C-contiguous")
        array = np.frombuffer(
            view.cast("B") if view.ndim != 1 or view.format != "B" else view, dtype=np.uint8
        )
    if writable and not array.flags.writeable:
        raise ValueError("load destinations must be writable")
    return array


def _is_segment_list(buffer: Any) -> bool:
    return isinstance(buffer, Sequence) and not isinstance(buffer, bytes | bytearray | memoryview)


def _whole(buffer: BlockRef | DeviceSegments, block_bytes: int) -> BlockRef | DeviceSegments:
    """A BlockRef (host: as is; device: its DeviceSegments) or DeviceSegments, size checked."""
    whole: BlockRef | DeviceSegments = buffer
    if isinstance(buffer, BlockRef) and not buffer.on_host:
        whole = buffer.device_segments()
    if whole.nbytes != block_bytes:
        raise ValueError(f"block buffer holds {whole.nbytes} bytes, expected {block_bytes}")
    return whole


def as_segments(buffer: BlockBuffer, block_bytes: int, *, writable: bool = False) -> Segments:
    """Return ``buffer`` as Segments whose sizes sum to ``block_bytes``. Never copies.

    Raises ValueError when the sizes do not add up, a segment is not contiguous, segments mix
    host and device memory (or two devices), or (for ``writable=True``) a host segment is
    read-only.
    """
    if isinstance(buffer, BlockRef | DeviceSegments):
        return _whole(buffer, block_bytes)
    parts = list(buffer) if _is_segment_list(buffer) else [buffer]
    torch = device.loaded_torch()
    tensor_type = torch.Tensor if torch is not None else ()
    on_device = [isinstance(part, tensor_type) and not _on_host(part) for part in parts]
    segments: Segments
    if any(on_device):
        if not all(on_device):
            raise ValueError("a block's segments must all be in host memory or all on one device")
        segments = DeviceSegments(parts)
        total = segments.nbytes
    else:
        segments = [
            _tensor_view(part) if isinstance(part, tensor_type) else _flat(part, writable=writable)
            for part in parts
        ]
        total = sum(segment.size for segment in segments)
    if total != block_bytes:
        raise ValueError(f"block buffer holds {total} bytes, expected {block_bytes}")
    return segments


def gather_into(destination: ByteArray, segments: Segments) -> None:
    """Copy ``segments`` back to back into ``destination`` (which is at least their total size)."""
    if isinstance(segments, DeviceSegments):
        device.device_to_host(destination, segments)
        return
    if isinstance(segments, BlockRef):
        segments.gather_into(destination[: segments.nbytes])
        return
    offset = 0
    for segment in segments:
        np.copyto(destination[offset : offset + segment.size], segment)
        offset += segment.size


def scatter_from(source: ByteArray, segments: Segments) -> None:
    """Copy ``source`` into ``segments`` in order (the inverse of gather_into)."""
    if isinstance(segments, DeviceSegments):
        device.host_to_device(source, segments)
        return
    if isinstance(segments, BlockRef):
        segments.scatter_from(source)
        return
    offset = 0
    for segment in segments:
        np.copyto(segment, source[offset : offset + segment.size])
        offset += segment.size
