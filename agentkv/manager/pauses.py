"""Pauses: the client's pause and resume of a branch, decided by the policy.

Primitives:
  Pauses.pause        predict the tool's wait, ``policy.decide`` (with the pool's eviction
                      forecast under ``Writeback.FORECAST``), record the pause on the branch
                      (tool, prediction, prefetch time, metrics, trace), then carry the decision
                      out (``Transitions.apply_decision``: now, or when the running turn ends)
  Pauses.resume       the client says the tool returned: an OFFLOADED branch is promoted
  Pauses.note_resume  a pause ends (resume or a new turn): the observed wait trains the
                      predictor; the prefetch outcome (early, late, wasted) is counted
  Pauses.implicit_skip  why a finished turn is not an implicit pause (ImplicitSkip), or None:
                      ``TrajectoryManager.pause_finished`` pauses it then
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from typing import TYPE_CHECKING, Any

from agentkv import metrics as m
from agentkv.manager.decision_log import DecisionLog
from agentkv.manager.state import Branch, BranchState, Trajectory
from agentkv.policy import Action, Decision, PolicyParams, Writeback, decide
from agentkv.predict import WaitEstimate, classify_prefetch
from agentkv.tier import Tier

if TYPE_CHECKING:
    from agentkv.manager.core import TrajectoryManager

log = logging.getLogger("agentkv.manager")


class ImplicitSkip(enum.StrEnum):
    """Why a finished turn was not taken as an implicit pause (the counters' suffix and the
    reply's ``skipped``)."""

    UNKNOWN = "unknown"  # no such trajectory or branch (deleted meanwhile)
    RUNNING = "running"  # another request of the branch runs: its next turn is already here
    QUEUED = "queued"  # a request of the trajectory is looked up and waits (remote, admission)
    PAUSED = "paused"  # a pause came in since the turn started: the explicit one wins


class Pauses:
    def __init__(self, mgr: TrajectoryManager) -> None:
        self.m = mgr
        self.decision_log = DecisionLog()  # one INFO line per decision, rate-limited

    def pause(
        self,
        trajectory_id: str,
        branch_name: str,
        tool: str,
        expected_wait_s: float | None,
        *,
        max_lease_s: float | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Decide and apply (or record, while a request runs) what happens to a paused branch.
        ``max_lease_s`` caps a retain decision's lease (a client's KV retention TTL)."""
        traj = self.m.table.get(trajectory_id)
        if traj is None:
            return 404, {"detail": f"unknown trajectory {trajectory_id!r}"}
        branch = traj.branches.get(branch_name)
        if branch is None:
            detail = f"trajectory {trajectory_id!r} has no branch {branch_name!r}"
            return 404, {"detail": detail}
        now = self.m.clock.now()
        estimate = self.m.predictor.predict(tool, expected_wait_s)
        decision = self._decide(branch, estimate)
        if self.m.config.policy_override is not None:
            decision = _overridden(decision, self.m.config.policy_override, self.m.policy)
        action = decision.action
        if action is Action.OFFLOAD_DISK and not self.m.config.disk_enabled:
            action = Action.OFFLOAD_HOST
        body = decision.to_dict()
        body["action"] = action
        self._note_pause(traj, branch, tool, expected_wait_s, estimate, decision, action, now)
        branch.decision = body
        lease_s = decision.lease_s
        if max_lease_s is not None and action is Action.RETAIN:
            lease_s = min(lease_s, max(0.0, max_lease_s))
            body["lease_s"] = lease_s
        token = branch.timer_token
        deferred = decision.writeback_deferred and action is Action.OFFLOAD_HOST
        applied, note = self.m.transitions.apply_decision(
            traj, branch, action, lease_s, now, deferred
        )
        if branch.timer_token == token:  # no state change (which arms it when due)
            self.m.transitions.arm_prefetch(traj, branch)
        reply: dict[str, Any] = {
            "trajectory_id": trajectory_id,
            "branch": branch.name,
            "applied": applied,
            "state": branch.state.value,
            "decision": body,
            "wait_estimate": estimate.to_dict(),
        }
        if note:
            reply["reason"] = note
        return 200, reply

    def implicit_skip(self, key: str, branch_name: str) -> ImplicitSkip | None:
        """Why the branch's just-finished turn is not a pause, or None when it is: nothing
        runs or waits for the trajectory and no pause was given since the turn started
        (``note_resume`` clears ``paused_at`` when a turn starts; a pause sets it)."""
        traj = self.m.table.get(key)
        branch = traj.branches.get(branch_name) if traj is not None else None
        if traj is None or branch is None or traj.deleted:
            return ImplicitSkip.UNKNOWN
        if branch.running or branch.state is BranchState.ACTIVE:
            return ImplicitSkip.RUNNING
        if self.m.reqs.waiting_for(key):
            return ImplicitSkip.QUEUED
        if branch.paused_at is not None:
            return ImplicitSkip.PAUSED
        return None

    def _decide(self, branch: Branch, estimate: WaitEstimate) -> Decision:
        bb = self.m.config.block_bytes
        return decide(
            tokens=branch.kv_tokens,
            kv_bytes=float(len(branch.keys) * bb),
            wait=estimate,
            costs=self.m.costs,
            pressure=self.m.pins.pressure(),
            host_free_bytes=float(self.m.index.free(Tier.HOST) * bb),
            disk_free_bytes=float(self.m.index.free(Tier.DISK) * bb)
            if self.m.config.disk_enabled
            else 0.0,
            params=self.m.policy,
            admission=self.m.admission,
            # No forecast (0: eviction now) keeps every host write-back immediate.
            eviction_in_s=self.m.eviction_forecast()
            if self.m.config.writeback is Writeback.FORECAST
            else 0.0,
        )

    def _note_pause(
        self,
        traj: Trajectory,
        branch: Branch,
        tool: str,
        expected_wait_s: float | None,
        estimate: WaitEstimate,
        decision: Decision,
        action: Action,
        now: float,
    ) -> None:
        """The pause's bookkeeping: the branch's pause fields, counters, metrics, trace, log."""
        self.m.prefetcher.forget(branch)  # a pause without a turn since: a new prediction
        branch.tool = tool
        branch.estimate = estimate
        branch.paused_at = now
        branch.demoted_by = None
        p50 = estimate.p50 if math.isfinite(estimate.p50) else 0.0
        branch.predicted_return_at = now + p50
        branch.prefetch_due = (
            now + decision.prefetch_at_s
            if decision.prefetch_at_s is not None and action.tier is not None
            else None
        )
        branch.prefetch_done_at = None
        self.m.decisions[action] += 1
        self.m.metrics.add(m.DECISIONS, action=action)
        if math.isfinite(estimate.p50):
            self.m.metrics.observe(m.TOOL_WAIT_PREDICTED, estimate.p50, tool=tool)
        if self.m.otel is not None:
            self.m.otel.start_pause(
                (traj.trajectory_id, branch.name),
                {
                    "agentkv.trajectory_id": traj.trajectory_id,
                    "agentkv.branch": branch.name,
                    "agentkv.tool": tool,
                    "agentkv.expected_wait_s": expected_wait_s,
                    "agentkv.predicted_wait_s": _finite_or_none(estimate.p50),
                    "agentkv.action": action.value,
                    "agentkv.kv_tokens": branch.kv_tokens,
                    "agentkv.kv_bytes": len(branch.keys) * self.m.config.block_bytes,
                    "agentkv.rationale": decision.rationale,
                },
            )
        # The client's id, not the table key (a tenant's key holds a NUL and a digest).
        self.decision_log.pause(now, traj.name, branch.name, tool, estimate, action, decision)

    def resume(self, trajectory_id: str, branch_name: str) -> tuple[int, dict[str, Any]]:
        traj = self.m.table.get(trajectory_id)
        branch = traj.branches.get(branch_name) if traj is not None else None
        if traj is None or branch is None:
            return 404, {"detail": f"unknown trajectory or branch {trajectory_id!r}"}
        now = self.m.clock.now()
        observed = now - branch.paused_at if branch.paused_at is not None else None
        if branch.state is BranchState.OFFLOADED:
            self.m.transitions.promote(traj, branch, now)
        branch.resumed_prefetch = self.note_resume(traj, branch, now)
        return 200, {
            "trajectory_id": trajectory_id,
            "branch": branch.name,
            "state": branch.state.value,
            "observed_wait_s": observed,
        }

    def note_resume(self, traj: Trajectory, branch: Branch, now: float) -> str | None:
        """The pause ends; returns the device prefetch's outcome (None: none planned)."""
        if branch.paused_at is None:
            return None
        observed = now - branch.paused_at
        if branch.tool:
            self.m.predictor.observe(branch.tool, observed)
            self.m.metrics.observe(m.TOOL_WAIT_OBSERVED, observed, tool=branch.tool)
        outcome = None
        device = branch.device_prefetch is not None
        device_outcome = self.m.prefetcher.on_resume(traj, branch, now)
        if branch.prefetch_due is not None and branch.tier == Tier.DISK and not device:
            outcome = classify_prefetch(branch.prefetch_done_at, now)
            self.m.prefetch_outcomes.record(outcome)
            self.m.metrics.add(m.PREFETCH_OUTCOMES, outcome=outcome)
        if self.m.otel is not None:
            self.m.otel.end_pause(
                (traj.trajectory_id, branch.name),
                {
                    "agentkv.outcome": "resumed",
                    "agentkv.observed_wait_s": round(observed, 6),
                    "agentkv.resumed_state": branch.state.value,
                    "agentkv.resumed_tier": branch.tier,
                    "agentkv.prefetch_outcome": outcome,
                },
            )
        branch.paused_at = None
        branch.prefetch_due = None
        branch.prefetch_done_at = None
        return device_outcome


def _finite_or_none(value: float) -> float | None:
    return round(value, 6) if math.isfinite(value) else None


def _overridden(decision: Decision, action: Action, policy: PolicyParams) -> Decision:
    """``decision`` with its action replaced by a fixed one (``policy_override``, a benchmark's
    retain-always / offload-always): retain holds for the longest lease the policy allows (the
    resume or the pool's pressure ends it)."""
    action = Action(action)  # a plain string from a config file names the same action
    return dataclasses.replace(
        decision,
        action=action,
        lease_s=policy.max_lease_s if action is Action.RETAIN else 0.0,
        writeback_deferred=False,  # a fixed policy copies at once (offload-always)
        rationale=f"{action} (fixed by policy_override; the policy said {decision.action})",
    )
