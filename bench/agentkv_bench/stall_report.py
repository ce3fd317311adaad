"""The resume stall of a trace replay taken apart, and each tier's reload against memcpy.

Primitives:
  TierRates         per tier: reload jobs, bytes and seconds over the run (the plugin's
                    ``agentkv_reload_*`` histograms), hence its reload throughput
  tier_rates(delta) -> {tier: TierRates}
  reload_phase_section(delta)  per ReloadPhase: the worker's layer-by-layer reload steps' time
                    in it (``agentkv_reload_phase_seconds``), steps and mean per step
  StallRow          one resume round taken apart: load per tier, prefill, queue + the rest,
                    and the memcpy time of the bytes it loaded (cold and cache-hot)
  decompose(rounds, ...) -> [StallRow]
  stall_section(...)  the JSON section: per configuration means, per tier load vs memcpy
                    (cold: the target's baseline; cache-hot), the reload phases
  stall_markdown(section, names)

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
  memcpy  the same bytes copied by numpy in this process, two ways (agentkv_bench.copy_baseline):
          cold (the target's baseline): block by block between shuffled slots of two pools
          twice the last-level cache, source and destination in memory as a reload's are (arena
          slots written long before, KV cache blocks other requests used); hot: best of 5 of one
          buffer, in cache, ~1.5x faster on the dev VM. load / memcpy is the distance to the
          physical limit of moving those bytes once through this machine's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from agentkv.manager.jobs import ReloadPhase
from agentkv_bench.copy_baseline import CopyBaseline
from agentkv_bench.trace_replay import RoundRecord

# A reload step's phase past this is an outlier (the step's copy is ~0.2 ms): counted apart.
SLOW_PHASE_S = 0.001
PHASE_FAST = "agentkv_reload_phase_seconds_fast"  # steps whose phase took <= SLOW_PHASE_S
_RELOAD_SERIES = {
    "agentkv_reload_bytes_sum",
    "agentkv_reload_bytes_count",
    "agentkv_reload_seconds_sum",
}


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
    tiers = {t for (name, t) in delta if name in _RELOAD_SERIES and t}
    return {
        t: TierRates(
            t,
            round(delta.get(("agentkv_reload_bytes_count", t), 0.0)),
            delta.get(("agentkv_reload_bytes_sum", t), 0.0),
            delta.get(("agentkv_reload_seconds_sum", t), 0.0),
        )
        for t in sorted(tiers)
    }


def reload_phase_section(delta: dict[tuple[str, str], float]) -> dict[str, Any]:
    """Per ReloadPhase the worker's layer-by-layer reload steps spent in it over the run (the
    plugin's ``agentkv_reload_phase_seconds``): steps, total and mean seconds per step, and
    how many steps it took more than SLOW_PHASE_S (outliers: a step's copy is ~0.2 ms)."""
    out: dict[str, Any] = {}
    for phase in ReloadPhase:
        n = delta.get(("agentkv_reload_phase_seconds_count", phase.value), 0.0)
        total = delta.get(("agentkv_reload_phase_seconds_sum", phase.value), 0.0)
        fast = delta.get((PHASE_FAST, phase.value), n)
        if n > 0:
            out[phase.value] = {
                "steps": round(n),
                "total_s": total,
                "mean_s": total / n,
                "slow_steps": round(n - fast),  # past SLOW_PHASE_S
            }
    return out


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
    memcpy_s: float  # cold (CopyBaseline.cold_s): the baseline the target uses
    memcpy_hot_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decompose(
    rounds: Sequence[RoundRecord],
    *,
    block_tokens: int,
    block_bytes: int,
    rates: dict[str, TierRates],
    prefill_tokens_per_s: float,
    memcpy: Callable[[int], CopyBaseline],
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
        copy = memcpy(nbytes) if nbytes else CopyBaseline(0.0, 0.0)
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
                memcpy_s=copy.cold_s,
                memcpy_hot_s=copy.hot_s,
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
        "memcpy_hot_mean_s": sum(r.memcpy_hot_s for r in rows) / n,
        "prefill_tokens_mean": sum(r.prefill_tokens for r in rows) / n,
        "load_bytes_mean": sum(r.load_bytes for r in rows) / n,
    }


def stall_section(
    rows_by_config: dict[str, list[StallRow]],
    rates: dict[str, TierRates],
    prefill_tokens_per_s: float,
    prefill_source: str,
    memcpy: Callable[[int], CopyBaseline],
    reload_phases: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Per configuration the mean resume round taken apart; per tier the plugin's reload totals
    against a memcpy of the same bytes (the jobs' mean size, times the job count): cold, the
    target's baseline (``load_over_memcpy``), and cache-hot (``load_over_memcpy_hot``)."""
    tiers: dict[str, Any] = {}
    for t, rate in rates.items():
        if rate.jobs <= 0:
            continue
        per_job = int(rate.bytes / rate.jobs)
        copy = memcpy(per_job) if per_job else CopyBaseline(0.0, 0.0)
        cold_s, hot_s = copy.cold_s * rate.jobs, copy.hot_s * rate.jobs
        tiers[t] = {
            "reload_jobs": rate.jobs,
            "reload_bytes": rate.bytes,
            "reload_s": rate.seconds,
            "reload_bytes_per_s": rate.bytes_per_s,
            "memcpy_s": cold_s,
            "memcpy_bytes_per_s": rate.bytes / cold_s if cold_s > 0 else None,
            "load_over_memcpy": rate.seconds / cold_s if cold_s > 0 else None,
            "memcpy_hot_s": hot_s,
            "memcpy_hot_bytes_per_s": rate.bytes / hot_s if hot_s > 0 else None,
            "load_over_memcpy_hot": rate.seconds / hot_s if hot_s > 0 else None,
        }
    return {
        "prefill_tokens_per_s": prefill_tokens_per_s,
        "prefill_rate_source": prefill_source,
        "by_config": {name: _stall_means(rows) for name, rows in rows_by_config.items()},
        "tiers": tiers,
        "reload_phases": reload_phases or {},
    }


def ms(x: Any) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def stall_markdown(st: dict[str, Any], names: list[str]) -> list[str]:
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
        "| loaded MiB | memcpy of those bytes (cold) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        m = st["by_config"].get(n) or {}
        if not m.get("resume_rounds"):
            continue
        tiers = ", ".join(f"{t} {ms(v)}" for t, v in sorted(m["load_mean_s_by_tier"].items()))
        lines.append(
            f"| {n} | {m['resume_rounds']} | {ms(m['ttft_mean_s'])} | {ms(m['load_mean_s'])}"
            f"{f' ({tiers})' if tiers else ''} | {ms(m['prefill_mean_s'])} | "
            f"{ms(m['queue_mean_s'])} | {m['prefill_tokens_mean']:,.0f} | "
            f"{m['load_bytes_mean'] / 2**20:.2f} | {ms(m['memcpy_mean_s'])} |"
        )
    if not st["tiers"]:
        return [*lines, "", "No agentkv reloads in this run (every hit was on the device)."]
    return [*lines, *_tier_markdown(st["tiers"]), *_phase_markdown(st)]


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _gbps(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def _tier_markdown(tiers: dict[str, Any]) -> list[str]:
    """Each tier's reload against a memcpy of the same bytes, cold (the target) and hot."""
    lines = [
        "",
        "| tier | reload jobs | MiB | copy time (s) | reload GB/s | memcpy GB/s, cold "
        "| **load / cold memcpy** (target <= 1.25) | memcpy GB/s, cache-hot "
        "| load / hot memcpy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t, d in sorted(tiers.items()):
        lines.append(
            f"| {t} | {d['reload_jobs']} | {d['reload_bytes'] / 2**20:,.1f} | "
            f"{d['reload_s']:.3f} | {_gbps(d['reload_bytes_per_s'])} | "
            f"{_gbps(d['memcpy_bytes_per_s'])} | {_ratio(d['load_over_memcpy'])} | "
            f"{_gbps(d.get('memcpy_hot_bytes_per_s'))} | {_ratio(d.get('load_over_memcpy_hot'))} |"
        )
    note = (
        "copy time: the plugin's own timing of each reload job (`agentkv_reload_seconds`), "
        "not its latency: a layer-by-layer load (CPU host hits) from its copy's first line to "
        "its host copies unpinned (a small step is copied inside `start_step` before the "
        "forward, a larger one by the copier thread next to it, sharing the cores); an async "
        "load from when a store worker took it up to its last block. The wait before either "
        "is in queue + rest above. memcpy: numpy copies of each tier's mean job size, in this "
        "process after the runs. Cold, the baseline the target uses: best of 5 copies block by "
        "block between shuffled slots of two pools twice the last-level cache, no slot used "
        "twice, so source and destination come from memory, as a reload's do (arena slots "
        "written when the context paused, KV cache blocks other requests used since). "
        "Cache-hot: best of 5 of one buffer, its source in cache (~1.5x faster on the 2-core "
        "dev VM); not what a reload can reach (docs/tiers.md)."
    )
    return [*lines, "", note]


def _phase_markdown(st: dict[str, Any]) -> list[str]:
    """Where the worker's layer-by-layer reload steps spent their time, per ReloadPhase."""
    phases: dict[str, Any] = st.get("reload_phases") or {}
    if not phases:
        return []
    host = st["tiers"].get("host") or {}
    jobs = host.get("reload_jobs") or 0
    cold_us = 1e6 * host["memcpy_s"] / jobs if jobs and host.get("memcpy_s") else None
    lines = [
        "",
        "Layer-by-layer reload steps on the worker, per phase "
        "(`agentkv_reload_phase_seconds`, slowest rank; copy time = disk + copy + release):",
        "",
        f"| phase | steps | mean per step (us) | total (s) | steps over {SLOW_PHASE_S * 1e3:g} ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, d in phases.items():
        lines.append(
            f"| {name} | {d['steps']} | {1e6 * d['mean_s']:,.0f} | {d['total_s']:.4f} | "
            f"{d.get('slow_steps', '-')} |"
        )
    own = sum((phases.get(p) or {}).get("total_s", 0.0) for p in ("disk", "copy", "release"))
    cpu, copy = phases.get("copy_cpu"), phases.get("copy")
    if cpu and copy and own > 0:
        lines += [
            "",
            f"The copying thread ran {cpu['total_s'] / own:.0%} of the copy time (disk + copy + "
            "release; the rest it was off the CPU or waiting for the GIL or the store's lock; "
            "its CPU clock is read just outside that span, so a little over 100% is none)"
            + (
                f"; the copy phase's mean per step against a cold memcpy of the host tier's mean"
                f" job: {1e6 * copy['mean_s']:,.0f} vs {cold_us:,.0f} us."
                if cold_us
                else "."
            ),
        ]
    return lines
