"""Plugin part 3: per-turn prefix diagnostics, Prometheus on /metrics, OTLP export (real server)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentkv.metrics import METRICS
from tests.e2e.conftest import Server, lcp, long_text

pytestmark = pytest.mark.e2e


def _zoned(server: Server, tid: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """agentkv params declaring the system zone and the rest, in tokens of this prompt."""
    system_end = len(server.tokenize(messages[:1], gen=False))
    total = len(server.tokenize(messages))
    return {
        "agentkv": {
            "trajectory_id": tid,
            "zones": [
                {"name": "system", "start_token": 0, "end_token": system_end},
                {"name": "recent", "start_token": system_end, "end_token": total},
            ],
        }
    }


def _families(server: Server) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(server.metrics_text())}


def _value(fams: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    return sum(
        s.value
        for s in fams[family].samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_changed_system_zone_reports_divergence_token_and_zone(server: Server) -> None:
    tid = "diverge-3"
    words = long_text(910, 300).split()
    system = "You are a coding agent. " + " ".join(words)
    turn1 = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Task: " + long_text(911, 40)},
    ]
    server.chat(turn1, extra_params=_zoned(server, tid, turn1), max_tokens=4)
    turn2 = [*turn1, {"role": "user", "content": "Observation: " + long_text(912, 60)}]
    out2 = server.chat(turn2, extra_params=_zoned(server, tid, turn2), max_tokens=4)
    stats2 = out2["kv_transfer_params"]["agentkv"]
    assert stats2["turn"] == 2
    # Appending keeps the prefix: nothing diverges inside what turn 1 sent.
    assert stats2["first_divergence_token"] is None or stats2["first_divergence_token"] >= len(
        server.tokenize(turn1, gen=False)
    )

    # Turn 3 edits one word in the middle of the system prompt (say, a timestamp).
    words[150] = "EDITED"
    turn3 = [
        {"role": "system", "content": "You are a coding agent. " + " ".join(words)},
        *turn2[1:],
    ]
    expected = lcp(server.tokenize(turn2), server.tokenize(turn3))
    system_end = len(server.tokenize(turn3[:1], gen=False))
    assert 0 < expected < system_end
    before = _value(
        _families(server),
        "agentkv_prefix_divergences",
        "agentkv_prefix_divergences_total",
        zone="system",
    )
    out3 = server.chat(turn3, extra_params=_zoned(server, tid, turn3), max_tokens=4)
    stats3 = out3["kv_transfer_params"]["agentkv"]
    assert stats3["turn"] == 3
    assert stats3["first_divergence_token"] == expected
    assert stats3["divergence_zone"] == "system"
    # Only the tokens before the edit can come from any cache.
    assert stats3["hit_tokens"] <= expected

    view = server.trajectory(tid)
    assert view["turns"][2]["first_divergence_token"] == expected
    assert view["turns"][2]["divergence_zone"] == "system"
    assert 0 < view["prefix_hit_ratio"] < 1
    after = _value(
        _families(server),
        "agentkv_prefix_divergences",
        "agentkv_prefix_divergences_total",
        zone="system",
    )
    assert after == before + 1
    server.end(tid)


def _offload_and_reload(server: Server, tid: str, tool: str, seed: int) -> None:
    first = [
        {"role": "system", "content": "You are a coding agent. " + long_text(seed, 400)},
        {"role": "user", "content": "Run the tests."},
    ]
    server.chat(first, trajectory=tid)
    server.pause(tid, tool, 2.0)
    server.wait_state(tid, {"offloaded"})
    server.reset_prefix_cache()
    second = [*first, {"role": "user", "content": "Observation: " + long_text(seed + 1, 50)}]
    out = server.chat(second, trajectory=tid)
    assert out["kv_transfer_params"]["agentkv"]["tier"] == "host"


def test_metrics_endpoint_carries_every_agentkv_metric(server: Server) -> None:
    tid = "metrics-prom"
    _offload_and_reload(server, tid, "pytest-metrics", 920)
    fams = _families(server)
    for spec in METRICS:
        assert spec.name in fams, f"{spec.name} missing from /metrics"
        assert fams[spec.name].type == spec.kind
    assert _value(fams, "agentkv_engine_reachable", "agentkv_engine_reachable") == 1
    assert _value(fams, "agentkv_decisions", "agentkv_decisions_total", action="offload_host") >= 1
    for family in ("agentkv_offload_bytes", "agentkv_reload_bytes", "agentkv_reload_seconds"):
        assert _value(fams, family, family + "_count", tier="host") >= 1, family
        assert _value(fams, family, family + "_sum", tier="host") > 0, family
    assert (
        _value(
            fams,
            "agentkv_tool_wait_observed_seconds",
            "agentkv_tool_wait_observed_seconds_count",
            tool="pytest-metrics",
        )
        >= 1
    )
    assert (
        _value(
            fams,
            "agentkv_tool_wait_predicted_seconds",
            "agentkv_tool_wait_predicted_seconds_count",
            tool="pytest-metrics",
        )
        >= 1
    )
    assert _value(fams, "agentkv_prefix_hit_ratio", "agentkv_prefix_hit_ratio_count") >= 2
    assert _value(fams, "agentkv_cached_tokens", "agentkv_cached_tokens_total", source="host") > 0
    assert _value(fams, "agentkv_prompt_tokens", "agentkv_prompt_tokens_total") > 0
    tiers = {s.labels["tier"] for s in fams["agentkv_bytes_held"].samples}
    assert tiers == {"device_pinned", "host", "disk"}
    states = {s.labels["state"] for s in fams["agentkv_paused_trajectories"].samples}
    assert {"retained", "offloaded", "dropped"} <= states
    # The dashboard also reads vLLM's own cache metrics from the same endpoint.
    assert "vllm:kv_cache_usage_perc" in fams
    server.end(tid)


def test_otlp_receiver_gets_metrics_and_a_span_per_pause(server: Server) -> None:
    tid = "metrics-otlp"
    _offload_and_reload(server, tid, "pytest-otlp", 930)
    deadline = time.monotonic() + 30
    span: dict[str, Any] | None = None
    metric_names: set[str] = set()
    while time.monotonic() < deadline and (span is None or "agentkv.decisions" not in metric_names):
        for body in server.otlp_records("traces"):
            for rs in body.get("resourceSpans", []):
                resource = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
                for ss in rs.get("scopeSpans", []):
                    for s in ss.get("spans", []):
                        attrs = {a["key"]: a["value"] for a in s.get("attributes", [])}
                        if attrs.get("agentkv.trajectory_id", {}).get("stringValue") == tid:
                            span = {"span": s, "attrs": attrs, "resource": resource}
        for body in server.otlp_records("metrics"):
            for rm in body.get("resourceMetrics", []):
                for sm in rm.get("scopeMetrics", []):
                    metric_names.update(mm["name"] for mm in sm.get("metrics", []))
        time.sleep(0.5)
    assert span is not None, "no agentkv.tool_wait span reached the OTLP receiver"
    assert span["span"]["name"] == "agentkv.tool_wait"
    assert span["resource"]["service.name"]["stringValue"] == "agentkv-e2e"
    attrs = span["attrs"]
    assert attrs["agentkv.tool"]["stringValue"] == "pytest-otlp"
    assert attrs["agentkv.action"]["stringValue"] == "offload_host"
    assert attrs["agentkv.outcome"]["stringValue"] == "resumed"
    assert attrs["agentkv.resumed_tier"]["stringValue"] == "host"
    observed = attrs["agentkv.observed_wait_s"]["doubleValue"]
    duration_s = (
        int(span["span"]["endTimeUnixNano"]) - int(span["span"]["startTimeUnixNano"])
    ) / 1e9
    assert observed > 0 and abs(duration_s - observed) < 1.0
    assert {"agentkv.decisions", "agentkv.bytes_held", "agentkv.offload_bytes"} <= metric_names
    server.end(tid)
