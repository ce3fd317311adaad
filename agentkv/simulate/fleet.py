"""The fleet simulation: trajectories as SimPy processes, a router, N replicas; one call runs it.

Primitives:
  FleetConfig       replicas, router (and mu, gamma), KV policy (and the retain TTL), pool size,
                    tier sizes, engine costs, sampling interval
  SimResult         the Summary, the occupancy samples, the wall time the simulation took, the
                    offered load (agentkv.simulate.load) and whether a horizon cut the run short
  simulate(workload, config, on_progress=None, load=None) -> SimResult  deterministic in its
                    inputs

A trajectory sends turn 1 at its start time; the router picks a replica; the replica runs it
(a fork turn: one request per branch, all on that replica); when the answer is complete the
harness's pause reaches the replica (at once, later or never: ``pause_after_s``, within the
connector's ``grace_s``) and its policy decides what to do during the coming tool wait; after
the wait the next turn goes out (a closed loop per trajectory, as the bench's
harness and the trace replay run). At the end the trajectory is closed (agentkv's DELETE).
Nothing is random inside the simulation: the workload carries every sampled number, so the same
workload and config give the same result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, field
from typing import Any

import simpy

from agentkv.policy import Writeback
from agentkv.simulate.admission import Admission
from agentkv.simulate.costs import BENCH_SMALL_CPU, EngineCosts
from agentkv.simulate.grace import GRACE_S
from agentkv.simulate.load import OfferedLoad
from agentkv.simulate.metrics import Recorder, Summary
from agentkv.simulate.policies import make_policy
from agentkv.simulate.replica import GIB, Replica, Request
from agentkv.simulate.routers import make_router
from agentkv.simulate.tiers import TierStore
from agentkv.simulate.workload import SimTrajectory, SimWorkload
from agentkv.tier import Tier

ProgressFn = Callable[[str, int, int], None]


@dataclass(frozen=True)
class FleetConfig:
    replicas: int = 1
    router: str = "session-affinity"
    policy: str = "agentkv"
    num_blocks: int = 128
    host_capacity_gib: float = 2.0
    disk_capacity_gib: float = 0.0
    remote_capacity_gib: float = 0.0
    mu: float = 0.5
    gamma: float = 2.0
    retain_ttl_s: float = 60.0
    device_prefetch: bool = False
    """agentkv prefetches paused contexts into device blocks (the manager's rule)."""
    sample_interval_s: float = 0.5
    costs: EngineCosts = field(default=BENCH_SMALL_CPU)
    admission: Admission = Admission.WHOLE
    """How replicas give blocks to requests (replica.Admission): WHOLE (wait until prompt and
    output fit, never preempt: the model the committed runs validate) or CHUNK (vLLM 0.32's
    scheduler: chunk-wise allocation and recompute preemption; docs/simulate.md compares)."""
    writeback: Writeback = Writeback.FORECAST
    """When agentkv's offload_host copies are made (the plugin's ``writeback`` setting, whose
    default this is): FORECAST waits until the pool forecasts eviction, EAGER copies at once."""
    grace_s: float = GRACE_S
    """The connector's grace period: a finished turn's blocks stay pinned this long waiting for
    the harness's pause (policies run by the plugin: agentkv, retain-always, offload-always)."""
    pause_after_s: float | None = 0.0
    """When the harness's pause arrives after a turn's answer: 0 (the bench and trace
    harnesses: at once; the grace then changes nothing), a delay, or None (a harness that never
    pauses: every turn's blocks get the connector's default action when the grace ends)."""
    horizon_s: float | None = None
    """Stop simulating this long after the first arrival (None: run every trajectory to its
    end); turns not finished by then are not in the summary. For unbounded overloads."""

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.num_blocks < 1:
            raise ValueError("replicas and num_blocks must be >= 1")
        if self.sample_interval_s <= 0:
            raise ValueError("sample_interval_s must be positive")
        if self.grace_s < 0 or (self.pause_after_s is not None and self.pause_after_s < 0):
            raise ValueError("grace_s and pause_after_s must be >= 0")
        if self.horizon_s is not None and not self.horizon_s > 0:
            raise ValueError("horizon_s must be positive")

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["costs"] = self.costs.name
        return out


@dataclass
class SimResult:
    config: FleetConfig
    summary: Summary
    samples: list[tuple[float, ...]]
    wall_s: float
    ttft: list[float] = field(default_factory=list)
    resume_ttft: list[float] = field(default_factory=list)
    load: OfferedLoad | None = None
    truncated: bool = False
    """The run stopped at ``config.horizon_s`` with turns still queued."""

    def to_dict(self, with_samples: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "config": self.config.describe(),
            "summary": self.summary.to_dict(),
            "wall_s": round(self.wall_s, 3),
            "load": self.load.to_dict() if self.load is not None else None,
            "truncated": self.truncated,
        }
        if with_samples:
            out["samples"] = {
                "fields": [
                    "t_s",
                    "device_used",
                    "device_pinned",
                    "host_b",
                    "disk_b",
                    "remote_b",
                    "paused",
                ],
                "rows": [list(s) for s in self.samples],
            }
        return out


class _Fleet:
    def __init__(self, workload: SimWorkload, cfg: FleetConfig, on_progress: ProgressFn | None):
        self.cfg = cfg
        self.workload = workload
        self.env = simpy.Environment()
        costs = cfg.costs
        self.remote: TierStore | None = None
        if cfg.remote_capacity_gib > 0:
            self.remote = TierStore(
                Tier.REMOTE,
                cfg.remote_capacity_gib * GIB,
                costs.block_bytes(),
                costs.remote_bytes_per_s,
                costs.remote_bytes_per_s,
            )
        self.replicas = [
            Replica(
                self.env,
                i,
                costs,
                cfg.num_blocks,
                make_policy(cfg.policy, costs, cfg.retain_ttl_s, cfg.device_prefetch),
                cfg.host_capacity_gib,
                cfg.disk_capacity_gib,
                self.remote,
                Admission(cfg.admission),
                Writeback(cfg.writeback),
                cfg.grace_s,
            )
            for i in range(cfg.replicas)
        ]
        self.router = make_router(cfg.router, cfg.mu, cfg.gamma)
        self.rec = Recorder()
        self.total_turns = workload.turns
        self.done_turns = 0
        self.done_trajs = 0
        self.paused = 0
        self.first_sent = float("inf")
        self.last_done = 0.0
        self.on_progress = on_progress
        self.progress_every = max(1, self.total_turns // 200)
        self.all_done = self.env.event()
        self.truncated = False

    def _trajectory(self, t: SimTrajectory) -> Generator[simpy.Event, Any, None]:
        env = self.env
        bt = self.cfg.costs.block_tokens
        overhead = self.cfg.costs.request_overhead_s
        start = env.now
        prev_cacheable = t.shared_prefix_tokens
        last: Replica | None = None
        used: set[int] = set()
        n = len(t.turns)
        for k, turn in enumerate(t.turns):
            if k:
                self.paused += 1
                yield env.timeout(turn.wait_before_s)
                self.paused -= 1
                if last is not None:
                    last.policy.on_resume(turn.tool, turn.wait_before_s)
            reqs = self._requests(t, k, prev_cacheable)
            first = reqs[0]
            cacheable = first.cacheable_tokens
            self.first_sent = min(self.first_sent, env.now)
            if overhead > 0:
                yield env.timeout(overhead)
            idx = self.router.choose(first.route_view(), self.replicas)
            replica = self.replicas[idx]
            used.add(idx)
            for req in reqs:  # a fork's branches go where their shared history is
                replica.submit(req)
            yield first.done if len(reqs) == 1 else simpy.AllOf(env, [r.done for r in reqs])
            if any(r.rejected for r in reqs):
                self.rec.rejected += sum(r.rejected for r in reqs)
                break
            self._record(k, turn.output_tokens, reqs)
            if k + 1 < n:
                nxt = t.turns[k + 1]
                replica.finish_turn(
                    t.trajectory_id,
                    nxt.tool,
                    nxt.expected_wait_s,
                    cacheable,
                    cacheable // bt,
                    self.cfg.pause_after_s,
                )
            last = replica
            prev_cacheable = cacheable
        self.rec.jct.append(env.now - start)
        for i in used:
            self.replicas[i].close(t.trajectory_id)
        self.done_trajs += 1
        if self.done_trajs == len(self.workload.trajectories):
            self.all_done.succeed()

    def _requests(self, t: SimTrajectory, k: int, prev_cacheable: int) -> list[Request]:
        """Turn ``k``'s requests: one, or one per branch of a fork (the first continues the
        trajectory; the others, ids ``<trajectory>/fork<k>.<b>``, share its history)."""
        turn = t.turns[k]
        out: list[Request] = []
        for b in range(turn.requests):
            prompt = turn.branch_prompt(b)
            req = Request(
                t.trajectory_id if b == 0 else f"{t.trajectory_id}/fork{k}.{b}",
                t.prefix_group,
                prompt,
                turn.output_tokens,
                min(t.shared_prefix_tokens, prompt),
                min(turn.context_tokens, prev_cacheable),
                prompt + (turn.output_tokens if t.output_in_cache else 0),
                self.cfg.costs.block_tokens,
                self.env.now,
                self.env.event(),
            )
            if b:
                req.parent = t.trajectory_id
            out.append(req)
        return out

    def _record(self, k: int, output: int, reqs: list[Request]) -> None:
        for req in reqs:
            self.rec.turn(
                k + 1,
                k > 0,
                req.first_token_at - req.sent_at,
                req.finished_at - req.sent_at,
                req.prompt,
                req.cached_tokens,
                req.tier_hit_tokens,
                output,
            )
        self.last_done = max(self.last_done, self.env.now)
        before = self.done_turns
        self.done_turns += len(reqs)
        every = self.progress_every
        if self.on_progress is not None and self.done_turns // every != before // every:
            self.on_progress("simulating turns", self.done_turns, self.total_turns)

    def _arrivals(self) -> Generator[simpy.Event, Any, None]:
        env = self.env
        for t in sorted(self.workload.trajectories, key=lambda t: t.start_s):
            if t.start_s > env.now:
                yield env.timeout(t.start_s - env.now)
            env.process(self._trajectory(t))

    def _sampler(self) -> Generator[simpy.Event, Any, None]:
        env = self.env
        reps = self.replicas
        cap = sum(r.pool.capacity for r in reps)
        while True:
            self.rec.sample(
                (
                    env.now,
                    sum(r.pool.used for r in reps) / cap,
                    sum(r.pool.pinned for r in reps) / cap,
                    sum(r.host.used_bytes for r in reps if r.host is not None),
                    sum(r.disk.used_bytes for r in reps if r.disk is not None),
                    self.remote.used_bytes if self.remote is not None else 0.0,
                    float(self.paused),
                )
            )
            yield env.timeout(self.cfg.sample_interval_s * self.rec.sample_every)

    def run(self) -> Summary:
        env = self.env
        if not self.workload.trajectories:
            raise ValueError("the workload has no trajectories")
        env.process(self._arrivals())
        env.process(self._sampler())
        stop: simpy.Event = self.all_done
        if self.cfg.horizon_s is not None:
            first = min(t.start_s for t in self.workload.trajectories)
            stop = self.all_done | env.timeout(first + self.cfg.horizon_s - env.now)
        env.run(until=stop)
        self.truncated = not self.all_done.triggered
        reps = self.replicas
        tiers = [t for r in reps for t in (r.host, r.disk) if t is not None]
        if self.remote is not None:
            tiers.append(self.remote)
        decisions: dict[str, int] = {}
        prefetch: dict[str, int] = {}
        writebacks: dict[str, int] = {}
        for r in reps:
            for k, v in r.writebacks.items():
                writebacks[k] = writebacks.get(k, 0) + v
            for k, v in r.decisions.items():
                decisions[k] = decisions.get(k, 0) + v
            for k, v in r.prefetch.items():
                prefetch[k] = prefetch.get(k, 0) + v
        summary = self.rec.summary(
            self.cfg.policy,
            self.cfg.router,
            self.cfg.replicas,
            max(0.0, self.last_done - self.first_sent),
            sum(r.demotions for r in reps),
            sum(r.pool.evicted_blocks for r in reps),
            sum(t.bytes_written for t in tiers),
            sum(t.bytes_read for t in tiers),
            sum(r.steps for r in reps),
            decisions,
            sum(r.busy_s for r in reps) / max(1e-9, len(reps) * (env.now - self.first_sent)),
            sum(r.preemptions for r in reps),
        )
        summary.prefetch = dict(sorted(prefetch.items()))
        summary.writebacks = dict(sorted(writebacks.items()))
        return summary


def simulate(
    workload: SimWorkload,
    config: FleetConfig,
    on_progress: ProgressFn | None = None,
    load: OfferedLoad | None = None,
) -> SimResult:
    """Run ``workload`` on the fleet ``config`` describes; deterministic in its inputs.
    ``load`` (``offered_load`` of the same workload and fleet) is attached to the result."""
    t0 = time.perf_counter()
    fleet = _Fleet(workload, config, on_progress)
    summary = fleet.run()
    return SimResult(
        config,
        summary,
        fleet.rec.samples,
        time.perf_counter() - t0,
        list(fleet.rec.ttft),
        list(fleet.rec.resume_ttft),
        load,
        fleet.truncated,
    )
