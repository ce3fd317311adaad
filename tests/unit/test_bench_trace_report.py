"""Trace report: summaries, oracle ratios, the stall decomposition, engine counters, markdown,
plots, and the replay's matching of the server's per-turn stats."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from agentkv_bench.copy_baseline import CopyBaseline, MemcpyTimer, memcpy_seconds
from agentkv_bench.plots import write_trace_plots
from agentkv_bench.sampler import Sample
from agentkv_bench.stall_report import (
    decompose,
    reload_phase_section,
    stall_section,
    tier_rates,
)
from agentkv_bench.trace_replay import RoundRecord, SessionRecord, _attach_engine_stats
from agentkv_bench.trace_report import (
    build_report,
    device_hit,
    parse_prom,
    prom_delta,
    ratios,
    summarize,
    to_markdown,
    vllm_phases,
)

BLOCK = 128
BLOCK_BYTES = 262144  # the tiny model: 2 KiB per token


def _round(
    i: int,
    ttft: float,
    cached: int,
    *,
    prompt: int = 1000,
    reusable: int = 640,
    tier_hit: int | None = None,
    tier: str | None = None,
    decision: str | None = None,
    tid: str = "t0",
) -> RoundRecord:
    return RoundRecord(
        session_id=tid,
        trajectory_id=tid,
        round=i,
        kind="resume" if i else "first",
        wait_before_s=0.1 if i else 0.0,
        sent_at_s=float(i),
        ttft_s=ttft,
        latency_s=ttft + 0.5,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=8,
        planned_prefix=reusable + 50 if i else 0,
        reusable_tokens=reusable if i else 0,
        decision=decision,
        tier_hit_tokens=tier_hit,
        tier=tier,
    )


def _session(rounds: list[RoundRecord], jct: float) -> SessionRecord:
    return SessionRecord(rounds[0].session_id, rounds[0].trajectory_id, 0.0, jct, rounds)


def test_device_hit_needs_every_whole_block_of_the_cacheable_history() -> None:
    assert device_hit(_round(1, 0.1, cached=640, reusable=700), BLOCK)  # 5 whole blocks
    assert not device_hit(_round(1, 0.1, cached=512, reusable=700), BLOCK)
    assert device_hit(_round(1, 0.1, cached=0, reusable=100), BLOCK)  # nothing whole to hold


def test_summaries_and_ratios_against_vanilla_and_oracle() -> None:
    van = [_session([_round(0, 0.2, 0), _round(1, 0.8, 0), _round(2, 1.2, 128)], 4.0)]
    akv = [
        _session(
            [
                _round(0, 0.2, 0),
                _round(1, 0.3, 640, tier_hit=512, tier="host", decision="offload_host"),
                _round(2, 0.5, 640, tier_hit=0, decision="retain"),
            ],
            2.0,
        )
    ]
    ora = [_session([_round(0, 0.2, 0), _round(1, 0.1, 640), _round(2, 0.1, 640)], 1.0)]
    samples = [Sample(0.0, 0.5, 1, 0, 0, 0), Sample(0.5, 0.7, 1, 0, 1, 10)]
    sv = summarize("vanilla", van, samples, 5.0)
    sa = summarize("agentkv", akv, samples, 3.0)
    so = summarize("oracle", ora, [], 2.0)
    assert (sa.rounds, sa.resume_rounds) == (3, 2)
    assert sa.resume_ttft_p50_s == pytest.approx(0.4)
    assert sa.decisions == {"offload_host": 1, "retain": 1}
    assert sa.tier_hit_tokens == 512 and sv.tier_hit_tokens is None
    assert sv.resume_rounds_all_reused == 0 and so.resume_rounds_all_reused == 2
    assert sa.reusable_hit_rate == pytest.approx(1.0)
    assert sv.recomputed_tokens == 3000 - 128
    assert sv.kv_usage_mean == pytest.approx(0.6)
    r_ov = ratios(sa, sv)
    r_oo = ratios(sa, so)
    assert r_ov["resume_ttft_p50_s"] == pytest.approx(0.4 / 1.0)
    assert r_ov["jct_mean_s"] == pytest.approx(0.5)
    assert r_oo["resume_ttft_p50_s"] == pytest.approx(4.0)
    assert r_oo["jct_mean_s"] == pytest.approx(2.0)
    assert ratios(sa, summarize("empty", [], [], 0.0))["makespan_s"] is None


def test_the_pause_and_resume_calls_are_summed_against_job_time() -> None:
    """The agent waits on pause and resume: their time per wait and their share of the jobs'
    time are reported; a run without agentkv calls has none."""
    rounds = [_round(0, 0.2, 0), _round(1, 0.3, 640), _round(2, 0.3, 640), _round(3, 0.3, 640)]
    for r, c in zip(rounds[1:], (0.01, 0.03, 0.2), strict=True):
        r.control_s = c
    s = summarize(
        "agentkv", [_session(rounds, 2.0), _session([_round(0, 0.2, 0, tid="t1")], 2.0)], [], 4.0
    )
    assert s.control_p50_s == pytest.approx(0.03)
    assert s.control_p99_s == pytest.approx(0.03 + (0.2 - 0.03) * 0.98)
    assert s.control_share == pytest.approx(0.24 / 4.0)
    assert summarize("vanilla", [_session(rounds[:1], 1.0)], [], 1.0).control_share is None


PROM = """# HELP agentkv_reload_bytes Bytes per reload job
agentkv_reload_bytes_bucket{le="+Inf",tier="host"} 3.0
agentkv_reload_bytes_count{tier="host"} 3.0
agentkv_reload_bytes_sum{tier="host"} 3.0e+06
agentkv_reload_seconds_sum{tier="host"} 0.006
agentkv_reload_bytes_count{tier="disk"} 1.0
agentkv_reload_bytes_sum{tier="disk"} 1.0e+06
agentkv_reload_seconds_sum{tier="disk"} 0.01
agentkv_reload_phase_seconds_sum{phase="prepare"} 0.0003
agentkv_reload_phase_seconds_count{phase="prepare"} 3.0
agentkv_reload_phase_seconds_sum{phase="copy"} 0.0009
agentkv_reload_phase_seconds_count{phase="copy"} 3.0
agentkv_reload_phase_seconds_bucket{le="0.0005",phase="copy"} 1.0
agentkv_reload_phase_seconds_bucket{le="0.001",phase="copy"} 2.0
agentkv_reload_phase_seconds_bucket{le="+Inf",phase="copy"} 3.0
agentkv_reload_phase_seconds_bucket{le="0.001",phase="prepare"} 3.0
agentkv_reload_phase_seconds_sum{phase="copy_cpu"} 0.0006
agentkv_reload_phase_seconds_count{phase="copy_cpu"} 3.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="tiny"} 2.5
vllm:request_queue_time_seconds_count{engine="0",model_name="tiny"} 10.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 1.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 2.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 10.0
vllm:kv_cache_usage_perc{engine="0"} NaN
"""


def test_engine_counters_parse_and_difference() -> None:
    before = parse_prom(
        'agentkv_reload_bytes_sum{tier="host"} 1.0e+06\n'
        'agentkv_reload_bytes_count{tier="host"} 1.0\n'
        'agentkv_reload_seconds_sum{tier="host"} 0.004\n'
        'vllm:request_queue_time_seconds_count{engine="0"} 2.0\n'
        'vllm:request_queue_time_seconds_sum{engine="0"} 0.5\n'
    )
    after = parse_prom(PROM)
    assert after[("agentkv_reload_bytes_sum", "host")] == 3.0e6
    assert ("vllm:kv_cache_usage_perc", "") not in after  # not wanted
    d = prom_delta(before, after)
    rates = tier_rates(d)
    assert set(rates) == {"disk", "host"}  # a phase label is not a tier
    assert (rates["host"].jobs, rates["host"].bytes) == (2, 2.0e6)
    assert rates["host"].bytes_per_s == pytest.approx(2.0e6 / 0.002)
    assert rates["disk"].bytes_per_s == pytest.approx(1.0e8)
    phases = vllm_phases(d)
    assert phases["queue_mean_s"] == pytest.approx(2.0 / 8)
    assert phases["prefill_mean_s"] == pytest.approx(0.1)
    assert phases["ttft_mean_s"] == pytest.approx(0.2)
    assert vllm_phases({})["queue_mean_s"] is None
    assert vllm_phases({})["ttft_mean_s"] is None
    # The worker's reload phases, in ReloadPhase order, per step.
    reload = reload_phase_section(after)
    assert list(reload) == ["prepare", "copy", "copy_cpu"]
    assert reload["copy"] == {
        "steps": 3,
        "total_s": 0.0009,
        "mean_s": pytest.approx(3e-4),
        "slow_steps": 1,  # 2 of its 3 steps within 1 ms
    }
    assert reload["prepare"]["slow_steps"] == reload["copy_cpu"]["slow_steps"] == 0
    assert reload_phase_section({}) == {}


def test_decompose_splits_ttft_into_load_prefill_and_the_rest() -> None:
    rates = tier_rates(parse_prom(PROM))  # host 0.5 GB/s, disk 0.1 GB/s
    rounds = [
        _round(0, 0.5, 0),  # first rounds are not resume stalls
        _round(1, 0.200, 640, tier_hit=512, tier="host"),  # 1 MiB from host, 360 prefilled
        _round(2, 0.050, 1000 - 100, tier_hit=0),  # a device hit: no load
        _round(3, 0.020, 0, tier_hit=128, tier="disk"),  # the prefill alone exceeds the TTFT
    ]
    copies: list[int] = []

    def fake_memcpy(n: int) -> CopyBaseline:
        copies.append(n)
        return CopyBaseline(cold_s=n / 10e9, hot_s=n / 20e9)

    rows = decompose(
        rounds,
        block_tokens=BLOCK,
        block_bytes=BLOCK_BYTES,
        rates=rates,
        prefill_tokens_per_s=10_000.0,
        memcpy=fake_memcpy,
    )
    assert [r.round for r in rows] == [1, 2, 3]
    host, dev, disk = rows
    assert host.load_bytes == 512 * 2048 and host.tier == "host"
    assert host.load_s == pytest.approx(512 * 2048 / 1.0e9 * 2)  # at 0.5 GB/s
    assert host.prefill_s == pytest.approx(360 / 10_000)
    assert host.queue_s == pytest.approx(0.2 - host.load_s - host.prefill_s)
    assert host.memcpy_s == pytest.approx(512 * 2048 / 10e9)  # cold: the target's baseline
    assert host.memcpy_hot_s == pytest.approx(512 * 2048 / 20e9)
    assert (dev.load_s, dev.tier, dev.memcpy_s, dev.memcpy_hot_s) == (0.0, None, 0.0, 0.0)
    assert dev.prefill_s == pytest.approx(0.01)
    assert disk.load_s == pytest.approx(128 * 2048 / 1.0e8)
    assert disk.queue_s == 0.0  # clamped: a layerwise load overlaps the prefill
    assert copies == [512 * 2048, 128 * 2048]  # only rounds that loaded anything
    with pytest.raises(ValueError, match="prefill"):
        decompose(
            rounds,
            block_tokens=128,
            block_bytes=1,
            rates={},
            prefill_tokens_per_s=0,
            memcpy=fake_memcpy,
        )

    section = stall_section({"agentkv": rows, "oracle": []}, rates, 10_000.0, "test", fake_memcpy)
    m = section["by_config"]["agentkv"]
    assert m["resume_rounds"] == 3 and m["rounds_with_load"] == 2
    assert m["load_mean_s"] == pytest.approx((host.load_s + disk.load_s) / 3)
    assert set(m["load_mean_s_by_tier"]) == {"host", "disk"}
    assert section["by_config"]["oracle"] == {"resume_rounds": 0}
    host_tier = section["tiers"]["host"]
    assert host_tier["memcpy_s"] == pytest.approx(2 * (1.5e6 / 10e9))  # mean job size x jobs
    assert host_tier["load_over_memcpy"] == pytest.approx(0.006 / (3e6 / 10e9))  # cold
    assert host_tier["memcpy_hot_s"] == pytest.approx(2 * (1.5e6 / 20e9))
    assert host_tier["load_over_memcpy_hot"] == pytest.approx(0.006 / (3e6 / 20e9))
    assert m["memcpy_mean_s"] == pytest.approx(2 * m["memcpy_hot_mean_s"])


def test_memcpy_is_measured_cold_and_hot_once_per_size() -> None:
    t = memcpy_seconds(1 << 20)
    assert 0 < t < 1.0
    assert memcpy_seconds(0) == 0.0
    calls: list[tuple[str, int]] = []

    def cold(n: int) -> float:
        calls.append(("cold", n))
        return 2e-3

    def hot(n: int) -> float:
        calls.append(("hot", n))
        return 1e-3

    timer = MemcpyTimer(BLOCK_BYTES, cold=cold, hot=hot)
    assert timer(4096) == timer(4096) == CopyBaseline(cold_s=2e-3, hot_s=1e-3)
    assert timer(0) == CopyBaseline(0.0, 0.0)  # nothing measured for nothing loaded
    assert calls == [("cold", 4096), ("hot", 4096)]


def test_attach_engine_stats_matches_turns_to_rounds_by_number_and_prompt() -> None:
    rounds = [_round(0, 0.1, 0, prompt=500), _round(1, 0.1, 384, prompt=700)]
    stats: list[Any] = [
        {
            "turn": 2,
            "branch": "main",
            "prompt_tokens": 700,
            "device_hit_tokens": 128,
            "tier_hit_tokens": 256,
            "tier": "host",
        },
        {"turn": 1, "branch": "main", "prompt_tokens": 999, "device_hit_tokens": 0},  # mismatch
        {"turn": 2, "branch": "other", "prompt_tokens": 700, "device_hit_tokens": 7},
    ]
    _attach_engine_stats(rounds, stats)
    assert rounds[0].device_hit_tokens is None  # prompt sizes disagree: not attached
    assert (rounds[1].device_hit_tokens, rounds[1].tier_hit_tokens, rounds[1].tier) == (
        128,
        256,
        "host",
    )


def _baseline(n: int) -> CopyBaseline:
    return CopyBaseline(cold_s=n / 10e9, hot_s=n / 15e9)


def _report() -> dict[str, Any]:
    mk = lambda name, ttft, cached, tier_hit=None: [  # noqa: E731
        _session(
            [
                _round(0, 0.2, 0, tid=f"{name}0"),
                _round(
                    1,
                    ttft,
                    cached,
                    tier_hit=tier_hit,
                    tier="host" if tier_hit else None,
                    tid=f"{name}0",
                ),
            ],
            1.0 + ttft,
        )
    ]
    sessions = {
        "vanilla": mk("v", 0.9, 0),
        "agentkv": mk("a", 0.3, 640, 512),
        "oracle": mk("o", 0.1, 640),
    }
    samples = [Sample(0.0, 0.5, 1, 0, 0, 0), Sample(1.0, 0.6, 1, 0, 1, 100)]
    summaries = {n: summarize(n, s, samples, 2.0) for n, s in sessions.items()}
    rates = tier_rates(parse_prom(PROM))
    rows = {
        n: decompose(
            [r for s in ss for r in s.rounds],
            block_tokens=BLOCK,
            block_bytes=BLOCK_BYTES,
            rates=rates if n == "agentkv" else {},
            prefill_tokens_per_s=10_000.0,
            memcpy=_baseline,
        )
        for n, ss in sessions.items()
    }
    configs = {
        n: {
            "rounds": [r.to_dict() for s in ss for r in s.rounds],
            "samples": [x.to_dict() for x in samples],
            "vllm_phases": {"queue_mean_s": 0.01, "prefill_mean_s": 0.02, "ttft_mean_s": 0.05},
        }
        for n, ss in sessions.items()
    }
    return build_report(
        command="agentkv bench agents --trace t.csv",
        machine={},
        server={
            "preset": "tiny",
            "num_blocks": 16,
            "oracle_blocks": 64,
            "block_tokens": 128,
            "host_capacity_gib": 2.0,
        },
        trace={
            "source": "t.csv",
            "format": "tracelab-session-csv",
            "sessions": 1,
            "rounds": 2,
            "token_scale": 0.5,
            "time_scale": 1.0,
            "max_context_len": 1008,
            "distinct_tokens": 1008,
        },
        configs=configs,
        summaries=summaries,
        stall=stall_section(
            rows, rates, 10_000.0, "test", _baseline, reload_phase_section(parse_prom(PROM))
        ),
    )


def test_report_has_three_sections_oracle_ratios_and_check(tmp_path: Path) -> None:
    report = _report()
    assert set(report["configs"]) == {"vanilla", "agentkv", "oracle"}
    assert report["ratios_agentkv_over_vanilla"]["resume_ttft_p50_s"] == pytest.approx(0.3 / 0.9)
    assert report["ratios_agentkv_over_oracle"]["resume_ttft_p50_s"] == pytest.approx(3.0)
    assert report["oracle_check"] == {
        "resume_rounds": 1,
        "resume_rounds_all_reused": 1,
        "held": True,
    }
    md = to_markdown(report)
    assert "| metric | vanilla | agentkv | oracle | agentkv / vanilla | agentkv / oracle |" in md
    assert "| resume TTFT p50 (s) | 0.900 | 0.300 | 0.100 | 0.333 | 3.000 |" in md
    assert "Oracle check: 1 of 1 resume rounds" in md
    # Where a round's TTFT goes: the client's mean over its rounds beside vLLM's phases.
    client_ms = 1e3 * statistics.mean(r["ttft_s"] for r in report["configs"]["agentkv"]["rounds"])
    assert f"| agentkv | {client_ms:.1f} | 50.0 | 10.0 | 20.0 |" in md
    assert "## Resume stall, taken apart" in md
    assert "| host | 3 |" in md  # the tier's reload jobs against memcpy
    # The plugin's per-job timing is labelled as what it is: copy time, not job latency.
    assert "| copy time (s) |" in md and "not its latency" in md
    # Both baselines, the target's (cold) first, and where it comes from.
    assert "| **load / cold memcpy** (target <= 1.25) | memcpy GB/s, cache-hot |" in md
    assert "Cold, the baseline the target uses" in md
    # host: 3 jobs of 1e6 B in 0.006 s; cold memcpy 3e6 / 10e9 s, hot 3e6 / 15e9 s.
    assert "| host | 3 | 2.9 | 0.006 | 0.50 | 10.00 | 20.00x | 15.00 | 30.00x |" in md
    # The worker's reload phases: a table, and how much of the copy its thread was running.
    assert "| copy | 3 | 300 | 0.0009 | 1 |" in md
    assert "ran 67% of the copy time (disk + copy + release" in md and "300 vs 100 us" in md
    paths = write_trace_plots(report, tmp_path)
    assert [p.name for p in paths] == [
        "trace_ttft_cdf.png",
        "trace_stall.png",
        "trace_kv_occupancy.png",
    ]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bound_that_could_not_be_fitted_is_reported_without_numbers() -> None:
    report = _report()
    report["capacity_equal_bound"] = {
        "how": "not computed: the oracle run could not be fitted",
        "num_blocks": 12,
        "summary": None,
        "notes": ["too few measured turns (8) to fit on; kept bench-small-cpu's"],
    }
    md = to_markdown(report)
    assert "Capacity-equal bound: not computed: the oracle run could not be fitted" in md
    assert "too few measured turns (8)" in md
