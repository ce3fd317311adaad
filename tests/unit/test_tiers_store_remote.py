"""The TieredStore's remote tier against a real valkey-server: round trips through remote, the
load fallback host -> disk -> remote, copy_to_remote and drop, a server down, batching by
max_batch_bytes, both I/O paths."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agentkv.errors import ConfigError
from agentkv.tiers.disk import HEADER_BYTES as HEADER_BYTES_DISK
from agentkv.tiers.remote import RemoteBlocks
from agentkv.tiers.results import BlockStatus
from agentkv.tiers.store import TieredStore
from agentkv.tiers.valkey_server import ValkeyProcess
from tests.unit import remote_fixtures
from tests.unit.remote_fixtures import BLOCK, FILE, content, keys, zeros
from tests.unit.test_tiers_store import moved
from tests.valkey_fixture import unique_prefix, valkey_server, valkey_url  # noqa: F401

remote = remote_fixtures.remote
raw = remote_fixtures.raw
store = remote_fixtures.store


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
    assert moved(s) == {"hits_remote": 3, "loads": 3, "stores": 3, "stores_remote": 3}


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
    assert moved(s) == {"hits_remote": 2, "loads": 2, "stores": 2, "stores_remote": 2}


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
    assert moved(s) == {
        "corrupt": 1,
        "hits_disk": 1,
        "hits_host": 2,
        "hits_remote": 2,
        "loads": 6,
        "misses": 1,
        "stores": 7,
        "stores_remote": 3,
    }


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
    assert moved(s) == {"errors": 1, "stores": 4, "stores_remote": 2}


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


def test_a_load_cancelled_before_its_remote_read_fails_each_block_under_its_key(
    remote: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutant store_remote._load_chunk__mutmut_38 (those results built without their keys).
    The cancel lands after the local tiers missed and before the batched remote read."""
    client = remote()
    ks = keys(3, salt="cancel-remote")
    assert all(x.ok for x in client.put_many(ks, [content(k) for k in ks]))
    with TieredStore(4 * BLOCK, None, 0, BLOCK, workers=1, remote=client) as s:
        handles: list[Any] = []
        real = s._remote_batch_blocks

        def cancel_first() -> int:
            handles[0].cancel()  # no transfer writes now: returns at once
            return real()

        gate = threading.Event()
        s._pool.submit(gate.wait)  # the only worker waits until the handle is known
        handles.append(s.submit_load(ks, zeros(3)))
        monkeypatch.setattr(s, "_remote_batch_blocks", cancel_first)
        gate.set()
        results = handles[0].result(10)
    assert [r.key for r in results] == ks
    assert all(r.status is BlockStatus.ERROR and "cancelled" in str(r.error) for r in results)
    assert client.stats().gets == 0  # no network read for a cancelled load


def test_every_remote_miss_counts(store: Any) -> None:
    """Mutant store_remote._count_remote__mutmut_11 (the misses counter set to 1)."""
    s = store()
    nowhere = keys(3)
    results = s.submit_load(nowhere, zeros(3)).result(10)
    assert [(r.status, r.tier) for r in results] == [(BlockStatus.MISS, "remote")] * 3
    assert moved(s) == {"loads": 3, "misses": 3}
