"""The remote tier's wire codec: server keys, the value a block is stored as, the SET command
built around caller memory, and the RESP reply reader (remote.py's client uses them).

Primitives:
    remote_key       the server key of a BlockKey (``{key_prefix}:kv2:{32 hex}``, remote_auth).
    encode_value     header + tag + payload for one block (one copy of the payload).
    set_command      ``SET name value PX ttl`` as RESP chunks: host segments are sent from where
                     they are (checksum computed in place), device segments gathered first.
    normalise        a caller buffer as Segments (no copy); ValueError for bad sizes.
    segments_nbytes  the payload size of Segments (host or device).
    RemoteValue      one block read by ``fetch_many``: a verified payload, a miss, or an error.
    ReplyReader      RESP2 replies of simple commands straight from the socket, each value
                     received once (valkey-py's pure-Python parser copies it four times).
Header format and verification: remote_auth.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from agentkv.errors import TierError
from agentkv.tier import Tier
from agentkv.tiers.buffers import BlockBuffer, Segments, as_segments, gather_into, scatter_from
from agentkv.tiers.device import DeviceSegments
from agentkv.tiers.keys import BlockKey
from agentkv.tiers.remote_auth import HEADER_BYTES, RemoteAuth, pack_header
from agentkv.tiers.results import BlockResult, BlockStatus

_MAX_BULK_BYTES = 1 << 30  # Redis and Valkey cap a string at 512 MiB; larger is a broken stream


def remote_key(prefix: str, key: BlockKey, secret: str | None = None) -> str:
    """Return the server key of ``key`` under ``prefix`` for a deployment ``secret``."""
    return RemoteAuth(secret).name(prefix, key)


def encode_value(auth: RemoteAuth, key: BlockKey, segments: Segments) -> bytearray:
    """Return header + tag + payload for one block (one copy of the payload: the gather)."""
    nbytes = segments.nbytes if isinstance(segments, DeviceSegments) else _host_nbytes(segments)
    value = bytearray(HEADER_BYTES + nbytes)
    payload = np.frombuffer(value, np.uint8)[HEADER_BYTES:]
    gather_into(payload, segments)
    value[:HEADER_BYTES] = pack_header(
        auth, key, nbytes, xxhash.xxh3_64_intdigest(payload.data), [payload.data]
    )
    return value


_COALESCE_BYTES = 64 << 10  # segments smaller than this are joined before sending: fewer syscalls


def set_command(
    auth: RemoteAuth, name: str, key: BlockKey, segments: Segments, ttl_ms: int
) -> tuple[list[bytes | memoryview], int]:
    """Return ``SET name value PX ttl`` as RESP chunks, and the payload size.

    Host segments are sent from where they are (the checksum reads them once; no gather, no
    allocation per block); device segments are gathered to host first (encode_value).
    """
    if isinstance(segments, DeviceSegments):
        value = encode_value(auth, key, segments)
        nbytes = len(value) - HEADER_BYTES
        header = b""
        payload: list[bytes | memoryview] = [memoryview(value)]
    else:
        digest = xxhash.xxh3_64()
        for segment in segments:
            digest.update(segment.data)
        nbytes = _host_nbytes(segments)
        header = pack_header(
            auth, key, nbytes, digest.intdigest(), (segment.data for segment in segments)
        )
        payload = []
        small: list[bytes] = []
        for segment in segments:
            if segment.size < _COALESCE_BYTES:
                small.append(segment.tobytes())
                continue
            if small:
                payload.append(b"".join(small))
                small = []
            payload.append(segment.data)
        if small:
            payload.append(b"".join(small))
    encoded = name.encode()
    ttl = str(ttl_ms).encode()
    head = b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b" % (
        len(encoded),
        encoded,
        HEADER_BYTES + nbytes,
        header,
    )
    tail = b"\r\n$2\r\nPX\r\n$%d\r\n%b\r\n" % (len(ttl), ttl)
    return [head, *payload, tail], nbytes


def _host_nbytes(segments: Sequence[Any]) -> int:
    return sum(int(segment.size) for segment in segments)


def _part_nbytes(part: Any) -> int:
    if isinstance(part, np.ndarray):
        return int(part.nbytes)
    numel = getattr(part, "numel", None)
    if callable(numel) and hasattr(part, "element_size"):  # a torch tensor
        return int(numel()) * int(part.element_size())
    return memoryview(part).nbytes


def normalise(buffer: BlockBuffer | Segments, *, writable: bool) -> Segments:
    """Return ``buffer`` as Segments (no copy); Segments pass through. Raises ValueError."""
    if isinstance(buffer, DeviceSegments):
        return buffer
    parts = (
        list(buffer)
        if isinstance(buffer, Sequence) and not isinstance(buffer, bytes | bytearray | memoryview)
        else [buffer]
    )
    return as_segments(buffer, sum(_part_nbytes(p) for p in parts), writable=writable)


def segments_nbytes(segments: Segments) -> int:
    if isinstance(segments, DeviceSegments):
        return int(segments.nbytes)
    return _host_nbytes(segments)


@dataclass(frozen=True, slots=True)
class RemoteValue:
    """One block read by ``fetch_many``: ok with a verified payload, a miss, or an error."""

    key: BlockKey
    status: BlockStatus
    payload: memoryview | None = None
    error: TierError | None = None

    def copy_into(self, segments: Segments) -> None:
        """Scatter the payload into ``segments`` (their total must equal the payload length)."""
        assert self.payload is not None
        scatter_from(np.frombuffer(self.payload, np.uint8), segments)

    def result(self) -> BlockResult:
        return BlockResult(self.key, self.status, Tier.REMOTE, self.error)


class ReplyReader:
    """RESP2 replies of simple commands (GET, SET, PEXPIRE: bulk and simple strings, integers,
    errors) straight from the socket.

    valkey-py's pure-Python parser copies a bulk string four times (socket -> bytes -> BytesIO ->
    bytes -> slice), which caps GET near 0.3 GB/s; here a value is received once, with
    ``recv_into`` into a buffer of its exact size. Raises ValueError for anything else
    (arrays, a malformed reply), OSError/TimeoutError from the socket; the caller then drops the
    connection.
    """

    _READ = 1 << 16

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._pos = 0

    def pending(self) -> int:
        return len(self._buf) - self._pos

    def _fill(self) -> None:
        chunk = self._sock.recv(self._READ)
        if not chunk:
            raise OSError("the server closed the connection")
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += chunk

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n", self._pos)
            if end >= 0:
                line = bytes(self._buf[self._pos : end])
                self._pos = end + 2
                return line
            self._fill()

    def read(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            length = int(rest)
            if length < 0:
                return None
            if length > _MAX_BULK_BYTES:
                raise ValueError(f"bulk string of {length} bytes")
            out = bytearray(length + 2)
            view = memoryview(out)
            have = min(self.pending(), length + 2)
            view[:have] = self._buf[self._pos : self._pos + have]
            self._pos += have
            while have < length + 2:
                count = self._sock.recv_into(view[have:])
                if not count:
                    raise OSError("the server closed the connection")
                have += count
            if out[length:] != b"\r\n":
                raise ValueError("bulk string without its terminator")
            return view[:length]
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest
        if kind == b"-":
            import valkey

            return valkey.exceptions.ResponseError(rest.decode(errors="replace"))
        raise ValueError(f"unexpected reply type {kind!r}")
