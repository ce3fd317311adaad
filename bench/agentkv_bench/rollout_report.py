"""What ``agentkv bench rollout`` reports, from its step results (pure: no server, no vLLM).

Primitives:
  summarize(steps)          -> one configuration's figures at one pool size: step wall times,
                               tokens prefilled (prompt minus cached), TTFT of first turns and of
                               resumes (turn >= 2), the syncs and the tier blocks left after them
  compare(vanilla, agentkv) -> the ratios (vanilla / agentkv: > 1 means agentkv is faster)
  verdict(pool_kind, ratio) -> whether the issue-41 target of that pool holds
  to_markdown(report)       -> report.md
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from enum import StrEnum
from statistics import median
from typing import Any

from agentkv_bench.rollout import StepResult

# Issue 41's targets: a tight pool's rollout step >= 1.3x faster than vanilla; a roomy one's
# within 3% of vanilla.
TIGHT_SPEEDUP = 1.3
ROOMY_FLOOR = 0.97


class PoolKind(StrEnum):
    TIGHT = "tight"
    ROOMY = "roomy"


def _quantile(xs: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile by the nearest-rank rule (no interpolation: a p99 of 30 values is the
    largest, which is what a reader of a tail expects)."""
    if not xs:
        return None
    ordered = sorted(xs)
    rank = max(1, min(len(ordered), math.ceil(q * len(ordered))))
    return ordered[rank - 1]


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def summarize(steps: Sequence[StepResult]) -> dict[str, Any]:
    """One configuration at one pool size. ``step_wall_s`` is every step's; the headline is
    their median (the first step starts cold in both configurations and is kept in)."""
    turns = [t for s in steps for t in s.turns]
    resumes = [t.ttft_s for t in turns if t.turn > 1]
    firsts = [t.ttft_s for t in turns if t.turn == 1]
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    walls = [s.wall_s for s in steps]
    syncs = [s.sync_s for s in steps if s.sync_s is not None]
    left = [s.tier_blocks_after_sync for s in steps if s.tier_blocks_after_sync is not None]
    return {
        "steps": len(steps),
        "requests": len(turns),
        "step_wall_s": [round(w, 3) for w in walls],
        "step_wall_median_s": _r(median(walls) if walls else None, 3),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefilled_tokens": prompt - cached,
        "resume_ttft_p50_s": _r(_quantile(resumes, 0.5)),
        "resume_ttft_p99_s": _r(_quantile(resumes, 0.99)),
        "first_ttft_p50_s": _r(_quantile(firsts, 0.5)),
        "sync_s": [round(s, 3) for s in syncs],
        "tier_blocks_after_sync": left,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 3)


def compare(vanilla: Mapping[str, Any], agentkv: Mapping[str, Any]) -> dict[str, Any]:
    """vanilla / agentkv of the step wall time (the speedup), the resume TTFT and the tokens
    prefilled: above 1, agentkv does better."""
    return {
        "step_speedup": _ratio(vanilla["step_wall_median_s"], agentkv["step_wall_median_s"]),
        "resume_ttft_p50": _ratio(vanilla["resume_ttft_p50_s"], agentkv["resume_ttft_p50_s"]),
        "resume_ttft_p99": _ratio(vanilla["resume_ttft_p99_s"], agentkv["resume_ttft_p99_s"]),
        "prefilled_tokens": _ratio(vanilla["prefilled_tokens"], agentkv["prefilled_tokens"]),
    }


def verdict(kind: PoolKind, speedup: float | None) -> dict[str, Any]:
    """The issue-41 target of a ``kind`` pool and whether ``speedup`` meets it."""
    target = TIGHT_SPEEDUP if kind is PoolKind.TIGHT else ROOMY_FLOOR
    return {"target": f">= {target}", "met": speedup is not None and speedup >= target}


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3f}"
    if isinstance(x, list):
        return ", ".join(_fmt(v) for v in x) or "-"
    return str(x)


def to_markdown(report: Mapping[str, Any]) -> str:
    shape = report["shape"]
    lines = [
        "# agentkv bench rollout",
        "",
        f"`{report['command']}` ({report['started_at']}, {report['machine'].get('cpu', '?')}, "
        f"{report['machine'].get('cpus', '?')} CPUs, preset `{report['preset']}`)",
        "",
        f"{shape['trajectories']} trajectories (groups of {shape['group']}) x {shape['turns']} "
        f"turns x {shape['steps']} rollout steps; prompt {shape['system_tokens']} template + "
        f"{shape['task_tokens']} task tokens, {shape['observation_tokens']} observation and "
        f"{shape['output_tokens']} output tokens per turn; environment steps lognormal "
        f"(median {shape['env_median_s']} s, sigma {shape['env_sigma']}); an OpenRLHF weight "
        "sync (`/collective_rpc update_weight`, plain `/reset_prefix_cache`) between steps.",
        "",
        "| pool | blocks | config | step wall median (s) | each step (s) | prefilled tokens | "
        "resume TTFT p50 / p99 (s) | tier blocks after syncs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for pool in report["pools"]:
        for name in ("vanilla", "agentkv"):
            s = pool["configs"].get(name)
            if s is None:
                continue
            lines.append(
                f"| {pool['kind']} | {pool['num_blocks']} | {name} | "
                f"{_fmt(s['step_wall_median_s'])} | {_fmt(s['step_wall_s'])} | "
                f"{s['prefilled_tokens']} | {_fmt(s['resume_ttft_p50_s'])} / "
                f"{_fmt(s['resume_ttft_p99_s'])} | {_fmt(s['tier_blocks_after_sync'])} |"
            )
    lines += [
        "",
        "| pool | step speedup (vanilla / agentkv) | target | met | resume TTFT p50 / p99 "
        "ratio | prefilled ratio |",
        "|---|---|---|---|---|---|",
    ]
    for pool in report["pools"]:
        r = pool.get("ratios")
        if not r:
            continue
        v = pool["verdict"]
        lines.append(
            f"| {pool['kind']} ({pool['num_blocks']} blocks) | {_fmt(r['step_speedup'])} | "
            f"{v['target']} | {'yes' if v['met'] else 'no'} | {_fmt(r['resume_ttft_p50'])} / "
            f"{_fmt(r['resume_ttft_p99'])} | {_fmt(r['prefilled_tokens'])} |"
        )
    lines += [
        "",
        "Ratios are vanilla / agentkv (above 1: agentkv better). Tier blocks after syncs: what "
        "agentkv's host and disk tiers held right after each weight sync (must be 0: nothing "
        "computed by older weights stays loadable).",
        "",
    ]
    return "\n".join(lines)
