"""Block buffers as callers hand them over: one buffer, or several segments concatenated in order.

Primitives:
    BlockBuffer    what a caller may pass for one block: any C-contiguous buffer (memoryview,
                   numpy array, bytearray, ...) or a sequence of them (e.g. one per layer).
    as_segments    normalise a BlockBuffer into flat uint8 numpy views (no copy), checking the
                   total size and, for loads, that every segment is writable.
    gather_into    copy segments into one contiguous destination (store path).
    scatter_from   copy one contiguous source into segments (load path).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

ByteArray: TypeAlias = npt.NDArray[np.uint8]
BlockBuffer: TypeAlias = Any
"""A buffer-protocol object, or a sequence of them (segments of one block, in order)."""


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


def as_segments(
    buffer: BlockBuffer, block_bytes: int, *, writable: bool = False
) -> list[ByteArray]:
    """Return ``buffer`` as flat uint8 views whose sizes sum to ``block_bytes``.

    Raises ValueError when the sizes do not add up, a segment is not contiguous, or (for
    ``writable=True``) a segment is read-only. Never copies.
    """
    parts = list(buffer) if _is_segment_list(buffer) else [buffer]
    segments = [_flat(part, writable=writable) for part in parts]
    total = sum(segment.size for segment in segments)
    if total != block_bytes:
        raise ValueError(f"block buffer holds {total} bytes, expected {block_bytes}")
    return segments


def gather_into(destination: ByteArray, segments: Sequence[ByteArray]) -> None:
    """Copy ``segments`` back to back into ``destination`` (which is at least their total size)."""
    offset = 0
    for segment in segments:
        np.copyto(destination[offset : offset + segment.size], segment)
        offset += segment.size


def scatter_from(source: ByteArray, segments: Sequence[ByteArray]) -> None:
    """Copy ``source`` into ``segments`` in order (the inverse of gather_into)."""
    offset = 0
    for segment in segments:
        np.copyto(segment, source[offset : offset + segment.size])
        offset += segment.size
