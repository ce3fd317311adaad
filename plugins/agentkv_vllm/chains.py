"""Responses API chains: which trajectory a ``previous_response_id`` continues, and whose it is.

A Responses-API conversation is a chain of responses, each naming the one before
(``previous_response_id``); vLLM keeps them in the API server's response store
(``VLLM_ENABLE_RESPONSES_API_STORE=1``). The chain is the trajectory: the hooks record each
response id a trajectory's request produced, and a later request continuing it inherits the
trajectory and branch without naming either.

vLLM's store has no tenants: it serves a stored response (``GET /v1/responses/{id}``) and
continues it (``previous_response_id``, whose conversation it renders into the new prompt) for
anyone who names its id. So each entry keeps the tenant of the request that produced it (the
digest of its ``cache_salt``, never the salt), and the hooks refuse another tenant's salted
response with vLLM's own 404.

Primitives:
  ResponseChains(max_entries)   response id -> (trajectory id | None, branch, tenant digest |
                                None); least recently used ids are forgotten first (each entry
                                is ~250 bytes)
  .record(response_id, trajectory_id, branch, tenant=None)   ``trajectory_id`` None: a salted
                                response outside any trajectory (its tenant only)
  .lookup(response_id) -> (trajectory_id, branch) | None
  .foreign(response_id, tenant) -> bool   the response belongs to another tenant's salted
                                request (an unsalted one belongs to everyone, as in vLLM)

One table per API server process, like vLLM's own response store (a ``previous_response_id``
only resolves in the process that stored it). A salted response forgotten by the LRU is served
by vLLM to anyone again: ``max_entries`` bounds the memory, so size it to the store's working
set. Thread-safe: the ASGI app runs on one event loop, but nothing here assumes it.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass

from agentkv.manager.state import tenant_digest

DEFAULT_MAX_ENTRIES = 65536


@dataclass(frozen=True)
class _Entry:
    trajectory_id: str | None
    branch: str
    tenant: str | None  # tenant_digest of the producing request's cache_salt


class ResponseChains:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max(1, max_entries)
        self._of: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._of)

    def record(
        self,
        response_id: str,
        trajectory_id: str | None,
        branch: str,
        tenant: str | None = None,
    ) -> None:
        """``tenant``: the producing request's raw cache_salt (kept only as its digest)."""
        entry = _Entry(trajectory_id, branch, tenant_digest(tenant) if tenant else None)
        with self._lock:
            self._of[response_id] = entry
            self._of.move_to_end(response_id)
            while len(self._of) > self.max_entries:
                self._of.popitem(last=False)

    def lookup(self, response_id: str) -> tuple[str, str] | None:
        with self._lock:
            found = self._of.get(response_id)
            if found is not None:
                self._of.move_to_end(response_id)  # an active chain stays
        if found is None or found.trajectory_id is None:
            return None
        return found.trajectory_id, found.branch

    def foreign(self, response_id: str, tenant: str | None) -> bool:
        """Whether ``response_id`` was produced by a salted request of a tenant other than
        ``tenant`` (the caller's raw cache_salt; None or "": unsalted)."""
        with self._lock:
            found = self._of.get(response_id)
        if found is None or found.tenant is None:
            return False
        mine = tenant_digest(tenant) if tenant else ""
        return not secrets.compare_digest(found.tenant, mine)
