"""Shared by the remote tier's tests (test_tiers_remote*.py, test_tiers_store_remote.py):
block helpers and the client, raw-connection and store fixtures on the session valkey-server.

A test module binds the fixtures it uses to module names (``remote = fixtures.remote``) and
imports tests.valkey_fixture's fixtures, which these depend on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import valkey

from agentkv.tiers.disk import HEADER_BYTES as HEADER_BYTES_DISK
from agentkv.tiers.keys import BlockKey, ModelFingerprint
from agentkv.tiers.remote import RemoteBlocks, RemoteConfig
from agentkv.tiers.store import TieredStore
from tests.unit.key_helpers import make_keys
from tests.valkey_fixture import unique_prefix

BLOCK = 16 * 1024
FP = ModelFingerprint("tiny", "bfloat16", 16, 4)
TTL_S = 600.0
FILE = HEADER_BYTES_DISK + BLOCK


def keys(n: int, salt: str = "s", fp: ModelFingerprint = FP) -> list[BlockKey]:
    return make_keys(fp, salt, range(n))


def content(key: BlockKey, size: int = BLOCK) -> np.ndarray:
    """Bytes derived from the key, so a mixed-up block is detected."""
    seed = int.from_bytes(key.digest[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def zeros(n: int, size: int = BLOCK) -> list[np.ndarray]:
    return [np.zeros(size, np.uint8) for _ in range(n)]


@pytest.fixture
def remote(valkey_url: str) -> Iterator[Any]:
    """A factory of clients on the session server, each test under its own key prefix."""
    opened: list[RemoteBlocks] = []
    prefix = unique_prefix()

    def make(url: str = valkey_url, **options: Any) -> RemoteBlocks:
        options.setdefault("key_prefix", prefix)
        options.setdefault("ttl_s", TTL_S)
        client = RemoteBlocks(RemoteConfig.parse(url, **options))
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()


@pytest.fixture
def raw(valkey_url: str) -> Iterator[Any]:
    client = valkey.Valkey.from_url(valkey_url)
    yield client
    client.close()


@pytest.fixture
def store(remote: Any, tmp_path: Path) -> Iterator[Any]:
    """A factory of stores with 4 host slots, 4 disk files and the given (or a new) client."""
    opened: list[TieredStore] = []

    def make(client: RemoteBlocks | None = None, **kw: Any) -> TieredStore:
        kw.setdefault("remote", client if client is not None else remote())
        s = TieredStore(4 * BLOCK, tmp_path / f"kv{len(opened)}", 4 * FILE, BLOCK, **kw)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()
