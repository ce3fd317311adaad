"""TieredStore: round trips through every tier, eviction and leases, restart, corruption,
owners, concurrency, capacity and disk-full behaviour."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agentkv.errors import CorruptBlockError, TierFullError
from agentkv.tiers import disk, store_local
from agentkv.tiers.disk import HEADER_BYTES
from agentkv.tiers.keys import BlockKey, ModelFingerprint
from agentkv.tiers.store import BlockStatus, Tier, TieredStore
from tests.unit.key_helpers import make_keys

BLOCK = 64 * 1024
FILE = HEADER_BYTES + BLOCK
FP = ModelFingerprint("tiny", "bfloat16", 16, 4)


def keys(n: int, salt: str = "s") -> list[BlockKey]:
    return make_keys(FP, salt, range(n))


def content(key: BlockKey) -> np.ndarray:
    """Bytes derived from the key, so a mixed-up block is detected."""
    return np.random.default_rng(int.from_bytes(key.digest[:8], "little")).integers(
        0, 256, BLOCK, dtype=np.uint8
    )


def load(s: TieredStore, ks: list[BlockKey]) -> tuple[list[BlockStatus], list[np.ndarray]]:
    out = [np.zeros(BLOCK, np.uint8) for _ in ks]
    results = s.submit_load(ks, out).result(timeout=10)
    return [r.status for r in results], out


def store_all(s: TieredStore, ks: list[BlockKey], **kw: object) -> list[BlockStatus]:
    return [r.status for r in s.submit_store(ks, [content(k) for k in ks], **kw).result(timeout=10)]  # type: ignore[arg-type]


def assert_exact(ks: list[BlockKey], out: list[np.ndarray]) -> None:
    for key, buffer in zip(ks, out, strict=True):
        assert np.array_equal(buffer, content(key))


@pytest.fixture
def make(tmp_path: Path) -> Iterator[object]:
    opened: list[TieredStore] = []

    def factory(host_blocks: int, disk_blocks: int | None, **kw: object) -> TieredStore:
        s = TieredStore(
            host_blocks * BLOCK,
            tmp_path / "kv" if disk_blocks is not None else None,
            (disk_blocks or 0) * FILE,
            BLOCK,
            **kw,  # type: ignore[arg-type]
        )
        opened.append(s)
        return s

    yield factory
    for s in opened:
        s.close()


OK = BlockStatus.OK


def moved(s: TieredStore) -> dict[str, int]:
    """The store's counters that moved (a test asserts all of them at once)."""
    return {k: v for k, v in sorted(s.stats().counters.items()) if v != 0}


def test_host_round_trip_bit_exact_with_segments(make) -> None:  # type: ignore[no-untyped-def]
    s = make(8, None)
    ks = keys(4)
    layers = [np.array_split(content(k), 4) for k in ks]  # one segment per layer
    assert all(r.ok and r.tier == "host" for r in s.submit_store(ks, layers).result(10))
    out = [[np.zeros(BLOCK // 4, np.uint8) for _ in range(4)] for _ in ks]
    assert all(r.ok for r in s.submit_load(ks, out).result(10))
    assert_exact(ks, [np.concatenate(parts) for parts in out])
    assert [s.tier_of(k) for k in ks] == ["host"] * 4
    assert s.lookup_prefix([*ks, keys(1, "other")[0], ks[0]]) == 4
    assert moved(s) == {"hits_host": 4, "loads": 4, "stores": 4}


def test_disk_round_trip_and_promote_demote(make) -> None:  # type: ignore[no-untyped-def]
    s = make(4, 8)
    ks = keys(3)
    assert store_all(s, ks, tier="disk") == [OK] * 3
    assert [s.tier_of(k) for k in ks] == ["disk"] * 3
    statuses, out = load(s, ks)
    assert statuses == [OK] * 3
    assert_exact(ks, out)
    assert all(r.ok for r in s.promote(ks).result(10))
    assert [s.tier_of(k) for k in ks] == ["host"] * 3
    assert s.stats().host.blocks == 3
    assert all(r.ok for r in s.demote(ks).result(10))
    assert [s.tier_of(k) for k in ks] == ["disk"] * 3
    assert s.stats().host.used_bytes == 0
    statuses, out = load(s, ks)
    assert statuses == [OK] * 3
    assert_exact(ks, out)
    assert moved(s) == {"hits_disk": 9, "loads": 6, "promotions": 3, "stores": 3}


def test_wrong_sizes_and_read_only_destinations_raise_at_submit(make) -> None:  # type: ignore[no-untyped-def]
    s = make(2, None)
    with pytest.raises(ValueError, match="expected"):
        s.submit_store(keys(1), [np.zeros(BLOCK - 1, np.uint8)])
    with pytest.raises(ValueError, match="writable"):
        s.submit_load(keys(1), [bytes(BLOCK)])
    with pytest.raises(ValueError, match="buffers"):
        s.submit_store(keys(2), [np.zeros(BLOCK, np.uint8)])
    assert moved(s) == {}


def test_a_full_tier_fails_the_block_and_never_evicts(make) -> None:  # type: ignore[no-untyped-def]
    """The store executes, the manager decides: a full tier is an error result for the new
    block; every block already stored stays, until the caller drops one."""
    s = make(2, 1, workers=1)
    a, b, c, d = keys(4)
    assert store_all(s, [a, b]) == [OK, OK]
    (result,) = s.submit_store([c], [content(c)]).result(10)
    assert result.status is BlockStatus.ERROR and isinstance(result.error, TierFullError)
    assert [s.tier_of(k) for k in (a, b, c)] == ["host", "host", None]
    assert store_all(s, [d], tier="disk") == [OK]
    (result,) = s.submit_store([c], [content(c)], tier="disk").result(10)
    assert isinstance(result.error, TierFullError) and s.stats().counters["disk_full"] == 1
    statuses, out = load(s, [a, b, d])
    assert statuses == [OK] * 3
    assert_exact([a, b, d], out)
    assert s.drop([a]) == 1  # the caller frees a slot: the next store lands
    assert store_all(s, [c]) == [OK] and s.tier_of(c) == "host"
    assert moved(s) == {
        "disk_full": 1,
        "errors": 2,
        "hits_disk": 1,
        "hits_host": 2,
        "loads": 3,
        "stores": 6,
    }


def test_restart_rebuilds_index_from_files(make, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    s = make(4, 8)
    ks = keys(5)
    assert store_all(s, ks, tier="disk") == [OK] * 5
    s.close()
    again = make(4, 8)
    assert again.lookup_prefix(ks) == 5
    assert again.stats().disk.used_bytes == 5 * FILE
    statuses, out = load(again, ks)
    assert statuses == [OK] * 5
    assert_exact(ks, out)
    again.close()
    smaller = make(4, 3)  # a smaller limit than last run: the oldest files go
    assert smaller.stats().disk.blocks == 3
    assert len(list((tmp_path / "kv").rglob("*.kvb"))) == 3
    assert moved(s) == {"stores": 5}


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_file_is_an_error_never_data_and_then_a_miss(make, damage: str) -> None:  # type: ignore[no-untyped-def]
    s = make(4, 4)
    (key,) = keys(1)
    store_all(s, [key], tier="disk")
    path = s._files.path_for(key)
    if damage == "flip":
        raw = bytearray(path.read_bytes())
        raw[HEADER_BYTES + 777] ^= 0x80
        path.write_bytes(raw)
    else:
        os.truncate(path, HEADER_BYTES + 10)
    out = np.zeros(BLOCK, np.uint8)
    (result,) = s.submit_load([key], [out]).result(10)
    assert result.status is BlockStatus.ERROR and isinstance(result.error, CorruptBlockError)
    assert not out.any()
    assert s.tier_of(key) is None and s.lookup_prefix([key]) == 0
    assert not path.exists() and s.stats().disk.used_bytes == 0
    assert load(s, [key])[0] == [BlockStatus.MISS]
    assert moved(s) == {"corrupt": 1, "loads": 2, "misses": 1, "stores": 1}


def test_drop_removes_from_every_tier(make, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    s = make(4, 4)
    ks = keys(2)
    store_all(s, ks, tier="disk")
    s.promote(ks).result(10)
    assert s.drop(ks) == 2
    assert s.lookup_prefix(ks) == 0 and list((tmp_path / "kv").rglob("*.kvb")) == []
    assert moved(s) == {"hits_disk": 2, "promotions": 2, "stores": 2}


def test_block_in_flight_is_pinned_and_handle_polls(make, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    s = make(1, None)
    a, b = keys(2)
    store_all(s, [a])
    release, started = threading.Event(), threading.Event()
    real = store_local.scatter_from

    def slow(source, segments):  # type: ignore[no-untyped-def]
        started.set()
        assert release.wait(10)
        real(source, segments)

    monkeypatch.setattr(store_local, "scatter_from", slow)
    out = np.zeros(BLOCK, np.uint8)
    handle = s.submit_load([a], [out])
    assert started.wait(10)
    assert not handle.done() and handle.ok_prefix() == 0
    (stored,) = s.submit_store([b], [content(b)]).result(10)
    assert stored.status is BlockStatus.ERROR and isinstance(stored.error, TierFullError)
    assert s.drop([a]) == 1  # dropped while pinned: the slot stays until the copy ends
    release.set()
    assert handle.wait(10) and handle.ok_prefix() == 1
    assert np.array_equal(out, content(a))
    assert store_all(s, [b]) == [OK]  # the slot came back after the last pin
    assert moved(s) == {"errors": 1, "hits_host": 1, "loads": 1, "stores": 3}


def test_concurrent_stores_and_loads_lose_or_mix_nothing(make) -> None:  # type: ignore[no-untyped-def]
    s = make(64, 64, workers=3)
    failures: list[str] = []

    def worker(thread: int) -> None:
        own = keys(6, salt=f"t{thread}")
        shared = keys(3, salt="shared")
        for round_ in range(4):
            batch = own + shared
            tier = "disk" if round_ % 2 else "host"
            results = s.submit_store(batch, [content(k) for k in batch], tier=tier).result(10)
            if not all(r.ok for r in results):
                failures.append(f"store {thread}/{round_}: {results}")
            out = [np.zeros(BLOCK, np.uint8) for _ in batch]
            for key, buffer, result in zip(
                batch, out, s.submit_load(batch, out).result(10), strict=True
            ):
                if result.ok and not np.array_equal(buffer, content(key)):
                    failures.append(f"mixed block {key.hex()} via {result.tier}")
                if not result.ok:
                    failures.append(f"lost block {key.hex()}: {result}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert failures == []
    stats = s.stats()
    assert stats.host.used_bytes <= stats.host.capacity_bytes
    assert stats.disk.used_bytes <= stats.disk.capacity_bytes
    assert stats.host.blocks == 4 * 6 + 3 and stats.disk.blocks == 4 * 6 + 3


def test_memory_and_disk_stay_within_capacity(make, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    s = make(3, 5)
    for i in range(6):
        store_all(s, keys(4, salt=str(i)))  # past capacity: those blocks fail, none evicted
        store_all(s, keys(4, salt=f"d{i}"), tier="disk")
    stats = s.stats()
    assert stats.host.blocks == 3 and stats.host.capacity_bytes == 3 * BLOCK
    assert s._arena._memory.nbytes <= 3 * BLOCK
    on_disk = sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*") if p.is_file())
    assert on_disk <= 5 * FILE and stats.disk.used_bytes == on_disk
    assert moved(s) == {"disk_full": 19, "errors": 40, "stores": 48}


def test_disk_full_store_fails_cleanly_and_caller_can_fall_back(
    make, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    s = make(1, 8, workers=1)
    a, b, c = keys(3)

    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "_pwrite", full)
    (result,) = s.submit_store([a], [content(a)], tier="disk").result(10)
    assert result.status is BlockStatus.ERROR and isinstance(result.error, TierFullError)
    assert s.tier_of(a) is None and load(s, [a])[0] == [BlockStatus.MISS]
    # The host tier is unaffected; it holds one block, and a second fails: nothing is evicted.
    assert store_all(s, [b]) == [OK]
    (full,) = s.submit_store([c], [content(c)]).result(10)
    assert isinstance(full.error, TierFullError)
    assert s.tier_of(b) == "host" and s.tier_of(c) is None
    assert [p for p in (tmp_path / "kv").rglob("*") if p.is_file()] == []
    assert s.stats().disk.used_bytes == 0 and s.stats().counters["disk_full"] == 1
    assert moved(s) == {"disk_full": 1, "errors": 2, "loads": 1, "misses": 1, "stores": 3}


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_real_enospc_on_tiny_tmpfs(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "mnt", "256k") as mount:
        ks = keys(8)
        with TieredStore(0, mount / "kv", 100 * FILE, BLOCK) as s:
            results = s.submit_store(ks, [content(k) for k in ks], tier="disk").result(10)
            assert any(r.ok for r in results)
            failed = [r for r in results if not r.ok]
            assert failed and all(isinstance(r.error, TierFullError) for r in failed)
            present = {p.name for p in (mount / "kv").rglob("*") if p.is_file()}
            assert present == {f"{r.key.hex()}.kvb" for r in results if r.ok}
            statuses, _ = load(s, [r.key for r in results if r.ok])
            assert set(statuses) == {OK}


def test_acquire_host_pins_views_until_release(make) -> None:  # type: ignore[no-untyped-def]
    s = make(2, None)
    ks = keys(2)
    assert store_all(s, ks) == [OK, OK]
    read = s.acquire_host([ks[0], keys(1, "absent")[0], ks[1]])
    assert read.missing == [1]
    v0, v1 = read.views[0], read.views[2]
    assert v0 is not None and v1 is not None
    assert np.array_equal(v0, content(ks[0])) and np.array_equal(v1, content(ks[1]))
    # Each view's arena address, for native batched copies (0 where the key was not in host).
    assert read.addresses == [v0.ctypes.data, 0, v1.ctypes.data]
    with pytest.raises(ValueError):
        v0[0] = 1  # read-only: a reader must never write a tier
    # Host is full and both blocks are pinned: a new store cannot evict them mid-read...
    newcomer = keys(1, "new")
    assert [r.status for r in s.submit_store(newcomer, [content(newcomer[0])]).result(10)] != [OK]
    # ...and a drop of a pinned block keeps its bytes valid until the read is released.
    s.drop([ks[0]])
    assert np.array_equal(v0, content(ks[0]))
    s.release_host(read)
    assert s.tier_of(ks[0]) is None and s.tier_of(ks[1]) == "host"
    assert store_all(s, newcomer) == [OK]  # the slots are reusable again
    assert moved(s) == {"errors": 1, "hits_host": 2, "loads": 3, "misses": 1, "stores": 4}


def test_copy_to_disk_results_name_the_disk_tier(make) -> None:  # type: ignore[no-untyped-def]
    """Mutant store_local._copy_down_one__mutmut_32 (the result's tier left None)."""
    s = make(2, 2)
    ks = keys(2)
    store_all(s, ks)
    results = s.copy_to_disk(ks).result(10)
    assert [(r.key, r.status, r.tier) for r in results] == [(k, OK, Tier.DISK) for k in ks]
    assert moved(s) == {"demotions": 2, "stores": 2}


def test_a_block_dropped_while_it_is_demoted_is_a_miss_of_its_key(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Mutant store_local._demote_one__mutmut_39 (the MISS result built without its key: an
    internal error instead). The drop lands while the block's file is being written."""
    s = make(2, 2)
    [key] = keys(1)
    store_all(s, [key])
    real = s._files.write

    def write_then_lose(k: BlockKey, segments: object) -> None:
        assert s.drop([k]) == 1  # the caller drops the block mid-demotion
        real(k, segments)

    monkeypatch.setattr(s._files, "write", write_then_lose)
    [result] = s.demote([key]).result(10)
    assert (result.key, result.status, result.error) == (key, BlockStatus.MISS, None)
    assert s.tier_of(key) is None and s.stats().disk.used_bytes == 0
    assert moved(s) == {"stores": 1}


# ---------------------------------------------------------------- mutation sample E (docs/testing.md)


def test_a_zero_block_size_is_refused(tmp_path: Path) -> None:
    """Zero is refused, as a negative size is. (Mutant store.TieredStore.__init____mutmut_2,
    ``block_bytes < 0``, is equivalent: the host arena built next refuses 0 with this error.)"""
    from agentkv.errors import ConfigError

    with pytest.raises(ConfigError, match="block_bytes must be positive"):
        TieredStore(BLOCK, None, 0, 0)


def test_every_host_miss_counts_once(make) -> None:  # type: ignore[no-untyped-def]
    """Mutant store.TieredStore.acquire_host__mutmut_17 (a miss counted twice)."""
    s = make(2, None)
    ks = keys(1)
    assert store_all(s, ks) == [OK]
    read = s.acquire_host([ks[0], *keys(2, "absent")])
    assert read.missing == [1, 2]
    s.release_host(read)
    assert s.stats().counters["loads"] == 3 and s.stats().counters["misses"] == 2
    assert moved(s) == {"hits_host": 1, "loads": 3, "misses": 2, "stores": 1}


def test_stats_say_whether_the_disk_tier_bypasses_the_page_cache(make) -> None:  # type: ignore[no-untyped-def]
    """Mutant store.TieredStore.stats__mutmut_33 (``direct_io`` always None)."""
    assert make(2, 2, direct_io=False).stats().direct_io is False
    assert make(2, None).stats().direct_io is None  # no disk tier


def test_pin_memory_false_reaches_the_disk_staging_buffers(
    make, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Mutant store.TieredStore.__init____mutmut_64 (the disk tier given ``pin_memory=None``:
    with CUDA present it would pin its staging buffers though the caller said never)."""
    asked: list[bool | None] = []
    real = disk.allocate_host

    def record(size: int, pin_memory: bool | None = None) -> object:
        asked.append(pin_memory)
        return real(size, pin_memory)

    monkeypatch.setattr(disk, "allocate_host", record)
    s = make(2, 2, pin_memory=False)
    assert store_all(s, keys(1), tier="disk") == [OK]
    assert asked and set(asked) == {False}
    assert moved(s) == {"stores": 1}


def test_reopening_a_disk_tier_logs_what_it_found(make, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """Mutant store_local.LocalTransfers._rebuild_disk_index__mutmut_31 (the log line given one
    argument for two placeholders: a logging error instead of the line)."""
    s = make(2, 4)
    assert store_all(s, keys(3), tier="disk") == [OK] * 3
    s.close()
    with caplog.at_level("INFO", logger="agentkv.tiers.store"):
        make(2, 4)
    found = [r.getMessage() for r in caplog.records if "disk tier:" in r.msg]
    assert found == [f"disk tier: 3 blocks found in {tmp_path / 'kv'}"]
    assert moved(s) == {"stores": 3}


def test_what_a_store_refuses_and_says_why(make, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from agentkv.errors import ConfigError, TierError

    with pytest.raises(ConfigError, match=r"^workers must be at least 1$"):
        TieredStore(BLOCK, None, 0, BLOCK, workers=0)
    with pytest.raises(ConfigError, match=rf"^disk capacity {FILE - 1} B is smaller than one"):
        TieredStore(BLOCK, tmp_path / "small", FILE - 1, BLOCK)
    host_only, disk_only = make(2, None), make(0, 2)
    for call in (host_only.demote, host_only.copy_to_disk):
        with pytest.raises(ConfigError, match=r"^this store has no disk tier$"):
            call(keys(1))
    with pytest.raises(ConfigError, match=r"^unknown tier 'tape'$"):
        host_only.submit_store(keys(1), [content(k) for k in keys(1)], tier="tape")
    with pytest.raises(ConfigError, match=r"^this store has neither host capacity nor a disk"):
        TieredStore(0, None, 0, BLOCK).submit_store(keys(1), [content(keys(1)[0])])
    assert store_all(disk_only, keys(1)) == [OK]  # no host slots: the block goes to disk
    assert disk_only.tier_of(keys(1)[0]) is Tier.DISK
    empty = host_only.submit_load([], [])
    assert empty.done() and empty.result(timeout=0) == []
    host_only.close()
    with pytest.raises(TierError, match=r"^the store is closed$"):
        host_only.submit_store(keys(1), [content(keys(1)[0])])


def test_moves_of_absent_blocks_miss_and_moves_already_done_are_ok(make) -> None:  # type: ignore[no-untyped-def]
    s = make(2, 4)
    absent, on_host, on_disk = keys(3, salt="moves")
    assert store_all(s, [on_host]) == [OK]
    assert store_all(s, [on_disk], tier="disk") == [OK]

    def moved_to(handle) -> list[tuple[BlockStatus, Tier | None]]:  # type: ignore[no-untyped-def]
        return [(r.status, r.tier) for r in handle.result(10)]

    miss = (BlockStatus.MISS, None)
    assert moved_to(s.promote([absent, on_host])) == [miss, (OK, Tier.HOST)]
    assert moved_to(s.demote([absent, on_disk])) == [miss, (OK, Tier.DISK)]
    assert moved_to(s.copy_to_disk([absent])) == [miss]
    assert moved(s) == {"misses": 3, "stores": 2}  # nothing moved: no promotion, no demotion
    assert s.tier_of(on_host) is Tier.HOST and s.tier_of(on_disk) is Tier.DISK
    assert moved_to(s.promote([on_disk])) == [(OK, Tier.HOST)]
    assert moved_to(s.demote([on_host])) == [(OK, Tier.DISK)]
    assert s.tier_of(on_host) is Tier.DISK and s.tier_of(on_disk) is Tier.HOST
    assert moved(s) == {
        "demotions": 1,
        "hits_disk": 1,  # the promote read it
        "misses": 3,
        "promotions": 1,
        "stores": 2,
    }


def test_a_transfer_is_timed_from_when_a_worker_takes_it_up_not_from_its_submit(make) -> None:  # type: ignore[no-untyped-def]
    """``started_at`` excludes the wait in the store's queue: with the only worker held, a
    submitted load has no start yet; it starts after the worker is free, and ends after that."""
    s = make(2, None, workers=1)
    ks = keys(1)
    assert store_all(s, ks) == [OK]
    held, release = threading.Event(), threading.Event()
    s._pool.submit(lambda: (held.set(), release.wait(10)))
    assert held.wait(10)
    handle = s.submit_load(ks, [np.zeros(BLOCK, np.uint8)])
    assert handle.started_at is None and not handle.done()  # queued, not transferring
    freed = time.monotonic()
    release.set()
    assert [r.status for r in handle.result(10)] == [OK]
    assert handle.started_at is not None and handle.finished_at is not None
    assert freed <= handle.started_at <= handle.finished_at
