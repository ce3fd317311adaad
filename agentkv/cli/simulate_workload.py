"""The workload of ``agentkv simulate``: the generator of ``agentkv bench agents``
(``agentkv_bench.workload``, imported inside) or a recorded trace (``agentkv.traces``), in the
simulator's neutral form (``agentkv.simulate.workload``).

Primitives:
    bench_workload      the bench plan for a WorkloadConfig (exact up to EXACT_PLAN_MAX_TURNS).
    build_workload      a trace (first N sessions, scaled) or the bench generator with overrides.
    BENCH_TOKEN_SCALE   prompt tokens per generator target token in the bench.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentkv.simulate.workload import SimWorkload
    from agentkv_bench.workload import WorkloadConfig

# Prompt tokens per generator target token in the bench: the embedded tokenizer's real rate on
# the generator's words plus the chat template. From docs/results.md's Performance table: 123,079
# tokens recomputed at a 0.282 hit rate (vanilla) and 32,967 at 0.808 (agentkv) are both
# ~171,500 prompt tokens, where the plan's targets add up to 152,391.
BENCH_TOKEN_SCALE = 1.125
# Above this many turns the bench plan is drawn without its text (same distributions and seeds
# per trajectory, but not the exact numbers of `agentkv bench agents`, which also draws words).
EXACT_PLAN_MAX_TURNS = 3000


def bench_workload(cfg: WorkloadConfig, token_scale: float = BENCH_TOKEN_SCALE) -> SimWorkload:
    """The plan of ``agentkv bench agents`` for ``cfg`` in the simulator's form.

    Up to EXACT_PLAN_MAX_TURNS turns it is the bench's own plan (``generate``); above, the same
    distributions drawn without text. A fork turn (``fork_prob``) runs ``fork_width`` branches,
    each with its branch observation (half the turn's, at least ``obs_min_tokens``) after the
    turn's; the first continues, as the bench's harness joins it."""
    from agentkv.simulate.workload import SimTrajectory, SimTurn, SimWorkload
    from agentkv_bench.workload import generate

    pre = round(cfg.prefix_tokens * token_scale)
    action = round(cfg.action_tokens * token_scale)
    trajs: list[SimTrajectory] = []
    Row = tuple[str | None, float, float | None, int, int]
    plans: list[tuple[str, float, list[Row]]]
    if cfg.trajectories * cfg.turns <= EXACT_PLAN_MAX_TURNS:
        plans = [
            (
                t.trajectory_id,
                t.start_s,
                [
                    (u.tool, u.wait_s, u.expected_wait_s, u.observation_tokens, u.fork)
                    for u in t.turns[1:]
                ],
            )
            for t in generate(cfg).trajectories
        ]
    else:
        plans = []
        weights = [t.weight for t in cfg.tools]
        for i in range(cfg.trajectories):
            rng = random.Random(f"{cfg.seed}:traj:{i}")
            rows: list[Row] = []
            for _ in range(2, cfg.turns + 1):
                dist = rng.choices(cfg.tools, weights=weights)[0]
                wait = dist.sample(rng) * cfg.time_scale
                raw = math.exp(rng.gauss(math.log(cfg.obs_median_tokens), cfg.obs_sigma))
                obs = int(min(cfg.obs_max_tokens, max(cfg.obs_min_tokens, raw)))
                # Drawn only when forks are asked for: the plans without forks stay as they were.
                fork = cfg.fork_width if cfg.fork_prob > 0 and rng.random() < cfg.fork_prob else 0
                rows.append((dist.name, wait, round(dist.median_s * cfg.time_scale, 4), obs, fork))
            plans.append((f"bench-{cfg.seed}-{i}", i * cfg.stagger_s * cfg.time_scale, rows))
    for tid, start, rows in plans:
        first = SimTurn(pre, round(cfg.task_tokens * token_scale), cfg.action_tokens)
        turns = [first]
        for tool, wait, expected, obs, fork in rows:
            branch = round(max(cfg.obs_min_tokens, obs // 2) * token_scale)
            turns.append(
                SimTurn(
                    turns[-1].prompt_tokens + action,
                    round(obs * token_scale),
                    cfg.action_tokens,
                    wait,
                    tool,
                    expected,
                    (branch,) * fork,
                )
            )
        trajs.append(SimTrajectory(tid, start, tuple(turns), pre, "bench"))
    return SimWorkload(tuple(trajs), f"bench agents {cfg.trajectories}x{cfg.turns}")


def build_workload(
    trace: Path | None,
    trajectories: int | None,
    turns: int | None,
    time_scale: float | None,
    token_scale: float | None,
    seed: int,
    fork_prob: float | None = None,
    fork_width: int | None = None,
) -> SimWorkload:
    if trace is not None:
        from agentkv.simulate.workload import from_trace
        from agentkv.traces import load_trace

        tw = load_trace(trace)
        if trajectories is not None:
            tw = tw.head(trajectories)
        tw = tw.scaled(
            token_scale if token_scale is not None else 1.0,
            time_scale if time_scale is not None else 1.0,
        )
        return from_trace(tw)
    from agentkv_bench.workload import WorkloadConfig

    cfg = WorkloadConfig(seed=seed).with_overrides(
        trajectories=trajectories,
        turns=turns,
        time_scale=time_scale,
        fork_prob=fork_prob,
        fork_width=fork_width,
    )
    return bench_workload(cfg, token_scale if token_scale is not None else BENCH_TOKEN_SCALE)
