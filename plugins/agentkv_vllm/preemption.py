"""Swap instead of recompute: the blocks of this connector's requests vLLM is about to preempt.

Primitives:
  PreemptionNotes.hold(request)    a trajectory request vLLM now holds (its lookup)
  PreemptionNotes.drop(req_id)     it finished or was aborted
  PreemptionNotes.note(kv_cache_manager, block_size)
                                   an allocation failed and vLLM may preempt: note the block ids
                                   and trusted computed tokens of the held RUNNING requests, once
                                   per step (O(held running requests), only on a failed
                                   allocation)
  PreemptionNotes.take(scheduler_output)
                                   this step's preempted requests among the noted ones:
                                   (request id, block ids, computed tokens, block hashes)

Why notes: vLLM 0.32's ``Scheduler._preempt_request`` (v1/core/sched/scheduler.py:1571-1614)
frees the victim's blocks (:1590) and zeroes its ``num_computed_tokens`` (:1593) without calling
the KV connector; the last connector call before it is ``has_pending_block_frees()`` (:790), made
once an allocation failed and before the victim is chosen. The preempted ids then reach
``build_connector_meta`` in the same ``schedule()`` call (``preempted_req_ids``), whose jobs the
worker runs before that step's forward: the freed blocks still hold the KV then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class PreemptionNotes:
    def __init__(self) -> None:
        self.held: dict[str, Any] = {}  # request id -> vLLM request (trajectory requests only)
        self._noted: dict[str, tuple[list[int], int, Any]] | None = None

    def hold(self, request: Any) -> None:
        self.held[request.request_id] = request

    def drop(self, req_id: str) -> None:
        self.held.pop(req_id, None)

    def note(self, kv_cache_manager: Any, block_size: int) -> None:
        if self._noted is not None or not self.held or kv_cache_manager is None:
            return
        from vllm.v1.request import RequestStatus

        noted: dict[str, tuple[list[int], int, Any]] = {}
        for req_id, request in self.held.items():
            if request.status != RequestStatus.RUNNING:
                continue
            # KV a step still in flight writes is not trusted yet (as at finish).
            computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
            if computed >= block_size:
                ids = kv_cache_manager.get_block_ids(req_id)[0]
                noted[req_id] = (list(ids), computed, request)
        self._noted = noted

    def take(self, scheduler_output: Any) -> list[tuple[str, list[int], int, Sequence[bytes]]]:
        noted, self._noted = self._noted, None
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        if not noted or not preempted:
            return []
        out = []
        for req_id in preempted:
            if req_id in noted:
                ids, computed, request = noted[req_id]
                out.append((req_id, ids, computed, request.block_hashes))
        return out
