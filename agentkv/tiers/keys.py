"""Content addresses for KV blocks: a block can never be served to another model, layout or tenant.

Primitives:
    ModelFingerprint   what makes KV bytes interchangeable: model id, dtype, block size, layer
                       count, TP rank/size and the engine's memory layout; ``digest()`` is 16 bytes.
    BlockKey           one block's address: a 16-byte digest of (fingerprint, cache_salt, engine
                       block hash, parent key), plus the fingerprint digest it was derived under
                       (written into disk headers). Frozen, hashable, usable as a dict key;
                       ``hex()`` names its file.
    BlockKey.derive    one link of the chain.
    chain_keys         the whole chain for a request's engine block hashes, in order.

Keys use BLAKE2b (hashlib) rather than a fast non-cryptographic hash: cache_salt separates
tenants, and a key collision crafted by one tenant must not read another tenant's KV.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

KEY_BYTES = 16
"""Size of a key digest and of a fingerprint digest."""

EngineBlockHash = bytes | int
"""vLLM's block hash: bytes (sha256 family) or an int (builtin hash, may be negative)."""


def _field(data: bytes) -> bytes:
    # Length-prefixing keeps the encoding unambiguous ("ab"+"c" != "a"+"bc").
    return len(data).to_bytes(4, "little") + data


def _engine_hash_bytes(engine_hash: EngineBlockHash) -> bytes:
    if isinstance(engine_hash, bool):
        raise TypeError("engine block hash must be bytes or int, not bool")
    if isinstance(engine_hash, int):
        length = max(1, (engine_hash.bit_length() + 8) // 8)
        return b"i" + engine_hash.to_bytes(length, "little", signed=True)
    if isinstance(engine_hash, bytes | bytearray | memoryview):
        return b"b" + bytes(engine_hash)
    raise TypeError(f"engine block hash must be bytes or int, got {type(engine_hash).__name__}")


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Everything that decides whether two engines' KV bytes for the same tokens are identical."""

    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    tp_rank: int = 0
    tp_size: int = 1
    layout: str = ""

    def digest(self) -> bytes:
        """Return the 16-byte digest of every field (stable across processes and versions)."""
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"agentkv-fp-v1")
        for text in (self.model_id, self.dtype, self.layout):
            h.update(_field(text.encode()))
        for number in (self.block_size, self.num_layers, self.tp_rank, self.tp_size):
            h.update(number.to_bytes(8, "little", signed=True))
        return h.digest()


@dataclass(frozen=True, slots=True)
class BlockKey:
    """A block's content address. Equal keys mean byte-identical blocks."""

    digest: bytes
    fingerprint_digest: bytes

    def __post_init__(self) -> None:
        if len(self.digest) != KEY_BYTES or len(self.fingerprint_digest) != KEY_BYTES:
            raise ValueError(f"BlockKey digests must be {KEY_BYTES} bytes")

    def hex(self) -> str:
        """Return the key digest as 32 lowercase hex characters (used as the file name)."""
        return self.digest.hex()

    @classmethod
    def derive(
        cls,
        fingerprint: ModelFingerprint | bytes,
        cache_salt: str | bytes | None,
        engine_hash: EngineBlockHash,
        parent: BlockKey | None = None,
    ) -> BlockKey:
        """Return the key of one block, chained to its parent (None for the first block).

        ``fingerprint`` may be a ModelFingerprint or its precomputed ``digest()``.
        A parent derived under another fingerprint raises ValueError.
        """
        fp_digest = (
            fingerprint.digest() if isinstance(fingerprint, ModelFingerprint) else fingerprint
        )
        if parent is not None and parent.fingerprint_digest != fp_digest:
            raise ValueError("parent key belongs to another model fingerprint")
        salt = cache_salt.encode() if isinstance(cache_salt, str) else (cache_salt or b"")
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"agentkv-key-v1")
        h.update(fp_digest)
        h.update(_field(salt))
        h.update(_field(_engine_hash_bytes(engine_hash)))
        h.update(parent.digest if parent is not None else b"\0" * KEY_BYTES)
        return cls(h.digest(), fp_digest)


def chain_keys(
    fingerprint: ModelFingerprint,
    cache_salt: str | bytes | None,
    engine_hashes: Iterable[EngineBlockHash],
) -> list[BlockKey]:
    """Return one key per engine block hash, each chained to the previous one (pure, cheap)."""
    fp_digest = fingerprint.digest()
    keys: list[BlockKey] = []
    parent: BlockKey | None = None
    for engine_hash in engine_hashes:
        parent = BlockKey.derive(fp_digest, cache_salt, engine_hash, parent)
        keys.append(parent)
    return keys
