"""Tier keys for tier tests: the real key functions over stand-in vLLM block hashes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from agentkv.tiers.keys import BlockKey, ModelFingerprint, block_keys


def fake_block_hash(tag: str | None, i: int) -> bytes:
    """A stand-in for vLLM's block hash of block ``i`` under ``tag`` (distinct per pair)."""
    return hashlib.sha256(f"{tag}|{i}".encode()).digest()


def make_keys(fp: ModelFingerprint, tag: str | None, ids: Iterable[int]) -> list[BlockKey]:
    """One rank's keys (``fp``) of blocks ``ids`` under ``tag``."""
    return block_keys(fp, [fake_block_hash(tag, i) for i in ids])
