"""The control ops the scheduler side answers on the control thread (``control.ControlServer``).

Primitives:
  ControlOps.handle(req)   one op: ping, tick (fire due timers; says whether the engine must be
                           woken, when the next timer and the next PREFETCH timer are due, the
                           engine's step count, and the device prefetches to issue or cancel),
                           status, metrics, pause, resume, end, get, known (is a trajectory
                           still held: 200 or 404); any other op 400
  REPLAYABLE_OPS           the ops a retry must not apply twice (pause, resume, end)
  REPLAYED_FIELD           set in an answer that replays an earlier one (the route turns it into
                           a header)
  WAKE_FIELD               in the answer of each op of WAKE_OPS: whether the route must wake
                           vLLM's loop for the work the op left (``SchedulerSide.wake_needed``)

``status`` answers the caller's tenant's view (``tenant_view``): its own trajectory ids and
aggregate numbers only; the route sets ``OPERATOR_FIELD`` for the cross-tenant operator view
(every tenant's ids, the learned tool waits, per-tool prefetch outcomes).

A pause, resume or end carrying ``idempotency_key`` is applied once: a retry with the same key
(same tenant) answers the first answer again (``agentkv.idempotency.ReplayCache``).

``ControlOps`` is a mixin of ``SchedulerSide``: it reads ``manager`` and ``replays`` and, for
status and metrics, the side's own ``status()`` and ``metrics_snapshot()``.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from agentkv.idempotency import KEY_FIELD
from agentkv.ids import TENANT_FIELD
from agentkv.manager.state import scoped_id, tenant_digest

if TYPE_CHECKING:
    from agentkv.idempotency import ReplayCache
    from agentkv.manager import TrajectoryManager
    from agentkv.metrics import Snapshot

# Control ops a retry must not apply twice (GET, status and metrics are safe already).
REPLAYABLE_OPS = frozenset({"pause", "resume", "end"})
# Set in a control answer that replays an earlier answer; the route turns it into a header.
REPLAYED_FIELD = "_idempotent_replayed"
# Set in the answer of each op of WAKE_OPS (the route ops that may leave engine work); the
# route pops it and wakes the engine loop only when it is true. A wake is a utility call (~0.4
# ms of the engine thread, more of the API server's) that a stepping engine does not need: it
# picks the work up at its next step.
WAKE_FIELD = "_wake_engine"
WAKE_OPS = frozenset({"pause", "resume", "end", "get", "status"})
# Set by the status route when the caller holds the operator key: the cross-tenant view.
OPERATOR_FIELD = "operator"
MAX_STATUS_IDS = 1000


class ControlOps:
    """The control thread's ops over the manager (a mixin: see the module docstring)."""

    manager: TrajectoryManager
    replays: ReplayCache

    def status(self) -> dict[str, Any]:
        raise NotImplementedError

    def metrics_snapshot(self) -> Snapshot:
        raise NotImplementedError

    def wake_needed(self) -> bool:
        raise NotImplementedError

    def delete_durable(self, trajectory_key: str) -> None:
        """After a DELETE, before its answer: no restart manifest lists the trajectory (the
        side's ``ManifestKeeper.durable_delete``); no manifest: nothing to do."""

    def handle(self, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        status, body = self._handle(req)
        if req.get("op") in WAKE_OPS:
            body = {**body, WAKE_FIELD: self.wake_needed()}
        return status, body

    def _handle(self, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        op = req.get("op")
        mgr = self.manager
        tid = str(req.get("trajectory_id"))
        branch = str(req.get("branch") or "main")
        # The trajectory's tenant (its requests' cache_salt); none: the unsalted namespace.
        tenant = str(req[TENANT_FIELD]) if req.get(TENANT_FIELD) else None
        if op == "ping":
            return 200, {"pong": True}
        if op == "tick":
            next_in = mgr.tick()
            orders, cancels = mgr.take_prefetch_work()
            return 200, {
                "next_in_s": next_in,
                # The pump's back-off (agentkv_vllm.pump): engine steps since start (timers
                # fire on each) and the next PREFETCH timer, which only a tick collects.
                "steps": mgr.steps,
                "prefetch_in_s": mgr.next_prefetch_due(),
                "engine_work": mgr.engine_work_pending(),
                # Device prefetches for the pump to issue as internal requests, and the
                # tickets of those to abort (a resume or DELETE came first).
                "prefetch": [o.to_wire() for o in orders],
                "cancel": cancels,
            }
        mgr.tick()
        if op == "status":
            body = self.status()
            if req.get(OPERATOR_FIELD) is True:
                return 200, {**body, "view": "operator"}
            return 200, tenant_view(body, self._tenant_ids(tenant))
        if op == "metrics":
            return 200, self.metrics_snapshot()
        if op in REPLAYABLE_OPS and req.get(KEY_FIELD):
            # A retried call with the same key answers the first call's answer (the route's
            # 503 on a timeout does not mean the engine did not apply it).
            status, body, replayed = self.replays.run(
                str(req[KEY_FIELD]), tenant, req, lambda: self._apply(op, req, tid, branch, tenant)
            )
            return status, {**body, REPLAYED_FIELD: True} if replayed else body
        return self._apply(op, req, tid, branch, tenant)

    def _tenant_ids(self, tenant: str | None) -> list[str]:
        """The trajectory ids of ``tenant``'s namespace (None: the unsalted one)."""
        digest = tenant_digest(tenant) if tenant else None
        with self.manager.lock:
            mine = (t.name for t in self.manager.table.values() if t.tenant == digest)
            return list(itertools.islice(mine, MAX_STATUS_IDS))

    def _apply(
        self, op: object, req: dict[str, Any], tid: str, branch: str, tenant: str | None
    ) -> tuple[int, dict[str, Any]]:
        mgr = self.manager
        if op == "pause":
            wait = req.get("expected_wait_s")
            cap = req.get("max_lease_s")
            tools = req.get("tools")
            return mgr.pause(
                tid,
                branch,
                [str(t) for t in tools] if tools else str(req.get("tool") or "unknown"),
                float(wait) if wait is not None else None,
                max_lease_s=float(cap) if cap is not None else None,
                tenant=tenant,
            )
        if op == "resume":
            return mgr.resume(tid, branch, tenant=tenant)
        if op == "end":
            code, body = mgr.delete(tid, tenant=tenant)
            if code == 200:
                try:  # durable before the 200: a crash now must not restore it
                    self.delete_durable(scoped_id(tid, tenant))
                except OSError as exc:
                    return 503, {"detail": f"deleted, but the restart manifest kept it ({exc})"}
            return code, body
        if op == "get":
            return mgr.get(tid, tenant=tenant)
        if op == "known":
            # Whether the trajectory is still held (the hooks ask before a resent Responses
            # conversation continues it): a get without the view it would build.
            if mgr.knows(tid, tenant):
                return 200, {"known": True}
            return 404, {"detail": f"unknown trajectory {tid!r}"}
        return 400, {"detail": f"unknown op {op!r}"}


def tenant_view(body: dict[str, Any], own_ids: list[str]) -> dict[str, Any]:
    """The status ``body`` as one tenant may see it: ``trajectory_ids`` are its own; what names
    or comes from another tenant's trajectories (tool names learned from their pauses, per-tool
    prefetch outcomes, the last unblocked request's id) is left out. Counts stay: they are
    aggregates over every tenant and name nothing."""
    out = {**body, "view": "tenant", "trajectory_ids": own_ids}
    out.pop("predictor", None)
    if isinstance(out.get("device_prefetch"), dict):
        out["device_prefetch"] = {
            k: v for k, v in out["device_prefetch"].items() if k != "per_tool"
        }
    pool = out.get("pool")
    if isinstance(pool, dict) and isinstance(pool.get("last_unblocked"), dict):
        unblocked = {k: v for k, v in pool["last_unblocked"].items() if k != "request_id"}
        out["pool"] = {**pool, "last_unblocked": unblocked}
    return out
