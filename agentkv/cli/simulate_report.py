"""What ``agentkv simulate`` prints: the results table (with the agentkv / vanilla ratio),
simulated vs measured, the replica search, and the validation protocol's table.

Primitives:
    fmt                 one cell: "-" for None, thousands separators, 3 decimals below 10.
    results_table       one column per router/policy; latency rows read "overloaded" when a
                        horizon cut an unbounded overload short (LATENCY_ROWS).
    compare_table       simulated vs measured with relative errors.
    search_table        the smallest fleet per router and policy.
    print_validation    predicted before the run vs measured, per row of the protocol (printed).
Only typer and rich are imported (rich inside the functions).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentkv.simulate.costs import EngineCosts
    from agentkv.simulate.fleet import SimResult

# Rows that mean nothing when a horizon cut an unbounded overload short (queues still growing).
LATENCY_ROWS = frozenset(
    {
        "resume_ttft_p50_s",
        "resume_ttft_p99_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "jct_mean_s",
        "makespan_s",
    }
)

SHOWN: tuple[tuple[str, str], ...] = (
    ("resume_ttft_p50_s", "resume TTFT p50 (s)"),
    ("resume_ttft_p99_s", "resume TTFT p99 (s)"),
    ("ttft_p50_s", "TTFT p50, all turns (s)"),
    ("ttft_p99_s", "TTFT p99, all turns (s)"),
    ("jct_mean_s", "job completion time, mean (s)"),
    ("recomputed_tokens", "tokens recomputed"),
    ("prefix_hit_rate", "prefix hit rate, all turns"),
    ("resume_hit_rate", "prefix hit rate, resume turns"),
    ("tier_hit_tokens", "tokens loaded from tiers"),
    ("decode_tok_s", "decode throughput per sequence (tok/s)"),
    ("makespan_s", "makespan (s)"),
    ("engine_busy", "engine busy (measured utilization)"),
    ("kv_usage_mean", "device KV in use, mean"),
    ("demotions", "demotions (pins given up)"),
    ("preemptions", "requests preempted (recompute)"),
    ("evicted_blocks", "device blocks evicted"),
)


def fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 10 else f"{x:,.1f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def results_table(results: dict[str, SimResult]) -> Any:
    from rich.table import Table

    labels = list(results)
    table = Table(title="agentkv simulate", title_justify="left")
    table.add_column("metric")
    for label in labels:
        table.add_column(label, justify="right")
    pair = None
    van = [k for k in labels if k.endswith("/vanilla")]
    akv = [k for k in labels if k.endswith("/agentkv")]
    if len(van) == 1 and len(akv) == 1:
        pair = (akv[0], van[0])
        table.add_column("agentkv / vanilla", justify="right")
    loads = [results[k].load for k in labels]
    if any(x is not None for x in loads):
        table.add_row(
            "offered load (utilization, peak)",
            *[f"{x.utilization:.2f}" if x is not None else "-" for x in loads],
            *([""] if pair else []),
        )
    for key, name in SHOWN:
        row = [name] + [
            "overloaded"
            if results[k].truncated and key in LATENCY_ROWS
            else fmt(results[k].summary.to_dict().get(key))
            for k in labels
        ]
        cut = pair is not None and any(results[k].truncated for k in pair)
        if pair is not None and cut and key in LATENCY_ROWS:
            row.append("-")
        elif pair is not None:
            a = results[pair[0]].summary.to_dict().get(key)
            v = results[pair[1]].summary.to_dict().get(key)
            ok = isinstance(a, (int, float)) and isinstance(v, (int, float)) and v
            row.append(f"{a / v:.3f}" if ok else "-")  # type: ignore[operator]
        table.add_row(*row)
    table.add_row(
        "pause decisions",
        *[
            ", ".join(f"{k} {n}" for k, n in results[k].summary.decisions.items()) or "-"
            for k in labels
        ],
        *([""] if pair else []),
    )
    for name, field in (("device prefetch", "prefetch"), ("deferred write-backs", "writebacks")):
        counts = [getattr(results[k].summary, field) for k in labels]
        if any(counts):
            table.add_row(
                name,
                *[", ".join(f"{k} {n}" for k, n in c.items()) or "-" for c in counts],
                *([""] if pair else []),
            )
    return table


def print_validation(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="predicted before the run vs measured", title_justify="left")
    for c in ("row", "commit", "config", "metric", "predicted", "measured", "error", "within"):
        table.add_column(
            c, justify="left" if c in ("row", "commit", "config", "metric") else "right"
        )
    for r in rows:
        commit = (r["commit"] or "uncommitted")[:9]
        if not r["metrics"]:
            table.add_row(r["row"], commit, "-", "not run yet", "", "", "", "")
            continue
        flag = "" if r.get("committed_before_run") else " (committed after the run)"
        flag += " (run with another command)" if r.get("same_command") is False else ""
        flag += "" if r["held_out"] else " (calibration fitted to the run)"
        for config, key, pv, mv, err, ok in r["metrics"]:
            table.add_row(
                r["row"] + flag,
                commit,
                config,
                key,
                fmt(pv),
                fmt(mv),
                "-" if err is None else f"{err:+.0%}",
                "-" if ok is None else ("yes" if ok else "NO"),
            )
    Console(width=160).print(table)


def compare_table(measured_rows: list[Any], costs: EngineCosts) -> Any:
    """Simulated vs measured (``agentkv.simulate.validate.compare`` rows)."""
    from rich.table import Table

    from agentkv.simulate.costs import Provenance

    title = "simulated vs measured"
    if costs.provenance is Provenance.FITTED_TO_RUN:
        title += " (engine costs fitted to the run: not a held-out prediction)"
    t = Table(title=title, title_justify="left")
    for c in ("config", "metric", "simulated", "measured", "error", "within 25%"):
        t.add_column(c, justify="left" if c in ("config", "metric") else "right")
    for row in measured_rows:
        t.add_row(
            row.config,
            row.metric,
            fmt(row.simulated),
            fmt(row.measured),
            "-" if row.rel_error is None else f"{row.rel_error:+.1%}",
            "-" if row.within is None else ("yes" if row.within else "NO"),
        )
    return t


def search_table(found: list[Any], slo: float, rate: float | None, max_replicas: int) -> Any:
    """The smallest fleet per router and policy (``agentkv.simulate.search`` results)."""
    from rich.table import Table

    table = Table(
        title=f"smallest fleet for TTFT p99 <= {slo:g} s at {rate:g} trajectories/s",
        title_justify="left",
    )
    for c in (
        "router",
        "policy",
        "replicas",
        "TTFT p99 (s)",
        "resume TTFT p50 (s)",
        "hit rate",
        "probes (replicas: p99)",
    ):
        table.add_column(c, justify="left" if c in ("router", "policy") else "right")
    for f in found:
        s = f.result.summary if f.result is not None else None
        table.add_row(
            f.router,
            f.policy,
            str(f.replicas) if f.replicas else f"> {max_replicas}",
            fmt(f.ttft_p99_s),
            fmt(s.resume_ttft_p50_s if s else None),
            fmt(s.prefix_hit_rate if s else None),
            ", ".join(f"{n}: {fmt(v)}" for n, v in sorted(f.probes.items())),
        )
    return table
