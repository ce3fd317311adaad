"""The restart rules of the manager's state machine (test_manager_stateful.py), as a mixin:
hypothesis collects ``@rule`` methods from every base class.

Primitives:
    RestartRules    restart (a clean stop, or with ``crash`` a kill -9, and a new engine process
                    on the same disk tier, the manifest written and restored as
                    agentkv.manager.recovery does; its twin restart_2 weighs it up while a
                    branch is offloaded to disk), keeper_tick (the ManifestKeeper's periodic
                    rewrite) and long_tool_call (the pause that offloads a branch to disk: what
                    a restart is about); ``attach_disk`` lays each rank's disk tier out as
                    production does (tiers.disk.rank_dir: one folder per DP and TP rank under
                    one disk root shared by every DP rank of the machine).
Invariant: every queued device-prefetch order carries its trajectory's cache_salt (issue 40
item 8: restored trajectories keep their tenant).
The machine supplies the state (self.mgr, self.eng, self.pool, self.workers, self.keeper...)
and the helpers ``_start`` (an engine process starting: a new manager, the manifest restored),
``_engine_loop`` and ``_pick_traj``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hypothesis.strategies as st
from hypothesis.stateful import invariant, precondition, rule

from agentkv.manager import BranchState
from agentkv.manager.recovery import Manifest, manifest_path
from agentkv.manager.state import scoped_id
from agentkv.tiers.disk import rank_dir
from tests.unit.sim_engine import SimPool, SimWorkers
from tests.unit.stateful_invariants import POOL, SALT_OF


class RestartRules:
    """The restart rules; the machine's setup builds the state they read."""

    mgr: Any
    eng: Any
    pool: Any
    workers: Any
    keeper: Any
    tp: int
    config: Any
    dp_rank: int
    identity: bytes
    disk_root: Path
    deleted_ids: set[tuple[str, str | None]]
    # The block files under disk_root, per folder: they outlive engine processes, and every DP
    # rank of the machine sees the same root.
    disk_files: dict[Path, dict[bytes, Any]]

    if TYPE_CHECKING:  # the machine's helpers

        @property
        def quiet(self) -> bool: ...

        def _start(
            self, workers: SimWorkers, contexts: dict[tuple[str, str], list[int]]
        ) -> None: ...

        def _engine_loop(self, iters: int, jobs: int, dt: float) -> None: ...

        def _pick_traj(self, i: int, deleted: bool = False) -> tuple[str, str | None] | None: ...

    def attach_disk(self, workers: SimWorkers) -> None:
        """An engine process's workers open their disk folders (``rank_dir``): what those
        folders hold survives the process; another DP rank's workers never see them."""
        if not hasattr(self, "disk_files"):
            self.disk_files = {}
        for tp_rank, store in enumerate(workers.stores):
            folder = rank_dir(self.disk_root, self.dp_rank, tp_rank)
            store.disk = self.disk_files.setdefault(folder, {})

    @precondition(lambda self: self.quiet)
    @rule(
        identity=st.sampled_from(["same", "same", "same", "other"]),
        resume=st.booleans(),
        crash=st.booleans(),
    )
    def restart(self, identity: str, resume: bool, crash: bool = False) -> None:
        """A clean stop (or with ``crash`` a kill -9) and a new engine process on the same disk
        tier, as production does it (agentkv.manager.recovery): the stop writes the manifest
        (ManifestKeeper.close); a crash leaves the last one written (keeper_tick, a DELETE's
        own rewrite). The device pool, host tier, requests, jobs and timers die with the
        process, the remote tier (another process) and each rank's disk folder survive. The
        new manager restores the manifest's records and exports its keep plan; each worker
        applies it at the first step (the files it lists stay, every other goes, and what it
        lists but lacks is reported missing). ``other``: the new process runs other weights or
        another KV format (another identity): its keys name nothing written before (a fresh
        remote namespace) and its manifest restores nothing. ``resume``: the agent of a
        restored trajectory sends its next turn right away (it loads the surviving files).
        A trajectory DELETE answered 200 never comes back, crash or not (issue 40 item 10)."""
        old = self.mgr
        assert old is not None
        self.eng.deliver_reports()  # the last step's reports arrive before the stop
        if crash:
            self.keeper._stop.set()  # killed: no last write
            self.keeper._thread.join(timeout=5)
        else:
            self.keeper.close()
        self._manifest_written()
        live = {t.trajectory_id for t in old.table.values() if not t.deleted}
        if identity == "other":
            self.identity = os.urandom(16)
        self.pool = SimPool(POOL, self.tp)  # a new device pool: nothing cached, nothing pinned
        workers = SimWorkers(self.pool, self.tp, self.workers.capacity)
        for rank, store in enumerate(workers.stores):
            store.damaged = set(self.workers.stores[rank].damaged)  # its files, not the process
        if identity == "same":
            workers.remote = self.workers.remote
        workers.published_truth = self.workers.published_truth
        self._start(workers, self.eng.finished_contexts)
        assert self.mgr is not None
        # Nothing of a deleted trajectory comes back; only what lived at the stop does (a
        # crash: what lived at the last write).
        back = set(self.mgr.table)
        assert crash or back <= live, sorted(back - live)
        assert not back & self._gone(), sorted(back & self._gone())  # DELETE was durable
        for tid, salt in self.deleted_ids:
            if scoped_id(tid, salt) not in live and not crash:
                assert self.mgr.get(tid, tenant=salt)[0] == 404, (tid, salt)
        for traj in self.mgr.table.values():
            # its tenant's salt (kept, and so in the manifest, only with device prefetch on)
            salt = SALT_OF[traj.tenant] if self.config.device_prefetch else None
            assert traj.salt == salt, (traj.trajectory_id, traj.salt)
            for b in traj.branches.values():
                assert b.state is BranchState.OFFLOADED and b.keys, (traj.trajectory_id, b.name)
        self._engine_loop(1, 0, 0.0)  # the first step: the workers apply the keep plan
        restored = sorted(self.mgr.table.values(), key=lambda t: t.trajectory_id)
        if resume and restored:
            traj = restored[0]
            b = traj.branches[sorted(traj.branches)[0]]
            req = self.eng.new_request(
                traj.name, b.name, [*b.token_ids, 1], max_new=1, salt=SALT_OF[traj.tenant]
            )
            for _ in range(6):
                self._engine_loop(1, 0xFFFF, 0.01)
                if req.status == "FINISHED":
                    break

    @precondition(lambda self: self.quiet)
    @rule()
    def keeper_tick(self) -> None:
        """The ManifestKeeper's thread wakes (every interval_s in production): a crash after
        it restores what this write lists."""
        self.keeper.write_if_changed()
        self._manifest_written()

    @precondition(lambda self: self._disk_offloaded())
    @rule(crash=st.booleans())
    def delete_then_crash(self, crash: bool) -> None:
        """Issue 40 item 10's window, weighed up: the manifest lists a trajectory offloaded to
        disk (the keeper wrote it), its client DELETEs it (200), and the engine is killed (or
        stopped) at once: the restart must not bring it back."""
        assert self.mgr is not None
        self.keeper_tick()
        ids = self._live_ids()
        for i, (tid, salt) in enumerate(ids):
            traj = self.mgr.table[scoped_id(tid, salt)]
            if any(
                b.state is BranchState.OFFLOADED and b.tier == "disk"
                for b in traj.branches.values()
            ):
                self.delete(i)  # type: ignore[attr-defined]  # ControlRules.delete
                break
        self.restart("same", resume=False, crash=crash)

    def deleted_durably(self, trajectory_key: str) -> None:
        """What the DELETE control op does after the manager's 200 and before its answer
        (ControlOps._apply -> ManifestKeeper.durable_delete): from then on no manifest on disk
        lists the trajectory, so no crash can restore it."""
        self.keeper.durable_delete(trajectory_key)
        self._gone().add(trajectory_key)
        self._manifest_written()
        assert trajectory_key in self._gone(), f"the manifest still lists {trajectory_key}"

    def _gone(self) -> set[str]:
        """This DP rank's trajectory keys deleted by a client and in no manifest written since
        (each DP rank its own: the same id may live on another)."""
        if not hasattr(self, "gone_by_rank"):
            self.gone_by_rank: dict[int, set[str]] = {}
        return self.gone_by_rank.setdefault(self.dp_rank, set())

    def _manifest_written(self) -> None:
        """A manifest write: a deleted key it lists again is a new trajectory of that id (a
        turn after the DELETE), no longer a deleted one."""
        on_disk = Manifest.read(manifest_path(self.disk_root, self.dp_rank))
        if on_disk is not None:
            self._gone().difference_update(r.trajectory_id for r in on_disk.records)

    @invariant()
    def prefetch_orders_carry_their_tenant(self) -> None:
        """An order's internal request hashes in its trajectory's namespace: never the
        unsalted one for a salted trajectory (a restored one included)."""
        mgr = self.mgr
        if mgr is None:
            return
        for traj, _, order in mgr.prefetcher.orders:
            assert order.cache_salt == SALT_OF[traj.tenant], (traj.trajectory_id, order.ticket)

    @precondition(lambda self: self.quiet and self.workers.capacity["disk"] > 0)
    @rule(traj=st.integers(0, 5), wait=st.sampled_from([400.0, 1e5]))
    def long_tool_call(self, traj: int, wait: float) -> None:
        """A human-in-the-loop wait: the pause offloads the branch to disk (or drops it when
        the disk is full) and the engine idles meanwhile, so the store completes."""
        assert self.mgr is not None
        picked = self._pick_traj(traj)
        if picked is None:
            return
        self.mgr.pause(picked[0], "main", "human", wait, tenant=picked[1])
        self._engine_loop(3, 0xFFFF, 0.01)

    @precondition(
        lambda self: (
            self.quiet
            and self.workers.capacity["disk"] > 0
            and any(t.tenant for t in self.mgr.table.values())
        )
    )
    @rule(crash=st.booleans())
    def tenant_to_disk_then_restart(self, crash: bool) -> None:
        """A tenant's trajectory goes to disk and the engine restarts: it comes back in its
        namespace with its salt (issue 40 item 8), weighed up (rules are drawn uniformly)."""
        assert self.mgr is not None
        for i, (_, salt) in enumerate(self._live_ids()):
            if salt:
                self.long_tool_call(i, 400.0)
                break
        if crash:
            self.keeper_tick()
        self.restart("same", resume=False, crash=crash)

    def _disk_offloaded(self, salted: bool = False) -> bool:
        mgr = self.mgr
        return (
            mgr is not None
            and self.quiet
            and any(
                b.state is BranchState.OFFLOADED and b.tier == "disk"
                for t in mgr.table.values()
                if t.tenant or not salted
                for b in t.branches.values()
            )
        )

    # What a restart is about: weigh it up while some branch is offloaded to disk, and while
    # a tenant's is (it must come back in its namespace, with its salt: issue 40 item 8).
    restart_2 = precondition(lambda self: self._disk_offloaded())(restart)
    restart_salted = precondition(lambda self: self._disk_offloaded(salted=True))(restart)
