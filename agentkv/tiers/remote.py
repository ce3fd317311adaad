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

Where the parts live: this module is the client (RemoteBlocks, RemoteStats; RemoteConfig is
re-exported); remote_config.py parses and validates the URL; remote_codec.py holds the wire
codec (remote_key, encode_value, the SET command, the RESP reply reader); remote_auth.py the
header format, the key names and the tag.

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
      receives each value once (ReplyReader). With the C parser (libvalkey installed) the
      ordinary pipeline is used. A connection left mid-reply is closed, never reused.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agentkv.errors import CorruptBlockError, TierError
from agentkv.tier import Tier
from agentkv.tiers.buffers import BlockBuffer, Segments
from agentkv.tiers.keys import BlockKey
from agentkv.tiers.remote_auth import HEADER_BYTES, SECRET_ENV, BadTagError, RemoteAuth, verify
from agentkv.tiers.remote_codec import (
    RemoteValue,
    ReplyReader,
    encode_value,
    normalise,
    segments_nbytes,
    set_command,
)
from agentkv.tiers.remote_config import RemoteConfig
from agentkv.tiers.results import BlockResult, BlockStatus

__all__ = ["RemoteBlocks", "RemoteConfig", "RemoteStats", "RemoteValue"]

log = logging.getLogger(__name__)

_WARN_INTERVAL_S = 30.0
_UNAUTHENTICATED_WARNED: set[str] = set()
_LOOKUP_CHUNK = 512  # keys per EXISTS pipeline in lookup_prefix: stops early on long chains


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


class _Unavailable(Exception):
    """Internal: the server could not be reached (connection error, timeout, backoff)."""


class RemoteBlocks:
    """A Valkey/Redis-backed block tier (see module docstring). Thread-safe."""

    direct = True
    """Under valkey-py's pure-Python parser, send SETs from the caller's memory and read replies
    with ReplyReader (False: an ordinary pipeline for everything; for tests)."""

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
        for batch in self._batches([segments_nbytes(s) for s in segments]):
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
        for batch in self._batches([segments_nbytes(s) for s in segments]):
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
        expected = segments_nbytes(segments)
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
        chunks, reading the replies with ReplyReader, when the client uses its pure-Python
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
                    reader = ReplyReader(sock)
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
                command, sizes[i] = set_command(
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
