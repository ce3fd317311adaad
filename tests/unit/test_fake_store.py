"""The store contract the simulated engine relies on, on the shared fake (tests/unit/fake_store.py)
and on the real TieredStore as the plugin opens it (it never evicts): one random sequence of
operations runs on both and every result, tier and byte must agree, so the fake cannot drift."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, given, settings

from agentkv.tiers.disk import HEADER_BYTES
from agentkv.tiers.keys import KEY_BYTES, BlockKey
from agentkv.tiers.results import BlockStatus
from agentkv.tiers.store import TieredStore
from tests.unit.fake_store import FakeTierStore
from tests.valkey_fixture import unique_prefix, valkey_server, valkey_url  # noqa: F401

DEEP = os.environ.get("AGENTKV_HYPOTHESIS_PROFILE") == "deep"  # `make test-deep`
DEEP_EXAMPLES = 2000
BLOCK = 4096
FILE = HEADER_BYTES + BLOCK
FP = b"\x01" * KEY_BYTES
KEYS = [hashlib.blake2b(bytes([i]), digest_size=KEY_BYTES).digest() for i in range(5)]
CONTENTS = [b"A", b"B", b"C"]


def payload(content: bytes) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(content, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def content_of(buffer: np.ndarray) -> bytes | None:
    for c in CONTENTS:
        if np.array_equal(buffer, payload(c)):
            return c
    return None


class Real:
    """The real store behind the fake's interface (content ids <-> payload bytes)."""

    def __init__(self, directory: Path, host: int, disk: int) -> None:
        self.s = TieredStore(host * BLOCK, directory, disk * FILE, BLOCK, workers=1)

    def key(self, k: bytes) -> BlockKey:
        return BlockKey(k, FP)

    def store(self, keys: list[bytes], contents: list[bytes], tier: str) -> list[tuple]:  # type: ignore[type-arg]
        bufs = [payload(c) for c in contents]
        res = self.s.submit_store([self.key(k) for k in keys], bufs, tier=tier).result(10)  # type: ignore[arg-type]
        return [(r.status, r.tier if r.ok else None) for r in res]

    def load(self, keys: list[bytes]) -> list[tuple]:  # type: ignore[type-arg]
        out = [np.zeros(BLOCK, np.uint8) for _ in keys]
        res = self.s.submit_load([self.key(k) for k in keys], out).result(10)
        return [
            (r.status, r.tier if r.ok else None, content_of(b) if r.ok else None)
            for r, b in zip(res, out, strict=True)
        ]

    def move(self, op: str, keys: list[bytes]) -> list[BlockStatus]:
        fn = self.s.promote if op == "promote" else self.s.copy_to_disk
        return [r.status for r in fn([self.key(k) for k in keys]).result(10)]

    def damage(self, k: bytes) -> None:
        assert self.s._files is not None
        path = self.s._files.path_for(self.key(k))
        if path.exists():
            os.truncate(path, HEADER_BYTES + 10)  # idempotent, unlike a flipped bit


key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True)
ops = st.one_of(
    st.tuples(
        st.just("store"),
        key_lists,
        st.sampled_from(CONTENTS),
        st.sampled_from(["host", "disk"]),
    ),
    st.tuples(st.just("load"), key_lists),
    st.tuples(st.sampled_from(["promote", "copy_to_disk"]), key_lists),
    st.tuples(st.just("drop"), key_lists, st.sampled_from([None, "host", "disk"])),
    st.tuples(st.just("damage"), st.sampled_from(KEYS)),
)


@settings(
    max_examples=DEEP_EXAMPLES if DEEP else 100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    host=st.integers(1, 3),
    disk=st.integers(1, 3),
    program=st.lists(ops, min_size=1, max_size=25),
)
def test_fake_and_real_store_agree_on_every_operation(
    host: int,
    disk: int,
    program: list[tuple],  # type: ignore[type-arg]
) -> None:
    fake = FakeTierStore(host, disk)
    with tempfile.TemporaryDirectory() as tmp:
        real = Real(Path(tmp), host, disk)
        try:
            for step, op in enumerate(program):
                where = f"step {step} {op[0]}"
                if op[0] == "store":
                    _, keys, content, tier = op
                    contents = [content] * len(keys)
                    got = real.store(keys, contents, tier)
                    want = [
                        (r.status, r.tier if r.ok else None)
                        for r in fake.store(keys, contents, tier)
                    ]
                    assert got == want, where
                elif op[0] == "load":
                    assert real.load(op[1]) == [
                        (r.status, r.tier if r.ok else None, r.content) for r in fake.load(op[1])
                    ], where
                elif op[0] in ("promote", "copy_to_disk"):
                    got_s = real.move(op[0], op[1])
                    fn = fake.promote if op[0] == "promote" else fake.copy_to_disk
                    assert got_s == [r.status for r in fn(op[1])], where
                elif op[0] == "drop":
                    assert real.s.drop([real.key(k) for k in op[1]], op[2]) == fake.drop(
                        op[1], op[2]
                    ), where
                else:
                    real.damage(op[1])
                    fake.damage(op[1])
                for k in KEYS:
                    assert real.s.tier_of(real.key(k)) == fake.tier_of(k), (where, k.hex()[:6])
            # every surviving copy holds what the fake says (host first, then disk)
            assert real.load(KEYS) == [
                (r.status, r.tier if r.ok else None, r.content) for r in fake.load(KEYS)
            ]
        finally:
            real.s.close()


def test_a_store_never_overwrites_an_existing_copy() -> None:
    """The class of stale-copy bugs: a second store of a key keeps the first copy, reports OK."""
    fake = FakeTierStore(2, 2)
    k = KEYS[0]
    assert [r.ok for r in fake.store([k], [b"A"], "host")] == [True]
    assert [r.ok for r in fake.store([k], [b"B"], "host")] == [True]
    assert fake.load([k])[0].content == b"A"
    with tempfile.TemporaryDirectory() as tmp:
        real = Real(Path(tmp), 2, 2)
        try:
            real.store([k], [b"A"], "host")
            assert real.store([k], [b"B"], "host") == [(BlockStatus.OK, "host")]
            assert real.load([k]) == [(BlockStatus.OK, "host", b"A")]
        finally:
            real.s.close()


def test_a_damaged_disk_copy_is_an_error_once_then_a_miss() -> None:
    fake = FakeTierStore(1, 1)
    k = KEYS[0]
    fake.store([k], [b"A"], "disk")
    assert fake.damage(k)
    (r,) = fake.load([k])
    assert r.status is BlockStatus.ERROR and r.corrupt
    assert fake.load([k])[0].status is BlockStatus.MISS and fake.tier_of(k) is None


def test_a_full_tier_fails_the_block_and_evicts_nothing() -> None:
    fake = FakeTierStore(1, 0)
    fake.store([KEYS[0]], [b"A"], "host")
    (r,) = fake.store([KEYS[1]], [b"B"], "host")
    assert r.status is BlockStatus.ERROR and r.full
    assert fake.tier_of(KEYS[0]) == "host" and fake.tier_of(KEYS[1]) is None


# ----------------------------------------------------------------- the real store's own contract


def test_the_real_stores_counters_count_each_block_once() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        real = Real(Path(tmp), 2, 2)
        try:
            real.store(KEYS[:2], [b"A", b"B"], "host")
            real.store(KEYS[2:3], [b"C"], "disk")
            real.store(KEYS[:1], [b"A"], "host")  # present: counted as a store, not copied
            real.load(KEYS[:4])  # two host hits, one disk hit, one miss
            c = real.s.stats().counters
            assert (c["stores"], c["loads"]) == (4, 4)
            assert (c["hits_host"], c["hits_disk"], c["misses"]) == (2, 1, 1)
            assert c["errors"] == c["corrupt"] == 0
            real.damage(KEYS[2])
            real.load(KEYS[2:3])
            c = real.s.stats().counters
            assert (c["corrupt"], c["errors"], c["hits_disk"]) == (1, 0, 1)
        finally:
            real.s.close()


def test_every_disk_hit_counts() -> None:
    """Two disk blocks loaded twice: four disk hits (a counter that only flags is wrong)."""
    with tempfile.TemporaryDirectory() as tmp:
        real = Real(Path(tmp), 2, 4)
        try:
            real.store(KEYS[:2], [b"A", b"B"], "disk")
            real.load(KEYS[:2])
            real.load(KEYS[:2])
            assert real.s.stats().counters["hits_disk"] == 4
        finally:
            real.s.close()


def test_a_disk_file_removed_behind_the_stores_back_is_a_miss_not_an_error() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        real = Real(Path(tmp), 1, 2)
        try:
            real.store(KEYS[:1], [b"A"], "disk")
            assert real.s._files is not None
            real.s._files.path_for(real.key(KEYS[0])).unlink()
            assert real.load(KEYS[:1]) == [(BlockStatus.MISS, None, None)]
            assert real.s.tier_of(real.key(KEYS[0])) is None
            assert real.s.stats().counters["errors"] == 0
            assert real.s.stats().disk.used_bytes == 0  # type: ignore[union-attr]
        finally:
            real.s.close()


def test_a_bug_inside_a_transfer_is_that_blocks_error_and_the_handle_completes() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        real = Real(Path(tmp), 2, 2)
        try:

            def broken(*args: object, **kw: object) -> None:
                raise RuntimeError("a bug")

            real.s._store_one = broken  # type: ignore[method-assign,assignment]
            keys = [real.key(k) for k in KEYS[:2]]
            results = real.s.submit_store(keys, [payload(b"A"), payload(b"B")]).result(10)
            assert [r.key for r in results] == keys
            assert all(r.status is BlockStatus.ERROR and "a bug" in str(r.error) for r in results)
            assert real.s.stats().counters["errors"] == 2
        finally:
            real.s.close()


def test_dropping_the_host_copy_of_a_block_also_on_disk_keeps_the_disk_copy() -> None:
    fake = FakeTierStore(2, 2)
    with tempfile.TemporaryDirectory() as tmp:
        real = Real(Path(tmp), 2, 2)
        try:
            for store in (fake, real):
                store.store(KEYS[:1], [b"A"], "host")
            assert real.move("copy_to_disk", KEYS[:1]) == [BlockStatus.OK]
            fake.copy_to_disk(KEYS[:1])
            assert real.s.drop([real.key(KEYS[0])], "host") == fake.drop(KEYS[:1], "host") == 1
            assert real.s.tier_of(real.key(KEYS[0])) == fake.tier_of(KEYS[0]) == "disk"
            assert real.load(KEYS[:1]) == [(BlockStatus.OK, "disk", b"A")]
            assert real.s.stats().host.blocks == 0
        finally:
            real.s.close()


def test_a_store_reads_its_sources_and_never_needs_them_writable() -> None:
    """The worker hands the store read-only views of the engine's blocks."""
    with tempfile.TemporaryDirectory() as tmp:
        real = Real(Path(tmp), 2, 2)
        try:
            src = payload(b"A")
            src.flags.writeable = False
            (r,) = real.s.submit_store([real.key(KEYS[0])], [src], tier="host").result(10)
            assert r.ok and real.load(KEYS[:1]) == [(BlockStatus.OK, "host", b"A")]
        finally:
            real.s.close()


def test_the_remote_tier_counts_its_stores(valkey_url: str) -> None:  # noqa: F811
    from agentkv.tiers.remote import RemoteBlocks, RemoteConfig

    client = RemoteBlocks(RemoteConfig.parse(valkey_url, key_prefix=unique_prefix(), ttl_s=60))
    with tempfile.TemporaryDirectory() as tmp:
        s = TieredStore(2 * BLOCK, Path(tmp), 2 * FILE, BLOCK, workers=1, remote=client)
        try:
            keys = [BlockKey(k, FP) for k in KEYS[:3]]
            results = s.submit_store(keys, [payload(c) for c in CONTENTS], tier="remote").result(10)
            assert all(r.ok for r in results)
            c = s.stats().counters
            assert (c["stores"], c["stores_remote"]) == (3, 3)
        finally:
            s.close()
            client.close()


def test_ok_prefix_counts_the_leading_blocks_that_loaded() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        real = Real(Path(tmp), 2, 2)
        try:
            real.store(KEYS[:1], [b"A"], "host")
            out = [np.zeros(BLOCK, np.uint8) for _ in range(2)]
            handle = real.s.submit_load([real.key(KEYS[0]), real.key(KEYS[1])], out)
            handle.wait(10)
            assert handle.ok_prefix() == 1
        finally:
            real.s.close()
