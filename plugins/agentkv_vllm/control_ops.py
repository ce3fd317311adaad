"""The control ops the scheduler side answers on the control thread (``control.ControlServer``).

Primitives:
  ControlOps.handle(req)   one op: ping, tick (fire due timers; says whether the engine must be
                           woken, when the next timer and the next PREFETCH timer are due, the
                           engine's step count, and the device prefetches to issue or cancel),
                           status, metrics, pause, resume, end, get; any other op 400
  REPLAYABLE_OPS           the ops a retry must not apply twice (pause, resume, end)
  REPLAYED_FIELD           set in an answer that replays an earlier one (the route turns it into
                           a header)
  WAKE_FIELD               in the answer of each op of WAKE_OPS: whether the route must wake
                           vLLM's loop for the work the op left (``SchedulerSide.wake_needed``)

A pause, resume or end carrying ``idempotency_key`` is applied once: a retry with the same key
(same tenant) answers the first answer again (``agentkv.idempotency.ReplayCache``).

``ControlOps`` is a mixin of ``SchedulerSide``: it reads ``manager`` and ``replays`` and, for
status and metrics, the side's own ``status()`` and ``metrics_snapshot()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentkv.idempotency import KEY_FIELD

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
        tenant = str(req["cache_salt"]) if req.get("cache_salt") else None
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
            return 200, self.status()
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
            return mgr.delete(tid, tenant=tenant)
        if op == "get":
            return mgr.get(tid, tenant=tenant)
        return 400, {"detail": f"unknown op {op!r}"}
