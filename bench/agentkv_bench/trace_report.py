"""A trace replay's numbers: per-configuration summaries, the oracle ratios, the resume stall.

Primitives:
  TraceSummary      one configuration's metrics (resume TTFT p50/p99, JCT, hits, makespan)
  summarize(name, sessions, samples, makespan_s) -> TraceSummary
  ratios(a, b)      a / b for every metric in METRICS (None where missing or b is 0)
  device_hit(r, block_tokens)  the round reused every cacheable block of its history
  parse_prom(text)  {(metric, tier label or ""): value} for the counters the bench reads
  prom_delta(before, after)
  TierRates         per tier: reload jobs, bytes and seconds over the run (the plugin's
                    ``agentkv_reload_*`` histograms), hence its reload throughput
  StallRow          one resume round taken apart: load per tier, prefill, queue + the rest,
                    and the raw memcpy time of the bytes it loaded
  decompose(rounds, ...) -> [StallRow]
  memcpy_seconds(nbytes)  best of 5 numpy copies of a buffer that size, on this machine
  stall_section(...)  the JSON section: per configuration means, per tier load vs memcpy
  build_report(...), to_markdown(report)

How a resume round is taken apart (all configurations alike, times in seconds):
  load    its ``tier_hit_tokens`` as bytes (``block_bytes`` per ``block_tokens``) at its tier's
          reload throughput over the run (reload bytes / reload seconds, from the plugin's
          transfer histograms: each job's copy time as the worker timed it, not its latency:
          a layer-by-layer load from its copy's first line to its pins released, an async one
          from when a store worker took it up to its last block). The plugin reports transfer
          times per job and hit tokens per turn, not a job per turn, so a round's share is its
          bytes at the run's rate; the per-tier totals are the histograms' own sums.
  prefill the tokens it prefilled (prompt - cached) at the engine's prefill rate (agentkv's
          online calibration from the engine's prefill steps, read at the end of its run).
  queue   the rest of the TTFT: waiting behind other requests, batching with their steps,
          scheduling, the HTTP hop. Clamped at 0 (a layerwise load overlaps the prefill).
  memcpy  a numpy copy of the same bytes in this process, best of 5: the physical limit of
          moving them once through this machine's memory, with the source in cache (a reload's
          source, stored long before, is in memory: a cold copy is slower, docs/tiers.md);
          load / memcpy is the distance to it.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from agentkv import stats
from agentkv.stats import mean, percentile
from agentkv_bench.prefetch_report import prefetch_markdown, prefetch_section
from agentkv_bench.sampler import Sample
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
_TIER_RE = re.compile(r'tier="([^"]*)"')
PROM_WANTED = (
    "agentkv_reload_bytes_sum",
    "agentkv_reload_bytes_count",
    "agentkv_reload_seconds_sum",
    "agentkv_offload_bytes_sum",
    "agentkv_offload_seconds_sum",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_count",
)


def parse_prom(text: str) -> dict[tuple[str, str], float]:
    """The PROM_WANTED series of a /metrics page, keyed by (name, tier label or "")."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _PROM_RE.match(line.strip())
        if not m or m.group(1) not in PROM_WANTED:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        tier = _TIER_RE.search(m.group(2) or "")
        key = (m.group(1), tier.group(1) if tier else "")
        out[key] = out.get(key, 0.0) + value
    return out


def prom_delta(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[tuple[str, str], float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


@dataclass(frozen=True)
class TierRates:
    tier: str
    jobs: int
    bytes: float
    seconds: float

    @property
    def bytes_per_s(self) -> float | None:
        return self.bytes / self.seconds if self.seconds > 0 else None


def tier_rates(delta: dict[tuple[str, str], float]) -> dict[str, TierRates]:
    tiers = {t for (name, t) in delta if name.startswith("agentkv_reload_") and t}
    return {
        t: TierRates(
            t,
            round(delta.get(("agentkv_reload_bytes_count", t), 0.0)),
            delta.get(("agentkv_reload_bytes_sum", t), 0.0),
            delta.get(("agentkv_reload_seconds_sum", t), 0.0),
        )
        for t in sorted(tiers)
    }


def vllm_phases(delta: dict[tuple[str, str], float]) -> dict[str, float | None]:
    """vLLM's own per-request means over the run: time WAITING and time in PREFILL."""
    out: dict[str, float | None] = {}
    for phase in ("queue", "prefill"):
        n = delta.get((f"vllm:request_{phase}_time_seconds_count", ""), 0.0)
        s = delta.get((f"vllm:request_{phase}_time_seconds_sum", ""), 0.0)
        out[f"{phase}_mean_s"] = s / n if n > 0 else None
    out["requests"] = delta.get(("vllm:request_queue_time_seconds_count", ""), 0.0)
    return out


# ---------------------------------------------------------------- the resume stall


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Best of ``repeats`` numpy copies of ``nbytes`` between two touched buffers."""
    import numpy as np

    if nbytes <= 0:
        return 0.0
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # fault both in before timing
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


class MemcpyTimer:
    """memcpy_seconds with one measurement per distinct size (rounds share block counts)."""

    def __init__(self, measure: Callable[[int], float] = memcpy_seconds) -> None:
        self.measure = measure
        self.cache: dict[int, float] = {}

    def __call__(self, nbytes: int) -> float:
        if nbytes not in self.cache:
            self.cache[nbytes] = self.measure(nbytes)
        return self.cache[nbytes]


@dataclass
class StallRow:
    trajectory_id: str
    round: int
    ttft_s: float
    tier: str | None
    load_bytes: int
    load_s: float
    prefill_tokens: int
    prefill_s: float
    queue_s: float  # the rest of the TTFT
    memcpy_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decompose(
    rounds: Sequence[RoundRecord],
    *,
    block_tokens: int,
    block_bytes: int,
    rates: dict[str, TierRates],
    prefill_tokens_per_s: float,
    memcpy: Callable[[int], float],
) -> list[StallRow]:
    """Take every resume round of ``rounds`` apart (see the module docstring)."""
    if prefill_tokens_per_s <= 0:
        raise ValueError("prefill_tokens_per_s must be > 0")
    out: list[StallRow] = []
    for r in rounds:
        if r.kind != "resume":
            continue
        tier_tokens = r.tier_hit_tokens or 0
        nbytes = tier_tokens * block_bytes // block_tokens
        rate = rates.get(r.tier or "")
        bps = rate.bytes_per_s if rate is not None else None
        load = nbytes / bps if nbytes and bps else 0.0
        prefill = r.recomputed_tokens / prefill_tokens_per_s
        out.append(
            StallRow(
                trajectory_id=r.trajectory_id,
                round=r.round,
                ttft_s=r.ttft_s,
                tier=r.tier if nbytes else None,
                load_bytes=nbytes,
                load_s=load,
                prefill_tokens=r.recomputed_tokens,
                prefill_s=prefill,
                queue_s=max(0.0, r.ttft_s - load - prefill),
                memcpy_s=memcpy(nbytes) if nbytes else 0.0,
            )
        )
    return out


def _stall_means(rows: Sequence[StallRow]) -> dict[str, Any]:
    n = len(rows)
    if not n:
        return {"resume_rounds": 0}
    by_tier: dict[str, float] = {}
    for row in rows:
        if row.tier:
            by_tier[row.tier] = by_tier.get(row.tier, 0.0) + row.load_s / n
    return {
        "resume_rounds": n,
        "rounds_with_load": sum(1 for r in rows if r.load_bytes),
        "ttft_mean_s": sum(r.ttft_s for r in rows) / n,
        "load_mean_s": sum(r.load_s for r in rows) / n,
        "load_mean_s_by_tier": by_tier,
        "prefill_mean_s": sum(r.prefill_s for r in rows) / n,
        "queue_mean_s": sum(r.queue_s for r in rows) / n,
        "memcpy_mean_s": sum(r.memcpy_s for r in rows) / n,
        "prefill_tokens_mean": sum(r.prefill_tokens for r in rows) / n,
        "load_bytes_mean": sum(r.load_bytes for r in rows) / n,
    }


def stall_section(
    rows_by_config: dict[str, list[StallRow]],
    rates: dict[str, TierRates],
    prefill_tokens_per_s: float,
    prefill_source: str,
    memcpy: Callable[[int], float],
) -> dict[str, Any]:
    """Per configuration the mean resume round taken apart; per tier the plugin's reload totals
    against a memcpy of the same bytes (the jobs' mean size, times the job count)."""
    tiers: dict[str, Any] = {}
    for t, rate in rates.items():
        if rate.jobs <= 0:
            continue
        per_job = int(rate.bytes / rate.jobs)
        copy_s = memcpy(per_job) * rate.jobs if per_job else 0.0
        tiers[t] = {
            "reload_jobs": rate.jobs,
            "reload_bytes": rate.bytes,
            "reload_s": rate.seconds,
            "reload_bytes_per_s": rate.bytes_per_s,
            "memcpy_s": copy_s,
            "memcpy_bytes_per_s": rate.bytes / copy_s if copy_s > 0 else None,
            "load_over_memcpy": rate.seconds / copy_s if copy_s > 0 else None,
        }
    return {
        "prefill_tokens_per_s": prefill_tokens_per_s,
        "prefill_rate_source": prefill_source,
        "by_config": {name: _stall_means(rows) for name, rows in rows_by_config.items()},
        "tiers": tiers,
    }


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


def _ms(x: Any) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


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
        "vLLM's own per-request means over all rounds (queue = WAITING, prefill = PREFILL phase): "
        + "; ".join(
            f"{n} queue {_ms(p.get('queue_mean_s'))} ms, prefill {_ms(p.get('prefill_mean_s'))} ms"
            for n, p in phases
        )
        + ".",
        "",
    ]
    lines += prefetch_markdown(report.get("prefetch"))
    return "\n".join(lines)


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


def _stall_markdown(st: dict[str, Any], names: list[str]) -> list[str]:
    """The resume stall taken apart per configuration, and each tier's reload against memcpy."""
    lines = [
        "",
        "## Resume stall, taken apart (mean per resume round, ms)",
        "",
        f"Prefill rate {st['prefill_tokens_per_s']:,.0f} tokens/s ({st['prefill_rate_source']}); "
        "load = tier-hit bytes at the tier's reload throughput over the run (plugin transfer "
        "metrics); queue = the rest of the TTFT.",
        "",
        "| config | resume rounds | TTFT | load | prefill | queue + rest | prefilled tokens "
        "| loaded MiB | memcpy of those bytes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        m = st["by_config"].get(n) or {}
        if not m.get("resume_rounds"):
            continue
        tiers = ", ".join(f"{t} {_ms(v)}" for t, v in sorted(m["load_mean_s_by_tier"].items()))
        lines.append(
            f"| {n} | {m['resume_rounds']} | {_ms(m['ttft_mean_s'])} | {_ms(m['load_mean_s'])}"
            f"{f' ({tiers})' if tiers else ''} | {_ms(m['prefill_mean_s'])} | "
            f"{_ms(m['queue_mean_s'])} | {m['prefill_tokens_mean']:,.0f} | "
            f"{m['load_bytes_mean'] / 2**20:.2f} | {_ms(m['memcpy_mean_s'])} |"
        )
    if not st["tiers"]:
        return [*lines, "", "No agentkv reloads in this run (every hit was on the device)."]
    lines += [
        "",
        "| tier | reload jobs | MiB | copy time (s) | reload GB/s | memcpy GB/s (numpy, same "
        "sizes, cache-hot) | load / memcpy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    note = (
        "copy time: the plugin's own timing of each reload job (`agentkv_reload_seconds`), "
        "not its latency: a layer-by-layer load (CPU host hits) from its copy's first line to "
        "its host copies unpinned (a small step is copied inside `start_step` before the "
        "forward, a larger one by the copier thread next to it, sharing the cores); an async "
        "load from when a store worker took it up to its last block. The wait before either "
        "is in queue + rest above. The memcpy is a best of 5 of one buffer, its source in "
        "cache; a reload reads blocks stored long before, from memory (a copy from a cold "
        "source took ~1.5x as long on the 2-core dev VM: `python -m "
        "agentkv_bench.reload_phases --cold`, docs/tiers.md)."
    )
    for t, d in sorted(st["tiers"].items()):
        bps, mbps, r = d["reload_bytes_per_s"], d["memcpy_bytes_per_s"], d["load_over_memcpy"]
        lines.append(
            f"| {t} | {d['reload_jobs']} | {d['reload_bytes'] / 2**20:,.1f} | "
            f"{d['reload_s']:.3f} | {'-' if bps is None else f'{bps / 1e9:.2f}'} | "
            f"{'-' if mbps is None else f'{mbps / 1e9:.2f}'} | "
            f"{'-' if r is None else f'{r:.1f}x'} |"
        )
    return [*lines, "", note]
