"""agentkv_bench.connector_cpu and its use in the overhead comparison and the agents report:
deltas of the connector's CPU clocks between two recorded status bodies, per-call figures."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkv_bench import connector_cpu as cc
from agentkv_bench import overhead
from agentkv_bench.overhead import OverheadSpec, compare, run_interleaved
from agentkv_bench.report import connector_cpu_section, cpu_markdown

# Status bodies as GET /agentkv/v1/status returns them (abridged to what the bench reads).
STATUS_BEFORE: dict[str, Any] = {
    "pool": {"usage": 0.01},
    "trajectories": 0,
    "connector_cpu": {
        "request": {"calls": 12, "cpu_s": 0.0031},
        "step": {"calls": 1000, "cpu_s": 0.0125},
    },
}
STATUS_AFTER: dict[str, Any] = {
    "pool": {"usage": 0.02},
    "trajectories": 3,
    "connector_cpu": {
        "request": {"calls": 42, "cpu_s": 0.0121},
        "step": {"calls": 3000, "cpu_s": 0.0285},
    },
}
METRICS = "\n".join(
    [
        "# TYPE vllm:iteration_tokens_total histogram",
        'vllm:iteration_tokens_total_bucket{engine="0",le="1.0"} 10.0',
        'vllm:iteration_tokens_total_count{engine="0",model_name="tiny"} 1900.0',
        'vllm:iteration_tokens_total_sum{engine="0",model_name="tiny"} 5000.0',
    ]
)


def test_reading_fills_missing_kinds_and_rejects_garbage() -> None:
    assert cc.reading(STATUS_BEFORE) == {
        "request": {"calls": 12, "cpu_s": 0.0031},
        "step": {"calls": 1000, "cpu_s": 0.0125},
    }
    only_step = {"connector_cpu": {"step": {"calls": 5, "cpu_s": 0.001}}}
    assert cc.reading(only_step) == {
        "step": {"calls": 5, "cpu_s": 0.001},
        "request": {"calls": 0, "cpu_s": 0.0},
    }
    assert cc.reading({}) is None
    assert cc.reading(None) is None
    assert cc.reading({"connector_cpu": "n/a"}) is None
    assert cc.reading({"connector_cpu": {"step": {"calls": "x", "cpu_s": 1}}}) is None


def test_delta_and_per_call_figures() -> None:
    d = cc.delta(cc.reading(STATUS_BEFORE), cc.reading(STATUS_AFTER))
    assert d is not None
    assert d["step"]["calls"] == 2000 and d["step"]["cpu_s"] == pytest.approx(0.016)
    assert d["request"]["calls"] == 30 and d["request"]["cpu_s"] == pytest.approx(0.009)
    f = cc.figures(d, wall_s=4.0, requests=3, engine_steps=1900)
    assert f["status"] == "ok"
    assert f["step_us_per_call"] == pytest.approx(8.0)  # 16 ms / 2000 calls
    assert f["step_us_per_engine_step"] == pytest.approx(16e3 / 1900)
    assert f["request_us_per_call"] == pytest.approx(300.0)  # 9 ms / 30 hook calls
    assert f["request_us_per_request"] == pytest.approx(3000.0)  # 9 ms / 3 requests
    assert f["step_share_pct"] == pytest.approx(0.4)  # 16 ms of 4 s
    assert f["share_pct"] == pytest.approx(0.625)  # (16 + 9) ms of 4 s


def test_figures_without_denominators_are_none_not_zero() -> None:
    zero = {"step": {"calls": 0, "cpu_s": 0.0}, "request": {"calls": 0, "cpu_s": 0.0}}
    f = cc.figures(zero, wall_s=None, requests=0, engine_steps=None)
    assert f["step_us_per_call"] is None and f["request_us_per_request"] is None
    assert f["step_share_pct"] is None and f["engine_steps"] is None
    assert cc.figures(None) == {"status": "unavailable"}


def test_a_restarted_engine_gives_no_delta() -> None:
    assert cc.delta(cc.reading(STATUS_AFTER), cc.reading(STATUS_BEFORE)) is None
    assert cc.delta(None, cc.reading(STATUS_AFTER)) is None


def test_add_sums_deltas() -> None:
    d = cc.delta(cc.reading(STATUS_BEFORE), cc.reading(STATUS_AFTER))
    total = cc.add(cc.add(None, d), d)
    assert total is not None
    assert total["step"]["calls"] == 4000 and total["step"]["cpu_s"] == pytest.approx(0.032)
    assert cc.add(d, None) == d


def test_engine_steps_from_metrics_and_probe_delta() -> None:
    assert cc.engine_steps(METRICS) == 1900.0
    assert cc.engine_steps("vllm:other 1") is None
    before = {"connector_cpu": cc.reading(STATUS_BEFORE), "engine_steps": 100.0}
    after = {"connector_cpu": cc.reading(STATUS_AFTER), "engine_steps": 2100.0}
    d, steps = cc.probe_delta(before, after)
    assert steps == 2000.0 and d is not None and d["step"]["calls"] == 2000
    assert cc.probe_delta(before, None) == (None, None)
    assert cc.probe_delta(before, {**after, "engine_steps": None})[1] is None


def test_overhead_records_the_connector_cpu_of_probed_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def fake(spec: Any, base_url: str, model: str, tok: str, out: Path, name: str) -> dict:
        return {"output_throughput": 100.0, "duration": 5.0}

    monkeypatch.setattr(overhead, "run_bench_serve", fake)
    readings = iter(
        [
            {"connector_cpu": cc.reading(STATUS_BEFORE), "engine_steps": 0.0},
            {"connector_cpu": cc.reading(STATUS_AFTER), "engine_steps": 2000.0},
        ]
        * 2
    )

    @contextlib.contextmanager
    def open_server(name: str) -> Iterator[tuple[str, str, Any]]:
        yield f"http://{name}", "m", (lambda: next(readings)) if name == "agentkv" else None

    runs = run_interleaved(
        OverheadSpec(repeats=2), open_server, ("vanilla", "agentkv"), "tok", tmp_path
    )
    assert all("connector_cpu_delta" not in r for r in runs["vanilla"])
    assert [r["engine_steps"] for r in runs["agentkv"]] == [2000.0, 2000.0]
    out = compare(runs, OverheadSpec(repeats=2))
    cpu = out["connector_cpu"]
    assert cpu["runs"] == 2 and cpu["engine_steps"] == 4000
    assert cpu["step_us_per_engine_step"] == pytest.approx(8.0)  # 32 ms / 4000 steps
    assert cpu["wall_s"] == 10.0 and cpu["step_share_pct"] == pytest.approx(0.32)


def test_overhead_without_probes_says_unavailable() -> None:
    runs = {"vanilla": [{"output_throughput": 1.0}], "agentkv": [{"output_throughput": 1.0}]}
    assert compare(runs, OverheadSpec())["connector_cpu"] == {"status": "unavailable"}


def test_report_section_and_markdown() -> None:
    d = cc.delta(cc.reading(STATUS_BEFORE), cc.reading(STATUS_AFTER))
    plain = cc.figures(
        {"step": d["step"], "request": {"calls": 0, "cpu_s": 0.0}} if d else None,
        wall_s=8.0,
        requests=0,
        engine_steps=2000,
    )
    agent = cc.figures(d, wall_s=4.0, requests=3, engine_steps=1900)
    section = connector_cpu_section(
        {"agentkv": {"connector_cpu": agent}, "vanilla": {}},
        {"status": "ok", "connector_cpu": plain},
    )
    assert section["target"]["measured"] == pytest.approx(0.2)  # 16 ms of 8 s
    assert section["target"]["met"] is True
    md = "\n".join(cpu_markdown(section))
    assert (
        "| plain traffic (`vllm bench serve`, all repeats) | 2000 | 8.0 | 8.0 | 0 | - | 0.200% |"
        in md
    )
    assert "| agent workload | 1900 | 8.4 | 8.0 | 3 | 3000.0 | 0.625% |" in md
    assert "measured 0.200%: met." in md
    skipped = connector_cpu_section({}, {"status": "skipped"})
    assert skipped["plain_traffic"] == {"status": "not run"}
    assert skipped["target"]["met"] is None
    assert "| agent workload | unavailable |" in "\n".join(cpu_markdown(skipped))
