"""`agentkv simulate validate`: a prediction file, its commit before the run, the table."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv.cli import app
from agentkv.simulate import protocol

TRACE = Path("/work/shared/traces/multi_session_example.csv")
FIXTURE = Path(__file__).parent / "fixtures/simulate/trace_report_negative_fit.json"


def _git(cwd: Path, *args: str) -> None:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
    }
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, env=env)


def test_a_row_is_predicted_committed_then_compared_with_its_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not TRACE.is_file():
        pytest.skip("the example trace is not on this machine")
    monkeypatch.chdir(tmp_path)
    _git(tmp_path, "init", "-q")
    runner = CliRunner()
    # A calibration fitted to a run is allowed, and marks the row as not held out.
    args = ["simulate", "validate", "--predict", "ex", "--trace", str(TRACE), "--num-blocks", "8"]
    out = runner.invoke(app, [*args, "--calibration", str(FIXTURE), "--json"])
    assert out.exit_code == 0, out.output
    pred = json.loads(out.stdout)
    assert pred["held_out"] is False and "--num-blocks 8" in pred["command"]
    path = tmp_path / protocol.PREDICTIONS_DIR / "ex.json"
    table = runner.invoke(app, ["simulate", "validate", "--json"])
    rows = json.loads(table.stdout)
    assert rows[0]["commit"] is None and rows[0]["measured"] is None  # not committed, not run
    _git(tmp_path, "add", "-f", str(path))
    _git(tmp_path, "commit", "-qm", "prediction ex")
    # The run: a report whose numbers are the prediction's, vanilla's TTFT doubled.
    p = pred["predicted"]
    report = {
        "configs": {
            "vanilla": {"summary": {**p["vanilla"], "jct_mean_s": p["vanilla"]["jct_mean_s"] * 2}},
            "agentkv": {"summary": p["agentkv"]},
        }
    }
    rp = tmp_path / pred["measured_report"]
    rp.parent.mkdir(parents=True)
    rp.write_text(json.dumps(report))
    later = rp.stat().st_mtime + 5
    os.utime(rp, (later, later))
    rows = json.loads(runner.invoke(app, ["simulate", "validate", "--json"]).stdout)
    row = rows[0]
    assert row["commit"] and row["committed_before_run"] and not row["held_out"]
    errs = {(c, k): (e, ok) for c, k, _, _, e, ok in row["metrics"]}
    assert errs[("agentkv", "jct_mean_s")][0] == pytest.approx(0.0)
    assert errs[("vanilla", "jct_mean_s")] == (pytest.approx(-0.5), False)
    assert errs[("agentkv/vanilla", "jct_mean_s")][0] == pytest.approx(1.0)
    text = runner.invoke(app, ["simulate", "validate"]).output
    assert "calibration fitted to the run" in text and "NO" in text


def test_a_trace_rows_command_runs_vanilla_and_agentkv_where_the_table_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The printed command is accepted by `agentkv bench agents`, runs no oracle, and its report
    lands at the prediction's measured_report (a --configs run writes under pool-N/)."""
    if not TRACE.is_file():
        pytest.skip("the example trace is not on this machine")
    import agentkv_bench.sweep_runner as sweep_runner
    import agentkv_bench.trace_runner as trace_runner

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    args = ["simulate", "validate", "--predict", "ex", "--trace", str(TRACE), "--num-blocks", "12"]
    pred = json.loads(runner.invoke(app, [*args, "--sessions", "2", "--json"]).stdout)
    assert pred["row"]["sessions"] == 2
    seen: dict[str, object] = {}

    def fake_sweep(
        opts: object, sizes: list[int], progress: object, repeats: int = 1
    ) -> dict[str, object]:
        seen.update(opts=opts, sizes=sizes, repeats=repeats)
        return {}

    monkeypatch.setattr(sweep_runner, "run_trace_sweep", fake_sweep)
    # Without --configs the bench would run every configuration for real: never here.
    monkeypatch.setattr(trace_runner, "run_trace_bench", lambda *a, **k: pytest.fail("no sweep"))
    argv = pred["command"].split()
    assert argv[:3] == ["agentkv", "bench", "agents"]
    out = runner.invoke(app, argv[1:])
    assert out.exit_code == 0, out.output
    opts = seen["opts"]
    assert opts.configs == ("vanilla", "agentkv") and opts.sessions == 2  # type: ignore[attr-defined]
    assert seen["sizes"] == [12] and seen["repeats"] == 1
    written = opts.out / "pool-12" / "report.json"  # type: ignore[attr-defined]
    assert str(written) == pred["measured_report"]


def test_a_generator_row_is_predicted_at_the_benchs_own_scales(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bench generator runs at time scale 0.1 by default and its prompts are x1.125 its
    targets: the prediction must use the same workload its command measures."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    out = runner.invoke(app, ["simulate", "validate", "--predict", "gen", "--json"])
    assert out.exit_code == 0, out.output
    pred = json.loads(out.stdout)
    bad = runner.invoke(app, ["simulate", "validate", "--predict", "g", "--token-scale", "2"])
    assert pred["row"]["time_scale"] == 0.1 and pred["row"]["token_scale"] == 1.125
    assert "--time-scale 0.1 " in pred["command"] and "--host-capacity-gib 2" in pred["command"]
    assert pred["measured_report"] == "bench/results/validation/gen/report.json"
    assert bad.exit_code != 0 and "--trace row" in bad.output


def test_a_run_that_started_before_the_commit_or_ran_another_command_is_flagged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report's own start time counts, not its file's mtime (a checkout resets that, and a
    prediction committed while the run was under way is not a prediction); a report written by
    another command than the row's is not the row's measurement."""
    if not TRACE.is_file():
        pytest.skip("the example trace is not on this machine")
    monkeypatch.chdir(tmp_path)
    _git(tmp_path, "init", "-q")
    runner = CliRunner()
    args = ["simulate", "validate", "--predict", "ex", "--trace", str(TRACE), "--num-blocks", "12"]
    pred = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    _git(tmp_path, "add", "-f", str(protocol.PREDICTIONS_DIR / "ex.json"))
    _git(tmp_path, "commit", "-qm", "prediction ex")
    p = pred["predicted"]
    report = {
        "command": pred["command"].replace("--num-blocks 12", "--num-blocks 13"),
        "started_at": "2000-01-01T00:00:00Z",
        "configs": {"vanilla": {"summary": p["vanilla"]}, "agentkv": {"summary": p["agentkv"]}},
    }
    rp = tmp_path / pred["measured_report"]
    rp.parent.mkdir(parents=True)
    rp.write_text(json.dumps(report))  # written now, after the commit
    row = json.loads(runner.invoke(app, ["simulate", "validate", "--json"]).stdout)[0]
    assert row["measured_at"] == "2000-01-01T00:00:00Z" and row["measured_at_is"] == "run start"
    assert row["committed_before_run"] is False and row["same_command"] is False
    text = runner.invoke(app, ["simulate", "validate"]).output
    assert "committed after the run" in text and "another command" in text
    report["command"], report["started_at"] = pred["command"], "2999-01-01T00:00:00Z"
    rp.write_text(json.dumps(report))
    row = json.loads(runner.invoke(app, ["simulate", "validate", "--json"]).stdout)[0]
    assert row["committed_before_run"] is True and row["same_command"] is True


def test_bench_reports_carry_their_start_time() -> None:
    import re

    from agentkv_bench.runner import utc_stamp

    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", utc_stamp())
