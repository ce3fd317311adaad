"""The adapter's preemption notes (plugins/agentkv_vllm/preemption.py): the blocks of the
trajectory requests vLLM may preempt, noted at ``has_pending_block_frees`` (the last connector
call before vLLM frees them) and handed over for the requests the step did preempt."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm.v1.request import RequestStatus

from agentkv_vllm.preemption import PreemptionNotes


class _KVManager:
    def __init__(self, blocks: dict[str, list[int]]) -> None:
        self.blocks = blocks
        self.calls = 0

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        self.calls += 1
        return (self.blocks[req_id],)


def _req(rid: str, status: Any, computed: int, in_flight: int = 0) -> Any:
    return SimpleNamespace(
        request_id=rid,
        status=status,
        num_computed_tokens=computed,
        num_in_flight_tokens=in_flight,
        block_hashes=[b"h1", b"h2", b"h3"],
    )


def test_notes_running_requests_once_and_hands_over_the_preempted_ones() -> None:
    notes = PreemptionNotes()
    notes.hold(_req("a", RequestStatus.RUNNING, 300, in_flight=2))
    notes.hold(_req("b", RequestStatus.WAITING, 0))
    notes.hold(_req("c", RequestStatus.RUNNING, 100))  # under one block: nothing to save
    kv = _KVManager({"a": [5, 6, 7], "b": [], "c": [9]})
    notes.note(kv, 128)
    kv.blocks["a"] = [1]  # a later failed allocation in the same step: the first note stands
    notes.note(kv, 128)
    assert kv.calls == 1
    out = notes.take(SimpleNamespace(preempted_req_ids={"a", "b"}))
    assert out == [("a", [5, 6, 7], 298, [b"h1", b"h2", b"h3"])]
    assert notes.take(SimpleNamespace(preempted_req_ids={"a"})) == []  # taken once per step


def test_nothing_is_noted_without_held_requests_or_a_bound_cache_manager() -> None:
    notes = PreemptionNotes()
    notes.note(_KVManager({}), 128)
    assert notes.take(SimpleNamespace(preempted_req_ids={"a"})) == []
    notes.hold(_req("a", RequestStatus.RUNNING, 300))
    notes.note(None, 128)
    assert notes.take(SimpleNamespace(preempted_req_ids={"a"})) == []
    notes.drop("a")
    assert notes.held == {}
