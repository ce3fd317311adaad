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
        96: {"vanilla": _s(0.1, 80), "agentkv": _s(0.1, 80, wb=12)},
        24: {"vanilla": _s(1.0, 50), "agentkv": _s(0.6, 55, wb=40)},
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
    pools = {48: {"vanilla": _s(0.1, 80), "agentkv": _s(0.104, 60)}}
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
