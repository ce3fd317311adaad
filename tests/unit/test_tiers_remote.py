"""The remote tier's client against a real valkey-server: URL config, round trips, content
addressing (salt, TP rank, fingerprint, key prefix), corruption, TTL refresh, a server killed,
hung and restarted, password auth, one round trip per batch. The TieredStore's remote tier is in
test_tiers_store_remote.py, TLS in test_tiers_remote_tls.py."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import valkey

from agentkv.errors import ConfigError, CorruptBlockError
from agentkv.tiers.keys import ModelFingerprint
from agentkv.tiers.remote import RemoteBlocks, RemoteConfig
from agentkv.tiers.remote_auth import HEADER_BYTES
from agentkv.tiers.remote_codec import remote_key
from agentkv.tiers.results import BlockStatus
from agentkv.tiers.store import TieredStore
from agentkv.tiers.valkey_server import ValkeyProcess
from tests.unit import remote_fixtures
from tests.unit.key_helpers import make_keys
from tests.unit.remote_fixtures import BLOCK, FP, TTL_S, content, keys, zeros
from tests.valkey_fixture import unique_prefix, valkey_server, valkey_url  # noqa: F401

remote = remote_fixtures.remote
raw = remote_fixtures.raw


# ---------------------------------------------------------------------------------- config


def test_parse_url_forms_and_options(monkeypatch: pytest.MonkeyPatch) -> None:
    c = RemoteConfig.parse("valkey://cache.internal")
    assert (c.host, c.port, c.db, c.tls, c.key_prefix) == (
        "cache.internal",
        6379,
        0,
        False,
        "agentkv",
    )
    c = RemoteConfig.parse("rediss://user:p%40ss@10.0.0.5:6380/3?ttl_s=120&key_prefix=prod")
    assert (c.host, c.port, c.db, c.tls, c.username) == ("10.0.0.5", 6380, 3, True, "user")
    assert c.resolved_password() == "p@ss" and c.ttl_s == 120 and c.key_prefix == "prod"
    assert "p@ss" not in repr(c) and "p%40ss" not in repr(c)
    assert c.url == "valkeys://10.0.0.5:6380/3"
    assert RemoteConfig.parse("redis://h/0", ttl_s=5).ttl_s == 5  # options override the URL
    assert RemoteConfig.from_url("valkeys://h:1/0").tls
    assert RemoteConfig.parse("valkeys://h").tls_check_hostname
    assert not RemoteConfig.parse("valkeys://h?tls_check_hostname=false").tls_check_hostname
    monkeypatch.setenv("AGENTKV_TEST_PW", "from-env")
    c = RemoteConfig.parse("valkey://h?password_env=AGENTKV_TEST_PW")
    assert c.resolved_password() == "from-env"


@pytest.mark.parametrize(
    ("url", "options", "message"),
    [
        ("localhost:6379", {}, "must look like valkey://"),
        ("http://h:6379/0", {}, "scheme 'http' is not supported"),
        ("valkey://:6379/0", {}, "has no host"),
        ("valkey://h:99999/0", {}, "out of range"),
        ("valkey://h/zero", {}, "database 'zero' must be a number"),
        ("valkey://h/0?ttl=5", {}, "option 'ttl' is unknown"),
        ("valkey://h/0?ttl_s=abc", {}, "ttl_s 'abc' is not a number"),
        ("valkey://h/0?ttl_s=0", {}, "ttl_s must be positive"),
        ("valkey://h/0?ttl_s=inf", {}, "ttl_s must be positive and finite"),
        ("valkey://h/0?ttl_s=1e9", {}, "above"),
        ("valkey://h/0", {"key_prefix": "has space"}, "key_prefix 'has space'"),
        ("valkey://h/0", {"max_batch_bytes": 0}, "max_batch_bytes must be positive"),
        ("valkey://h/0", {"tls_ca": "/etc/hostname"}, "need a TLS URL"),
        ("valkeys://h/0", {"tls_cert": "/etc/hostname"}, "go together"),
        ("valkeys://h/0", {"tls_ca": "/nonexistent/ca.pem"}, "not a readable file"),
        ("valkey://h/0", {"password_env": "AGENTKV_SURELY_UNSET"}, "is not set"),
        ("valkey://h/0", {"colour": "red"}, "unknown remote tier option 'colour'"),
        ("valkeys://h/0?tls_check_hostname=maybe", {}, "must be true or false"),
    ],
)
def test_parse_errors_name_the_bad_part(url: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RemoteConfig.parse(url, **options)


# --------------------------------------------------------------------------------- client


def test_round_trip_bit_identical_segments_and_prefix_lookup(remote: Any) -> None:
    r = remote()
    ks = keys(6)
    assert r.ping()
    assert [x.status for x in r.put_many(ks[:4], [content(k) for k in ks[:4]])] == [
        BlockStatus.OK
    ] * 4
    # A block as segments (e.g. one per layer) round-trips into differently split segments.
    whole = content(ks[4])
    assert r.put_many([ks[4]], [[whole[:1000], whole[1000:]]])[0].ok
    out = zeros(5)
    results = r.get_many(ks[:5], out)
    assert all(x.ok and x.tier == "remote" for x in results)
    assert all(np.array_equal(o, content(k)) for o, k in zip(out, ks[:5], strict=True))
    split = [np.zeros(BLOCK - 7, np.uint8), np.zeros(7, np.uint8)]
    assert r.get_many([ks[4]], [split])[0].ok
    assert np.array_equal(np.concatenate(split), whole)
    assert r.lookup_prefix(ks) == 5
    assert r.lookup_prefix(ks[1:]) == 4 and r.lookup_prefix([]) == 0
    assert r.exists_many([ks[5], ks[0]]) == [False, True]
    miss = r.get_many([ks[5]], zeros(1))[0]
    assert miss.status is BlockStatus.MISS and miss.tier == "remote"
    assert r.delete_many(ks) == 5 and r.lookup_prefix(ks) == 0


def test_keys_differing_by_salt_rank_fingerprint_or_prefix_never_collide(
    remote: Any, raw: Any
) -> None:
    r = remote()
    [stored] = keys(1, salt="tenant-a")
    variants = {
        "salt": keys(1, salt="tenant-b")[0],
        "no salt": make_keys(FP, None, range(1))[0],
        "tp rank": keys(1, "tenant-a", ModelFingerprint("tiny", "bfloat16", 16, 4, tp_rank=1))[0],
        "layout": keys(1, "tenant-a", ModelFingerprint("tiny", "bfloat16", 16, 4, layout="HND"))[0],
        "model": keys(1, "tenant-a", ModelFingerprint("other", "bfloat16", 16, 4))[0],
    }
    assert r.put_many([stored], [content(stored)])[0].ok
    names = {r.name_of(stored)} | {r.name_of(k) for k in variants.values()}
    assert len(names) == len(variants) + 1
    for what, key in variants.items():
        assert r.get_many([key], zeros(1))[0].status is BlockStatus.MISS, what
        assert r.lookup_prefix([key]) == 0, what
    # Another deployment's prefix on the same server sees nothing and deletes nothing.
    other = remote(key_prefix=unique_prefix())
    assert other.get_many([stored], zeros(1))[0].status is BlockStatus.MISS
    assert other.delete_many([stored]) == 0
    assert r.lookup_prefix([stored]) == 1
    assert r.name_of(stored).startswith(f"{r.config.key_prefix}:kv2:")
    assert raw.exists(r.name_of(stored)) == 1


def test_a_value_copied_under_another_key_is_rejected(remote: Any, raw: Any) -> None:
    """Even a server-side mix-up (or a crafted value) cannot serve one key's bytes for another."""
    r = remote()
    a, b = keys(2)
    assert r.put_many([a], [content(a)])[0].ok
    raw.set(r.name_of(b), raw.get(r.name_of(a)))
    result = r.get_many([b], zeros(1))[0]
    assert result.status is BlockStatus.ERROR and isinstance(result.error, CorruptBlockError)
    assert "another key" in str(result.error)
    assert raw.exists(r.name_of(b)) == 0 and raw.exists(r.name_of(a)) == 1


@pytest.mark.parametrize("damage", ["payload bit", "truncated", "header", "garbage"])
def test_corrupt_value_is_an_error_and_deleted(remote: Any, raw: Any, damage: str) -> None:
    r = remote()
    [k] = keys(1, salt=damage)
    assert r.put_many([k], [content(k)])[0].ok
    name = r.name_of(k)
    value = bytearray(raw.get(name))
    if damage == "payload bit":
        value[HEADER_BYTES + 100] ^= 0x01
    elif damage == "truncated":
        value = value[:-1]
    elif damage == "header":
        value[10] ^= 0xFF
    else:
        value = bytearray(b"not a block")
    raw.set(name, bytes(value), px=60_000)
    out = zeros(1)
    result = r.get_many([k], out)[0]
    assert result.status is BlockStatus.ERROR and isinstance(result.error, CorruptBlockError)
    assert not out[0].any()  # nothing reached the buffer
    assert raw.exists(name) == 0
    assert r.stats().corrupt == 1
    assert r.get_many([k], out)[0].status is BlockStatus.MISS


def test_a_block_of_another_size_is_an_error_and_stays(remote: Any, raw: Any) -> None:
    r = remote()
    [k] = keys(1)
    assert r.put_many([k], [content(k)])[0].ok
    result = r.get_many([k], [np.zeros(BLOCK * 2, np.uint8)])[0]
    assert result.status is BlockStatus.ERROR and not isinstance(result.error, CorruptBlockError)
    assert raw.exists(r.name_of(k)) == 1


def test_ttl_is_set_on_write_and_refreshed_on_read_and_on_re_put(remote: Any, raw: Any) -> None:
    r = remote(ttl_s=TTL_S)
    ks = keys(2)
    assert all(x.ok for x in r.put_many(ks, [content(k) for k in ks]))
    full = TTL_S * 1000
    for k in ks:
        assert full - 5_000 < raw.pttl(r.name_of(k)) <= full
        raw.pexpire(r.name_of(k), 5_000)  # as if most of the TTL had passed
    assert r.get_many(ks[:1], zeros(1))[0].ok
    assert raw.pttl(r.name_of(ks[0])) > full - 5_000  # a read renews
    assert raw.pttl(r.name_of(ks[1])) <= 5_000  # an unread block does not
    assert r.exists_many(ks[1:]) == [True]  # a presence query does not renew either
    assert raw.pttl(r.name_of(ks[1])) <= 5_000
    before = r.stats()
    assert r.put_many(ks[1:], [content(ks[1])])[0].ok  # present: renewed, not resent
    assert raw.pttl(r.name_of(ks[1])) > full - 5_000
    after = r.stats()
    assert after.put_skipped == before.put_skipped + 1 and after.puts == before.puts


class _Sends:
    """Counts the socket writes of ``clients``' connections: one per pipeline round trip."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *clients: RemoteBlocks) -> None:
        self.count = 0
        pools = [c._client.connection_pool for c in clients]
        original = valkey.connection.AbstractConnection.send_packed_command

        def counting(conn: Any, command: Any, check_health: bool = True) -> None:
            if any(conn in pool._in_use_connections for pool in pools):
                self.count += 1
            original(conn, command, check_health)

        monkeypatch.setattr(valkey.connection.AbstractConnection, "send_packed_command", counting)


def _calls(raw: Any, command: str) -> int:
    stats: dict[str, Any] = raw.info("commandstats")  # type: ignore[assignment]
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_one_round_trip_per_batch(remote: Any, raw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    r = remote()
    ks = keys(8)
    blocks = [content(k) for k in ks]
    small = remote(max_batch_bytes=3 * BLOCK)
    assert r.ping() and small.ping()  # connect (and handshake) before counting
    sends = _Sends(monkeypatch, r, small)
    sets, gets, pexpires = _calls(raw, "set"), _calls(raw, "get"), _calls(raw, "pexpire")
    assert all(x.ok for x in r.put_many(ks, blocks, skip_present=False))
    assert sends.count == 1 and _calls(raw, "set") == sets + 8
    assert all(x.ok for x in r.get_many(ks, zeros(8)))
    assert sends.count == 2
    assert _calls(raw, "get") == gets + 8 and _calls(raw, "pexpire") == pexpires + 8
    assert r.lookup_prefix(ks) == 8 and sends.count == 3
    # skip_present: one probe round trip; nothing is resent when everything is there.
    assert all(x.ok for x in r.put_many(ks, blocks))
    assert sends.count == 4 and _calls(raw, "set") == sets + 8
    # Batches hold at most max_batch_bytes of payload: 3 blocks per batch -> 3 round trips.
    sends.count = 0
    assert all(x.ok for x in small.get_many(ks, zeros(8)))
    assert sends.count == 3
    assert small.stats().round_trips == 3


def test_server_killed_mid_run_gives_error_results_then_recovers(
    remote: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with ValkeyProcess() as server:
        r = remote(server.url, backoff_s=0.0, connect_timeout_s=0.5, op_timeout_s=1.0)
        ks = keys(4)
        assert all(x.ok for x in r.put_many(ks[:2], [content(k) for k in ks[:2]]))
        server.kill()
        with caplog.at_level(logging.WARNING, logger="agentkv.tiers.remote"):
            put = r.put_many(ks[2:], [content(k) for k in ks[2:]])
            got = r.get_many(ks, zeros(4))
            assert all(x.status is BlockStatus.ERROR and x.tier == "remote" for x in put + got)
            assert "unreachable" in str(got[0].error)
            assert r.exists_many(ks) == [False] * 4
            assert r.lookup_prefix(ks) == 0 and r.delete_many(ks) == 0 and not r.ping()
        # Rate-limited: one warning for the whole outage, not one per call.
        assert len([m for m in caplog.messages if "remote tier" in m]) == 1
        server.start()  # same port, empty (no persistence)
        assert r.get_many(ks[:1], zeros(1))[0].status is BlockStatus.MISS  # no stale socket error
        assert all(x.ok for x in r.put_many(ks, [content(k) for k in ks]))
        out = zeros(4)
        assert all(x.ok for x in r.get_many(ks, out))
        assert all(np.array_equal(o, content(k)) for o, k in zip(out, ks, strict=True))


def test_backoff_fails_fast_without_io_until_ping_succeeds(remote: Any) -> None:
    with ValkeyProcess() as server:
        r = remote(server.url, backoff_s=3600.0)
        ks = keys(2)
        server.kill()
        assert r.get_many(ks, zeros(2))[0].status is BlockStatus.ERROR
        trips = r.stats().round_trips
        server.start()
        result = r.get_many(ks, zeros(2))[0]  # still backing off: no I/O at all
        assert result.status is BlockStatus.ERROR and "backing off" in str(result.error)
        assert r.stats().round_trips == trips and r.stats().unavailable >= 2
        assert r.ping()  # the probe ends the backoff
        assert r.get_many(ks, zeros(2))[0].status is BlockStatus.MISS


def test_password_auth(remote: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with ValkeyProcess(password="s3cr:t/@") as server:
        assert ":s3cr%3At%2F%40@" in server.url
        ks = keys(1)
        anonymous = remote(server.url.replace(":s3cr%3At%2F%40@", ""), backoff_s=0.0)
        assert not anonymous.ping()
        result = anonymous.put_many(ks, [content(ks[0])])[0]
        assert result.status is BlockStatus.ERROR
        wrong = remote(server.url, password="wrong", backoff_s=0.0)
        assert not wrong.ping() and not wrong.get_many(ks, zeros(1))[0].ok
        in_url = remote(server.url)
        assert in_url.ping() and in_url.put_many(ks, [content(ks[0])])[0].ok
        monkeypatch.setenv("AGENTKV_TEST_REMOTE_PW", "s3cr:t/@")
        from_env = remote(
            server.url.replace(":s3cr%3At%2F%40@", ""), password_env="AGENTKV_TEST_REMOTE_PW"
        )
        assert from_env.get_many(ks, zeros(1))[0].ok


def test_remote_key_is_prefix_and_digest_of_the_whole_key() -> None:
    a, b = keys(2)
    assert remote_key("p", a) != remote_key("p", b) != remote_key("q", b)
    assert remote_key("p", a).startswith("p:kv2:") and len(remote_key("p", a)) == len("p:kv2:") + 32
    assert not ValkeyProcess().running()


def test_cancelled_remote_load_writes_nothing(remote: Any) -> None:
    import threading

    client = remote()
    ks = keys(3, salt="cancel")
    assert all(x.ok for x in client.put_many(ks, [content(k) for k in ks]))
    with TieredStore(4 * BLOCK, None, 0, BLOCK, workers=1, remote=client) as s:
        gate = threading.Event()
        s._pool.submit(gate.wait)  # the only worker is busy until the load is cancelled
        out = zeros(3)
        handle = s.submit_load(ks, out)
        handle.cancel()
        gate.set()
        results = handle.result(10)
        assert all(r.status is BlockStatus.ERROR and "cancelled" in str(r.error) for r in results)
        assert not any(o.any() for o in out)
        assert client.stats().gets == 0  # no network read for a cancelled load


def test_a_hung_server_times_out_into_error_results_then_recovers(remote: Any) -> None:
    import os
    import signal
    import time

    with ValkeyProcess() as server:
        r = remote(server.url, op_timeout_s=0.3, backoff_s=0.0)
        ks = keys(2, salt="hang")
        assert r.put_many(ks[:1], [content(ks[0])])[0].ok
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)  # accepts connections (kernel backlog), never answers
        try:
            start = time.monotonic()
            got = r.get_many(ks, zeros(2))
            put = r.put_many(ks[1:], [content(ks[1])])
            assert all(x.status is BlockStatus.ERROR for x in got + put)
            assert (
                "timed out" in str(got[0].error).lower() or "timeout" in str(got[0].error).lower()
            )
            assert time.monotonic() - start < 5  # bounded by op_timeout_s, not hanging
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert r.ping()
        out = zeros(1)
        assert r.get_many(ks[:1], out)[0].ok and np.array_equal(out[0], content(ks[0]))
