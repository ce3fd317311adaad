"""The trajectory table: what the engine holds for each agent trajectory, and its state machine.

Primitives:
  BranchState   lifecycle of one branch (a forked continuation) of a trajectory:
                ACTIVE -> HELD -> {RETAINED, OFFLOADING -> OFFLOADED, DROPPED} -> ACTIVE ... -> ENDED
  Branch        one branch: its last context (token count, logical block keys), pinned device
                blocks, pending decision, lease, tool wait bookkeeping
  Trajectory    branches under one id plus per-turn prefix statistics
  TrajectoryTable  id -> Trajectory with the queries the plugin needs (expired leases, pressure
                victims ordered by farthest predicted return)

Pure bookkeeping: no engine objects, no clocks of its own (callers pass ``now``), so the state
machine is unit-tested without vLLM.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


class BranchState(str, enum.Enum):
    ACTIVE = "active"  # a request of this branch is running
    HELD = "held"  # finished; device blocks pinned for the grace period, awaiting a decision
    RETAINED = "retained"  # paused; device blocks pinned under a lease
    OFFLOADING = "offloading"  # paused; copy to a tier in flight, device blocks pinned until done
    OFFLOADED = "offloaded"  # paused; KV in a tier, device copy unpinned (reusable until evicted)
    DROPPED = "dropped"  # paused; nothing kept beyond what vLLM's cache happens to hold
    ENDED = "ended"


PAUSED_STATES = frozenset(
    {
        BranchState.HELD,
        BranchState.RETAINED,
        BranchState.OFFLOADING,
        BranchState.OFFLOADED,
        BranchState.DROPPED,
    }
)


@dataclass
class TurnStats:
    """Prefix statistics of one turn (request) of a branch."""

    turn: int
    branch: str
    prompt_tokens: int
    device_hit_tokens: int = 0
    tier_hit_tokens: int = 0
    tier: str | None = None
    first_divergence_token: int | None = None
    divergence_zone: str | None = None

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.tier_hit_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "turn": self.turn,
            "branch": self.branch,
            "prompt_tokens": self.prompt_tokens,
            "device_hit_tokens": self.device_hit_tokens,
            "tier_hit_tokens": self.tier_hit_tokens,
            "hit_tokens": self.hit_tokens,
            "tier": self.tier,
            "hit_ratio": round(self.hit_tokens / self.prompt_tokens, 6)
            if self.prompt_tokens
            else 0.0,
            "first_divergence_token": self.first_divergence_token,
            "divergence_zone": self.divergence_zone,
        }


@dataclass
class Branch:
    name: str
    state: BranchState = BranchState.ACTIVE
    token_ids: list[int] = field(default_factory=list)  # the last finished context
    keys: list[bytes] = field(default_factory=list)  # logical keys of its full blocks
    pinned_block_ids: list[int] = field(default_factory=list)
    held_until: float = 0.0  # end of the grace period (HELD)
    lease_until: float = 0.0  # end of the lease (RETAINED)
    tool: str | None = None
    paused_at: float | None = None
    predicted_return_at: float | None = None
    prefetch_at: float | None = None
    prefetched_at: float | None = None
    decision: dict[str, Any] | None = None
    tier: str | None = None
    # Why the engine last moved it off the device on its own (grace_expired, lease_expired,
    # pressure); None after a pause decision. Operators ask "why was this offloaded?".
    demoted_by: str | None = None
    running_requests: set[str] = field(default_factory=set)

    @property
    def kv_tokens(self) -> int:
        return len(self.token_ids)

    def summary(self) -> dict[str, Any]:
        return {
            "branch": self.name,
            "state": self.state.value,
            "tokens": self.kv_tokens,
            "blocks": len(self.keys),
            "pinned_blocks": len(self.pinned_block_ids),
            "tier": self.tier,
            "tool": self.tool,
            "lease_until": self.lease_until or None,
            "predicted_return_at": self.predicted_return_at,
            "decision": self.decision,
            "demoted_by": self.demoted_by,
        }


@dataclass
class Trajectory:
    trajectory_id: str
    branches: dict[str, Branch] = field(default_factory=dict)
    turns: list[TurnStats] = field(default_factory=list)
    created_at: float = 0.0

    def branch(self, name: str) -> Branch:
        if name not in self.branches:
            self.branches[name] = Branch(name=name)
        return self.branches[name]

    @property
    def prefix_hit_ratio(self) -> float:
        """H_prefix so far: hit tokens over prompt tokens, turns after the first of each branch."""
        seen: set[str] = set()
        hit = total = 0
        for t in self.turns:
            if t.branch in seen:
                hit += t.hit_tokens
                total += t.prompt_tokens
            seen.add(t.branch)
        return hit / total if total else 0.0

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "trajectory_id": self.trajectory_id,
            "branches": {name: b.summary() for name, b in self.branches.items()},
            "turns": [t.to_dict() for t in self.turns],
            "prefix_hit_ratio": round(self.prefix_hit_ratio, 6),
        }


class TrajectoryTable:
    """id -> Trajectory, with the queries the scheduler-side connector makes every step."""

    def __init__(self) -> None:
        self._by_id: dict[str, Trajectory] = {}

    def get(self, trajectory_id: str) -> Trajectory | None:
        return self._by_id.get(trajectory_id)

    def get_or_create(self, trajectory_id: str, now: float) -> Trajectory:
        traj = self._by_id.get(trajectory_id)
        if traj is None:
            traj = self._by_id[trajectory_id] = Trajectory(trajectory_id, created_at=now)
        return traj

    def pop(self, trajectory_id: str) -> Trajectory | None:
        return self._by_id.pop(trajectory_id, None)

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(list(self._by_id.values()))

    def branches(self) -> Iterator[tuple[Trajectory, Branch]]:
        for traj in list(self._by_id.values()):
            for branch in list(traj.branches.values()):
                yield traj, branch

    def expired(self, now: float) -> list[tuple[Trajectory, Branch]]:
        """Branches whose grace period (HELD) or lease (RETAINED) has run out."""
        out = []
        for traj, b in self.branches():
            if (b.state is BranchState.HELD and now >= b.held_until) or (
                b.state is BranchState.RETAINED and now >= b.lease_until
            ):
                out.append((traj, b))
        return out

    def pressure_victims(self) -> list[tuple[Trajectory, Branch]]:
        """Retained or held branches, farthest predicted return first (demoted first)."""
        pinned = [
            (t, b)
            for t, b in self.branches()
            if b.state in (BranchState.RETAINED, BranchState.HELD)
        ]
        return sorted(
            pinned, key=lambda tb: -(tb[1].predicted_return_at or tb[1].lease_until or 0.0)
        )

    def count_by_state(self) -> dict[str, int]:
        counts = {s.value: 0 for s in BranchState}
        for _, b in self.branches():
            counts[b.state.value] += 1
        return counts
