"""Capacity search: the smallest fleet that meets a latency objective.

Primitives:
  SearchResult                 one (router, policy): the smallest replica count meeting the SLO
                               (None: not within ``max_replicas``), its TTFT p99, every probe
  find_replicas(workload, base, slo_ttft_p99_s, max_replicas, on_progress) -> SearchResult

The search doubles the replica count until the SLO holds, then bisects between the last
failing and the first passing count. It assumes more replicas never make the p99 worse, which
holds for the load-spreading routers; with pure session affinity a hash collision can make it
non-monotone, so every probe is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from agentkv.simulate.fleet import FleetConfig, SimResult, simulate
from agentkv.simulate.workload import SimWorkload

ProgressFn = Callable[[str, int, int], None]


@dataclass
class SearchResult:
    router: str
    policy: str
    slo_ttft_p99_s: float
    replicas: int | None
    ttft_p99_s: float | None
    probes: dict[int, float | None] = field(default_factory=dict)
    result: SimResult | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "router": self.router,
            "policy": self.policy,
            "slo_ttft_p99_s": self.slo_ttft_p99_s,
            "replicas": self.replicas,
            "ttft_p99_s": self.ttft_p99_s,
            "probes": {str(k): v for k, v in sorted(self.probes.items())},
            "summary": self.result.summary.to_dict() if self.result is not None else None,
        }


def find_replicas(
    workload: SimWorkload,
    base: FleetConfig,
    slo_ttft_p99_s: float,
    max_replicas: int = 64,
    on_progress: ProgressFn | None = None,
) -> SearchResult:
    """Smallest replica count (<= ``max_replicas``) whose TTFT p99 over all turns is at most
    ``slo_ttft_p99_s``, for the router and policy of ``base``."""
    out = SearchResult(base.router, base.policy, slo_ttft_p99_s, None, None)
    cache: dict[int, SimResult] = {}

    def probe(n: int) -> bool:
        if n not in cache:
            if on_progress is not None:
                on_progress(f"{base.router}/{base.policy}: {n} replicas", len(cache), 0)
            cache[n] = simulate(workload, replace(base, replicas=n))
            out.probes[n] = cache[n].summary.ttft_p99_s
        p99 = cache[n].summary.ttft_p99_s
        return p99 is not None and p99 <= slo_ttft_p99_s and not cache[n].summary.rejected_turns

    lo, hi = 0, 1
    while not probe(hi):
        lo = hi
        if hi >= max_replicas:
            return out
        hi = min(hi * 2, max_replicas)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid):
            hi = mid
        else:
            lo = mid
    out.replicas = hi
    out.result = cache[hi]
    out.ttft_p99_s = cache[hi].summary.ttft_p99_s
    return out
