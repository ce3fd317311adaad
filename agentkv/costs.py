"""What moving or rebuilding a paused trajectory's KV costs: the physics under the pause decision.

Primitives:
    CostModel           per-engine constants: link and disk bandwidths, prefill rate, model size;
                        ``CostModel.from_profile`` builds one from a measured hardware profile
    reload_seconds      M / B (one way over one link)
    round_trip_seconds  2M / B (out and back over one link)
    recompute_seconds   (2PS + 4 L S^2 d_model) / R_prefill, or S / (tokens per second)
    hold_cost           M * T_wait, in byte-seconds
    positive_finite     whether a rate or size is usable (positive, finite, not NaN)

Every function here is pure and never raises on a bad number: an unusable bandwidth or prefill
rate gives an infinite time ("that path is impossible"), which the decision in ``agentkv.policy``
reads as "never pick it". The knobs that turn these costs into a decision (the DRAM/HBM
shadow-price ratio, the stall tolerance, the break-even wait T*) are ``agentkv.policy``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentkv.profile import HardwareProfile

_INF = math.inf


def positive_finite(value: float | None) -> bool:
    """Whether ``value`` is a usable rate or size: not None, not NaN, positive and finite."""
    return value is not None and not math.isnan(value) and value > 0 and not math.isinf(value)


@dataclass(frozen=True)
class CostModel:
    """What moving or rebuilding a trajectory's KV costs on this engine.

    Bandwidths are bytes per second; None (or a non-positive number) means the path is unusable.
    Recompute uses ``prefill_tokens_per_s`` when measured, else ``prefill_flops_per_s`` with
    ``model_params`` (plus the attention term when ``num_layers`` and ``hidden_size`` are known);
    with neither, recompute time is unknown and taken as infinite (never drop to save time).
    """

    host_link_bytes_per_s: float | None
    """Device <-> host copy rate (the host memcpy rate when the "device" is CPU memory)."""
    disk_write_bytes_per_s: float | None = None
    disk_read_bytes_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    prefill_flops_per_s: float | None = None
    model_params: float | None = None
    num_layers: int = 0
    hidden_size: int = 0
    copy_uses_compute: bool = False
    """The "device" is CPU memory: a copy's memcpy runs on the cores decoding runs on."""

    @classmethod
    def from_profile(
        cls,
        profile: HardwareProfile,
        *,
        model_params: float | None = None,
        num_layers: int = 0,
        hidden_size: int = 0,
    ) -> CostModel:
        """Cost model from a measured (or default) hardware profile and the served model's size.

        Contract: the host link is the slower of the two host<->device directions when a GPU was
        measured, else the host copy rate (vLLM on CPU keeps its KV cache in host memory).
        """
        directions = [
            v
            for v in (profile.host_to_device_bytes_per_s, profile.device_to_host_bytes_per_s)
            if v is not None and positive_finite(v)
        ]
        link = min(directions) if directions else profile.host_copy_bytes_per_s
        return cls(
            copy_uses_compute=not directions,
            host_link_bytes_per_s=link,
            disk_write_bytes_per_s=profile.disk_write_bytes_per_s,
            disk_read_bytes_per_s=profile.disk_read_bytes_per_s,
            prefill_tokens_per_s=profile.prefill_tokens_per_s,
            model_params=model_params,
            num_layers=num_layers,
            hidden_size=hidden_size,
        )

    def recompute_seconds(self, tokens: float) -> float:
        """Time to rebuild ``tokens`` tokens of KV by prefill; inf when no prefill rate is known."""
        if positive_finite(self.prefill_tokens_per_s):
            return recompute_seconds(tokens, prefill_tokens_per_s=self.prefill_tokens_per_s)
        if positive_finite(self.prefill_flops_per_s) and positive_finite(self.model_params):
            return recompute_seconds(
                tokens,
                params=self.model_params,
                prefill_flops_per_s=self.prefill_flops_per_s,
                num_layers=self.num_layers,
                hidden_size=self.hidden_size,
            )
        return _INF


def reload_seconds(kv_bytes: float, bytes_per_s: float) -> float:
    """M / B: one-way transfer time. Contract: inf when the link is unusable (<= 0, NaN)."""
    return kv_bytes / bytes_per_s if positive_finite(bytes_per_s) else _INF


def round_trip_seconds(kv_bytes: float, bytes_per_s: float) -> float:
    """2M / B: out and back over one link. Contract: inf when the link is unusable."""
    return 2.0 * reload_seconds(kv_bytes, bytes_per_s)


def recompute_seconds(
    tokens: float,
    *,
    params: float | None = None,
    prefill_flops_per_s: float | None = None,
    num_layers: int = 0,
    hidden_size: int = 0,
    prefill_tokens_per_s: float | None = None,
) -> float:
    """Prefill time to rebuild ``tokens`` tokens of KV.

    Contract: with ``prefill_tokens_per_s`` (a measured rate) returns S / T; otherwise
    (2*P*S + 4*L*S^2*d_model) / R, the attention term counted only when ``num_layers`` and
    ``hidden_size`` are given. Returns inf when the needed rate or parameter count is missing,
    zero or NaN.
    """
    if positive_finite(prefill_tokens_per_s):
        assert prefill_tokens_per_s is not None
        return tokens / prefill_tokens_per_s
    if not (positive_finite(params) and positive_finite(prefill_flops_per_s)):
        return _INF
    assert params is not None and prefill_flops_per_s is not None
    flops = 2.0 * params * tokens + 4.0 * num_layers * tokens * tokens * hidden_size
    return flops / prefill_flops_per_s


def hold_cost(kv_bytes: float, wait_s: float) -> float:
    """M * T_wait: device memory withheld from the pool, in byte-seconds."""
    return kv_bytes * wait_s
