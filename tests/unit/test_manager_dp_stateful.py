"""The manager state machine (test_manager_stateful.ManagerMachine) with two DP ranks behind the
routes' fan-out, as a data-parallel server runs them: each DP rank is its own engine core with its
own manager, device pool, workers and disk manifest (manifest-dp<rank>.json); they share the
clock, the remote tier, the agents (a trajectory's turns may land on either rank, so the same
id holds state on both) and one disk root: each rank's workers keep their files in that rank's
folders of it (``tiers.disk.rank_dir``), so one rank's store, DELETE or restart never counts or
deletes the other's files (issue 40 item 12: the invariants check each rank's stores against
its own index).

Rules: everything ManagerMachine does, on the rank ``switch_rank`` selected (requests, jobs,
restarts of that rank, its own control calls); plus control calls through the production
fan-out (``agentkv_vllm.routes._fan_out`` over each rank's ``SchedulerSide.handle``): DELETE,
pause and GET of an id that may be held by one rank, both or none.

Invariants: ManagerMachine's, on the selected rank after every step and on every rank after a
fanned-out call; a fanned-out DELETE leaves the id unknown (404) on every rank, answers 200 iff
some rank held it and 404 otherwise, and lists exactly the ranks that held it; a fanned-out pause
reaches every rank that holds the id (each records the tool call).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import INVARIANT_MARKER, initialize, precondition, rule

import tests.unit.test_manager_stateful as base
from agentkv.idempotency import ReplayCache
from agentkv.manager.state import scoped_id
from tests.unit.sim_engine import SimPool, SimWorkers

routes = pytest.importorskip("agentkv_vllm.routes")
scheduler_side = pytest.importorskip("agentkv_vllm.scheduler_side")

_BASE_SETUP = base.ManagerMachine.setup
# What each DP rank has of its own (swapped in by switch_rank); the rest is shared.
PER_RANK = (
    "dp_rank",
    "mgr",
    "eng",
    "pool",
    "workers",
    "keeper",
    "announced",
    "deleted",
    "looked_up_before_delete",
    "jobs_at_delete",
    "last_demotion",
    "victims",
)


class _RankControl(scheduler_side.SchedulerSide):  # type: ignore[misc]
    """One DP rank's engine side of the control channel: the production ``handle`` (a
    SchedulerSide without vLLM: only what the control ops read is set)."""

    def __init__(self, machine: DPMachine, rank: int) -> None:  # no super(): no vLLM config
        self.machine, self.rank = machine, rank
        self.manager = machine.ranks[rank]["mgr"]
        self.replays = ReplayCache(self.manager.clock.now)
        self._live: set[str] = set()
        self._lease_until: OrderedDict[Any, float] = OrderedDict()

    def delete_durable(self, trajectory_key: str) -> None:
        """The production side's ManifestKeeper.durable_delete, checked (the rank's own)."""
        self.machine.deleted_durably(trajectory_key)


class _RankClient:
    """The routes' ControlClient of one DP rank, in process."""

    def __init__(self, machine: DPMachine, rank: int) -> None:
        self.machine, self.rank = machine, rank

    async def call(self, op: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        with self.machine.on_rank(self.rank):
            answer = self.machine.control[self.rank].handle({"op": op, **fields})
        self.machine.answers[self.rank] = answer
        return answer  # type: ignore[no-any-return]


class DPMachine(base.ManagerMachine):
    @initialize(**_BASE_SETUP.hypothesis_stateful_initialize_rule.arguments)  # type: ignore[attr-defined]
    def setup(self, **kw: Any) -> None:
        _BASE_SETUP(self, **kw)
        self.ranks: list[dict[str, Any]] = [self._save(), {}]
        remote, contexts = self.workers.remote, self.eng.finished_contexts
        self.dp_rank = 1
        self.pool = SimPool(base.POOL, self.tp)
        workers = SimWorkers(self.pool, self.tp, self.workers.capacity)
        workers.remote = remote  # one Valkey behind every rank
        self._start(workers, contexts)
        self.ranks[1] = self._save()
        self.current = 1
        self.control: dict[int, _RankControl] = {}

    def _save(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in PER_RANK}

    def _load(self, rank: int) -> None:
        for name, value in self.ranks[rank].items():
            setattr(self, name, value)

    @contextlib.contextmanager
    def on_rank(self, rank: int) -> Iterator[None]:
        """Run a block on ``rank`` (its manager, engine, pool...), then back to the current one."""
        self.ranks[self.current] = self._save()
        self._load(rank)
        try:
            yield
        finally:
            self.ranks[rank] = self._save()
            self._load(self.current)

    def _control(self, rank: int) -> _RankControl:
        ctl = self.control.get(rank)
        if ctl is None or ctl.manager is not self.ranks[rank]["mgr"]:  # a restart: a new one
            ctl = self.control[rank] = _RankControl(self, rank)
        return ctl

    def teardown(self) -> None:
        if self.mgr is None:
            return
        try:
            with self.on_rank(1 - self.current):
                try:
                    self._drain_everything()
                finally:
                    self.keeper.close()
        finally:
            super().teardown()

    # ------------------------------------------------------------------ rules
    @rule(rank=st.integers(0, 1))
    def switch_rank(self, rank: int) -> None:
        """The DP load balancer sends what follows to ``rank``."""
        self.ranks[self.current] = self._save()
        self.current = rank
        self._load(rank)

    def _all_ids(self) -> list[tuple[str, str | None]]:
        ids: set[tuple[str, str | None]] = set()
        for rank in (0, 1):
            with self.on_rank(rank):
                ids.update(self._live_ids())
        return sorted(ids, key=str) + sorted(self.deleted_ids, key=str)[:1]

    def _holders(self, tid: str, salt: str | None) -> list[int]:
        return [r for r in (0, 1) if scoped_id(tid, salt) in self.ranks_mgr(r).table]

    def ranks_mgr(self, rank: int) -> Any:
        return self.mgr if rank == self.current else self.ranks[rank]["mgr"]

    @property
    def m(self) -> Any:
        """The selected rank's manager (set once setup ran)."""
        assert self.mgr is not None
        return self.mgr

    def _tick_all(self) -> None:
        """Each rank's manager ticks first (as ``handle`` does): expired trajectories go."""
        for rank in (0, 1):
            with self.on_rank(rank):
                self.m.tick()

    def _fan_out(self, op: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        """The call through the production fan-out; then: every rank was asked, and the answer
        names exactly the ranks that knew the id (404 only when none did)."""
        for rank in (0, 1):
            self._control(rank)
        self.answers: dict[int, tuple[int, dict[str, Any]]] = {}
        clients = [_RankClient(self, rank) for rank in (0, 1)]
        status, body = asyncio.run(routes._fan_out(clients, op, **fields))
        assert sorted(self.answers) == [0, 1], f"{op} skipped a DP rank: {sorted(self.answers)}"
        knew = [r for r in (0, 1) if self.answers[r][0] != 404]
        if knew:
            assert body["dp_ranks"] == knew, (op, body, self.answers)
        else:
            assert status == 404, (op, status, body)
        return status, body

    @precondition(lambda self: self.quiet)
    @rule(traj=st.integers(0, 7))
    def delete_everywhere(self, traj: int) -> None:
        """DELETE through the routes: every rank that holds the id drops it."""
        ids = self._all_ids()
        if not ids:
            return
        tid, salt = ids[traj % len(ids)]
        self._tick_all()
        holders = self._holders(tid, salt)
        for rank in holders:  # the base delete rule's bookkeeping, per rank
            with self.on_rank(rank):
                gone = self.m.table[scoped_id(tid, salt)]
                self.looked_up_before_delete |= {
                    rid for rid, key in self.m.reqs._waiting.items() if key == gone.trajectory_id
                } | {rid for rid, r in self.m.requests.items() if r.traj is gone}
                self.jobs_at_delete[id(gone)] = {
                    j for j, job in self.m.jobs.items() if job.trajectory is gone
                }
                self.deleted.append(gone)
        fields = {"trajectory_id": tid, **({"cache_salt": salt} if salt else {})}
        status, body = self._fan_out("end", **fields)
        assert status == (200 if holders else 404), (status, body, holders)
        if holders:
            self.deleted_ids.add((tid, salt))
        for rank in (0, 1):
            with self.on_rank(rank):
                assert self.m.get(tid, tenant=salt)[0] == 404, (tid, salt, rank)
        self._check_every_rank()

    @precondition(lambda self: self.quiet)
    @rule(
        traj=st.integers(0, 7),
        wait=st.sampled_from(base.WAITS),
        tool=st.sampled_from(["t1", "t2"]),
    )
    def pause_everywhere(self, traj: int, wait: float | None, tool: str) -> None:
        """The hooks' auto-pause (and the pause route): every rank that holds the id records
        the tool call."""
        ids = self._all_ids()
        if not ids:
            return
        tid, salt = ids[traj % len(ids)]
        fields = {"trajectory_id": tid, "branch": "main", "tool": tool, "expected_wait_s": wait}
        self._fan_out("pause", **fields, **({"cache_salt": salt} if salt else {}))
        self._check_every_rank()

    def _check_every_rank(self) -> None:
        for rank in (0, 1):
            with self.on_rank(rank):
                for name in _INVARIANTS:
                    getattr(self, name)()


_INVARIANTS = sorted(
    name
    for name in dir(base.ManagerMachine)
    if getattr(getattr(base.ManagerMachine, name), INVARIANT_MARKER, None) is not None
)
assert _INVARIANTS, "no invariants found"

DPMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("AGENTKV_STATEFUL_EXAMPLES", "40")),
    stateful_step_count=int(os.environ.get("AGENTKV_STATEFUL_STEPS", "50")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerDPStateful = DPMachine.TestCase
