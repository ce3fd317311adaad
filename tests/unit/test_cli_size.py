"""`agentkv size` and `agentkv plan` through the real root app: worked numbers, JSON, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from agentkv.cli import app

CONFIGS = Path(__file__).parent / "configs"
L70 = str(CONFIGS / "llama-3.1-70b.json")
runner = CliRunner()


def run_json(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def contexts(report: dict[str, Any], key: str) -> list[Any]:
    return [row[key] for row in report["contexts"]]


def test_napkin_01_on_a_526_gb_pool() -> None:
    report = run_json("size", L70, "--tp", "8", "--pool-bytes", "526e9")
    assert report["bytes_per_token"] == 327_680
    assert report["bytes_per_token_per_device"] == 40_960
    assert report["kv_pool_bytes"] == report["usable_pool_bytes"] == 526 * 10**9
    assert contexts(report, "tokens") == [8192, 32_768, 131_072]
    assert contexts(report, "max_trajectories") == [195, 48, 12]
    assert contexts(report, "bytes") == [s * 327_680 for s in (8192, 32_768, 131_072)]


def test_napkin_01_from_the_node_memory() -> None:
    report = run_json(
        "size",
        L70,
        "--tp",
        "8",
        "--gpu",
        "H100",
        "--gpus",
        "8",
        "--weights-bytes",
        "141.2GB",
        "--runtime-bytes",
        "20GB",
    )
    assert round(report["kv_pool_bytes"] / 1e9, 1) == 526.0
    assert contexts(report, "max_trajectories") == [195, 48, 12]


def test_napkin_01_480_gib() -> None:
    report = run_json("size", L70, "--tp", "8", "--pool-bytes", "480GiB", "-c", "8192,131072")
    assert contexts(report, "max_trajectories") == [192, 12]


def test_napkin_02_static_reservation() -> None:
    report = run_json(
        "size",
        L70,
        "--tp",
        "2",
        "--pool-bytes",
        "20GiB",
        "-c",
        "2048",
        "--static-max-tokens",
        "16384",
    )
    assert report["bytes_per_token_per_device"] == 163_840
    assert contexts(report, "static_max_requests") == [4]
    assert contexts(report, "static_allocation_efficiency") == [0.125]


@pytest.mark.parametrize(("block", "percent"), [(16, 0.12), (64, 0.51)])
def test_napkin_03_blocks_and_tail_waste(block: int, percent: float) -> None:
    report = run_json(
        "size",
        L70,
        "--tp",
        "8",
        "--pool-bytes",
        "480GiB",
        "-c",
        "8192",
        "--block-size",
        str(block),
        "--sequences",
        "256",
    )
    if block == 16:
        assert report["paged"]["num_blocks_per_device"] == 98_304
        assert report["paged"]["block_bytes_per_device"] == 640 * 1024
    assert round(contexts(report, "fragmentation_ratio")[0] * 100, 2) == percent


def test_napkin_07_prefix_sharing() -> None:
    report = run_json(
        "size",
        L70,
        "--tp",
        "8",
        "--hbm-bytes",
        "640GB",
        "--weights-bytes",
        "140GB",
        "--runtime-bytes",
        "36GB",
        "--headroom",
        "0.1",
        "-c",
        "32768",
        "--output-tokens",
        "2048",
        "--shared-tokens",
        "24576",
    )
    assert report["kv_pool_bytes"] == 464 * 10**9
    assert contexts(report, "max_trajectories") == [36]
    assert contexts(report, "max_trajectories_shared") == [122]


def test_defaults_estimate_weights_and_runtime() -> None:
    report = run_json("size", str(CONFIGS / "llama-3.1-8b.json"), "--gpu", "h100", "-c", "8192")
    memory = report["memory"]
    assert memory["weights_bytes"] == 2 * 8_030_261_248
    assert memory["runtime_bytes"] == 8 * 2**30  # 10% of 80 GiB
    assert (
        report["kv_pool_bytes"]
        == memory["hbm_bytes"] - memory["weights_bytes"] - memory["runtime_bytes"]
    )


def test_footprint_only_without_memory() -> None:
    report = run_json("size", str(CONFIGS / "deepseek-v3.json"), "--tp", "8", "-c", "1000")
    assert report["bytes_per_token"] == report["bytes_per_token_per_device"] == 70_272
    assert report["kv_pool_bytes"] is None
    assert contexts(report, "max_trajectories") == [None]


def test_rich_table_names_units() -> None:
    result = runner.invoke(app, ["size", L70, "--tp", "8", "--pool-bytes", "526e9"])
    assert result.exit_code == 0
    assert "GiB" in result.stdout and "GB" in result.stdout and "195" in result.stdout


def test_context_beyond_max_position_warns_but_computes() -> None:
    result = runner.invoke(
        app, ["size", L70, "--tp", "8", "--pool-bytes", "480GiB", "-c", "262144", "--json"]
    )
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert contexts(report, "max_trajectories") == [6]
    assert report["warnings"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tp", "3"], "does not divide"),
        (["--pool-bytes", "-5GB"], "negative"),
        (["--pool-bytes", "0"], "positive"),
        (["--pool-bytes", "12G"], "unknown byte unit"),
        (["-c", "0"], "positive"),
        (["-c", "abc"], "not a token count"),
        (["--gpu", "V100"], "unknown GPU preset"),
        (["--gpu", "L40S", "--tp", "1"], "no memory left"),
        (["--headroom", "1.5", "--pool-bytes", "1GB"], "headroom"),
        (["--kv-dtype", "fp3"], "unknown dtype"),
    ],
)
def test_bad_input_one_line_exit_2(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["size", L70, *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_malformed_config_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{")
    result = runner.invoke(app, ["size", str(tmp_path)])
    assert result.exit_code == 2 and "malformed JSON" in result.stderr


def test_size_help_documents_every_flag() -> None:
    result = runner.invoke(app, ["size", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for flag in (
        "--context",
        "--kv-dtype",
        "--tp",
        "--gpu",
        "--gpus",
        "--hbm-bytes",
        "--weights-bytes",
        "--runtime-bytes",
        "--pool-bytes",
        "--headroom",
        "--output-tokens",
        "--shared-tokens",
        "--block-size",
        "--static-max-tokens",
        "--sequences",
        "--json",
    ):
        assert flag in result.stdout


def test_plan_for_n_trajectories() -> None:
    report = run_json(
        "plan",
        L70,
        "-c",
        "32768",
        "-n",
        "200",
        "--gpu",
        "H100",
        "--tp",
        "8",
        "--runtime-bytes-per-gpu",
        "2.5GB",
    )
    best = report["plans"]["without_offload"]["best"]
    assert best["tp"] == 8
    assert best["replicas"] == -(-200 // best["trajectories_per_replica"])
    assert best["gpus"] == 8 * best["replicas"] and best["nodes"] == best["replicas"]


def test_plan_tool_wait_profile_offload_needs_fewer_gpus() -> None:
    report = run_json(
        "plan",
        L70,
        "-c",
        "32768",
        "--arrival-rate",
        "2",
        "--gen-seconds",
        "5",
        "--tool-seconds",
        "45",
        "--gpu",
        "H200",
    )
    assert report["littles_law"]["in_flight"] == 100.0
    plans = report["plans"]
    assert plans["without_offload"]["target_trajectories"] == 100
    assert plans["with_offload"]["target_trajectories"] == 10
    assert plans["with_offload"]["best"]["gpus"] < plans["without_offload"]["best"]["gpus"]


def test_plan_bad_input() -> None:
    result = runner.invoke(app, ["plan", L70, "-c", "1000", "--gpu", "H100"])
    assert result.exit_code == 2 and "--trajectories" in result.stderr
