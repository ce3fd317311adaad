"""Remote values authenticated with the deployment secret, against a real valkey-server: a block
planted by someone who knows the format, the key and the server key name but not the secret is a
miss and a counter (never loaded); deployments with different secrets never share a block; the
secret comes from ``remote_key`` or ``AGENTKV_REMOTE_KEY`` and never shows in a repr."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from agentkv.tiers import remote as remote_module
from agentkv.tiers.keys import BlockKey
from agentkv.tiers.remote import RemoteBlocks
from agentkv.tiers.remote_auth import SECRET_ENV, RemoteAuth
from agentkv.tiers.remote_codec import encode_value
from agentkv.tiers.results import BlockStatus
from tests.unit import remote_fixtures
from tests.valkey_fixture import unique_prefix, valkey_server, valkey_url  # noqa: F401

remote = remote_fixtures.remote
raw = remote_fixtures.raw
BLOCK = 8 * 1024


def _key(i: int) -> BlockKey:
    return BlockKey(bytes([i]) * 16, bytes([200]) * 16)


def _content(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8)


@pytest.fixture
def make(remote: Any) -> Any:
    """Clients by key prefix and deployment secret (None: unauthenticated)."""

    def build(prefix: str, secret: str | None) -> RemoteBlocks:
        return remote(key_prefix=prefix, auth_key=secret)  # type: ignore[no-any-return]

    return build


def test_a_planted_block_is_a_miss_and_a_counter_never_loaded(make: Any, raw: Any) -> None:
    victim = make(unique_prefix(), "deployment-secret")
    key = _key(1)
    # The attacker writes a well-formed value (right header, right checksums, right server key
    # name) under a secret of its own: everything but the tag is valid.
    planted = encode_value(RemoteAuth("attacker-guess"), key, [np.full(BLOCK, 7, np.uint8)])
    raw.set(victim.name_of(key), bytes(planted), px=60_000)
    out = [np.zeros(BLOCK, np.uint8)]
    result = victim.get_many([key], out)[0]
    assert result.status is BlockStatus.MISS
    assert not out[0].any()  # not one byte of it reached the buffer
    assert victim.stats().bad_tags == 1 and victim.stats().corrupt == 0
    assert raw.exists(victim.name_of(key)) == 0  # deleted: the next write is not skipped
    assert victim.put_many([key], [_content(1)])[0].ok
    assert victim.get_many([key], out)[0].ok and np.array_equal(out[0], _content(1))


def test_deployments_with_different_secrets_never_share_a_block(make: Any) -> None:
    prefix = unique_prefix()  # even a misconfigured shared prefix
    a, b, a2 = make(prefix, "secret-a"), make(prefix, "secret-b"), make(prefix, "secret-a")
    key = _key(2)
    assert a.put_many([key], [_content(2)])[0].ok
    assert a.name_of(key) != b.name_of(key)
    assert b.get_many([key], [np.zeros(BLOCK, np.uint8)])[0].status is BlockStatus.MISS
    assert b.lookup_prefix([key]) == 0 and b.stats().bad_tags == 0
    out = [np.zeros(BLOCK, np.uint8)]
    assert a2.get_many([key], out)[0].ok and np.array_equal(out[0], _content(2))


def test_the_secret_comes_from_the_environment_and_stays_out_of_reprs(
    make: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = unique_prefix()
    explicit = make(prefix, "from-env-secret")
    monkeypatch.setenv(SECRET_ENV, "from-env-secret")
    from_env = make(prefix, None)
    key = _key(3)
    assert explicit.put_many([key], [_content(3)])[0].ok
    assert from_env.get_many([key], [np.zeros(BLOCK, np.uint8)])[0].ok
    assert "from-env-secret" not in repr(explicit.config)
    monkeypatch.delenv(SECRET_ENV)
    monkeypatch.setattr(remote_module, "_UNAUTHENTICATED_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="agentkv.tiers.remote"):
        make(prefix, None)
    assert "not authenticated" in caplog.text  # an operator learns the blocks are unsigned
