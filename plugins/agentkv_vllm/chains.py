"""Responses API chains: which trajectory a ``previous_response_id`` continues.

A Responses-API conversation is a chain of responses, each naming the one before
(``previous_response_id``); vLLM keeps them in the API server's response store
(``VLLM_ENABLE_RESPONSES_API_STORE=1``). The chain is the trajectory: the hooks record each
response id a trajectory's request produced, and a later request continuing it inherits the
trajectory and branch without naming either.

Primitives:
  ResponseChains(max_entries)   response id -> (trajectory id, branch); least recently used
                                ids are forgotten first (each entry is ~200 bytes)
  .record(response_id, trajectory_id, branch)
  .lookup(response_id) -> (trajectory_id, branch) | None

One table per API server process, like vLLM's own response store (a ``previous_response_id``
only resolves in the process that stored it). Thread-safe: the ASGI app runs on one event loop,
but nothing here assumes it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

DEFAULT_MAX_ENTRIES = 65536


class ResponseChains:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max(1, max_entries)
        self._of: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._of)

    def record(self, response_id: str, trajectory_id: str, branch: str) -> None:
        with self._lock:
            self._of[response_id] = (trajectory_id, branch)
            self._of.move_to_end(response_id)
            while len(self._of) > self.max_entries:
                self._of.popitem(last=False)

    def lookup(self, response_id: str) -> tuple[str, str] | None:
        with self._lock:
            found = self._of.get(response_id)
            if found is not None:
                self._of.move_to_end(response_id)  # an active chain stays
            return found
