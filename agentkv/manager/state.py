"""Trajectory and branch state: what the manager knows about each agent trajectory.

Primitives:
  BranchState   ACTIVE -> HELD -> {RETAINED, CACHED, OFFLOADING -> OFFLOADED, DROPPED} -> ACTIVE
                (a deleted trajectory leaves the table: a tombstone, not a state)
  DemotedBy     why the engine moved a paused branch off the device on its own (a StrEnum: its
                values are GET's ``demoted_by``); defined in agentkv/demotion.py (with the
                reasons the demotions counter labels), re-exported here
  Branch        one branch (a forked continuation): its last finished context (tokens, tier
                keys, vLLM block hashes and ids), the device blocks pinned for it, the pause it is
                in (tool, decision, lease, prefetch), the requests running on it
  TurnStats     prefix statistics of one turn
  Trajectory    branches under one id, the last turns, activity time, the deleted flag
  scoped_id     the table key of a trajectory id in a tenant's namespace (tenants: cache_salt)

Plain data: the TrajectoryManager is the only writer.
"""

from __future__ import annotations

import enum
import functools
import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentkv.demotion import DemotedBy

if TYPE_CHECKING:
    from agentkv.manager.prefetch import DevicePrefetch
    from agentkv.predict import WaitEstimate

MAX_TURNS_KEPT = 256
CONCURRENT_WARNING = (
    "another request of this trajectory's branch was still running: several runs share one "
    "session id (a client-level header?); give each run its own id, set per run "
    "(docs/sdk.md, Agent frameworks)"
)


class BranchState(str, enum.Enum):
    ACTIVE = "active"  # a request of this branch is running
    HELD = "held"  # finished; device blocks pinned for the grace period, awaiting a decision
    RETAINED = "retained"  # paused; device blocks pinned under a lease
    OFFLOADING = "offloading"  # paused; copy to a tier in flight, device blocks pinned until done
    OFFLOADED = "offloaded"  # paused; KV in a tier, device copy unpinned (reusable until evicted)
    # paused; an offload_host whose copy waits: device blocks unpinned in vLLM's prefix cache,
    # copied to host once the pool forecasts eviction (policy.defer_writeback)
    CACHED = "cached"
    DROPPED = "dropped"  # paused; nothing kept beyond what vLLM's cache happens to hold


PAUSED_STATES = frozenset(
    {
        BranchState.HELD,
        BranchState.RETAINED,
        BranchState.CACHED,
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
    # The device prefetch of the pause this turn ended: on_time, late (prefetch.py), or None.
    prefetch: str | None = None
    # Requests of the same branch still running when this one was looked up: > 0 means several
    # runs share one session id (merged into one trajectory), never a real next turn.
    concurrent_turns: int = 0

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
            "prefetch": self.prefetch,
            # Only when it happened: the stats of an ordinary turn keep their shape.
            **(
                {"concurrent_turns": self.concurrent_turns, "warning": CONCURRENT_WARNING}
                if self.concurrent_turns
                else {}
            ),
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
    estimate: WaitEstimate | None = None  # the pause's wait prediction
    device_prefetch: DevicePrefetch | None = None  # a device prefetch in flight (prefetch.py)
    # Its outcome when the client's resume ended the pause: the next turn reports it.
    resumed_prefetch: str | None = None
    decision: dict[str, Any] | None = None
    # (action, lease_s, write-back deferred) decided while a request ran
    pending: tuple[str, float, bool] | None = None
    tier: str | None = None
    store_job: int | None = None
    # Why the engine moved it off the device on its own; None after a client decision.
    # Operators ask "why was this offloaded?".
    demoted_by: DemotedBy | None = None
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
                # ordered | loading | ready: a device prefetch (RETAINED while ready)
                "device": self.device_prefetch.state.value if self.device_prefetch else None,
            },
        }


# Separates a trajectory id from its tenant's digest in a table key. Ids from the wire never
# contain it (the plugin's ID_PATTERN); an id that does (a direct caller) is escaped.
_SEP = "\x00"
_DIGEST_HEX = 16


@functools.lru_cache(maxsize=4096)
def tenant_digest(tenant: str) -> str:
    """An opaque tenant id: the salt itself is never kept in tables, views or spans."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:_DIGEST_HEX]


def scoped_id(trajectory_id: str, tenant: str | None) -> str:
    """The table key of ``trajectory_id`` in ``tenant``'s namespace. Tenants are separate
    namespaces: the same id under two cache_salts is two trajectories (stats, divergence, tier
    copies, pins). No tenant (None or ""): the unsalted namespace, whose keys are the plain id.
    Injective: a salted key ends in SEP + 16 hex digits, an escaped unsalted one in SEP."""
    if tenant:
        return f"{trajectory_id}{_SEP}{tenant_digest(tenant)}"
    return trajectory_id + _SEP if _SEP in trajectory_id else trajectory_id


def split_scoped(key: str) -> tuple[str, str | None]:
    """(trajectory id, tenant digest or None) of a table key."""
    if _SEP not in key:
        return key, None
    if key.endswith(_SEP):
        return key[:-1], None
    name, digest = key.rsplit(_SEP, 1)
    return name, digest


@dataclass
class Trajectory:
    # The table key: the client's id scoped to its tenant (``scoped_id``); ``name`` is the id.
    trajectory_id: str
    created_at: float = 0.0
    last_active: float = 0.0
    branches: dict[str, Branch] = field(default_factory=dict)
    turns: deque[TurnStats] = field(default_factory=lambda: deque(maxlen=MAX_TURNS_KEPT))
    turn_count: int = 0
    hit_tokens: int = 0  # over turns after the first of each branch
    prompt_tokens: int = 0
    deleted: bool = False
    # The raw cache_salt of its requests, never in views or spans: a device prefetch's internal
    # request must hash its blocks exactly as the turns did. The restart manifest keeps it
    # (a local 0600 file, ``recovery``), so a restored trajectory prefetches in its namespace.
    salt: str | None = field(default=None, repr=False)
    owned: set[bytes] = field(default_factory=set)  # tier keys this trajectory holds a reference on
    warned_concurrent: bool = False  # the server log warned of concurrent turns (once each)
    _seen_branches: set[str] = field(default_factory=set)

    def branch(self, name: str) -> Branch:
        b = self.branches.get(name)
        if b is None:
            b = self.branches[name] = Branch(name=name)
        return b

    @property
    def name(self) -> str:
        """The id its client knows (without the tenant)."""
        return split_scoped(self.trajectory_id)[0]

    @property
    def tenant(self) -> str | None:
        """Its tenant's digest (None: the unsalted namespace)."""
        return split_scoped(self.trajectory_id)[1]

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
