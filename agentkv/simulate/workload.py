"""The workload the simulator runs: trajectories of turns separated by tool waits, in tokens.

Primitives:
  SimTurn           one request: tokens kept from the trajectory's context, new tokens, output
                    tokens, the tool wait before it (with the tool's name and declared wait);
                    a fork turn (``branches``) runs one request per branch at once
  SimTrajectory     one trajectory: id, start time, shared-prefix group, turns
  SimWorkload       the trajectories; ``with_poisson_arrivals(rate, seed)`` re-times their
                    starts as a Poisson process (for rate questions), ``turns`` counts requests
  from_trace(trace) a TraceWorkload (agentkv.traces) as a SimWorkload

Neutral on purpose: the bench's generator (agentkv_bench.workload) and recorded traces are
adapted to this form outside the core (the CLI adapts the bench), so the simulator imports
neither. A turn's prompt is ``context_tokens`` tokens of the trajectory's history followed by
``input_tokens`` new ones. Of the history, only the previous prompt can hit a cache: both the
bench and the trace replay commit a scripted reply to the history, never the generated one, so
the reply's KV never matches (``output_in_cache`` turns that on for engines replaying real
outputs). A fork (the bench's ``--fork-prob``) runs its branches at once on the same context,
each with its own new tokens after the turn's; the first branch continues the trajectory (the
harness joins it), the others end with the turn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentkv.traces import TraceWorkload


@dataclass(frozen=True, slots=True)
class SimTurn:
    """One request of a trajectory."""

    context_tokens: int
    """Leading prompt tokens copied from the trajectory's history (turn 1: the shared prefix)."""
    input_tokens: int
    output_tokens: int
    wait_before_s: float = 0.0
    """Tool (or user) time between the previous turn's answer and this request."""
    tool: str | None = None
    expected_wait_s: float | None = None
    """What the harness declares at pause time (None: nothing declared)."""
    branches: tuple[int, ...] = ()
    """A fork: each branch's new tokens after ``input_tokens`` (empty: no fork)."""

    @property
    def prompt_tokens(self) -> int:
        """The prompt of the request that continues the trajectory (a fork's first branch)."""
        return self.branch_prompt(0)

    def branch_prompt(self, b: int) -> int:
        """Branch ``b``'s prompt (b = 0 without a fork)."""
        return self.context_tokens + self.input_tokens + (self.branches[b] if self.branches else 0)

    @property
    def requests(self) -> int:
        """Requests this turn sends: its branches, or one."""
        return max(1, len(self.branches))


@dataclass(frozen=True, slots=True)
class SimTrajectory:
    trajectory_id: str
    start_s: float
    turns: tuple[SimTurn, ...]
    shared_prefix_tokens: int = 0
    """Leading tokens of every turn identical across the trajectories of ``prefix_group``."""
    prefix_group: str = ""
    output_in_cache: bool = False


@dataclass(frozen=True)
class SimWorkload:
    trajectories: tuple[SimTrajectory, ...]
    name: str = "workload"

    @cached_property
    def turns(self) -> int:
        """Requests of the whole workload (a fork's branches each count)."""
        trajs = self.trajectories
        extra = sum(len(u.branches) - 1 for t in trajs for u in t.turns if u.branches)
        return sum(len(t.turns) for t in trajs) + extra

    def with_poisson_arrivals(self, rate_per_s: float, seed: int = 0) -> SimWorkload:
        """The same trajectories started by a Poisson process of ``rate_per_s`` per second
        (exponential gaps, seeded), in their order."""
        if not rate_per_s > 0:
            raise ValueError("rate must be positive")
        rng = random.Random(f"{seed}:arrivals")
        t = 0.0
        out: list[SimTrajectory] = []
        for traj in self.trajectories:
            out.append(replace(traj, start_s=t))
            t += rng.expovariate(rate_per_s)
        return SimWorkload(tuple(out), f"{self.name} @ {rate_per_s:g}/s")


def from_trace(trace: TraceWorkload, output_in_cache: bool = False) -> SimWorkload:
    """A TraceLab trace as a SimWorkload: round i's wait after becomes round i+1's wait before;
    nothing is declared at pause time (the tool is named ``tool``, the predictor learns it)."""
    trajs: list[SimTrajectory] = []
    for s in trace.sessions:
        turns: list[SimTurn] = []
        wait = 0.0
        for k, r in enumerate(s.rounds):
            turns.append(
                SimTurn(
                    context_tokens=r.prefix_len,
                    input_tokens=r.input_len,
                    output_tokens=max(1, r.output_len),
                    wait_before_s=wait if k else 0.0,
                    tool="tool" if k else None,
                )
            )
            wait = r.wait_after_s
        trajs.append(
            SimTrajectory(
                trajectory_id=str(s.session_id),
                start_s=float(s.arrival_s),
                turns=tuple(turns),
                output_in_cache=output_in_cache,
            )
        )
    trajs.sort(key=lambda t: t.start_s)
    return SimWorkload(tuple(trajs), f"trace {trace.source}")
