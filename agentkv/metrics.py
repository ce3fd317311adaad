"""The metrics agentkv keeps about itself: one definition list, one recorder, two exports.

Primitives:
  MetricSpec / METRICS   every metric: name, kind, help, labels, buckets. The single source for
                         the Prometheus export (``agentkv.prometheus_export``), the OpenTelemetry
                         export (``agentkv.otel_export``) and docs/metrics.md
  MetricsRecorder        cumulative counters and histograms fed by events; thread-safe;
                         ``snapshot()`` is plain JSON, because it crosses from the engine process
                         to the API server process that serves ``/metrics``
  MetricsSink            what an exporter implements to see every event as it happens (OTel)
  label_value()          caps label cardinality (tool names come from clients)

Gauges (bytes held per tier, paused trajectories by state) are not recorded: they are read from
the engine's state when a snapshot is taken, so they can never drift from it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from agentkv.demotion import COUNTED_REASONS
from agentkv.policy import Action

log = logging.getLogger("agentkv.metrics")
MetricKind = Literal["counter", "gauge", "histogram"]

# Transfers: one job is a trajectory's context, from one 128-token block (tens of KiB on small
# models) to tens of GiB on a large model's long context.
BYTE_BUCKETS = tuple(float(1 << (16 + 2 * i)) for i in range(10))  # 64 KiB .. 16 GiB
# A reload step's phases are tens to hundreds of microseconds each.
PHASE_SECOND_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0)
TRANSFER_SECOND_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
# Tool waits span a compile (seconds) to a human approval (minutes to an hour).
WAIT_SECOND_BUCKETS = (
    0.1,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)

MAX_LABEL_VALUES = 32  # per label, per metric; beyond it values collapse into "other"
OTHER = "other"


@dataclass(frozen=True)
class MetricSpec:
    """One metric. ``name`` is the Prometheus name without the ``_total`` a counter gets."""

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    unit: str = ""

    @property
    def otel_name(self) -> str:
        """``agentkv_offload_bytes`` -> ``agentkv.offload_bytes`` (OTel's namespace separator)."""
        return self.name.replace("_", ".", 1)


DECISIONS = MetricSpec(
    "agentkv_decisions",
    "counter",
    f"Pause decisions by action ({', '.join(Action)}).",
    ("action",),
)
PREFETCH_OUTCOMES = MetricSpec(
    "agentkv_prefetch_outcomes",
    "counter",
    "Disk-to-host prefetches by outcome relative to the actual return (early, on_time, late, wasted).",
    ("outcome",),
)
DEVICE_PREFETCH_OUTCOMES = MetricSpec(
    "agentkv_device_prefetch_outcomes",
    "counter",
    "Prefetches into device blocks by outcome (on_time: the resume found them on the device; "
    "late: the resume came first; wasted: the lease ended unused), per tool.",
    ("outcome", "tool"),
)
PREFETCH_RETURN_ERROR = MetricSpec(
    "agentkv_prefetch_return_error_seconds",
    "histogram",
    "|actual - predicted return| of paused branches a device prefetch was planned for, per tool.",
    ("tool",),
    WAIT_SECOND_BUCKETS,
    "s",
)
OFFLOAD_BYTES = MetricSpec(
    "agentkv_offload_bytes",
    "histogram",
    "Bytes per offload job (device to tier), summed over tensor-parallel ranks.",
    ("tier",),
    BYTE_BUCKETS,
    "By",
)
OFFLOAD_SECONDS = MetricSpec(
    "agentkv_offload_seconds",
    "histogram",
    "Duration of an offload job (device to tier), slowest rank.",
    ("tier",),
    TRANSFER_SECOND_BUCKETS,
    "s",
)
RELOAD_BYTES = MetricSpec(
    "agentkv_reload_bytes",
    "histogram",
    "Bytes per reload job (tier to device), summed over tensor-parallel ranks.",
    ("tier",),
    BYTE_BUCKETS,
    "By",
)
RELOAD_SECONDS = MetricSpec(
    "agentkv_reload_seconds",
    "histogram",
    "Duration of a reload job (tier to device), slowest rank.",
    ("tier",),
    TRANSFER_SECOND_BUCKETS,
    "s",
)
RELOAD_PHASE_SECONDS = MetricSpec(
    "agentkv_reload_phase_seconds",
    "histogram",
    "Per layer-by-layer reload step: seconds in each phase on the worker, slowest rank.",
    ("phase",),
    PHASE_SECOND_BUCKETS,
    "s",
)
TOOL_WAIT_PREDICTED = MetricSpec(
    "agentkv_tool_wait_predicted_seconds",
    "histogram",
    "Predicted (p50) tool wait at pause time, per tool.",
    ("tool",),
    WAIT_SECOND_BUCKETS,
    "s",
)
TOOL_WAIT_OBSERVED = MetricSpec(
    "agentkv_tool_wait_observed_seconds",
    "histogram",
    "Observed tool wait (pause to resume), per tool.",
    ("tool",),
    WAIT_SECOND_BUCKETS,
    "s",
)
PREFIX_HIT_RATIO = MetricSpec(
    "agentkv_prefix_hit_ratio",
    "histogram",
    "Per trajectory turn: prompt tokens served from a cache (device or tier) / prompt tokens.",
    (),
    RATIO_BUCKETS,
    "1",
)
PROMPT_TOKENS = MetricSpec(
    "agentkv_prompt_tokens",
    "counter",
    "Prompt tokens of trajectory requests.",
)
CACHED_TOKENS = MetricSpec(
    "agentkv_cached_tokens",
    "counter",
    "Prompt tokens of trajectory requests not recomputed, by source (device, host, disk).",
    ("source",),
)
DIVERGENCES = MetricSpec(
    "agentkv_prefix_divergences",
    "counter",
    "Turns whose prompt left the previous turn's context, by the declared zone of the first "
    "changed token (undeclared when the request declared none there).",
    ("zone",),
)
DEMOTIONS = MetricSpec(
    "agentkv_demotions",
    "counter",
    "Paused branches moved off the device without a pause decision, by reason "
    f"({', '.join(COUNTED_REASONS)}).",
    ("reason",),
)
BYTES_HELD = MetricSpec(
    "agentkv_bytes_held",
    "gauge",
    "KV bytes agentkv holds for trajectories, by tier (device_pinned, host, disk).",
    ("tier",),
    unit="By",
)
PAUSED_TRAJECTORIES = MetricSpec(
    "agentkv_paused_trajectories",
    "gauge",
    "Paused trajectory branches by state (held, retained, cached, offloading, offloaded, dropped).",
    ("state",),
)
TRAJECTORIES = MetricSpec("agentkv_trajectories", "gauge", "Trajectories the engine tracks.")
PREEMPT_SAVES = MetricSpec(
    "agentkv_preempt_saves",
    "counter",
    "Preempted trajectory requests whose computed blocks were copied to host before vLLM "
    "reused them (the rescheduled request loads them instead of recomputing).",
)
PREEMPT_SAVED_TOKENS = MetricSpec(
    "agentkv_preempt_saved_tokens",
    "counter",
    "Tokens of KV those preemption saves copied to host.",
)

CONCURRENT_TURNS = MetricSpec(
    "agentkv_concurrent_turns",
    "counter",
    "Trajectory requests that started while another request of the same branch still ran: "
    "several runs sharing one session id (a client-level header), merged into one trajectory "
    "(docs/sdk.md, Agent frameworks).",
)

REJECTED_BLOCKS = MetricSpec(
    "agentkv_rejected_blocks",
    "counter",
    "Tier values refused and recomputed instead, by tier and reason (bad_tag: a remote value "
    "whose tag does not verify, forged or written under another secret; corrupt: a damaged "
    "header, length or checksum).",
    ("tier", "reason"),
)

METRICS: tuple[MetricSpec, ...] = (
    DECISIONS,
    PREEMPT_SAVES,
    PREEMPT_SAVED_TOKENS,
    CONCURRENT_TURNS,
    PREFETCH_OUTCOMES,
    DEVICE_PREFETCH_OUTCOMES,
    PREFETCH_RETURN_ERROR,
    OFFLOAD_BYTES,
    OFFLOAD_SECONDS,
    RELOAD_BYTES,
    RELOAD_SECONDS,
    RELOAD_PHASE_SECONDS,
    TOOL_WAIT_PREDICTED,
    TOOL_WAIT_OBSERVED,
    PREFIX_HIT_RATIO,
    PROMPT_TOKENS,
    CACHED_TOKENS,
    DIVERGENCES,
    DEMOTIONS,
    BYTES_HELD,
    PAUSED_TRAJECTORIES,
    TRAJECTORIES,
    REJECTED_BLOCKS,
)
BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}

# A snapshot, as JSON: {"counter"|"gauge": {name: [[label values..., value], ...]},
#                       "histogram": {name: [[label values..., bucket counts, sum, count], ...]}}
Snapshot = dict[str, dict[str, list[list[Any]]]]


class MetricsSink(Protocol):
    """Sees each event as it is recorded (an exporter that pushes, such as OpenTelemetry)."""

    def add(self, spec: MetricSpec, value: float, labels: Mapping[str, str]) -> None: ...

    def observe(self, spec: MetricSpec, value: float, labels: Mapping[str, str]) -> None: ...


@dataclass
class _Histogram:
    counts: list[int]  # per bucket, not cumulative; the last one is +Inf
    total: float = 0.0
    count: int = 0


def _bucket_index(buckets: Sequence[float], value: float) -> int:
    for i, upper in enumerate(buckets):
        if value <= upper:
            return i
    return len(buckets)


class MetricsRecorder:
    """Cumulative counters and histograms over METRICS; every method is thread-safe.

    Label values beyond MAX_LABEL_VALUES distinct ones per metric collapse into ``"other"``,
    because tool names come from clients and an unbounded label would grow the scrape forever.
    """

    def __init__(self, sink: MetricsSink | None = None) -> None:
        self.sink = sink
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple[str, ...], float]] = {}
        self._histograms: dict[str, dict[tuple[str, ...], _Histogram]] = {}
        self._seen: dict[tuple[str, str], set[str]] = {}

    def label_value(self, spec: MetricSpec, label: str, value: str) -> str:
        seen = self._seen.setdefault((spec.name, label), set())
        if value in seen:
            return value
        if len(seen) >= MAX_LABEL_VALUES:
            return OTHER
        seen.add(value)
        return value

    def _key(self, spec: MetricSpec, labels: Mapping[str, str]) -> tuple[str, ...]:
        if set(labels) != set(spec.labels):
            raise ValueError(f"{spec.name} takes labels {spec.labels}, got {tuple(labels)}")
        return tuple(self.label_value(spec, name, str(labels[name])) for name in spec.labels)

    def add(self, spec: MetricSpec, value: float = 1.0, **labels: str) -> None:
        """Add ``value`` (>= 0) to a counter."""
        if spec.kind != "counter":
            raise TypeError(f"{spec.name} is a {spec.kind}, not a counter")
        if value < 0:
            raise ValueError(f"counter {spec.name} cannot decrease (got {value})")
        with self._lock:
            key = self._key(spec, labels)
            series = self._counters.setdefault(spec.name, {})
            series[key] = series.get(key, 0.0) + value
            bound = dict(zip(spec.labels, key, strict=True))
        if self.sink is not None:
            self._to_sink(self.sink.add, spec, value, bound)

    def observe(self, spec: MetricSpec, value: float, **labels: str) -> None:
        """Record one observation in a histogram."""
        if spec.kind != "histogram":
            raise TypeError(f"{spec.name} is a {spec.kind}, not a histogram")
        with self._lock:
            key = self._key(spec, labels)
            series = self._histograms.setdefault(spec.name, {})
            hist = series.get(key)
            if hist is None:
                hist = series[key] = _Histogram([0] * (len(spec.buckets) + 1))
            hist.counts[_bucket_index(spec.buckets, value)] += 1
            hist.total += value
            hist.count += 1
            bound = dict(zip(spec.labels, key, strict=True))
        if self.sink is not None:
            self._to_sink(self.sink.observe, spec, value, bound)

    @staticmethod
    def _to_sink(call: Any, spec: MetricSpec, value: float, labels: Mapping[str, str]) -> None:
        # Events are recorded on the engine's hot path: an exporter fault must not reach it.
        try:
            call(spec, value, labels)
        except Exception:
            log.debug("agentkv: metrics sink failed for %s", spec.name, exc_info=True)

    def snapshot(
        self, gauges: Iterable[tuple[MetricSpec, Mapping[str, str], float]] = ()
    ) -> Snapshot:
        """The cumulative state as JSON-able lists, plus the ``gauges`` given (read by the caller)."""
        out: Snapshot = {"counter": {}, "gauge": {}, "histogram": {}}
        with self._lock:
            for name, counter_series in self._counters.items():
                out["counter"][name] = [[*k, v] for k, v in counter_series.items()]
            for name, hist_series in self._histograms.items():
                out["histogram"][name] = [
                    [*k, list(h.counts), h.total, h.count] for k, h in hist_series.items()
                ]
        for spec, labels, value in gauges:
            row = [str(labels[n]) for n in spec.labels]
            out["gauge"].setdefault(spec.name, []).append([*row, float(value)])
        return out


def counter_value(snapshot: Snapshot, name: str, **labels: str) -> float:
    """Sum of a counter's series in a snapshot matching ``labels`` (tests and the CLI use it)."""
    spec = BY_NAME[name]
    total = 0.0
    for row in snapshot.get("counter", {}).get(name, []):
        values = dict(zip(spec.labels, row[:-1], strict=True))
        if all(values.get(k) == v for k, v in labels.items()):
            total += float(row[-1])
    return total
