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
from agentkv.tiers.batched import BlockRef, StagedBlocks, staging_budget  # noqa: E402
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
        monkeypatch.setattr(BlockRef, "on_host", property(lambda self: False))


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
    assert all(run.rows.device.type == DEVICE for run in views.table.runs)
    s = make_store(views.block_bytes, **store_kw)
    if CUDA:
        assert s.stats().pinned_memory, "the host arena must be pinned on CUDA"
    keys = make_keys(FP, f"{layout}-{tier}", range(3))
    stored = s.submit_store(keys, [views.block(b) for b in (1, 4, 9)], tier=tier).result(30)
    assert all(r.ok and r.tier == tier for r in stored), stored
    for t in caches.values():
        t.view(torch.int16).zero_()
    loaded = s.submit_load(keys, [views.block(b) for b in (0, 5, 7)]).result(30)
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
    assert gds.submit_store(key, [views.block(2)], tier="disk").result(30)[0].ok
    gds.close()
    staged = TieredStore(0, tmp_path / "a", 8 << 20, views.block_bytes, gds=False)
    out = torch.zeros(views.block_bytes, dtype=torch.uint8)  # host memory: the staged path
    assert staged.submit_load(key, [out]).result(30)[0].ok
    image = torch.empty((1, views.block_bytes), dtype=torch.uint8, device=DEVICE)
    views.table.gather([2], image)
    assert torch.equal(out, image[0].cpu())
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
        assert s.submit_store(keys[round_ : round_ + 1], [views.block(round_)]).result(30)[0].ok
    out = torch.zeros_like(kv)
    out_views = BlockViews({"l0": out}, NUM_BLOCKS)
    assert all(r.ok for r in s.submit_load(keys, [out_views.block(b) for b in range(4)]).result(30))
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

    caches = {n: torch.zeros(NUM_BLOCKS, 1 << 20, dtype=torch.uint8, device=DEVICE) for n in "ab"}
    views = BlockViews(caches, NUM_BLOCKS)
    host = torch.arange(2 << 21, dtype=torch.int64).to(torch.uint8).numpy().reshape(2, -1)
    if CUDA:
        host = torch.from_numpy(host).pin_memory().numpy()
    copier = LayerCopier(DEVICE, ["a", "b"])
    copier.copy_runs(views.table, [7, 3], list(host), [0])
    copier.events["a"].set()
    assert copier.events["a"].wait(1) and not copier.events["b"].wait(0)
    # ordered after layer a's copy (the wait made this stream wait for its event)
    assert bool((caches["a"][7].cpu().numpy() == host[0][: 1 << 20]).all())
    assert bool((caches["a"][3].cpu().numpy() == host[1][: 1 << 20]).all())
    copier.copy_runs(views.table, [7, 3], list(host), [1])
    copier.events["b"].set()
    assert copier.events["b"].wait(1)
    copier.synchronize()
    assert bool((caches["b"][7].cpu().numpy() == host[0][1 << 20 :]).all())
    assert bool((caches["b"][3].cpu().numpy() == host[1][1 << 20 :]).all())


needs_cuda = pytest.mark.skipif(not CUDA, reason="device staging uses CUDA streams")


@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_staged_gather_store_and_staged_load_scatter_are_bit_exact(make_store, layout: str) -> None:  # type: ignore[no-untyped-def]
    """The worker's CUDA path: one index_select per run into device staging, one DMA per block
    into the pinned arena, back into staging rows, one index_copy_ per run; shuffled ids."""
    caches = {f"model.layers.{i}.attn": layouts(seed=i)[layout][0] for i in range(3)}
    block_dim = layouts(seed=0)[layout][1]
    expected = {name: t.clone() for name, t in caches.items()}
    views = BlockViews(caches, NUM_BLOCKS)
    table = views.table
    assert staging_budget(table, 3) == 3
    s = make_store(views.block_bytes)
    keys = make_keys(FP, f"staged-{layout}", range(3))
    staged = StagedBlocks.gather(table, [9, 1, 4])
    assert all(row.ready is not None for row in staged.rows)
    assert all(r.ok for r in s.submit_store(keys, staged.rows).result(30))
    for t in caches.values():
        t.view(torch.int16).zero_()
    load = StagedBlocks.for_load(table, [5, 0, 7])
    assert all(r.ok for r in s.submit_load(keys, load.rows).result(30))
    load.scatter([True, False, True])  # the middle block "failed": block 0 stays zero
    torch.cuda.synchronize()
    for name, t in caches.items():
        assert same_bits(t.select(block_dim, 5), expected[name].select(block_dim, 9)), name
        assert same_bits(t.select(block_dim, 7), expected[name].select(block_dim, 4)), name
        for untouched in (0, 1, 2, 3, 4, 6, 8, 9):
            assert not bool(t.select(block_dim, untouched).view(torch.int16).any()), name


@needs_cuda
def test_staged_gather_waits_for_the_producers_stream(make_store) -> None:  # type: ignore[no-untyped-def]
    kv = torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, DIM, dtype=torch.bfloat16, device=DEVICE)
    views = BlockViews({"l0": kv}, NUM_BLOCKS)
    s = make_store(views.block_bytes)
    keys = make_keys(FP, "staged-order", range(4))
    work = torch.ones(2048, 2048, device=DEVICE)
    for _ in range(16):  # keep the producer stream busy
        work = (work @ work).clamp_(-1, 1)
    for b in range(4):
        kv[:, b].fill_(b + 1)  # queued behind the matmuls
    staged = StagedBlocks.gather(views.table, [0, 1, 2, 3])
    assert all(r.ok for r in s.submit_store(keys, staged.rows).result(30))
    out = torch.zeros_like(kv)
    out_views = BlockViews({"l0": out}, NUM_BLOCKS)
    load = StagedBlocks.for_load(out_views.table, [3, 2, 1, 0])
    assert all(r.ok for r in s.submit_load(keys, load.rows).result(30))
    load.scatter([True] * 4)
    for b in range(4):  # ordered on the current stream after the scatter
        assert bool((out[:, 3 - b] == b + 1).all()), b


@needs_cuda
def test_worker_stores_and_loads_through_device_staging(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from agentkv.manager.jobs import BlockTransfer, LoadJob, StepPlan, StoreJob
    from agentkv_vllm.metadata import AgentKVStepMetadata
    from agentkv_vllm.settings import ConnectorSettings
    from agentkv_vllm.worker_side import WorkerSide

    caches = {f"model.layers.{i}.attn": layouts(seed=30 + i)["flash_attn"][0] for i in range(3)}
    expected = {name: t.clone() for name, t in caches.items()}
    w = WorkerSide(
        settings=ConnectorSettings(host_capacity_gib=0.05, run_dir=str(tmp_path)),
        model_id="gpu-test",
        tp_rank=0,
        tp_size=1,
        num_blocks=NUM_BLOCKS,
    )
    w.register_kv_caches(caches)
    jobs = [
        StoreJob(1, "host", [BlockTransfer(b"a", 8), BlockTransfer(b"b", 2)], "t"),
        StoreJob(2, "host", [BlockTransfer(b"c", 5)], "t"),
    ]
    w.start_step(AgentKVStepMetadata(StepPlan(stores=jobs)))
    assert all(p.staged is not None for p in w._jobs)  # one gather for both jobs
    assert w._jobs[0].staged.staging.data_ptr() + 2 * w.views.block_bytes == (  # type: ignore[union-attr]
        w._jobs[1].staged.staging.data_ptr()  # type: ignore[union-attr]
    )
    for pending in w._jobs:
        pending.handle.result()
    w.poll()
    for t in caches.values():
        t.view(torch.int16).zero_()
    load = LoadJob(
        3, "req", [BlockTransfer(b"c", 0), BlockTransfer(b"a", 4), BlockTransfer(b"b", 9)]
    )
    w.start_step(AgentKVStepMetadata(StepPlan(loads=[load])))
    for pending in w._loads:
        pending.handle.result()
    assert w.poll() == {"req"}
    torch.cuda.synchronize()
    for name, t in caches.items():
        for dst, src in ((0, 5), (4, 8), (9, 2)):
            assert same_bits(t[:, dst], expected[name][:, src]), (name, dst)
    assert w.load_error_block_ids() == set()
    w.shutdown()


@needs_cuda
def test_bench_tiers_cuda_reports_pinned_copy_ratios(tmp_path: Path) -> None:
    from agentkv.tiers.bench import run_tier_bench

    report = run_tier_bench([1 << 20], 64 << 20, None, repeats=1, device="cuda", batches=(1, 64))
    seen = {(m.operation, m.batch): m for m in report.measurements}
    for op in ("device->host store", "host->device load"):
        for batch in (1, 64):
            m = seen[(op, batch)]
            assert m.baseline.startswith("pinned copy") and m.gbps > 0
    assert report.pinned_memory
