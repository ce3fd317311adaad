"""Layer-by-layer loads on the worker side: forward order, per-layer waits, misses -> recompute.

Real tensors (CPU KV layout) and a real TieredStore; only vLLM's forward pass is replaced by the
test calling ``wait_for_layer`` per layer, as vLLM's attention layers do.
"""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from agentkv.manager.jobs import (  # noqa: E402
    BlockTransfer,
    LoadJob,
    ReloadPhase,
    StepPlan,
    StoreJob,
)
from agentkv_vllm.block_copy import BlockViews  # noqa: E402
from agentkv_vllm.layerwise_loads import ReloadStamps  # noqa: E402
from agentkv_vllm.metadata import AgentKVStepMetadata  # noqa: E402
from agentkv_vllm.settings import ConnectorSettings  # noqa: E402
from agentkv_vllm.worker_side import WorkerSide  # noqa: E402

NUM_BLOCKS, HEADS, BLOCK, DIM = 8, 2, 16, 128
NAMES = [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10, 11)]


def _caches() -> dict[str, torch.Tensor]:
    return {
        name: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, DIM, dtype=torch.bfloat16) for name in NAMES
    }


def test_layer_slices_follow_forward_order_and_cover_the_block() -> None:
    views = BlockViews(_caches(), NUM_BLOCKS)
    slices = views.layer_slices()
    assert [name for name, _ in slices] == NAMES  # 2 before 10, unlike sorted()
    spans = sorted((off, size) for _, segs in slices for _, off, size in segs)
    assert spans[0][0] == 0 and sum(size for _, size in spans) == views.block_bytes
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans))


def _step(**plan: object) -> AgentKVStepMetadata:
    return AgentKVStepMetadata(StepPlan(**plan))  # type: ignore[arg-type]


def _drain(w: WorkerSide) -> set[str]:
    """Wait for every transfer the worker started (on its handle, no spinning), then poll."""
    for pending in [*w._jobs, *w._loads]:
        pending.handle.result()
    return w.poll()


def _worker() -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    caches = _caches()
    w = WorkerSide(
        settings=ConnectorSettings(host_capacity_gib=0.01, run_dir="/tmp"),
        model_id="sim",
        tp_rank=0,
        tp_size=1,
        num_blocks=NUM_BLOCKS,
    )
    w.register_kv_caches(caches)
    return w, caches


def test_layerwise_load_restores_blocks_exactly_and_reports_misses() -> None:
    w, caches = _worker()
    for i, name in enumerate(NAMES):  # distinct content in blocks 1 and 2 of every layer
        caches[name][1] = i + 1
        caches[name][2] = -(i + 1)
    w.start_step(
        _step(stores=[StoreJob(1, "host", [BlockTransfer(b"k1", 1), BlockTransfer(b"k2", 2)], "t")])
    )
    _drain(w)
    report = w.take_report()
    assert report is not None
    assert report.report.jobs_done == {1: 1} and not report.report.jobs_failed
    expected = {name: caches[name][1:3].clone() for name in NAMES}
    for name in NAMES:
        caches[name].zero_()

    # Reload k1, k2 into blocks 5, 6, plus a key the host never had into block 7.
    job = LoadJob(
        2,
        "req",
        [BlockTransfer(b"k1", 5), BlockTransfer(b"k2", 6), BlockTransfer(b"nope", 7)],
        layerwise=True,
    )
    w.start_step(_step(loads=[job]))
    for name in NAMES:  # what the attention layers do, in forward order
        w.wait_for_layer(name)
        assert torch.equal(caches[name][5:7], expected[name])
    w.finish_step()
    assert w.load_error_block_ids() == {7}  # vLLM recomputes that one
    taken = w.take_report()
    assert taken is not None
    assert taken.report.bad_keys == {b"nope": "miss"}
    assert taken.report.jobs_done == {2: 1} and taken.report.jobs_failed == {2}
    [(kind, tier, _)] = list(taken.report.transfers)
    assert (kind, tier) == ("reload", "host")
    assert w.poll() == set()  # a layerwise load is never reported as an async one
    # The host copies were unpinned: they can be loaded again.
    w.start_step(_step(loads=[LoadJob(3, "r2", [BlockTransfer(b"k1", 4)], True)]))
    w.finish_step()
    assert torch.equal(caches[NAMES[0]][4], expected[NAMES[0]][0])
    w.shutdown()


def test_layerwise_reads_disk_only_blocks_whole_before_the_first_layer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    caches = _caches()
    w = WorkerSide(
        settings=ConnectorSettings(
            host_capacity_gib=0.01, disk_dir=str(tmp_path), disk_capacity_gib=0.1, run_dir="/tmp"
        ),
        model_id="sim",
        tp_rank=0,
        tp_size=1,
        num_blocks=NUM_BLOCKS,
    )
    w.register_kv_caches(caches)
    for i, name in enumerate(NAMES):
        caches[name][3] = 7 * (i + 1)
    w.start_step(_step(stores=[StoreJob(1, "disk", [BlockTransfer(b"d", 3)], "t")]))
    _drain(w)
    expected = {name: caches[name][3].clone() for name in NAMES}
    for name in NAMES:
        caches[name].zero_()
    # The scheduler believed the block was in host (a prefetch was queued): it is still on disk.
    w.start_step(_step(loads=[LoadJob(2, "r", [BlockTransfer(b"d", 6)], True)]))
    for name in NAMES:
        w.wait_for_layer(name)
        assert torch.equal(caches[name][6], expected[name])
    w.finish_step()
    assert w.load_error_block_ids() == set()
    w.shutdown()


def test_async_load_past_its_deadline_is_fenced_and_fails() -> None:
    """A load that does not finish in job_timeout_s is cancelled (nothing more is written into
    its blocks) and reported failed, so vLLM recomputes instead of waiting forever."""
    caches = _caches()
    w = WorkerSide(
        settings=ConnectorSettings(
            host_capacity_gib=0.01, run_dir="/tmp", job_timeout_s=0.001, debug_load_delay_s=30
        ),
        model_id="sim",
        tp_rank=0,
        tp_size=1,
        num_blocks=NUM_BLOCKS,
    )
    w.register_kv_caches(caches)
    w.start_step(_step(stores=[StoreJob(1, "host", [BlockTransfer(b"k", 1)], "t")]))
    _drain(w)
    w.take_report()
    w.start_step(_step(loads=[LoadJob(2, "r", [BlockTransfer(b"k", 5)])]))
    [pending] = w._loads
    pending.deadline = 0.0  # past due: the next poll times it out
    assert w.poll() == {"r"}  # vLLM stops waiting
    assert w.load_error_block_ids() == {5}  # and recomputes the block
    taken = w.take_report()
    assert taken is not None and taken.report.jobs_failed == {2}
    assert all(bool((caches[n][5] == 0).all()) for n in NAMES)  # nothing was written
    w.shutdown()


def test_silent_rank_knob_never_reports_matching_stores() -> None:
    caches = _caches()
    w = WorkerSide(
        settings=ConnectorSettings(
            host_capacity_gib=0.01, run_dir="/tmp", debug_silent_rank_trajectory_prefix="silent-"
        ),
        model_id="sim",
        tp_rank=1,
        tp_size=2,
        num_blocks=NUM_BLOCKS,
    )
    w.register_kv_caches(caches)
    w.start_step(
        _step(
            stores=[
                StoreJob(1, "host", [BlockTransfer(b"a", 1)], "silent-1"),
                StoreJob(2, "host", [BlockTransfer(b"b", 2)], "loud-1"),
            ]
        )
    )
    _drain(w)
    taken = w.take_report()
    assert taken is not None and taken.report.jobs_done == {2: 1}
    w.shutdown()


def _stored_pair(w: WorkerSide, caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Blocks 1 and 2 of every layer stored to host as k1, k2, then zeroed; their old bytes."""
    for i, name in enumerate(NAMES):
        caches[name][1] = i + 1
        caches[name][2] = -(i + 1)
    w.start_step(
        _step(stores=[StoreJob(1, "host", [BlockTransfer(b"k1", 1), BlockTransfer(b"k2", 2)], "t")])
    )
    _drain(w)
    w.take_report()
    expected = {name: caches[name][1:3].clone() for name in NAMES}
    for name in NAMES:
        caches[name].zero_()
    return expected


def _native() -> None:
    from agentkv.tiers import native_copy

    native_copy.warm_up(background=False)
    if not native_copy.available():
        pytest.skip("numba is not installed: no native copies")


def test_a_small_cpu_step_is_copied_inside_start_step_without_the_copier_thread() -> None:
    """Up to SYNC_COPY_MAX_BYTES on CPU: the copy is done when start_step returns (one native
    call, no thread hand-off, no per-layer events), the waits return at once, and the job and
    its copy time are reported as before."""
    _native()
    w, caches = _worker()
    expected = _stored_pair(w, caches)
    w.start_step(
        _step(loads=[LoadJob(2, "req", [BlockTransfer(b"k1", 6), BlockTransfer(b"k2", 4)], True)])
    )
    assert w._copier is None  # no thread was ever started for it
    for name in NAMES:  # already there before any layer is waited for
        assert torch.equal(caches[name][6], expected[name][0])
        assert torch.equal(caches[name][4], expected[name][1])
    for name in NAMES:
        w.wait_for_layer(name)
    w.finish_step()
    taken = w.take_report()
    assert taken is not None and taken.report.jobs_done == {2: 1} and not taken.report.jobs_failed
    [((kind, tier, _), (nbytes, seconds))] = list(taken.report.transfers.items())
    assert (kind, tier, nbytes) == ("reload", "host", 2 * w.views.block_bytes)  # type: ignore[union-attr]
    assert seconds > 0
    # Its phases come with it: every one of a copy done in start_step, the reported copy time
    # made of the disk, copy and release phases (same clock), no thread hand-off to wait for.
    phases = taken.report.reload_phases
    assert set(phases) == set(ReloadPhase)
    assert phases[ReloadPhase.COPY] > 0 and phases[ReloadPhase.DISK] < phases[ReloadPhase.COPY]
    own = phases[ReloadPhase.DISK] + phases[ReloadPhase.COPY] + phases[ReloadPhase.RELEASE]
    assert own <= seconds
    assert phases[ReloadPhase.COPY_CPU] > 0
    # The pins were released: the same blocks load again (and a host miss still fails).
    w.start_step(
        _step(loads=[LoadJob(3, "r2", [BlockTransfer(b"k2", 0), BlockTransfer(b"no", 7)], True)])
    )
    w.finish_step()
    assert torch.equal(caches[NAMES[-1]][0], expected[NAMES[-1]][1])
    assert w.load_error_block_ids() == {7}
    w.shutdown()


def test_a_large_cpu_step_goes_layer_by_layer_on_the_copier_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Above SYNC_COPY_MAX_BYTES the copier thread writes layer after layer, one native call of
    the step's batch per layer (addresses made once), exactly."""
    from agentkv.tiers import native_copy
    from agentkv_vllm import layerwise_loads

    _native()
    monkeypatch.setattr(layerwise_loads, "SYNC_COPY_MAX_BYTES", 0)
    w, caches = _worker()
    expected = _stored_pair(w, caches)
    calls: list[tuple[list[int], list[int]]] = []
    real = native_copy.copy_runs

    def counting(hosts: object, blocks: object, table: object, runs: object, *rest: object) -> None:
        calls.append((list(blocks), list(runs)))  # type: ignore[call-overload]
        real(hosts, blocks, table, runs, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(native_copy, "copy_runs", counting)
    w.start_step(
        _step(loads=[LoadJob(2, "req", [BlockTransfer(b"k2", 7), BlockTransfer(b"k1", 3)], True)])
    )
    for name in NAMES:
        w.wait_for_layer(name)
        assert torch.equal(caches[name][7], expected[name][1])
        assert torch.equal(caches[name][3], expected[name][0])
    w.finish_step()
    assert w._copier is not None
    # Forward order (layers 0, 1, 2, 10, 11 are runs 0, 1, 4, 2, 3 of the sorted table), one
    # call per layer for both blocks.
    assert calls == [([7, 3], [i]) for i in (0, 1, 4, 2, 3)]
    taken = w.take_report()
    assert taken is not None and taken.report.jobs_done == {2: 1} and not taken.report.jobs_failed
    # Timed on the copier thread too; its hand-off is a phase of its own.
    phases = taken.report.reload_phases
    assert set(phases) == set(ReloadPhase) and phases[ReloadPhase.HANDOFF] > 0
    w.shutdown()


def test_a_block_id_outside_the_cache_fails_the_load_instead_of_raising_into_the_engine() -> None:
    _native()
    w, caches = _worker()
    _stored_pair(w, caches)
    w.start_step(_step(loads=[LoadJob(2, "req", [BlockTransfer(b"k1", NUM_BLOCKS)], True)]))
    for name in NAMES:
        w.wait_for_layer(name)
    w.finish_step()
    assert w.load_error_block_ids() == {NUM_BLOCKS}  # vLLM recomputes; the pins were released
    taken = w.take_report()
    assert taken is not None and taken.report.jobs_failed == {2}
    w.start_step(_step(loads=[LoadJob(3, "r2", [BlockTransfer(b"k1", 0)], True)]))
    w.finish_step()
    assert w.load_error_block_ids() == set()
    w.shutdown()


def test_reload_stamps_give_each_phase_and_leave_out_the_unreached_ones() -> None:
    stamps = ReloadStamps(
        10.0,
        layerwise=10.1,
        prepared=10.3,
        copy_start=10.3,
        disk_done=10.3,
        copy_end=11.0,
        released=11.05,
        returned=11.2,
        finishing=15.0,
        finished=15.01,
        copy_cpu=0.4,
    )
    assert stamps.phases() == pytest.approx(
        {
            ReloadPhase.BEFORE: 0.1,
            ReloadPhase.PREPARE: 0.2,
            ReloadPhase.HANDOFF: 0.0,
            ReloadPhase.DISK: 0.0,
            ReloadPhase.COPY: 0.7,
            ReloadPhase.COPY_CPU: 0.4,
            ReloadPhase.RELEASE: 0.05,
            ReloadPhase.FORWARD: 3.8,
            ReloadPhase.FINISH: 0.01,
        }
    )
    # The copy raised: no copy (nor its CPU time) and no disk phase end; what ran is kept.
    failed = ReloadStamps(1.0, layerwise=1.0, prepared=1.2, copy_start=1.3, released=1.4)
    assert failed.phases() == pytest.approx(
        {ReloadPhase.BEFORE: 0.0, ReloadPhase.PREPARE: 0.2, ReloadPhase.HANDOFF: 0.1}
    )
