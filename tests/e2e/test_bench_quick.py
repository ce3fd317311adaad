"""``agentkv bench agents --quick``: completes against two real servers and writes a
well-formed report. A smoke test, not a timed one: the targets are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

TURN_KEYS = {
    "trajectory_id",
    "branch",
    "turn",
    "kind",
    "ttft_s",
    "latency_s",
    "prompt_tokens",
    "cached_tokens",
    "recomputed_tokens",
    "completion_tokens",
}
SUMMARY_KEYS = {
    "resume_ttft_p50_s",
    "resume_ttft_p99_s",
    "ttft_p50_s",
    "jct_mean_s",
    "recomputed_tokens",
    "prefix_hit_rate",
    "decode_tok_s",
    "hit_rate_by_turn",
}


def test_bench_agents_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", "bench", "agents", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert set(report["configs"]) == {"vanilla", "agentkv"}
    planned = sum(
        max(1, t["fork"]) for tr in report["workload"]["trajectories"] for t in tr["turns"]
    )
    for name, cfg in report["configs"].items():
        assert set(cfg["summary"]) >= SUMMARY_KEYS, name
        assert len(cfg["turns"]) == planned, name
        for t in cfg["turns"]:
            assert set(t) >= TURN_KEYS
            assert t["prompt_tokens"] > 0 and 0 < t["ttft_s"] <= t["latency_s"]
            assert t["completion_tokens"] == 8  # ignore_eos: exactly max_tokens
        assert cfg["samples"], name
        assert len(cfg["trajectories"]) == 3 and all(x["jct_s"] > 0 for x in cfg["trajectories"])
    # Same plan, same prompts: the two configurations sent identical token counts.
    key = lambda t: (t["trajectory_id"], t["branch"], t["turn"])  # noqa: E731
    prompts = {
        n: sorted((key(t), t["prompt_tokens"]) for t in c["turns"])
        for n, c in report["configs"].items()
    }
    assert prompts["vanilla"] == prompts["agentkv"]
    agentkv_turns = report["configs"]["agentkv"]["turns"]
    assert all(t["decision"] for t in agentkv_turns if t["kind"] == "resume")
    assert all(t["device_hit_tokens"] is not None for t in agentkv_turns)
    assert {t["name"] for t in report["targets"]} and len(report["targets"]) == 3
    assert report["native_offload"]["status"] in ("skipped", "not run")
    assert "| metric | vanilla vLLM |" in (out / "report.md").read_text()
    for png in ("ttft_cdf.png", "kv_occupancy.png", "hit_rate_by_turn.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
