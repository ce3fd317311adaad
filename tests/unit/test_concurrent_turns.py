"""Concurrent turns of one branch (issue 42): a client-level session id shared by several runs
merges them into one trajectory; a request looked up while another request of its branch still
runs is flagged in its turn's stats, counted, and warned about once per trajectory."""

from __future__ import annotations

import logging

import pytest

from agentkv import metrics as m
from tests.unit.sim_engine import make_rig

PROMPT = list(range(1, 18))


def _start(rig, traj: str, prompt: list[int]):  # type: ignore[no-untyped-def]
    req = rig.eng.new_request(traj, "main", prompt, max_new=0)
    assert rig.eng.schedule(req)
    rig.eng.step()
    rig.eng.compute(req)
    return req


def test_overlapping_requests_of_one_branch_are_flagged_counted_and_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = make_rig()
    caplog.set_level(logging.WARNING, logger="agentkv.manager")
    first = _start(rig, "shared", PROMPT)
    second = _start(rig, "shared", [*PROMPT[:-1], 99])
    third = _start(rig, "shared", [*PROMPT, 7])
    s1 = rig.eng.finish(first)
    s2 = rig.eng.finish(second)
    s3 = rig.eng.finish(third)
    assert s1 is not None and s2 is not None and s3 is not None
    # The first ran alone when it was looked up; the others each found 1, then 2, running.
    assert "concurrent_turns" not in s1
    assert s2["concurrent_turns"] == 1 and s3["concurrent_turns"] == 2
    assert "per run" in s2["warning"]
    assert rig.mgr.status()["counters"]["concurrent_turns"] == 2
    assert m.counter_value(rig.mgr.metrics.snapshot(), m.CONCURRENT_TURNS.name) == 2
    warned = [r for r in caplog.records if "concurrent" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
    assert "shared" in warned[0].getMessage()


def test_sequential_requests_of_one_branch_are_not_flagged() -> None:
    rig = make_rig()
    for i in range(3):
        req = rig.turn("seq", PROMPT + list(range(100, 100 + 4 * i)))
        assert req.stats is not None and "concurrent_turns" not in req.stats
    # Two branches of one trajectory running at once are forks, not a merge.
    a = _start(rig, "seq", PROMPT)
    b = rig.eng.new_request("seq", "fork", PROMPT, max_new=0)
    assert rig.eng.schedule(b)
    rig.eng.step()
    rig.eng.compute(b)
    assert "concurrent_turns" not in (rig.eng.finish(a) or {})
    assert "concurrent_turns" not in (rig.eng.finish(b) or {})
    assert rig.mgr.status()["counters"]["concurrent_turns"] == 0
