"""The ``prefetch`` column of ``agentkv bench agents``: how device prefetch did.

Primitives:
  prefetch_section(configs) -> dict   from one run's configurations (report.json's ``configs``):
                                      agentkv's device-prefetch outcomes (on_time / late /
                                      wasted, the on-time rate) and the resume TTFT of its
                                      on-time resumes against the oracle's (vanilla vLLM with a
                                      pool that never evicts: every resume a device hit) on the
                                      same turns; None when agentkv did not run
  prefetch_markdown(section) -> lines

An on-time resume found its context pinned on the device, so it should cost what the oracle's
device hit costs: the target is agentkv/oracle <= 1.1 on those turns (the same turn of the same
trajectory in both runs). Resumes that reloaded from a tier are shown beside them for scale.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentkv.stats import percentile

TARGET_RATIO = 1.1


def _key(turn: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """The same request in two runs: a bench turn by (trajectory, branch, turn), a trace round
    by (session, round) (trajectory ids are per run there)."""
    if "round" in turn:
        return (turn.get("session_id"), None, turn.get("round"))
    return (turn.get("trajectory_id"), turn.get("branch"), turn.get("turn"))


def _requests(config: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """A run's measured requests: a bench's turns or a trace's rounds."""
    if not config:
        return []
    return list(config.get("turns") or config.get("rounds") or ())


def _p50(xs: list[float]) -> float | None:
    return percentile(xs, 50) if xs else None


def prefetch_section(configs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    agentkv = configs.get("agentkv")
    if agentkv is None:
        return None
    status = agentkv.get("device_prefetch") or {}
    counts = {k: int(status.get(k) or 0) for k in ("on_time", "late", "wasted")}
    total = sum(counts.values())
    resumes = [t for t in _requests(agentkv) if t.get("kind") == "resume"]
    on_time = [t for t in resumes if t.get("prefetch") == "on_time"]
    reloaded = [t for t in resumes if (t.get("tier_hit_tokens") or 0) > 0]
    oracle = configs.get("oracle")
    oracle_by_key = {_key(t): t for t in _requests(oracle)}
    pairs = [(t, oracle_by_key[_key(t)]) for t in on_time if _key(t) in oracle_by_key]
    a = _p50([float(t["ttft_s"]) for t, _ in pairs])
    o = _p50([float(u["ttft_s"]) for _, u in pairs])
    ratio = a / o if a is not None and o else None
    return {
        "enabled": bool(status.get("enabled")),
        **counts,
        "on_time_rate": counts["on_time"] / total if total else None,
        "skipped": dict(status.get("skipped") or {}),
        "resumes": len(resumes),
        "on_time_resumes": len(on_time),
        "on_time_resume_ttft_p50_s": _p50([float(t["ttft_s"]) for t in on_time]),
        "tier_reload_resume_ttft_p50_s": _p50([float(t["ttft_s"]) for t in reloaded]),
        "matched_oracle_turns": len(pairs),
        "oracle_ttft_p50_s_same_turns": o,
        "on_time_over_oracle": ratio,
        "target": f"on-time resume TTFT p50 / oracle's on the same turns <= {TARGET_RATIO}",
        "met": None if ratio is None else ratio <= TARGET_RATIO,
    }


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def prefetch_markdown(section: Mapping[str, Any] | None) -> list[str]:
    if not section:
        return []
    if not section.get("enabled"):
        return ["", "## Device prefetch", "", "Off in this run (`--no-prefetch`)."]
    return [
        "",
        "## Device prefetch",
        "",
        "| on time | late | wasted | on-time rate | on-time resume TTFT p50 (s) | oracle, "
        "same turns (s) | agentkv/oracle | tier-reload resume TTFT p50 (s) |",
        "|---|---|---|---|---|---|---|---|",
        f"| {section['on_time']} | {section['late']} | {section['wasted']} "
        f"| {_fmt(section['on_time_rate'])} | {_fmt(section['on_time_resume_ttft_p50_s'])} "
        f"| {_fmt(section['oracle_ttft_p50_s_same_turns'])} "
        f"| {_fmt(section['on_time_over_oracle'])} "
        f"| {_fmt(section['tier_reload_resume_ttft_p50_s'])} |",
        "",
        f"Skipped (never-worse rules): {section['skipped'] or 'none'}. "
        f"Target: {section['target']} ({section['matched_oracle_turns']} turns matched; "
        "run with `--configs vanilla,agentkv,oracle` for the oracle column).",
    ]
