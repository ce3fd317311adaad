"""Tier keys: a block can never be served to another model, layout, rank or tenant.

Primitives:
    ModelFingerprint   what makes KV bytes interchangeable: model id, dtype, block size, layer
                       count, TP rank/size and the engine's memory layout; ``digest()`` is 16 bytes.
                       KV identity lives here: a field added to it separates every key.
    logical_fingerprint(model_id, dtype, block_size, num_layers, tp_size)
                       the scheduler's fingerprint (rank-agnostic: tp_rank -1, layout logical-v2)
    logical_key(block_hash, fingerprint_digest)
                       the scheduler's key of one vLLM block hash (``agentkv-key-v2``): what the
                       manager indexes and the KV events name
    rank_key(logical, rank_fingerprint_digest)
                       one TP rank's key of a logical key (``agentkv-rank-v1``): what that rank's
                       host, disk and remote tiers store the block under
    BlockKey           a rank key: its 16-byte digest plus the fingerprint digest it was derived
                       under (written into disk headers). Frozen, hashable; ``hex()`` names its file.
    block_keys(fingerprint, block_hashes)
                       both steps for one rank, in order (tools and tests)

The one key scheme. vLLM's block hash already chains the prefix and carries cache_salt, LoRA
and multimodal extras, so a logical key inherits all of them; the fingerprints add the model,
dtype and layout (logical) and the rank (per rank). Keys use BLAKE2b (hashlib) rather than a
fast non-cryptographic hash: cache_salt separates tenants, and a key collision crafted by one
tenant must not read another tenant's KV.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

KEY_BYTES = 16
"""Size of a key digest and of a fingerprint digest."""
LOGICAL_KEY_PERSON = b"agentkv-key-v2"
RANK_KEY_PERSON = b"agentkv-rank-v1"
LOGICAL_LAYOUT = "logical-v2"


def _field(data: bytes) -> bytes:
    # Length-prefixing keeps the encoding unambiguous ("ab"+"c" != "a"+"bc").
    return len(data).to_bytes(4, "little") + data


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
    """A block's address in one rank's tiers. Equal keys mean byte-identical blocks."""

    digest: bytes
    fingerprint_digest: bytes

    def __post_init__(self) -> None:
        if len(self.digest) != KEY_BYTES or len(self.fingerprint_digest) != KEY_BYTES:
            raise ValueError(f"BlockKey digests must be {KEY_BYTES} bytes")

    def hex(self) -> str:
        """Return the key digest as 32 lowercase hex characters (used as the file name)."""
        return self.digest.hex()


def logical_fingerprint(
    model_id: str, dtype: str, block_size: int, num_layers: int, tp_size: int
) -> ModelFingerprint:
    """The scheduler's fingerprint: the same on every rank (no rank, a logical layout)."""
    return ModelFingerprint(
        model_id=model_id,
        dtype=dtype,
        block_size=block_size,
        num_layers=num_layers,
        tp_rank=-1,
        tp_size=tp_size,
        layout=LOGICAL_LAYOUT,
    )


def logical_key(block_hash: bytes, fingerprint_digest: bytes) -> bytes:
    """The tier key of one vLLM block hash under a logical fingerprint's digest (16 bytes)."""
    return hashlib.blake2b(
        bytes(block_hash),
        digest_size=KEY_BYTES,
        key=fingerprint_digest[:64],
        person=LOGICAL_KEY_PERSON,
    ).digest()


def rank_key(logical: bytes, rank_fingerprint_digest: bytes) -> BlockKey:
    """One rank's key of a logical key: a block only ever comes back to the rank, layout and
    model it left."""
    digest = hashlib.blake2b(
        logical + rank_fingerprint_digest, digest_size=KEY_BYTES, person=RANK_KEY_PERSON
    ).digest()
    return BlockKey(digest, rank_fingerprint_digest)


def block_keys(
    fingerprint: ModelFingerprint,
    block_hashes: Iterable[bytes],
    logical: ModelFingerprint | None = None,
) -> list[BlockKey]:
    """The keys a rank with ``fingerprint`` stores these vLLM block hashes under (the logical
    fingerprint defaults to the rank's own model, dtype and layer count)."""
    fp = fingerprint.digest()
    lfp = (
        logical
        or logical_fingerprint(
            fingerprint.model_id,
            fingerprint.dtype,
            fingerprint.block_size,
            fingerprint.num_layers,
            fingerprint.tp_size,
        )
    ).digest()
    return [rank_key(logical_key(h, lfp), fp) for h in block_hashes]
