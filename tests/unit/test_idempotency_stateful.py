"""Idempotent control calls as a state machine: keyed and unkeyed pause, resume and DELETE of a
few trajectories under two tenants, reusing a small pool of keys (so retries, reuses with
another request and other tenants' same keys all happen), turns that re-create deleted
trajectories, tier jobs completing, and clock jumps past the window. The calls go through the
engine-side glue (``SchedulerSide.handle``) over a real manager on the simulated engine.

A model of the cache says, for each keyed call, what must happen:
  - a key seen in this tenant within the window, for the same request: the first answer again,
    marked replayed, and the manager is left exactly as it was (its /status view unchanged);
  - the same key for another request: 422, nothing applied;
  - otherwise the call is applied (as an unkeyed call would be) and its answer remembered
    unless it is a 5xx; at most ``MAX_KEYS`` are remembered, the oldest forgotten first.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, rule

from agentkv.idempotency import KEY_FIELD, ReplayCache
from tests.unit.sim_engine import make_rig

pytest.importorskip("vllm")

from agentkv_vllm.scheduler_side import REPLAYED_FIELD, SchedulerSide
from tests.unit.test_idempotency import _as_routes_see_it

WINDOW_S = 30.0
MAX_KEYS = 3
TRAJS = ["t1", "t2"]
SALTS = [None, "tenant-b"]
KEYS = ["k1", "k2", "k3", "k4"]
SYS = [7, 7, 7, 7, 9, 9, 9, 9]


def _view(side: Any) -> Any:
    """What a replay must leave untouched: the manager's whole status view, minus timings."""
    body = side.manager.status()
    body.pop("uptime_s", None)
    return body


class IdempotencyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rig = make_rig()
        side = SchedulerSide.__new__(SchedulerSide)
        side.manager = self.rig.mgr
        side.replays = ReplayCache(self.rig.clock.now, window_s=WINDOW_S, max_keys=MAX_KEYS)
        side._live = set()
        side._lease_until = OrderedDict()
        self.side = _as_routes_see_it(side)
        # (key, salt) -> (request, status, body, remembered at); insertion order = age
        self.model: dict[tuple[str, str | None], tuple[dict[str, Any], int, dict[str, Any], float]]
        self.model = {}

    def _expire(self) -> None:
        now = self.rig.clock.now()
        for scope, (_, _, _, at) in list(self.model.items()):
            if at + WINDOW_S <= now:
                del self.model[scope]

    @rule(traj=st.sampled_from(TRAJS), salt=st.sampled_from(SALTS), tail=st.integers(1, 3))
    def turn(self, traj: str, salt: str | None, tail: int) -> None:
        self.rig.run(self.rig.eng.new_request(traj, "main", [*SYS, int(traj == "t1"), *[tail] * 5]))
        if salt is not None:
            self.rig.run(self.rig.eng.new_request(traj, "main", [*SYS, 3, *[tail] * 5], salt=salt))

    @rule()
    def settle(self) -> None:
        self.rig.settle()

    @rule(dt=st.sampled_from([0.3, 1.0, 10.0, WINDOW_S]))
    def advance(self, dt: float) -> None:
        self.rig.clock.advance(dt)

    @rule(
        op=st.sampled_from(["pause", "resume", "end"]),
        traj=st.sampled_from(TRAJS),
        salt=st.sampled_from(SALTS),
        key=st.sampled_from([None, *KEYS]),
        wait=st.sampled_from([0.001, 1.0, 50.0]),
    )
    def call(self, op: str, traj: str, salt: str | None, key: str | None, wait: float) -> None:
        req: dict[str, Any] = {"op": op, "trajectory_id": traj}
        if op == "pause":
            req.update(tool="tool", expected_wait_s=wait)
        if salt is not None:
            req["cache_salt"] = salt
        if key is not None:
            req[KEY_FIELD] = key
        self.rig.mgr.tick()  # handle() ticks first: compare against the state it starts from
        self._expire()
        seen = self.model.get((key, salt)) if key is not None else None
        before = _view(self.side)
        status, body = self.side.handle(dict(req))
        if seen is not None:
            first, first_status, first_body, _ = seen
            if first == req:
                assert body.pop(REPLAYED_FIELD) is True
                assert (status, body) == (first_status, first_body)
            else:
                assert status == 422 and REPLAYED_FIELD not in body
            assert _view(self.side) == before, "a replay or a refused reuse changed the manager"
            assert len(self.side.replays) == len(self.model)
            return
        assert REPLAYED_FIELD not in body
        if key is None:
            return
        if status < 500:
            # A deep copy: a later change of the manager must not reach a remembered answer.
            self.model[(key, salt)] = (
                req,
                status,
                json.loads(json.dumps(body)),
                self.rig.clock.now(),
            )
            while len(self.model) > MAX_KEYS:
                del self.model[next(iter(self.model))]
        assert len(self.side.replays) == len(self.model)


IdempotencyMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIdempotencyStateful = IdempotencyMachine.TestCase
