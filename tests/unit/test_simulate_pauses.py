"""What the plugin does around a pause, in the simulator: deferred write-backs (the connector's
``writeback: forecast``), the grace period, forks. Small hand-made traces with numbers derived
by hand (the built-in engine: blocks of 128 tokens, 1,572,864 bytes each)."""

from __future__ import annotations

from dataclasses import replace

from agentkv.simulate.costs import BENCH_SMALL_CPU
from agentkv.simulate.fleet import FleetConfig, simulate
from agentkv.simulate.metrics import Summary
from agentkv.simulate.workload import SimTrajectory, SimTurn, SimWorkload
from agentkv.simulate.writeback import Writeback

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


def test_a_burst_evicts_part_of_a_deferred_copy_before_it_is_made() -> None:
    """At t=20 s an 11,000-token prompt (86 blocks) arrives while a's 15 blocks wait in the LRU
    of a 95-block pool: 80 are empty, so 6 of a's (its tail) are evicted at admission, faster
    than the trend forecast. The forecast then copies the 9 that survive; a's resume hits those
    9 on the device and recomputes 6. Eager had copied all 15: the 6 come back from host."""
    wl = SimWorkload(
        (SimTrajectory("a", 0.0, _A), SimTrajectory("b", 20.0, (SimTurn(0, 11000, 8),)))
    )
    eager = _run(wl, Writeback.EAGER)
    forecast = _run(wl, Writeback.FORECAST)
    assert forecast.writebacks == {"deferred": 1, "copied": 1, "lost_blocks": 6}
    assert forecast.tier_bytes_written == 9 * BB
    assert eager.tier_bytes_written == 15 * BB
    assert eager.tier_hit_tokens == 6 * BT and forecast.tier_hit_tokens == 0
    assert eager.cached_tokens == 15 * BT and forecast.cached_tokens == 9 * BT
    assert forecast.resume_recomputed_tokens - eager.resume_recomputed_tokens == 6 * BT


def test_the_default_is_the_connectors_forecast() -> None:
    assert FleetConfig().writeback is Writeback.FORECAST
    # Vanilla never defers (nothing to defer): the mode changes nothing for it.
    wl = SimWorkload((SimTrajectory("a", 0.0, _A),))
    cfg = FleetConfig(policy="vanilla", num_blocks=96)
    assert simulate(wl, cfg).summary.to_dict() == (
        simulate(wl, replace(cfg, writeback=Writeback.EAGER)).summary.to_dict()
    )
