"""Per-configuration metrics, agentkv/vanilla ratios, targets, JSON and markdown.

Primitives:
  percentile(xs, q)         re-exported from agentkv.stats (one definition for bench and simulate)
  summarize(turns, trajs, samples, makespan_s) -> ConfigSummary
  ratios(a, b)              a / b for every shared numeric metric (None where b is 0 or missing)
  writebacks(status)        blocks the connector copied to a tier (its status counters)
  targets(summaries, overhead) -> [Target]   the issue's three targets, met or not
  connector_cpu_section(configs, overhead)   the connector's measured CPU, both workloads
  build_report(...)         the JSON-able report (schema SCHEMA)
  to_markdown(report)       the summary table a person reads

Every metric is "lower is better" except hit rates and throughputs; ``ratios`` is always
agentkv / vanilla, and a target on a lower-is-better metric is met when vanilla / agentkv
reaches the factor.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agentkv import stats
from agentkv.stats import mean, percentile
from agentkv_bench.drivers import TrajectoryRecord, TurnRecord
from agentkv_bench.prefetch_report import prefetch_markdown, prefetch_section
from agentkv_bench.sampler import Sample

SCHEMA = "agentkv-bench-agents/1"

# (key, label, unit, higher_is_better)
METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("resume_ttft_p50_s", "resume TTFT p50", "s", False),
    ("resume_ttft_p99_s", "resume TTFT p99", "s", False),
    ("ttft_p50_s", "TTFT p50, all turns", "s", False),
    ("ttft_p99_s", "TTFT p99, all turns", "s", False),
    ("jct_mean_s", "job completion time, mean", "s", False),
    ("jct_p50_s", "job completion time, p50", "s", False),
    ("jct_max_s", "job completion time, max", "s", False),
    ("recomputed_tokens", "tokens recomputed", "tok", False),
    ("resume_recomputed_tokens", "tokens recomputed on resume turns", "tok", False),
    ("prefix_hit_rate", "prefix hit rate, all turns", "", True),
    ("resume_hit_rate", "prefix hit rate, resume turns", "", True),
    ("decode_tok_s", "decode throughput per sequence", "tok/s", True),
    ("output_tok_s", "output tokens per second of makespan", "tok/s", True),
    ("makespan_s", "makespan", "s", False),
    ("kv_usage_mean", "device KV usage, mean", "", False),
)
# Shown, not a ratio target: None for configurations without a connector.
WRITEBACKS = ("writeback_blocks", "blocks written back (agentkv stores)", "blocks", False)


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


@dataclass
class ConfigSummary:
    name: str
    turns: int
    resume_turns: int
    resume_ttft_p50_s: float | None
    resume_ttft_p99_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    ttft_mean_s: float | None
    jct_mean_s: float | None
    jct_p50_s: float | None
    jct_max_s: float | None
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    resume_recomputed_tokens: int
    tier_hit_tokens: int | None
    prefix_hit_rate: float | None
    resume_hit_rate: float | None
    decode_tok_s: float | None
    output_tok_s: float | None
    makespan_s: float
    kv_usage_mean: float | None
    kv_usage_max: float | None
    decisions: dict[str, int] = field(default_factory=dict)
    hit_rate_by_turn: dict[str, float] = field(default_factory=dict)
    writeback_blocks: int | None = None  # status counters store_blocks; None: no connector

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    name: str,
    turns: Sequence[TurnRecord],
    trajectories: Sequence[TrajectoryRecord],
    samples: Sequence[Sample],
    makespan_s: float,
) -> ConfigSummary:
    """Reduce one configuration's records to its metrics.

    Decode throughput per sequence is sum(completion tokens - 1) / sum(latency - TTFT): the
    tokens after the first over the time spent producing them, batching included.
    """
    resume = [t for t in turns if t.kind == "resume"]
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    decode_tokens = sum(max(0, t.completion_tokens - 1) for t in turns)
    decode_time = sum(max(0.0, t.latency_s - t.ttft_s) for t in turns)
    tier = [t.tier_hit_tokens for t in turns if t.tier_hit_tokens is not None]
    usage = [s.kv_usage for s in samples if s.kv_usage is not None]
    jct = [r.jct_s for r in trajectories]
    by_turn: dict[int, list[TurnRecord]] = {}
    for t in turns:
        by_turn.setdefault(t.turn, []).append(t)
    decisions: dict[str, int] = {}
    for t in resume:
        if t.decision is not None:
            decisions[t.decision] = decisions.get(t.decision, 0) + 1
    return ConfigSummary(
        name=name,
        turns=len(turns),
        resume_turns=len(resume),
        resume_ttft_p50_s=percentile([t.ttft_s for t in resume], 50),
        resume_ttft_p99_s=percentile([t.ttft_s for t in resume], 99),
        ttft_p50_s=percentile([t.ttft_s for t in turns], 50),
        ttft_p99_s=percentile([t.ttft_s for t in turns], 99),
        ttft_mean_s=mean([t.ttft_s for t in turns]),
        jct_mean_s=mean(jct),
        jct_p50_s=percentile(jct, 50),
        jct_max_s=max(jct) if jct else None,
        prompt_tokens=prompt,
        cached_tokens=cached,
        recomputed_tokens=sum(t.recomputed_tokens for t in turns),
        resume_recomputed_tokens=sum(t.recomputed_tokens for t in resume),
        tier_hit_tokens=sum(tier) if tier else None,
        prefix_hit_rate=_ratio(cached, prompt),
        resume_hit_rate=_ratio(
            sum(t.cached_tokens for t in resume), sum(t.prompt_tokens for t in resume)
        ),
        decode_tok_s=decode_tokens / decode_time if decode_time > 0 else None,
        output_tok_s=sum(t.completion_tokens for t in turns) / makespan_s
        if makespan_s > 0
        else None,
        makespan_s=makespan_s,
        kv_usage_mean=mean(usage),
        kv_usage_max=max(usage) if usage else None,
        decisions=decisions,
        hit_rate_by_turn={
            str(k): sum(t.cached_tokens for t in v) / max(1, sum(t.prompt_tokens for t in v))
            for k, v in sorted(by_turn.items())
        },
    )


def writebacks(status: dict[str, Any]) -> int | None:
    """Blocks the connector copied to a tier over a run (status ``counters.store_blocks``);
    None without a connector (an empty status)."""
    counters = status.get("counters") if status else None
    if not isinstance(counters, dict):
        return None
    value = counters.get("store_blocks")
    return int(value) if isinstance(value, (int, float)) else None


def ratios(a: ConfigSummary, b: ConfigSummary) -> dict[str, float | None]:
    """``a / b`` for each metric in METRICS; None when either side is missing or b is 0."""
    return stats.ratios(a.to_dict(), b.to_dict(), (key for key, *_ in METRICS))


@dataclass
class Target:
    name: str
    goal: str
    measured: float | None
    met: bool | None  # None: not measured

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _speedup(vanilla: float | None, agentkv: float | None) -> float | None:
    if vanilla is None or agentkv is None or agentkv <= 0:
        return None
    return vanilla / agentkv


def targets(
    vanilla: ConfigSummary, agentkv: ConfigSummary, overhead_pct: float | None
) -> list[Target]:
    """The issue's targets: resume TTFT p50 >= 5x lower, mean JCT >= 1.5x lower, overhead <= 3%."""
    ttft = _speedup(vanilla.resume_ttft_p50_s, agentkv.resume_ttft_p50_s)
    jct = _speedup(vanilla.jct_mean_s, agentkv.jct_mean_s)
    return [
        Target(
            "resume TTFT p50, vanilla / agentkv",
            ">= 5.0x",
            ttft,
            None if ttft is None else ttft >= 5.0,
        ),
        Target(
            "mean job completion time, vanilla / agentkv",
            ">= 1.5x",
            jct,
            None if jct is None else jct >= 1.5,
        ),
        Target(
            "throughput loss without pauses (vllm bench serve)",
            "<= 3.0%",
            overhead_pct,
            None if overhead_pct is None else overhead_pct <= 3.0,
        ),
    ]


CPU_TARGET_PCT = 1.0


def connector_cpu_section(
    configs: dict[str, dict[str, Any]], overhead: dict[str, Any]
) -> dict[str, Any]:
    """The agentkv server's connector CPU (scheduler side, engine thread) in both workloads:
    plain traffic (the overhead run, summed over its repeats) and the agent workload, with the
    target: on plain traffic the connector takes <= 1% of the engine thread's wall time, a
    measured bound on the throughput it can cost (its hooks run inline in every engine step).
    """
    unavailable = {"status": "unavailable"}
    plain = overhead.get("connector_cpu") or {
        "status": "not run" if overhead.get("status") != "ok" else "unavailable"
    }
    agent = (configs.get("agentkv") or {}).get("connector_cpu") or unavailable
    share = plain.get("share_pct")
    return {
        "plain_traffic": plain,
        "agent_workload": agent,
        "target": {
            "name": "connector CPU share of wall time, plain traffic (throughput loss bound)",
            "goal": f"<= {CPU_TARGET_PCT:.1f}%",
            "measured": share,
            "met": None if share is None else share <= CPU_TARGET_PCT,
        },
    }


def build_report(
    *,
    workload: dict[str, Any],
    server: dict[str, Any],
    machine: dict[str, Any],
    command: str,
    configs: dict[str, dict[str, Any]],
    summaries: dict[str, ConfigSummary],
    native_offload: dict[str, Any],
    overhead: dict[str, Any],
) -> dict[str, Any]:
    """The JSON report. ``configs[name]`` holds that configuration's turns/trajectories/samples."""
    v, a = summaries["vanilla"], summaries["agentkv"]
    loss = overhead.get("throughput_loss_pct")
    return {
        "schema": SCHEMA,
        "command": command,
        "machine": machine,
        "server": server,
        "workload": workload,
        "configs": {
            name: {"summary": summaries[name].to_dict(), **configs[name]} for name in configs
        },
        "ratios_agentkv_over_vanilla": ratios(a, v),
        "targets": [
            t.to_dict() for t in targets(v, a, loss if isinstance(loss, (int, float)) else None)
        ],
        "native_offload": native_offload,
        "overhead": overhead,
        "connector_cpu": connector_cpu_section(configs, overhead),
        "prefetch": prefetch_section(configs),
    }


def _fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if unit == "":
            return f"{x:.3f}"
        if unit == "tok/s":
            return f"{x:.1f}"
        return f"{x:.2f}"
    return str(x)


def to_markdown(report: dict[str, Any]) -> str:
    """A markdown summary: setup, the metrics table with ratios, targets, skipped parts."""
    cfgs = report["configs"]
    v, a = cfgs["vanilla"]["summary"], cfgs["agentkv"]["summary"]
    others = [n for n in cfgs if n not in ("vanilla", "agentkv")]
    r = report["ratios_agentkv_over_vanilla"]
    wl = report["workload"]["config"]
    srv = report["server"]
    lines = [
        "# agentkv bench agents",
        "",
        f"`{report['command']}`",
        "",
        f"Model `{srv.get('preset')}`, {srv.get('num_blocks')} device KV blocks "
        f"({srv.get('block_tokens', 128)} tokens each), host tier {srv.get('host_capacity_gib')} GiB. "
        f"Workload: {wl['trajectories']} trajectories x {wl['turns']} turns, seed {wl['seed']}, "
        f"time scale {wl['time_scale']}, {a['turns']} requests per configuration "
        f"({a['resume_turns']} after a tool wait).",
        "",
        "| metric | vanilla vLLM | vLLM + agentkv"
        + "".join(f" | {n}" for n in others)
        + " | agentkv / vanilla |",
        "|---|---:|---:|" + "---:|" * len(others) + "---:|",
    ]
    for key, label, unit, _ in (*METRICS, WRITEBACKS):
        ratio = r.get(key)
        row = f"| {label}{f' ({unit})' if unit else ''} | {_fmt(v.get(key), unit)} | "
        row += f"{_fmt(a.get(key), unit)} | "
        row += "".join(f"{_fmt(cfgs[n]['summary'].get(key), unit)} | " for n in others)
        lines.append(row + f"{'-' if ratio is None else f'{ratio:.3f}'} |")
    for n in ("agentkv", *others):
        d = cfgs[n]["summary"].get("decisions")
        if d:
            lines += [
                "",
                f"{n} pause decisions: " + ", ".join(f"{k} {c}" for k, c in sorted(d.items())),
            ]
    lines += ["", "| target | goal | measured | met |", "|---|---|---:|---|"]
    for t in report["targets"]:
        m = t["measured"]
        shown = "-" if m is None else (f"{m:.2f}%" if t["goal"].endswith("%") else f"{m:.2f}x")
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {t['name']} | {t['goal']} | {shown} | {met} |")
    lines += _overhead_markdown(report["overhead"])
    if "connector_cpu" in report:
        lines += cpu_markdown(report["connector_cpu"])
    lines += prefetch_markdown(report.get("prefetch"))
    no = report["native_offload"]
    lines += [
        "",
        "## vLLM native offloading / LMCache",
        "",
        f"{no.get('status')}: {no.get('reason', '')}",
        "",
    ]
    return "\n".join(lines)


def _overhead_markdown(ov: dict[str, Any]) -> list[str]:
    """The no-pause overhead section: the medians of both servers and the throughput loss, or
    why it is missing."""
    lines = ["", "## Overhead without pauses (`vllm bench serve`)", ""]
    if ov.get("status") == "ok":
        lines += [
            f"`{ov.get('dataset')}` dataset, {ov.get('num_prompts')} prompts, "
            f"max concurrency {ov.get('max_concurrency')}; both servers up side by side, "
            f"{ov.get('repeats', 1)} interleaved repeats, medians:",
            "",
            "| | vanilla | agentkv | change |",
            "|---|---:|---:|---:|",
        ]
        for key in ("output_throughput", "request_throughput", "mean_ttft_ms", "mean_tpot_ms"):
            x, y = ov["vanilla"].get(key), ov["agentkv"].get(key)
            change = (
                f"{(y / x - 1) * 100:+.2f}%"
                if isinstance(x, (int, float)) and x and isinstance(y, (int, float))
                else "-"
            )
            lines.append(f"| {key} | {_fmt(x, 'x')} | {_fmt(y, 'x')} | {change} |")
        lines.append("")
        pairs = ", ".join(f"{x:+.2f}%" for x in ov.get("pair_losses_pct", []))
        lines.append(
            f"Throughput loss (median of per-repeat losses): {ov['throughput_loss_pct']:.2f}%"
            + (f" (per repeat: {pairs})" if pairs else "")
        )
    else:
        lines.append(f"{ov.get('status')}: {ov.get('reason', '')}")
    return lines


def _us(x: Any) -> str:
    return "-" if x is None else f"{x:.1f}"


def cpu_markdown(section: dict[str, Any]) -> list[str]:
    """The connector CPU table: per engine step, per agentkv request, share of wall time."""
    lines = [
        "",
        "## Connector CPU (measured: scheduler-side hooks, thread CPU time on the engine thread)",
        "",
        "| workload | engine steps | µs per engine step | µs per step-hook call | agentkv requests "
        "| µs per agentkv request | share of wall time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, label in (
        ("plain_traffic", "plain traffic (`vllm bench serve`, all repeats)"),
        ("agent_workload", "agent workload"),
    ):
        c = section.get(key) or {}
        if c.get("status") != "ok":
            lines.append(f"| {label} | {c.get('status', 'unavailable')} | | | | | |")
            continue
        share = c.get("share_pct")
        lines.append(
            f"| {label} | {_fmt(c.get('engine_steps'))} | {_us(c.get('step_us_per_engine_step'))} "
            f"| {_us(c.get('step_us_per_call'))} | {_fmt(c.get('requests'))} "
            f"| {_us(c.get('request_us_per_request'))} "
            f"| {'-' if share is None else f'{share:.3f}%'} |"
        )
    t = section.get("target") or {}
    m = t.get("measured")
    met = "not measured" if t.get("met") is None else ("met" if t["met"] else "not met")
    lines += [
        "",
        f"Target, {t.get('name')}: {t.get('goal')}; measured "
        f"{'-' if m is None else f'{m:.3f}%'}: {met}.",
    ]
    return lines


def all_turns(trajs: Iterable[TrajectoryRecord]) -> list[TurnRecord]:
    return [t for r in trajs for t in r.turns]
