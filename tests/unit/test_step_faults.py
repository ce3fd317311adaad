"""A fault in the scheduler side's step building still ships the step's jobs (issue 40, item 3).

The manager's outbox holds jobs vLLM was promised in this very step: a layerwise load runs in
this step's forward, a preemption save reads blocks vLLM may reallocate right after it. So a
fault in ``build_step`` before ``take_step`` (the step sample, the preemption notes, the
admission picture) must not ship an empty plan and leave them for a later step; the real
SchedulerSide over a real manager, a fault injected at each part.
"""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import pytest

pytest.importorskip("vllm")

from agentkv_vllm.connector import AgentKVConnector
from agentkv_vllm.scheduler_side import SchedulerSide
from agentkv_vllm.settings import ConnectorSettings
from tests.unit.test_engine_config import BLOCK, _vllm_config


def _scheduler() -> tuple[AgentKVConnector, SchedulerSide]:
    side = SchedulerSide(*_vllm_config("cpu"), ConnectorSettings())
    side.block_pool = NS(get_num_free_blocks=lambda: 200, get_usage=lambda: 0.1, num_gpu_blocks=257)
    # The scheduler role without vLLM's process setup: only what build_connector_meta reads.
    conn = object.__new__(AgentKVConnector)
    conn._scheduler = side
    conn._emergency_loads = []
    return conn, side


def _output() -> Any:
    return NS(num_scheduled_tokens={"r1": 2 * BLOCK}, scheduled_new_reqs=[], preempted_req_ids=())


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected scheduler fault")


@pytest.mark.parametrize(
    "part", ["_sample_step", "_save_preempted", "admission_of", "set_admission", "drain_doomed"]
)
def test_a_fault_while_building_the_step_still_ships_its_loads(
    part: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn, side = _scheduler()
    # vLLM counted external tokens the manager cannot serve (an unknown request): it queued a
    # load every rank fails, due in this step.
    side.manager.on_alloc("r1", [3, 4], 2 * BLOCK)
    [queued] = side.manager.outbox.loads
    if part == "set_admission":
        monkeypatch.setattr(side.manager, "set_admission", _raise)
    elif part == "drain_doomed":  # inside take_step, past its own guard
        monkeypatch.setattr(side.manager.transitions, "drain_doomed", _raise)
    else:
        monkeypatch.setattr(side, part, _raise)
    meta = conn.build_connector_meta(_output())
    assert queued in meta.plan.loads, "the step's load was left for a later step"
    assert not side.manager.outbox, "a job stayed behind to go out with another step"
    assert side.status()["counters"]["step_faults"] == 1
    monkeypatch.undo()
    assert not conn.build_connector_meta(_output()).plan.loads  # shipped once
