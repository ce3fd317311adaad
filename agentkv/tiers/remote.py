"""The remote tier: KV blocks in a shared Valkey/Redis server, content addressed, checksummed, TTL'd.

Primitives:
    RemoteConfig            where and how to connect. ``RemoteConfig.parse(url, **options)``
                            takes ``valkey://``, ``valkeys://`` (TLS), ``redis://``, ``rediss://``
                            (TLS) URLs with optional user, password, port, db and query options;
                            a bad part raises ConfigError naming it. Frozen; its repr never shows
                            the password.
    RemoteBlocks            the client (thread-safe: a connection pool). Constructing it does no
                            I/O. Every other method does network I/O, so none may be called on an
                            engine thread, and none raises for server trouble: an unreachable,
                            slow, full or misbehaving server becomes error (or miss) results and a
                            rate-limited warning. Only caller bugs (mismatched counts, bad buffer
                            sizes) raise ValueError, before any I/O.
    RemoteBlocks.put_many   store blocks; with ``skip_present`` (default) a first pipeline of
                            PEXPIRE both refreshes the TTL of blocks already there and tells which
                            are missing, and only those are sent (SET PX, pipelined).
    RemoteBlocks.get_many   read blocks into caller buffers (GET + PEXPIRE, pipelined); verifies
                            header and checksum before any byte reaches a buffer.
    RemoteBlocks.fetch_many the same reads, returning verified payloads (RemoteValue) that the
                            caller copies itself (the store copies under its cancel fence).
    RemoteBlocks.exists_many, lookup_prefix
                            presence queries (EXISTS, pipelined); lookup_prefix returns the
                            longest leading run present. Live answers: no index is kept.
    RemoteBlocks.delete_many, ping, stats, close.
    remote_key              the server key of a BlockKey; encode_value the format (remote_auth).

Key layout and value format: ``remote_auth`` (``{key_prefix}:kv2:{32 hex}`` named with the
deployment secret; a 96-byte header with xxh3 checksums and an HMAC-SHA256 tag, then the
payload). The BlockKey covers the KV identity and generation, the TP rank, the cache_salt and
the whole parent chain, so a block is never served to another model, weights, format, layout,
rank or tenant; ``key_prefix`` separates deployments sharing a server. One key per block: Redis
Cluster is not supported (pipelines span slots). No pickle, nothing executable.

Invariants:
    - A read reports ok only after the header (magic, version, header checksum, both digests),
      the length, the payload checksum and the tag all match. Damage (anything but the tag) is
      an error carrying CorruptBlockError; a bad tag (forged, or another secret) is a miss,
      counted in ``bad_tags``; either way the value is deleted from the server. A well-formed
      value of another length (another block size) is an error and stays.
    - Every write sets a TTL (``ttl_s``); every successful read and every skipped re-put refreshes
      it, so blocks in use stay and abandoned ones expire without anyone deleting them.
    - One round trip per batch (at most ``max_batch_bytes`` of payload, or one block): puts with
      ``skip_present`` take one more (the PEXPIRE probe), fewer bytes when blocks are present.
    - After a connection failure or timeout, calls fail fast (error results, no I/O) for
      ``backoff_s`` so a dead server costs the engine no connect timeouts; ``ping`` always probes.
    - Commands are idempotent, so a connection found dead is retried once on a fresh one (a
      server restart costs no error); timeouts are not retried (they would double the wait).
    - Blocks move with at most one copy in this process: writes send host segments from where
      they are (RESP framing around them, checksum computed in place), and reads bypass valkey-py's
      pure-Python reply parser (four copies of every value) with a small RESP reader that
      receives each value once (_ReplyReader). With the C parser (libvalkey installed) the
      ordinary pipeline is used. A connection left mid-reply is closed, never reused.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import xxhash

from agentkv.errors import ConfigError, CorruptBlockError, TierError
from agentkv.tier import Tier
from agentkv.tiers.buffers import BlockBuffer, Segments, as_segments, gather_into, scatter_from
from agentkv.tiers.device import DeviceSegments
from agentkv.tiers.keys import BlockKey
from agentkv.tiers.remote_auth import (
    HEADER_BYTES,
    SECRET_ENV,
    BadTagError,
    RemoteAuth,
    pack_header,
    verify,
)
from agentkv.tiers.results import BlockResult, BlockStatus

log = logging.getLogger(__name__)


SCHEMES = {"valkey": False, "redis": False, "valkeys": True, "rediss": True}
"""URL scheme -> TLS."""
DEFAULT_PORT = 6379
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_WARN_INTERVAL_S = 30.0
_MAX_TTL_S = 365 * 86400.0
_MAX_BULK_BYTES = 1 << 30  # Redis and Valkey cap a string at 512 MiB; larger is a broken stream
_UNAUTHENTICATED_WARNED: set[str] = set()
_LOOKUP_CHUNK = 512  # keys per EXISTS pipeline in lookup_prefix: stops early on long chains


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """How to reach the remote tier. Build it with ``parse`` (validates every field)."""

    host: str
    port: int = DEFAULT_PORT
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    password_env: str | None = None
    """Name of an environment variable holding the password (read when the client is built)."""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_check_hostname: bool = True
    """Check that the server certificate names the host of the URL (an IP needs an IP SAN)."""
    key_prefix: str = "agentkv"
    auth_key: str | None = field(default=None, repr=False)
    """The deployment secret that names and signs blocks (remote_auth); None: the
    ``AGENTKV_REMOTE_KEY`` environment variable, else unauthenticated."""
    ttl_s: float = 3600.0
    connect_timeout_s: float = 2.0
    op_timeout_s: float = 5.0
    max_batch_bytes: int = 16 << 20
    backoff_s: float = 2.0

    # Options a URL query may carry (``?ttl_s=600&key_prefix=prod``).
    _QUERY = (
        "password_env",
        "tls_ca",
        "tls_cert",
        "tls_key",
        "tls_check_hostname",
        "key_prefix",
        "ttl_s",
        "connect_timeout_s",
        "op_timeout_s",
        "max_batch_bytes",
        "backoff_s",
    )

    @classmethod
    def parse(cls, url: str, **options: Any) -> RemoteConfig:
        """Return the config for ``url`` plus ``options`` (any field name; they override the URL).

        URL grammar: ``scheme://[[user]:password@]host[:port][/db][?option=value&...]`` with scheme
        valkey, redis (plain) or valkeys, rediss (TLS); port defaults to 6379, db to 0; query
        options are the field names listed in ``_QUERY``. The password may come from the URL
        (percent-encoded), ``password=`` or ``password_env=`` (an environment variable's name).
        Raises ConfigError with the offending part for anything invalid, including a
        ``password_env`` variable that is not set.
        """
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(
                f"remote URL {url if not isinstance(url, str) else _redact(url)!r} must look like "
                "valkey://host:port/0 "
                "(schemes: valkey, valkeys, redis, rediss)"
            )
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise ConfigError(f"remote URL {_redact(url)!r}: {exc}") from exc
        scheme = parts.scheme.lower()
        if scheme not in SCHEMES:
            raise ConfigError(
                f"remote URL scheme {scheme!r} is not supported "
                "(use valkey://, valkeys://, redis:// or rediss://)"
            )
        if not parts.hostname:
            raise ConfigError(f"remote URL {_redact(url)!r} has no host")
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise ConfigError(f"remote URL database {path!r} must be a number (as in /0)")
        if parts.fragment:
            raise ConfigError("remote URL must not have a #fragment")
        fields: dict[str, Any] = {
            "host": parts.hostname,
            "port": port if port is not None else DEFAULT_PORT,
            "db": int(path) if path else 0,
            "tls": SCHEMES[scheme],
            "username": urllib.parse.unquote(parts.username) if parts.username else None,
            "password": urllib.parse.unquote(parts.password) if parts.password else None,
        }
        for name, values in urllib.parse.parse_qs(parts.query, keep_blank_values=True).items():
            if name not in cls._QUERY:
                raise ConfigError(
                    f"remote URL option {name!r} is unknown (known: {', '.join(cls._QUERY)})"
                )
            if len(values) != 1:
                raise ConfigError(f"remote URL option {name!r} is given more than once")
            fields[name] = values[0]
        known = {f for f in cls.__dataclass_fields__ if not f.startswith("_")}
        for name, value in options.items():
            if name not in known:
                raise ConfigError(f"unknown remote tier option {name!r}")
            if value is not None:
                fields[name] = value
        config = cls(**_coerce(fields))
        config.validate()
        return config

    from_url = parse

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field."""
        if not 0 < self.port < 65536:
            raise ConfigError(f"remote port {self.port} is out of range")
        if self.db < 0:
            raise ConfigError(f"remote database {self.db} must not be negative")
        if not _PREFIX_RE.match(self.key_prefix):
            raise ConfigError(
                f"remote key_prefix {self.key_prefix!r} must be 1-64 characters of "
                "letters, digits, '_', '.', ':' or '-'"
            )
        for name in ("ttl_s", "connect_timeout_s", "op_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"remote {name} must be positive and finite, got {value}")
        if self.ttl_s > _MAX_TTL_S:
            raise ConfigError(f"remote ttl_s {self.ttl_s} is above {_MAX_TTL_S:.0f} s (a year)")
        if not (self.backoff_s >= 0 and math.isfinite(self.backoff_s)):
            raise ConfigError(f"remote backoff_s must not be negative, got {self.backoff_s}")
        if self.max_batch_bytes <= 0:
            raise ConfigError(
                f"remote max_batch_bytes must be positive, got {self.max_batch_bytes}"
            )
        if (self.tls_ca or self.tls_cert or self.tls_key) and not self.tls:
            raise ConfigError("remote TLS files need a TLS URL (valkeys:// or rediss://)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("remote tls_cert and tls_key go together (client certificate)")
        for name in ("tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ConfigError(f"remote {name} {path!r} is not a readable file")
        self.resolved_password()

    def resolved_password(self) -> str | None:
        """The password: ``password``, else the ``password_env`` variable. ConfigError when unset."""
        if self.password is not None:
            return self.password
        if self.password_env:
            value = os.environ.get(self.password_env)
            if value is None:
                raise ConfigError(
                    f"remote password variable {self.password_env} is not set in the environment"
                )
            return value
        return None

    def resolved_auth_key(self) -> str | None:
        """The deployment secret: ``auth_key``, else the ``AGENTKV_REMOTE_KEY`` variable."""
        return self.auth_key or os.environ.get(SECRET_ENV) or None

    @property
    def url(self) -> str:
        """The server URL without credentials or options (safe to log)."""
        scheme = "valkeys" if self.tls else "valkey"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}/{self.db}"


def _coerce(fields: dict[str, Any]) -> dict[str, Any]:
    """Convert query strings to field types; ConfigError names the field."""
    converters: dict[str, Callable[[Any], Any]] = {
        "port": int,
        "db": int,
        "ttl_s": float,
        "connect_timeout_s": float,
        "op_timeout_s": float,
        "backoff_s": float,
        "max_batch_bytes": int,
    }
    out = dict(fields)
    flag = out.get("tls_check_hostname")
    if isinstance(flag, str):
        if flag.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ConfigError(f"remote tls_check_hostname {flag!r} must be true or false")
        out["tls_check_hostname"] = flag.lower() in ("1", "true", "yes")
    for name, convert in converters.items():
        if name in out and isinstance(out[name], str):
            try:
                out[name] = convert(out[name])
            except ValueError as exc:
                raise ConfigError(f"remote {name} {out[name]!r} is not a number") from exc
    return out


def _redact(url: str) -> str:
    return re.sub(r"//([^/@]*):[^/@]*@", r"//\1:***@", url)


# ------------------------------------------------------------------------------- value format


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


def _set_command(
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


# ------------------------------------------------------------------------------------ client


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


@dataclass(slots=True)
class RemoteStats:
    """Counters since the client was built (a copy; see RemoteBlocks.stats)."""

    round_trips: int = 0
    puts: int = 0
    put_skipped: int = 0
    put_bytes: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    get_bytes: int = 0
    errors: int = 0
    corrupt: int = 0
    bad_tags: int = 0
    unavailable: int = 0


class _ReplyReader:
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


class _Unavailable(Exception):
    """Internal: the server could not be reached (connection error, timeout, backoff)."""


class RemoteBlocks:
    """A Valkey/Redis-backed block tier (see module docstring). Thread-safe."""

    direct = True
    """Under valkey-py's pure-Python parser, send SETs from the caller's memory and read replies
    with _ReplyReader (False: an ordinary pipeline for everything; for tests)."""

    def __init__(
        self, config: RemoteConfig | str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Build the client without connecting. A string is parsed with ``RemoteConfig.parse``.

        Raises ConfigError for an invalid config (a missing password variable included). No I/O
        happens here: an unreachable server shows up in results and ``ping``.
        """
        import valkey  # lazy: the core imports this module without the remote extra installed
        from valkey.backoff import NoBackoff
        from valkey.retry import Retry

        self.config = RemoteConfig.parse(config) if isinstance(config, str) else config
        self.config.validate()
        self._clock = clock
        self._ttl_ms = max(1, round(self.config.ttl_s * 1000))
        self._auth = RemoteAuth(self.config.resolved_auth_key())
        if not self._auth.authenticated and self.config.url not in _UNAUTHENTICATED_WARNED:
            _UNAUTHENTICATED_WARNED.add(self.config.url)  # once per server and process
            log.warning(
                "no deployment secret (remote_key or %s) for %s: remote blocks are checksummed "
                "but not authenticated, so anyone who can write to the server can plant KV",
                SECRET_ENV,
                self.config.url,
            )
        self._lock = threading.Lock()
        self._stats = RemoteStats()
        self._down_until = 0.0
        self._last_warning = -float("inf")
        self._suppressed = 0
        self._errors = valkey.exceptions
        tls: dict[str, Any] = {}
        if self.config.tls:
            tls = {
                "ssl": True,
                "ssl_ca_certs": self.config.tls_ca,
                "ssl_certfile": self.config.tls_cert,
                "ssl_keyfile": self.config.tls_key,
                "ssl_check_hostname": self.config.tls_check_hostname,
            }
        self._client = valkey.Valkey(
            host=self.config.host,
            port=self.config.port,
            db=self.config.db,
            username=self.config.username,
            password=self.config.resolved_password(),
            socket_connect_timeout=self.config.connect_timeout_s,
            socket_timeout=self.config.op_timeout_s,
            # One retry on a fresh connection for a dead pooled socket (server restarted); every
            # command we send is idempotent. Timeouts are not in the list: no doubled waits.
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[valkey.exceptions.ConnectionError],
            health_check_interval=0,
            **tls,
        )

    # ------------------------------------------------------------------------------ public API

    def put_many(
        self,
        keys: Sequence[BlockKey],
        blocks: Sequence[BlockBuffer | Segments],
        *,
        skip_present: bool = True,
    ) -> list[BlockResult]:
        """Store one block per key; returns one result per key, in order (ok or error).

        Blocking network I/O: never call it on an engine thread. Never raises for server
        trouble. Raises ValueError before any I/O for mismatched counts or unusable buffers.
        With ``skip_present``, blocks already on the server are not sent again (their TTL is
        refreshed); without it every block is written (SET PX).
        """
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        segments = [normalise(block, writable=False) for block in blocks]
        results: list[BlockResult | None] = [None] * len(keys)
        for batch in self._batches([_nbytes(s) for s in segments]):
            try:
                self._put_batch(keys, segments, batch, skip_present, results)
            except _Unavailable as exc:
                self._fail(keys, batch, results, TierError(str(exc)))
        return [r for r in results if r is not None]

    def fetch_many(
        self, keys: Sequence[BlockKey], block_bytes: int | None = None
    ) -> list[RemoteValue]:
        """Read ``keys`` and verify them; returns one RemoteValue per key, in order.

        Blocking network I/O: never call it on an engine thread. Never raises. Refreshes the
        TTL of every block found; deletes corrupt values (error results with CorruptBlockError).
        Every payload stays in memory until the caller drops it: call it a batch at a time.
        ``block_bytes`` (the expected size) sizes the batches to ``max_batch_bytes``; without it
        a batch is 64 keys.
        """
        per_batch = max(1, self.config.max_batch_bytes // block_bytes) if block_bytes else 64
        values: list[RemoteValue | None] = [None] * len(keys)
        for start in range(0, len(keys), per_batch):
            self._fetch_or_fail(keys, list(range(start, min(len(keys), start + per_batch))), values)
        return [v for v in values if v is not None]

    def get_many(
        self, keys: Sequence[BlockKey], blocks: Sequence[BlockBuffer | Segments]
    ) -> list[BlockResult]:
        """Read ``keys`` into ``blocks`` (writable); one result per key: ok, miss or error.

        Blocking network I/O: never call it on an engine thread. Never raises for server
        trouble; raises ValueError before any I/O for mismatched counts or read-only buffers.
        A buffer is written only for an ok result. A value of another length is an error.
        """
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        segments = [normalise(block, writable=True) for block in blocks]
        results: list[BlockResult | None] = [None] * len(keys)
        values: list[RemoteValue | None] = [None] * len(keys)
        for batch in self._batches([_nbytes(s) for s in segments]):
            self._fetch_or_fail(keys, batch, values)
            for i in batch:
                value = values[i]
                assert value is not None
                results[i] = self.deliver(value, segments[i])
                values[i] = None  # one batch of payloads in memory at a time
        return [r for r in results if r is not None]

    def deliver(self, value: RemoteValue, segments: Segments) -> BlockResult:
        """Copy a fetched value into ``segments`` when ok and sizes agree; return its result."""
        if value.status is not BlockStatus.OK or value.payload is None:
            return value.result()
        expected = _nbytes(segments)
        if len(value.payload) != expected:
            self._count("errors")
            return BlockResult(
                value.key,
                BlockStatus.ERROR,
                Tier.REMOTE,
                TierError(f"remote block holds {len(value.payload)} bytes, expected {expected}"),
            )
        value.copy_into(segments)
        return value.result()

    def exists_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Return whether each key is on the server now; False for all when it cannot answer.

        Blocking network I/O: never call it on an engine thread. Never raises. Does not refresh
        TTLs (a read does).
        """
        try:
            replies = self._pipeline(lambda pipe: [pipe.exists(self._name(k)) for k in keys])
        except _Unavailable:
            return [False] * len(keys)
        return [bool(r) and not isinstance(r, Exception) for r in replies]

    def lookup_prefix(self, keys: Sequence[BlockKey]) -> int:
        """Return how many leading ``keys`` are on the server now (0 when it cannot answer).

        Blocking network I/O: never call it on an engine thread. Never raises. One round trip
        per 512 keys, stopping at the first chunk with a gap.
        """
        count = 0
        for start in range(0, len(keys), _LOOKUP_CHUNK):
            present = self.exists_many(keys[start : start + _LOOKUP_CHUNK])
            for here in present:
                if not here:
                    return count
                count += 1
        return count

    def delete_many(self, keys: Sequence[BlockKey]) -> int:
        """Delete ``keys``; returns how many existed (0 when the server cannot answer).

        Blocking network I/O: never call it on an engine thread. Never raises.
        """
        if not keys:
            return 0
        names = [self._name(k) for k in keys]
        chunk = 1000
        try:
            replies = self._pipeline(
                lambda pipe: [
                    pipe.delete(*names[i : i + chunk]) for i in range(0, len(names), chunk)
                ]
            )
        except _Unavailable:
            return 0
        return sum(int(r) for r in replies if not isinstance(r, Exception))

    def ping(self) -> bool:
        """Return True when the server answers PING now. Never raises; ignores the backoff and
        ends it on success (use it as the health probe)."""
        try:
            ok = bool(self._client.ping())
        except Exception as exc:
            self._warn(f"remote tier {self.config.url} does not answer: {exc}")
            return False
        with self._lock:
            self._down_until = 0.0
        return ok

    def stats(self) -> RemoteStats:
        """Return a copy of the counters."""
        with self._lock:
            return replace(self._stats)

    def name_of(self, key: BlockKey) -> str:
        """The server key of ``key`` (for operators and tests)."""
        return self._name(key)

    def close(self) -> None:
        """Close every pooled connection. Idempotent; later calls reconnect."""
        try:
            self._client.close()
            self._client.connection_pool.disconnect()
        except Exception as exc:  # closing must never fail a shutdown
            log.debug("closing the remote tier client: %s", exc)

    def __enter__(self) -> RemoteBlocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ internals

    def _name(self, key: BlockKey) -> str:
        return self._auth.name(self.config.key_prefix, key)

    def _batches(self, sizes: Sequence[int]) -> Iterator[list[int]]:
        """Index lists of at most max_batch_bytes of payload each (a bigger block goes alone)."""
        batch: list[int] = []
        total = 0
        for index, size in enumerate(sizes):
            if batch and total + size > self.config.max_batch_bytes:
                yield batch
                batch, total = [], 0
            batch.append(index)
            total += size
        if batch:
            yield batch

    def _pipeline(self, queue: Callable[[Any], object]) -> list[Any]:
        """Queue commands with ``queue(pipe)`` and run them in one round trip.

        Per-command errors come back as exception objects in the list. Raises _Unavailable for
        connection trouble (and starts the backoff) or while backing off.
        """

        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            queue(pipe)
            replies: list[Any] = pipe.execute(raise_on_error=False)
            return replies

        return self._round_trip(run)

    def _direct(
        self,
        pack: Callable[[Any], list[bytes | memoryview]],
        count: int,
        plain: Callable[[Any], object],
    ) -> list[Any]:
        """Run one round trip of ``count`` commands that ``pack(connection)`` encodes as RESP
        chunks, reading the replies with _ReplyReader, when the client uses its pure-Python
        parser; otherwise (C parser, or ``direct`` off) queue them with ``plain(pipeline)`` on
        an ordinary pipeline. Same contract as ``_pipeline``."""

        def run() -> list[Any]:
            pool = self._client.connection_pool
            for attempt in (0, 1):
                conn = pool.get_connection("GET")
                sock = getattr(conn, "_sock", None)
                if not self.direct or type(conn._parser).__name__ != "_RESP2Parser" or not sock:
                    pool.release(conn)  # a C parser (libvalkey) is fast already: plain pipeline
                    break
                clean = False
                try:
                    try:
                        conn.send_packed_command(pack(conn))
                    except self._errors.ConnectionError:
                        if attempt:
                            raise
                        continue  # a dead pooled socket: once more on a fresh connection
                    reader = _ReplyReader(sock)
                    replies = [reader.read() for _ in range(count)]
                    if reader.pending():
                        raise self._errors.InvalidResponse("unexpected data after the replies")
                    clean = True
                    return replies
                except (OSError, ValueError) as exc:
                    raise self._errors.ConnectionError(f"reading replies: {exc}") from exc
                finally:
                    if not clean:
                        conn.disconnect()  # mid-stream: the connection's state is unknown
                    pool.release(conn)
            pipe = self._client.pipeline(transaction=False)
            plain(pipe)
            replies_: list[Any] = pipe.execute(raise_on_error=False)
            return replies_

        return self._round_trip(run)

    def _round_trip(self, run: Callable[[], list[Any]]) -> list[Any]:
        """Run one round trip with the backoff, the counters and the error mapping."""
        now = self._clock()
        with self._lock:
            if now < self._down_until:
                self._stats.unavailable += 1
                raise _Unavailable(f"remote tier {self.config.url} unavailable (backing off)")
        try:
            replies = run()
        except (self._errors.ConnectionError, self._errors.TimeoutError, OSError) as exc:
            with self._lock:
                self._down_until = self._clock() + self.config.backoff_s
                self._stats.unavailable += 1
                self._stats.round_trips += 1
            self._warn(f"remote tier {self.config.url} unreachable: {exc}")
            raise _Unavailable(f"remote tier {self.config.url} unreachable: {exc}") from exc
        except self._errors.ValkeyError as exc:  # e.g. authentication: reachable but refusing
            with self._lock:
                self._stats.round_trips += 1
            self._warn(f"remote tier {self.config.url} refused the request: {exc}")
            raise _Unavailable(f"remote tier {self.config.url} refused the request: {exc}") from exc
        with self._lock:
            self._stats.round_trips += 1
        return replies

    def _put_batch(
        self,
        keys: Sequence[BlockKey],
        segments: Sequence[Segments],
        batch: list[int],
        skip_present: bool,
        results: list[BlockResult | None],
    ) -> None:
        todo = batch
        if skip_present:
            # PEXPIRE answers "is it there" and refreshes the TTL in one command per key.
            replies = self._pipeline(
                lambda pipe: [pipe.pexpire(self._name(keys[i]), self._ttl_ms) for i in batch]
            )
            todo = []
            for i, reply in zip(batch, replies, strict=True):
                if reply is True or reply == 1:
                    results[i] = BlockResult(keys[i], BlockStatus.OK, Tier.REMOTE)
                    self._count("put_skipped")
                else:
                    todo.append(i)
            if not todo:
                return
        sizes: dict[int, int] = {}

        def pack(_conn: Any) -> list[bytes | memoryview]:
            chunks: list[bytes | memoryview] = []
            for i in todo:
                command, sizes[i] = _set_command(
                    self._auth, self._name(keys[i]), keys[i], segments[i], self._ttl_ms
                )
                chunks += command
            return chunks

        def plain(pipe: Any) -> None:
            for i in todo:
                value = encode_value(self._auth, keys[i], segments[i])
                sizes[i] = len(value) - HEADER_BYTES
                pipe.set(self._name(keys[i]), memoryview(value), px=self._ttl_ms)

        replies = self._direct(pack, len(todo), plain)
        for i, reply in zip(todo, replies, strict=True):
            if isinstance(reply, Exception) or not reply:
                self._count("errors")
                self._warn(f"remote tier {self.config.url} rejected a block: {reply}")
                error = TierError(f"remote tier rejected the block: {reply}")
                results[i] = BlockResult(keys[i], BlockStatus.ERROR, Tier.REMOTE, error)
            else:
                with self._lock:
                    self._stats.puts += 1
                    self._stats.put_bytes += sizes[i]
                results[i] = BlockResult(keys[i], BlockStatus.OK, Tier.REMOTE)

    def _fetch_or_fail(
        self, keys: Sequence[BlockKey], batch: list[int], values: list[RemoteValue | None]
    ) -> None:
        try:
            self._fetch_batch(keys, batch, values)
        except _Unavailable as exc:
            with self._lock:
                self._stats.errors += len(batch)
            for i in batch:
                values[i] = RemoteValue(keys[i], BlockStatus.ERROR, error=TierError(str(exc)))

    def _fetch_batch(
        self, keys: Sequence[BlockKey], batch: list[int], values: list[RemoteValue | None]
    ) -> None:
        names = [self._name(keys[i]) for i in batch]
        commands: list[tuple[Any, ...]] = []
        for name in names:
            commands += [("GET", name), ("PEXPIRE", name, self._ttl_ms)]

        def plain(pipe: Any) -> None:
            for command in commands:
                pipe.execute_command(*command)

        replies = self._direct(lambda conn: conn.pack_commands(commands), len(commands), plain)
        corrupt: list[str] = []
        for n, i in enumerate(batch):
            raw = replies[2 * n]
            key = keys[i]
            with self._lock:
                self._stats.gets += 1
            if isinstance(raw, Exception):
                self._count("errors")
                values[i] = RemoteValue(
                    key, BlockStatus.ERROR, error=TierError(f"remote read failed: {raw}")
                )
            elif raw is None:
                self._count("misses")
                values[i] = RemoteValue(key, BlockStatus.MISS)
            else:
                try:
                    payload = verify(self._auth, key, raw)
                except BadTagError:
                    # Forged, or written under another secret: a miss for us. Deleted, so this
                    # deployment's next write of the block is not skipped as "present".
                    self._count("bad_tags")
                    self._warn(f"remote block {names[n]} has a bad tag; treated as a miss")
                    corrupt.append(names[n])
                    values[i] = RemoteValue(key, BlockStatus.MISS)
                    continue
                except CorruptBlockError as exc:
                    self._count("corrupt")
                    log.warning("remote block %s is corrupt (%s); deleting it", names[n], exc)
                    corrupt.append(names[n])
                    values[i] = RemoteValue(key, BlockStatus.ERROR, error=exc)
                    continue
                with self._lock:
                    self._stats.hits += 1
                    self._stats.get_bytes += len(payload)
                values[i] = RemoteValue(key, BlockStatus.OK, payload)
        if corrupt:
            # Unreachable now: the next reader finds it corrupt again and retries the delete.
            with contextlib.suppress(_Unavailable):
                self._pipeline(lambda pipe: pipe.delete(*corrupt))

    def _fail(
        self,
        keys: Sequence[BlockKey],
        batch: list[int],
        results: list[BlockResult | None],
        error: TierError,
    ) -> None:
        with self._lock:
            self._stats.errors += len(batch)
        for i in batch:
            results[i] = BlockResult(keys[i], BlockStatus.ERROR, Tier.REMOTE, error)

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self._stats, name, getattr(self._stats, name) + 1)

    def _warn(self, message: str) -> None:
        """Log ``message`` at most once per 30 s; the next one says how many were suppressed."""
        now = self._clock()
        with self._lock:
            if now - self._last_warning < _WARN_INTERVAL_S:
                self._suppressed += 1
                return
            suppressed, self._suppressed = self._suppressed, 0
            self._last_warning = now
        if suppressed:
            message += f" ({suppressed} similar warnings suppressed)"
        log.warning(message)


def _nbytes(segments: Segments) -> int:
    if isinstance(segments, DeviceSegments):
        return int(segments.nbytes)
    return _host_nbytes(segments)
