"""A fault anywhere in a step's connector work fails that step's loads (issue 40, item 3).

vLLM trusts the connector's answers: a layerwise request runs its forward in the very step its
load was bound, an async one waits in WAITING_FOR_REMOTE_KVS until ``get_finished`` names it. So
a fault must never leave a load silently unstarted: its blocks go to
``get_block_ids_with_load_errors`` (vLLM recomputes them), an async load is reported finished,
every job of the step is reported to the manager (done or failed, exactly once per rank, so it
releases its pins and tier slots), and host pins taken for the step are released.

Real tensors (CPU KV layout), a real TieredStore and the real connector hooks; faults are
injected at each stage of ``start_step`` (a key whose rank key raises, placed in that stage's
job), in the store's calls, in the layer waits and in the poll.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from agentkv.manager.jobs import (  # noqa: E402
    BlockTransfer,
    DropOp,
    LoadJob,
    MoveJob,
    MoveKind,
    StepPlan,
    StoreJob,
    WorkerReport,
)
from agentkv.tier import Tier  # noqa: E402
from agentkv_vllm import layerwise_loads  # noqa: E402
from agentkv_vllm.connector import AgentKVConnector  # noqa: E402
from agentkv_vllm.metadata import AgentKVStepMetadata  # noqa: E402
from agentkv_vllm.settings import ConnectorSettings  # noqa: E402
from agentkv_vllm.worker_side import WorkerSide  # noqa: E402
from tests.unit.test_layerwise import NAMES, NUM_BLOCKS, _caches  # noqa: E402

BOOM = b"boom"  # its rank key raises: the fault, in whichever job carries it


def _connector() -> tuple[AgentKVConnector, WorkerSide, dict[str, Any]]:
    caches = _caches()
    w = WorkerSide(
        settings=ConnectorSettings(host_capacity_gib=0.01, run_dir="/tmp"),
        model_id="sim",
        tp_rank=0,
        tp_size=1,
        num_blocks=NUM_BLOCKS,
    )
    w.register_kv_caches(caches)
    # The worker role without vLLM's process setup: only what the worker hooks read.
    conn = object.__new__(AgentKVConnector)
    conn._worker = w
    conn._connector_metadata = None
    return conn, w, caches


def _store_pair(conn: AgentKVConnector, w: WorkerSide, caches: dict[str, Any]) -> dict[str, Any]:
    """k1, k2: blocks 1 and 2 of every layer, in host; the blocks zeroed; their old bytes."""
    for i, name in enumerate(NAMES):
        caches[name][1] = i + 1
        caches[name][2] = -(i + 1)
    conn.bind_connector_metadata(
        AgentKVStepMetadata(
            StepPlan(
                stores=[StoreJob(1, Tier.HOST, [BlockTransfer(b"k1", 1), BlockTransfer(b"k2", 2)])]
            )
        )
    )
    _settle(conn, w, set())
    report = _report(conn)
    assert report.jobs_done == {1: 1} and not report.jobs_failed
    expected = {name: caches[name][1:3].clone() for name in NAMES}
    for name in NAMES:
        caches[name].zero_()
    return expected


def _settle(conn: AgentKVConnector, w: WorkerSide, waiting: set[str]) -> set[str]:
    """What vLLM does after binding a step: each layer's wait, the save wait, then polls until
    every async request it waits for is reported (each transfer waited on its own handle)."""
    for name in NAMES:
        conn.wait_for_layer_load(name)
    conn.wait_for_save()
    finished: set[str] = set()
    for _ in range(3):
        for pending in [*w._jobs, *w._loads]:
            _wait(pending.handle)
        _, recving = conn.get_finished(set())
        finished |= recving or set()
        if waiting <= finished:
            break
    return finished


def _wait(handle: Any) -> None:
    """A transfer's own completion (a TransferHandle, or the fetch thread's Future)."""
    if isinstance(handle, Future):
        handle.exception(timeout=10)
    else:
        handle.wait(10)


def _report(conn: AgentKVConnector) -> WorkerReport:
    meta = conn.build_connector_worker_meta()
    return meta.report if meta is not None else WorkerReport()  # type: ignore[attr-defined]


def _raise_on_boom(w: WorkerSide, monkeypatch: pytest.MonkeyPatch) -> None:
    real = w.rank_key

    def rank_key(logical: bytes) -> Any:
        if logical == BOOM:
            raise RuntimeError("injected worker fault")
        return real(logical)

    monkeypatch.setattr(w, "rank_key", rank_key)


def _fault_plan(stage: str) -> StepPlan:
    """One job of every kind; BOOM sits in ``stage``'s job (a second load of its kind for the
    loads, after one that starts fine)."""

    def extra(at: str, block: int) -> list[BlockTransfer]:
        return [BlockTransfer(BOOM, block)] if stage == at else []

    loads = [LoadJob(12, "lw", [BlockTransfer(b"k1", 5)], layerwise=True)]
    if stage == "layerwise":
        loads.append(LoadJob(14, "lw2", [BlockTransfer(BOOM, 7)], layerwise=True))
    loads.append(LoadJob(13, "as", [BlockTransfer(b"k2", 6)], layerwise=False))
    if stage == "async":
        loads.append(LoadJob(15, "as2", [BlockTransfer(BOOM, 7)], layerwise=False))
    return StepPlan(
        drops=[DropOp([b"gone", *(b.key for b in extra("drop", 0))])],
        stores=[StoreJob(10, Tier.HOST, [BlockTransfer(b"s", 3), *extra("store", 4)], "t")],
        moves=[MoveJob(11, MoveKind.PROMOTE, [b"k1", *(b.key for b in extra("move", 0))])],
        loads=loads,
    )


def _no_host_pins(w: WorkerSide) -> bool:
    store = w.store
    assert store is not None
    return not any(store._host_order.pinned(b) for b in store._blocks.values())


def _check_fault_step(
    conn: AgentKVConnector,
    w: WorkerSide,
    caches: dict[str, Any],
    expected: dict[str, Any],
    plan: StepPlan,
    must_fail: set[int],
) -> None:
    """The step was bound: settle it as vLLM would, then check nothing failed open."""
    waiting = {load.req_id for load in plan.loads if not load.layerwise}
    finished = _settle(conn, w, waiting)
    assert waiting <= finished, "an async load was never reported: vLLM would wait forever"
    errors = conn.get_block_ids_with_load_errors()
    report = _report(conn)
    content = {5: expected[NAMES[0]][0], 6: expected[NAMES[0]][1]}
    for load in plan.loads:
        ids = {b.block_id for b in load.blocks}
        if load.job_id in must_fail:
            assert ids <= errors, f"load {load.req_id} failed open: its blocks are not errors"
            assert load.job_id in report.jobs_failed
        for b in load.blocks:  # a block vLLM reads as loaded holds the loaded bytes
            if b.block_id not in errors:
                assert torch.equal(caches[NAMES[0]][b.block_id], content[b.block_id])
    jobs = [j.job_id for j in (*plan.stores, *plan.moves, *plan.loads)]
    # Every job reported exactly once (the manager counts ranks): its pins and slots go.
    assert {j: report.jobs_done.get(j) for j in jobs} == dict.fromkeys(jobs, 1)
    assert _no_host_pins(w), "a host copy stays pinned after the step"


@pytest.mark.parametrize("stage", ["drop", "store", "move", "layerwise", "async"])
def test_a_fault_at_each_stage_of_start_step_fails_the_loads_it_did_not_start(
    stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn, w, caches = _connector()
    expected = _store_pair(conn, w, caches)
    _raise_on_boom(w, monkeypatch)
    plan = _fault_plan(stage)
    # Loads at or after the fault: a layerwise step is one batch (all or none of it starts);
    # async loads start one by one (``as`` started before the faulty ``as2``).
    must_fail = {"layerwise": {12, 13, 14}, "async": {15}}.get(stage, {12, 13})
    conn.bind_connector_metadata(AgentKVStepMetadata(plan))
    _check_fault_step(conn, w, caches, expected, plan, must_fail)
    # The worker is not wedged: the next step loads normally.
    monkeypatch.undo()
    conn.bind_connector_metadata(
        AgentKVStepMetadata(StepPlan(loads=[LoadJob(20, "next", [BlockTransfer(b"k1", 4)], True)]))
    )
    _settle(conn, w, set())
    assert conn.get_block_ids_with_load_errors() == set()
    assert torch.equal(caches[NAMES[-1]][4], expected[NAMES[-1]][0])
    w.shutdown()


@pytest.mark.parametrize("call", ["drop", "acquire_host", "submit_load", "submit_store"])
def test_a_store_call_that_raises_fails_the_step_loads_it_reaches(
    call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store itself raising (not a per-block result): drops first, the layerwise pins, the
    async loads' submit, the stores' submit."""
    conn, w, caches = _connector()
    expected = _store_pair(conn, w, caches)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise OSError(f"injected {call} fault")

    monkeypatch.setattr(w.store, call, boom)
    plan = _fault_plan("none")
    must_fail = {
        "drop": {12, 13},
        "acquire_host": {12, 13},
        "submit_load": {13},
        "submit_store": set(),
    }[call]
    conn.bind_connector_metadata(AgentKVStepMetadata(plan))
    _check_fault_step(conn, w, caches, expected, plan, must_fail)
    w.shutdown()


def test_a_layer_wait_that_times_out_fails_the_step_and_its_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy that never finishes: the layer wait gives up (bounded), the step's blocks are
    load errors and its job is reported failed, not done."""
    monkeypatch.setattr(layerwise_loads, "LAYER_WAIT_TIMEOUT_S", 0.01)
    conn, w, caches = _connector()
    _store_pair(conn, w, caches)
    conn.bind_connector_metadata(
        AgentKVStepMetadata(StepPlan(loads=[LoadJob(2, "lw", [BlockTransfer(b"k1", 5)], True)]))
    )
    step = w._layerwise
    assert step is not None
    stuck: Future[float] = Future()  # the copy never completes
    step.future, step.events = stuck, {}
    for name in NAMES:
        conn.wait_for_layer_load(name)
    assert 5 in conn.get_block_ids_with_load_errors()
    stuck.set_result(0.0)
    conn.wait_for_save()
    report = _report(conn)
    assert report.jobs_done == {2: 1} and report.jobs_failed == {2}
    w.shutdown()


def test_a_poll_that_raises_still_reports_the_async_load_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Collecting a finished load raises: the request is still reported (with its blocks as
    errors), once, and the next polls do not raise again on the same transfer."""
    conn, w, caches = _connector()
    _store_pair(conn, w, caches)
    conn.bind_connector_metadata(
        AgentKVStepMetadata(StepPlan(loads=[LoadJob(2, "as", [BlockTransfer(b"k2", 6)])]))
    )
    [pending] = w._loads
    pending.handle.wait(10)

    def broken() -> Any:
        raise RuntimeError("injected result fault")

    monkeypatch.setattr(pending.handle, "result", broken)
    _, recving = conn.get_finished(set())
    assert recving == {"as"}
    assert conn.get_block_ids_with_load_errors() == {6}
    report = _report(conn)
    assert report.jobs_done == {2: 1} and report.jobs_failed == {2}
    assert conn.get_finished(set()) == (None, None)
    w.shutdown()


def test_the_manager_learns_a_faulted_step_failed_its_jobs_and_releases_their_pins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """End to end over the real manager: an offload's store job meets a worker fault; the
    worker's report fails it, the manager ends the job (no job left waiting for ranks) and
    the branch's device pins go back to the pool."""
    from agentkv.manager import BranchState
    from agentkv.policy import Action
    from tests.unit.sim_engine import make_rig

    rig = make_rig(blocks=NUM_BLOCKS, policy_override=Action.OFFLOAD_HOST)
    rig.turn("t1", list(range(1, 23)))  # 5 full blocks
    code, body = rig.mgr.pause("t1", "main", "human", 300.0)
    assert code == 200 and body["decision"]["action"] == "offload_host", body
    plan = rig.mgr.take_step()
    assert plan.stores and rig.mgr.jobs and rig.mgr.pinned_blocks() > 0
    conn, w, _ = _connector()
    monkeypatch.setattr(w, "rank_key", lambda logical: (_ for _ in ()).throw(OSError("fault")))
    conn.bind_connector_metadata(AgentKVStepMetadata(plan))
    _settle(conn, w, set())
    rig.mgr.on_report(_report(conn))
    assert not rig.mgr.jobs, "a job still waits for a rank that already gave up on it"
    assert rig.mgr.counters["store_failures"] == 1
    [traj] = rig.mgr.table.values()
    # Nothing was copied, so nothing is kept: the offload fell back to a drop, pins released.
    assert traj.branches["main"].state is BranchState.DROPPED
    assert rig.mgr.pinned_blocks() == 0
    w.shutdown()


# ---------------------------------------------------------------- any plan, a fault anywhere

_CALLS = ("drop", "acquire_host", "submit_load", "submit_store", "promote")


@st.composite
def _plans(draw: st.DrawFn) -> tuple[StepPlan, tuple[str, int]]:
    """A step of every kind of job over k1, k2 (in host) and a key no tier holds, load targets
    distinct (vLLM never gives one block to two requests); the fault: BOOM in the n-th job,
    one of the store's calls raising, or none."""
    ids = iter(range(100, 200))
    keys = st.sampled_from([b"k1", b"k2", b"nope"])
    targets = iter([3, 4, 5, 6, 7, 0])
    stores = [
        StoreJob(next(ids), Tier.HOST, [BlockTransfer(draw(keys) + b"s", draw(st.integers(0, 7)))])
        for _ in range(draw(st.integers(0, 2)))
    ]
    moves = [
        MoveJob(next(ids), MoveKind.PROMOTE, [draw(keys)]) for _ in range(draw(st.integers(0, 1)))
    ]
    loads = []
    for _ in range(draw(st.integers(0, 3))):
        n = draw(st.integers(1, 2))
        blocks = [BlockTransfer(draw(keys), b) for b in itertools.islice(targets, n)]
        if blocks:
            loads.append(LoadJob(next(ids), f"r{len(loads)}", blocks, draw(st.booleans())))
    plan = StepPlan(drops=[DropOp([b"gone"])], stores=stores, moves=moves, loads=loads)
    jobs = [*plan.stores, *plan.moves, *plan.loads]
    kind = draw(st.sampled_from(["none", "key", "call"]))
    if kind == "key" and jobs:
        n = draw(st.integers(0, len(jobs) - 1))
        job = jobs[n]
        if isinstance(job, MoveJob):
            job.keys.append(BOOM)
        else:
            job.blocks[-1] = BlockTransfer(BOOM, job.blocks[-1].block_id)
        return plan, ("key", n)
    if kind == "call":
        return plan, ("call", draw(st.integers(0, len(_CALLS) - 1)))
    return plan, ("none", 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_plans())
def test_any_plan_with_a_fault_anywhere_never_fails_open(
    case: tuple[StepPlan, tuple[str, int]],
) -> None:
    plan, (kind, n) = case
    conn, w, caches = _connector()
    expected = _store_pair(conn, w, caches)
    with pytest.MonkeyPatch.context() as mp:
        if kind == "key":
            _raise_on_boom(w, mp)
        elif kind == "call":

            def boom(*args: Any, **kwargs: Any) -> Any:
                raise OSError("injected store fault")

            mp.setattr(w.store, _CALLS[n], boom)
        conn.bind_connector_metadata(AgentKVStepMetadata(plan))
        waiting = {load.req_id for load in plan.loads if not load.layerwise}
        finished = _settle(conn, w, waiting)
    assert waiting <= finished, "an async load was never reported: vLLM would wait forever"
    errors = conn.get_block_ids_with_load_errors()
    report = _report(conn)
    truth = {b"k1": 0, b"k2": 1}
    for load in plan.loads:
        for b in load.blocks:
            if b.block_id in errors:
                continue
            assert b.key in truth, f"block {b.block_id} of {load.req_id} served with no source"
            for name in NAMES:  # a block vLLM reads as loaded holds the loaded bytes
                assert torch.equal(caches[name][b.block_id], expected[name][truth[b.key]])
        if any(b.block_id in errors for b in load.blocks):
            assert load.job_id in report.jobs_failed
    jobs = [j.job_id for j in (*plan.stores, *plan.moves, *plan.loads)]
    assert {j: report.jobs_done.get(j) for j in jobs} == dict.fromkeys(jobs, 1)
    assert _no_host_pins(w), "a host copy stays pinned after the step"
    w.shutdown()
