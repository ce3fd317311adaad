"""Routers: which replica serves a trajectory's next turn.

Primitives:
  RouteRequest          the turn as the router sees it: trajectory, prompt tokens, what it can
                        reuse (prefix group and blocks)
  ReplicaView           what a router may ask a replica: outstanding requests, queued prefill
                        seconds, and how many of the prompt's tokens it holds per tier
  Router                the strategy interface: ``choose(request, replicas) -> index``
  RoundRobin            replicas in turn
  SessionAffinity       a stable hash of the trajectory id (consistent across runs)
  LeastLoaded           fewest outstanding requests (lowest index on ties)
  KvAware               vllm-router's ``kv_aware`` cost: prefill seconds of the tokens no tier
                        credits, plus the replica's queued prefill seconds; host, disk and remote
                        hits credited 0.8, 0.3 and 0.6 of a device hit (its --kv-penalty-*
                        defaults); lowest cost wins (temperature 0)
  AffinityLoad          the reference's objective w* = argmax[mu*(Match/S) - (1-mu)*(L_j/L_max)^gamma]
                        with Match the prompt tokens the replica holds on the device or a tier
                        and L_j its outstanding requests
  make_router(name, ...) -> Router;  ROUTERS: the names
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

ROUTERS: tuple[str, ...] = (
    "round-robin",
    "session-affinity",
    "least-loaded",
    "kv-aware",
    "affinity-load",
)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    trajectory_id: str
    prompt_tokens: int
    prefix_group: str
    prefix_blocks: int
    reusable_tokens: int
    """Leading tokens of the prompt that a cache could hold (prefix included)."""


class ReplicaView(Protocol):
    def outstanding(self) -> int: ...

    def queued_prefill_s(self) -> float: ...

    def cached_tokens(self, req: RouteRequest) -> tuple[int, int, int, int]:
        """Prompt tokens held (device, host, disk, remote), each past the previous tiers."""
        ...

    def prefill_s(self, tokens: int, cached: int) -> float: ...


class Router:
    name = "base"

    def choose(self, req: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, req: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        i = self._next % len(replicas)
        self._next += 1
        return i


class SessionAffinity(Router):
    name = "session-affinity"

    def choose(self, req: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        return zlib.crc32(req.trajectory_id.encode()) % len(replicas)


class LeastLoaded(Router):
    name = "least-loaded"

    def choose(self, req: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        return min(range(len(replicas)), key=lambda i: (replicas[i].outstanding(), i))


class KvAware(Router):
    name = "kv-aware"

    def __init__(self, host: float = 0.8, disk: float = 0.3, remote: float = 0.6) -> None:
        self.credits = (1.0, host, disk, remote)

    def choose(self, req: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        best, best_cost = 0, float("inf")
        for i, r in enumerate(replicas):
            held = r.cached_tokens(req)
            credited = sum(c * n for c, n in zip(self.credits, held, strict=True))
            cost = r.prefill_s(max(0, int(req.prompt_tokens - credited)), int(credited))
            cost += r.queued_prefill_s()
            if cost < best_cost:
                best, best_cost = i, cost
        return best


class AffinityLoad(Router):
    name = "affinity-load"

    def __init__(self, mu: float = 0.5, gamma: float = 2.0) -> None:
        if not 0.0 <= mu <= 1.0 or gamma <= 0:
            raise ValueError("mu must be within [0, 1] and gamma positive")
        self.mu = mu
        self.gamma = gamma

    def choose(self, req: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        loads = [r.outstanding() for r in replicas]
        l_max = max(max(loads), 1)
        s = max(req.prompt_tokens, 1)
        best, best_score = 0, float("-inf")
        for i, r in enumerate(replicas):
            match = sum(r.cached_tokens(req))
            score = self.mu * (match / s) - (1.0 - self.mu) * (loads[i] / l_max) ** self.gamma
            if score > best_score:
                best, best_score = i, score
        return best


def make_router(name: str, mu: float = 0.5, gamma: float = 2.0) -> Router:
    if name == "round-robin":
        return RoundRobin()
    if name == "session-affinity":
        return SessionAffinity()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "kv-aware":
        return KvAware()
    if name == "affinity-load":
        return AffinityLoad(mu, gamma)
    raise ValueError(f"unknown router {name!r}; choose one of: {', '.join(ROUTERS)}")
