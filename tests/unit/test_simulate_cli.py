"""`agentkv simulate` through the root app: JSON, tables, the search, plots, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv.cli import app

runner = CliRunner()
FIXTURE = Path(__file__).parent / "fixtures/simulate/bench_agents_small_cpu.json"


def test_json_has_every_configuration_and_the_comparison() -> None:
    result = runner.invoke(
        app,
        [
            "simulate",
            "--json",
            "--writeback",
            "eager",  # the fixture's run predates the forecast write-back
            "--compare",
            str(FIXTURE),
            "--policy",
            "vanilla,agentkv",
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out["results"]) == {"session-affinity/vanilla", "session-affinity/agentkv"}
    s = out["results"]["session-affinity/agentkv"]["summary"]
    assert s["turns"] == 30 and s["resume_turns"] == 24 and s["decisions"] == {"offload_host": 24}
    assert all(row["within"] for row in out["compare"])


def test_fit_builtin_re_derives_the_builtin_constants(tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", "fit-builtin", str(FIXTURE), "--top", "2"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 + 2 + 1 and lines[2].startswith("| 2.8e11 | 40 ms |")
    assert lines[-1] == (
        "fit: prefill_flops_per_s=2.8e11 step_overhead_s=0.04 (the built-in constants)"
    )
    bad = runner.invoke(app, ["simulate", "fit-builtin", __file__])
    assert bad.exit_code == 2 and "not a measured bench run" in bad.output
    # A measured run without any metric the fit compares: one line, no traceback.
    data = json.loads(FIXTURE.read_text())
    data["configs"] = {"vanilla": {}, "agentkv": {}}
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(data))
    bad = runner.invoke(app, ["simulate", "fit-builtin", str(empty)])
    assert bad.exit_code == 2 and "none of resume_ttft_p50_s" in bad.output


def test_table_and_plots(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "simulate",
            "-n",
            "4",
            "-t",
            "3",
            "--replicas",
            "2",
            "--router",
            "all",
            "--policy",
            "agentkv",
            "--plot",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "tokens recomputed" in result.output and "round-robin" in result.output
    result = runner.invoke(
        app,
        [
            "simulate",
            "-n",
            "4",
            "-t",
            "3",
            "-r",
            "2",
            "--router",
            "all",
            "--policy",
            "agentkv",
            "--json",
        ],
    )
    assert len(json.loads(result.stdout)["results"]) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hit_rate_by_turn.png",
        "kv_occupancy.png",
        "ttft_cdf.png",
    ]


def test_find_replicas_answers_the_smallest_fleet() -> None:
    args = [
        "simulate",
        "-n",
        "12",
        "-t",
        "3",
        "--rate",
        "0.5",
        "--find-replicas",
        "--slo-ttft-p99",
        "20",
        "--policy",
        "agentkv",
        "--router",
        "least-loaded",
        "--json",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    (found,) = json.loads(result.stdout)["results"]
    n = found["replicas"]
    assert n is not None and found["ttft_p99_s"] <= 20
    probes = {int(k): v for k, v in found["probes"].items()}
    assert n == 1 or probes[n - 1] is None or probes[n - 1] > 20


def test_bad_input_is_one_line() -> None:
    result = runner.invoke(app, ["simulate", "--find-replicas"])
    assert result.exit_code == 2 and "--rate" in result.output
    result = runner.invoke(app, ["simulate", "--router", "magic"])
    assert result.exit_code == 2 and "unknown router" in result.output


def test_a_trace_runs_with_the_bench_flags() -> None:
    trace = Path(__file__).resolve().parents[3] / "shared/traces/multi_session_example.csv"
    if not trace.exists():
        pytest.skip(f"{trace} is not on this machine")
    result = runner.invoke(
        app,
        ["simulate", "--trace", str(trace), "--sessions", "2", "--token-scale", "0.5", "--json"],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["workload"]["trajectories"] == 2
    assert (
        out["results"]["session-affinity/agentkv"]["summary"]["turns"] == out["workload"]["turns"]
    )


def test_an_unbounded_overload_is_reported_as_such_not_as_hours_of_ttft() -> None:
    # 300 trajectories starting together on one replica: a backlog of hours.
    args = ["simulate", "-n", "300", "-t", "4", "--time-scale", "0", "--policy", "vanilla"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    load = out["load"]
    assert load["overloaded"] and load["unbounded"] and load["utilization"] > 10
    assert load["min_replicas"] > 10 and "smallest fleet" in load["warning"]
    run = out["results"]["session-affinity/vanilla"]
    assert run["truncated"] and run["summary"]["engine_busy"] > 0.9
    assert run["summary"]["turns"] < 300 * 4  # stopped at the horizon, not hours later
    table = runner.invoke(app, args)
    assert "overloaded" in table.output and "smallest fleet that carries it" in table.output
    full = runner.invoke(app, [*args, "-n", "40", "--json", "--full"])
    assert not json.loads(full.stdout)["results"]["session-affinity/vanilla"]["truncated"]


def test_a_saturated_small_population_is_simulated_to_its_end() -> None:
    result = runner.invoke(app, ["simulate", "--policy", "agentkv", "--json"])
    out = json.loads(result.stdout)
    assert out["load"]["overloaded"] and not out["load"]["unbounded"]
    run = out["results"]["session-affinity/agentkv"]
    assert not run["truncated"] and run["summary"]["turns"] == 30


def test_the_pause_options_reach_the_simulation() -> None:
    """--fork-prob (every turn after the first forks in 2), --pause-after never (every turn's
    blocks take the grace's default action or a demotion), --writeback eager (no deferral)."""
    args = ["simulate", "-n", "2", "-t", "3", "--policy", "agentkv", "--json"]
    result = runner.invoke(
        app, [*args, "--fork-prob", "1", "--pause-after", "never", "--writeback", "eager"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["workload"]["turns"] == 2 * (1 + 2 * 2)
    s = out["results"]["session-affinity/agentkv"]["summary"]
    assert s["turns"] == 10 and s["writebacks"] == {}
    assert set(s["decisions"]) <= {"grace_expired"}  # no pause ever arrives: nothing decided
    bad = runner.invoke(app, [*args, "--pause-after", "soon"])
    assert bad.exit_code == 2 and "--pause-after" in bad.output
    bad = runner.invoke(app, [*args, "--writeback", "lazy"])
    assert bad.exit_code == 2 and "--writeback" in bad.output
