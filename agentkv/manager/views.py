"""Read-only views of the manager: GET of a trajectory, /status, metrics gauges and turn metrics.

Primitives:
  REPORTED_COUNTERS      counters /status always reports (0 until they happen)
  trajectory_view(mgr, traj)   GET /trajectories/{id}: branches, residency per tier, turns
  status_view(mgr)       the /status body: pool, tiers, trajectories, counters, decisions
  gauges(mgr)            (metric, labels, value) for the bytes held and paused branches
  bytes_held(mgr), count_by_state(mgr)
  record_turn(metrics, turn)   a finished turn's prompt, cached and divergence metrics

Callers hold the manager's lock (``gauges`` takes it itself: the scrape thread calls it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from typing import TYPE_CHECKING, Any

from agentkv import metrics as m
from agentkv.manager.jobs import REJECTIONS, rejection_counter
from agentkv.manager.state import PAUSED_STATES, BranchState, Trajectory, TurnStats
from agentkv.tier import LOCAL_TIERS, Tier

if TYPE_CHECKING:
    from agentkv.manager.core import TrajectoryManager

REPORTED_COUNTERS = (
    "loads",
    "layerwise_loads",
    "load_failures",
    "failed_closed_loads",
    "aborted_loads",
    "stores",
    "store_failures",
    "store_timeouts",
    "job_timeouts",
    "tier_misses",
    "tier_corrupt_blocks",
    "grace_expired",
    "lease_expired_demotions",
    "pressure_demotions",
    "queue_demotions",
    "grace_shortened",
    "writebacks_unread",
    "writebacks_deferred",
    "writebacks_deferred_copied",
    "writebacks_deferred_lost_blocks",
    "writebacks_reset_copied",
    "preempt_saves",
    "preempt_saved_blocks",
    "preempt_saved_tokens",
    "concurrent_turns",  # requests of a branch that started while another of it ran
    "salt_generation_releases",  # salt_generations: an id's old-salt trajectory released
    "prefetches",
    "evictions_host",
    "evictions_disk",
    "internal_errors",
    "remote_fetches",
    "remote_fetched_blocks",
    "remote_missed_blocks",
    "remote_uploaded_blocks",
    "remote_upload_failures",
    # values a tier refused (WorkerReport.rejected): remote_bad_tag_blocks, ...
    *(rejection_counter(tier, why) for tier, why in REJECTIONS),
)


def bytes_held(mgr: TrajectoryManager) -> dict[str, int]:
    bb = mgr.config.block_bytes
    return {
        "device_pinned": mgr.pinned_blocks() * bb,
        "host": mgr.index.count(Tier.HOST) * bb,
        "disk": mgr.index.count(Tier.DISK) * bb,
    }


def count_by_state(mgr: TrajectoryManager) -> dict[str, int]:
    counts = {s.value: 0 for s in BranchState}
    for traj in mgr.table.values():
        for b in traj.branches.values():
            counts[b.state.value] += 1
    return counts


def trajectory_view(mgr: TrajectoryManager, traj: Trajectory) -> dict[str, Any]:
    branches = {}
    owned_bytes = {"device_pinned": 0, "host": 0, "disk": 0}
    bb = mgr.config.block_bytes
    seen: set[bytes] = set()
    for name, b in traj.branches.items():
        s = b.summary()
        residency: Counter[str] = Counter()
        for key in b.keys:
            e = mgr.index.get(key)
            if e is None:
                residency["none"] += 1
                continue
            for tier in LOCAL_TIERS:
                if e.has(tier):
                    residency[tier.value] += 1
            if e.writing:
                residency["in_flight"] += 1
            if key not in seen:
                seen.add(key)
                for tier in LOCAL_TIERS:
                    owned_bytes[tier.value] += bb * e.has(tier)
        residency["device_pinned"] = len(b.pinned)
        owned_bytes["device_pinned"] += bb * len(b.pinned)
        s["residency_blocks"] = dict(residency)
        branches[name] = s
    return {
        "trajectory_id": traj.name,
        "branches": branches,
        "turns": [t.to_dict() for t in traj.turns],
        "prefix_hit_ratio": round(traj.prefix_hit_ratio, 6),
        "bytes_held": owned_bytes,
    }


def record_turn(metrics: m.MetricsRecorder, turn: TurnStats) -> None:
    metrics.add(m.PROMPT_TOKENS, float(turn.prompt_tokens))
    metrics.add(m.CACHED_TOKENS, float(turn.device_hit_tokens), source="device")
    if turn.tier_hit_tokens:
        metrics.add(m.CACHED_TOKENS, float(turn.tier_hit_tokens), source=turn.tier or "host")
    if turn.prompt_tokens:
        metrics.observe(m.PREFIX_HIT_RATIO, turn.hit_tokens / turn.prompt_tokens)
    if turn.first_divergence_token is not None:
        metrics.add(m.DIVERGENCES, zone=turn.divergence_zone or "undeclared")


def gauges(mgr: TrajectoryManager) -> list[tuple[m.MetricSpec, dict[str, str], float]]:
    with mgr.lock:
        held = bytes_held(mgr)
        by_state = count_by_state(mgr)
        n = len(mgr.table)
    out: list[tuple[m.MetricSpec, dict[str, str], float]] = [
        (m.BYTES_HELD, {"tier": tier}, float(v)) for tier, v in held.items()
    ]
    out += [
        (m.PAUSED_TRAJECTORIES, {"state": s.value}, float(by_state.get(s.value, 0)))
        for s in sorted(PAUSED_STATES, key=lambda s: s.value)
    ]
    out.append((m.TRAJECTORIES, {}, float(n)))
    return out


def status_view(mgr: TrajectoryManager) -> dict[str, Any]:
    bb = mgr.config.block_bytes
    index = mgr.index
    tiers: dict[str, Any] = {
        tier.value: {
            "blocks": index.count(tier),
            "bytes": index.count(tier) * bb,
            "capacity_bytes": index.capacity[tier] * bb,
        }
        for tier in LOCAL_TIERS
    }
    tiers[Tier.DISK]["enabled"] = mgr.config.disk_enabled
    tiers["in_flight_jobs"] = len(mgr.jobs)
    return {
        "pool": {
            "usage": round(mgr.pinner.usage(), 6),
            "total_blocks": mgr.pinner.total_blocks(),
            "pinned_blocks": mgr.pinned_blocks(),
            "releasing_blocks": mgr.pins.releasing,
            "high_water": mgr.config.high_water,
            "admission": dataclasses.asdict(mgr.admission),
            "free_block_drain_per_s": round(mgr.pool_trend.rate, 3),
            "block_fill_per_s": round(mgr.pool_trend.fill, 3),
            "steps": mgr.steps,
            "last_queue_demotion_step": mgr.last_queue_demotion_step,
            "eviction_forecast_s": _finite_or_none(mgr.eviction_forecast()),
            "placed_paused_blocks": mgr.writebacks.ahead(math.inf),
            "block_size_tokens": mgr.config.block_size,
            "block_bytes": bb,
        },
        "tiers": tiers,
        "bytes_held": bytes_held(mgr),
        "trajectories": len(mgr.table),
        "trajectory_ids": [t.name for t in itertools.islice(mgr.table.values(), 1000)],
        "tombstones": len(mgr.tombstones),
        "running_requests": len(mgr.requests),
        "branches_by_state": count_by_state(mgr),
        "decisions": dict(mgr.decisions),
        "prefetch": mgr.prefetch_outcomes.counts(),
        "device_prefetch": {
            "enabled": mgr.config.device_prefetch,
            **mgr.prefetcher.stats.view(),
        },
        "counters": {
            **dict.fromkeys(REPORTED_COUNTERS, 0),
            **mgr.counters,
            "writebacks_unread": mgr.index.unread_dropped,
        },
        "predictor": mgr.predictor.tools(),
    }


def _finite_or_none(value: float) -> float | None:
    return round(value, 3) if math.isfinite(value) else None
