"""What the scheduler side derives from vLLM's config and the connector settings
(plugins/agentkv_vllm/engine_config.py), and that SchedulerSide wires it into the manager:
a setting that stops reaching the manager fails here, not only in an e2e run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest

from agentkv.policy import Writeback
from agentkv_vllm.engine_config import GiB, layerwise, tier_blocks
from agentkv_vllm.scheduler_side import SchedulerSide
from agentkv_vllm.settings import ConnectorSettings

PAGE, LAYERS, TP, BLOCK = 4096, 3, 2, 16


def _vllm_config(device: str = "cpu", events: bool | None = None) -> tuple[Any, Any]:
    spec = NS(page_size_bytes=PAGE, num_kv_heads=2, head_size=64)
    groups = [NS(layer_names=[f"l{i}" for i in range(LAYERS)], kv_cache_spec=spec)]
    config = NS(
        cache_config=NS(block_size=BLOCK, cache_dtype="auto"),
        parallel_config=NS(tensor_parallel_size=TP, data_parallel_rank=0),
        model_config=NS(
            model="/nonexistent/model",
            revision=None,
            dtype="bfloat16",
            hf_overrides=None,
            quantization=None,
            hf_config=NS(to_dict=lambda: {}),  # no geometry: costs from the profile only
        ),
        device_config=NS(device_type=device),
        kv_events_config=None if events is None else NS(enable_kv_cache_events=events),
    )
    return config, NS(kv_cache_groups=groups)


def test_tier_capacity_in_blocks_of_one_rank(tmp_path: Path) -> None:
    block = PAGE * LAYERS
    host, disk = tier_blocks(ConnectorSettings(host_capacity_gib=1.0), block)
    assert (host, disk) == (GiB // block, 0)  # no disk_dir: no disk tier
    settings = ConnectorSettings(disk_dir=str(tmp_path), disk_capacity_gib=2.0)
    assert tier_blocks(settings, block)[1] == 2 * GiB // (block + 8192)  # a file's header counts


@pytest.mark.parametrize(
    ("mode", "device", "expected"),
    [
        ("auto", "cpu", True),
        ("auto", "cuda", False),
        ("layerwise", "cuda", True),
        ("async", "cpu", False),
    ],
)
def test_loads_go_layer_by_layer_when_asked_or_on_cpu(
    mode: str, device: str, expected: bool
) -> None:
    config, _ = _vllm_config(device)
    assert layerwise(ConnectorSettings(load_mode=mode), config) is expected


def test_the_settings_reach_the_manager() -> None:
    settings = ConnectorSettings(
        grace_s=0.3,
        high_water=0.7,
        writeback="eager",
        max_lease_s=77.0,
        lease_margin_s=1.5,
        disk_after_s=12.0,
        device_prefetch_max_spread=3.0,
        load_mode="async",
    )
    side = SchedulerSide(*_vllm_config("cpu"), settings)
    try:
        config, policy = side.manager.config, side.manager.policy
        assert side.block_bytes_per_rank == PAGE * LAYERS
        assert config.block_bytes == PAGE * LAYERS * TP and config.tp_size == TP
        assert config.block_size == BLOCK
        assert config.host_capacity_blocks == int(settings.host_capacity_gib * GiB) // (
            PAGE * LAYERS
        )
        assert (config.grace_s, config.high_water) == (0.3, 0.7)
        assert config.writeback is Writeback.EAGER and config.layerwise is False
        assert (policy.max_lease_s, policy.lease_margin_s, policy.disk_after_s) == (77.0, 1.5, 12.0)
        assert policy.device_prefetch_max_spread == 3.0
        assert side.events is None  # the server runs without --kv-events-config
    finally:
        side.close()


def test_kv_events_only_when_the_server_enables_them() -> None:
    for enabled in (False, True):
        side = SchedulerSide(*_vllm_config(events=enabled), ConnectorSettings())
        try:
            assert (side.events is not None) is enabled
            assert side.manager.config.layerwise is True  # auto on a CPU device
        finally:
            side.close()
