"""Remote tier values, authenticated: a deployment secret names and signs every block.

Primitives:
    RemoteAuth(secret)        from the deployment secret (``remote_key`` setting, else the
                              ``AGENTKV_REMOTE_KEY`` environment variable; None: unauthenticated,
                              see below): ``name(prefix, key)`` the server key of a BlockKey,
                              ``mac()`` a fresh HMAC-SHA256 over header and payload.
    pack_header(auth, key, nbytes, checksum, payload_parts)
                              the 96-byte header of a value (its tag covers the payload parts).
    verify(auth, key, value)  the verified payload (a view, no copy); CorruptBlockError for
                              damage (structure, lengths, checksums: accidental), BadTagError for
                              a well-formed value whose tag does not verify (forged, or written
                              under another secret).

Key layout: ``{key_prefix}:kv2:{32 hex}``, the hex being keyed BLAKE2b-128 (key derived from the
secret) of the BlockKey's digest and fingerprint digest: without the secret no one can even name
a block. The BlockKey covers the KV identity and generation (``agentkv.kv_identity``), the tier
rank, the cache_salt and the whole prefix; ``key_prefix`` separates deployments sharing a server.

Value format (little endian): a 64-byte header, a 32-byte tag, then the payload:
    magic "AKVR" | version u16 (2) | flags u16 | payload_len u64 | payload xxh3_64 u64 |
    key digest 16B | fingerprint digest 16B | header xxh3_64 u64 | HMAC-SHA256 tag 32B
The xxh3 checksums tell accidental damage (corrupt: an error, the value is deleted) from a bad
tag (a miss, counted, the value is deleted so this deployment's next write replaces it). The tag
is HMAC-SHA256 under a key derived from the secret, over the 64-byte header and the payload.

Without a secret the same format is used with a public key: integrity against accidents only;
anyone who can write to the server can plant blocks. ``RemoteBlocks`` warns once at start.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable
from typing import Any

import xxhash

from agentkv.errors import CorruptBlockError, TierError
from agentkv.tiers.keys import KEY_BYTES, BlockKey

MAGIC = b"AKVR"
VERSION = 2
KEY_SPACE = "kv2"
"""Version of the key layout; a new value format gets a new key space, never a mixed one."""
SECRET_ENV = "AGENTKV_REMOTE_KEY"
TAG_BYTES = 32
_HEADER = struct.Struct(f"<4sHHQQ{KEY_BYTES}s{KEY_BYTES}s")
_HEADER_CHECKSUM = struct.Struct("<Q")
_PLAIN_HEADER = _HEADER.size + _HEADER_CHECKSUM.size  # 64
HEADER_BYTES = _PLAIN_HEADER + TAG_BYTES
"""Bytes in front of every payload (96)."""


class BadTagError(TierError):
    """A well-formed remote value whose tag does not verify under this deployment's secret."""


class RemoteAuth:
    """Names and tags of one deployment's remote blocks (see the module docstring)."""

    def __init__(self, secret: str | bytes | None) -> None:
        raw = secret.encode() if isinstance(secret, str) else (secret or b"")
        self.authenticated = bool(raw)
        self._name_key = hashlib.sha256(b"agentkv-remote-name\0" + raw).digest()
        self._mac_key = hashlib.sha256(b"agentkv-remote-mac\0" + raw).digest()

    def name(self, prefix: str, key: BlockKey) -> str:
        """The server key of ``key`` under ``prefix``."""
        h = hashlib.blake2b(digest_size=KEY_BYTES, key=self._name_key, person=b"agentkv-remote2")
        h.update(key.digest)
        h.update(key.fingerprint_digest)
        return f"{prefix}:{KEY_SPACE}:{h.hexdigest()}"

    def mac(self) -> Any:
        """A fresh HMAC-SHA256 under this deployment's tag key."""
        return hmac.new(self._mac_key, digestmod=hashlib.sha256)


def pack_header(
    auth: RemoteAuth, key: BlockKey, nbytes: int, checksum: int, payload_parts: Iterable[Any]
) -> bytes:
    """Return header + tag of a value whose payload (``payload_parts``, in order) has ``nbytes``
    bytes and xxh3 ``checksum``."""
    header = _HEADER.pack(MAGIC, VERSION, 0, nbytes, checksum, key.digest, key.fingerprint_digest)
    header += _HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(header))
    mac = auth.mac()
    mac.update(header)
    for part in payload_parts:
        mac.update(part)
    return header + mac.digest()


def verify(auth: RemoteAuth, key: BlockKey, value: bytes | bytearray | memoryview) -> memoryview:
    """Return the verified payload of ``value`` (a view, no copy); see the module docstring."""
    view = memoryview(value)
    if len(view) < HEADER_BYTES:
        raise CorruptBlockError(f"remote value truncated ({len(view)} bytes, no full header)")
    magic, version, _flags, length, checksum, digest, fingerprint = _HEADER.unpack_from(view)
    (header_sum,) = _HEADER_CHECKSUM.unpack_from(view, _HEADER.size)
    if magic != MAGIC:
        raise CorruptBlockError("remote value has a bad magic")
    if version != VERSION:
        raise CorruptBlockError(f"remote value has unsupported version {version}")
    if xxhash.xxh3_64_intdigest(view[: _HEADER.size]) != header_sum:
        raise CorruptBlockError("remote value header checksum mismatch")
    if len(view) - HEADER_BYTES != length:
        raise CorruptBlockError(
            f"remote value truncated ({len(view) - HEADER_BYTES} of {length} payload bytes)"
        )
    payload = view[HEADER_BYTES:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptBlockError("remote value payload checksum mismatch")
    mac = auth.mac()
    mac.update(view[:_PLAIN_HEADER])
    mac.update(payload)
    if not hmac.compare_digest(mac.digest(), bytes(view[_PLAIN_HEADER:HEADER_BYTES])):
        raise BadTagError("remote value tag does not verify (forged, or another secret)")
    if digest != key.digest or fingerprint != key.fingerprint_digest:
        raise CorruptBlockError("remote value header names another key")
    return payload
