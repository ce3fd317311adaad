"""Bounds a measured run is read against: what no cache policy can beat with its device memory.

Primitives:
  capacity_equal(workload, num_blocks, costs) -> Summary   the capacity-equal bound: the same
                        pool, every history available at zero load cost (policy
                        ``capacity-equal``), simulated on ``costs``
  trace_report_bound(report) -> dict | None   the bound of a trace-bench report (its trace,
                        scales and pool; engine costs fitted to its oracle run); None when the
                        report has no oracle run or its trace file is not on this machine

The infinite-memory oracle a trace bench measures removes two limits at once: evictions and the
pool's admission limit (a request waits until its blocks fit). The capacity-equal bound removes
only the first, so the gap between agentkv and it is what a better cache policy could still win,
and the gap between it and the oracle is what only more device memory buys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentkv.errors import AgentKVError
from agentkv.simulate.costs import BENCH_SMALL_CPU, EngineCosts, fit_rounds
from agentkv.simulate.fleet import FleetConfig, simulate
from agentkv.simulate.metrics import Summary
from agentkv.simulate.workload import SimWorkload


def capacity_equal(workload: SimWorkload, num_blocks: int, costs: EngineCosts) -> Summary:
    """The capacity-equal bound of ``workload`` on one replica of ``num_blocks`` blocks."""
    cfg = FleetConfig(
        policy="capacity-equal", num_blocks=num_blocks, host_capacity_gib=0.0, costs=costs
    )
    return simulate(workload, cfg).summary


def _trace_file(recorded: str) -> Path | None:
    if not recorded:
        return None
    path = Path(recorded)
    if path.is_file():
        return path
    shared = Path(__file__).resolve().parents[3] / "shared" / "traces" / path.name
    return shared if shared.is_file() else None


def trace_report_bound(report: dict[str, Any]) -> dict[str, Any] | None:
    """The capacity-equal bound of a trace-bench report (see the module docstring)."""
    from agentkv.simulate.workload import from_trace
    from agentkv.traces import load_trace

    oracle = (report.get("configs") or {}).get("oracle") or {}
    tr, srv = report.get("trace") or {}, report.get("server") or {}
    path = _trace_file(str(tr.get("path", "")))
    if not oracle.get("rounds") or path is None or not srv.get("num_blocks"):
        return None
    try:
        trace = load_trace(path)
        if tr.get("sessions_kept"):
            trace = trace.head(int(tr["sessions_kept"]))
        wl = from_trace(trace.scaled(tr.get("token_scale", 1.0), tr.get("time_scale", 1.0)))
        costs = fit_rounds(oracle["rounds"], BENCH_SMALL_CPU, "the oracle run")
        if costs.name != "fitted":
            # Another engine's costs (the built-in small model's) would make a "bound" that
            # the measured configurations beat by 10x: say why there is none instead.
            return {
                "how": "not computed: the oracle run could not be fitted",
                "num_blocks": int(srv["num_blocks"]),
                "summary": None,
                "notes": list(costs.notes),
            }
        s = capacity_equal(wl, int(srv["num_blocks"]), costs)
    except (AgentKVError, ValueError):
        # A bound is an extra line in a report; a trace that changed since must not break it.
        return None
    return {
        "how": "simulated: the same pool, every history at zero load cost; engine costs fitted "
        "to this report's oracle run",
        "num_blocks": int(srv["num_blocks"]),
        "summary": {
            "resume_ttft_p50_s": s.resume_ttft_p50_s,
            "resume_ttft_p99_s": s.resume_ttft_p99_s,
            "ttft_p50_s": s.ttft_p50_s,
            "jct_mean_s": s.jct_mean_s,
            "recomputed_tokens": s.recomputed_tokens,
            "resume_hit_rate": s.resume_hit_rate,
            "makespan_s": s.makespan_s,
        },
        "notes": list(costs.notes),
    }
