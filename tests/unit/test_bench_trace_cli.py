"""``agentkv bench agents --trace``: bad input fails fast (no server starts) with a clear error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

GOOD = """session_id,arrival_time,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms
a,0,0,0,1000,4,3000
a,0,1,1004,sixty,4,0
"""
CMD = [sys.executable, "-m", "agentkv.cli", "bench", "agents", "--quick", "--trace"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=120)


def test_malformed_trace_names_file_line_and_field(tmp_path: Path) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text(GOOD)
    proc = _run(str(trace), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    err = " ".join(proc.stderr.split())  # rich wraps long lines
    assert f"{trace}:3: field 'input_len': expected an integer >= 0, got 'sixty'" in err
    assert not (tmp_path / "out").exists()  # failed before anything ran


def test_pool_too_small_and_generator_flags_are_refused(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(GOOD.replace("sixty", "60"))
    proc = _run(str(trace), "--num-blocks", "8", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "--num-blocks 8 cannot hold the longest request" in " ".join(proc.stderr.split())
    proc = _run(str(trace), "--turns", "3")
    assert proc.returncode == 2
    assert "--turns shape the generated workload" in " ".join(proc.stderr.split())
