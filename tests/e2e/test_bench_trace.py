"""``agentkv bench agents --trace FILE --quick``: a tiny recorded workload replayed against three
real servers (vanilla, agentkv, oracle). A smoke test of the plumbing plus the behaviour the
trace is built to force: session ``a`` waits while ``b`` needs almost the whole pool, so its
device copy is evicted; agentkv reloads it from host RAM, vanilla recomputes, the oracle (a
pool sized from the trace) still has it on the device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

BLOCK = 128
# a: 1,000 tokens, then a 3 s wait; b arrives at 1 s and needs 10 of the 11 usable blocks.
TRACE = """session_id,arrival_time,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms
a,0,0,0,1000,4,3000
a,0,1,1004,100,4,0
b,1000,0,0,1200,4,200
b,1000,1,1204,60,4,0
c,2000,0,0,300,4,100
c,2000,1,304,40,4,0
"""


def test_bench_trace_quick(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.csv"
    trace.write_text(TRACE)
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "agentkv.cli", "bench", "agents", "--quick", "--trace"]
    cmd += [str(trace), "--num-blocks", "12", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert set(report["configs"]) == {"vanilla", "agentkv", "oracle"}
    assert report["server"]["num_blocks"] == 12
    assert report["server"]["oracle_blocks"] > 12
    planned = {("a", 0): 1000, ("a", 1): 1104, ("b", 0): 1200, ("b", 1): 1264}
    planned |= {("c", 0): 300, ("c", 1): 344}
    by: dict[str, dict[tuple[str, int], dict[str, Any]]] = {}
    for name, cfg in report["configs"].items():
        rounds = {(r["session_id"], r["round"]): r for r in cfg["rounds"]}
        by[name] = rounds
        # Every round sent as planned: token-exact prompts, exactly output_len tokens back.
        assert {k: r["prompt_tokens"] for k, r in rounds.items()} == planned, name
        assert all(r["completion_tokens"] == 4 for r in rounds.values()), name
        assert all(0 < r["ttft_s"] <= r["latency_s"] for r in rounds.values()), name
        assert len(cfg["stall"]) == 3, name  # one row per resume round
        assert cfg["summary"]["resume_rounds"] == 3
    # The oracle's resume rounds are device hits: every whole block of their history.
    for r in by["oracle"].values():
        if r["kind"] == "resume":
            assert r["cached_tokens"] >= r["reusable_tokens"] // BLOCK * BLOCK, r
    assert report["oracle_check"]["held"] is True
    # a's context was evicted by b: vanilla recomputes it, agentkv loads it from host RAM.
    a_van, a_akv = by["vanilla"][("a", 1)], by["agentkv"][("a", 1)]
    assert a_van["cached_tokens"] < 1000 // BLOCK * BLOCK
    assert a_akv["tier"] == "host" and a_akv["tier_hit_tokens"] > 0
    assert a_akv["cached_tokens"] >= 1000 // BLOCK * BLOCK
    assert a_akv["decision"]
    # The stall taken apart: the host load measured, next to a memcpy of the same bytes.
    stall = report["stall_decomposition"]
    assert stall["prefill_tokens_per_s"] > 0
    host = stall["tiers"]["host"]
    assert host["reload_jobs"] >= 1 and host["reload_bytes"] > 0 and host["reload_s"] > 0
    assert host["memcpy_s"] > 0 and host["load_over_memcpy"] > 0
    akv = stall["by_config"]["agentkv"]
    assert akv["rounds_with_load"] >= 1 and akv["load_mean_s_by_tier"]["host"] > 0
    assert stall["by_config"]["oracle"]["load_mean_s"] == 0.0
    md = (out / "report.md").read_text()
    assert "| metric | vanilla | agentkv | oracle | agentkv / vanilla | agentkv / oracle |" in md
    assert "## Resume stall, taken apart" in md
    for png in ("trace_ttft_cdf.png", "trace_stall.png", "trace_kv_occupancy.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
