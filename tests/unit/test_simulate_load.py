"""agentkv.simulate.load: the offered load of a workload, before simulating it."""

from __future__ import annotations

from agentkv.simulate.costs import BENCH_SMALL_CPU
from agentkv.simulate.load import max_batch, offered_load, trajectory_work, turn_work_s
from agentkv.simulate.workload import SimTrajectory, SimTurn, SimWorkload

C = BENCH_SMALL_CPU


def _traj(i: int, start: float, wait: float = 10.0) -> SimTrajectory:
    turns = [SimTurn(0, 2000, 20)]
    for _ in range(4):
        turns.append(SimTurn(turns[-1].prompt_tokens, 300, 20, wait_before_s=wait))
    return SimTrajectory(f"t{i}", start, tuple(turns))


def test_cached_tokens_and_fuller_batches_cost_less() -> None:
    turn = SimTurn(4096, 256, 32)
    assert turn_work_s(C, turn, 4096, 1) < turn_work_s(C, turn, 0, 1)
    assert turn_work_s(C, turn, 4096, 8) < turn_work_s(C, turn, 4096, 1)
    assert max_batch(C, 128, 4096) == 4 and max_batch(C, 128, 100_000) == 1


def test_work_counts_every_history_cached_and_the_duration_counts_the_waits() -> None:
    t = _traj(0, 0.0)
    work, alone = trajectory_work(C, 128, t)
    assert alone > 40.0 + work * 0.9  # four waits of 10 s plus about the work
    # The resumes prefill only their 300 new tokens (plus the unfull tail block).
    first = turn_work_s(C, t.turns[0], 0, 1)
    assert work < first * 3


def test_a_light_load_is_not_overloaded_and_a_heavy_one_names_the_fleet_that_carries_it() -> None:
    light = SimWorkload(tuple(_traj(i, i * 60.0) for i in range(20)))
    ol = offered_load(light, C, 128, 1)
    assert not ol.overloaded and ol.warning() is None and ol.min_replicas == 1
    heavy = SimWorkload(tuple(_traj(i, 0.0) for i in range(400)))
    ol = offered_load(heavy, C, 128, 2)
    assert ol.overloaded and ol.unbounded and ol.horizon_s() is not None
    assert f"{ol.min_replicas} replicas" in (ol.warning() or "")
    carried = offered_load(heavy, C, 128, ol.min_replicas)
    assert not carried.overloaded
    assert offered_load(heavy, C, 128, ol.min_replicas - 1).overloaded


def test_the_peak_follows_the_busiest_stretch_not_the_mean() -> None:
    # Ten trajectories together, then a long quiet gap, then one more.
    burst = [_traj(i, 0.0) for i in range(10)] + [_traj(99, 5000.0)]
    ol = offered_load(SimWorkload(tuple(burst)), C, 128, 1)
    assert ol.utilization > 3 * ol.mean_utilization
