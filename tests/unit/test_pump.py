"""The timer pump backs off while the engine steps (issue 26), but never past a PREFETCH timer,
whose order only a tick collects: the rule as pure logic, the heap's PREFETCH view, and the
manager's answer on the simulated engine."""

from __future__ import annotations

from typing import Any

import pytest

from agentkv.manager.timers import TimerHeap, TimerKind
from agentkv_vllm.pump import PUMP_MAX_S, PUMP_MIN_S, pump_delay
from tests.unit.sim_engine import make_rig
from tests.unit.test_device_prefetch import _offloaded
from tests.unit.test_manager import branch


def _tick(steps: int | None, next_in: float | None, prefetch_in: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {"next_in_s": next_in, "prefetch_in_s": prefetch_in}
    if steps is not None:
        body["steps"] = steps
    return body


@pytest.mark.parametrize(
    ("body", "last_steps", "delay"),
    [
        # An idle engine (no step since the last tick): the pump fires the next timer itself.
        (_tick(7, 0.05, None), 7, 0.05),
        (_tick(7, 0.05, 0.5), 7, 0.05),
        # A stepping engine fires grace, lease and job timers: the pump waits the longest...
        (_tick(9, 0.05, None), 7, PUMP_MAX_S),
        # ... but comes back when a PREFETCH timer is due: its order waits for a tick.
        (_tick(9, 0.05, 0.08), 7, 0.08),
        (_tick(9, 0.01, 0.0), 7, PUMP_MIN_S),
        # The first tick, or an engine that does not say its steps: as idle.
        (_tick(9, 0.05, None), None, 0.05),
        (_tick(None, 0.05, None), 7, 0.05),
        # Clamped to PUMP_MIN_S..PUMP_MAX_S; no timer at all: PUMP_MAX_S.
        (_tick(7, 0.0, None), 7, PUMP_MIN_S),
        (_tick(7, 30.0, None), 7, PUMP_MAX_S),
        (_tick(7, None, None), 7, PUMP_MAX_S),
    ],
)
def test_pump_delay(body: dict[str, Any], last_steps: int | None, delay: float) -> None:
    assert pump_delay(body, last_steps) == pytest.approx(delay)


def _never_stale(_t: Any) -> bool:
    return False


class _Ref:
    """A weakly referenceable trajectory / branch stand-in."""


def test_the_heap_answers_the_next_prefetch_timer_past_earlier_timers() -> None:
    heap = TimerHeap()
    t, b = _Ref(), _Ref()
    heap.add(1.0, TimerKind.GRACE, (t, b))
    heap.add(5.0, TimerKind.PREFETCH, (t, b))
    heap.add(9.0, TimerKind.PREFETCH, (t, b))
    assert heap.next_due(0.0, _never_stale) == 1.0
    assert heap.next_wake(0.0, _never_stale) == 5.0
    # Due but not fired yet (no step, no tick since): 0, never skipped.
    assert heap.next_wake(6.0, _never_stale) == 0.0
    assert [x.kind for x in heap.pop_due(6.0, _never_stale)] == [
        TimerKind.GRACE,
        TimerKind.PREFETCH,
    ]
    assert heap.next_wake(6.0, _never_stale) == 3.0
    # A timer armed already due after a firing (a step at a later clock) still answers 0.
    heap.add(2.0, TimerKind.PREFETCH, (t, b))
    assert heap.next_wake(6.0, _never_stale) == 0.0
    list(heap.pop_due(10.0, _never_stale))
    assert heap.next_wake(10.0, _never_stale) is None


def test_a_stale_or_dead_prefetch_timer_is_not_waited_for() -> None:
    heap = TimerHeap()
    t, b, gone = _Ref(), _Ref(), _Ref()
    heap.add(3.0, TimerKind.PREFETCH, (t, gone))
    del gone  # its branch is gone: the timer is dead
    heap.add(4.0, TimerKind.PREFETCH, (t, b), token=1)
    heap.add(8.0, TimerKind.PREFETCH, (t, b), token=2)
    assert heap.next_wake(0.0, lambda x: x.token == 1) == 8.0


def test_the_manager_says_when_the_prefetch_order_comes_and_a_step_queues_it() -> None:
    """An offloaded branch's PREFETCH timer is what the tick reports, even with earlier timers;
    an engine step fires it, and the order then waits in the queue the tick takes."""
    rig = make_rig(device_prefetch=True)
    _offloaded(rig)
    due = branch(rig).prefetch_due
    assert due is not None
    assert rig.mgr.next_prefetch_due() == pytest.approx(due - rig.clock.t)
    rig.clock.t = due + 0.01
    assert rig.mgr.next_prefetch_due() == 0.0  # due, not yet fired
    rig.mgr.take_step()  # the engine's step fires it
    assert rig.mgr.next_prefetch_due() is None
    orders, _ = rig.mgr.take_prefetch_work()
    assert [o.trajectory_id for o in orders] == ["t1"]
