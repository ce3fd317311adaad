"""Timers and leases: every deadline the manager keeps, in one heap, and the retained set.

Primitives:
  TimerKind          GRACE | LEASE | PREFETCH (per branch), JOB (per job), IDLE (per trajectory)
  Timer              (due, kind, ref, token): ``ref`` is (trajectory, branch), a job id or a
                     trajectory, held weakly (None once it is gone); ``token`` is the branch's
                     ``timer_token`` when armed
  TimerHeap.add      arm a timer (O(log n)); timers are never cancelled, they go stale
  TimerHeap.pop_due  the due timers in order, stale ones skipped (the caller says what is stale)
  TimerHeap.next_due seconds until the next live timer (None: none)
  TimerHeap.next_wake   seconds until the next live PREFETCH timer (None: none): the timer whose
                        firing hands the API server work (a device prefetch order), which the
                        pump must collect on time even while engine steps fire the others
  Leases.retain      a RETAINED branch under a lease: a LEASE timer plus the pressure candidates
  Leases.release     the branch left RETAINED (any state change, a delete)
  Leases.victims     which retained branches one pressure event demotes (policy.pressure_victims)

Why stale rather than cancelled: a branch's ``timer_token`` bumps on every state change, so a
timer armed for an old state is recognised and dropped when it comes up; per-step work stays
O(timers due), and idle branches are never visited. Why weakly: a stale timer stays in the heap
until its due time (an IDLE timer: idle_ttl_s, a day by default); holding its trajectory strongly
kept every deleted or evicted trajectory's context alive until then. A timer whose object is
gone is stale.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from agentkv.manager.state import Branch, Trajectory


class TimerKind(enum.StrEnum):
    GRACE = "grace"  # a HELD branch's grace period ends: the default action applies
    LEASE = "lease"  # a RETAINED branch's lease ends: it is demoted
    PREFETCH = "prefetch"  # an OFFLOADED branch's predicted return nears: disk -> host
    JOB = "job"  # a job not reported by every rank in job_timeout_s fails
    IDLE = "idle"  # a trajectory inactive for idle_ttl_s expires


BRANCH_TIMERS = frozenset({TimerKind.GRACE, TimerKind.LEASE, TimerKind.PREFETCH})
# Timers whose firing queues work only the API server's pump takes (device prefetch orders).
WAKE_TIMERS = frozenset({TimerKind.PREFETCH})


@dataclass(order=True)
class Timer:
    due: float
    seq: int
    kind: TimerKind = field(compare=False)
    held: Any = field(compare=False)  # a job id, or weak references (see ``ref``)
    token: int = field(compare=False, default=0)
    popped: bool = field(compare=False, default=False)  # left the heap (fired or dropped)

    @property
    def ref(self) -> Any:
        """The job id, trajectory or (trajectory, branch) armed for; None once gone."""
        if self.kind is TimerKind.JOB:
            return self.held
        if self.kind is TimerKind.IDLE:
            return self.held()
        traj, branch = self.held[0](), self.held[1]()
        return None if traj is None or branch is None else (traj, branch)


def _weakly(kind: TimerKind, ref: Any) -> Any:
    if kind is TimerKind.JOB:
        return ref
    if kind is TimerKind.IDLE:
        return weakref.ref(ref)
    return (weakref.ref(ref[0]), weakref.ref(ref[1]))


class TimerHeap:
    def __init__(self) -> None:
        self._heap: list[Timer] = []
        self._wake: list[Timer] = []  # the WAKE_TIMERS among them (the same objects)
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, due: float, kind: TimerKind, ref: Any, token: int = 0) -> None:
        timer = Timer(due, next(self._seq), kind, _weakly(kind, ref), token)
        heapq.heappush(self._heap, timer)
        if kind in WAKE_TIMERS:
            heapq.heappush(self._wake, timer)

    def pop_due(self, now: float, stale: Callable[[Timer], bool]) -> Iterator[Timer]:
        """Due live timers, earliest first. A timer a handler arms while iterating fires in the
        same call when it is already due."""
        while self._heap and self._heap[0].due <= now:
            t = heapq.heappop(self._heap)
            t.popped = True
            if t.ref is not None and not stale(t):
                yield t

    def next_due(self, now: float, stale: Callable[[Timer], bool]) -> float | None:
        while self._heap and (self._heap[0].ref is None or stale(self._heap[0])):
            heapq.heappop(self._heap).popped = True
        return max(0.0, self._heap[0].due - now) if self._heap else None

    def next_wake(self, now: float, stale: Callable[[Timer], bool]) -> float | None:
        """``next_due`` over WAKE_TIMERS only; a due one not fired yet answers 0."""
        wake = self._wake
        while wake and (wake[0].popped or wake[0].ref is None or stale(wake[0])):
            heapq.heappop(wake)
        return max(0.0, wake[0].due - now) if wake else None


def branch_timer_stale(t: Timer) -> bool:
    """A branch timer is stale once its trajectory is deleted or the branch changed state."""
    traj, branch = t.ref
    return bool(traj.deleted) or branch.timer_token != t.token


class Leases:
    """Retained branches: each holds its device blocks until its lease timer or a pressure
    event demotes it."""

    def __init__(self, timers: TimerHeap, max_lease_s: Callable[[], float]) -> None:
        self._timers = timers
        self._max_lease_s = max_lease_s
        self._retained: dict[tuple[int, str], tuple[Trajectory, Branch]] = {}

    def __len__(self) -> int:
        return len(self._retained)

    def retain(self, traj: Trajectory, branch: Branch, lease_s: float, now: float) -> None:
        branch.lease_until = now + max(0.0, min(lease_s, self._max_lease_s()))
        self._retained[(id(traj), branch.name)] = (traj, branch)
        self._timers.add(branch.lease_until, TimerKind.LEASE, (traj, branch), branch.timer_token)

    def release(self, traj: Trajectory, branch: Branch) -> None:
        self._retained.pop((id(traj), branch.name), None)

    def victims(
        self,
        excess_blocks: float,
        pick: Callable[[list[tuple[object, float, int]], float], list[object]],
    ) -> list[tuple[Trajectory, Branch]]:
        """Retained branches to demote for ``excess_blocks``: ``pick`` is the policy's
        ``pressure_victims`` over (handle, predicted return, pinned blocks)."""
        candidates: list[tuple[object, float, int]] = [
            ((t, b), b.predicted_return_at or b.lease_until, len(b.pinned))
            for t, b in self._retained.values()
        ]
        return [handle for handle in pick(candidates, excess_blocks)]  # type: ignore[misc]
