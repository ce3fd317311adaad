"""Race hunting: a hypothesis state machine over the real TrajectoryManager and a simulated engine.

Rules drive requests like vLLM's scheduler (lookup, allocation, async and layerwise loads,
compute, finish, abort also during an async load, preemption; two cache_salts), the control
channel (pause with tiny to huge waits, resume, DELETE, GET, a control-thread tick), the workers
(each job completes, fails a block's I/O, or fails to start, per rank; a silent rank that wakes
late; an async load cancelled at the worker's own deadline; a damaged disk file), pool pressure
spikes and clock jumps, and restarts (a clean stop writes the manifest, the disk files are pruned
to it, a new manager restores it, as agentkv.manager.recovery does; or a restart under another
KV identity, which restores nothing). Right after a restart: only trajectories live at the stop
come back (nothing deleted), each restored branch is OFFLOADED on disk, and the invariants below
hold for the new manager (its disk copies are true and on every rank, nothing unindexed).
test_invalidation_stateful.py adds generations (a manifest written after a reset restores
nothing), test_manager_dp_stateful.py two DP ranks behind the routes' fan-out. The sim does only what the plugin's adapter and worker do
(sim_engine.py), on stores that behave like the real TieredStore (fake_store.py).

Invariants after every step (numbers from agentkv/manager/core.py's docstring):
  1. no load copies a tier copy that is not its key's true content; every normally finished
     request holds the true KV in all its computed blocks; tier copies the index lists are true;
     no upload publishes a wrong copy
  2. every counted external block is covered by a LoadJob in the next plan
  3. pins in the pool == the manager's recorded pins == branch pins + store-job pins + queued
     unpins; all balance to zero at the end (teardown); every pinned block holds its keys'
     true KV on every rank (a branch's context blocks, a store job's sources)
  4. only live trajectories own indexed keys (and know it); deleted ones hold nothing, answer
     404, never come back through their running requests, nor through a turn queued before the
     DELETE and looked up after it (issue 40 item 9); tombstones only while running
  5. pressure weighs only RETAINED branches, and every one it picks leaves RETAINED; a demotion
     that covered its excess is not followed by another unless usage grew or a store completed
  6. index == stores: what the index lists complete is on every rank; the ranks hold nothing the
     index does not know (drops still in the outbox aside); no tier is written past capacity
  7. the KV-event change log replays to exactly the index
  8. deferred write-backs: a recorded eviction due belongs to a CACHED branch, and its live
     heap entry carries the same due; no write-back structure references a deleted trajectory
     (8c, under eager and forecast write-back: issue 40 item 11)
They are in stateful_invariants.py (ManagerInvariants, a mixin of the machine). The rules: the
control channel's in stateful_control.py (ControlRules), the restarts in stateful_restart.py
(RestartRules), both mixins; the requests, engine loop, workers, clock and pressure here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
)

import agentkv.manager.core as core
from agentkv.kv_identity import BASE_GENERATION
from agentkv.manager import BranchState, ManagerConfig, Trajectory, TrajectoryManager
from agentkv.manager.recovery import ManifestKeeper, load_records, manifest_path, restore
from agentkv.manager.state import scoped_id
from agentkv.policy import CostModel, PolicyParams, Writeback
from tests.unit.sim_engine import (
    FakeClock,
    SimEngine,
    SimPool,
    SimWorkers,
    key_of,
)
from tests.unit.stateful_control import WAITS, ControlRules
from tests.unit.stateful_invariants import DISK, HOST, POOL, SALT_OF, SALTS, ManagerInvariants
from tests.unit.stateful_restart import RestartRules

BS = 4
TIMEOUT = 10.0
CLOCK_STEPS = [0.05, 0.3, 0.6, 3.0, 2 * TIMEOUT, 70.0, 700.0]
SYSTEM = [7, 7, 7, 7, 9, 9, 9, 9]  # a shared system prompt: identical blocks across trajectories
OUTCOMES = ["ok", "ok", "ok", "io_error", "start_error"]  # how one rank ends one job
IDENTITY = bytes(range(16))  # the engine's KV identity digest (model, weights, format, layout)


class ManagerMachine(ManagerInvariants, ControlRules, RestartRules, RuleBasedStateMachine):
    dp_rank = 0  # the engine's DP rank: names its manifest

    def __init__(self) -> None:
        super().__init__()
        self.mgr: TrajectoryManager | None = None

    # ------------------------------------------------------------------ setup
    @initialize(
        tp=st.sampled_from([1, 2]),
        layerwise=st.booleans(),
        grace=st.sampled_from([0.0, 0.5]),
        disk=st.booleans(),
        admission_wait=st.sampled_from([False, False, True]),
        defer=st.booleans(),
        device_prefetch=st.booleans(),
        salt_generations=st.booleans(),
    )
    def setup(
        self,
        tp: int,
        layerwise: bool,
        grace: float,
        disk: bool,
        admission_wait: bool,
        defer: bool = False,
        device_prefetch: bool = False,
        salt_generations: bool = False,
    ) -> None:
        self.clock = FakeClock()
        self.pool = SimPool(POOL, tp)
        config = ManagerConfig(
            block_size=BS,
            block_bytes=1 << 20,
            tp_size=tp,
            host_capacity_blocks=HOST,
            disk_capacity_blocks=DISK if disk else 0,
            grace_s=grace,
            job_timeout_s=TIMEOUT,
            idle_ttl_s=300.0,
            max_trajectories=5,
            layerwise=layerwise,
            high_water=0.75,
            admission_wait=admission_wait,
            remote_enabled=True,
            # issue 26: offload_host copies wait for an eviction forecast
            writeback=Writeback.FORECAST if defer else Writeback.EAGER,
            device_prefetch=device_prefetch,
            # issue 41: a cache_salt is a weight version; a turn under a new salt releases the
            # id's old-salt trajectory (every rule drawing a salt may then release one)
            salt_generations=salt_generations,
        )
        # 1 MiB blocks: a 10-block context reloads from host in 0.1 s, from disk in 0.12 s, and
        # recomputes in 0.4 s; break-even waits are ~0.1-0.3 s, so declared waits from 0 to
        # 1e5 s give every action (retain, offload_host, offload_disk past 100 s, drop when full).
        costs = CostModel(
            host_link_bytes_per_s=1e8,
            disk_write_bytes_per_s=5e8,
            disk_read_bytes_per_s=5e8,
            prefill_tokens_per_s=100.0,
        )
        self.config, self.costs, self.tp = config, costs, tp
        self.identity = IDENTITY
        # The manifests' directory: tmpfs where there is one (the manifest's fsyncs are free)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.disk_root = Path(tempfile.mkdtemp(prefix="agentkv-stateful-", dir=shm))
        self.deleted_ids: set[tuple[str, str | None]] = set()  # (trajectory id, tenant)
        self.next_traj = 0
        self._start(SimWorkers(self.pool, tp, {"host": HOST, "disk": DISK if disk else 0}), {})
        # pressure bookkeeping (invariant 5)
        self._orig_victims = core.pressure_victims
        core.pressure_victims = self._record_victims  # type: ignore[assignment]
        self.last_demotion: dict[str, Any] | None = None
        self.cascades: list[str] = []
        # (branch, its decision then): each pressure victim picked, until the invariant checks
        # it was demoted
        self.victims: list[tuple[Any, Any]] = []

    def _start(self, workers: SimWorkers, contexts: dict[tuple[str, str], list[int]]) -> None:
        """An engine process starting: a new manager on the pool (as the adapter builds it),
        the change log recorded from the start, the restart manifest restored
        (scheduler_side._restore_from_disk: load_records + restore) and kept from now on."""
        self.mgr = TrajectoryManager(
            self.config,
            self.pool,
            key_of=key_of,
            costs=self.costs,
            policy=PolicyParams(disk_after_s=100.0, max_lease_s=60.0, writeback_margin=0.0),
            clock=self.clock,
        )
        self._configure(self.mgr)
        self.mgr.record_tier_changes()
        # What a KV-event consumer believes each tier holds, from the change log alone.
        self.announced: dict[str, set[bytes]] = {"host": set(), "disk": set()}
        self.workers = workers
        self.attach_disk(workers)  # its disk folders (RestartRules): they outlive the process
        self.eng = SimEngine(self.mgr, self.pool, self.workers)
        self.eng.finished_contexts = contexts  # the agents remember their contexts
        self.deleted: list[Trajectory] = []
        self.looked_up_before_delete: set[str] = set()  # request ids
        self.jobs_at_delete: dict[int, set[int]] = {}  # id(trajectory) -> its jobs then
        self.last_demotion = None
        self.victims = []
        path = manifest_path(self.disk_root, self.dp_rank)
        restore(self.mgr, load_records(path, self.identity, BASE_GENERATION, BS))
        self.keeper = ManifestKeeper(
            self.mgr, path, lambda: (self.identity, self._generation()), interval_s=1e9
        )

    def _configure(self, mgr: TrajectoryManager) -> None:
        """Hook: a subclass wires its own key derivation into a new manager."""

    def _generation(self) -> bytes:
        """The engine's KV generation now (a subclass that resets or updates weights bumps it)."""
        return BASE_GENERATION

    def _record_victims(self, candidates: list[Any], excess: float) -> list[object]:
        for handle, *_ in candidates:  # only retained branches are demoted by pressure
            traj, branch = handle
            if branch.state is not BranchState.RETAINED or traj.deleted:
                self.cascades.append(
                    f"pressure candidate {traj.trajectory_id}/{branch.name} is "
                    f"{branch.state.value}{' (deleted)' if traj.deleted else ''}, not retained"
                )
        out = self._orig_victims(candidates, excess)
        self.victims += [(handle[1], handle[1].decision) for handle in out]  # type: ignore[index]
        mgr = self.mgr
        assert mgr is not None
        stores = {j for j, job in mgr.jobs.items() if job.kind == "store"}
        last = self.last_demotion
        if (
            excess > 0
            and last is not None
            and last["exclusive"]
            and last["freed"] >= last["excess"]
            and last["grow"] == self.pool.grow_events
            and last["stores"] <= stores
        ):
            self.cascades.append(
                f"pressure demoted again (excess {excess:.1f}) with no new use since the last "
                f"demotion of {last['n']} branch(es) at excess {last['excess']:.1f}"
            )
        if out:
            pinned = [b for handle in out for b in handle[1].pinned]  # type: ignore[index]
            self.last_demotion = {
                "exclusive": all(self.pool.ref[b] == 1 for b in pinned),
                "grow": self.pool.grow_events,
                "stores": stores,
                "n": len(out),
                "excess": excess,
                "freed": len(pinned),
            }
        return out

    def teardown(self) -> None:
        if self.mgr is None:
            return
        try:
            self._drain_everything()
        finally:
            core.pressure_victims = self._orig_victims  # type: ignore[assignment]
            self.keeper.close()
            shutil.rmtree(self.disk_root, ignore_errors=True)

    # ------------------------------------------------------------------ helpers
    def _live_ids(self) -> list[tuple[str, str | None]]:
        """(trajectory id, tenant) of every live trajectory: the same id under two tenants is
        two trajectories."""
        assert self.mgr is not None
        return [(t.name, SALT_OF[t.tenant]) for t in self.mgr.table.values()]

    def _pick_request(self, i: int, pred: Any) -> Any:
        reqs = [r for r in self.eng.requests.values() if pred(r)]
        return reqs[i % len(reqs)] if reqs else None

    def _pick_traj(self, i: int, deleted: bool = False) -> tuple[str, str | None] | None:
        gone = sorted(self.deleted_ids, key=str)[:1] if deleted else []
        ids = self._live_ids() + gone
        return ids[i % len(ids)] if ids else None

    @property
    def quiet(self) -> bool:
        """No schedule() in progress: its plan went out (engine-thread rules may run)."""
        return not self.eng._awaiting_cover

    # ------------------------------------------------------------------ requests
    @precondition(lambda self: len(self.eng.requests) < 4)
    @rule(
        traj=st.integers(0, 5),
        branch=st.sampled_from(["main", "main", "f1"]),
        cut=st.integers(0, 40),
        system=st.booleans(),
        tail=st.lists(st.integers(1, 3), min_size=1, max_size=9),
        max_new=st.integers(0, 5),
        salt=st.sampled_from(SALTS),
    )
    def new_request(
        self,
        traj: int,
        branch: str,
        cut: int,
        system: bool,
        tail: list[int],
        max_new: int,
        salt: str | None = None,
    ) -> None:
        """A turn of a live trajectory (continuing its branch, or forking main at ``cut``), of
        a deleted one, or of a new one (``traj`` past the candidates), under a cache_salt (the
        same tokens under two salts are two tenants' blocks: never one key, never one block)."""
        ids = [tid for tid, _ in self._live_ids()]
        ids = ids + ids + [tid for tid, _ in sorted(self.deleted_ids, key=str)[:1]]
        if traj < len(ids):
            tid = ids[traj]  # under ``salt``: maybe another tenant's id (its own trajectory)
        else:
            self.next_traj += 1
            tid = f"t{self.next_traj}"
        ctx = self.eng.finished_contexts.get((tid, branch))
        if ctx is None and branch != "main":  # a fork: a prefix of main
            ctx = self.eng.finished_contexts.get((tid, "main"), [])[:cut]
        if ctx is None:
            ctx = list(SYSTEM) if system else []
        if len(ctx) > 28:
            ctx = ctx[:20]
        self.eng.new_request(tid, branch, ctx + tail, max_new=max_new, salt=salt)

    @precondition(lambda self: len(self.eng.requests) < 4 and bool(self.mgr.table))
    @rule(
        traj=st.integers(0, 5),
        tail=st.lists(st.integers(1, 3), min_size=1, max_size=9),
        gap=st.sampled_from([0.0, 0.0, 0.01, 0.6]),
        after=st.booleans(),
    )
    def turn_queued_then_deleted(self, traj: int, tail: list[int], gap: float, after: bool) -> None:
        """Issue 40 item 9: a turn sits in vLLM's waiting queue, not yet looked up, while its
        trajectory is DELETEd (200); ``gap`` seconds pass between its arrival and the DELETE.
        Scheduled later, it runs as a vanilla request (invariant 4: the deleted trajectory never
        comes back, holds nothing); with ``after``, a turn that arrives after the DELETE starts
        a fresh trajectory as before."""
        assert self.mgr is not None
        picked = self._pick_traj(traj)
        assert picked is not None
        tid, salt = picked
        ctx = self.eng.finished_contexts.get((tid, "main")) or list(SYSTEM)
        queued = self.eng.new_request(tid, "main", ctx[:20] + tail, max_new=1, salt=salt)
        self.clock.advance(gap)
        self.delete(self._live_ids().index(picked))  # bookkeeping for invariant 4 included
        fresh = None
        if after:
            self.clock.advance(0.01)
            fresh = self.eng.new_request(tid, "main", ctx[:20] + tail, max_new=1, salt=salt)
        self._engine_loop(3, 0xFFFF, 0.01)
        if queued.status == "FINISHED":
            assert queued.stats is None, queued.stats  # vanilla: no turn of any trajectory
        if fresh is not None and fresh.req_id in self.mgr.requests:
            assert not self.mgr.requests[fresh.req_id].traj.deleted

    @precondition(
        lambda self: (
            self.config.salt_generations and len(self.eng.requests) < 3 and bool(self.mgr.table)
        )
    )
    @rule(
        traj=st.integers(0, 5),
        tail=st.lists(st.integers(1, 3), min_size=1, max_size=9),
        straggler=st.booleans(),
    )
    def turn_under_a_new_salt(self, traj: int, tail: list[int], straggler: bool) -> None:
        """Issue 41, salt_generations: a weight sync moved the trajectory's id to another
        cache_salt (SkyRL's per-version salt), and its next turn's lookup releases the old
        salt's trajectory as DELETE does: from then on invariant 4 holds for it (it holds
        nothing, answers 404, never comes back through a request looked up or queued before;
        the release is not durable: a crash may restore it, as it restores an expiry).
        ``straggler``: an old-salt turn was queued before the new one (vLLM kept it across the
        sync): looked up after, it runs vanilla and never releases the newer trajectory."""
        assert self.mgr is not None
        picked = self._pick_traj(traj)
        assert picked is not None
        tid, salt = picked
        new_salt = next(s for s in SALTS if s != salt)
        gone = self.mgr.table[scoped_id(tid, salt)]
        ctx = self.eng.finished_contexts.get((tid, "main")) or list(SYSTEM)
        old_turn = None
        if straggler:
            old_turn = self.eng.new_request(tid, "main", ctx[:20] + tail, max_new=1, salt=salt)
        self.clock.advance(0.01)
        looked_up = {
            rid for rid, key in self.mgr.reqs._waiting.items() if key == gone.trajectory_id
        } | {rid for rid, r in self.mgr.requests.items() if r.traj is gone}
        queued = {
            rid
            for rid, r in self.eng.requests.items()
            if r.status == "WAITING"
            and r.params.prefetch is None
            and rid not in self.mgr.requests
            and scoped_id(r.traj_id, r.salt) == gone.trajectory_id
        }
        jobs = {j for j, job in self.mgr.jobs.items() if job.trajectory is gone}
        releases = self.mgr.counters["salt_generation_releases"]
        new = self.eng.new_request(tid, "main", ctx[:20] + tail, max_new=1, salt=new_salt)
        self.eng.schedule(new)  # its first lookup, whatever the pool then says
        assert new.req_id not in self.mgr.reqs._orphans  # it arrived after every DELETE
        assert gone.deleted and scoped_id(tid, salt) not in self.mgr.table
        assert self.mgr.get(tid, tenant=salt)[0] == 404
        assert self.mgr.counters["salt_generation_releases"] > releases
        self.looked_up_before_delete |= looked_up | queued
        self.jobs_at_delete[id(gone)] = jobs
        self.deleted.append(gone)
        self.deleted_ids.add(picked)
        self._engine_loop(2, 0xFFFF, 0.01)
        if old_turn is not None and old_turn.status == "FINISHED":
            assert old_turn.stats is None, old_turn.stats  # vanilla: no turn of any trajectory
        if new.req_id in self.mgr.requests:
            assert not self.mgr.requests[new.req_id].traj.deleted

    @precondition(lambda self: len(self.eng.requests) < 4)
    @rule(
        traj=st.integers(0, 5),
        branch=st.sampled_from(["main", "main", "f1"]),
        cut=st.integers(0, 40),
        tail=st.lists(st.integers(1, 3), min_size=1, max_size=9),
        wait=st.sampled_from([*WAITS, "no pause"]),
        tool=st.sampled_from(["t1", "t2"]),
        gap=st.sampled_from([0.01, 0.6, 3.0, 30.0, 150.0]),
        jobs=st.sampled_from([0xFFFF, 0xFFFF, 0x5555, 0]),
        flush=st.booleans(),
        salt=st.sampled_from(SALTS),
    )
    def agent_turn(
        self,
        traj: int,
        branch: str,
        cut: int,
        tail: list[int],
        wait: float | str | None,
        tool: str,
        gap: float,
        jobs: int,
        flush: bool,
        salt: str | None,
    ) -> None:
        """What an agent does: one turn runs to its end (the engine loops meanwhile), the
        harness declares the tool call (pause), the tool runs for ``gap`` seconds (meanwhile
        other traffic may ``flush`` vLLM's prefix cache)."""
        before = set(self.eng.requests)
        self.new_request(traj, branch, cut, True, tail, 1, salt)
        (rid,) = set(self.eng.requests) - before
        req = self.eng.requests[rid]
        for _ in range(6):
            self._engine_loop(1, jobs, 0.01)
            if req.status == "FINISHED":
                break
        assert self.mgr is not None
        if req.status == "FINISHED" and wait != "no pause":
            assert not isinstance(wait, str)
            self.mgr.pause(req.traj_id, req.branch, tool, wait, tenant=req.salt)
        if flush:
            self.flush_cache()
        self.clock.advance(gap)
        self._engine_loop(1, jobs, 0.01)
        self.eng.issue_prefetches()  # the adapter's pump, while the tool runs
        self._engine_loop(2, jobs, 0.01)

    agent_turn_2 = agent_turn

    @precondition(lambda self: bool(self.eng.requests) or bool(self.workers.pending))
    @rule(
        iters=st.integers(1, 4),
        jobs=st.sampled_from([0, 0xFFFF, 0xFFFF, 0x5555, 0x0F0F]),
        dt=st.sampled_from([0.01, 0.01, 0.6]),
    )
    def engine_loop(self, iters: int, jobs: int, dt: float) -> None:
        """A few whole engine iterations, as vLLM runs them: schedule the waiting requests,
        ship the plan, one forward of every running request, finish the done ones, the
        workers complete the jobs ``jobs`` (a bit mask) selects, their reports come back."""
        self._engine_loop(iters, jobs, dt)

    @rule(steps=st.integers(4, 24))
    def quiet_pool(self, steps: int) -> None:
        """Engine steps 10 s apart with nothing new scheduled: the pool's fill rate decays, so
        its eviction forecast grows and offload_host copies are deferred (CACHED)."""
        for _ in range(steps):
            self.eng.step()
            self.eng.deliver_reports()
            self.clock.advance(10.0)

    # The engine loop is what an engine mostly does: weigh it up (rules are drawn uniformly).
    engine_loop_2 = engine_loop
    engine_loop_3 = engine_loop

    def _engine_loop(self, iters: int, jobs: int, dt: float) -> None:
        eng = self.eng
        for _ in range(iters):
            for req in eng.active("WAITING"):
                if not eng.schedule(req):
                    break
            eng.step()
            for req in eng.active("RUNNING"):
                if eng.can_compute(req) and not eng.compute(req):
                    eng.preempt(req)
            for req in eng.active("RUNNING"):
                if eng.can_finish(req) and len(req.output) >= req.max_new:
                    eng.finish(req)
            for n, p in enumerate(self.workers.completable()):
                if jobs >> (n % 16) & 1:
                    self.workers.complete(p, True)
            eng.deliver_reports()
            self.clock.advance(dt)

    @rule()
    def issue_prefetches(self) -> None:
        """The adapter's timer pump: device-prefetch orders become internal requests (one new
        token, never a turn), cancels abort theirs."""
        self.eng.issue_prefetches()

    @rule(i=st.integers(0, 3), adapter_error=st.sampled_from([False, False, True]))
    def schedule(self, i: int, adapter_error: bool) -> None:
        req = self._pick_request(i, lambda r: r.status == "WAITING")
        if req is not None:
            self.eng.schedule(req, adapter_error)

    @rule(pick=st.lists(st.integers(0, 63), max_size=6), unknown=st.integers(0, 2))
    def fetch_remote(self, pick: list[int], unknown: int) -> None:
        """A trajectory this replica never saw: the adapter fetches its prompt's blocks from the
        remote tier (some there, some never written) before the lookup."""
        mgr = self.mgr
        if mgr is None:
            return
        written = sorted(set().union(*(r.keys() for r in self.workers.remote)))
        keys = [written[i % len(written)] for i in pick] if written else []
        keys += [bytes([0xEE, n]) * 8 for n in range(unknown)]
        self.next_traj += 1
        mgr.fetch_remote(f"t{self.next_traj}", keys, tenant=SALTS[unknown])

    @rule(glitch=st.sampled_from([False, False, True]))
    def engine_step(self, glitch: bool) -> None:
        """build_connector_meta; with ``glitch`` the pool raises inside the manager's tick."""
        if glitch:
            self.pool.usage_error = RuntimeError("pool glitch")
        self.eng.step()
        self.pool.usage_error = None

    @precondition(lambda self: self.quiet)
    @rule()
    def worker_reports(self) -> None:
        self.eng.deliver_reports()

    @precondition(lambda self: self.quiet)
    @rule(i=st.integers(0, 3), chunk=st.sampled_from([None, BS, 1]))
    def compute(self, i: int, chunk: int | None) -> None:
        req = self._pick_request(i, self.eng.can_compute)
        if req is None:
            return
        if not self.eng.compute(req, chunk):
            self.eng.preempt(req)

    @precondition(lambda self: self.quiet)
    @rule(i=st.integers(0, 3))
    def finish(self, i: int) -> None:
        req = self._pick_request(i, self.eng.can_finish)
        if req is not None:
            self.eng.finish(req)

    @precondition(lambda self: self.quiet)
    @rule(i=st.integers(0, 3))
    def finish_implicit(self, i: int) -> None:
        """A finish taken as an implicit pause (an in-process rollout that never pauses):
        never while a request of the branch runs, never over a pause the turn already had."""
        req = self._pick_request(i, self.eng.can_finish)
        if req is None or req.params.prefetch is not None or self.eng.finish(req) is None:
            return
        p, mgr = req.params, self.mgr
        assert mgr is not None
        traj = mgr.table.get(p.key)
        b = traj.branches.get(p.branch) if traj is not None else None
        busy = b is not None and bool(b.running)
        paused = b is not None and b.paused_at is not None
        reply = mgr.pause_finished(p.trajectory_id, p.branch, "env", tenant=p.tenant)
        assert reply["implicit"], reply
        if b is None:
            assert reply.get("skipped") == "unknown", reply
        elif busy:
            assert reply.get("skipped") == "running", reply
        elif paused:
            assert reply.get("skipped") in ("queued", "paused"), reply
        elif "skipped" not in reply:
            assert b.tool == "env" and b.paused_at is not None, reply

    @precondition(lambda self: self.quiet)
    @rule(i=st.integers(0, 3))
    def abort(self, i: int) -> None:
        req = self._pick_request(i, lambda r: not r.aborted_waiting)
        if req is not None:
            self.eng.abort(req)

    @precondition(lambda self: self.quiet)
    @rule(i=st.integers(0, 3))
    def preempt(self, i: int) -> None:
        req = self._pick_request(i, self.eng.can_compute)
        if req is not None:
            self.eng.preempt(req)

    # ------------------------------------------------------------------ workers
    @rule(i=st.integers(0, 15), outcome=st.sampled_from(OUTCOMES))
    def complete_job(self, i: int, outcome: str) -> None:
        """One rank finishes one job: done, a block I/O error, or it failed to start."""
        pending = self.workers.completable()
        if pending:
            self.workers.complete(pending[i % len(pending)], outcome)  # type: ignore[arg-type]

    @rule(rank=st.integers(0, 1), i=st.integers(0, 15))
    def damage_disk_copy(self, rank: int, i: int) -> None:
        """A disk file on one rank no longer verifies (a flipped bit, a truncated write): its
        next read is an error (corrupt) and the copy is gone."""
        store = self.workers.stores[rank % self.tp]
        keys = sorted(store.disk)
        if keys:
            self.workers.damage(rank % self.tp, keys[i % len(keys)])

    @rule()
    def complete_all_jobs(self) -> None:
        for p in self.workers.completable():
            self.workers.complete(p, True)

    @precondition(lambda self: self.tp == 2 and not self.workers.silent)
    @rule()
    def silence_rank(self) -> None:
        self.workers.silent.add(1)

    @precondition(lambda self: bool(self.workers.silent))
    @rule(newest_first=st.booleans())
    def wake_rank(self, newest_first: bool) -> None:
        self.workers.wake(1, newest_first)

    # ------------------------------------------------------------------ clock
    @rule(dt=st.sampled_from(CLOCK_STEPS))
    def advance_clock(self, dt: float) -> None:
        self.clock.advance(dt)

    # ------------------------------------------------------------------ pressure
    @precondition(lambda self: len(self.eng.spikes) < 3)
    @rule(n=st.integers(4, 24))
    def spike(self, n: int) -> None:
        self.eng.spike(n)

    @rule()
    def release_spike(self) -> None:
        self.eng.release_spike()

    @rule()
    def flush_cache(self) -> None:
        """Other traffic takes every free block for a moment: unpinned device copies are gone."""
        if self.eng.spike(self.pool.num_free()):
            self.pool.free(self.eng.spikes.pop())

    # ------------------------------------------------------------------ the end
    def _drain_everything(self) -> None:
        mgr, eng = self.mgr, self.eng
        assert mgr is not None
        if self.workers.silent:
            self.workers.wake(1)
        for _ in range(6):
            for req in list(eng.requests.values()):
                if req.status == "FINISHED" or req.aborted_waiting:
                    continue
                if eng._awaiting_cover:
                    eng.step()
                eng.abort(req)
            for tid, salt in self._live_ids():
                assert mgr.delete(tid, tenant=salt)[0] == 200
            for _ in range(4):
                eng.step()
                for p in self.workers.completable():
                    self.workers.complete(p, True)
                eng.deliver_reports()
            self.clock.advance(2 * TIMEOUT)
            eng.step()
            eng.deliver_reports()
            if not eng.requests and not mgr.jobs and not mgr.has_work():
                break
        assert not eng.violations, eng.violations
        assert not eng.requests, list(eng.requests)
        assert not mgr.jobs, mgr.jobs
        assert not mgr.tombstones
        assert not mgr._pins, mgr._pins
        assert not any(self.pool.pins), self.pool.pins
        assert len(mgr.index) == 0, [k.hex()[:8] for k in mgr.index]
        for rank in range(self.tp):
            for tier in ("host", "disk"):
                assert not self.workers.tiers[rank][tier], (rank, tier)
        for tier in ("host", "disk"):
            assert mgr.index.reserved(tier) == 0  # type: ignore[arg-type]


# Profiles (AGENTKV_HYPOTHESIS_PROFILE): "default" -- 500 programs of up to 50 steps, ~20-60 s on
# 2 shared cores, what `make test` runs; "deep" -- 5,000 programs of up to 150 steps, what
# `make test-deep` runs (~20-40 min). AGENTKV_STATEFUL_EXAMPLES / AGENTKV_STATEFUL_STEPS override
# either for a longer hunt.
# "mutation" (scripts/mutation.sh) runs 100 programs without shrinking: a mutant's run costs ~5x
# less on 2 shared cores; its kills are a lower bound of the default profile's (docs/testing.md).
PROFILES = {"default": (500, 50), "deep": (5000, 150), "mutation": (100, 50)}
PROFILE = os.environ.get("AGENTKV_HYPOTHESIS_PROFILE", "default")
if PROFILE not in PROFILES:
    raise ValueError(f"AGENTKV_HYPOTHESIS_PROFILE={PROFILE!r}: one of {sorted(PROFILES)}")
ManagerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("AGENTKV_STATEFUL_EXAMPLES", PROFILES[PROFILE][0])),
    stateful_step_count=int(os.environ.get("AGENTKV_STATEFUL_STEPS", PROFILES[PROFILE][1])),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    phases=[Phase.explicit, Phase.reuse, Phase.generate] if PROFILE == "mutation" else list(Phase),
)
TestManagerStateful = ManagerMachine.TestCase
