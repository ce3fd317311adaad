"""Offered load: how much engine time a workload asks of a fleet, before simulating it.

Primitives:
  turn_work_s(costs, turn, cached, batch)  engine seconds one turn needs when ``cached`` of its
                        prompt tokens are already on the device: its prefill chunks (compute and
                        one step overhead each) and its decode tokens (compute, and the step
                        overhead shared by ``batch`` sequences)
  max_batch(costs, num_blocks, tokens)     sequences of ``tokens`` tokens a pool can run at once
  trajectory_work(costs, num_blocks, t) -> (work_s, unloaded_s)  every history cached (the
                        capacity-equal assumption: no policy can need less), and the trajectory's
                        duration on an idle engine (its tool waits plus its own service)
  OfferedLoad           utilization (the busiest stretch, one median trajectory long), the mean,
                        the workload's engine seconds, the smallest fleet that carries it, a warning
  offered_load(workload, costs, num_blocks, replicas) -> OfferedLoad
  MAX_UTILIZATION       what "carries it" means: offered engine seconds per second per replica <= 1

Why a bound and not the simulation: a closed-loop simulation of an overloaded fleet is correct
and useless (queues of hours, and as slow to compute as the work it queues). The offered load is
a lower bound (every resume finds its whole history cached, decode batches as full as the pool
allows), so "overloaded" is a statement about every cache policy; a policy that recomputes needs
more. The utilization is the peak of the offered rate averaged over a window one median
unloaded trajectory long: trajectories that start together load the fleet together.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from agentkv.simulate.costs import EngineCosts
from agentkv.simulate.workload import SimTrajectory, SimTurn, SimWorkload

MAX_UTILIZATION = 1.0
BACKLOG_WINDOWS = 10.0
"""An overload is unbounded when the work left over at the end of the arrivals (the fleet's
lower-bound makespan minus the unloaded span) exceeds this many median trajectories: queueing
then dominates every latency (a small saturated population, like the bench's 6 trajectories on
one replica, only stretches)."""


def max_batch(costs: EngineCosts, num_blocks: int, tokens: int) -> int:
    """Sequences of ``tokens`` tokens that fit in ``num_blocks`` blocks (at least 1), capped by
    the engine's ``max_num_seqs``."""
    per_seq = max(1, -(-tokens // costs.block_tokens))
    return max(1, min(costs.max_num_seqs, num_blocks // per_seq))


def turn_work_s(costs: EngineCosts, turn: SimTurn, cached: int, batch: int) -> float:
    """Engine seconds of one turn with ``cached`` prompt tokens already computed."""
    return _turn(costs, turn.prompt_tokens, turn.output_tokens, cached, batch)[0]


def _turn(
    costs: EngineCosts, prompt: int, output: int, cached: int, batch: int
) -> tuple[float, float]:
    """(engine seconds at ``batch``, seconds alone on an idle engine) of one turn."""
    new = max(1, prompt - cached)
    chunks = -(-new // costs.max_batched_tokens)
    step = costs.step_overhead_s
    prefill = costs.prefill_s(new, prompt - new)
    prefill = max(prefill, chunks * step) if costs.roofline else prefill + chunks * step
    decode_tokens = max(0, output - 1)
    # One token per decode step; the attention cost is that of the context mid-answer.
    compute = decode_tokens * costs.decode_token_s(prompt + decode_tokens // 2)
    work = prefill + compute + decode_tokens * step / max(1, batch)
    alone = prefill + compute + decode_tokens * step + costs.request_overhead_s
    return work, alone


def trajectory_work(costs: EngineCosts, num_blocks: int, t: SimTrajectory) -> tuple[float, float]:
    """(engine seconds with every history cached, duration on an idle fleet)."""
    work = 0.0
    alone = 0.0
    prev_cacheable = t.shared_prefix_tokens
    bt = costs.block_tokens
    for turn in t.turns:
        prompt = turn.prompt_tokens
        # Only full blocks are cached, and the last prompt token is always computed.
        reusable = min(turn.context_tokens, prev_cacheable, prompt - 1)
        batch = max_batch(costs, num_blocks, prompt + turn.output_tokens)
        cached = (max(0, reusable) // bt) * bt
        w, a = _turn(costs, prompt, turn.output_tokens, cached, batch)
        work += w
        for b in range(
            1, len(turn.branches)
        ):  # a fork's other branches run alongside, same history
            work += _turn(costs, turn.branch_prompt(b), turn.output_tokens, cached, batch)[0]
        alone += turn.wait_before_s + a
        prev_cacheable = prompt + (turn.output_tokens if t.output_in_cache else 0)
    return work, alone


@dataclass(frozen=True)
class OfferedLoad:
    """The load a workload offers a fleet (see the module docstring)."""

    replicas: int
    utilization: float
    """Peak offered engine seconds per second per replica, over a window of ``window_s``."""
    mean_utilization: float
    """The whole run's engine seconds over its unloaded span, per replica."""
    work_s: float
    span_s: float
    window_s: float
    min_replicas: int
    """Smallest fleet whose peak utilization is at most MAX_UTILIZATION."""

    @property
    def overloaded(self) -> bool:
        return self.utilization > MAX_UTILIZATION

    @property
    def backlog_s(self) -> float:
        """Engine seconds per replica still queued when the unloaded run would have ended."""
        return max(0.0, self.work_s / self.replicas - self.span_s)

    @property
    def unbounded(self) -> bool:
        return self.overloaded and self.backlog_s > BACKLOG_WINDOWS * self.window_s

    def horizon_s(self) -> float | None:
        """How far to simulate an unbounded overload (its first BACKLOG_WINDOWS median
        trajectories: enough to see the policy at saturation), None to simulate it all."""
        return BACKLOG_WINDOWS * self.window_s if self.unbounded else None

    def warning(self) -> str | None:
        if not self.overloaded:
            return None
        if not self.unbounded:
            return (
                f"saturated: offered load {self.utilization:.1f}x what {self.replicas} "
                f"replica(s) serve at the busiest stretch; trajectories are stretched by queueing "
                f"(the smallest fleet that carries it has {self.min_replicas} replicas)"
            )
        return (
            f"offered load {self.utilization:.1f}x what {self.replicas} replica(s) can serve "
            f"(utilization {self.utilization:.0%} at the busiest stretch, {self.mean_utilization:.0%}"
            f" on average, counting every history as cached): the fleet is overloaded, queues "
            f"grow without bound; the smallest fleet that carries it has {self.min_replicas} "
            "replicas (more for a latency objective: --find-replicas)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "overloaded": self.overloaded,
            "unbounded": self.unbounded,
            "backlog_s": self.backlog_s,
            "warning": self.warning(),
        }


def _peak_rate(intervals: list[tuple[float, float, float]], window: float) -> float:
    """Max over t of the mean of the summed rates on [t, t + window]; ``intervals`` are
    (start, end, rate). The integral is piecewise linear, so its window differences peak where
    t or t + window is a breakpoint."""
    import numpy as np

    starts = np.array([s for s, _, _ in intervals])
    ends = np.array([e for _, e, _ in intervals])
    rates = np.array([r for _, _, r in intervals])
    times = np.concatenate([starts, ends])
    deltas = np.concatenate([rates, -rates])
    order = np.argsort(times, kind="stable")
    times, deltas = times[order], deltas[order]
    level = np.cumsum(deltas)  # the rate right after each breakpoint
    seg = np.diff(times, append=times[-1])
    integral = np.concatenate([[0.0], np.cumsum(level * seg)])[:-1]

    def area(t: Any) -> Any:
        idx = np.clip(np.searchsorted(times, t, side="right") - 1, 0, len(times) - 1)
        before = t < times[0]
        out = integral[idx] + level[idx] * (t - times[idx])
        return np.where(before, 0.0, out)

    probes = np.concatenate([times, times - window])
    return float(np.max((area(probes + window) - area(probes)) / window))


def offered_load(
    workload: SimWorkload, costs: EngineCosts, num_blocks: int, replicas: int
) -> OfferedLoad:
    """The offered load of ``workload`` on ``replicas`` replicas of ``num_blocks`` blocks."""
    if not workload.trajectories:
        raise ValueError("the workload has no trajectories")
    intervals: list[tuple[float, float, float]] = []
    durations: list[float] = []
    total = 0.0
    for t in workload.trajectories:
        work, alone = trajectory_work(costs, num_blocks, t)
        alone = max(alone, work, 1e-9)
        total += work
        durations.append(alone)
        intervals.append((t.start_s, t.start_s + alone, work / alone))
    durations.sort()
    window = durations[len(durations) // 2]
    t0 = min(s for s, _, _ in intervals)
    span = max(e for _, e, _ in intervals) - t0
    peak = _peak_rate(intervals, window)
    return OfferedLoad(
        replicas=replicas,
        utilization=peak / replicas,
        mean_utilization=total / max(span, 1e-9) / replicas,
        work_s=total,
        span_s=span,
        window_s=window,
        min_replicas=max(1, math.ceil(peak / MAX_UTILIZATION - 1e-9)),
    )
