"""agentkv.metrics (recorder), agentkv.prometheus_export (scrape text) and OTel configuration."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agentkv import metrics as m
from agentkv.metrics import MAX_LABEL_VALUES, MetricSpec, MetricsRecorder, counter_value
from agentkv.otel_export import OTelExport, otel_configured
from agentkv.prometheus_export import SnapshotCollector


def _scrape(fetch: Any) -> dict[str, Any]:
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(fetch))
    text = generate_latest(reg).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(fam: Any, suffix: str = "", **labels: str) -> list[Any]:
    return [
        s
        for s in fam.samples
        if s.name == fam.name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def test_counters_and_histograms_accumulate() -> None:
    rec = MetricsRecorder()
    rec.add(m.DECISIONS, action="retain")
    rec.add(m.DECISIONS, action="retain")
    rec.add(m.DECISIONS, action="offload_host")
    for v in (0.004, 0.2, 50.0):
        rec.observe(m.RELOAD_SECONDS, v, tier="host")
    snap = json.loads(json.dumps(rec.snapshot()))  # it must survive the trip over the channel
    assert counter_value(snap, "agentkv_decisions", action="retain") == 2
    assert counter_value(snap, "agentkv_decisions") == 3
    [row] = snap["histogram"]["agentkv_reload_seconds"]
    tier, counts, total, count = row
    assert tier == "host" and count == 3 and total == pytest.approx(50.204)
    assert sum(counts) == 3 and counts[-1] == 1  # 50 s is past the last bucket: +Inf
    assert counts[m.TRANSFER_SECOND_BUCKETS.index(0.005)] == 1


def test_labels_are_checked_and_capped() -> None:
    rec = MetricsRecorder()
    with pytest.raises(ValueError, match="takes labels"):
        rec.add(m.DECISIONS, tool="x")
    with pytest.raises(TypeError):
        rec.observe(m.DECISIONS, 1.0, action="retain")
    with pytest.raises(ValueError):
        rec.add(m.DECISIONS, -1, action="retain")
    for i in range(MAX_LABEL_VALUES + 5):
        rec.observe(m.TOOL_WAIT_OBSERVED, 1.0, tool=f"tool{i}")
    tools = {row[0] for row in rec.snapshot()["histogram"]["agentkv_tool_wait_observed_seconds"]}
    assert len(tools) == MAX_LABEL_VALUES + 1 and "other" in tools


def test_sink_sees_each_event_with_capped_labels() -> None:
    seen: list[tuple[str, str, float, dict[str, str]]] = []

    class Sink:
        def add(self, spec: MetricSpec, value: float, labels: Mapping[str, str]) -> None:
            seen.append(("add", spec.name, value, dict(labels)))

        def observe(self, spec: MetricSpec, value: float, labels: Mapping[str, str]) -> None:
            seen.append(("observe", spec.name, value, dict(labels)))

    rec = MetricsRecorder(Sink())
    rec.add(m.CACHED_TOKENS, 128, source="host")
    rec.observe(m.PREFIX_HIT_RATIO, 0.5)
    assert seen == [
        ("add", "agentkv_cached_tokens", 128, {"source": "host"}),
        ("observe", "agentkv_prefix_hit_ratio", 0.5, {}),
    ]


def test_a_failing_sink_never_reaches_the_caller() -> None:
    class Broken:
        def add(self, spec: MetricSpec, value: float, labels: Mapping[str, str]) -> None:
            raise RuntimeError("exporter down")

        observe = add

    rec = MetricsRecorder(Broken())
    rec.add(m.DECISIONS, action="drop")  # must not raise: this runs in the engine's hooks
    rec.observe(m.PREFIX_HIT_RATIO, 0.3)
    assert counter_value(rec.snapshot(), "agentkv_decisions", action="drop") == 1


def test_scrape_text_parses_and_carries_every_metric() -> None:
    rec = MetricsRecorder()
    rec.add(m.DECISIONS, action="offload_disk")
    rec.observe(m.OFFLOAD_BYTES, 3 * 2**20, tier="disk")
    rec.observe(m.PREFIX_HIT_RATIO, 0.97)
    gauges = [
        (m.BYTES_HELD, {"tier": "host"}, 4096.0),
        (m.PAUSED_TRAJECTORIES, {"state": "offloaded"}, 2.0),
        (m.TRAJECTORIES, {}, 3.0),
    ]
    fams = _scrape(lambda: rec.snapshot(gauges))
    for spec in m.METRICS:
        assert spec.name in fams, spec.name  # every metric is exported, even without events
        assert fams[spec.name].type == spec.kind
    [dec] = _samples(fams["agentkv_decisions"], "_total", action="offload_disk")
    assert dec.value == 1
    buckets = _samples(fams["agentkv_offload_bytes"], "_bucket", tier="disk")
    les = [s.labels["le"] for s in buckets]
    assert les[-1] == "+Inf" and len(les) == len(m.BYTE_BUCKETS) + 1
    values = [s.value for s in buckets]
    assert values == sorted(values) and values[-1] == 1  # cumulative
    assert (
        values[les.index(repr(float(1 << 20)))] == 0
        and values[les.index(repr(float(1 << 22)))] == 1
    )
    [count] = _samples(fams["agentkv_offload_bytes"], "_count", tier="disk")
    assert count.value == 1
    [held] = _samples(fams["agentkv_bytes_held"], tier="host")
    assert held.value == 4096
    [up] = fams["agentkv_engine_reachable"].samples
    assert up.value == 1


def test_scrape_survives_an_unreachable_engine() -> None:
    rec = MetricsRecorder()
    rec.add(m.DECISIONS, action="drop")
    calls = {"n": 0}

    def fetch() -> Any:
        calls["n"] += 1
        if calls["n"] > 1:
            raise TimeoutError("engine did not answer")
        return rec.snapshot()

    reg = CollectorRegistry()
    reg.register(SnapshotCollector(fetch))
    generate_latest(reg)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}
    [up] = fams["agentkv_engine_reachable"].samples
    assert up.value == 0
    # the last good numbers are still served, not dropped to zero
    [dec] = _samples(fams["agentkv_decisions"], "_total", action="drop")
    assert dec.value == 1


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "true"},
            False,
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318",
                "OTEL_METRICS_EXPORTER": "none",
                "OTEL_TRACES_EXPORTER": "none",
            },
            False,
        ),
    ],
)
def test_otel_configured_follows_the_standard_variables(
    env: dict[str, str], expected: bool
) -> None:
    assert otel_configured(env) is expected


def test_otel_export_is_none_unless_configured() -> None:
    assert OTelExport.from_env(lambda: [], env={}) is None


def test_otel_export_spans_and_metrics_in_memory() -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans_out, reader = InMemorySpanExporter(), InMemoryMetricReader()
    gauges = [(m.BYTES_HELD, {"tier": "disk"}, 8192.0)]
    exp = OTelExport.from_env(
        lambda: gauges,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
        span_exporter=spans_out,
        metric_reader=reader,
    )
    assert exp is not None
    rec = MetricsRecorder(exp)
    rec.add(m.DECISIONS, action="retain")
    rec.observe(m.RELOAD_SECONDS, 0.02, tier="host")
    exp.start_pause(("t1", "main"), {"agentkv.tool": "pytest", "agentkv.expected_wait_s": None})
    exp.start_pause(("t1", "main"), {"agentkv.tool": "pytest"})  # a second pause supersedes
    assert exp.end_pause(("t1", "main"), {"agentkv.outcome": "resumed"})
    assert not exp.end_pause(("t1", "main"), {})
    data = reader.get_metrics_data()
    points: dict[str, Any] = {}
    for rm in data.resource_metrics:
        assert rm.resource.attributes["service.name"] == "agentkv"
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                points[metric.name] = list(metric.data.data_points)
    assert points["agentkv.decisions"][0].value == 1
    assert dict(points["agentkv.decisions"][0].attributes) == {"action": "retain"}
    [hist] = points["agentkv.reload_seconds"]
    assert hist.count == 1 and list(hist.explicit_bounds) == list(m.TRANSFER_SECOND_BUCKETS)
    [held] = points["agentkv.bytes_held"]
    assert held.value == 8192 and dict(held.attributes) == {"tier": "disk"}
    exp.shutdown()  # flushes the batch span processor
    spans = spans_out.get_finished_spans()
    assert [s.attributes.get("agentkv.outcome") for s in spans] == ["superseded", "resumed"]
    assert all(s.name == "agentkv.tool_wait" for s in spans)
    assert "agentkv.expected_wait_s" not in spans[0].attributes  # None is left out


def test_the_demotions_counter_names_exactly_the_reasons_the_manager_counts() -> None:
    """Its help text and docs/metrics.md come from agentkv.demotion.COUNTED_REASONS, and every
    reason the manager labels the counter with (or demotes for) is one of them."""
    import re
    from pathlib import Path

    from agentkv.demotion import COUNTED_REASONS, DemotedBy

    root = Path(__file__).resolve().parents[2]
    doc_row = next(
        line
        for line in (root / "docs" / "metrics.md").read_text().splitlines()
        if "`agentkv_demotions_total`" in line
    )
    for reason in COUNTED_REASONS:
        assert reason.value in m.DEMOTIONS.help
        assert reason.value in doc_row
    used: set[str] = set()
    for path in (root / "agentkv" / "manager").glob("*.py"):
        text = path.read_text()
        used |= set(re.findall(r"DEMOTIONS, reason=DemotedBy\.(\w+)", text))
        used |= set(re.findall(r"\.demote\([^)]*?DemotedBy\.(\w+)", text, re.S))
    assert used, "the pattern no longer finds the manager's demotions: update this test"
    assert {DemotedBy[name] for name in used} <= set(COUNTED_REASONS)


def test_the_decisions_counter_names_every_action() -> None:
    """A new pause action needs no edit here: the help text is derived from agentkv.policy.Action."""
    from agentkv.policy import Action

    for action in Action:
        assert action.value in m.DECISIONS.help
