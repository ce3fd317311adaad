"""`agentkv bench tiers`: JSON on stdout, every tier measured, clean one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import valkey
from typer.testing import CliRunner

from agentkv.cli import app
from tests.valkey_fixture import valkey_server, valkey_url  # noqa: F401


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


def test_bench_tiers_device_cpu_reports_batched_path_ratios_per_batch(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    args = ["bench", "tiers", "--disk-dir", str(tmp_path), "--total-mib", "2", "--block-kib", "64"]
    args += ["--block-kib", "1024", "--device", "cpu", "--layers", "4", "--repeats", "1", "--json"]
    args += ["--batch", "1", "--batch", "8", "--batch", "32"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["device"] == "cpu" and report["layers"] == 4 and report["gds"] is None
    seen = {(m["operation"], m["block_bytes"], m["batch"]): m for m in report["measurements"]}
    # 2 MiB per run: 32 blocks of 64 KiB (every batch), 2 blocks of 1 MiB (batch 1 only)
    host_runs = [(64, 1), (64, 8), (64, 32), (1024, 1)]
    for op in ("device->host store", "host->device load"):
        for size, batch in host_runs:
            m = seen[(op, size << 10, batch)]
            assert m["baseline"] == "memory copy"  # CPU: the bytes never leave host memory
            assert m["gbps"] > 0 and m["baseline_gbps"] > 0
            assert m["ratio"] == pytest.approx(m["gbps"] / m["baseline_gbps"])
            assert m["target"] is None  # below 1 MiB, or fewer than 8 blocks per call
            assert m["cpu_ratio"] > 0  # CPU: the copy's cost next to the memcpy's
    assert report["native_copies"] in (True, False)  # the bench says which CPU path it measured
    assert all(m["cpu_ratio"] is None for m in report["measurements"] if m["batch"] is None)
    assert report["skipped"] == ["1024 KiB x 8 blocks per call", "1024 KiB x 32 blocks per call"]
    for op, baseline in (
        ("device->disk store", "sequential write"),
        ("disk->device load", "sequential read"),
    ):
        assert seen[(op, 64 << 10, 32)]["baseline"] == baseline  # the largest batch that fits
        assert seen[(op, 1024 << 10, 1)]["target"] == 0.7
    assert list(tmp_path.iterdir()) == []


def test_bench_tiers_device_target_applies_at_one_mib_and_eight_blocks(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    args = ["bench", "tiers", "--no-disk", "--total-mib", "8", "--block-kib", "1024"]
    args += ["--device", "cpu", "--layers", "2", "--repeats", "1", "--batch", "8", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    targets = {m["operation"]: m["target"] for m in report["measurements"] if m["batch"] == 8}
    assert targets == {"device->host store": 0.8, "host->device load": 0.8}


def test_bench_tiers_rejects_an_unknown_device() -> None:
    result = CliRunner().invoke(app, ["bench", "tiers", "--device", "tpu", "--no-disk"])
    assert result.exit_code == 2 and "--device must be" in result.output


def test_bench_tiers_remote_measures_put_and_get_and_leaves_nothing(valkey_url: str) -> None:  # noqa: F811
    args = ["bench", "tiers", "--no-disk", "--total-mib", "1", "--block-kib", "256"]
    args += ["--remote", f"{valkey_url}?key_prefix=benchtest", "--repeats", "1", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["remote"] == valkey_url
    seen = {m["operation"]: m for m in report["measurements"]}
    assert seen["remote put"]["baseline"] == "raw pipelined SET"
    assert seen["remote get"]["baseline"] == "raw pipelined GET"
    for op in ("remote put", "remote get"):
        assert seen[op]["gbps"] > 0 and seen[op]["baseline_gbps"] > 0 and seen[op]["target"] is None
    client = valkey.Valkey.from_url(valkey_url)
    try:
        assert list(client.scan_iter("benchtest*")) == []  # bench keys are deleted afterwards
    finally:
        client.close()


@pytest.mark.parametrize(
    ("url", "message"),
    [("http://x", "scheme 'http' is not supported"), ("valkey://127.0.0.1:1/0", "does not answer")],
)
def test_bench_tiers_bad_remote_is_one_line_exit_2(url: str, message: str) -> None:
    args = ["bench", "tiers", "--no-disk", "--total-mib", "1", "--block-kib", "64"]
    result = CliRunner().invoke(app, [*args, "--remote", url, "--repeats", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert message in result.output
