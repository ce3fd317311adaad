"""agentkv_bench.report: metrics, ratios, targets, JSON and markdown (pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentkv_bench.drivers import TrajectoryRecord, TurnRecord
from agentkv_bench.report import (
    METRICS,
    SCHEMA,
    build_report,
    percentile,
    ratios,
    summarize,
    targets,
    to_markdown,
)
from agentkv_bench.sampler import Sample, parse_metrics


def turn(
    tid: str, k: int, kind: str, ttft: float, prompt: int, cached: int, latency: float = 1.0
) -> TurnRecord:
    return TurnRecord(
        trajectory_id=tid,
        branch="main",
        turn=k,
        kind=kind,
        tool=None if kind == "first" else "compile",
        wait_s=0.0 if kind == "first" else 1.0,
        sent_at_s=float(k),
        ttft_s=ttft,
        latency_s=latency,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=11,
        decision=None if kind == "first" else "offload_host",
    )


def records(resume_ttft: float, cached: int, jct: float) -> list[TrajectoryRecord]:
    out = []
    for i in range(2):
        tid = f"t{i}"
        turns = [
            turn(tid, 1, "first", 2.0, 1000, 0),
            turn(tid, 2, "resume", resume_ttft, 1200, cached),
            turn(tid, 3, "resume", resume_ttft * 3, 1400, cached),
        ]
        out.append(TrajectoryRecord(tid, 0.0, jct + i, turns))
    return out


def summary(name: str, resume_ttft: float, cached: int, jct: float) -> Any:
    recs = records(resume_ttft, cached, jct)
    turns = [t for r in recs for t in r.turns]
    samples = [Sample(0.0, 0.5, 1, 0, 0, 0), Sample(1.0, 0.7, 1, 0, 1, 1200)]
    return summarize(name, turns, recs, samples, makespan_s=10.0)


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_summary_metrics() -> None:
    s = summary("vanilla", 4.0, 256, 20.0)
    assert s.turns == 6 and s.resume_turns == 4
    assert s.resume_ttft_p50_s == pytest.approx(8.0)  # [4, 4, 12, 12]
    assert s.ttft_p50_s == pytest.approx(4.0)  # [2, 2, 4, 4, 12, 12]
    assert s.jct_mean_s == pytest.approx(20.5) and s.jct_max_s == 21.0
    assert s.prompt_tokens == 2 * 3600 and s.cached_tokens == 4 * 256
    assert s.recomputed_tokens == 2 * 3600 - 4 * 256
    assert s.resume_recomputed_tokens == 2 * (1200 + 1400) - 4 * 256
    assert s.prefix_hit_rate == pytest.approx(1024 / 7200)
    assert s.resume_hit_rate == pytest.approx(1024 / 5200)
    assert s.decode_tok_s is None  # every latency here is below its TTFT: no decode time
    assert s.output_tok_s == pytest.approx(66 / 10.0)
    assert s.kv_usage_mean == pytest.approx(0.6) and s.kv_usage_max == pytest.approx(0.7)
    assert s.decisions == {"offload_host": 4}
    assert s.hit_rate_by_turn == {
        "1": 0.0,
        "2": pytest.approx(256 / 1200),
        "3": pytest.approx(256 / 1400),
    }


def test_decode_throughput() -> None:
    recs = [TrajectoryRecord("t", 0.0, 1.0, [turn("t", 1, "first", 0.5, 100, 0, latency=1.5)])]
    s = summarize("x", recs[0].turns, recs, [], 2.0)
    assert s.decode_tok_s == pytest.approx(10 / 1.0)


def test_ratios_and_targets() -> None:
    v = summary("vanilla", 4.0, 256, 30.0)
    a = summary("agentkv", 0.5, 1024, 15.0)
    r = ratios(a, v)
    assert set(r) == {k for k, *_ in METRICS}
    assert r["resume_ttft_p50_s"] == pytest.approx(0.125)
    assert r["jct_mean_s"] == pytest.approx(15.5 / 30.5)
    assert r["prefix_hit_rate"] == pytest.approx(4.0)
    t = {x.name.split(",")[0]: x for x in targets(v, a, overhead_pct=2.0)}
    assert t["resume TTFT p50"].measured == pytest.approx(8.0) and t["resume TTFT p50"].met
    assert t["mean job completion time"].measured == pytest.approx(30.5 / 15.5)
    assert t["mean job completion time"].met
    assert t["throughput loss without pauses (vllm bench serve)"].met
    slow = targets(v, summary("agentkv", 1.0, 256, 25.0), overhead_pct=None)
    assert [x.met for x in slow] == [False, False, None]


def test_ratio_with_zero_denominator_is_none() -> None:
    v = summary("vanilla", 4.0, 0, 30.0)  # hit rate on resume: 0
    a = summary("agentkv", 1.0, 512, 20.0)
    assert ratios(a, v)["resume_hit_rate"] is None


def report() -> dict[str, Any]:
    v = summary("vanilla", 4.0, 256, 30.0)
    a = summary("agentkv", 0.5, 1024, 15.0)
    configs = {
        name: {
            "turns": [t.to_dict() for r in records(1.0, 0, 1.0) for t in r.turns],
            "trajectories": [],
            "samples": [],
        }
        for name in ("vanilla", "agentkv")
    }
    return build_report(
        workload={"config": {"trajectories": 2, "turns": 3, "seed": 0, "time_scale": 0.1}},
        server={"preset": "small", "num_blocks": 128, "host_capacity_gib": 2},
        machine={"cpus": 2},
        command="agentkv bench agents --seed 0",
        configs=configs,
        summaries={"vanilla": v, "agentkv": a},
        native_offload={
            "status": "skipped",
            "reason": "vLLM native offloading / LMCache need CUDA",
        },
        overhead={
            "status": "ok",
            "dataset": "random",
            "num_prompts": 8,
            "max_concurrency": 4,
            "vanilla": {"output_throughput": 100.0},
            "agentkv": {"output_throughput": 98.0},
            "throughput_loss_pct": 2.0,
        },
    )


def test_report_is_json_with_the_expected_keys() -> None:
    r = json.loads(json.dumps(report()))
    assert r["schema"] == SCHEMA
    assert set(r) >= {
        "command",
        "machine",
        "server",
        "workload",
        "configs",
        "ratios_agentkv_over_vanilla",
        "targets",
        "native_offload",
        "overhead",
    }
    for name in ("vanilla", "agentkv"):
        cfg = r["configs"][name]
        assert {"summary", "turns", "trajectories", "samples"} <= set(cfg)
        assert cfg["turns"][0]["recomputed_tokens"] == 1000
    assert [t["met"] for t in r["targets"]] == [True, True, True]


def test_markdown_has_the_table_targets_and_skips() -> None:
    md = to_markdown(report())
    assert "| metric | vanilla vLLM | vLLM + agentkv | agentkv / vanilla |" in md
    assert "| resume TTFT p50 (s) | 8.00 | 1.00 | 0.125 |" in md
    assert "| resume TTFT p50, vanilla / agentkv | >= 5.0x | 8.00x | yes |" in md
    assert "Throughput loss (median of per-repeat losses): 2.00%" in md
    assert "skipped: vLLM native offloading / LMCache need CUDA" in md
    assert "`agentkv bench agents --seed 0`" in md


def test_parse_metrics_sums_label_sets_and_skips_others() -> None:
    text = "\n".join(
        [
            "# HELP vllm:kv_cache_usage_perc KV usage",
            'vllm:kv_cache_usage_perc{engine="0",model_name="small"} 0.25',
            'vllm:prefix_cache_hits_total{engine="0"} 128.0',
            'vllm:prefix_cache_hits_total{engine="1"} 128.0',
            "vllm:other_metric 7",
            "process_cpu_seconds_total 3",
        ]
    )
    assert parse_metrics(text) == {
        "vllm:kv_cache_usage_perc": 0.25,
        "vllm:prefix_cache_hits_total": 256.0,
    }
