"""`agentkv bench tiers`: JSON on stdout, every tier measured, clean one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from agentkv.cli import app


def test_bench_tiers_json_measures_every_tier(tmp_path: Path) -> None:
    args = [
        "bench",
        "tiers",
        "--disk-dir",
        str(tmp_path),
        "--total-mib",
        "2",
        "--block-kib",
        "64",
        "--block-kib",
        "1024",
    ]
    result = CliRunner().invoke(app, [*args, "--repeats", "1", "--workers", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    operations = {(m["operation"], m["block_bytes"]) for m in report["measurements"]}
    expected = {"host store", "host load", "disk write", "disk read"}
    assert operations == {(op, size << 10) for op in expected for size in (64, 1024)}
    for m in report["measurements"]:
        assert m["gbps"] > 0 and m["baseline_gbps"] > 0
        assert (m["target"] is None) == (m["block_bytes"] < 1 << 20)
    assert list(tmp_path.iterdir()) == []  # its scratch directory is removed


def test_bench_tiers_unusable_disk_dir_is_one_line_exit_2(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "tiers",
            "--disk-dir",
            str(not_a_dir / "sub"),
            "--total-mib",
            "1",
            "--repeats",
            "1",
        ],
    )
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert "error: cannot benchmark the disk tier" in result.output
