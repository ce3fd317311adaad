"""The reference's worked numbers (Napkin Math 0.1, 0.2, 0.3, 0.7) through agentkv.capacity."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv import capacity as cap
from agentkv.errors import ConfigError
from agentkv.geometry import ModelGeometry
from agentkv.hardware import GPU_PRESETS, get_preset
from agentkv.units import parse_bytes

CONFIGS = Path(__file__).parent / "configs"
L70 = ModelGeometry.from_hf_config(CONFIGS / "llama-3.1-70b.json")
GB, GIB = 10**9, 2**30


def test_napkin_01_node_of_8_h100() -> None:
    hbm = get_preset("h100").memory_bytes * 8
    assert round(hbm / GB, 1) == 687.2
    pool = cap.kv_pool_bytes(hbm, parse_bytes("141.2GB"), parse_bytes("20GB"))
    assert round(pool / GB, 1) == 526.0
    counts = [
        cap.max_trajectories(526 * GB, cap.trajectory_bytes(L70, s))
        for s in (8192, 32_768, 131_072)
    ]
    assert counts == [195, 48, 12]
    assert [round(cap.trajectory_bytes(L70, s) / GB, 1) for s in (8192, 32_768, 131_072)] == [
        2.7,
        10.7,
        42.9,
    ]


def test_napkin_01_480_gib_variant() -> None:
    counts = [
        cap.max_trajectories(480 * GIB, cap.trajectory_bytes(L70, s)) for s in (8192, 131_072)
    ]
    assert counts == [192, 12]


def test_napkin_02_static_reservation() -> None:
    static = cap.static_reservation(L70, 10 * GIB, max_tokens=16_384, mean_tokens=2048, tp=2)
    assert static.reservation_bytes == 16_384 * 163_840 == int(2.5 * GIB)
    assert static.max_requests == 4
    assert static.allocation_efficiency == pytest.approx(0.125)
    assert static.idle_bytes == int(8.75 * GIB)
    assert cap.weights_bytes_per_device(70 * 10**9, 2, tp=2) == 70 * GB  # 65.19 GiB
    with pytest.raises(ConfigError):
        cap.static_reservation(L70, GIB, max_tokens=100, mean_tokens=200)


def test_napkin_03_blocks_and_tail_waste() -> None:
    per_gpu = L70.kv_bytes_per_token(tp=8)
    pool = cap.paged_pool(60 * GIB, per_gpu, 16)
    assert (pool.block_bytes, pool.num_blocks, pool.token_capacity) == (
        640 * 1024,
        98_304,
        1_572_864,
    )
    assert pool.expected_tail_waste_tokens == 7.5
    assert cap.tail_waste_bytes(256, 16, per_gpu) == 75 * 2**20
    assert round(cap.fragmentation_ratio(256, 16, per_gpu, 60 * GIB) * 100, 2) == 0.12
    assert round(cap.fragmentation_ratio(256, 64, per_gpu, 60 * GIB) * 100, 2) == 0.51


def test_napkin_07_shared_prefix() -> None:
    pool = 8 * cap.kv_pool_bytes(
        80 * GB, cap.weights_bytes_per_device(70 * 10**9, 2, tp=8), parse_bytes("4.5GB")
    )
    assert pool == 464 * GB
    usable = cap.usable_pool_bytes(pool, 0.10)
    whole = cap.trajectory_bytes(L70, 32_768, 2048)
    assert cap.max_trajectories(usable, whole) == 36
    shared = L70.kv_bytes(24_576)
    assert round(shared / GB, 2) == 8.05
    assert cap.max_trajectories_shared(usable, shared, whole - shared) == 122


def test_size_node_flags_context_beyond_max_position() -> None:
    sizing = cap.size_node(L70, [262_144], pool_bytes=480 * GIB, num_devices=8, tp=8)
    assert sizing.contexts[0].beyond_max_position
    assert sizing.contexts[0].max_trajectories == 6
    assert any("max_position_embeddings" in w for w in sizing.warnings)


def test_bad_budgets_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="no memory left"):
        cap.kv_pool_bytes(80 * GB, 140 * GB, 0)
    with pytest.raises(ConfigError):
        cap.usable_pool_bytes(GB, 1.0)
    with pytest.raises(ConfigError):
        cap.trajectory_bytes(L70, 0)
    with pytest.raises(ConfigError, match="TP groups"):
        cap.size_node(L70, [8192], pool_bytes=GB, num_devices=6, tp=4)


def test_littles_law_with_and_without_offload() -> None:
    wait = cap.littles_law_concurrency(2.0, generate_s=5.0, tool_wait_s=45.0)
    assert wait.in_flight == wait.resident_without_offload == 100.0
    assert wait.resident_with_offload == 10.0 and wait.paused == 90.0
    with pytest.raises(ConfigError):
        cap.littles_law_concurrency(-1.0, 1.0, 1.0)


def test_plan_inverts_size() -> None:
    opt = cap.plan_devices(
        L70,
        trajectories=100,
        context_tokens=32_768,
        device_bytes=get_preset("H100").memory_bytes,
        tp=8,
        runtime_bytes_per_device=parse_bytes("2.5GB"),
    )
    assert opt.replicas == -(-100 // opt.trajectories_per_replica)
    assert opt.devices == opt.replicas * 8 and opt.nodes == opt.replicas
    with pytest.raises(ConfigError, match="cannot hold"):
        cap.plan_devices(
            L70,
            trajectories=1,
            context_tokens=131_072,
            device_bytes=get_preset("L40S").memory_bytes,
            tp=4,
            runtime_bytes_per_device=5 * GB,
        )


def test_presets_state_their_convention() -> None:
    assert get_preset("H100-80GB").memory_bytes == 80 * GIB
    assert get_preset("b200").memory_bytes == 192 * GB
    assert {p.convention for p in GPU_PRESETS.values()} == {"GB", "GiB"}
    with pytest.raises(ConfigError, match="known"):
        get_preset("v100")


@given(st.integers(1, 10**13), st.integers(1, 10**10), st.integers(0, 10**12))
def test_shared_prefix_never_holds_fewer(usable: int, private: int, shared: int) -> None:
    unshared = cap.max_trajectories(usable, private + shared)
    assert cap.max_trajectories_shared(usable, shared, private) >= unshared
    assert unshared * (private + shared) <= usable
