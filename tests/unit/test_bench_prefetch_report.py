"""The bench's prefetch column (bench/agentkv_bench/prefetch_report.py): outcomes from the
server's status, on-time resumes' TTFT against the oracle's on the same turns."""

from __future__ import annotations

from typing import Any

from agentkv_bench.prefetch_report import prefetch_markdown, prefetch_section


def _turn(tid: str, turn: int, ttft: float, **kw: Any) -> dict[str, Any]:
    return {
        "trajectory_id": tid,
        "branch": "main",
        "turn": turn,
        "kind": "resume",
        "ttft_s": ttft,
        **kw,
    }


def test_on_time_resumes_are_compared_with_the_oracle_on_the_same_turns() -> None:
    configs = {
        "agentkv": {
            "device_prefetch": {
                "enabled": True,
                "on_time": 3,
                "late": 1,
                "wasted": 0,
                "skipped": {"spread": 2},
            },
            "turns": [
                _turn("a", 2, 0.11, prefetch="on_time", tier_hit_tokens=0),
                _turn("b", 2, 0.13, prefetch="on_time", tier_hit_tokens=0),
                _turn("c", 2, 0.50, prefetch="late", tier_hit_tokens=256),
                {**_turn("a", 1, 9.0), "kind": "first"},
            ],
        },
        "oracle": {"turns": [_turn("a", 2, 0.10), _turn("b", 2, 0.10), _turn("c", 2, 0.1)]},
    }
    s = prefetch_section(configs)
    assert s is not None
    assert (s["on_time"], s["late"], s["wasted"]) == (3, 1, 0)
    assert s["on_time_rate"] == 0.75
    assert s["on_time_resumes"] == 2 and s["matched_oracle_turns"] == 2
    assert abs(s["on_time_over_oracle"] - 1.2) < 1e-9  # p50 0.12 / 0.10
    assert s["met"] is False
    assert s["tier_reload_resume_ttft_p50_s"] == 0.5
    text = "\n".join(prefetch_markdown(s))
    assert "| 3 | 1 | 0 | 0.750 |" in text and "spread" in text


def test_without_an_oracle_or_agentkv_the_ratio_is_not_claimed() -> None:
    assert prefetch_section({"vanilla": {"turns": []}}) is None
    s = prefetch_section({"agentkv": {"device_prefetch": {"enabled": True}, "turns": []}})
    assert s is not None and s["on_time_over_oracle"] is None and s["met"] is None
    assert s["on_time_rate"] is None


def test_trace_rounds_match_by_session_and_round() -> None:
    def rnd(sid: str, tid: str, r: int, ttft: float, **kw: Any) -> dict[str, Any]:
        return {
            "session_id": sid,
            "trajectory_id": tid,
            "round": r,
            "kind": "resume",
            "ttft_s": ttft,
            **kw,
        }

    configs = {
        "agentkv": {
            "device_prefetch": {"enabled": True, "on_time": 1},
            "rounds": [rnd("s1", "trace-agentkv-0", 1, 0.2, prefetch="on_time")],
        },
        "oracle": {"rounds": [rnd("s1", "trace-oracle-0", 1, 0.2)]},
    }
    s = prefetch_section(configs)
    assert s is not None and s["matched_oracle_turns"] == 1
    assert s["on_time_over_oracle"] == 1.0 and s["met"] is True
