"""agentkv's metrics on vLLM's ``/metrics`` without blocking the API server's event loop.

prometheus_client calls a collector synchronously, on the event loop that also streams every
response, so a collector that asked the engine's control thread itself would stall every stream
for a round trip to a busy engine core on each scrape. Instead the hooks middleware awaits
``refresh()`` just before a ``GET /metrics`` reaches vLLM's app, and the collector's ``fetch()``
returns that snapshot.

Primitives:
  MetricsSnapshot.refresh()   async: ask the engine for its metrics (``metrics`` control op);
                              never raises (a failure is remembered for ``fetch``)
  MetricsSnapshot.fetch()     sync, for ``SnapshotCollector``: the snapshot if refreshed within
                              ``fresh_s``; raises ``ControlUnavailable`` if that refresh failed;
                              otherwise (no middleware in front: a scrape that bypassed it) one
                              blocking call, as before

Invariant: a scrape that went through the middleware never makes a blocking call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

from agentkv_vllm.control import ControlUnavailable

FRESH_S = 1.0
TIMEOUT_S = 1.0


class _Client(Protocol):
    async def call(self, op: str, **fields: Any) -> tuple[int, dict[str, Any]]: ...

    def call_sync(
        self, op: str, timeout_s: float | None = None, **fields: Any
    ) -> tuple[int, dict[str, Any]]: ...


class MetricsSnapshot:
    def __init__(
        self,
        client: _Client,
        fresh_s: float = FRESH_S,
        timeout_s: float = TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._fresh_s = fresh_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._body: dict[str, Any] | None = None
        self._error: str | None = None
        self._at = float("-inf")

    async def refresh(self) -> None:
        try:
            answer = await asyncio.wait_for(self._client.call("metrics"), timeout=self._timeout_s)
            self._body, self._error = _body(*answer), None
        except Exception as exc:  # served as unreachable by the collector, never raised here
            self._body, self._error = None, str(exc) or type(exc).__name__
        self._at = self._clock()

    def fetch(self) -> dict[str, Any]:
        if self._clock() - self._at <= self._fresh_s:
            if self._body is not None:
                return self._body
            raise ControlUnavailable(self._error or "metrics unavailable")
        return _body(*self._client.call_sync("metrics", timeout_s=self._timeout_s))


def _body(status: int, body: dict[str, Any]) -> dict[str, Any]:
    if status != 200:
        raise ControlUnavailable(f"metrics op answered {status}: {body.get('detail')}")
    return body
