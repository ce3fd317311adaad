"""The sweep orchestration (servers faked: the single-pool runners are replaced) and the CLI's
refusal of bad --configs / --num-blocks before any server starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentkv_bench import runner, sweep_runner, trace_runner
from agentkv_bench.overhead import OverheadSpec
from agentkv_bench.runner import BenchOptions
from agentkv_bench.trace_runner import TraceBenchOptions


def _summary(n: int, name: str) -> dict[str, Any]:
    # A pool-dependent agentkv that beats vanilla only in the tight pool.
    ttft = {"vanilla": 1.0, "agentkv": 1.5 if n > 50 else 0.5, "oracle": 0.1}.get(name, 0.8)
    return {
        "resume_ttft_p50_s": ttft,
        "resume_ttft_p99_s": ttft,
        "jct_mean_s": ttft * 10,
        "decode_tok_s": 50.0,
        "recomputed_tokens": 100,
        "writeback_blocks": None if name in ("vanilla", "oracle") else 7,
    }


def test_agents_sweep_runs_each_pool_the_oracle_and_overhead_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[int, tuple[str, ...], bool, Path]] = []

    def fake_run_bench(opts: BenchOptions, progress: Any = None) -> dict[str, Any]:
        calls.append((opts.num_blocks, opts.configs, opts.overhead is not None, opts.out))
        return {"configs": {c: {"summary": _summary(opts.num_blocks, c)} for c in opts.configs}}

    monkeypatch.setattr(runner, "run_bench", fake_run_bench)
    opts = BenchOptions(
        out=tmp_path,
        configs=("vanilla", "agentkv", "retain-always", "oracle"),
        overhead=OverheadSpec(),
        command="agentkv bench agents --configs vanilla,agentkv,retain-always,oracle",
    )
    rep = sweep_runner.run_agents_sweep(opts, [96, 24])
    assert calls == [
        (96, ("vanilla", "agentkv", "retain-always", "oracle"), True, tmp_path / "pool-96"),
        (24, ("vanilla", "agentkv", "retain-always"), False, tmp_path / "pool-24"),
    ]
    assert rep["oracle"]["resume_ttft_p50_s"] == 0.1
    roomy, tight = rep["pools"]
    assert list(roomy["metrics"]) == ["vanilla", "agentkv", "retain-always"]
    assert roomy["regret"]["resume_ttft_p50_s"]["best_fixed"] == "retain-always"
    assert roomy["regret"]["resume_ttft_p50_s"]["over_best_fixed"] == pytest.approx(1.5 / 0.8)
    assert tight["regret"]["resume_ttft_p50_s"]["over_best_fixed"] == pytest.approx(0.5 / 0.8)
    assert json.loads((tmp_path / "sweep.json").read_text())["schema"] == rep["schema"]
    assert "## 24 device blocks" in (tmp_path / "sweep.md").read_text()


def test_trace_sweep_fits_the_bound_of_later_pools_to_the_first_oracle(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[tuple[int | None, tuple[str, ...]]] = []

    def fake_run(opts: TraceBenchOptions, progress: Any = None) -> dict[str, Any]:
        seen.append((opts.num_blocks, tuple(opts.configs)))
        n = opts.num_blocks or 0
        rep: dict[str, Any] = {
            "configs": {
                c: {"summary": _summary(n, c), "rounds": ["r"] if c == "oracle" else []}
                for c in opts.configs
            },
            "trace": {"path": "t.csv"},
            "server": {"num_blocks": n},
        }
        if "oracle" in opts.configs:
            rep["capacity_equal_bound"] = {"summary": {"resume_ttft_p50_s": 0.2, "pool": n}}
        return rep

    bound_calls: list[dict[str, Any]] = []

    def fake_bound(report: dict[str, Any]) -> dict[str, Any]:
        bound_calls.append(report)
        return {"summary": {"resume_ttft_p50_s": 0.3, "pool": report["server"]["num_blocks"]}}

    monkeypatch.setattr(trace_runner, "run_trace_bench", fake_run)
    monkeypatch.setattr("agentkv.simulate.bounds.trace_report_bound", fake_bound)
    opts = TraceBenchOptions(trace=Path("t.csv"), out=tmp_path, configs=("agentkv", "oracle"))
    rep = sweep_runner.run_trace_sweep(opts, [64, 32])
    assert seen == [(64, ("agentkv", "oracle")), (32, ("agentkv",))]
    assert [p["capacity_equal_bound"] for p in rep["pools"]] == [
        {"resume_ttft_p50_s": 0.2, "pool": 64},
        {"resume_ttft_p50_s": 0.3, "pool": 32},
    ]
    (call,) = bound_calls
    assert call["configs"]["oracle"]["rounds"] == ["r"]  # the first pool's oracle run


def test_agents_sweep_repeats_alternate_the_order_and_report_medians(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[int, tuple[str, ...], bool, Path]] = []
    phases: list[str] = []

    def fake_run_bench(opts: BenchOptions, progress: Any = None) -> dict[str, Any]:
        calls.append((opts.num_blocks, opts.configs, opts.overhead is not None, opts.out))
        progress("vanilla: agent workload", 1, 9)
        k = len(calls)  # the run's agentkv TTFT: 1.1, 0.9, 1.5 at 96 blocks (median 1.1)
        cfgs = {c: {"summary": _summary(opts.num_blocks, c)} for c in opts.configs}
        cfgs["agentkv"]["summary"]["resume_ttft_p50_s"] = {1: 1.1, 2: 0.9, 3: 1.5}.get(k, 0.5)
        return {"configs": cfgs}

    monkeypatch.setattr(runner, "run_bench", fake_run_bench)
    given = ("vanilla", "agentkv", "retain-always", "oracle")
    opts = BenchOptions(out=tmp_path, configs=given, overhead=OverheadSpec())
    rep = sweep_runner.run_agents_sweep(
        opts, [96, 24], lambda phase, d, t: phases.append(phase), repeats=3
    )
    no_oracle = ("vanilla", "agentkv", "retain-always")
    backwards = ("retain-always", "agentkv", "vanilla")
    assert calls == [
        (96, given, True, tmp_path / "pool-96" / "rep-1"),  # the oracle and overhead once
        (96, backwards, False, tmp_path / "pool-96" / "rep-2"),
        (96, no_oracle, False, tmp_path / "pool-96" / "rep-3"),
        (24, no_oracle, False, tmp_path / "pool-24" / "rep-1"),
        (24, backwards, False, tmp_path / "pool-24" / "rep-2"),
        (24, no_oracle, False, tmp_path / "pool-24" / "rep-3"),
    ]
    assert phases[:2] == [
        "[pool 96, repeat 1/3] vanilla: agent workload",
        "[pool 96, repeat 2/3] vanilla: agent workload",
    ]
    assert rep["aggregate"] == "median of 3 repeats"
    roomy = rep["pools"][0]
    assert list(roomy["metrics"]) == list(no_oracle)  # columns in the given order every repeat
    assert roomy["metrics"]["agentkv"]["resume_ttft_p50_s"] == pytest.approx(1.1)
    assert roomy["repeats"]["values"]["agentkv"]["resume_ttft_p50_s"] == [1.1, 0.9, 1.5]
    assert roomy["repeats"]["order"][1] == list(backwards)
    assert roomy["regret"]["resume_ttft_p50_s"]["over_best_fixed"] == pytest.approx(1.1 / 0.8)
    assert rep["oracle"]["resume_ttft_p50_s"] == 0.1
    assert roomy["report"] == str(tmp_path / "pool-96")
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["pools"][1]["repeats"]["count"] == 3
    assert "0.800 (0.800-0.800)" in (tmp_path / "sweep.md").read_text()


def test_trace_sweep_repeats_run_the_oracle_and_fit_each_bound_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[tuple[int | None, tuple[str, ...], Path]] = []

    def fake_run(opts: TraceBenchOptions, progress: Any = None) -> dict[str, Any]:
        seen.append((opts.num_blocks, tuple(opts.configs), opts.out))
        n = opts.num_blocks or 0
        return {
            "configs": {c: {"summary": _summary(n, c), "rounds": []} for c in opts.configs},
            "trace": {"path": "t.csv"},
            "server": {"num_blocks": n},
        }

    bound_calls: list[int] = []

    def fake_bound(report: dict[str, Any]) -> dict[str, Any]:
        bound_calls.append(report["server"]["num_blocks"])
        return {"summary": {"resume_ttft_p50_s": 0.3}}

    monkeypatch.setattr(trace_runner, "run_trace_bench", fake_run)
    monkeypatch.setattr("agentkv.simulate.bounds.trace_report_bound", fake_bound)
    opts = TraceBenchOptions(
        trace=Path("t.csv"), out=tmp_path, configs=("vanilla", "agentkv", "oracle")
    )
    rep = sweep_runner.run_trace_sweep(opts, [64], repeats=2)
    assert seen == [
        (64, ("vanilla", "agentkv", "oracle"), tmp_path / "pool-64" / "rep-1"),
        (64, ("agentkv", "vanilla"), tmp_path / "pool-64" / "rep-2"),
    ]
    assert bound_calls == [64]  # the first repeat ran the oracle; no refit per repeat
    assert rep["pools"][0]["capacity_equal_bound"] == {"resume_ttft_p50_s": 0.3}
    assert rep["repeats"] == 2
    with pytest.raises(ValueError, match="--repeats"):
        sweep_runner.run_trace_sweep(opts, [64], repeats=0)


TINY_TRACE = """session_id,arrival_time,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms
a,0,0,0,1000,4,3000
a,0,1,1004,60,4,0
"""


@pytest.mark.parametrize("trace", [False, True])
def test_cli_repeats_makes_one_pool_a_sweep(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, trace: bool
) -> None:
    from typer.testing import CliRunner

    from agentkv.cli import app

    got: list[tuple[list[int], int]] = []

    def fake_sweep(opts: Any, pools: Any, progress: Any, repeats: int = 1) -> dict:
        got.append((list(pools), repeats))
        return {"pools": [], "repeats": repeats}

    def no_single_run(opts: Any, progress: Any = None) -> dict[str, Any]:
        # Without the sweep the command would start real servers: fail at once instead.
        raise AssertionError("--repeats 2 ran a single-pool bench, not a sweep")

    monkeypatch.setattr(sweep_runner, "run_agents_sweep", fake_sweep)
    monkeypatch.setattr(sweep_runner, "run_trace_sweep", fake_sweep)
    monkeypatch.setattr(runner, "run_bench", no_single_run)
    monkeypatch.setattr(trace_runner, "run_trace_bench", no_single_run)
    args = ["bench", "agents", "--quick", "--num-blocks", "48", "--repeats", "2"]
    if trace:
        (tmp_path / "t.csv").write_text(TINY_TRACE)
        args += ["--trace", str(tmp_path / "t.csv")]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    assert got == [([48], 2)]


CMD = [sys.executable, "-m", "agentkv.cli", "bench", "agents", "--quick"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--configs", "vanilla,always-retain"], "unknown configuration 'always-retain'"),
        (["--configs", "vanilla,oracle"], "--configs must include agentkv"),
        (["--configs", "agentkv,oracle"], "--configs must include vanilla"),
        (["--num-blocks", "48,4"], "below the minimum of 8"),
        (["--repeats", "0"], "Invalid value for '--repeats'"),
    ],
)
def test_bad_matrix_fails_before_any_server(tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [*CMD, *args, "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert message in " ".join(proc.stderr.split())
    assert not out.exists()


def test_synthetic_oracle_pool_holds_every_context_at_once() -> None:
    from agentkv_bench.runner import oracle_blocks
    from agentkv_bench.workload import WorkloadConfig, generate

    wl = generate(WorkloadConfig.quick(0))
    contexts = sum(
        u.observation_tokens * max(1, u.fork) + u.max_tokens
        for t in wl.trajectories
        for u in t.turns
    )
    assert oracle_blocks(wl) * 128 >= wl.config.prefix_tokens + contexts
    more = generate(WorkloadConfig.quick(0).with_overrides(trajectories=6))
    assert oracle_blocks(more) > oracle_blocks(wl)
