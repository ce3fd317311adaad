"""agentkv_bench.scale_report: the report math of ``agentkv bench scale`` (pure, recorded
inputs), and scale.py's pure helpers (settled, CpuMeter.cores)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentkv_bench import scale_report
from agentkv_bench.scale import CpuMeter, settled
from agentkv_bench.scale_report import (
    bracketed,
    build_report,
    latency_stats,
    phase_summary,
    pooled,
    ratios,
    step_us,
    targets,
    to_markdown,
)


def probe(steps_calls: int, steps_cpu: float, engine_steps: float | None) -> dict[str, Any]:
    return {
        "connector_cpu": {
            "step": {"calls": steps_calls, "cpu_s": steps_cpu},
            "request": {"calls": 0, "cpu_s": 0.0},
        },
        "engine_steps": engine_steps,
    }


def phase(
    kind: str, r: int, ms: list[float], step_cpu_s: float, steps: float = 160.0
) -> dict[str, Any]:
    """A phase whose connector spent ``step_cpu_s`` over ``steps`` engine steps."""
    status = {
        "trajectories": 2000 if kind == "held" else 0,
        "branches_by_state": {"offloaded": 2000 if kind == "held" else 0, "active": 0},
        "tiers": {"host": {"blocks": 2000 if kind == "held" else 0, "bytes": 0}},
    }
    return phase_summary(
        kind,
        r,
        [x / 1000 for x in ms],
        probe(1000, 1.0, 500.0),
        probe(1000 + int(steps), 1.0 + step_cpu_s, 500.0 + steps),
        wall_s=sum(ms) / 1000,
        status=status,
        background_cores=0.1,
    )


def test_latency_stats_in_ms() -> None:
    s = latency_stats([0.1, 0.2, 0.3, 0.4, 0.5])
    assert s["p50_ms"] == pytest.approx(300.0)
    assert s["p90_ms"] == pytest.approx(460.0)
    assert s["mean_ms"] == pytest.approx(300.0) and s["min_ms"] == pytest.approx(100.0)
    assert latency_stats([])["p50_ms"] is None


def test_phase_summary_takes_the_connector_cpu_delta() -> None:
    p = phase("held", 0, [100.0, 110.0, 120.0], step_cpu_s=0.0016)
    assert p["p50_ms"] == pytest.approx(110.0)
    assert p["connector_cpu"]["engine_steps"] == 160
    assert p["connector_cpu"]["step_us_per_engine_step"] == pytest.approx(10.0)
    assert step_us(p) == pytest.approx(10.0)
    assert p["trajectories"] == 2000 and p["host_blocks"] == 2000
    assert p["branches_by_state"] == {"offloaded": 2000}  # zero counts dropped
    assert p["latencies_ms"] == [100.0, 110.0, 120.0]


def test_step_us_falls_back_to_hook_calls() -> None:
    p = phase_summary("none", 0, [0.1], probe(0, 0.0, None), probe(100, 0.001, None), 0.1)
    assert p["connector_cpu"]["engine_steps"] is None
    assert step_us(p) == pytest.approx(10.0)  # 1 ms / 100 calls


def sequence() -> list[dict[str, Any]]:
    # Latency drifts up over the run (100 -> 120 -> 140 ms without trajectories); each held
    # phase is 5% above the mean of its neighbours, and its CPU per step 2% above.
    return [
        phase("none", 0, [100.0] * 3, 0.0016),
        phase("held", 0, [115.5] * 3, 0.001632),
        phase("deleted", 0, [120.0] * 3, 0.0016),
        phase("held", 1, [136.5] * 3, 0.001632),
        phase("deleted", 1, [140.0] * 3, 0.0016),
    ]


def test_bracketed_ratios_cancel_drift() -> None:
    rounds = bracketed(sequence())
    assert [r["round"] for r in rounds] == [0, 1]
    assert rounds[0]["base_p50_ms"] == pytest.approx(110.0)
    assert rounds[0]["p50_latency"] == pytest.approx(1.05)
    assert rounds[1]["p50_latency"] == pytest.approx(1.05)
    assert rounds[0]["step_cpu"] == pytest.approx(1.02)


def test_bracketed_with_a_single_neighbour() -> None:
    seq = sequence()[:2]  # none, held: no phase after
    [r] = bracketed(seq)
    assert r["base_p50_ms"] == pytest.approx(100.0)
    assert r["p50_latency"] == pytest.approx(1.155)


def test_pooled_and_ratios() -> None:
    seq = sequence()
    held = pooled(seq, "held")
    assert held is not None
    assert held["phases"] == 2 and held["requests"] == 6
    assert held["p50_ms"] == pytest.approx(126.0)
    assert held["engine_steps"] == 320
    assert held["step_us"] == pytest.approx(10.2)
    assert pooled(seq, "nothing") is None
    r = ratios(seq)
    assert r["held/none"]["p50_latency"] == pytest.approx(1.05)
    assert r["held/none"]["step_cpu"] == pytest.approx(1.02)
    assert len(r["held/none"]["rounds"]) == 2
    # Pooled: drift leaks in (held sits in the later, slower part of the run).
    assert r["held/none pooled"]["p50_latency"] == pytest.approx(126.0 / 120.0)
    # Drift control: after deleting vs the fresh server.
    assert r["deleted/none"]["p50_latency"] == pytest.approx(1.3)
    assert r["deleted/none"]["step_cpu"] == pytest.approx(1.0)


def test_targets_within_five_percent() -> None:
    t = targets(ratios(sequence()))
    assert [x["met"] for x in t] == [True, True]
    slow = targets({"held/none": {"p50_latency": 1.06, "step_cpu": None}})
    assert [x["met"] for x in slow] == [False, None]


def test_report_json_and_markdown() -> None:
    r = build_report(
        command="agentkv bench scale --idle 2000",
        machine={"cpus": 2},
        server={"preset": "tiny", "num_blocks": 256, "host_capacity_gib": 2.0},
        options={"idle": 2000, "requests": 3, "rounds": 2, "prompt_tokens": 200},
        idle=[{"round": 0, "created": 2000, "create_s": 40.0, "settle_s": 1.0, "delete_s": 5.0}],
        phases=sequence(),
    )
    r = json.loads(json.dumps(r))
    assert r["schema"] == scale_report.SCHEMA
    assert set(r["summary"]) == {"none", "held", "deleted"}
    assert [t["met"] for t in r["targets"]] == [True, True]
    md = to_markdown(r)
    assert "| | no trajectories (fresh server) | 2000 idle trajectories held |" in md
    assert "| plain request latency p50 (ms) | 100.0 | 126.0 | 130.0 |" in md
    assert "| connector CPU per engine step (µs) | 10.00 | 10.20 | 10.00 |" in md
    assert "| 0 | 110.0 | 115.5 | 1.050 | 10.00 | 10.20 | 1.020 |" in md
    assert "| held/none (median of rounds) | 1.050 |" in md
    assert "| plain request p50 latency, held / none | <= 1.05 | 1.050 | yes |" in md
    assert "`agentkv bench scale --idle 2000`" in md


def test_settled_waits_for_grace_and_jobs() -> None:
    st = {
        "trajectories": 2,
        "branches_by_state": {"offloaded": 2, "held": 0},
        "tiers": {"in_flight_jobs": 0},
    }
    assert settled(st, 2)
    assert not settled({**st, "trajectories": 1}, 2)
    assert not settled({**st, "branches_by_state": {"offloaded": 1, "held": 1}}, 2)
    assert not settled({**st, "tiers": {"in_flight_jobs": 1}}, 2)
    assert settled({"trajectories": 0, "branches_by_state": {}, "tiers": {}}, 0)


def test_cpu_meter_cores() -> None:
    # machine busy 3 s, server 1.5 s, bench 0.5 s over 2 s of wall: others used 0.5 cores.
    assert CpuMeter.cores((10.0, 5.0, 1.0), (13.0, 6.5, 1.5), 2.0) == pytest.approx(0.5)
    assert CpuMeter.cores(None, (1.0, 1.0, 1.0), 2.0) is None
    assert CpuMeter.cores((0.0, 0.0, 0.0), (1.0, 2.0, 0.0), 1.0) == 0.0  # never negative
