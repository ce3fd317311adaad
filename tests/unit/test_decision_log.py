"""The server log's line per pause decision (issue 42): one compact INFO line with the
trajectory, tool, predicted wait, action and why; a burst past the rate limit is counted and
said by the next line, never a flood."""

from __future__ import annotations

import logging

import pytest

from agentkv.manager import decision_log
from tests.unit.sim_engine import make_rig


def test_each_pause_decision_is_one_info_line_and_a_burst_is_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="agentkv.decisions")
    rig = make_rig()
    rig.run(rig.eng.new_request("t1", "main", list(range(1, 18)), max_new=0, salt="tenant-a"))
    burst = decision_log.MAX_PER_WINDOW + 5
    for _ in range(burst):
        assert rig.mgr.pause("t1", "main", "pytest", 5.0, tenant="tenant-a")[0] == 200

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "agentkv.decisions"]

    got = lines()
    assert len(got) == decision_log.MAX_PER_WINDOW
    action = rig.mgr.get("t1", tenant="tenant-a")[1]["branches"]["main"]["decision"]["action"]
    # The client's id (never the tenant-scoped table key), the tool, the wait, action, why.
    assert got[0].startswith("agentkv: pause t1/main tool=pytest predicted_wait=5s (declared)")
    assert f"-> {action}; why: {action}: " in got[0] and "\x00" not in got[0]
    assert all(r.levelno == logging.INFO for r in caplog.records)

    rig.clock.advance(decision_log.WINDOW_S)
    rig.mgr.pause("t1", "main", "pytest", 5.0, tenant="tenant-a")
    assert len(lines()) == decision_log.MAX_PER_WINDOW + 1
    assert lines()[-1].endswith("(5 earlier decisions not logged: rate limit)")
