"""Periodic samples of KV occupancy while a configuration runs.

Both configurations: vLLM's ``/metrics`` (``vllm:kv_cache_usage_perc``, prefix-cache queries and
hits) and the harness's own count of trajectories waiting on a tool with their context tokens.
With agentkv also ``GET /agentkv/v1/status``: bytes held pinned on the device, in host RAM and on
disk, and branches by state, read every ``status_every``-th sample and on the last one (carried
forward in between): each read is a control call the engine answers, work a vanilla server in
the same comparison is not asked to do. Vanilla vLLM has no notion of a paused trajectory: its paused
contexts sit, unpinned, in the prefix cache until evicted, which only ``kv_cache_usage_perc``
and the hit rates show.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

METRIC_RE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$")
WANTED = (
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


@dataclass
class Sample:
    t_s: float  # since the run started
    kv_usage: float | None  # fraction of device KV blocks in use (vLLM's gauge)
    running: float | None
    waiting: float | None
    paused_trajectories: int  # waiting on a tool, as the harness knows
    paused_context_tokens: int
    device_pinned_bytes: int | None = None  # agentkv only
    host_bytes: int | None = None
    disk_bytes: int | None = None
    branches_by_state: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_metrics(text: str) -> dict[str, float]:
    """Sum each wanted vLLM metric over its label sets (one model, one engine: one series)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = METRIC_RE.match(line.strip())
        if m and m.group(1) in WANTED and m.group(2) != "NaN":
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


class Sampler:
    """``async with Sampler(...)``: samples every ``interval_s`` until the block exits."""

    def __init__(
        self,
        base_url: str,
        agentkv: bool,
        t_run: float,
        paused: Callable[[], tuple[int, int]],
        interval_s: float = 0.5,
        headers: dict[str, str] | None = None,
        status_every: int = 4,
    ) -> None:
        self.base_url = base_url
        self.agentkv = agentkv
        self.t_run = t_run
        self.paused = paused
        self.interval_s = interval_s
        self.status_every = max(1, status_every)
        self._status: dict[str, Any] = {}
        self.samples: list[Sample] = []
        self.errors = 0
        self._client = httpx.AsyncClient(timeout=10.0, headers=headers or {})
        self._task: asyncio.Task[None] | None = None

    async def sample_once(self, last: bool = False) -> Sample:
        metrics: dict[str, float] = {}
        try:
            r = await self._client.get(self.base_url + "/metrics")
            metrics = parse_metrics(r.text)
            if self.agentkv and (last or len(self.samples) % self.status_every == 0):
                s = await self._client.get(self.base_url + "/agentkv/v1/status")
                self._status = s.json() if s.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            self.errors += 1
        status = self._status
        n, tokens = self.paused()
        held = status.get("bytes_held") or {}
        sample = Sample(
            t_s=time.monotonic() - self.t_run,
            kv_usage=metrics.get("vllm:kv_cache_usage_perc"),
            running=metrics.get("vllm:num_requests_running"),
            waiting=metrics.get("vllm:num_requests_waiting"),
            paused_trajectories=n,
            paused_context_tokens=tokens,
            device_pinned_bytes=held.get("device_pinned") if self.agentkv else None,
            host_bytes=held.get("host") if self.agentkv else None,
            disk_bytes=held.get("disk") if self.agentkv else None,
            branches_by_state=dict(status.get("branches_by_state") or {}),
        )
        self.samples.append(sample)
        return sample

    async def _loop(self) -> None:
        while True:
            await self.sample_once()
            await asyncio.sleep(self.interval_s)

    async def __aenter__(self) -> Sampler:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self.sample_once(last=True)
        await self._client.aclose()


async def prefix_counters(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """vLLM's cumulative prefix-cache counters right now (for a before/after difference)."""
    async with httpx.AsyncClient(timeout=10.0, headers=headers or {}) as c:
        r = await c.get(base_url + "/metrics")
    return parse_metrics(r.text)
