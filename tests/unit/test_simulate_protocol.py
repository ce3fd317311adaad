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
