"""A step with no agentkv job costs vLLM as little as the connector can make it (issue 26: a
plain request must cost what it costs in vanilla vLLM).

Most steps carry no job: plain traffic, or trajectories that are only decoding. Such a step's
metadata pickles to a reference instead of the dataclass tree (the executor pickles it to every
worker each step), and the worker binds nothing, so vLLM's attention layers skip the connector's
per-layer hooks (they run only while ``has_connector_metadata()``)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

pytest.importorskip("vllm")

from agentkv.manager.jobs import BlockTransfer, LoadJob, StepPlan
from agentkv_vllm.connector import AgentKVConnector
from agentkv_vllm.metadata import AgentKVStepMetadata


def _load_plan(layerwise: bool = True) -> StepPlan:
    return StepPlan(loads=[LoadJob(7, "req-1", [BlockTransfer(b"k" * 16, 3)], layerwise)])


def test_an_empty_step_pickles_to_a_reference_and_comes_back_empty() -> None:
    empty = pickle.dumps(AgentKVStepMetadata(StepPlan()), protocol=pickle.HIGHEST_PROTOCOL)
    assert b"StepPlan" not in empty  # no dataclass tree on the wire
    assert len(empty) < 100
    back = pickle.loads(empty)
    assert isinstance(back, AgentKVStepMetadata)
    assert back.plan == StepPlan() and not back.plan
    back.plan.loads.append(_load_plan().loads[0])  # a fresh plan each time, never shared
    assert not pickle.loads(empty).plan


def test_a_step_with_jobs_round_trips_whole() -> None:
    meta = AgentKVStepMetadata(_load_plan())
    back = pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
    assert back.plan == meta.plan


class _Worker:
    def __init__(self) -> None:
        self.started: list[StepPlan] = []
        self.waited: list[str] = []

    def start_step(self, meta: Any) -> None:
        self.started.append(meta.plan)

    def wait_for_layer(self, layer_name: str) -> None:
        self.waited.append(layer_name)


def _worker_connector() -> tuple[AgentKVConnector, _Worker]:
    # The worker role without vLLM's process setup: only what bind_connector_metadata reads.
    conn = object.__new__(AgentKVConnector)
    worker = _Worker()
    conn._worker = worker  # type: ignore[assignment]
    conn._connector_metadata = None
    return conn, worker


def test_the_worker_binds_nothing_for_an_empty_step() -> None:
    conn, worker = _worker_connector()
    conn.bind_connector_metadata(AgentKVStepMetadata(StepPlan()))
    assert not conn.has_connector_metadata()  # vLLM's layers skip the per-layer hooks
    assert worker.started == []


def test_a_step_with_a_job_is_bound_and_started_after_an_empty_one() -> None:
    conn, worker = _worker_connector()
    conn.bind_connector_metadata(AgentKVStepMetadata(StepPlan()))
    plan = _load_plan()
    conn.bind_connector_metadata(AgentKVStepMetadata(plan))
    assert conn.has_connector_metadata()  # its layers wait for the layerwise load
    assert worker.started == [plan]
    conn.wait_for_layer_load("model.layers.0.self_attn.attn")
    assert worker.waited == ["model.layers.0.self_attn.attn"]
    conn.clear_connector_metadata()
    conn.bind_connector_metadata(AgentKVStepMetadata(StepPlan()))
    assert not conn.has_connector_metadata()  # the next empty step unbinds again


def test_an_idle_step_plans_nothing_and_still_records_its_admission_picture() -> None:
    """No trajectory: the manager's step is skipped (``idle_step``), but the status still shows
    this step's admission picture, fill included (it is computed after the step's sample)."""
    from types import SimpleNamespace as NS

    from agentkv_vllm.scheduler_side import SchedulerSide
    from agentkv_vllm.settings import ConnectorSettings
    from tests.unit.test_engine_config import BLOCK, _vllm_config

    side = SchedulerSide(*_vllm_config("cpu"), ConnectorSettings())
    side.block_pool = NS(get_num_free_blocks=lambda: 200, get_usage=lambda: 0.1, num_gpu_blocks=257)
    out = NS(num_scheduled_tokens={"a": 2 * BLOCK, "b": 1}, scheduled_new_reqs=[])
    steps = side.manager.steps
    meta = side.build_step(out)
    assert not meta.plan
    assert side.manager.steps == steps + 1
    picture = side.manager.status()["pool"]["admission"]
    assert picture["free_blocks"] == 200
    assert picture["filled_blocks"] == (2 * BLOCK + 1) / BLOCK
