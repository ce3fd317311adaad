"""What the plugin does around a pause, in the simulator: deferred write-backs (the connector's
``writeback: forecast``), the grace period, forks. Small hand-made traces with numbers derived
by hand (the built-in engine: blocks of 128 tokens, 1,572,864 bytes each)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agentkv.policy import Writeback
from agentkv.simulate.costs import BENCH_SMALL_CPU
from agentkv.simulate.fleet import FleetConfig, simulate
from agentkv.simulate.metrics import Summary
from agentkv.simulate.workload import SimTrajectory, SimTurn, SimWorkload

BB = BENCH_SMALL_CPU.block_bytes()
BT = BENCH_SMALL_CPU.block_tokens

# -- write-back: forecast vs eager ----------------------------------------------------------------

# One trajectory: a 2,000-token task answered in 16 tokens, then a 30 s tool wait the harness
# declares (p90 60 s: past retain's break-even, so agentkv decides offload_host). Its 2,016
# cacheable tokens are 15 full blocks.
_A = (SimTurn(0, 2000, 16), SimTurn(2016, 100, 16, 30.0, "t", 30.0))
_A_BLOCKS = 2016 // BT


def _run(wl: SimWorkload, writeback: Writeback) -> Summary:
    cfg = FleetConfig(policy="agentkv", num_blocks=96, writeback=writeback)
    return simulate(wl, cfg).summary


def test_a_forecast_write_back_is_never_made_when_the_pool_keeps_the_blocks() -> None:
    wl = SimWorkload((SimTrajectory("a", 0.0, _A),))
    eager = _run(wl, Writeback.EAGER)
    forecast = _run(wl, Writeback.FORECAST)
    assert eager.decisions == forecast.decisions == {"offload_host": 1}
    # Eager copies the 15 blocks at the pause; the forecast (nothing else writes: eviction
    # never) leaves them in vLLM's cache, where the resume finds them.
    assert eager.tier_bytes_written == _A_BLOCKS * BB
    assert forecast.tier_bytes_written == 0
    assert forecast.writebacks == {"deferred": 1}
    assert eager.cached_tokens == forecast.cached_tokens == _A_BLOCKS * BT


@pytest.mark.parametrize("shared_prefix", [0, 512], ids=["private", "shared-prefix"])
def test_a_burst_gets_the_copy_in_time_when_the_forecast_counted_right(shared_prefix: int) -> None:
    """At t=20 s an 11,000-token prompt (86 blocks) arrives while a's 15 blocks wait in the LRU
    of a 95-block pool behind 80 empty ones (a's forecast: evicted after 80 more blocks are
    written). vLLM writes it 16 blocks (a 2,048-token chunk) per step; the manager's tick
    before the sixth chunk finds the eviction due and copies all 15 before any is overwritten:
    6 of them are then evicted and come back from host, as with eager.

    With a's first 512 tokens (4 blocks) shared with its group, its request frees them after
    its 11 private blocks (tail first), so they sit behind those in the LRU. The simulator
    counted them ahead of a (the tick came 4 blocks late and all 11 were lost), measured a
    copy's losses against the whole context (every copy lost the prefix) and copied only the
    private blocks (the resume recomputed the prefix eager had copied)."""
    a = SimTrajectory("a", 0.0, _A, shared_prefix_tokens=shared_prefix, prefix_group="g")
    wl = SimWorkload((a, SimTrajectory("b", 20.0, (SimTurn(0, 11000, 8),))))
    eager = _run(wl, Writeback.EAGER)
    forecast = _run(wl, Writeback.FORECAST)
    assert forecast.writebacks == {"deferred": 1, "copied": 1}
    assert forecast.tier_bytes_written == eager.tier_bytes_written == 15 * BB
    assert eager.tier_hit_tokens == forecast.tier_hit_tokens == 6 * BT
    assert eager.cached_tokens == forecast.cached_tokens == 15 * BT


def test_a_forecast_that_counted_reused_blocks_is_late_and_loses_the_rest() -> None:
    """c (7 cached blocks) pauses before a, so a's forecast counts c's blocks ahead of it: 80
    blocks (73 empty + 7). c's resume takes them (a hit writes nothing) and frees its 8 behind
    a; 2 fresh blocks were written. When b's 86 blocks come, 72 empty blocks are really ahead
    of a, the forecast still says 78: the tick before the sixth chunk (80 written) is the
    first to find it due, after 8 of a's 15 blocks were overwritten. 7 are copied, 8 lost;
    b evicts 14 of a's, so a's resume finds 1 on the device and 6 on host (eager: 14).
    a declares 15 s (p90 30 s): with _A's 30 s (p90 60 s) its forecast, c's prefill rate over
    80 blocks, is less than twice the p90 and the copy is made at the pause."""
    c = (SimTurn(0, 1000, 16), SimTurn(1016, 100, 16, 6.0, "t", 6.0))
    a = (_A[0], replace(_A[1], expected_wait_s=15.0))
    wl = SimWorkload(
        (
            SimTrajectory("c", 0.0, c),
            SimTrajectory("a", 1.0, a),
            SimTrajectory("b", 20.0, (SimTurn(0, 11000, 8),)),
        )
    )
    eager = _run(wl, Writeback.EAGER)
    forecast = _run(wl, Writeback.FORECAST)
    assert forecast.writebacks == {"deferred": 2, "copied": 1, "lost_blocks": 8}
    assert eager.tier_bytes_written == (7 + 15) * BB  # c and a, at their pauses
    assert forecast.tier_bytes_written == 7 * BB  # c's copy never needed: it resumed first
    assert eager.tier_hit_tokens == 14 * BT and forecast.tier_hit_tokens == 6 * BT
    # c's resume hits its 7 blocks in both; a's: 1 + 14 (eager), 1 + 6 (forecast).
    assert eager.cached_tokens == (7 + 15) * BT and forecast.cached_tokens == (7 + 7) * BT


def test_the_default_is_the_connectors_forecast() -> None:
    assert FleetConfig().writeback is Writeback.FORECAST
    # Vanilla never defers (nothing to defer): the mode changes nothing for it.
    wl = SimWorkload((SimTrajectory("a", 0.0, _A),))
    cfg = FleetConfig(policy="vanilla", num_blocks=96)
    assert simulate(wl, cfg).summary.to_dict() == (
        simulate(wl, replace(cfg, writeback=Writeback.EAGER)).summary.to_dict()
    )


# -- the grace period ------------------------------------------------------------------------


def _grace(wait_s: float, pause_after_s: float | None, grace_s: float = 0.5) -> Summary:
    """Trajectory a with a ``wait_s`` tool wait, declared 30 s (agentkv decides offload_host),
    on a pool nothing else uses; write-backs eager so that every decision's copy shows."""
    turns = (_A[0], SimTurn(2016, 100, 16, wait_s, "t", 30.0))
    wl = SimWorkload((SimTrajectory("a", 0.0, turns),))
    cfg = FleetConfig(
        policy="agentkv",
        num_blocks=96,
        writeback=Writeback.EAGER,
        grace_s=grace_s,
        pause_after_s=pause_after_s,
    )
    return simulate(wl, cfg).summary


def test_a_resume_within_the_grace_takes_the_held_blocks_and_nothing_is_copied() -> None:
    held = _grace(0.2, None)  # the harness never pauses; the next turn comes after 0.2 s
    assert held.decisions == {} and held.tier_bytes_written == 0 and held.demotions == 0
    assert held.cached_tokens == _A_BLOCKS * BT
    # No grace: the connector's default action (offload_host) applies when the turn ends.
    none = _grace(0.2, None, grace_s=0.0)
    assert none.decisions == {"grace_expired": 1} and none.tier_bytes_written == _A_BLOCKS * BB


def test_without_a_pause_the_grace_ends_in_the_default_action() -> None:
    s = _grace(1.0, None)
    assert s.decisions == {"grace_expired": 1} and s.demotions == 1
    assert s.tier_bytes_written == _A_BLOCKS * BB
    assert s.cached_tokens == _A_BLOCKS * BT  # the copy left the blocks cached: a device hit


def test_under_the_forecast_a_grace_without_a_pause_defers_its_copy_as_the_plugin_does() -> None:
    """The manager's Transitions.default_action: a grace that ends with no pause leaves the
    blocks in vLLM's cache; the copy waits for the eviction forecast (none here), and the
    resume finds them on the device."""
    turns = (_A[0], SimTurn(2016, 100, 16, 1.0, "t", 30.0))
    cfg = FleetConfig(
        policy="agentkv", num_blocks=96, writeback=Writeback.FORECAST, pause_after_s=None
    )
    s = simulate(SimWorkload((SimTrajectory("a", 0.0, turns),)), cfg).summary
    assert s.decisions == {"grace_expired": 1} and s.writebacks == {"deferred": 1}
    assert s.tier_bytes_written == 0 and s.cached_tokens == _A_BLOCKS * BT
    # A burst after the grace (b's 86 blocks, as in the forecast test above): copied in time.
    wl = SimWorkload(
        (SimTrajectory("a", 0.0, _A), SimTrajectory("b", 20.0, (SimTurn(0, 11000, 8),)))
    )
    burst = simulate(wl, cfg).summary
    assert burst.writebacks == {"deferred": 1, "copied": 1}
    assert burst.tier_bytes_written == 15 * BB and burst.tier_hit_tokens == 6 * BT


def test_a_pause_within_the_grace_decides_and_a_late_one_still_applies() -> None:
    within = _grace(5.0, 0.3)
    assert within.decisions == {"offload_host": 1} and within.demotions == 0
    assert within.tier_bytes_written == _A_BLOCKS * BB
    late = _grace(5.0, 2.0)  # the grace ended first (copied), then the pause decides again
    assert late.decisions == {"grace_expired": 1, "offload_host": 1}
    assert late.tier_bytes_written == _A_BLOCKS * BB  # content addressed: copied once
    # At once (the bench's harness, the default): the grace changes nothing.
    assert _grace(5.0, 0.0).to_dict() == _grace(5.0, 0.0, grace_s=0.0).to_dict()


def _held_then(prompt: int) -> Summary:
    """a's blocks are HELD (the harness never pauses; a 5 s grace) when b arrives at t=5 s with
    ``prompt`` tokens, on a 95-block pool where a holds 15."""
    wl = SimWorkload(
        (SimTrajectory("a", 0.0, _A), SimTrajectory("b", 5.0, (SimTurn(0, prompt, 8),)))
    )
    cfg = FleetConfig(
        policy="agentkv",
        num_blocks=96,
        writeback=Writeback.EAGER,
        grace_s=5.0,
        pause_after_s=None,
    )
    return simulate(wl, cfg).summary


def test_a_blocked_queue_ends_a_grace_early_but_high_water_alone_does_not() -> None:
    # b needs 80 blocks, the 80 empty ones: it fits, and use reaches 95/95, over high water
    # (0.88); the manager demotes retained branches there, never grace pins: a's grace runs out.
    high = _held_then(10232)
    assert high.decisions == {"grace_expired": 1} and high.demotions == 1
    # b needs 86: the queue is short of 6 blocks, so the held pin ends early with the default
    # action (a copy to host), no grace_expired; b then evicts 6 of a's 15 blocks, which a's
    # resume reloads from host.
    short = _held_then(11000)
    assert short.decisions == {} and short.demotions == 1
    assert short.tier_bytes_written == _A_BLOCKS * BB and short.tier_hit_tokens == 6 * BT


# -- forks ---------------------------------------------------------------------------------------


def _forked(num_blocks: int) -> Summary:
    """Turn 1 caches 15 blocks (2,016 tokens); turn 2 forks into two branches with 200 and 300
    tokens of their own after the turn's 100 (prompts 2,316 and 2,416: 19 blocks each with
    their 16-token answers); turn 3 continues the first branch (2,332 + 50 tokens)."""
    turns = (
        SimTurn(0, 2000, 16),
        SimTurn(2016, 100, 16, 1.0, "t", 1.0, branches=(200, 300)),
        SimTurn(2316 + 16, 50, 16, 1.0, "t", 1.0),
    )
    wl = SimWorkload((SimTrajectory("a", 0.0, turns),))
    return simulate(wl, FleetConfig(policy="vanilla", num_blocks=num_blocks)).summary


def test_a_forks_branches_share_the_history_blocks_and_the_first_continues() -> None:
    # 24 usable blocks: the two branches hold 15 shared + 4 + 4 (their own 19 - 15 each), so
    # both run without evicting anything; without sharing they would need 15 + 4 + 19 = 38.
    s = _forked(25)
    assert s.turns == 4 and s.resume_turns == 3 and s.rejected_turns == 0
    assert s.evicted_blocks == 0
    # Each branch hits the 15 history blocks; turn 3 hits the first branch's 18 full blocks.
    assert s.cached_tokens == 15 * BT + 15 * BT + 18 * BT
    assert s.prompt_tokens == 2000 + 2316 + 2416 + 2382


def test_the_bench_adapter_forks_as_the_bench_harness_does() -> None:
    from agentkv.cli.simulate_workload import bench_workload
    from agentkv_bench.workload import WorkloadConfig, generate

    cfg = WorkloadConfig(trajectories=2, turns=3, fork_prob=1.0, fork_width=3)
    wl = bench_workload(cfg, token_scale=1.0)
    plan = generate(cfg)
    assert wl.turns == 2 * (1 + 2 * 3)
    for t, p in zip(wl.trajectories, plan.trajectories, strict=True):
        for u, pu in zip(t.turns[1:], p.turns[1:], strict=True):
            half = max(cfg.obs_min_tokens, pu.observation_tokens // 2)
            assert u.branches == (half,) * 3 and u.input_tokens == pu.observation_tokens
        # The next turn's context is the first branch's prompt plus the scripted reply.
        assert t.turns[2].context_tokens == t.turns[1].prompt_tokens + cfg.action_tokens
    # No forks asked for: the plan is the one without forks (no extra draws).
    plain = bench_workload(WorkloadConfig(trajectories=2, turns=3), token_scale=1.0)
    assert all(not u.branches for t in plain.trajectories for u in t.turns)


def test_a_resume_keeps_the_deferred_contexts_ahead_of_it_in_place() -> None:
    """The manager's rule (agentkv.manager.writeback), on the simulator's books: b resumes
    with 4 of its blocks hit; a, ahead of it in the LRU, keeps its distance to eviction (its
    due moves with the fill the hit adds), c behind it moves up."""
    from agentkv.admission import FreeQueuePlaces
    from agentkv.simulate.writeback import WritebackMixin

    w = WritebackMixin()
    w._wb_due = {"a": 10.0, "b": 20.0, "c": 30.0}
    w._wb_token = {"a": 1, "b": 2, "c": 3}
    w._wb_resume_by = {}
    w._wb_want = {}
    w._wb_heap = [(10.0, 1, "a"), (20.0, 2, "b"), (30.0, 3, "c")]
    w._wb_place = FreeQueuePlaces()
    for tid, due in w._wb_due.items():
        w._wb_place.place(tid, due, 4)
    w._writeback_resumed("b", 4)
    assert w._wb_due == {"a": 14.0, "c": 30.0}
    assert sorted(w._wb_heap) == [(14.0, 1, "a"), (20.0, 2, "b"), (30.0, 3, "c")]
    assert "b" not in w._wb_token
    assert w._wb_place.places == {"a": (14.0, 4), "c": (30.0, 4)}
    assert w._wb_place.take_hits(10.0) == 4  # its hit is not fill
    w._writeback_resumed("a", 0)  # nothing of its own was hit: nobody moves
    assert w._wb_due == {"c": 30.0}
