"""Trajectory and branch state: what the manager knows about each agent trajectory.

Primitives:
  BranchState   ACTIVE -> HELD -> {RETAINED, OFFLOADING -> OFFLOADED, DROPPED} -> ACTIVE ...
                (a deleted trajectory leaves the table: a tombstone, not a state)
  Branch        one branch (a forked continuation): its last finished context (tokens, tier
                keys, vLLM block hashes and ids), the device blocks pinned for it, the pause it is
                in (tool, decision, lease, prefetch), the requests running on it
  TurnStats     prefix statistics of one turn
  Trajectory    branches under one id, the last turns, activity time, the deleted flag

Plain data: the TrajectoryManager is the only writer.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

MAX_TURNS_KEPT = 256


class BranchState(str, enum.Enum):
    ACTIVE = "active"  # a request of this branch is running
    HELD = "held"  # finished; device blocks pinned for the grace period, awaiting a decision
    RETAINED = "retained"  # paused; device blocks pinned under a lease
    OFFLOADING = "offloading"  # paused; copy to a tier in flight, device blocks pinned until done
    OFFLOADED = "offloaded"  # paused; KV in a tier, device copy unpinned (reusable until evicted)
    DROPPED = "dropped"  # paused; nothing kept beyond what vLLM's cache happens to hold


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
    # The last finished context: its trusted tokens, and per full block its tier key, vLLM block
    # hash (to check a block still holds it before re-pinning) and engine block id.
    token_ids: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    pinned: list[int] = field(default_factory=list)  # block ids this branch holds a pin on
    running: set[str] = field(default_factory=set)
    grace_until: float = 0.0
    lease_until: float = 0.0
    tool: str | None = None
    paused_at: float | None = None
    predicted_return_at: float | None = None
    prefetch_due: float | None = None
    prefetch_done_at: float | None = None
    decision: dict[str, Any] | None = None
    pending: tuple[str, float] | None = None  # (action, lease_s) decided while a request ran
    tier: str | None = None
    store_job: int | None = None
    # Why the engine moved it off the device on its own (grace_expired, lease_expired, pressure,
    # job_timeout, evicted); None after a client decision. Operators ask "why was this offloaded?".
    demoted_by: str | None = None
    timer_token: int = 0  # bumps on every state change: stale timers are ignored

    @property
    def kv_tokens(self) -> int:
        return len(self.token_ids)

    def summary(self) -> dict[str, Any]:
        due = (
            self.prefetch_due - self.paused_at
            if self.prefetch_due is not None and self.paused_at is not None
            else None
        )
        done = (
            self.prefetch_done_at - self.paused_at
            if self.prefetch_done_at is not None and self.paused_at is not None
            else None
        )
        return {
            "branch": self.name,
            "state": self.state.value,
            "tokens": self.kv_tokens,
            "blocks": len(self.keys),
            "pinned_blocks": len(self.pinned),
            "tier": self.tier,
            "tool": self.tool,
            "decision": self.decision,
            "demoted_by": self.demoted_by,
            "running_requests": len(self.running),
            "prefetch": {
                "due_after_pause_s": round(due, 6) if due is not None else None,
                "done_after_pause_s": round(done, 6) if done is not None else None,
            },
        }


@dataclass
class Trajectory:
    trajectory_id: str
    created_at: float = 0.0
    last_active: float = 0.0
    branches: dict[str, Branch] = field(default_factory=dict)
    turns: deque[TurnStats] = field(default_factory=lambda: deque(maxlen=MAX_TURNS_KEPT))
    turn_count: int = 0
    hit_tokens: int = 0  # over turns after the first of each branch
    prompt_tokens: int = 0
    deleted: bool = False
    owned: set[bytes] = field(default_factory=set)  # tier keys this trajectory holds a reference on
    _seen_branches: set[str] = field(default_factory=set)

    def branch(self, name: str) -> Branch:
        b = self.branches.get(name)
        if b is None:
            b = self.branches[name] = Branch(name=name)
        return b

    @property
    def running(self) -> int:
        return sum(len(b.running) for b in self.branches.values())

    def add_turn(self, turn: TurnStats) -> None:
        self.turns.append(turn)
        self.turn_count += 1
        if turn.branch in self._seen_branches:
            self.hit_tokens += turn.hit_tokens
            self.prompt_tokens += turn.prompt_tokens
        self._seen_branches.add(turn.branch)

    @property
    def prefix_hit_ratio(self) -> float:
        """H_prefix so far: hit tokens over prompt tokens, turns after the first of each branch."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
