"""The validation protocol: a prediction is written and committed before its run is measured.

Primitives:
  PREDICTION_SCHEMA       ``agentkv-simulate-prediction/1``
  PREDICTIONS_DIR         bench/results/predictions/ (one JSON per row)
  RowSpec                 one row: a name, the workload (a trace with scales and sessions, or the
                          bench generator at a time scale), the pool, the host tier, the
                          calibration file; .bench_command() measures it, .measured_report() is
                          where that command writes its report
  predict(spec, workload, costs) -> dict   both policies simulated, the bench command that
                          measures the row, the calibration's provenance, when
  committed_at(path)      (commit, ISO time) of the commit that added a file, None if none
  table_rows(preds_dir)   every row: predicted, measured, relative errors, held-out or not, and
                          whether the prediction was committed before the report was written

Held out means: the calibration was not fitted to the run it predicts (its provenance is not
FITTED_TO_RUN) and the prediction's commit is older than the run's start (the report's
``started_at``; for reports without it, the report file's mtime). ``same_command`` says whether
the report was written by the row's own command.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agentkv.simulate.costs import EngineCosts, Provenance
from agentkv.simulate.fleet import FleetConfig, simulate
from agentkv.simulate.workload import SimWorkload

PREDICTION_SCHEMA = "agentkv-simulate-prediction/1"
PREDICTIONS_DIR = Path("bench/results/predictions")
VALIDATION_DIR = Path("bench/results/validation")
KEYS = ("resume_ttft_p50_s", "resume_ttft_p99_s", "jct_mean_s", "resume_hit_rate")
RATIO_TOLERANCE = 0.25
ABSOLUTE_TOLERANCE = 0.35
TRACE_CONFIGS = "vanilla,agentkv"


@dataclass(frozen=True)
class RowSpec:
    """One row. A trace row runs ``vanilla,agentkv`` only (the oracle is not compared, and
    skipping it saves a server start and a replay): with ``--configs`` the trace bench writes its
    report under ``pool-<num_blocks>/``. A generator row (``trace`` None) runs the bench's
    default configurations (vanilla, agentkv) at ``time_scale`` (the bench's default 0.1)."""

    name: str
    trace: str | None
    token_scale: float
    time_scale: float
    num_blocks: int
    host_capacity_gib: float
    calibration: str | None
    sessions: int | None = None  # a trace row: only the first N sessions (fit the queue)

    def bench_command(self) -> str:
        out = VALIDATION_DIR / self.name
        pool = f"--num-blocks {self.num_blocks} --host-capacity-gib {self.host_capacity_gib:g}"
        if self.trace is None:
            return (
                f"agentkv bench agents --time-scale {self.time_scale:g} {pool} --skip-overhead "
                f"--out {out} --json"
            )
        sessions = f" --sessions {self.sessions}" if self.sessions is not None else ""
        return (
            f"agentkv bench agents --trace {self.trace} --token-scale {self.token_scale:g} "
            f"--time-scale {self.time_scale:g}{sessions} {pool} --configs {TRACE_CONFIGS} "
            f"--out {out} --json"
        )

    def measured_report(self) -> Path:
        """Where the row's command writes its report."""
        out = VALIDATION_DIR / self.name
        if self.trace is None:
            return out / "report.json"
        return out / f"pool-{self.num_blocks}" / "report.json"


def predict(spec: RowSpec, workload: SimWorkload, costs: EngineCosts) -> dict[str, Any]:
    """The prediction file's content for one row (vanilla and agentkv)."""
    out: dict[str, Any] = {}
    for policy in ("vanilla", "agentkv"):
        cfg = FleetConfig(
            policy=policy,
            num_blocks=spec.num_blocks,
            host_capacity_gib=spec.host_capacity_gib,
            costs=costs,
        )
        s = simulate(workload, cfg).summary.to_dict()
        out[policy] = {k: s.get(k) for k in (*KEYS, "recomputed_tokens", "makespan_s")}
    return {
        "schema": PREDICTION_SCHEMA,
        "row": asdict(spec),
        "predicted_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "calibration": {
            "name": costs.name,
            "provenance": str(costs.provenance),
            "source": costs.source,
            "notes": list(costs.notes),
        },
        "held_out": costs.provenance is not Provenance.FITTED_TO_RUN,
        "command": spec.bench_command(),
        "measured_report": str(spec.measured_report()),
        "predicted": out,
    }


def committed_at(path: Path) -> tuple[str, str] | None:
    """(commit, ISO time) of the commit that added ``path``; None outside git or uncommitted."""
    try:
        res = subprocess.run(
            ["git", "log", "--diff-filter=A", "--format=%H %cI", "--", str(path)],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        return None
    commit, when = lines[-1].split(" ", 1)
    return commit, when


def _measured(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: dict(c.get("summary") or {})
        for name, c in (report.get("configs") or {}).items()
        if isinstance(c, dict)
    }


def _err(pred: Any, meas: Any) -> float | None:
    if not isinstance(pred, (int, float)) or not isinstance(meas, (int, float)) or not meas:
        return None
    return (float(pred) - float(meas)) / abs(float(meas))


def table_rows(preds_dir: Path = PREDICTIONS_DIR) -> list[dict[str, Any]]:
    """One entry per prediction file (see the module docstring)."""
    rows: list[dict[str, Any]] = []
    for path in sorted(preds_dir.glob("*.json")):
        pred = json.loads(path.read_text(encoding="utf-8"))
        if pred.get("schema") != PREDICTION_SCHEMA:
            continue
        commit = committed_at(path)
        report_path = Path(pred["measured_report"])
        entry: dict[str, Any] = {
            "row": pred["row"]["name"],
            "prediction": str(path),
            "commit": commit[0] if commit else None,
            "committed_at": commit[1] if commit else None,
            "held_out": bool(pred.get("held_out")),
            "measured": None,
            "metrics": [],
        }
        if report_path.is_file():
            report = json.loads(report_path.read_text(encoding="utf-8"))
            started = report.get("started_at")
            # The run's start when the report has it; else when the report was written (an
            # older bench: a file's mtime, which a checkout resets).
            if isinstance(started, str):
                measured_at = datetime.fromisoformat(started.replace("Z", "+00:00"))
            else:
                measured_at = datetime.fromtimestamp(report_path.stat().st_mtime, timezone.utc)
            entry["measured"] = str(report_path)
            entry["measured_at"] = measured_at.strftime("%Y-%m-%dT%H:%M:%SZ")
            entry["measured_at_is"] = "run start" if isinstance(started, str) else "report mtime"
            before = commit is not None and datetime.fromisoformat(commit[1]) < measured_at
            entry["committed_before_run"] = before
            # The run must be the row's: the bench writes the command it was given.
            ran = report.get("command")
            entry["same_command"] = None if ran is None else ran == pred["command"]
            meas = _measured(report)
            p = pred["predicted"]
            for key in KEYS:
                for policy in ("vanilla", "agentkv"):
                    pv, mv = p.get(policy, {}).get(key), meas.get(policy, {}).get(key)
                    e = _err(pv, mv)
                    ok = None if e is None else abs(e) <= ABSOLUTE_TOLERANCE
                    entry["metrics"].append((policy, key, pv, mv, e, ok))
                pa, pv_ = p.get("agentkv", {}).get(key), p.get("vanilla", {}).get(key)
                ma, mv_ = meas.get("agentkv", {}).get(key), meas.get("vanilla", {}).get(key)
                pr = pa / pv_ if isinstance(pa, (int, float)) and pv_ else None
                mr = ma / mv_ if isinstance(ma, (int, float)) and mv_ else None
                e = _err(pr, mr)
                ok = None if e is None else abs(e) <= RATIO_TOLERANCE
                entry["metrics"].append(("agentkv/vanilla", key, pr, mr, e, ok))
        rows.append(entry)
    return rows
