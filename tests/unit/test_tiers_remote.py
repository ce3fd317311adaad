"""The remote tier against a real valkey-server: URL config, round trips, content addressing
(salt, TP rank, fingerprint, key prefix), corruption, TTL refresh, a server killed and restarted,
password auth, one round trip per batch, and the TieredStore's remote tier and load fallback."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import valkey

from agentkv.errors import ConfigError, CorruptBlockError
from agentkv.tiers.disk import HEADER_BYTES as HEADER_BYTES_DISK
from agentkv.tiers.keys import BlockKey, ModelFingerprint
from agentkv.tiers.remote import RemoteBlocks, RemoteConfig
from agentkv.tiers.remote_auth import HEADER_BYTES
from agentkv.tiers.remote_codec import remote_key
from agentkv.tiers.results import BlockStatus
from agentkv.tiers.store import TieredStore
from agentkv.tiers.valkey_server import ValkeyProcess
from tests.unit.key_helpers import make_keys
from tests.valkey_fixture import unique_prefix, valkey_server, valkey_url  # noqa: F401

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
def remote(valkey_url: str) -> Iterator[Any]:  # noqa: F811
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
def raw(valkey_url: str) -> Iterator[Any]:  # noqa: F811
    client = valkey.Valkey.from_url(valkey_url)
    yield client
    client.close()


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


# ------------------------------------------------------------------------------ TieredStore


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


def test_store_round_trip_through_remote_bit_identical(store: Any) -> None:
    s = store()
    ks = keys(3)
    results = s.submit_store(ks, [content(k) for k in ks], tier="remote").result(10)
    assert all(r.ok and r.tier == "remote" for r in results)
    assert s.lookup_prefix(ks) == 0 and s.tier_of(ks[0]) is None  # no local copy, no index
    assert s.lookup_remote_prefix(ks) == 3
    out = zeros(3)
    results = s.submit_load(ks, out).result(10)
    assert all(r.ok and r.tier == "remote" for r in results), results
    assert all(np.array_equal(o, content(k)) for o, k in zip(out, ks, strict=True))
    counters = s.stats().counters
    assert counters["hits_remote"] == 3 and counters["stores_remote"] == 3
    assert counters["misses"] == 0 and s.stats().remote is not None


def test_store_round_trip_of_cpu_torch_tensors_through_remote(store: Any) -> None:
    torch = pytest.importorskip("torch")
    s = store()
    k1, k2 = keys(2, salt="torch")
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**15), 2**15, (BLOCK // 2,), dtype=torch.int16, generator=generator)
    block = bits.view(torch.bfloat16).reshape(4, 16, -1)  # NaN and subnormal patterns included
    layers = [t.clone() for t in block.reshape(2, 2, -1).unbind(0)]  # one segment per "layer"
    results = s.submit_store([k1, k2], [block, layers], tier="remote").result(10)
    assert all(r.ok for r in results)
    out_block = torch.zeros_like(block)
    out_layers = [torch.zeros_like(t) for t in layers]
    results = s.submit_load([k1, k2], [out_block, out_layers]).result(10)
    assert all(r.ok and r.tier == "remote" for r in results)
    assert torch.equal(out_block.view(torch.int16), block.view(torch.int16))
    for got, want in zip(out_layers, layers, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_load_falls_back_host_then_disk_then_remote(store: Any, raw: Any) -> None:
    s = store()
    in_host, on_disk, remote_only, nowhere, both, corrupt_disk = keys(6)
    assert all(
        r.ok for r in s.submit_store([in_host, both], [content(in_host), content(both)]).result(10)
    )
    assert (
        s.submit_store(
            [on_disk, corrupt_disk], [content(on_disk), content(corrupt_disk)], tier="disk"
        )
        .result(10)[0]
        .ok
    )
    up = [remote_only, both, corrupt_disk]
    assert all(r.ok for r in s.submit_store(up, [content(k) for k in up], tier="remote").result(10))
    path = s._files.path_for(corrupt_disk)
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES_DISK + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    order = [in_host, on_disk, remote_only, nowhere, both, corrupt_disk]
    out = zeros(len(order))
    results = s.submit_load(order, out).result(10)
    assert [(r.status, r.tier) for r in results] == [
        (BlockStatus.OK, "host"),
        (BlockStatus.OK, "disk"),
        (BlockStatus.OK, "remote"),
        (BlockStatus.MISS, "remote"),
        (BlockStatus.OK, "host"),
        (BlockStatus.OK, "remote"),  # the disk copy was corrupt (and is gone); remote served it
    ]
    for i, key in enumerate(order):
        if results[i].ok:
            assert np.array_equal(out[i], content(key))
    counters = s.stats().counters
    assert counters["hits_host"] == 2 and counters["hits_disk"] == 1
    assert counters["hits_remote"] == 2 and counters["misses"] == 1 and counters["corrupt"] == 1


def test_copy_to_remote_keeps_local_copies_and_drop_remote_deletes(store: Any) -> None:
    s = store()
    in_host, on_disk, absent = keys(3)
    s.submit_store([in_host], [content(in_host)]).result(10)
    s.submit_store([on_disk], [content(on_disk)], tier="disk").result(10)
    results = s.copy_to_remote([in_host, on_disk, absent]).result(10)
    assert [r.status for r in results] == [BlockStatus.OK, BlockStatus.OK, BlockStatus.ERROR]
    assert "no local tier" in str(results[2].error)
    assert s.tier_of(in_host) == "host" and s.tier_of(on_disk) == "disk"
    assert s.lookup_remote_prefix([in_host, on_disk, absent]) == 2
    # A second replica (its own store, same server and prefix) loads them from the remote tier.
    other = store(s.remote)
    out = zeros(2)
    results = other.submit_load([in_host, on_disk], out).result(10)
    assert all(r.ok and r.tier == "remote" for r in results)
    assert np.array_equal(out[0], content(in_host)) and np.array_equal(out[1], content(on_disk))
    # Local drops never delete the shared copies; drop(tier="remote") does, for everyone.
    assert s.drop([in_host, on_disk]) == 2 and s.lookup_remote_prefix([in_host, on_disk]) == 2
    assert s.drop([in_host, on_disk], tier="remote") == 2
    assert other.lookup_remote_prefix([in_host]) == 0


def test_store_without_remote_is_unchanged_and_says_so(tmp_path: Path) -> None:
    with TieredStore(4 * BLOCK, tmp_path / "kv", 4 * FILE, BLOCK) as s:
        [k] = keys(1)
        with pytest.raises(ConfigError, match="no remote tier"):
            s.submit_store([k], [content(k)], tier="remote")
        with pytest.raises(ConfigError, match="no remote tier"):
            s.copy_to_remote([k])
        assert s.lookup_remote_prefix([k]) == 0 and s.drop([k], tier="remote") == 0
        assert s.submit_load([k], zeros(1)).result(10)[0].status is BlockStatus.MISS
        assert s.stats().remote is None and s.remote is None


def test_store_with_remote_down_gives_error_results(store: Any, remote: Any) -> None:
    with ValkeyProcess() as server:
        client = remote(server.url, backoff_s=0.0, connect_timeout_s=0.5)
        s = store(client)
        in_host, elsewhere = keys(2)
        s.submit_store([in_host], [content(in_host)]).result(10)
        server.kill()
        out = zeros(2)
        results = s.submit_load([in_host, elsewhere], out).result(10)
        assert results[0].ok and results[0].tier == "host"
        assert results[1].status is BlockStatus.ERROR and results[1].tier == "remote"
        assert not s.copy_to_remote([in_host]).result(10)[0].ok
        assert not s.submit_store([elsewhere], [content(elsewhere)], tier="remote").result(10)[0].ok
        assert s.lookup_remote_prefix([in_host]) == 0
        assert s.tier_of(in_host) == "host"  # the local copy is untouched


def test_store_remote_transfers_are_batched_by_max_batch_bytes(remote: Any, tmp_path: Path) -> None:
    client = remote(max_batch_bytes=2 * BLOCK)
    with TieredStore(4 * BLOCK, None, 0, BLOCK, workers=1, remote=client) as s:
        ks = keys(4)
        trips = client.stats().round_trips
        assert all(
            r.ok for r in s.submit_store(ks, [content(k) for k in ks], tier="remote").result(10)
        )
        assert client.stats().round_trips == trips + 4  # 2 batches x (PEXPIRE probe + SET)
        out = zeros(4)
        assert all(r.ok for r in s.submit_load(ks, out).result(10))
        assert client.stats().round_trips == trips + 6  # 2 batches x (GET + PEXPIRE)
        s.submit_store(ks, [content(k) for k in ks]).result(10)  # now in host too
        assert all(r.ok for r in s.copy_to_remote(ks).result(10))
        assert client.stats().round_trips == trips + 8  # present: the probes only
        assert client.stats().put_skipped == 4


@pytest.mark.parametrize("direct", [True, False])
def test_both_io_paths_round_trip_and_report_server_errors(
    remote: Any, raw: Any, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The direct path (SET from the caller's memory, the reply reader) and valkey-py's own
    pipeline give the same results; a server error for one key (a key of the wrong type) is
    that block's error, the others are fine."""
    monkeypatch.setattr(RemoteBlocks, "direct", direct)
    r = remote()
    ks = keys(5, salt=f"paths-{direct}")
    sizes = [1, 70_000, BLOCK, 3 * BLOCK, 5]  # values below and above one socket read
    assert all(r.put_many([k], [content(k, n)])[0].ok for k, n in zip(ks[:4], sizes, strict=False))
    raw.lpush(r.name_of(ks[4]), b"not a block")
    out = [np.zeros(n, np.uint8) for n in sizes]
    results = r.get_many(ks, out)
    assert [x.status for x in results] == [BlockStatus.OK] * 4 + [BlockStatus.ERROR]
    assert "WRONGTYPE" in str(results[4].error)
    for key, n, got in zip(ks[:4], sizes, out, strict=False):
        assert np.array_equal(got, content(key, n))
    assert r.get_many(ks[:1], out[:1])[0].ok  # the connection is still in a clean state
    # Segments small (joined before sending) and large (sent in place), interleaved, keep order.
    [mixed] = keys(1, salt=f"mixed-{direct}")
    whole = content(mixed, 100 + 70_000 + 10 + 65_536 + 3)
    cuts = np.cumsum([100, 70_000, 10, 65_536])
    assert r.put_many([mixed], [np.split(whole, cuts)], skip_present=False)[0].ok
    got = np.zeros(whole.size, np.uint8)
    assert r.get_many([mixed], [got])[0].ok and np.array_equal(got, whole)


# ------------------------------------------------------------------------------------- TLS


def _certificates(directory: Path) -> dict[str, str]:
    """A test CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    paths: dict[str, str] = {}

    def issue(name: str, issuer: Any, issuer_key: Any, *, ca: bool, san: bool) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer or subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            import ipaddress

            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        paths[f"{name}_cert"] = str(directory / f"{name}.crt")
        paths[f"{name}_key"] = str(directory / f"{name}.key")
        return cert, key

    ca_cert, ca_key = issue("ca", None, None, ca=True, san=False)
    issue("server", ca_cert.subject, ca_key, ca=False, san=True)
    issue("client", ca_cert.subject, ca_key, ca=False, san=False)
    return paths


class _TlsProxy:
    """TLS in front of the plain test server (the bundled valkey-server has no TLS built in):
    terminates TLS with the server certificate, optionally requires a client certificate, and
    relays bytes both ways. Real handshakes and verification on the client side."""

    def __init__(self, target_port: int, certs: dict[str, str], *, client_certs: bool) -> None:
        import socket
        import ssl
        import threading

        self._target = target_port
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(certs["server_cert"], certs["server_key"])
        if client_certs:
            self._context.verify_mode = ssl.CERT_REQUIRED
            self._context.load_verify_locations(certs["ca_cert"])
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[Any] = [self._listener]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        import socket
        import ssl
        import threading

        while True:
            try:
                raw_client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                client = self._context.wrap_socket(raw_client, server_side=True)
            except (ssl.SSLError, OSError):
                raw_client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self._target))
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._relay, args=(source, sink), daemon=True).start()

    @staticmethod
    def _relay(source: Any, sink: Any) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.close()

    def close(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    pytest.importorskip("cryptography")
    return _certificates(tmp_path_factory.mktemp("tls"))


@pytest.mark.parametrize("direct", [True, False])
def test_tls_with_ca_verification(
    remote: Any,
    valkey_server: ValkeyProcess,  # noqa: F811
    certs: dict[str, str],
    direct: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(RemoteBlocks, "direct", direct)
    proxy = _TlsProxy(valkey_server.port, certs, client_certs=False)  # type: ignore[arg-type]
    try:
        url = f"valkeys://127.0.0.1:{proxy.port}/0"
        r = remote(url, tls_ca=certs["ca_cert"])
        ks = keys(3, salt=f"tls-{direct}")
        assert all(x.ok for x in r.put_many(ks, [content(k) for k in ks]))
        out = zeros(3)
        assert all(x.ok for x in r.get_many(ks, out))
        assert all(np.array_equal(o, content(k)) for o, k in zip(out, ks, strict=True))
        # Without the CA the server certificate does not verify: error results, no exception.
        untrusted = remote(url, backoff_s=0.0)
        assert not untrusted.ping()
        result = untrusted.get_many(ks[:1], zeros(1))[0]
        assert result.status is BlockStatus.ERROR and "certificate" in str(result.error).lower()
        # The plain scheme against the TLS port fails cleanly too.
        plain = remote(f"valkey://127.0.0.1:{proxy.port}/0", backoff_s=0.0, op_timeout_s=1.0)
        assert plain.get_many(ks[:1], zeros(1))[0].status is BlockStatus.ERROR
    finally:
        proxy.close()


def test_tls_client_certificate(
    remote: Any,
    valkey_server: ValkeyProcess,  # noqa: F811
    certs: dict[str, str],
) -> None:
    proxy = _TlsProxy(valkey_server.port, certs, client_certs=True)  # type: ignore[arg-type]
    try:
        url = f"valkeys://127.0.0.1:{proxy.port}/0?tls_ca={certs['ca_cert']}"
        anonymous = remote(url, backoff_s=0.0, op_timeout_s=1.0)
        assert not anonymous.ping()
        with_cert = remote(url, tls_cert=certs["client_cert"], tls_key=certs["client_key"])
        assert with_cert.ping()
        [k] = keys(1, salt="mtls")
        assert with_cert.put_many([k], [content(k)])[0].ok
        assert with_cert.get_many([k], zeros(1))[0].ok
    finally:
        proxy.close()


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
