"""Device prefetch: a paused branch's KV is back in device blocks when its tool is predicted to
return, so the resume is a device (prefix cache) hit rather than a reload.

Primitives:
  DeviceOutcome          ON_TIME (the resume found its blocks pinned on the device), LATE (the
                         resume came first: before the prefetch was due, ordered or loaded),
                         WASTED (the lease ended, pressure took it, or the trajectory ended)
  SkipReason             why a due prefetch was not issued (``agentkv.prefetch_rule``: the
                         "never worse" rules the simulator applies too)
  PrefetchOrder          what the adapter issues: an internal prefill-only request of the
                         branch's last context (``to_wire``: the control channel's JSON)
  DevicePrefetch         a branch's prefetch in flight: ORDERED -> LOADING -> READY
  DevicePrefetcher.start       a PREFETCH timer came up for an OFFLOADED branch: re-pin the
                               blocks vLLM still caches, else order the internal request, or skip
  DevicePrefetcher.lookup      the internal request's lookup: plans the tier load like a turn's,
                               without a turn; a cancelled ticket answers PENDING (the adapter
                               aborts it), an unknown one MISS (a vanilla request)
  DevicePrefetcher.finish      the internal request finished: its context blocks are pinned
                               under a short lease (RETAINED, READY); never a user turn
  DevicePrefetcher.on_resume   a turn of the branch started: ON_TIME or LATE (an order or a
                               request still in flight is cancelled)
  DevicePrefetcher.expire      the lease ended or pressure demotes it: unpin, OFFLOADED (WASTED)
  DevicePrefetcher.take_orders / take_cancels   the adapter's queue (control thread, tick)
  PrefetchStats          per tool: outcomes, skips, predicted vs actual return

Contracts:
  - Bounded: at most MAX_QUEUED orders and cancels wait for the adapter, MAX_CANCELLED tickets
    are remembered; a branch holds at most one prefetch.
  - Never worse (each rule a unit test): nothing is issued while the scheduler's queue waits on
    blocks or was short this step, when pool use plus the context's blocks would pass high water,
    when the wait prediction's spread (p90 / p10) is wider than ``device_prefetch_max_spread``,
    or for a deleted trajectory; a skipped disk prefetch still promotes disk -> host.
  - Tenants: an order carries its trajectory's cache_salt (restored from the manifest after a
    restart, ``recovery.restore``); a salted trajectory whose salt is unknown orders nothing.
  - The manager decides once (scheduler side); the internal request is an ordinary request, so
    tensor-parallel ranks load it like any other, and each data-parallel rank's manager orders
    prefetches only for the trajectories it holds.
  - The blocks a READY prefetch pins are the branch's context (hash-checked), pinned like a
    retained branch's: pool pressure and a blocked queue demote them first-class (invariant 5b).
"""

from __future__ import annotations

import enum
import logging
import math
import secrets
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentkv import metrics as m
from agentkv.manager.state import Branch, BranchState, DemotedBy, Trajectory, TurnStats
from agentkv.prefetch_rule import SkipReason, device_prefetch_skip, prefetch_lease_until

if TYPE_CHECKING:
    from agentkv.manager.core import TrajectoryManager
    from agentkv.manager.requests import LookupAnswer, RequestParams

log = logging.getLogger("agentkv.manager")

# Cancelled tickets remembered (their requests answer PENDING until the adapter aborts them).
MAX_CANCELLED = 1024
# Orders and cancels not yet taken (no API server pumps them, e.g. an offline engine): the
# oldest are dropped beyond this, so state stays bounded.
MAX_QUEUED = 1024
MAX_TOOLS = 256


class DeviceOutcome(enum.StrEnum):
    ON_TIME = "on_time"
    LATE = "late"
    WASTED = "wasted"


class PrefetchState(enum.StrEnum):
    ORDERED = "ordered"  # queued for the adapter
    LOADING = "loading"  # the internal request was looked up: its load runs
    READY = "ready"  # its blocks are pinned on the device under a short lease


@dataclass(frozen=True)
class PrefetchOrder:
    ticket: str
    trajectory_id: str  # the client's id (the tenant travels as cache_salt)
    branch: str
    cache_salt: str | None
    token_ids: list[int]

    def to_wire(self) -> dict[str, Any]:
        return {
            "ticket": self.ticket,
            "trajectory_id": self.trajectory_id,
            "branch": self.branch,
            "cache_salt": self.cache_salt,
            "token_ids": self.token_ids,
        }


@dataclass
class DevicePrefetch:
    ticket: str
    state: PrefetchState
    ordered_at: float
    lease_until: float  # absolute: when an unused READY prefetch is demoted again


@dataclass
class ToolStats:
    outcomes: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    resumes: int = 0
    abs_error_s: float = 0.0  # sum of |actual - predicted return|

    def view(self) -> dict[str, Any]:
        n = sum(self.outcomes.values())
        return {
            **{o.value: self.outcomes[o.value] for o in DeviceOutcome},
            "on_time_rate": round(self.outcomes[DeviceOutcome.ON_TIME] / n, 6) if n else None,
            "skipped": dict(self.skipped),
            "resumes": self.resumes,
            "mean_abs_return_error_s": round(self.abs_error_s / self.resumes, 6)
            if self.resumes
            else None,
        }


class PrefetchStats:
    """Per tool (at most MAX_TOOLS names, least recently used forgotten): device prefetch
    outcomes, skips, and how far the predicted return was from the actual one."""

    def __init__(self) -> None:
        self.tools: OrderedDict[str, ToolStats] = OrderedDict()
        self.totals = ToolStats()

    def _tool(self, tool: str | None) -> ToolStats:
        name = tool or "unknown"
        stats = self.tools.get(name)
        if stats is None:
            stats = self.tools[name] = ToolStats()
            while len(self.tools) > MAX_TOOLS:
                self.tools.popitem(last=False)
        else:
            self.tools.move_to_end(name)
        return stats

    def outcome(self, tool: str | None, outcome: DeviceOutcome) -> None:
        self._tool(tool).outcomes[outcome.value] += 1
        self.totals.outcomes[outcome.value] += 1

    def skip(self, tool: str | None, reason: SkipReason) -> None:
        self._tool(tool).skipped[reason.value] += 1
        self.totals.skipped[reason.value] += 1

    def returned(self, tool: str | None, predicted_at: float | None, actual_at: float) -> None:
        if predicted_at is None or not math.isfinite(predicted_at):
            return
        for stats in (self._tool(tool), self.totals):
            stats.resumes += 1
            stats.abs_error_s += abs(actual_at - predicted_at)

    def view(self) -> dict[str, Any]:
        return {
            **self.totals.view(),
            "per_tool": {name: s.view() for name, s in self.tools.items()},
        }


class DevicePrefetcher:
    def __init__(self, mgr: TrajectoryManager) -> None:
        self.m = mgr
        self.orders: list[tuple[Trajectory, Branch, PrefetchOrder]] = []
        self.cancels: list[str] = []
        self.cancelled: OrderedDict[str, None] = OrderedDict()
        self.stats = PrefetchStats()

    @property
    def enabled(self) -> bool:
        return self.m.config.device_prefetch

    # ------------------------------------------------------------------ the timer

    def skip_reason(self, traj: Trajectory, branch: Branch) -> SkipReason | None:
        """The "never worse" rules (agentkv.prefetch_rule); None: the prefetch pays."""
        bs = self.m.config.block_size
        whole = len(branch.keys) if len(branch.token_ids) >= len(branch.keys) * bs else 0
        admission = self.m.admission
        return device_prefetch_skip(
            alive=branch.state is BranchState.OFFLOADED and not branch.running and not traj.deleted,
            blocks=whole,
            estimate=branch.estimate,
            max_spread=self.m.policy.device_prefetch_max_spread,
            queue_blocked=bool(admission.waiting or admission.blocked),
            pool_usage=self.m.pins.pressure(),
            total_blocks=self.m.pinner.total_blocks(),
            high_water=self.m.config.high_water,
        )

    def start(self, traj: Trajectory, branch: Branch, now: float) -> bool:
        """A PREFETCH timer of an OFFLOADED branch came up. True when a device prefetch is under
        way (re-pinned or ordered); False when skipped (the caller may still promote disk ->
        host)."""
        if not self.enabled:
            return False
        why = self.skip_reason(traj, branch)
        if why is None and traj.tenant is not None and not traj.salt:
            why = SkipReason.NO_SALT  # never an unsalted prefill of a tenant's context
        if why is not None:
            self.stats.skip(branch.tool, why)
            self.m.counters[f"device_prefetch_skipped_{why}"] += 1
            return False
        ticket = secrets.token_hex(16)
        dp = DevicePrefetch(ticket, PrefetchState.ORDERED, now, self._lease_until(branch, now))
        branch.device_prefetch = dp
        if self.m.pins.still_cached(branch) >= len(branch.keys):
            # vLLM still caches the whole context: pin it again, no request needed.
            self._ready(traj, branch, now)
            self.m.pins.queue_repin((traj, branch))
            self.m.counters["device_prefetch_repins"] += 1
            return True
        bs = self.m.config.block_size
        n = len(branch.keys) * bs
        # One token past the full blocks (when known) lets every full block load from the
        # tier; vLLM then computes only that token.
        tokens = branch.token_ids[: n + 1]
        order = PrefetchOrder(ticket, traj.name, branch.name, traj.salt, list(tokens))
        self.orders.append((traj, branch, order))
        if len(self.orders) > MAX_QUEUED:
            del self.orders[0]
        self.m.counters["device_prefetch_orders"] += 1
        return True

    def _lease_until(self, branch: Branch, now: float) -> float:
        params = self.m.policy
        paused = branch.paused_at if branch.paused_at is not None else now
        return prefetch_lease_until(
            now, paused, branch.estimate, params.device_prefetch_slack_s, params.max_lease_s
        )

    def _ready(self, traj: Trajectory, branch: Branch, now: float) -> None:
        dp = branch.device_prefetch
        assert dp is not None
        dp.state = PrefetchState.READY
        self.m.transitions.set_state(traj, branch, BranchState.RETAINED)
        self.m.leases.retain(traj, branch, dp.lease_until - now, now)
        branch.prefetch_done_at = now

    # ------------------------------------------------------------------ the adapter's queue

    def take_orders(self) -> list[PrefetchOrder]:
        """Orders still wanted (a resume or DELETE since cancels them); each order goes out
        once. Control thread or engine thread, under the manager's lock."""
        out = []
        for traj, branch, order in self.orders:
            dp = branch.device_prefetch
            if not traj.deleted and dp is not None and dp.ticket == order.ticket:
                out.append(order)
        self.orders = []
        return out

    def take_cancels(self) -> list[str]:
        out, self.cancels = self.cancels, []
        return out

    def _cancel(self, ticket: str) -> None:
        self.orders = [o for o in self.orders if o[2].ticket != ticket]
        self.cancels.append(ticket)
        if len(self.cancels) > MAX_QUEUED:
            del self.cancels[0]
        self.cancelled[ticket] = None
        while len(self.cancelled) > MAX_CANCELLED:
            self.cancelled.popitem(last=False)

    # ------------------------------------------------------------------ the internal request

    def match(self, params: RequestParams) -> tuple[Trajectory, Branch] | None:
        """The branch an internal request's ticket was ordered for, while it still wants it."""
        traj = self.m.table.get(params.key)
        branch = traj.branches.get(params.branch) if traj is not None else None
        dp = branch.device_prefetch if branch is not None else None
        if traj is None or branch is None or dp is None or traj.deleted:
            return None
        if dp.ticket != params.prefetch or dp.state is PrefetchState.READY:
            return None
        if branch.state is not BranchState.OFFLOADED or branch.running:
            return None
        return traj, branch

    def lookup(
        self,
        req_id: str,
        params: RequestParams,
        prompt: Sequence[int],
        block_hashes: Sequence[bytes],
        num_computed: int,
    ) -> LookupAnswer:
        """An internal request: plan its tier load as a turn's would be, without a turn (the
        branch stays OFFLOADED, the pause goes on)."""
        from agentkv.manager.requests import MISS, PENDING, Request

        reqs = self.m.reqs
        req = reqs.requests.get(req_id)
        if req is None:
            hit = self.match(params)
            if hit is None:
                if params.prefetch in self.cancelled:
                    return PENDING  # the adapter aborts it; never computed as a prompt
                return MISS  # a ticket never issued: served as a vanilla request
            traj, branch = hit
            assert branch.device_prefetch is not None
            branch.device_prefetch.state = PrefetchState.LOADING
            turn = TurnStats(turn=0, branch=branch.name, prompt_tokens=len(prompt))
            req = Request(req_id, traj, branch.name, turn, self.m.clock.now())
            req.prefetch = params.prefetch
            reqs.requests[req_id] = req
        else:
            reqs.release_plan(req)
            req.load_job = None
        req.device_hit = num_computed
        req.load_state = "none"
        req.layerwise = False
        return reqs.plan_load(req, len(prompt), block_hashes, num_computed)

    def finish(
        self,
        req: Any,
        block_ids: Sequence[int],
        computed_tokens: int,
        block_hashes: Sequence[bytes],
        aborted: bool,
    ) -> None:
        """The internal request ended: the leading blocks that hold the branch's context (hash
        checked, fully computed or loaded) are pinned, the branch RETAINED under the prefetch's
        lease. Anything else (a cancel, a DELETE, a resume meanwhile, a failed load) pins
        nothing."""
        traj = req.traj
        branch = traj.branches.get(req.branch)
        dp = branch.device_prefetch if branch is not None else None
        if branch is None or dp is None or dp.ticket != req.prefetch or traj.deleted:
            return
        if branch.state is not BranchState.OFFLOADED or branch.running:
            return
        trusted = computed_tokens
        if aborted and req.load_state in ("planned", "in_flight", "failed"):
            trusted = min(trusted, req.device_hit)
        bs = self.m.config.block_size
        n = 0
        limit = min(len(branch.hashes), trusted // bs, len(block_ids), len(block_hashes))
        while n < limit and block_hashes[n] == branch.hashes[n] and block_ids[n] >= 0:
            n += 1
        now = self.m.clock.now()
        if n == 0:
            branch.device_prefetch = None
            self.m.counters["device_prefetch_failed"] += 1
            return
        ids = list(block_ids[:n])
        self.m.pins.pin_now(ids)
        branch.pinned = ids
        branch.block_ids = ids + branch.block_ids[n:]
        self._ready(traj, branch, now)
        self.m.counters["device_prefetch_ready"] += 1

    # ------------------------------------------------------------------ outcomes

    def on_resume(self, traj: Trajectory, branch: Branch, now: float) -> DeviceOutcome | None:
        """A turn of the branch starts, or its client says the tool returned (its pause ends).
        Returns the outcome counted (None: no device prefetch was planned or it was skipped)."""
        dp, branch.device_prefetch = branch.device_prefetch, None
        planned = (
            self.enabled
            and branch.prefetch_due is not None
            and branch.state in (BranchState.OFFLOADED, BranchState.OFFLOADING)
        )
        if dp is None and not planned:
            return None
        self.stats.returned(branch.tool, branch.predicted_return_at, now)
        if branch.predicted_return_at is not None:
            self.m.metrics.observe(
                m.PREFETCH_RETURN_ERROR,
                abs(now - branch.predicted_return_at),
                tool=branch.tool or "",
            )
        if dp is not None and dp.state is PrefetchState.READY and branch.pinned:
            self._outcome(branch, DeviceOutcome.ON_TIME)
            return DeviceOutcome.ON_TIME
        if dp is not None and dp.state is not PrefetchState.READY:
            self._cancel(dp.ticket)
        elif dp is None and branch.prefetch_due is not None and now >= branch.prefetch_due:
            return None  # it came due and was skipped: counted as a skip, not an outcome
        self._outcome(branch, DeviceOutcome.LATE)
        return DeviceOutcome.LATE

    def expire(self, traj: Trajectory, branch: Branch, reason: DemotedBy) -> None:
        """An unused READY prefetch leaves the device again: its tier copy still holds it."""
        dp, branch.device_prefetch = branch.device_prefetch, None
        if dp is not None:
            self._outcome(branch, DeviceOutcome.WASTED)
        self.m.pins.unpin_later(branch.pinned)
        branch.pinned = []
        self.m.transitions.fall_back(traj, branch, reason)

    def forget(self, branch: Branch) -> None:
        """The branch's prefetch ends without a resume (DELETE, a new pause, an expiry)."""
        dp, branch.device_prefetch = branch.device_prefetch, None
        if dp is None:
            return
        if dp.state is PrefetchState.READY:
            self._outcome(branch, DeviceOutcome.WASTED)
        else:
            self._cancel(dp.ticket)

    def _outcome(self, branch: Branch, outcome: DeviceOutcome) -> None:
        self.stats.outcome(branch.tool, outcome)
        self.m.counters[f"device_prefetch_{outcome}"] += 1
        self.m.metrics.add(m.DEVICE_PREFETCH_OUTCOMES, outcome=outcome, tool=branch.tool or "")
