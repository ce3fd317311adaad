"""Prometheus export: agentkv's metrics snapshot as metric families on a server's ``/metrics``.

Primitives:
  families(snapshot)          -> prometheus_client metric families for every spec in METRICS
                                 (series that never had an event are exported empty)
  SnapshotCollector(fetch)    a prometheus_client Collector that calls ``fetch()`` on each scrape;
                              when fetch fails it serves the last good snapshot and sets
                              ``agentkv_engine_reachable`` to 0, so a scrape never fails

A pull-time collector (not metric objects updated in this process) because the numbers live in
the engine process and the scrape happens in the API server process.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from agentkv.metrics import METRICS, Snapshot

log = logging.getLogger("agentkv.metrics")


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def families(snapshot: Snapshot) -> list[Metric]:
    out: list[Metric] = []
    for spec in METRICS:
        labels = list(spec.labels)
        rows = snapshot.get(spec.kind, {}).get(spec.name, [])
        n = len(labels)
        if spec.kind == "counter":
            fam: Metric = CounterMetricFamily(spec.name, spec.help, labels=labels)
            for row in rows:
                fam.add_metric([str(v) for v in row[:n]], float(row[n]))  # type: ignore[attr-defined]
        elif spec.kind == "gauge":
            fam = GaugeMetricFamily(spec.name, spec.help, labels=labels)
            for row in rows:
                fam.add_metric([str(v) for v in row[:n]], float(row[n]))  # type: ignore[attr-defined]
        else:
            fam = HistogramMetricFamily(spec.name, spec.help, labels=labels)
            for row in rows:
                counts, total = row[n], float(row[n + 1])
                cumulative, buckets = 0, []
                for bound, c in zip((*spec.buckets, math.inf), counts, strict=True):
                    cumulative += int(c)
                    buckets.append((_le(bound), float(cumulative)))
                fam.add_metric([str(v) for v in row[:n]], buckets, total)  # type: ignore[attr-defined]
        out.append(fam)
    return out


class SnapshotCollector(Collector):
    def __init__(self, fetch: Callable[[], Snapshot]) -> None:
        self._fetch = fetch
        self._last: Snapshot = {}
        self._warned = False

    def collect(self) -> Iterator[Metric]:
        reachable = 1.0
        try:
            self._last = self._fetch()
            self._warned = False
        except Exception as exc:
            reachable = 0.0
            if not self._warned:
                log.warning("agentkv: metrics unavailable from the engine (%s); serving last", exc)
                self._warned = True
        yield from families(self._last)
        up = GaugeMetricFamily(
            "agentkv_engine_reachable",
            "1 when the last scrape read agentkv's metrics from the engine, 0 when it did not.",
        )
        up.add_metric([], reachable)
        yield up

    def describe(self) -> Iterator[Metric]:
        # Registering must not call the engine (it may not be up yet).
        return iter(())
