"""The control-channel rules of the manager's state machine (test_manager_stateful.py), as a
mixin: hypothesis collects ``@rule`` methods from every base class.

Primitives:
    ControlRules    what the harness sends on the control channel: pause (tiny to huge waits,
                    also of a deleted trajectory), pause_as_another_tenant (must not reach the
                    trajectory), resume, DELETE (another tenant's first: a 404 that changes
                    nothing; then the owner's, remembering what ran then for invariant 4),
                    and the control thread's tick.
    WAITS           the declared waits (seconds; None: unknown) the pause rules draw.
The machine supplies the state (self.mgr and the deletion bookkeeping invariant 4 reads) and
the helper ``_pick_traj``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import hypothesis.strategies as st
from hypothesis.stateful import rule

from agentkv.manager.state import scoped_id
from tests.unit.stateful_invariants import SALTS

WAITS = [None, 0.0, 0.001, 0.05, 2.0, 30.0, 400.0, 1e5]
# What both pause rules draw: a trajectory (index into the live ones), a branch, a wait, a tool.
PAUSE_ARGS = {
    "traj": st.integers(0, 5),
    "branch": st.sampled_from(["main", "f1"]),
    "wait": st.sampled_from(WAITS),
    "tool": st.sampled_from(["t1", "t2"]),
}


class ControlRules:
    """The control-channel rules; the machine's setup builds the state they read."""

    mgr: Any
    eng: Any
    deleted: list[Any]
    deleted_ids: set[tuple[str, str | None]]
    looked_up_before_delete: set[str]
    jobs_at_delete: dict[int, set[int]]

    if TYPE_CHECKING:  # the machine's helper

        def _pick_traj(self, i: int, deleted: bool = False) -> tuple[str, str | None] | None: ...

        def deleted_durably(self, trajectory_key: str) -> None: ...

    @rule(**PAUSE_ARGS)
    def pause(
        self, traj: int, branch: str, wait: float | None, tool: str, other: bool = False
    ) -> None:
        """A pause of a live (or deleted) trajectory; with ``other``, under another tenant: it
        must not reach the trajectory (a 404, or that tenant's own trajectory of the id)."""
        assert self.mgr is not None
        picked = self._pick_traj(traj, deleted=True)
        if picked is None:
            return
        tid, salt = picked
        if other:
            salt = next(s for s in SALTS if s != salt)
        before = self._snapshot(tid, picked[1])
        code, body = self.mgr.pause(tid, branch, tool, wait, tenant=salt)
        if scoped_id(tid, salt) not in self.mgr.table:
            assert code == 404, body
        if other:
            assert self._snapshot(tid, picked[1]) == before
        if code == 200 and not body["applied"]:
            assert body.get("reason"), body

    @rule(traj=st.integers(0, 5))
    def resume(self, traj: int) -> None:
        assert self.mgr is not None
        picked = self._pick_traj(traj)
        if picked is not None:
            self.mgr.resume(picked[0], "main", tenant=picked[1])

    @rule(traj=st.integers(0, 5))
    def delete(self, traj: int) -> None:
        assert self.mgr is not None
        picked = self._pick_traj(traj)
        if picked is None:
            return
        tid, salt = picked
        # Another tenant first: its DELETE of the same id never touches this trajectory.
        other = next(s for s in SALTS if s != salt)
        before = self._snapshot(tid, salt)
        if scoped_id(tid, other) not in self.mgr.table:
            assert self.mgr.delete(tid, tenant=other)[0] == 404
            assert self.mgr.get(tid, tenant=other)[0] == 404
            assert self._snapshot(tid, salt) == before
        gone = self.mgr.table[scoped_id(tid, salt)]
        # Requests looked up before the DELETE (running, or PENDING on a fetch or admission):
        # none of them may ever run on a live trajectory again.
        self.looked_up_before_delete |= {
            rid for rid, key in self.mgr.reqs._waiting.items() if key == gone.trajectory_id
        } | {rid for rid, r in self.mgr.requests.items() if r.traj is gone}
        # Turns queued in vLLM and never looked up yet (issue 40 item 9): they arrived before
        # the DELETE, so they must never re-create the trajectory either.
        self.looked_up_before_delete |= {
            rid
            for rid, r in self.eng.requests.items()
            if r.status == "WAITING"
            and r.params.prefetch is None
            and rid not in self.mgr.requests
            and scoped_id(r.traj_id, r.salt) == gone.trajectory_id
        }
        self.jobs_at_delete[id(gone)] = {
            j for j, job in self.mgr.jobs.items() if job.trajectory is gone
        }
        code, _ = self.mgr.delete(tid, tenant=salt)
        assert code == 200
        self.deleted_durably(gone.trajectory_id)  # the control op's, before its 200
        self.deleted.append(gone)
        self.deleted_ids.add(picked)
        assert self.mgr.get(tid, tenant=salt)[0] == 404

    @rule(**PAUSE_ARGS)
    def pause_as_another_tenant(
        self, traj: int, branch: str, wait: float | None, tool: str
    ) -> None:
        self.pause(traj, branch, wait, tool, other=True)

    def _snapshot(self, tid: str, salt: str | None) -> Any:
        """What another tenant must never change: the trajectory's turns, branch states, pins
        and owned keys."""
        assert self.mgr is not None
        t = self.mgr.table.get(scoped_id(tid, salt))
        if t is None:
            return None
        return (
            t.turn_count,
            {n: (b.state, list(b.pinned), list(b.keys)) for n, b in t.branches.items()},
            set(t.owned),
        )

    @rule()
    def control_tick(self) -> None:
        """The control thread's tick (the engine idle): only queues engine work."""
        assert self.mgr is not None
        t = threading.Thread(target=self.mgr.tick)
        t.start()
        t.join()
