"""The sweep report: regret against the best fixed policy, targets, markdown."""

from __future__ import annotations

import json

import pytest

from agentkv_bench.sweep import (
    TARGET_METRICS,
    build_sweep,
    regret,
    sweep_markdown,
    targets,
    worse_ratio,
)


def _s(ttft: float, decode: float, jct: float = 10.0, wb: int | None = None) -> dict:
    return {
        "resume_ttft_p50_s": ttft,
        "resume_ttft_p99_s": ttft * 2,
        "jct_mean_s": jct,
        "decode_tok_s": decode,
        "recomputed_tokens": 1000,
        "writeback_blocks": wb,
    }


def test_worse_ratio_follows_the_metric_direction() -> None:
    assert worse_ratio(1.2, 1.0, higher_is_better=False) == pytest.approx(1.2)
    assert worse_ratio(80.0, 100.0, higher_is_better=True) == pytest.approx(1.25)
    assert worse_ratio(0, 0, higher_is_better=False) == 1.0
    assert worse_ratio(5, 0, higher_is_better=False) is None
    assert worse_ratio(None, 1.0, higher_is_better=False) is None


def test_regret_picks_the_best_fixed_policy_per_metric() -> None:
    pool = {
        "vanilla": _s(0.10, 82.0),
        "agentkv": _s(0.15, 62.0),
        "retain-always": _s(0.12, 90.0),
        "offload-always": _s(0.30, 60.0),
        "oracle": _s(0.01, 200.0),  # a bound, never the "best fixed policy"
    }
    ttft = regret(pool, "resume_ttft_p50_s")
    assert ttft is not None
    assert ttft.best_fixed == "vanilla" and ttft.best_value == 0.10
    assert ttft.over_best_fixed == pytest.approx(1.5)
    assert ttft.regret_pct == pytest.approx(50.0)
    dec = regret(pool, "decode_tok_s")
    assert dec is not None and dec.best_fixed == "retain-always"
    assert dec.over_best_fixed == pytest.approx(90.0 / 62.0)
    # writebacks missing everywhere: no regret rather than a made-up one
    assert regret(pool, "writeback_blocks") is None


def test_regret_below_one_when_agentkv_beats_every_fixed_policy() -> None:
    pool = {"vanilla": _s(1.0, 50.0), "agentkv": _s(0.5, 60.0)}
    r = regret(pool, "resume_ttft_p50_s")
    assert r is not None and r.over_best_fixed == pytest.approx(0.5) and r.regret_pct == -50.0
    assert regret({"vanilla": _s(1, 1)}, "resume_ttft_p50_s") is None


def test_targets_against_vanilla_and_the_best_of_the_two_fixed_actions() -> None:
    pool = {
        "vanilla": _s(0.10, 82.0),
        "agentkv": _s(0.104, 62.0),
        "retain-always": _s(0.2, 61.0),
        "offload-always": _s(0.09, 100.0),
    }
    got = {(t.metric, t.against): t for t in targets(96, pool)}
    assert len(got) == 2 * len(TARGET_METRICS)
    assert got[("resume_ttft_p50_s", "vanilla")].met is True  # 1.04 <= 1.05
    assert got[("decode_tok_s", "vanilla")].met is False  # 82/62
    two = got[("resume_ttft_p50_s", "best of retain-always / offload-always")]
    assert two.ratio == pytest.approx(0.104 / 0.09) and two.met is False
    # without the fixed-action servers the second target is "not measured", not met
    only = {
        (t.metric, t.against): t for t in targets(96, {"vanilla": _s(1, 1), "agentkv": _s(1, 1)})
    }
    assert only[("jct_mean_s", "best of retain-always / offload-always")].met is None


def test_build_sweep_is_json_and_renders_every_pool() -> None:
    pools = {
        96: [{"vanilla": _s(0.1, 80), "agentkv": _s(0.1, 80, wb=12)}],
        24: [{"vanilla": _s(1.0, 50), "agentkv": _s(0.6, 55, wb=40)}],
    }
    rep = build_sweep(
        kind="synthetic",
        command="agentkv bench agents --configs vanilla,agentkv --num-blocks 96,24",
        machine={"cpus": 2},
        configs=["vanilla", "agentkv", "oracle"],
        pools=pools,
        oracle=_s(0.05, 90),
        bounds={24: {"resume_ttft_p50_s": 0.3}},
        conditions="shared machine",
    )
    json.dumps(rep)
    assert [p["num_blocks"] for p in rep["pools"]] == [96, 24]
    assert rep["fixed_policies"] == ["vanilla"]
    p24 = rep["pools"][1]
    assert p24["regret"]["resume_ttft_p50_s"]["over_best_fixed"] == pytest.approx(0.6)
    assert p24["capacity_equal_bound"] == {"resume_ttft_p50_s": 0.3}
    md = sweep_markdown(rep)
    assert "## 96 device blocks" in md and "## 24 device blocks" in md
    assert "capacity-equal bound" in md and "shared machine" in md
    assert "| resume TTFT p50 (s) | 1.000 | 0.600 | 0.300 | 0.050 | 0.600 | vanilla |" in md


def test_markdown_targets_table_says_met_not_met_and_not_measured() -> None:
    pools = {48: [{"vanilla": _s(0.1, 80), "agentkv": _s(0.104, 60)}]}
    md = sweep_markdown(
        build_sweep(
            kind="k",
            command="c",
            machine={},
            configs=["vanilla", "agentkv"],
            pools=pools,
            oracle=None,
        )
    )
    assert "| resume TTFT p50 | 1.040 met | not measured |" in md
    assert "| decode throughput per sequence | 1.333 NOT met | not measured |" in md


def test_one_repeat_report_has_no_repeat_fields() -> None:
    rep = build_sweep(
        kind="k",
        command="c",
        machine={},
        configs=["vanilla", "agentkv"],
        pools={48: [{"vanilla": _s(0.1, 80), "agentkv": _s(0.2, 80)}]},
        oracle=None,
        reports={48: "out/pool-48"},
    )
    assert "repeats" not in rep and "aggregate" not in rep and "repeats" not in rep["pools"][0]
    md = sweep_markdown(rep)
    assert "| resume TTFT p50 (s) | 0.100 | 0.200 | 2.000 | vanilla |" in md
    assert "per repeat" not in md and "Full report of this pool: `out/pool-48`" in md


def _three_repeats() -> dict:
    # Per-repeat agentkv / vanilla on resume TTFT p50: 1.3, 0.367, 1.333; the ratio of the
    # medians (0.13 / 0.12) is 1.083, the ratio of the means 0.769, the median ratio 1.3.
    vanilla = [_s(0.10, 80.0), _s(0.30, 40.0), _s(0.12, 90.0)]
    agentkv = [_s(0.13, 60.0, wb=4), _s(0.11, 70.0, wb=6), _s(0.16, 100.0, wb=None)]
    return build_sweep(
        kind="k",
        command="c --repeats 3",
        machine={},
        configs=["vanilla", "agentkv"],
        pools={48: [{"vanilla": v, "agentkv": a} for v, a in zip(vanilla, agentkv, strict=True)]},
        oracle=None,
        reports={48: "out/pool-48"},
        orders={48: [("vanilla", "agentkv"), ("agentkv", "vanilla"), ("vanilla", "agentkv")]},
    )


def test_repeats_cells_are_medians_and_regret_and_targets_read_them() -> None:
    rep = _three_repeats()
    json.dumps(rep)
    assert rep["repeats"] == 3 and rep["aggregate"] == "median of 3 repeats"
    (sec,) = rep["pools"]
    assert sec["metrics"]["vanilla"]["resume_ttft_p50_s"] == pytest.approx(0.12)
    assert sec["metrics"]["agentkv"]["resume_ttft_p50_s"] == pytest.approx(0.13)
    assert sec["metrics"]["agentkv"]["writeback_blocks"] == pytest.approx(5.0)
    assert sec["repeats"]["values"]["vanilla"]["resume_ttft_p50_s"] == [0.10, 0.30, 0.12]
    assert sec["repeats"]["values"]["agentkv"]["writeback_blocks"] == [4, 6, None]
    assert sec["repeats"]["order"][1] == ["agentkv", "vanilla"]
    assert sec["regret"]["resume_ttft_p50_s"]["over_best_fixed"] == pytest.approx(0.13 / 0.12)
    # decode: vanilla median 80, agentkv median 70 -> 80 / 70 in the worse direction
    assert sec["regret"]["decode_tok_s"]["over_best_fixed"] == pytest.approx(80 / 70)
    got = {(t["metric"], t["against"]): t for t in sec["targets"]}
    assert got[("resume_ttft_p50_s", "vanilla")]["ratio"] == pytest.approx(0.13 / 0.12)
    assert got[("resume_ttft_p50_s", "vanilla")]["met"] is False
    ratios = sec["repeats"]["agentkv_over_vanilla"]
    assert ratios["resume_ttft_p50_s"] == pytest.approx([1.3, 0.11 / 0.30, 0.16 / 0.12])
    assert ratios["decode_tok_s"] == pytest.approx([80 / 60, 40 / 70, 0.9])  # worse direction
    assert list(ratios) == list(TARGET_METRICS)


def test_repeats_markdown_shows_median_min_max_and_agentkv_over_vanilla_per_repeat() -> None:
    md = sweep_markdown(_three_repeats())
    assert "median of 3 repeats" in md and "ABBA" in md
    assert "| resume TTFT p50 (s) | 0.120 (0.100-0.300) | 0.130 (0.110-0.160) | 1.083 |" in md
    # a metric one repeat lacked says how many repeats had it
    assert "| blocks written back (blocks) | - | 5 (4-6, 2 of 3) |" in md
    assert (
        "| agentkv / vanilla per repeat (> 1: agentkv worse) | rep 1 (vanilla, agentkv) "
        "| rep 2 (agentkv, vanilla) | rep 3 (vanilla, agentkv) |"
    ) in md
    assert "| resume TTFT p50 | 1.300 | 0.367 | 1.333 |" in md
    assert "| decode throughput per sequence | 1.333 | 0.571 | 0.900 |" in md
    assert "| resume TTFT p50 | 1.083 NOT met | not measured |" in md
    assert "one per repeat: `out/pool-48/rep-*`" in md


def test_repeats_even_count_takes_the_mean_of_the_middle_two() -> None:
    rep = build_sweep(
        kind="k",
        command="c",
        machine={},
        configs=["vanilla", "agentkv"],
        pools={
            24: [
                {"vanilla": _s(0.2, 50.0), "agentkv": _s(0.1, 60.0)},
                {"vanilla": _s(0.4, 70.0), "agentkv": {"resume_ttft_p50_s": None}},
            ]
        },
        oracle=None,
    )
    (sec,) = rep["pools"]
    assert rep["aggregate"] == "median of 2 repeats"
    assert sec["metrics"]["vanilla"]["resume_ttft_p50_s"] == pytest.approx(0.3)
    assert sec["metrics"]["vanilla"]["decode_tok_s"] == pytest.approx(60.0)
    # agentkv's second repeat had no values: the median is the first's, not half of it
    assert sec["metrics"]["agentkv"]["resume_ttft_p50_s"] == pytest.approx(0.1)
    assert sec["regret"]["resume_ttft_p50_s"]["over_best_fixed"] == pytest.approx(0.1 / 0.3)
    assert sec["repeats"]["agentkv_over_vanilla"]["resume_ttft_p50_s"] == [
        pytest.approx(0.5),
        None,
    ]
    assert "| 0.100 (0.100-0.100, 1 of 2) |" in sweep_markdown(rep)
