"""The phased plain-traffic overhead benchmark's statistics: ABBA order, ratio of medians,
the two-level bootstrap interval and its verdict."""

from __future__ import annotations

import json
import random

import pytest

from agentkv_bench.phased import (
    RatioCI,
    bootstrap_ratio,
    build_report,
    per_round_ratios,
    phase_order,
    ratio_of_medians,
    to_markdown,
)


def test_phase_order_is_counterbalanced() -> None:
    assert phase_order(3) == [
        (0, "vanilla"),
        (0, "agentkv"),
        (1, "agentkv"),
        (1, "vanilla"),
        (2, "vanilla"),
        (2, "agentkv"),
    ]


def test_ratio_of_medians() -> None:
    assert ratio_of_medians([1.0, 2.0, 3.0], [2.0, 4.0, 9.0]) == pytest.approx(2.0)
    assert ratio_of_medians([], [1.0]) is None
    assert ratio_of_medians([0.0], [1.0]) is None


def _phases(
    rng: random.Random, rounds: int, n: int, scale: float, drift: float
) -> list[list[float]]:
    # Each round sits at its own machine-state level (drift), requests jitter around it.
    return [
        [scale * (1 + drift * r) * rng.uniform(0.95, 1.05) for _ in range(n)] for r in range(rounds)
    ]


def test_bootstrap_interval_covers_a_known_ratio_and_shrinks_with_rounds() -> None:
    rng = random.Random(1)
    a = _phases(random.Random(2), 8, 30, 0.1, 0.05)
    b = [[x * 1.10 * rng.uniform(0.98, 1.02) for x in p] for p in a]
    ci = bootstrap_ratio(a, b, resamples=500, seed=3)
    assert ci.lo is not None and ci.hi is not None
    assert ci.lo <= 1.10 <= ci.hi
    assert ci.lo <= ci.ratio <= ci.hi  # type: ignore[operator]
    assert ci.verdict() == "over" and ci.rounds == 8 and ci.resamples == 500
    few = bootstrap_ratio(a[:2], b[:2], resamples=500, seed=3)
    assert few.hi - few.lo >= ci.hi - ci.lo  # type: ignore[operator]


def test_identical_configs_are_within_and_the_interval_is_seeded() -> None:
    a = _phases(random.Random(5), 6, 20, 0.1, 0.0)
    ci = bootstrap_ratio(a, a, resamples=300, seed=0)
    assert ci.ratio == pytest.approx(1.0)
    assert ci == bootstrap_ratio(a, a, resamples=300, seed=0)


def test_verdicts() -> None:
    assert RatioCI(1.0, 0.99, 1.005, 0.95, 10, 4).verdict() == "within"
    assert RatioCI(1.2, 1.1, 1.3, 0.95, 10, 4).verdict() == "over"
    assert RatioCI(1.0, 0.8, 1.3, 0.95, 10, 4).verdict() == "undecided"
    assert RatioCI(None, None, None, 0.95, 0, 0).verdict() == "not measured"


def test_empty_phase_gives_no_interval() -> None:
    ci = bootstrap_ratio([[0.1], []], [[0.1], [0.2]])
    assert ci.lo is None and ci.verdict() == "not measured"


def test_report_pairs_rounds_and_renders() -> None:
    phases = [
        {"round": 0, "config": "vanilla", "latencies_s": [0.10, 0.11, 0.12]},
        {"round": 0, "config": "agentkv", "latencies_s": [0.20, 0.22, 0.24]},
        {"round": 1, "config": "agentkv", "latencies_s": [0.11, 0.12, 0.13]},
        {"round": 1, "config": "vanilla", "latencies_s": [0.11, 0.12, 0.13]},
        {"round": 2, "config": "vanilla", "latencies_s": [0.5]},  # incomplete round: left out
    ]
    rep = build_report(
        command="agentkv bench overhead",
        machine={},
        options={"rounds": 3, "requests": 3},
        phases=phases,
        resamples=200,
    )
    json.dumps(rep)
    assert rep["per_round_ratio"] == pytest.approx([2.0, 1.0])
    assert rep["ratio"]["rounds"] == 2
    assert rep["vanilla"]["n"] == 6 and rep["agentkv"]["n"] == 6
    assert per_round_ratios([[1.0]], [[3.0]]) == [3.0]
    md = to_markdown(rep)
    assert "ratio of medians" in md and "Per round: 2.000, 1.000" in md


def test_profile_summary_counts_samples_with_an_agentkv_frame() -> None:
    from agentkv_bench.phased import profile_summary

    prof = {
        "shared": {
            "frames": [
                {"name": "step", "file": "/x/vllm/engine/core.py", "line": 1},
                {
                    "name": "build_connector_meta",
                    "file": "/x/plugins/agentkv_vllm/connector.py",
                    "line": 9,
                },
                {"name": "take_step", "file": "/x/agentkv/manager/core.py", "line": 5},
            ]
        },
        "profiles": [
            {"samples": [[0], [0, 1], [0, 1, 2], [0]], "weights": [1, 1, 2, 4]},
            {"samples": [[0, 2]]},  # no weights: 1 each
        ],
    }
    got = profile_summary(prof)
    assert got["samples"] == 9
    assert got["agentkv_share"] == pytest.approx(4 / 9)  # 1 + 2 + 1
    top = got["top_agentkv_frames"]
    assert [t["share"] for t in top] == pytest.approx([3 / 9, 3 / 9])
    assert {t["frame"].split(" ")[0] for t in top} == {"build_connector_meta", "take_step"}
    assert profile_summary({})["agentkv_share"] is None


def test_no_verdict_from_too_few_rounds_or_a_busy_machine() -> None:
    from agentkv_bench.phased import verdict

    ci = RatioCI(0.6, 0.35, 0.83, 0.95, 2000, 2)  # measured here on a loaded machine: noise
    assert verdict(ci, []).startswith("undecided: 2 rounds")
    ok = RatioCI(1.0, 0.99, 1.005, 0.95, 2000, 6)
    quiet = [{"other_cores_busy": 0.1}, {"other_cores_busy": None}]
    assert verdict(ok, quiet) == "within"
    busy = [*quiet, {"other_cores_busy": 1.75}]
    assert verdict(ok, busy).startswith("undecided: other processes kept up to 1.75 cores")
