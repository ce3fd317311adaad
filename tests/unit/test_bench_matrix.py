"""The fixed-policy configuration matrix: parsing, the specs, the runs of a sweep."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentkv_bench.matrix import (
    FIXED_POLICIES,
    SPECS,
    BenchConfig,
    Cell,
    Driver,
    cells,
    parse_configs,
    parse_num_blocks,
)


def test_parse_configs_keeps_order_and_drops_duplicates() -> None:
    got = parse_configs("vanilla, agentkv,retain-always,offload-always,oracle,agentkv")
    assert got == (
        BenchConfig.VANILLA,
        BenchConfig.AGENTKV,
        BenchConfig.RETAIN_ALWAYS,
        BenchConfig.OFFLOAD_ALWAYS,
        BenchConfig.ORACLE,
    )


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty"),
        ("vanilla,retain", "unknown configuration 'retain'"),
        ("vanilla,oracle", "must include agentkv"),
    ],
)
def test_parse_configs_refuses_bad_lists(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_configs(text)


def test_parse_num_blocks() -> None:
    assert parse_num_blocks("96, 48,24,48") == (96, 48, 24)
    with pytest.raises(ValueError, match="not an integer"):
        parse_num_blocks("96,lots")
    with pytest.raises(ValueError, match="below the minimum"):
        parse_num_blocks("96,4")
    with pytest.raises(ValueError, match="empty"):
        parse_num_blocks(" , ")


def test_fixed_policies_are_real_server_configurations() -> None:
    # retain-always / offload-always: the connector plus one fixed action, driven exactly like
    # agentkv (trajectory params, pause, resume); vanilla and the oracle: no connector at all.
    for c in (BenchConfig.RETAIN_ALWAYS, BenchConfig.OFFLOAD_ALWAYS, BenchConfig.AGENTKV):
        assert SPECS[c].connector and SPECS[c].driver is Driver.TRAJECTORY
    assert SPECS[BenchConfig.RETAIN_ALWAYS].connector_settings == {"policy_override": "retain"}
    assert SPECS[BenchConfig.OFFLOAD_ALWAYS].connector_settings == {
        "policy_override": "offload_host"
    }
    assert SPECS[BenchConfig.AGENTKV].connector_settings == {}
    for c in (BenchConfig.VANILLA, BenchConfig.ORACLE):
        assert not SPECS[c].connector and SPECS[c].driver is Driver.PLAIN
    assert SPECS[BenchConfig.ORACLE].oracle_pool and not SPECS[BenchConfig.VANILLA].oracle_pool
    assert BenchConfig.AGENTKV not in FIXED_POLICIES
    assert BenchConfig.ORACLE not in FIXED_POLICIES
    assert set(SPECS) == set(BenchConfig)


def test_cells_run_each_pool_then_the_oracle_once() -> None:
    got = cells(parse_configs("oracle,vanilla,agentkv"), (96, 24))
    assert got == [
        Cell(BenchConfig.VANILLA, 96),
        Cell(BenchConfig.AGENTKV, 96),
        Cell(BenchConfig.VANILLA, 24),
        Cell(BenchConfig.AGENTKV, 24),
        Cell(BenchConfig.ORACLE, None),
    ]
    assert [c.label for c in got][-2:] == ["agentkv@24", "oracle"]


def test_connector_config_of_each_configuration(tmp_path: Path) -> None:
    """One definition for the agents bench and the trace replay: vanilla and the oracle run
    without the connector; agentkv's knobs go to every agentkv configuration, and a fixed
    configuration's own override comes last."""
    from agentkv_bench.runner import BenchOptions, connector_config

    opts = BenchOptions(host_capacity_gib=3.0, disk=True, prefetch=False)
    assert connector_config(opts, "vanilla", tmp_path / "d") is None
    assert connector_config(opts, "oracle", tmp_path / "d") is None
    agentkv = connector_config(opts, "agentkv", tmp_path / "d")
    assert agentkv == {
        "host_capacity_gib": 3.0,
        "disk_dir": str(tmp_path / "d"),
        "device_prefetch": False,
        "disk_after_s": 0.0,
    }
    fixed = connector_config(BenchOptions(), "retain-always", tmp_path / "r")
    assert fixed is not None and fixed["policy_override"] == "retain"
    assert fixed["device_prefetch"] is True and "disk_after_s" not in fixed
