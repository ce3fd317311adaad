"""The store's batched CPU path (agentkv.tiers.store_batched) and the streaming native kernel:
a host store or load of many KV cache blocks is one native call per worker share, bit-exact for
shuffled ids; loads fall back per block for disk-only and missing keys; a full host tier fails
the rest without leaking slots; a cancelled load writes nothing; streaming stores are exact at
every alignment and size.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from agentkv.errors import TierFullError  # noqa: E402
from agentkv.tiers import native_copy  # noqa: E402
from agentkv.tiers.disk import HEADER_BYTES  # noqa: E402
from agentkv.tiers.keys import ModelFingerprint  # noqa: E402
from agentkv.tiers.results import BlockStatus, Tier  # noqa: E402
from agentkv.tiers.store import TieredStore  # noqa: E402
from agentkv_vllm.block_copy import BlockViews  # noqa: E402
from tests.unit.key_helpers import make_keys  # noqa: E402

NUM_BLOCKS, LAYERS, TOKENS, HEADS, DIM = 16, 4, 16, 2, 64
FP = ModelFingerprint("store-batched", "bfloat16", TOKENS, LAYERS)
SRC = [11, 2, 7, 14, 0, 5]
DST = [3, 9, 12, 1, 8, 15]


@pytest.fixture(autouse=True)
def native() -> None:
    native_copy.warm_up(background=False)
    if not native_copy.available():
        pytest.skip("numba is not installed: no native copies")


def _views(seed: int = 0) -> tuple[dict[str, torch.Tensor], BlockViews]:
    """FlashAttention layout ([2, blocks, tokens, heads, dim] per layer): 2 runs per layer."""
    generator = torch.Generator().manual_seed(seed)
    caches = {
        f"model.layers.{i}.attn": torch.randint(
            -(2**15),
            2**15,
            (2, NUM_BLOCKS, TOKENS, HEADS, DIM),
            dtype=torch.int16,
            generator=generator,
        ).view(torch.bfloat16)
        for i in range(LAYERS)
    }
    return caches, BlockViews(caches, NUM_BLOCKS)


def _block(caches: dict[str, torch.Tensor], b: int) -> list[torch.Tensor]:
    return [t[:, b].contiguous().view(torch.int16) for t in caches.values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[object]:
    opened: list[TieredStore] = []

    def make(block_bytes: int, host_blocks: int = 32, workers: int = 2) -> TieredStore:
        file_bytes = HEADER_BYTES + -(-block_bytes // 4096) * 4096
        store = TieredStore(
            host_blocks * block_bytes,
            tmp_path / f"kv{len(opened)}",
            32 * file_bytes,
            block_bytes,
            workers=workers,
        )
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def test_a_host_store_and_load_of_many_blocks_is_one_streaming_call_per_worker_share(
    stores, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    calls: list[tuple[int, bool]] = []
    real = native_copy.copy_runs

    def counting(hosts, blocks, table, runs, to_host, streaming=False):  # type: ignore[no-untyped-def]
        calls.append((len(blocks), streaming))
        real(hosts, blocks, table, runs, to_host, streaming)

    monkeypatch.setattr(native_copy, "copy_runs", counting)
    monkeypatch.setattr("agentkv.tiers.store.copy_threads", lambda: 2)  # any machine's cores
    caches, views = _views()
    before = {b: _block(caches, b) for b in range(NUM_BLOCKS)}
    store = stores(views.block_bytes, workers=2)
    keys = make_keys(FP, "share", range(len(SRC)))
    stored = store.submit_store(keys, [views.block(b) for b in SRC]).result(10)
    assert [r.tier for r in stored] == [Tier.HOST] * len(SRC) and all(r.ok for r in stored)
    assert sorted(calls) == [(3, True), (3, True)]  # 6 blocks, 2 workers: 2 calls, not 6
    calls.clear()
    loaded = store.submit_load(keys, [views.block(b) for b in DST]).result(10)
    assert all(r.ok and r.tier == Tier.HOST for r in loaded)
    assert sorted(calls) == [(3, True), (3, True)]
    for s, d in zip(SRC, DST, strict=True):
        assert _same(_block(caches, d), before[s]), (s, d)
    for b in set(range(NUM_BLOCKS)) - set(DST):
        assert _same(_block(caches, b), before[b]), b
    counters = store.stats().counters
    assert (counters["stores"], counters["loads"], counters["hits_host"]) == (6, 6, 6)
    calls.clear()  # present keys are not copied again (content addressed)
    again = store.submit_store(keys, [views.block(b) for b in SRC]).result(10)
    assert all(r.ok for r in again) and calls == []


def test_a_batched_load_falls_back_per_block_for_disk_and_missing_keys(stores) -> None:  # type: ignore[no-untyped-def]
    caches, views = _views(seed=1)
    before = {b: _block(caches, b) for b in range(NUM_BLOCKS)}
    store = stores(views.block_bytes)
    keys = make_keys(FP, "mixed", range(5))
    assert all(
        r.ok for r in store.submit_store(keys[:2], [views.block(b) for b in SRC[:2]]).result(10)
    )
    on_disk = store.submit_store(keys[2:4], [views.block(b) for b in SRC[2:4]], tier=Tier.DISK)
    assert all(r.ok for r in on_disk.result(10))
    results = store.submit_load(keys, [views.block(b) for b in DST[:5]]).result(10)
    assert [r.tier for r in results[:4]] == [Tier.HOST, Tier.HOST, Tier.DISK, Tier.DISK]
    assert [r.status for r in results] == [BlockStatus.OK] * 4 + [BlockStatus.MISS]
    for s, d in zip(SRC[:4], DST[:4], strict=True):
        assert _same(_block(caches, d), before[s]), (s, d)
    assert _same(_block(caches, DST[4]), before[DST[4]])  # the miss wrote nothing
    counters = store.stats().counters
    assert (counters["loads"], counters["hits_host"], counters["hits_disk"]) == (5, 2, 2)
    assert counters["misses"] == 1


def test_a_full_host_tier_fails_the_rest_of_a_batch_and_leaks_no_slot(stores) -> None:  # type: ignore[no-untyped-def]
    _, views = _views(seed=2)
    store = stores(views.block_bytes, host_blocks=3, workers=1)
    keys = make_keys(FP, "full", range(5))
    results = store.submit_store(keys, [views.block(b) for b in SRC[:5]]).result(10)
    assert [r.ok for r in results] == [True, True, True, False, False]
    assert all(isinstance(r.error, TierFullError) for r in results[3:])
    assert store.stats().counters["errors"] == 2
    assert store.drop(keys[:3]) == 3
    rest = store.submit_store(keys[3:], [views.block(b) for b in SRC[3:5]]).result(10)
    assert all(r.ok for r in rest)  # every slot came back
    assert store.stats().host.blocks == 2


def test_a_load_cancelled_before_its_share_starts_writes_nothing(stores) -> None:  # type: ignore[no-untyped-def]
    caches, views = _views(seed=3)
    store = stores(views.block_bytes, workers=1)
    keys = make_keys(FP, "cancel", range(3))
    assert all(r.ok for r in store.submit_store(keys, [views.block(b) for b in SRC[:3]]).result(10))
    before = {b: _block(caches, b) for b in DST[:3]}
    gate = threading.Event()
    store._pool.submit(gate.wait)  # the only worker is busy until the load is cancelled
    handle = store.submit_load(keys, [views.block(b) for b in DST[:3]])
    handle.cancel()
    gate.set()
    results = handle.result(10)
    assert [r.status for r in results] == [BlockStatus.ERROR] * 3
    assert all("cancelled" in str(r.error) for r in results)
    for b in DST[:3]:
        assert _same(_block(caches, b), before[b]), b


@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("size", [1, 63, 64, 4095, 4096, 4097, 16384 + 5, 65536, 53253])
def test_streaming_copies_are_exact_at_any_alignment_and_size(size: int, to_host: bool) -> None:
    """Pieces below STREAMING_MIN_BYTES take memcpy; above it an unaligned head, a streamed body
    (stretches of 4 pages copied side by side, then single cache lines) and a tail: every byte
    lands, none outside the piece."""
    rng = np.random.default_rng(size)
    for shift in (0, 1, 17, 63):
        cache = rng.integers(0, 256, 2 * size + 128, dtype=np.uint8)
        host = rng.integers(0, 256, size + 128, dtype=np.uint8)
        want_cache, want_host = cache.copy(), host.copy()
        block, start = 1, 64 + shift  # the piece: block 1 of a run of stride `size`
        if to_host:
            want_host[start : start + size] = cache[64 + size : 64 + 2 * size]
        else:
            want_cache[64 + size : 64 + 2 * size] = host[start : start + size]
        table = (
            np.array([cache.ctypes.data + 64], np.int64),
            np.array([size], np.int64),
            np.zeros(1, np.int64),
            np.array([size], np.int64),
        )
        hosts = np.array([host.ctypes.data + start], np.int64)
        native_copy.copy_runs(
            hosts, np.array([block], np.int64), table, np.zeros(1, np.int64), to_host, True
        )
        assert np.array_equal(cache, want_cache) and np.array_equal(host, want_host), shift


def test_shares_are_capped_at_the_cores_a_copy_can_use(
    stores, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Four pool workers on a one-core budget: one share, one native call for all six blocks."""
    calls: list[int] = []
    real = native_copy.copy_runs

    def counting(hosts, blocks, *rest):  # type: ignore[no-untyped-def]
        calls.append(len(blocks))
        real(hosts, blocks, *rest)

    monkeypatch.setattr(native_copy, "copy_runs", counting)
    monkeypatch.setattr("agentkv.tiers.store.copy_threads", lambda: 1)
    _, views = _views(seed=4)
    store = stores(views.block_bytes, workers=4)
    keys = make_keys(FP, "cores", range(len(SRC)))
    assert all(r.ok for r in store.submit_store(keys, [views.block(b) for b in SRC]).result(10))
    assert calls == [len(SRC)]


def test_a_handle_records_when_its_last_block_completed() -> None:
    """The worker reports a transfer's time up to its last block, not up to the engine step
    that polled it (agentkv_vllm.worker_side._Pending.seconds)."""
    from agentkv.tiers.results import BlockResult
    from agentkv.tiers.transfer import TransferHandle

    keys = make_keys(FP, "clock", range(2))
    handle = TransferHandle(keys)
    assert handle.finished_at is None
    handle._set(0, BlockResult(keys[0], BlockStatus.OK, Tier.HOST))
    assert handle.finished_at is None
    handle._set_many({1: BlockResult(keys[1], BlockStatus.OK, Tier.HOST)})
    first = handle.finished_at
    assert first is not None and handle.done()
    handle._set(1, BlockResult(keys[1], BlockStatus.OK, Tier.HOST))  # a late duplicate
    assert handle.finished_at == first
    assert TransferHandle([]).finished_at is not None
