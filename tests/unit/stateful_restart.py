"""The restart rules of the manager's state machine (test_manager_stateful.py), as a mixin:
hypothesis collects ``@rule`` methods from every base class.

Primitives:
    RestartRules    restart (a clean stop and a new engine process on the same disk tier, the
                    manifest written and restored as agentkv.manager.recovery does; its twin
                    restart_2 weighs it up while a branch is offloaded to disk) and
                    long_tool_call (the pause that offloads a branch to disk: what a restart
                    is about).
The machine supplies the state (self.mgr, self.eng, self.pool, self.workers, self.keeper...)
and the helpers ``_start`` (an engine process starting: a new manager, the manifest restored),
``_engine_loop`` and ``_pick_traj``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hypothesis.strategies as st
from hypothesis.stateful import precondition, rule

from agentkv.kv_identity import BASE_GENERATION
from agentkv.manager import BranchState
from agentkv.manager.recovery import manifest_keys
from agentkv.manager.state import scoped_id
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
    identity: bytes
    disk_root: Path
    deleted_ids: set[tuple[str, str | None]]

    if TYPE_CHECKING:  # the machine's helpers

        @property
        def quiet(self) -> bool: ...

        def _start(
            self, workers: SimWorkers, contexts: dict[tuple[str, str], list[int]]
        ) -> None: ...

        def _engine_loop(self, iters: int, jobs: int, dt: float) -> None: ...

        def _pick_traj(self, i: int, deleted: bool = False) -> tuple[str, str | None] | None: ...

    @precondition(lambda self: self.quiet)
    @rule(identity=st.sampled_from(["same", "same", "same", "other"]), resume=st.booleans())
    def restart(self, identity: str, resume: bool) -> None:
        """A clean stop and a new engine process on the same disk tier, as production does it
        (agentkv.manager.recovery): the stop writes the manifest (ManifestKeeper.close); the
        device pool, host tier, requests, jobs and timers die with the process, the remote tier
        (another process) and each rank's disk files survive. At start each rank keeps only the
        files a base-generation manifest lists (prune_rank_files), the new manager restores the
        manifest's records. ``other``: the new process runs other weights or another KV format
        (another identity): its keys name nothing written before (a fresh remote namespace) and
        the old files do not carry its fingerprint. ``resume``: the agent of a restored
        trajectory sends its next turn right away (it loads the surviving files)."""
        old = self.mgr
        assert old is not None
        self.eng.deliver_reports()  # the last step's reports arrive before the stop
        self.keeper.close()
        live = {t.trajectory_id for t in old.table.values() if not t.deleted}
        # prune_rank_files: a file stays when its header carries this rank's identity and a
        # base-generation manifest lists its key.
        keep = manifest_keys(self.disk_root, BASE_GENERATION) if identity == "same" else set()
        if identity == "other":
            self.identity = os.urandom(16)
        self.pool = SimPool(POOL, self.tp)  # a new device pool: nothing cached, nothing pinned
        workers = SimWorkers(self.pool, self.tp, self.workers.capacity)
        for rank, store in enumerate(workers.stores):
            survived = self.workers.stores[rank]
            store.disk = {k: v for k, v in survived.disk.items() if k in keep}
            store.damaged = survived.damaged & set(store.disk)
        if identity == "same":
            workers.remote = self.workers.remote
        workers.published_truth = self.workers.published_truth
        self._start(workers, self.eng.finished_contexts)
        assert self.mgr is not None
        # Nothing of a deleted trajectory comes back; only what lived at the stop does.
        back = set(self.mgr.table)
        assert back <= live, sorted(back - live)
        for tid, salt in self.deleted_ids:
            if scoped_id(tid, salt) not in live:
                assert self.mgr.get(tid, tenant=salt)[0] == 404, (tid, salt)
        for traj in self.mgr.table.values():
            for b in traj.branches.values():
                assert b.state is BranchState.OFFLOADED and b.keys, (traj.trajectory_id, b.name)
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

    def _disk_offloaded(self) -> bool:
        mgr = self.mgr
        return (
            mgr is not None
            and self.quiet
            and any(
                b.state is BranchState.OFFLOADED and b.tier == "disk"
                for t in mgr.table.values()
                for b in t.branches.values()
            )
        )

    # What a restart is about: weigh it up while some branch is offloaded to disk.
    restart_2 = precondition(lambda self: self._disk_offloaded())(restart)
