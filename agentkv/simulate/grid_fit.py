"""The built-in calibration's two fitted constants, re-derived from the run they were fitted to.

Primitives:
  RATE_GRID, OVERHEAD_GRID  the grid: FLOP rates 2.3e11-3.0e11 by 0.1e11, step overheads
                            20-100 ms by 10 ms (docs/simulate.md, "The built-in calibration")
  FIT_METRICS               what the fit compares: the validation's rows (metrics.COMPARED)
                            plus decode tokens/s per sequence, the one measurement the step
                            overhead sets on its own
  GridPoint                 one (rate, overhead): the largest |relative error| and its row
  grid_fit(workload, measured, base, fleet, rates, overheads) -> [GridPoint], best first

The measured run is a bench run of both policies (``validate.load_measured``); every grid
point simulates both with ``base`` changed in those two constants only, and is scored by the
largest relative error over ``FIT_METRICS`` of vanilla, agentkv and their ratio (the rows
``tests/unit/test_simulate_validation.py`` bounds at 25%, so the fit minimizes what that test
checks). The grid is the one the constants were first set on; the surface is a flat ridge (a
faster FLOP rate trades against a longer step), so the ranking matters more than the step.
The caller builds the workload (the bench's generator lives outside the core: ``agentkv
simulate fit-builtin``).

Contract: raises ConfigError when the measured run has none of FIT_METRICS for both policies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agentkv.errors import ConfigError
from agentkv.simulate.costs import EngineCosts
from agentkv.simulate.fleet import FleetConfig, simulate
from agentkv.simulate.metrics import COMPARED
from agentkv.simulate.validate import Row, compare
from agentkv.simulate.workload import SimWorkload

RATE_GRID: tuple[float, ...] = tuple(r * 1e10 for r in range(23, 31))
OVERHEAD_GRID: tuple[float, ...] = tuple(ms / 1000 for ms in range(20, 101, 10))
FIT_METRICS: tuple[str, ...] = (*COMPARED, "decode_tok_s")
POLICIES = ("vanilla", "agentkv")


@dataclass(frozen=True)
class GridPoint:
    prefill_flops_per_s: float
    step_overhead_s: float
    max_error: float
    """The largest |relative error| over the compared rows."""
    worst: Row
    rows: tuple[Row, ...]


def _score(rate: float, overhead: float, rows: list[Row]) -> GridPoint:
    scored = [r for r in rows if r.rel_error is not None]
    if not scored:
        raise ConfigError(f"the measured run has none of {', '.join(FIT_METRICS)} to fit on")
    worst = max(scored, key=lambda r: abs(r.rel_error or 0.0))
    return GridPoint(rate, overhead, abs(worst.rel_error or 0.0), worst, tuple(rows))


def grid_fit(
    workload: SimWorkload,
    measured: Mapping[str, Mapping[str, Any]],
    base: EngineCosts,
    fleet: FleetConfig,
    rates: Sequence[float] = RATE_GRID,
    overheads: Sequence[float] = OVERHEAD_GRID,
) -> list[GridPoint]:
    """Every (rate, overhead) of the grid scored against ``measured`` (configs by policy),
    best first (ties: the lower rate, then the shorter step). ``fleet`` gives the run's setup
    (pool, tiers, write-back); its policy and costs are replaced."""
    points: list[GridPoint] = []
    for rate in rates:
        for overhead in overheads:
            costs = replace(base, prefill_flops_per_s=rate, step_overhead_s=overhead)
            simulated = {
                p: simulate(workload, replace(fleet, policy=p, costs=costs)).summary.to_dict()
                for p in POLICIES
            }
            rows = compare(simulated, measured, FIT_METRICS, tolerance=0.25)
            points.append(_score(rate, overhead, rows))
    points.sort(key=lambda p: (p.max_error, p.prefill_flops_per_s, p.step_overhead_s))
    return points
