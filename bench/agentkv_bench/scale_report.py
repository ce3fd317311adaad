"""The report of ``agentkv bench scale`` (scale.py runs it): pure math over recorded phases.

Primitives:
  latency_stats(latencies_s)      p50 / p90 / mean / min / max in ms
  phase_summary(kind, round_, latencies_s, before, after, wall_s, status?, background_cores?)
                                  one phase: latencies, connector CPU between two probes, table
  pooled(phases, kind)            every phase of a kind together; step_us(phase): CPU per step
  bracketed(phases)               each held phase over the mean of its neighbours in time
  ratios(phases) / targets(r)     held/none (median of the bracketed rounds), pooled, deleted/none;
                                  the issue's "within 5%" targets
  build_report(...) / to_markdown(report)   report.json's dict (SCHEMA) and report.md
  KINDS, SCHEMA, TARGET_RATIO, Phase
Why each held phase is bracketed by its neighbours: scale.py's docstring.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentkv_bench import connector_cpu
from agentkv_bench.report import percentile

SCHEMA = "agentkv-bench-scale/1"
KINDS = ("none", "held", "deleted")
TARGET_RATIO = 1.05  # "within 5%"

Phase = dict[str, Any]


def latency_stats(latencies_s: Sequence[float]) -> dict[str, float | None]:
    """p50 / p90 / mean / min / max of the latencies, in milliseconds."""
    ms = [x * 1000.0 for x in latencies_s]
    return {
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "mean_ms": sum(ms) / len(ms) if ms else None,
        "min_ms": min(ms) if ms else None,
        "max_ms": max(ms) if ms else None,
    }


def phase_summary(
    kind: str,
    round_: int,
    latencies_s: Sequence[float],
    before: Mapping[str, Any] | None,
    after: Mapping[str, Any] | None,
    wall_s: float,
    status: Mapping[str, Any] | None = None,
    background_cores: float | None = None,
) -> Phase:
    """One phase: latency stats and the connector CPU between two ``connector_cpu.read_probe``
    results. ``status``: the server's status body just before the phase. ``background_cores``:
    CPU used meanwhile by processes other than the server and the bench, in cores."""
    d, steps = connector_cpu.probe_delta(before, after)
    cpu = connector_cpu.figures(d, wall_s=wall_s, requests=0, engine_steps=steps)
    status = status or {}
    host = ((status.get("tiers") or {}).get("host")) or {}
    return {
        "kind": kind,
        "round": round_,
        "requests": len(latencies_s),
        "latencies_ms": [round(x * 1000.0, 3) for x in latencies_s],
        **latency_stats(latencies_s),
        "wall_s": wall_s,
        "background_cores": background_cores,
        "connector_cpu": cpu,
        "trajectories": status.get("trajectories"),
        "branches_by_state": {
            k: v for k, v in (status.get("branches_by_state") or {}).items() if v
        },
        "host_blocks": host.get("blocks"),
        "host_bytes": host.get("bytes"),
    }


def step_us(phase: Mapping[str, Any]) -> float | None:
    """Connector CPU per engine step (µs): per vLLM engine step when the server's metrics
    counted them, else per step-hook call."""
    cpu = phase.get("connector_cpu") or {}
    v = cpu.get("step_us_per_engine_step")
    return v if v is not None else cpu.get("step_us_per_call")


def pooled(phases: Sequence[Mapping[str, Any]], kind: str) -> dict[str, Any] | None:
    """All phases of ``kind`` together: latency stats over every request, connector CPU per
    step = all their step CPU over all their engine steps (or step-hook calls)."""
    sel = [p for p in phases if p["kind"] == kind]
    if not sel:
        return None
    lat = [x / 1000.0 for p in sel for x in p["latencies_ms"]]
    cpus = [p.get("connector_cpu") or {} for p in sel]
    cpu_s = sum(c.get("step_cpu_s") or 0.0 for c in cpus)
    calls = sum(c.get("step_calls") or 0 for c in cpus)
    counted = [c.get("engine_steps") for c in cpus]
    steps = sum(int(s) for s in counted if s is not None) if None not in counted else None
    per_step = _per_us(cpu_s, steps) if steps else _per_us(cpu_s, calls)
    bg = [p["background_cores"] for p in sel if p.get("background_cores") is not None]
    last = sel[-1]
    return {
        "kind": kind,
        "phases": len(sel),
        "requests": len(lat),
        **latency_stats(lat),
        "step_us": per_step,
        "step_calls": calls,
        "engine_steps": steps,
        "background_cores_mean": sum(bg) / len(bg) if bg else None,
        "trajectories": last.get("trajectories"),
        "host_blocks": last.get("host_blocks"),
    }


def _per_us(cpu_s: float, n: int | None) -> float | None:
    return cpu_s * 1e6 / n if n else None


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def _mean_of(
    phases: Sequence[Mapping[str, Any]], get: Callable[[Mapping[str, Any]], float | None]
) -> float | None:
    vals = [v for v in map(get, phases) if v is not None]
    return sum(vals) / len(vals) if vals else None


def bracketed(phases: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """For each held phase: its p50 / p90 latency and per-step CPU over the mean of its
    neighbours in time without trajectories (the phase just before and just after)."""
    out = []
    for i, p in enumerate(phases):
        if p["kind"] != "held":
            continue
        nb = [
            q
            for q in (
                phases[i - 1] if i > 0 else None,
                phases[i + 1] if i + 1 < len(phases) else None,
            )
            if q is not None and q["kind"] != "held"
        ]
        if not nb:
            continue
        b50 = _mean_of(nb, lambda q: q.get("p50_ms"))
        b90 = _mean_of(nb, lambda q: q.get("p90_ms"))
        bcpu = _mean_of(nb, step_us)
        out.append(
            {
                "round": p["round"],
                "p50_ms": p.get("p50_ms"),
                "base_p50_ms": b50,
                "p50_latency": _ratio(p.get("p50_ms"), b50),
                "p90_latency": _ratio(p.get("p90_ms"), b90),
                "step_us": step_us(p),
                "base_step_us": bcpu,
                "step_cpu": _ratio(step_us(p), bcpu),
            }
        )
    return out


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def ratios(phases: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``held/none``: median over rounds of the bracketed ratios (the headline).
    ``held/none pooled``: all held requests against all requests without trajectories.
    ``deleted/none``: after deleting against the fresh server (drift over the run)."""
    rounds = bracketed(phases)
    fresh, held, deleted = (pooled(phases, k) for k in KINDS)
    empty = [p for p in phases if p["kind"] != "held"]
    no_traj = pooled([{**p, "kind": "x"} for p in empty], "x")

    def pair(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> dict[str, Any]:
        if a is None or b is None:
            return {"p50_latency": None, "p90_latency": None, "step_cpu": None}
        return {
            "p50_latency": _ratio(a.get("p50_ms"), b.get("p50_ms")),
            "p90_latency": _ratio(a.get("p90_ms"), b.get("p90_ms")),
            "step_cpu": _ratio(a.get("step_us"), b.get("step_us")),
        }

    return {
        "held/none": {
            "p50_latency": _median([r["p50_latency"] for r in rounds]),
            "p90_latency": _median([r["p90_latency"] for r in rounds]),
            "step_cpu": _median([r["step_cpu"] for r in rounds]),
            "rounds": rounds,
        },
        "held/none pooled": pair(held, no_traj),
        "deleted/none": pair(deleted, fresh),
    }


def targets(r: Mapping[str, Any], limit: float = TARGET_RATIO) -> list[dict[str, Any]]:
    """The issue's targets: with the idle trajectories held, the plain request's p50 latency and
    the connector's CPU per engine step within 5% of none (bracketed, median over rounds)."""
    held = r.get("held/none") or {}
    out = []
    for key, label in (
        ("p50_latency", "plain request p50 latency, held / none"),
        ("step_cpu", "connector CPU per engine step, held / none"),
    ):
        m = held.get(key)
        out.append(
            {
                "name": label,
                "goal": f"<= {limit:.2f}",
                "measured": m,
                "met": None if m is None else m <= limit,
            }
        )
    return out


def build_report(
    *,
    command: str,
    machine: Mapping[str, Any],
    server: Mapping[str, Any],
    options: Mapping[str, Any],
    idle: Sequence[Mapping[str, Any]],
    phases: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    r = ratios(phases)
    return {
        "schema": SCHEMA,
        "command": command,
        "machine": dict(machine),
        "server": dict(server),
        "options": dict(options),
        "idle_rounds": [dict(x) for x in idle],
        "phases": [dict(p) for p in phases],
        "summary": {k: pooled(phases, k) for k in KINDS},
        "ratios": r,
        "targets": targets(r),
    }


def _f(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def to_markdown(report: Mapping[str, Any]) -> str:
    opts, srv = report["options"], report["server"]
    idle = report["idle_rounds"]
    lines = [
        "# agentkv bench scale",
        "",
        f"`{report['command']}`",
        "",
        f"Model `{srv.get('preset')}`, {srv.get('num_blocks')} device KV blocks, host tier "
        f"{srv.get('host_capacity_gib')} GiB. Each phase: {opts.get('requests')} sequential plain "
        f"requests ({opts.get('prompt_tokens')}-token prompt, {opts.get('output_tokens')} greedy "
        "output tokens, no trajectory), timed by the client; connector CPU = the difference of "
        "`connector_cpu.step` in `GET /agentkv/v1/status` over the phase, per engine step "
        f"(vLLM's step count). {opts.get('rounds')} rounds of create / held / delete / deleted; "
        "columns pool the phases of each kind.",
        "",
        *_summary_table(report),
        "",
        "Per round, each held phase against the mean of its neighbours without trajectories:",
        "",
        *_rounds_table(report["ratios"]["held/none"]["rounds"]),
        "",
        *_ratios_table(report["ratios"]),
        "",
        *_targets_table(report["targets"]),
        "",
    ]
    for i, x in enumerate(idle):
        lines.append(
            f"Round {i}: {x.get('created')} idle trajectories created in "
            f"{_f(x.get('create_s'))} s (concurrency {opts.get('concurrency')}, mean prompt "
            f"{_f(x.get('prompt_tokens_mean'))} tokens), settled (grace expired, stores done) "
            f"{_f(x.get('settle_s'))} s later; deleted in {_f(x.get('delete_s'))} s."
        )
    lines.append("")
    return "\n".join(lines)


def _summary_table(report: Mapping[str, Any]) -> list[str]:
    """One column per phase kind (the phases of a kind pooled), one row per figure."""
    summ = {k: v for k, v in report["summary"].items() if v is not None}
    idle = report["idle_rounds"]
    created = idle[0].get("created") if idle else report["options"].get("idle")
    names = [k for k in KINDS if k in summ]
    labels = {
        "none": "no trajectories (fresh server)",
        "held": f"{created} idle trajectories held",
        "deleted": "after deleting them",
    }
    lines = [
        "| | " + " | ".join(labels[n] for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for label, key, digits in (
        ("phases", "phases", 1),
        ("trajectories in the table", "trajectories", 1),
        ("host tier blocks", "host_blocks", 1),
        ("plain request latency p50 (ms)", "p50_ms", 1),
        ("plain request latency p90 (ms)", "p90_ms", 1),
        ("plain request latency mean (ms)", "mean_ms", 1),
        ("engine steps", "engine_steps", 1),
        ("connector CPU per engine step (µs)", "step_us", 2),
        ("other processes' CPU meanwhile (cores)", "background_cores_mean", 2),
    ):
        lines.append(
            f"| {label} | " + " | ".join(_f(summ[n].get(key), digits) for n in names) + " |"
        )
    return lines


def _rounds_table(rounds: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [
        "| round | p50 before/after (ms) | p50 held (ms) | p50 ratio | CPU/step before/after (µs) "
        "| CPU/step held (µs) | CPU ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rounds:
        lines.append(
            f"| {r['round']} | {_f(r['base_p50_ms'])} | {_f(r['p50_ms'])} | "
            f"{_f(r['p50_latency'], 3)} | {_f(r['base_step_us'], 2)} | {_f(r['step_us'], 2)} | "
            f"{_f(r['step_cpu'], 3)} |"
        )
    return lines


def _ratios_table(ratios_: Mapping[str, Mapping[str, Any]]) -> list[str]:
    lines = [
        "| ratio | p50 latency | p90 latency | connector CPU per step |",
        "|---|---:|---:|---:|",
    ]
    for key, r in ratios_.items():
        label = f"{key} (median of rounds)" if key == "held/none" else key
        lines.append(
            f"| {label} | {_f(r.get('p50_latency'), 3)} | {_f(r.get('p90_latency'), 3)} | "
            f"{_f(r.get('step_cpu'), 3)} |"
        )
    return lines


def _targets_table(targets_: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["| target | goal | measured | met |", "|---|---|---:|---|"]
    for t in targets_:
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {t['name']} | {t['goal']} | {_f(t['measured'], 3)} | {met} |")
    return lines
