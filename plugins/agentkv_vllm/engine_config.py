"""What the scheduler side derives from vLLM's configuration and the connector settings.

Primitives (pure functions, called once when the connector starts):
  spec_layout(groups)          the attention layout the scheduler sees (part of the KV identity)
  tier_blocks(settings, b)     (host, disk) tier capacity in blocks of one rank
  layerwise(settings, config)  whether loads go layer by layer (asked, or ``auto`` on CPU)
  manager_config(settings, ...)  the TrajectoryManager's configuration
  policy_params(settings)      the pause policy's knobs the settings set
  cost_model(profile, model_config)  the policy's costs: the hardware profile plus the served
                               model's size when its HF config gives it
  dp_placement(parallel_config)  (this engine's DP rank, the deployment's DP size)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from agentkv.costs import CostModel
from agentkv.manager import ManagerConfig
from agentkv.policy import PolicyParams
from agentkv_vllm.settings import ConnectorSettings, LoadMode

log = logging.getLogger("agentkv.scheduler")
GiB = 1 << 30


def dp_placement(parallel_config: Any) -> tuple[int, int]:
    """(DP rank, DP size) of this engine core, the same in its scheduler and its workers. vLLM
    0.32 runs each DP rank of a dense model as an independent engine: it resets
    ``data_parallel_rank`` to 0 and ``data_parallel_size`` to 1 there
    (``ParallelConfig.reconfigure_for_independent_dp_rank``); ``data_parallel_index`` keeps the
    rank, and ``elastic_ep_max_dp_size`` (set from the size before the reset, the maximum under
    elastic EP) the size."""
    rank = getattr(parallel_config, "data_parallel_index", None)
    if rank is None:
        rank = getattr(parallel_config, "data_parallel_rank", 0)
    size = max(
        int(getattr(parallel_config, "data_parallel_size", 1) or 1),
        int(getattr(parallel_config, "elastic_ep_max_dp_size", 1) or 1),
    )
    rank = int(rank or 0)
    return rank, max(size, rank + 1)


def spec_layout(groups: Sequence[Any]) -> str:
    """The attention layout the scheduler sees: per KV cache group, the spec's kind and shape."""
    parts = []
    for g in groups:
        spec = g.kv_cache_spec
        parts.append(
            f"{type(spec).__name__}/{getattr(spec, 'num_kv_heads', '')}x"
            f"{getattr(spec, 'head_size', '')}/{spec.page_size_bytes}/{len(g.layer_names)}"
        )
    return ";".join(parts)


def tier_blocks(settings: ConnectorSettings, block_bytes_per_rank: int) -> tuple[int, int]:
    """(host, disk) tier capacity in blocks of one rank (a disk block file has a header)."""
    host_blocks = int(settings.host_capacity_gib * GiB) // max(1, block_bytes_per_rank)
    disk_blocks = (
        int(settings.disk_capacity_gib * GiB) // max(1, block_bytes_per_rank + 8192)
        if settings.disk_dir
        else 0
    )
    return host_blocks, disk_blocks


def layerwise(settings: ConnectorSettings, vllm_config: Any) -> bool:
    """Loads go layer by layer when asked, or by default (``auto``) on a CPU device."""
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu"))
    return settings.load_mode is LoadMode.LAYERWISE or (
        settings.load_mode is LoadMode.AUTO and device == "cpu"
    )


def manager_config(
    settings: ConnectorSettings,
    *,
    block_size: int,
    block_bytes: int,
    tp_size: int,
    host_blocks: int,
    disk_blocks: int,
    layerwise: bool,
) -> ManagerConfig:
    """The manager's configuration: the engine's geometry plus the connector settings."""
    return ManagerConfig(
        block_size=block_size,
        block_bytes=block_bytes,
        tp_size=tp_size,
        host_capacity_blocks=host_blocks,
        disk_capacity_blocks=disk_blocks,
        grace_s=settings.grace_s,
        default_action=settings.default_action,
        policy_override=settings.policy_override,
        high_water=settings.high_water,
        job_timeout_s=settings.job_timeout_s,
        idle_ttl_s=settings.idle_ttl_s,
        max_trajectories=settings.max_trajectories,
        layerwise=layerwise,
        admission_wait=settings.admission_wait,
        writeback=settings.writeback,
        device_prefetch=settings.device_prefetch,
        salt_generations=settings.salt_generations,
        remote_enabled=bool(settings.remote_url),
        remote_ttl_s=settings.remote_ttl_s,
    )


def policy_params(settings: ConnectorSettings) -> PolicyParams:
    """The pause policy's knobs the connector settings set (the rest keep their defaults)."""
    return PolicyParams(
        max_lease_s=settings.max_lease_s,
        lease_margin_s=settings.lease_margin_s,
        disk_after_s=settings.disk_after_s,
        device_prefetch_max_spread=settings.device_prefetch_max_spread,
    )


def cost_model(profile: Any, model_config: Any) -> CostModel:
    """The policy's costs: the hardware profile plus the served model's size when known."""
    params = None
    try:
        from agentkv.geometry import ModelGeometry

        geom = ModelGeometry.from_hf_config(model_config.hf_config.to_dict())
        params = geom.num_parameters
        layers, hidden = geom.num_layers, geom.hidden_size
    except Exception as exc:  # sizing is best effort; decisions fall back safely
        log.info("agentkv: model size unknown (%s); recompute cost from the profile only", exc)
        layers, hidden = 0, 0
    return CostModel.from_profile(
        profile, model_params=params, num_layers=layers, hidden_size=hidden
    )
