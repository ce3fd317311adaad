"""KV policies: what a replica does with a trajectory's blocks while it waits on a tool.

Primitives:
  PauseContext        what is known at the pause: tool, declared wait, tokens and bytes held,
                      pool pressure, free room in the host and disk tiers, the pool's eviction
                      forecast
  PausePlan           'cache' (leave the blocks to the engine's LRU) | 'retain' (pin, lease) |
                      'offload_host' | 'offload_disk' (write-back copy, then unpin), a lease and a
                      prefetch time; ``deferred``: the host copy waits for the eviction forecast
  KVPolicy            the strategy interface; one instance per replica
  VanillaPolicy       prefix caching only: every pause is 'cache'
  AgentKVPolicy       agentkv's own decision: ``agentkv.predict.WaitPredictor`` for the wait and
                      ``agentkv.policy.decide`` for the action (the functions the plugin calls);
                      demotions under pressure pick ``agentkv.policy.pressure_victims``
  RetainAlwaysPolicy  pin every paused trajectory for a fixed TTL (Continuum-like), then cache
  OffloadAlwaysPolicy copy every paused trajectory to host (disk when host is full), then cache
  CapacityEqualPolicy the capacity-equal bound: the same pool, every history reloaded for free
  make_policy(name, costs, ...) -> KVPolicy;  POLICIES: the names
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agentkv.policy import (
    DEMOTION_ACTION,
    HIGH_WATER,
    Action,
    PolicyParams,
    decide,
    pressure_victims,
)
from agentkv.predict import WaitEstimate, WaitPredictor
from agentkv.simulate.costs import EngineCosts

# The simulator's action: a policy Action, or "cache" (leave the blocks to the engine's cache,
# what Action.DROP means on a real engine).
PlanAction = Action | Literal["cache"]
POLICIES: tuple[str, ...] = (
    "vanilla",
    "agentkv",
    "retain-always",
    "offload-always",
    "capacity-equal",
)


@dataclass(frozen=True, slots=True)
class PauseContext:
    trajectory_id: str
    tool: str | None
    declared_wait_s: float | None
    tokens: int
    kv_bytes: float
    pressure: float
    host_free_bytes: float | None
    disk_free_bytes: float | None
    eviction_in_s: float = 0.0
    """The pool's forecast of when a block unpinned now is evicted (``PoolTrend``; 0: now)."""


@dataclass(frozen=True, slots=True)
class PausePlan:
    action: PlanAction
    lease_s: float = 0.0
    prefetch_at_s: float | None = None
    predicted_wait_s: float = 0.0
    decision: str = ""
    """The policy's own name for the decision (agentkv: decide()'s action), for the report."""
    estimate: WaitEstimate | None = None
    """The wait prediction behind it (device prefetch's spread rule reads it)."""
    deferred: bool = False
    """offload_host only: the copy waits for an eviction forecast (``writeback_deferred``)."""


class KVPolicy:
    """Strategy interface. ``high_water``: pool use above which pinned trajectories are demoted
    (None: never by use alone); ``expiry_action``: what a lease's end does to the blocks."""

    name = "base"
    high_water: float | None = None
    expiry_action: PlanAction = "cache"
    device_prefetch: bool = False
    """Prefetch paused contexts back into device blocks at the predicted return
    (``agentkv.prefetch_rule``, the manager's rule)."""
    defers_writeback: bool = False
    """Its offload_host copies may wait for an eviction forecast (``Writeback.FORECAST``)."""
    holds_grace: bool = False
    """Runs inside the plugin: a finished turn's blocks stay pinned for the grace period until
    the harness's pause arrives (``FleetConfig.grace_s``)."""
    free_history: bool = False
    """Every paused history is also kept where it reloads instantly and takes no room (the
    capacity-equal bound; no real policy can do this)."""

    def on_pause(self, ctx: PauseContext) -> PausePlan:
        raise NotImplementedError

    def on_resume(self, tool: str | None, waited_s: float) -> None:
        """The trajectory came back after ``waited_s`` on ``tool``."""

    def victims(self, pinned: list[tuple[str, float, int]], excess_blocks: float) -> list[str]:
        """Which pinned trajectories (id, predicted return time, blocks) to demote to free
        ``excess_blocks``: the earliest pinned first by default."""
        out: list[str] = []
        freed = 0
        for tid, _, blocks in pinned:
            if freed >= excess_blocks:
                break
            out.append(tid)
            freed += blocks
        return out


class VanillaPolicy(KVPolicy):
    name = "vanilla"

    def on_pause(self, ctx: PauseContext) -> PausePlan:
        return PausePlan("cache", decision="none")


class AgentKVPolicy(KVPolicy):
    """agentkv's decision with the plugin's defaults (``PolicyParams()`` and ``HIGH_WATER``, the
    numbers the connector's settings default to)."""

    name = "agentkv"
    expiry_action: PlanAction = DEMOTION_ACTION
    defers_writeback = True
    holds_grace = True

    def __init__(
        self, costs: EngineCosts, params: PolicyParams | None = None, high_water: float = HIGH_WATER
    ) -> None:
        self.costs = costs.policy_costs()
        self.params = params or PolicyParams()
        self.high_water = high_water
        self.predictor = WaitPredictor()
        self.samples: dict[str, int] = {}
        self.cache: dict[tuple[str, float | None], tuple[int, WaitEstimate]] = {}

    def _estimate(self, tool: str, declared: float | None) -> WaitEstimate:
        """The predictor's estimate, re-read once the tool's sample count grew by 1% (every
        sample up to 100): past that, one more sample moves a DDSketch quantile by well under
        its 1% accuracy, and reading three quantiles per pause dominated large simulations."""
        n = self.samples.get(tool, 0)
        hit = self.cache.get((tool, declared))
        if hit is not None and (n == hit[0] or (n > 100 and n < hit[0] * 1.01)):
            return hit[1]
        estimate = self.predictor.predict(tool, declared)
        self.cache[(tool, declared)] = (n, estimate)
        return estimate

    def on_pause(self, ctx: PauseContext) -> PausePlan:
        estimate = self._estimate(ctx.tool or "tool", ctx.declared_wait_s)
        d = decide(
            tokens=ctx.tokens,
            kv_bytes=ctx.kv_bytes,
            wait=estimate,
            costs=self.costs,
            pressure=ctx.pressure,
            host_free_bytes=ctx.host_free_bytes,
            disk_free_bytes=ctx.disk_free_bytes,
            params=self.params,
            eviction_in_s=ctx.eviction_in_s,
        )
        action: PlanAction = "cache"
        if d.action is not Action.DROP:
            action = d.action
        return PausePlan(
            action,
            d.lease_s,
            d.prefetch_at_s,
            estimate.p50,
            d.action,
            estimate,
            d.writeback_deferred,
        )

    def on_resume(self, tool: str | None, waited_s: float) -> None:
        name = tool or "tool"
        if self.predictor.observe(name, waited_s):
            self.samples[name] = self.samples.get(name, 0) + 1

    def victims(self, pinned: list[tuple[str, float, int]], excess_blocks: float) -> list[str]:
        chosen = pressure_victims(list(pinned), excess_blocks)
        return [str(h) for h in chosen]


class RetainAlwaysPolicy(KVPolicy):
    """Pin for ``ttl_s`` (Continuum's time-to-live pinning), whatever the wait; the lease's end
    leaves the blocks to the LRU. Pins give way only when a request cannot be admitted."""

    name = "retain-always"
    holds_grace = True

    def __init__(self, ttl_s: float = 60.0) -> None:
        self.ttl_s = ttl_s

    def on_pause(self, ctx: PauseContext) -> PausePlan:
        return PausePlan(Action.RETAIN, lease_s=self.ttl_s, decision="retain")


class OffloadAlwaysPolicy(KVPolicy):
    """Write every paused trajectory back to host RAM (disk when host has no room)."""

    name = "offload-always"
    holds_grace = True

    def on_pause(self, ctx: PauseContext) -> PausePlan:
        host_ok = ctx.host_free_bytes is None or ctx.host_free_bytes >= ctx.kv_bytes
        if host_ok:
            return PausePlan(Action.OFFLOAD_HOST, prefetch_at_s=0.0, decision="offload_host")
        if ctx.disk_free_bytes is None or ctx.disk_free_bytes >= ctx.kv_bytes:
            return PausePlan(Action.OFFLOAD_DISK, prefetch_at_s=0.0, decision="offload_disk")
        return PausePlan("cache", decision="drop")


class CapacityEqualPolicy(KVPolicy):
    """The capacity-equal bound: the same device pool, and every history available at zero
    load cost. Running requests still need their blocks (admission, chunked prefill and
    queueing are those of the real pool); what a resume finds is all of its history, for free.
    No cache policy with this much device memory can beat it."""

    name = "capacity-equal"
    free_history = True

    def on_pause(self, ctx: PauseContext) -> PausePlan:
        return PausePlan("cache", decision="free")


def make_policy(
    name: str, costs: EngineCosts, retain_ttl_s: float = 60.0, device_prefetch: bool = False
) -> KVPolicy:
    """A fresh policy instance of ``name`` (one per replica: each has its own predictor);
    ``device_prefetch`` applies to agentkv."""
    if name == "vanilla":
        return VanillaPolicy()
    if name == "agentkv":
        policy = AgentKVPolicy(costs)
        policy.device_prefetch = device_prefetch
        return policy
    if name == "retain-always":
        return RetainAlwaysPolicy(retain_ttl_s)
    if name == "offload-always":
        return OffloadAlwaysPolicy()
    if name == "capacity-equal":
        return CapacityEqualPolicy()
    raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
