"""A trace replay's numbers: per-configuration summaries, the oracle ratios, the resume stall.

Primitives:
  TraceSummary      one configuration's metrics (resume TTFT p50/p99, JCT, hits, makespan)
  summarize(name, sessions, samples, makespan_s) -> TraceSummary
  ratios(a, b)      a / b for every metric in METRICS (None where missing or b is 0)
  device_hit(r, block_tokens)  the round reused every cacheable block of its history
  parse_prom(text)  {(metric, tier label or ""): value} for the counters the bench reads
  prom_delta(before, after)
  (the resume stall, TierRates, decompose, stall_section: agentkv_bench.stall_report)
  build_report(...), to_markdown(report)

"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agentkv import stats
from agentkv.stats import mean, percentile
from agentkv_bench.prefetch_report import prefetch_markdown, prefetch_section
from agentkv_bench.sampler import Sample
from agentkv_bench.stall_report import PHASE_FAST, SLOW_PHASE_S
from agentkv_bench.stall_report import ms as _ms
from agentkv_bench.stall_report import stall_markdown as _stall_markdown
from agentkv_bench.trace_replay import RoundRecord, SessionRecord

SCHEMA = "agentkv-bench-trace/1"

# (key, label, unit, higher_is_better)
METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("resume_ttft_p50_s", "resume TTFT p50", "s", False),
    ("resume_ttft_p99_s", "resume TTFT p99", "s", False),
    ("resume_ttft_mean_s", "resume TTFT mean", "s", False),
    ("ttft_p50_s", "TTFT p50, all rounds", "s", False),
    ("jct_mean_s", "job completion time, mean", "s", False),
    ("jct_p99_s", "job completion time, p99", "s", False),
    ("recomputed_tokens", "tokens prefilled", "tok", False),
    ("decode_tok_s", "decode throughput per sequence", "tok/s", True),
    ("writeback_blocks", "blocks written back (agentkv stores)", "blocks", False),
    ("resume_hit_rate", "prefix hit rate, resume rounds", "", True),
    ("reusable_hit_rate", "cacheable history reused, resume rounds", "", True),
    ("makespan_s", "makespan", "s", False),
    ("control_p50_s", "pause + resume calls per wait, p50", "s", False),
    ("control_share", "pause + resume calls, share of job time", "", False),
)


def device_hit(r: RoundRecord, block_tokens: int) -> bool:
    """Whether the round got every whole block of the history a cache could hold.

    The cacheable history is the previous round's prompt part of this prompt
    (``reusable_tokens``): the scripted reply was never computed by the engine.
    """
    return r.cached_tokens >= r.reusable_tokens // block_tokens * block_tokens


@dataclass
class TraceSummary:
    name: str
    rounds: int
    resume_rounds: int
    resume_ttft_p50_s: float | None
    resume_ttft_p99_s: float | None
    resume_ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    jct_mean_s: float | None
    jct_p50_s: float | None
    jct_p99_s: float | None
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    resume_hit_rate: float | None
    reusable_hit_rate: float | None  # cached / cacheable history, resume rounds
    resume_rounds_all_reused: int  # resume rounds that got every cacheable block
    tier_hit_tokens: int | None
    makespan_s: float
    kv_usage_mean: float | None
    kv_usage_max: float | None
    decisions: dict[str, int] = field(default_factory=dict)
    # sum(completion tokens - 1) / sum(latency - TTFT), as in the synthetic bench's summary
    decode_tok_s: float | None = None
    # Blocks the connector copied to a tier (status counters ``store_blocks``); None: no connector
    writeback_blocks: int | None = None
    # The agentkv pause + resume calls around each wait (the agent waits for both): their wall
    # time per wait, and their sum over the jobs' summed completion time. None: no agentkv.
    control_p50_s: float | None = None
    control_p99_s: float | None = None
    control_share: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    name: str,
    sessions: Sequence[SessionRecord],
    samples: Sequence[Sample],
    makespan_s: float,
    block_tokens: int = 128,
) -> TraceSummary:
    rounds = [r for s in sessions for r in s.rounds]
    resume = [r for r in rounds if r.kind == "resume"]
    jct = [s.jct_s for s in sessions]
    tier = [r.tier_hit_tokens for r in rounds if r.tier_hit_tokens is not None]
    usage = [s.kv_usage for s in samples if s.kv_usage is not None]
    decisions: dict[str, int] = {}
    for r in resume:
        if r.decision is not None:
            decisions[r.decision] = decisions.get(r.decision, 0) + 1
    reusable = sum(r.reusable_tokens for r in resume)
    decode_tokens = sum(max(0, r.completion_tokens - 1) for r in rounds)
    decode_time = sum(max(0.0, r.latency_s - r.ttft_s) for r in rounds)
    control = [r.control_s for r in rounds if r.control_s is not None]
    resume_prompt = sum(r.prompt_tokens for r in resume)
    return TraceSummary(
        name=name,
        rounds=len(rounds),
        resume_rounds=len(resume),
        resume_ttft_p50_s=percentile([r.ttft_s for r in resume], 50),
        resume_ttft_p99_s=percentile([r.ttft_s for r in resume], 99),
        resume_ttft_mean_s=mean([r.ttft_s for r in resume]),
        ttft_p50_s=percentile([r.ttft_s for r in rounds], 50),
        ttft_p99_s=percentile([r.ttft_s for r in rounds], 99),
        jct_mean_s=mean(jct),
        jct_p50_s=percentile(jct, 50),
        jct_p99_s=percentile(jct, 99),
        prompt_tokens=sum(r.prompt_tokens for r in rounds),
        cached_tokens=sum(r.cached_tokens for r in rounds),
        recomputed_tokens=sum(r.recomputed_tokens for r in rounds),
        resume_hit_rate=sum(r.cached_tokens for r in resume) / resume_prompt
        if resume_prompt
        else None,
        reusable_hit_rate=min(1.0, sum(r.cached_tokens for r in resume) / reusable)
        if reusable
        else None,
        resume_rounds_all_reused=sum(device_hit(r, block_tokens) for r in resume),
        tier_hit_tokens=sum(tier) if tier else None,
        makespan_s=makespan_s,
        kv_usage_mean=mean(usage),
        kv_usage_max=max(usage) if usage else None,
        decisions=decisions,
        decode_tok_s=decode_tokens / decode_time if decode_time > 0 else None,
        control_p50_s=percentile(control, 50),
        control_p99_s=percentile(control, 99),
        control_share=sum(control) / sum(jct) if control and sum(jct) > 0 else None,
    )


def ratios(a: TraceSummary, b: TraceSummary) -> dict[str, float | None]:
    """``a / b`` for each metric in METRICS; None when either side is missing or b is 0."""
    return stats.ratios(a.to_dict(), b.to_dict(), (key for key, *_ in METRICS))


# ---------------------------------------------------------------- engine counters

_PROM_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_LABEL_RE = re.compile(r'(?:tier|phase)="([^"]*)"')
_LE_RE = re.compile(r'le="([^"]*)"')
PROM_WANTED = (
    "agentkv_reload_bytes_sum",
    "agentkv_reload_bytes_count",
    "agentkv_reload_seconds_sum",
    "agentkv_reload_phase_seconds_sum",
    "agentkv_reload_phase_seconds_count",
    "agentkv_reload_phase_seconds_bucket",  # only le=SLOW_PHASE_S, kept as PHASE_FAST
    "agentkv_offload_bytes_sum",
    "agentkv_offload_seconds_sum",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
)


def parse_prom(text: str) -> dict[tuple[str, str], float]:
    """The PROM_WANTED series of a /metrics page, keyed by (name, tier or phase label or "");
    of the phase histogram's buckets only the one at SLOW_PHASE_S, as ``PHASE_FAST``."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _PROM_RE.match(line.strip())
        if not m or m.group(1) not in PROM_WANTED:
            continue
        name = m.group(1)
        if name == "agentkv_reload_phase_seconds_bucket":
            le = _LE_RE.search(m.group(2) or "")
            if le is None or le.group(1) == "+Inf" or float(le.group(1)) != SLOW_PHASE_S:
                continue
            name = PHASE_FAST
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        label = _LABEL_RE.search(m.group(2) or "")
        key = (name, label.group(1) if label else "")
        out[key] = out.get(key, 0.0) + value
    return out


def prom_delta(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[tuple[str, str], float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def vllm_phases(delta: dict[tuple[str, str], float]) -> dict[str, float | None]:
    """vLLM's own per-request means over the run: time WAITING and time in PREFILL."""
    out: dict[str, float | None] = {}
    for phase in ("queue", "prefill"):
        n = delta.get((f"vllm:request_{phase}_time_seconds_count", ""), 0.0)
        s = delta.get((f"vllm:request_{phase}_time_seconds_sum", ""), 0.0)
        out[f"{phase}_mean_s"] = s / n if n > 0 else None
    # vLLM's TTFT runs from the API server's arrival to its first output there: beside queue
    # and prefill it holds the frontend's work and both IPC hops, and a client's TTFT beyond it
    # is HTTP and any ASGI middleware (agentkv's hooks).
    n = delta.get(("vllm:time_to_first_token_seconds_count", ""), 0.0)
    s = delta.get(("vllm:time_to_first_token_seconds_sum", ""), 0.0)
    out["ttft_mean_s"] = s / n if n > 0 else None
    out["requests"] = delta.get(("vllm:request_queue_time_seconds_count", ""), 0.0)
    return out


# ---------------------------------------------------------------- report


def build_report(
    *,
    command: str,
    machine: dict[str, Any],
    server: dict[str, Any],
    trace: dict[str, Any],
    configs: dict[str, dict[str, Any]],
    summaries: dict[str, TraceSummary],
    stall: dict[str, Any],
) -> dict[str, Any]:
    """The JSON report; ``configs[name]`` holds that configuration's rounds, sessions, samples."""
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "command": command,
        "machine": machine,
        "server": server,
        "trace": trace,
        "configs": {n: {"summary": summaries[n].to_dict(), **configs[n]} for n in configs},
        "stall_decomposition": stall,
        "prefetch": prefetch_section(configs),
    }
    pairs = (("agentkv", "vanilla"), ("agentkv", "oracle"), ("vanilla", "oracle"))
    for a, b in pairs:
        if a in summaries and b in summaries:
            out[f"ratios_{a}_over_{b}"] = ratios(summaries[a], summaries[b])
    if "oracle" in summaries:
        from agentkv.simulate.bounds import trace_report_bound

        # Next to the infinite-memory oracle: the same pool with every history free to load.
        out["capacity_equal_bound"] = trace_report_bound(out)
        o = summaries["oracle"]
        out["oracle_check"] = {
            "resume_rounds": o.resume_rounds,
            "resume_rounds_all_reused": o.resume_rounds_all_reused,
            "held": o.resume_rounds_all_reused == o.resume_rounds,
        }
    return out


def _fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if unit == "":
            return f"{x:.3f}"
        if unit in ("tok", "blocks"):
            return f"{x:,.0f}"
        return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def to_markdown(report: dict[str, Any]) -> str:
    cfgs = report["configs"]
    order = ("vanilla", "agentkv", "retain-always", "offload-always", "oracle")
    names = [n for n in order if n in cfgs] + [n for n in cfgs if n not in order]
    srv, tr = report["server"], report["trace"]
    lines = [
        "# agentkv bench agents --trace",
        "",
        f"`{report['command']}`",
        "",
        f"Trace `{tr['source']}` ({tr['format']}): {tr['sessions']} sessions, {tr['rounds']} rounds, "
        f"tokens x{tr['token_scale']:g}, time x{tr['time_scale']:g}; longest context "
        f"{tr['max_context_len']:,} tokens, {tr['distinct_tokens']:,} distinct tokens in all. "
        f"Model `{srv['preset']}`; vanilla and agentkv {srv['num_blocks']} device KV blocks "
        f"({srv['block_tokens']} tokens each, {srv['num_blocks'] * srv['block_tokens']:,} tokens), "
        f"oracle {srv['oracle_blocks']} blocks (nothing evicted); agentkv host tier "
        f"{srv['host_capacity_gib']} GiB.",
        "",
        *_metrics_table(report, names),
        *_bounds_markdown(report, names),
        *_stall_markdown(report["stall_decomposition"], names),
    ]
    phases = [(n, cfgs[n].get("vllm_phases") or {}) for n in names]
    lines += [
        "",
        "Where a round's TTFT goes, per-request means over all rounds: the client's TTFT; vLLM's "
        "TTFT (API server arrival to first output there); of it, WAITING (queue) and PREFILL "
        "(prefill); the rest of vLLM's is the frontend's work and IPC, the client's beyond "
        "vLLM's is HTTP and ASGI middleware:",
        "",
        "| config | client TTFT ms | vLLM TTFT ms | queue ms | prefill ms |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {n} | {_ms(_client_ttft(cfgs[n]))} | {_ms(p.get('ttft_mean_s'))} | "
            f"{_ms(p.get('queue_mean_s'))} | {_ms(p.get('prefill_mean_s'))} |"
            for n, p in phases
        ),
        "",
    ]
    lines += prefetch_markdown(report.get("prefetch"))
    return "\n".join(lines)


def _client_ttft(cfg: dict[str, Any]) -> float | None:
    ttfts = [r["ttft_s"] for r in cfg.get("rounds") or [] if r.get("ttft_s") is not None]
    return sum(ttfts) / len(ttfts) if ttfts else None


def _metrics_table(report: dict[str, Any], names: list[str]) -> list[str]:
    """One column per configuration and per ratio (agentkv over vanilla / oracle), one row per
    metric in METRICS."""
    cfgs = report["configs"]
    head = "| metric | " + " | ".join(names)
    sep = "|---|" + "---:|" * len(names)
    ratio_keys = [
        k for k in ("agentkv_over_vanilla", "agentkv_over_oracle") if f"ratios_{k}" in report
    ]
    head += "".join(f" | {k.replace('_over_', ' / ')}" for k in ratio_keys) + " |"
    sep += "---:|" * len(ratio_keys)
    lines = [head, sep]
    for key, label, unit, _ in METRICS:
        row = f"| {label}{f' ({unit})' if unit and unit != 'tok' else ''} | "
        row += " | ".join(_fmt(cfgs[n]["summary"].get(key), unit) for n in names)
        for k in ratio_keys:
            v = report[f"ratios_{k}"].get(key)
            row += f" | {'-' if v is None else f'{v:.3f}'}"
        lines.append(row + " |")
    return lines


def _bounds_markdown(report: dict[str, Any], names: list[str]) -> list[str]:
    """Each configuration's pause decisions, the capacity-equal bound and the oracle check."""
    lines: list[str] = []
    for n in names:
        d = report["configs"][n]["summary"].get("decisions")
        if d:
            lines += [
                "",
                f"{n} pause decisions: " + ", ".join(f"{k} {v}" for k, v in sorted(d.items())),
            ]
    ce = report.get("capacity_equal_bound")
    if ce and not ce.get("summary"):
        lines += ["", f"Capacity-equal bound: {ce['how']} ({'; '.join(ce.get('notes', []))})."]
    elif ce:
        b = ce["summary"]
        lines += [
            "",
            f"Capacity-equal bound ({ce['how']}; {ce['num_blocks']} blocks): resume TTFT p50 "
            f"{_fmt(b['resume_ttft_p50_s'], 's')} s, p99 {_fmt(b['resume_ttft_p99_s'], 's')} s, "
            f"job completion time mean {_fmt(b['jct_mean_s'], 's')} s, "
            f"{_fmt(b['recomputed_tokens'])} tokens prefilled: what no cache policy beats "
            "with this pool; the oracle also lifts the pool's admission limit.",
        ]
    oc = report.get("oracle_check")
    if oc:
        lines += [
            "",
            f"Oracle check: {oc['resume_rounds_all_reused']} of {oc['resume_rounds']} resume rounds "
            "reused every cacheable block of their history"
            + (
                " (nothing was evicted)."
                if oc["held"]
                else " (NOT all: the oracle pool was too small)."
            ),
        ]
    return lines
