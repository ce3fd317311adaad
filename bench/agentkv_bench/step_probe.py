"""Step times of a server's engine core and worker, from the step probe's records
(``step_probe_site/sitecustomize.py``), for ``agentkv bench overhead --step-times``.

Primitives (pure but for ``read_records``):
  probe_env(folder, base_pythonpath)   the server environment that loads the probe
  read_records(folder) -> [(key, start, seconds)]   every process's records
  phase_step_times(records, t0, t1)    per target, the median of the calls that started inside
                                       [t0, t1] (microseconds), and the step's time outside the
                                       model forward (``EngineCore.step`` - ``_model_forward``)
  compare_step_times(phases)           per target, vanilla and agentkv medians over the rounds
                                       and the median of the per-round differences
  step_times_markdown(section)

Why: end-to-end latency moves +-5% between server starts here, the forward pass with it, so a
1% cost cannot be resolved from it in a bench of reasonable length. What agentkv adds to a
plain step is outside the forward (scheduler hooks, the metadata the executor ships, the worker's
connector calls), and those parts hold still between starts.
"""

from __future__ import annotations

import os
import statistics
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agentkv_bench.step_probe_site.sitecustomize import ENV, EXTRA_FILE, KEYS

SITE_DIR = Path(__file__).resolve().parent / "step_probe_site"
STEP, FORWARD = "EngineCore.step", "GPUModelRunner._model_forward"
OUTSIDE = "step outside the forward"
A, B = "vanilla", "agentkv"


def probe_env(folder: Path, base_pythonpath: str | None = None) -> dict[str, str]:
    """PYTHONPATH (the probe first: it is loaded as ``sitecustomize``) and the records' folder."""
    path = str(SITE_DIR) + (os.pathsep + base_pythonpath if base_pythonpath else "")
    return {"PYTHONPATH": path, ENV: str(folder)}


def read_records(folder: Path) -> list[tuple[str, float, float]]:
    """Every process's (method, start, seconds) records in ``folder``: the fixed targets' and the
    extra ones the server was given (``AGENTKV_STEP_PROBE_EXTRA``, named in EXTRA_FILE)."""
    keys = KEYS
    extra = folder / EXTRA_FILE
    if extra.exists():
        keys = KEYS + tuple(line for line in extra.read_text().splitlines() if line)
    out: list[tuple[str, float, float]] = []
    for path in sorted(folder.glob("probe-*.bin")):
        data = array("d")
        raw = path.read_bytes()
        data.frombytes(raw[: len(raw) - len(raw) % (3 * data.itemsize)])
        for i in range(0, len(data), 3):
            k = int(data[i])
            if 0 <= k < len(keys):
                out.append((keys[k], data[i + 1], data[i + 2]))
    return out


def phase_step_times(
    records: Sequence[tuple[str, float, float]], t0: float, t1: float
) -> dict[str, dict[str, float | int]]:
    by: dict[str, list[float]] = {}
    for key, start, seconds in records:
        if t0 <= start <= t1:
            by.setdefault(key, []).append(seconds)
    out: dict[str, dict[str, float | int]] = {
        k: {"n": len(v), "median_us": statistics.median(v) * 1e6} for k, v in by.items() if v
    }
    if STEP in out and FORWARD in out:
        out[OUTSIDE] = {
            "n": int(out[STEP]["n"]),
            "median_us": float(out[STEP]["median_us"]) - float(out[FORWARD]["median_us"]),
        }
    return out


def compare_step_times(phases: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``phases``: each {"round", "config", "step_times": phase_step_times(...)}. Per target:
    the median over rounds of each configuration's phase medians, and the median of the
    per-round differences (agentkv - vanilla); for the step outside the forward also that
    difference as a share of vanilla's whole step."""
    by = {(int(p["round"]), str(p["config"])): p.get("step_times") or {} for p in phases}
    rounds = sorted({r for r, _ in by})
    rows: dict[str, dict[str, Any]] = {}
    for key in (*KEYS, OUTSIDE):
        a = [by[(r, A)][key]["median_us"] for r in rounds if key in by.get((r, A), {})]
        b = [by[(r, B)][key]["median_us"] for r in rounds if key in by.get((r, B), {})]
        diffs = [
            by[(r, B)][key]["median_us"] - by[(r, A)][key]["median_us"]
            for r in rounds
            if key in by.get((r, A), {}) and key in by.get((r, B), {})
        ]
        if not diffs:
            continue
        rows[key] = {
            "vanilla_us": statistics.median(a),
            "agentkv_us": statistics.median(b),
            "diff_us": statistics.median(diffs),
            "diff_range_us": [min(diffs), max(diffs)],
            "rounds": len(diffs),
        }
    out: dict[str, Any] = {"targets": rows}
    if OUTSIDE in rows and STEP in rows and rows[STEP]["vanilla_us"] > 0:
        out["added_share_of_step"] = rows[OUTSIDE]["diff_us"] / rows[STEP]["vanilla_us"]
    return out


def step_times_markdown(section: Mapping[str, Any]) -> list[str]:
    rows = section.get("targets") or {}
    if not rows:
        return ["Step times: no probe records (the probe did not load, or no step ran)."]
    lines = [
        "Step times (`--step-times`: vLLM's own methods timed in the engine core and worker, "
        "median per phase, then over rounds; microseconds):",
        "",
        "| | vanilla | agentkv | agentkv - vanilla, median of rounds (range) |",
        "|---|---:|---:|---:|",
    ]
    for key, r in rows.items():
        lo, hi = r["diff_range_us"]
        lines.append(
            f"| {key} | {r['vanilla_us']:.0f} | {r['agentkv_us']:.0f} | "
            f"{r['diff_us']:+.0f} ({lo:+.0f} to {hi:+.0f}) |"
        )
    share = section.get("added_share_of_step")
    if share is not None:
        lines += [
            "",
            f"What an agentkv server adds to a plain step outside the model forward: "
            f"**{rows[OUTSIDE]['diff_us']:+.0f} us**, {share * 100:+.2f}% of vanilla's step "
            f"({rows[STEP]['vanilla_us']:.0f} us). The forward itself moves between server "
            "starts by more than that; this part does not.",
        ]
    return lines
