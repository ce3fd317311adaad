"""A configuration x pool-size sweep's report: every metric per cell, the agentkv policy's regret
against the best fixed policy, the issue's targets, JSON and markdown.

Primitives:
  SWEEP_METRICS        (key, label, unit, higher_is_better) of the metrics a sweep compares
  worse_ratio(x, best, higher_is_better) how many times worse ``x`` is than ``best`` (1.0 = as
                       good, < 1 = better; None when either is missing or the divisor is 0)
  Regret               agentkv against the best fixed policy on one metric at one pool size
  regret(cells, metric) -> Regret | None   from {config name: summary dict} of one pool size
  pool_section(pool, summaries, bound) -> dict   one pool size: the cells, regrets, targets
  per_repeat_ratios(repeats) -> {metric: [agentkv / vanilla per repeat]} (worse direction)
  build_sweep(...) -> dict   the JSON report (schema SCHEMA)
  sweep_markdown(report) -> str

With ``--repeats N`` (N > 1) every pool size ran each configuration N times (``repeats``): a
cell is the per-metric median over the repeats, regret and targets are computed from those
medians, and the pool's ``repeats`` section keeps each repeat's raw value (the markdown shows
``median (min-max)``) and agentkv / vanilla per repeat on the target metrics, so whether the
sign holds is visible. The report says ``"aggregate": "median of N repeats"``.

Regret is read in the "worse" direction for every metric: for a lower-is-better metric (TTFT,
JCT, tokens prefilled, writebacks) it is agentkv / best, for a higher-is-better one (decode
throughput) best / agentkv. 1.05 means agentkv is 5% worse than the best fixed policy on that
metric at that pool size; below 1 it beats every fixed policy. The fixed policies are
``matrix.FIXED_POLICIES`` among the configurations that ran; the oracle and the
capacity-equal bound are bounds, not policies, and are shown next to them.

Targets (issue 26): at every pool size and on each of resume TTFT p50 and p99, mean JCT and
decode throughput per sequence, agentkv <= 1.05x vanilla (never worse) and <= 1.05x the best of
retain-always / offload-always.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from agentkv_bench.matrix import FIXED_POLICIES, BenchConfig
from agentkv_bench.repeats import RepeatSummaries, merge, numbers

SCHEMA = "agentkv-bench-sweep/1"
FIXED_NAMES: tuple[str, ...] = tuple(str(c) for c in FIXED_POLICIES)

SWEEP_METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("resume_ttft_p50_s", "resume TTFT p50", "s", False),
    ("resume_ttft_p99_s", "resume TTFT p99", "s", False),
    ("jct_mean_s", "job completion time, mean", "s", False),
    ("decode_tok_s", "decode throughput per sequence", "tok/s", True),
    ("recomputed_tokens", "tokens prefilled", "tok", False),
    ("writeback_blocks", "blocks written back", "blocks", False),
    ("control_p50_s", "pause + resume calls per wait, p50", "s", False),
)
# The metrics the targets hold agentkv to.
TARGET_METRICS = ("resume_ttft_p50_s", "resume_ttft_p99_s", "jct_mean_s", "decode_tok_s")
TARGET_FACTOR = 1.05


def worse_ratio(x: Any, best: Any, higher_is_better: bool) -> float | None:
    """How many times worse ``x`` is than ``best`` in the metric's own direction."""
    if not isinstance(x, (int, float)) or not isinstance(best, (int, float)):
        return None
    num, den = (best, x) if higher_is_better else (x, best)
    if den == 0:
        return 1.0 if num == 0 else None
    return float(num) / float(den)


def _best(values: Mapping[str, Any], higher_is_better: bool) -> tuple[str, float] | None:
    usable = [(n, float(v)) for n, v in values.items() if isinstance(v, (int, float))]
    if not usable:
        return None
    pick = max if higher_is_better else min
    return pick(usable, key=lambda nv: nv[1])


@dataclass(frozen=True)
class Regret:
    metric: str
    agentkv: float | None
    best_fixed: str  # the configuration
    best_value: float
    over_best_fixed: float | None  # worse_ratio(agentkv, best)
    fixed_values: dict[str, float | None]

    @property
    def regret_pct(self) -> float | None:
        r = self.over_best_fixed
        return None if r is None else (r - 1.0) * 100.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "regret_pct": self.regret_pct}


def _metric(key: str) -> tuple[str, str, str, bool]:
    for m in SWEEP_METRICS:
        if m[0] == key:
            return m
    raise KeyError(key)


def regret(
    summaries: Mapping[str, Mapping[str, Any]],
    key: str,
    fixed: Sequence[str] = FIXED_NAMES,
) -> Regret | None:
    """agentkv against the best of the ``fixed`` configurations present with a value for
    ``key``; None without agentkv or without any such configuration."""
    if BenchConfig.AGENTKV.value not in summaries:
        return None
    higher = _metric(key)[3]
    values = {n: summaries[n].get(key) for n in fixed if n in summaries}
    best = _best(values, higher)
    if best is None:
        return None
    a = summaries[BenchConfig.AGENTKV.value].get(key)
    return Regret(
        metric=key,
        agentkv=float(a) if isinstance(a, (int, float)) else None,
        best_fixed=best[0],
        best_value=best[1],
        over_best_fixed=worse_ratio(a, best[1], higher),
        fixed_values={
            n: (float(v) if isinstance(v, (int, float)) else None) for n, v in values.items()
        },
    )


@dataclass(frozen=True)
class SweepTarget:
    pool: int
    metric: str
    against: str  # "vanilla" or "best of retain-always / offload-always"
    ratio: float | None
    met: bool | None  # None: not measured (a configuration or metric missing)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def targets(pool: int, summaries: Mapping[str, Mapping[str, Any]]) -> list[SweepTarget]:
    out: list[SweepTarget] = []
    fixed_two = (BenchConfig.RETAIN_ALWAYS.value, BenchConfig.OFFLOAD_ALWAYS.value)
    for key in TARGET_METRICS:
        for against, fixed in (
            ("vanilla", (BenchConfig.VANILLA.value,)),
            ("best of retain-always / offload-always", fixed_two),
        ):
            r = regret(summaries, key, fixed)
            ratio = None if r is None else r.over_best_fixed
            out.append(
                SweepTarget(
                    pool, key, against, ratio, None if ratio is None else ratio <= TARGET_FACTOR
                )
            )
    return out


def pool_section(
    pool: int,
    summaries: Mapping[str, Mapping[str, Any]],
    bound: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One pool size: each configuration's SWEEP_METRICS, agentkv's regret per metric, the
    targets, and the capacity-equal bound's summary when the simulator gave one."""
    regrets = {}
    for key, *_ in SWEEP_METRICS:
        r = regret(summaries, key)
        if r is not None:
            regrets[key] = r.to_dict()
    return {
        "num_blocks": pool,
        "metrics": {
            n: {k: s.get(k) for k, *_ in SWEEP_METRICS} | {"decisions": s.get("decisions") or {}}
            for n, s in summaries.items()
        },
        "regret": regrets,
        "targets": [t.to_dict() for t in targets(pool, summaries)],
        "capacity_equal_bound": dict(bound) if bound else None,
    }


def per_repeat_ratios(repeats: Sequence[RepeatSummaries]) -> dict[str, list[float | None]]:
    """agentkv / vanilla in each repeat on each TARGET_METRICS metric, in the metric's worse
    direction (vanilla / agentkv for throughput, as the targets), so > 1 always means agentkv
    was worse in that repeat and a reader sees whether the sign holds; {} without both."""
    a, v = BenchConfig.AGENTKV.value, BenchConfig.VANILLA.value
    if not any(a in rep and v in rep for rep in repeats):
        return {}
    return {
        key: [
            worse_ratio((rep.get(a) or {}).get(key), (rep.get(v) or {}).get(key), _metric(key)[3])
            for rep in repeats
        ]
        for key in TARGET_METRICS
    }


def _pool(
    pool: int,
    repeats: Sequence[RepeatSummaries],
    bound: Mapping[str, Any] | None,
    orders: Sequence[Sequence[str]] | None,
) -> dict[str, Any]:
    """One pool size from its repeats: one repeat is today's section; several are merged (the
    cells, regret and targets read the medians) and the section keeps every raw value."""
    if len(repeats) == 1:
        return pool_section(pool, repeats[0], bound)
    merged = merge(repeats, [k for k, *_ in SWEEP_METRICS])
    sec = pool_section(pool, merged.medians, bound)
    sec["repeats"] = {
        "count": len(repeats),
        "aggregate": aggregate_label(len(repeats)),
        "order": [list(o) for o in orders] if orders else None,
        "values": merged.values,
        "agentkv_over_vanilla": per_repeat_ratios(repeats),
    }
    return sec


def aggregate_label(repeats: int) -> str:
    return f"median of {repeats} repeats"


def build_sweep(
    *,
    kind: str,
    command: str,
    machine: Mapping[str, Any],
    configs: Sequence[str],
    pools: Mapping[int, Sequence[RepeatSummaries]],
    oracle: Mapping[str, Any] | None,
    bounds: Mapping[int, Mapping[str, Any] | None] | None = None,
    reports: Mapping[int, str] | None = None,
    conditions: str = "",
    orders: Mapping[int, Sequence[Sequence[str]]] | None = None,
) -> dict[str, Any]:
    """``pools``: pool size -> its repeats, each {configuration: summary dict} (the oracle not
    among them; one repeat without --repeats); ``oracle``: the oracle's summary (one run, its
    own pool); ``reports``: pool size -> the folder of that pool's full single-pool report(s);
    ``orders``: pool size -> the order the configurations ran in, per repeat. With several
    repeats the report says ``repeats`` and ``aggregate`` at the top."""
    bounds = bounds or {}
    count = max((len(r) for r in pools.values()), default=1)
    head: dict[str, Any] = {
        "schema": SCHEMA,
        "kind": kind,
        "command": command,
        "conditions": conditions,
    }
    if count > 1:
        head |= {"repeats": count, "aggregate": aggregate_label(count)}
    return head | {
        "machine": dict(machine),
        "configs": list(configs),
        "fixed_policies": [c.value for c in FIXED_POLICIES if c.value in configs],
        "oracle": {k: oracle.get(k) for k, *_ in SWEEP_METRICS} if oracle else None,
        "pools": [
            {
                **_pool(n, reps, bounds.get(n), (orders or {}).get(n)),
                "report": (reports or {}).get(n),
            }
            for n, reps in pools.items()
        ],
    }


def _fmt(x: Any, unit: str) -> str:
    if x is None:
        return "-"
    if unit in ("tok", "blocks"):
        return f"{x:,.0f}"
    if unit == "tok/s":
        return f"{x:.1f}"
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def _targets_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Metric x (against vanilla, against the best fixed action): the ratio and met / NOT met."""
    against = list(dict.fromkeys(str(t["against"]) for t in rows))
    out = [
        f"| target (agentkv <= {TARGET_FACTOR}x) | "
        + " | ".join(f"vs {a}" for a in against)
        + " |",
        "|---|" + "---:|" * len(against),
    ]
    for key in dict.fromkeys(str(t["metric"]) for t in rows):
        cells = []
        for a in against:
            t = next((t for t in rows if t["metric"] == key and t["against"] == a), None)
            if t is None or t["met"] is None:
                cells.append("not measured")
            else:
                cells.append(f"{t['ratio']:.3f} {'met' if t['met'] else 'NOT met'}")
        out.append(f"| {_metric(key)[1]} | " + " | ".join(cells) + " |")
    return out


def _cell(sec: Mapping[str, Any], name: str, key: str, unit: str) -> str:
    """The median and, with several repeats, the min-max of the repeats' values (and how many
    had the metric when some did not): ``0.093 (0.081-0.120)``."""
    text = _fmt(sec["metrics"][name].get(key), unit)
    reps = sec.get("repeats")
    if not reps:
        return text
    raw = reps["values"].get(name, {}).get(key) or []
    nums = numbers(raw)
    if not nums:
        return text
    spread = f"{_fmt(min(nums), unit)}-{_fmt(max(nums), unit)}"
    if len(nums) < len(raw):
        spread += f", {len(nums)} of {len(raw)}"
    return f"{text} ({spread})"


def _metrics_table(sec: Mapping[str, Any], oracle: Mapping[str, Any] | None) -> list[str]:
    """Configurations as columns (then the bound, the oracle, agentkv / best fixed and which)."""
    names = list(sec["metrics"])
    extra = ["capacity-equal bound"] if sec.get("capacity_equal_bound") else []
    extra += ["oracle"] if oracle else []
    head = "| metric | " + " | ".join(names)
    head += "".join(f" | {e}" for e in extra) + " | agentkv regret | best fixed |"
    lines = [head, "|---|" + "---:|" * (len(names) + len(extra) + 1) + "---|"]
    for key, label, unit, _ in SWEEP_METRICS:
        row = f"| {label}{f' ({unit})' if unit else ''} | "
        row += " | ".join(_cell(sec, n, key, unit) for n in names)
        if sec.get("capacity_equal_bound"):
            row += f" | {_fmt(sec['capacity_equal_bound'].get(key), unit)}"
        if oracle:
            row += f" | {_fmt(oracle.get(key), unit)}"
        r = sec["regret"].get(key)
        ratio = None if r is None else r.get("over_best_fixed")
        row += f" | {'-' if ratio is None else f'{ratio:.3f}'}"
        row += f" | {'-' if r is None else r['best_fixed']} |"
        lines.append(row)
    return lines


def _ratios_table(reps: Mapping[str, Any]) -> list[str]:
    """agentkv / vanilla per repeat on the target metrics (worse direction), with each
    repeat's run order, so a reader sees whether the sign holds from repeat to repeat."""
    ratios: Mapping[str, Sequence[float | None]] = reps.get("agentkv_over_vanilla") or {}
    if not ratios:
        return []
    count = int(reps["count"])
    order = reps.get("order") or []
    heads = [
        f"rep {k + 1}" + (f" ({', '.join(order[k])})" if k < len(order) else "")
        for k in range(count)
    ]
    lines = [
        "| agentkv / vanilla per repeat (> 1: agentkv worse) | " + " | ".join(heads) + " |",
        "|---|" + "---:|" * count,
    ]
    for key, row in ratios.items():
        cells = ["-" if x is None else f"{x:.3f}" for x in row]
        lines.append(f"| {_metric(key)[1]} | " + " | ".join(cells) + " |")
    return ["", *lines]


def _decisions_line(sec: Mapping[str, Any]) -> list[str]:
    decided = {n: m["decisions"] for n, m in sec["metrics"].items() if m.get("decisions")}
    if not decided:
        return []
    reps = sec.get("repeats")
    label = f"Pause decisions (all {reps['count']} repeats)" if reps else "Pause decisions"
    return [
        "",
        f"{label}: "
        + "; ".join(
            f"{n} " + ", ".join(f"{k} {v}" for k, v in sorted(d.items()))
            for n, d in decided.items()
        ),
    ]


def _repeats_note(report: Mapping[str, Any]) -> list[str]:
    if not report.get("repeats"):
        return []
    return [
        f"Each cell is the {report['aggregate']} (their min-max in brackets; every raw value is "
        "in sweep.json); regret and targets are computed from the medians. The configurations "
        "ran in the given order in repeats 1, 3, ... and reversed in 2, 4, ... (ABBA), so an "
        "order effect (the first server after a pause or warm-up) falls on each alike.",
        "",
    ]


def sweep_markdown(report: Mapping[str, Any]) -> str:
    """Per pool size: the metrics table (configurations as columns, then agentkv / best fixed
    and which one that was), agentkv / vanilla per repeat, the decisions, the targets."""
    lines = [f"# agentkv bench agents: fixed-policy sweep ({report['kind']})", ""]
    lines += [f"`{report['command']}`", ""]
    if report.get("conditions"):
        lines += [report["conditions"], ""]
    lines += _repeats_note(report)
    lines += [
        "Regret = agentkv / the best fixed policy (" + ", ".join(report["fixed_policies"]) + ") "
        "in the metric's worse direction: 1.05 = 5% worse; < 1 = better than every fixed policy.",
        "",
    ]
    for sec in report["pools"]:
        lines += [f"## {sec['num_blocks']} device blocks", ""]
        lines += _metrics_table(sec, report.get("oracle"))
        if sec.get("repeats"):
            lines += _ratios_table(sec["repeats"])
        lines += _decisions_line(sec)
        lines += ["", *_targets_table(sec["targets"]), ""]
        if sec.get("report"):
            if sec.get("repeats"):
                lines += [f"Full reports of this pool, one per repeat: `{sec['report']}/rep-*`", ""]
            else:
                lines += [f"Full report of this pool: `{sec['report']}`", ""]
    return "\n".join(lines)
