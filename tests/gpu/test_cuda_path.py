"""The CUDA data path (marked ``gpu``; skipped without a CUDA device): bit-exact device -> host ->
device and device -> disk -> device round trips for vLLM's CUDA KV layouts, copies ordered after
the producer's stream, layer-by-layer loads with per-layer events, GPUDirect Storage when present.

Run with ``make test-gpu`` (``pytest -m gpu``) in a CUDA venv. ``AGENTKV_GPU_TEST_DEVICE=cpu``
dry-runs the same tests on CPU tensors sent down the device code path (a check of the tests
themselves, not of CUDA); CUDA-only assertions are skipped then.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from agentkv.tiers import buffers  # noqa: E402
from agentkv.tiers.disk import HEADER_BYTES  # noqa: E402
from agentkv.tiers.gds import gds_available  # noqa: E402
from agentkv.tiers.keys import ModelFingerprint  # noqa: E402
from agentkv.tiers.store import TieredStore  # noqa: E402
from agentkv_vllm.block_copy import BlockViews  # noqa: E402
from tests.unit.key_helpers import make_keys  # noqa: E402

DEVICE = os.environ.get("AGENTKV_GPU_TEST_DEVICE", "cuda")
CUDA = DEVICE == "cuda"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(CUDA and not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_BLOCKS = 10
HEADS, BLOCK, DIM = 4, 16, 64
FP = ModelFingerprint("gpu-test", "bfloat16", BLOCK, 3)


@pytest.fixture(autouse=True)
def _device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not CUDA:  # dry run: CPU tensors take the DeviceSegments path, as CUDA tensors do
        monkeypatch.setattr(buffers, "_on_host", lambda tensor: False)


def random_bf16(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    bits = torch.randint(
        -(2**15), 2**15, shape, dtype=torch.int16, device=DEVICE, generator=generator
    )
    return bits.view(torch.bfloat16)


LAYOUTS = ["flash_attn", "flash_attn_hnd", "flashinfer", "flashinfer_hnd", "mla"]


def layouts(seed: int) -> dict[str, tuple[torch.Tensor, int]]:
    """vLLM's CUDA KV layouts (tensor, block dimension), random bf16 bits."""
    hnd = random_bf16(2, NUM_BLOCKS, HEADS, BLOCK, DIM, seed=seed).permute(0, 1, 3, 2, 4)
    flashinfer_hnd = random_bf16(NUM_BLOCKS, 2, HEADS, BLOCK, DIM, seed=seed).permute(0, 1, 3, 2, 4)
    return {
        "flash_attn": (random_bf16(2, NUM_BLOCKS, BLOCK, HEADS, DIM, seed=seed), 1),
        "flash_attn_hnd": (hnd, 1),
        "flashinfer": (random_bf16(NUM_BLOCKS, 2, BLOCK, HEADS, DIM, seed=seed), 0),
        "flashinfer_hnd": (flashinfer_hnd, 0),
        "mla": (random_bf16(NUM_BLOCKS, BLOCK, 576, seed=seed), 0),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int16).cpu(), b.view(torch.int16).cpu()))


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[object]:
    opened: list[TieredStore] = []

    def make(block_bytes: int, **kw: object) -> TieredStore:
        file_bytes = HEADER_BYTES + -(-block_bytes // 4096) * 4096
        s = TieredStore(16 * block_bytes, tmp_path / "kv", 16 * file_bytes, block_bytes, **kw)  # type: ignore[arg-type]
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


def _round_trip(make_store, layout: str, tier: str, **store_kw: object) -> None:  # type: ignore[no-untyped-def]
    caches = {f"model.layers.{i}.attn": layouts(seed=i)[layout][0] for i in range(3)}
    block_dim = layouts(seed=0)[layout][1]
    expected = {name: t.clone() for name, t in caches.items()}
    views = BlockViews(caches, NUM_BLOCKS)
    assert views.device.type == DEVICE
    assert all(seg.device.type == DEVICE for seg in views.segments(0))
    s = make_store(views.block_bytes, **store_kw)
    if CUDA:
        assert s.stats().pinned_memory, "the host arena must be pinned on CUDA"
    keys = make_keys(FP, f"{layout}-{tier}", range(3))
    stored = s.submit_store(keys, [views.segments(b) for b in (1, 4, 9)], tier=tier).result(30)
    assert all(r.ok and r.tier == tier for r in stored), stored
    for t in caches.values():
        t.view(torch.int16).zero_()
    loaded = s.submit_load(keys, [views.segments(b) for b in (0, 5, 7)]).result(30)
    assert all(r.ok and r.tier == tier for r in loaded), loaded
    for name, t in caches.items():
        for dst, src in ((0, 1), (5, 4), (7, 9)):
            assert same_bits(t.select(block_dim, dst), expected[name].select(block_dim, src)), name
        for untouched in (1, 2, 3, 4, 6, 8, 9):
            assert not bool(t.select(block_dim, untouched).view(torch.int16).any()), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_host_device_round_trip_is_bit_exact(make_store, layout: str) -> None:  # type: ignore[no-untyped-def]
    _round_trip(make_store, layout, "host")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_disk_device_round_trip_staged_is_bit_exact(make_store, layout: str) -> None:  # type: ignore[no-untyped-def]
    _round_trip(make_store, layout, "disk", gds=False)


@pytest.mark.skipif(not (CUDA and gds_available()), reason="GPUDirect Storage not usable here")
@pytest.mark.parametrize("layout", ["flash_attn", "mla"])
def test_device_disk_device_round_trip_through_gds_is_bit_exact(make_store, layout: str) -> None:  # type: ignore[no-untyped-def]
    _round_trip(make_store, layout, "disk", gds=True)


@pytest.mark.skipif(not (CUDA and gds_available()), reason="GPUDirect Storage not usable here")
def test_gds_and_staged_files_are_interchangeable(make_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    kv = random_bf16(2, NUM_BLOCKS, BLOCK, HEADS, DIM, seed=5)
    views = BlockViews({"l0": kv}, NUM_BLOCKS)
    gds = TieredStore(0, tmp_path / "a", 8 << 20, views.block_bytes, gds=True)
    key = make_keys(FP, "x", range(1))
    assert gds.submit_store(key, [views.segments(2)], tier="disk").result(30)[0].ok
    gds.close()
    staged = TieredStore(0, tmp_path / "a", 8 << 20, views.block_bytes, gds=False)
    out = torch.zeros(views.block_bytes, dtype=torch.uint8)  # host memory: the staged path
    assert staged.submit_load(key, [out]).result(30)[0].ok
    assert torch.equal(out, torch.cat(views.segments(2)).cpu())
    staged.close()


def test_copies_wait_for_the_producers_stream(make_store) -> None:  # type: ignore[no-untyped-def]
    """A store submitted right after a kernel wrote the block reads the written bytes."""
    kv = torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM, dtype=torch.bfloat16, device=DEVICE)
    views = BlockViews({"l0": kv}, NUM_BLOCKS)
    s = make_store(views.block_bytes)
    keys = make_keys(FP, "order", range(4))
    side = 2048 if CUDA else 32
    work = torch.ones(side, side, device=DEVICE)
    for round_ in range(4):
        for _ in range(8):  # keep the producer stream busy
            work = (work @ work).clamp_(-1, 1)
        kv[:, round_].fill_(round_ + 1)  # queued behind the matmuls
        assert s.submit_store(keys[round_ : round_ + 1], [views.segments(round_)]).result(30)[0].ok
    out = torch.zeros_like(kv)
    out_views = BlockViews({"l0": out}, NUM_BLOCKS)
    assert all(
        r.ok for r in s.submit_load(keys, [out_views.segments(b) for b in range(4)]).result(30)
    )
    for round_ in range(4):
        assert bool((out[:, round_] == round_ + 1).all()), round_


def test_layerwise_loads_on_the_device_in_forward_order(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from agentkv.manager.jobs import BlockTransfer, LoadJob, StepPlan, StoreJob
    from agentkv_vllm.metadata import AgentKVStepMetadata
    from agentkv_vllm.settings import ConnectorSettings
    from agentkv_vllm.worker_side import WorkerSide

    names = [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10, 11)]
    caches = {
        name: random_bf16(2, NUM_BLOCKS, BLOCK, HEADS, DIM, seed=20 + i)
        for i, name in enumerate(names)
    }
    w = WorkerSide(
        settings=ConnectorSettings(host_capacity_gib=0.05, run_dir=str(tmp_path)),
        model_id="gpu-test",
        tp_rank=0,
        tp_size=1,
        num_blocks=NUM_BLOCKS,
    )
    w.register_kv_caches(caches)
    store_job = StoreJob(1, "host", [BlockTransfer(b"k1", 1), BlockTransfer(b"k2", 2)], "t")
    w.start_step(AgentKVStepMetadata(StepPlan(stores=[store_job])))
    for pending in w._jobs:
        pending.handle.result()
    w.poll()
    expected = {name: caches[name][:, 1:3].clone() for name in names}
    for t in caches.values():
        t.view(torch.int16).zero_()
    job = LoadJob(2, "req", [BlockTransfer(b"k1", 6), BlockTransfer(b"k2", 8)], layerwise=True)
    w.start_step(AgentKVStepMetadata(StepPlan(loads=[job])))
    step = w._layerwise
    assert step is not None
    for name in names:  # what vLLM's attention layers do, in forward order
        w.wait_for_layer(name)
        if CUDA:  # the layer's own CUDA event, waited on by the current stream
            assert step.events[name]._cuda_event is not None  # type: ignore[attr-defined]
        # Queued on the current stream after the wait: sees this layer's copies.
        assert same_bits(caches[name][:, 6], expected[name][:, 0]), name
        assert same_bits(caches[name][:, 8], expected[name][:, 1]), name
    w.finish_step()
    assert w.load_error_block_ids() == set()
    w.shutdown()


def test_layer_events_are_per_layer() -> None:
    from agentkv_vllm.device_copy import LayerCopier

    dest = torch.zeros(2, 1 << 20, dtype=torch.uint8, device=DEVICE)
    host = torch.arange(2 << 20, dtype=torch.int64).to(torch.uint8).numpy().reshape(2, -1)
    copier = LayerCopier(DEVICE, ["a", "b"])
    copier.copy(dest[0], host[0])
    copier.events["a"].set()
    assert copier.events["a"].wait(1) and not copier.events["b"].wait(0)
    assert bool((dest[0].cpu().numpy() == host[0]).all())  # ordered after layer a's copy
    copier.copy(dest[1], host[1])
    copier.events["b"].set()
    assert copier.events["b"].wait(1)
    copier.synchronize()
    assert bool((dest.cpu().numpy() == host).all())
