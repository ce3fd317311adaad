"""The pause decision: keep a paused trajectory's KV on the device, copy it to a tier, or drop it.

Primitives:
    Action            RETAIN | OFFLOAD_HOST | OFFLOAD_DISK | DROP (a StrEnum); ``Action.tier``
                      the tier an offload writes (None for retain and drop)
    ACTIONS           every action's name (the settings and control validators derive from it)
    DEMOTION_ACTION   what the engine does on its own to a lease that ran out or pool pressure
    Defaults          LEASE_MARGIN_S, HIGH_WATER: the one place these numbers are written
    PolicyParams      the knobs: DRAM/HBM shadow-price ratio, stall tolerance, disk threshold
    shadow_price_ratio  r(U) = r_idle * (1 - U)
    break_even_wait   T* = round_trip / (1 - r(U)) + stall tolerance
    lease_seconds     a retained trajectory's lease: T*, at least p50 + margin, at most the cap
    pressure_victims  which retained trajectories one pressure event demotes
    defer_writeback   whether an offload_host copy waits for an eviction forecast (the pool keeps
                      the blocks past the predicted resume: a copy now is one nobody reads)
    Writeback         FORECAST | EAGER (a StrEnum): whether that rule is on; the one definition
                      of the write-back mode (the plugin's ``writeback`` setting, the manager's
                      config, the simulator and ``agentkv simulate --writeback``)
    Decision          the action, its lease and prefetch time, and every number behind it
    decide            pure, cheap and never raising: inputs -> Decision

The costs the decision weighs (``CostModel``, ``reload_seconds`` M/B, ``round_trip_seconds`` 2M/B,
``recompute_seconds``, ``hold_cost``) are ``agentkv.costs``'s; ``CostModel`` is re-exported here
because callers of ``decide`` pass one. The break-even wait and the lease stay here: they turn
those costs into a decision with ``PolicyParams``' knobs (price ratio, stall tolerance, margins).
The inputs' sanitizers (every unusable number becomes a
named fallback) are ``agentkv.policy_inputs``'s.

The model is the reference text's "Retain, Evict, Recompute, or Offload". Freeing device memory
for a wait is only possible when the wait exceeds the round trip 2M/B; beyond that, holding costs
mu_HBM * M * T and offloading costs the round trip plus mu_DRAM * M * T, which breaks even at
T* = (2M/B) * mu_HBM / (mu_HBM - mu_DRAM) + stall. The shadow price of device memory rises with
pool pressure U: mu_HBM(U) = mu_HBM(0) / (1 - U), so with r_idle = mu_DRAM / mu_HBM(0) the ratio is
r(U) = r_idle * (1 - U) and T* falls to the round trip as the pool fills.

A retained trajectory gets a lease of T* (the ski-rental rule: hold until holding has cost as much
as the round trip would have, then demote), so more pressure never lengthens a lease. Offload is
write-back: the tier gets a copy while the device blocks go back, unpinned, to vLLM's prefix cache,
so a resume is still free when the pool never needed them; the stall reported is the pessimistic
one (the blocks were evicted). Drop means "leave it to vLLM": no pin, no copy, recompute on a miss.

Write back only when it pays: a copy costs M/B of the host link and, when the "device" is CPU
memory, a core's worth of compute that decoding wanted. When the pool's own forecast
(``admission.PoolTrend``: LRU headroom over the fill rate) says vLLM keeps the unpinned blocks past
the wait's p90 plus a margin, an offload_host decision is *deferred*: the blocks are
unpinned into vLLM's prefix cache and copied to host only once eviction is forecast (or the
queue blocks); a resume before that hits the device and no copy was ever made.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field, replace

from agentkv.admission import Admission
from agentkv.costs import CostModel as CostModel
from agentkv.costs import hold_cost, reload_seconds
from agentkv.policy_inputs import (
    bandwidth_ok,
    has_room,
    sanitize_forecast,
    sanitize_fraction,
    sanitize_wait,
)
from agentkv.predict import WaitEstimate, prefetch_at
from agentkv.tier import Tier

_INF = math.inf


class Writeback(enum.StrEnum):
    """When an offload_host decision's host copy is made."""

    FORECAST = "forecast"
    """The copy waits, the blocks unpinned in vLLM's cache, until eviction is forecast before
    the resume (``defer_writeback``)."""
    EAGER = "eager"
    """Every offload_host decision copies at once (the plugin before issue 26)."""


class Action(enum.StrEnum):
    RETAIN = "retain"  # keep the device blocks pinned under a lease
    OFFLOAD_HOST = "offload_host"  # write-back copy to host; device blocks unpinned
    OFFLOAD_DISK = "offload_disk"  # write-back copy to disk; device blocks unpinned
    DROP = "drop"  # leave it to vLLM's prefix cache; recompute on a miss

    @property
    def tier(self) -> Tier | None:
        """The tier an offload writes; None for actions that write no tier."""
        return _ACTION_TIER.get(self)


_ACTION_TIER = {Action.OFFLOAD_HOST: Tier.HOST, Action.OFFLOAD_DISK: Tier.DISK}
ACTIONS: tuple[str, ...] = tuple(a.value for a in Action)

# Defaults written once: the plugin's settings, the manager and the simulator import them.
HIGH_WATER = 0.88
"""Pool use above which retained trajectories are demoted (farthest predicted return first)."""
LEASE_MARGIN_S = 2.0
"""A lease lasts at least the predicted median wait plus this (a tool's return jitters)."""


@dataclass(frozen=True)
class PolicyParams:
    """Knobs of the decision; the defaults suit a GPU node with a host tier and a disk tier."""

    dram_to_hbm_price_ratio: float = 0.25
    """r_idle = mu_DRAM / mu_HBM with an empty pool (about the $/GB of DDR5 over HBM3e)."""
    stall_tolerance_s: float = 0.0
    """Delta T_stall: resume latency the scheduler accepts on top of the round trip."""
    disk_after_s: float = 300.0
    """Predicted median waits at least this long (people, hours) go to disk when it has room."""
    prefetch_margin_s: float = 0.05
    """Reload finishes this long before the predicted p10 of the wait."""
    max_lease_s: float = 600.0
    """Upper bound on any lease, so a bad estimate cannot pin memory for hours."""
    writeback_horizon_s: float = 1.0
    """A deferred write-back is copied once eviction is forecast within this many seconds."""
    writeback_margin: float = 0.5
    """A host copy is deferred only while the eviction forecast, shortened by this fraction of
    itself, still comes after the wait's p90. Relative, because the forecast is a rate whose
    error grows with its horizon (a burst can beat it); an absolute margin (it was 2 s) made
    every sub-second tool wait copy at once, and nobody read those copies."""
    device_prefetch_max_spread: float = 8.0
    """A device prefetch is issued only when the wait prediction's p90 / p10 is at most this
    (a declared wait gives 4; the cold-start prior 120): a wide spread would pin blocks long."""
    device_prefetch_slack_s: float = 1.0
    """A prefetched branch's lease lasts until the predicted p90 return plus this."""
    lease_margin_s: float = LEASE_MARGIN_S
    """A lease lasts at least the predicted median wait plus this margin (a constant, so more
    pressure still never lengthens a lease)."""


DEFAULT_POLICY = PolicyParams()


def shadow_price_ratio(pressure: float, idle_ratio: float) -> float:
    """r(U) = mu_DRAM / mu_HBM(U) = idle_ratio * (1 - U), U clamped to [0, 1]."""
    u = min(max(pressure, 0.0), 1.0)
    return idle_ratio * (1.0 - u)


def break_even_wait(
    round_trip_s: float, pressure: float, params: PolicyParams = DEFAULT_POLICY
) -> float:
    """T*: the wait above which freeing device memory beats holding it.

    Contract: T* = round_trip_s / (1 - r(U)) + stall tolerance; equals the round trip plus the
    tolerance at U = 1, is non-increasing in U and non-decreasing in ``round_trip_s``.
    """
    ratio = min(max(shadow_price_ratio(pressure, params.dram_to_hbm_price_ratio), 0.0), 0.99)
    return round_trip_s / (1.0 - ratio) + max(params.stall_tolerance_s, 0.0)


def lease_seconds(t_star: float, p50: float, params: PolicyParams) -> float:
    """How long a retained trajectory stays pinned: T* (ski rental), at least the median wait plus
    ``lease_margin_s``, never more than ``max_lease_s``. Non-increasing in pressure (T* falls)."""
    floor = p50 + max(params.lease_margin_s, 0.0) if math.isfinite(p50) else 0.0
    return max(0.0, min(max(t_star, floor), max(params.max_lease_s, 0.0)))


DEMOTION_ACTION = Action.OFFLOAD_HOST
"""What the engine does on its own to a retained trajectory whose lease ran out or that pool
pressure pushes off the device: the cheapest move that frees device memory and keeps the KV."""


def pressure_victims(
    candidates: list[tuple[object, float, int]], excess_blocks: float
) -> list[object]:
    """Which retained trajectories one pressure event demotes.

    ``candidates``: (handle, predicted return time, pinned blocks). Farthest predicted return
    first (it would hold the memory longest), and only as many as cover ``excess_blocks``: one
    spike demotes only what it needs. Contract: never raises; excess <= 0 demotes nothing.
    """
    out: list[object] = []
    if not excess_blocks > 0:
        return out
    freed = 0
    for handle, _, blocks in sorted(candidates, key=lambda c: -c[1]):
        if blocks <= 0:
            continue
        out.append(handle)
        freed += blocks
        if freed >= excess_blocks:
            break
    return out


def defer_writeback(wait_p90_s: float, eviction_in_s: float, params: PolicyParams) -> bool:
    """Whether a host write-back can wait: vLLM's cache keeps the unpinned blocks past the wait's
    p90 even if eviction comes ``writeback_margin`` (a fraction) sooner than forecast, so a copy
    now would never be read. The deferred-copy tick asks it again with the wait left (p90 minus
    the time paused) and the forecast then, and copies once it says no.
    Contract: False for a NaN, infinite or negative wait (a wait past its p90 is no longer
    predicted) or a NaN forecast (copy now: the old, safe behaviour); an infinite forecast
    (nothing is being written) defers; a margin of 1 or more never defers."""
    if math.isnan(eviction_in_s) or not 0.0 <= wait_p90_s < math.inf:
        return False
    keep = 1.0 - min(max(params.writeback_margin, 0.0), 1.0)
    return keep > 0.0 and eviction_in_s * keep > wait_p90_s


@dataclass(frozen=True)
class Decision:
    """What to do with one paused trajectory, and the numbers that decided it.

    Times are seconds after the pause. ``reload_s`` and ``round_trip_s`` are those of the tier the
    action uses (offload) or, for retain and drop, of the fastest tier considered. Infinite values
    mean "impossible" (no usable link, unknown prefill rate).
    """

    action: Action
    lease_s: float
    """How long the device blocks stay pinned (retain only; 0 otherwise)."""
    prefetch_at_s: float | None
    """When to start reloading from the tier (offload only)."""
    expected_resume_stall_s: float
    """Resume latency at the median wait if the device copy was evicted meanwhile."""
    reload_s: float
    round_trip_s: float
    recompute_s: float
    break_even_wait_s: float
    hold_cost_byte_s: float
    """M * p50 wait: what retaining for the whole predicted wait would withhold."""
    kv_bytes: float
    tokens: int
    rationale: str
    wait_p10_s: float = 0.0
    wait_p50_s: float = 0.0
    wait_p90_s: float = 0.0
    wait_source: str = "declared"
    pressure: float = 0.0
    recompute_over_reload: float = _INF
    """How many times faster reloading is than recomputing (the reference's 53.6x, 62x)."""
    fallbacks: tuple[str, ...] = field(default_factory=tuple)
    """Inputs that were unusable and what was assumed instead (empty when all were fine)."""
    writeback_deferred: bool = False
    """offload_host only: the copy waits for an eviction forecast (``defer_writeback``)."""
    eviction_in_s: float = 0.0
    """The pool's forecast, at the decision, of when a block unpinned now is evicted."""

    def to_dict(self) -> dict[str, object]:
        """JSON-ready mapping of every field; non-finite numbers become None."""
        raw = asdict(self)
        raw["fallbacks"] = list(self.fallbacks)
        return {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in raw.items()
        }


def _fmt_s(value: float) -> str:
    if math.isinf(value):
        return "inf"
    if value < 1.0:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.3g} s"


def _safe_drop(tokens: int, kv_bytes: float, notes: list[str], pressure: float) -> Decision:
    notes_text = "; ".join(notes)
    return Decision(
        action=Action.DROP,
        lease_s=0.0,
        prefetch_at_s=None,
        expected_resume_stall_s=_INF,
        reload_s=_INF,
        round_trip_s=_INF,
        recompute_s=_INF,
        break_even_wait_s=0.0,
        hold_cost_byte_s=0.0,
        kv_bytes=kv_bytes,
        tokens=tokens,
        rationale=f"drop (leave the blocks to vLLM, no pin, no copy): {notes_text}",
        pressure=pressure,
        fallbacks=tuple(notes),
    )


def decide(
    *,
    tokens: int,
    kv_bytes: float,
    wait: WaitEstimate | float | None,
    costs: CostModel,
    pressure: float,
    host_free_bytes: float | None = None,
    disk_free_bytes: float | None = None,
    params: PolicyParams = DEFAULT_POLICY,
    admission: Admission | None = None,
    eviction_in_s: float = 0.0,
) -> Decision:
    """Decide what to do with a trajectory paused at ``tokens`` tokens holding ``kv_bytes``.

    Contract: pure, allocation-light (a few microseconds) and never raises. ``pressure`` is the
    device pool's use U_KV in [0, 1]; ``host_free_bytes`` / ``disk_free_bytes`` are the tiers' free
    space (None: unlimited; 0: tier absent or full). Rules, in order:
      1. retain, with lease T*, when the predicted median wait is below T* (the smallest
         break-even wait over the usable options: host, disk, or drop whose "round trip" is the
         recompute time) and the lease fits without delaying the scheduler's waiting requests
         (``admission``: the step's admission picture; a queue short of blocks, or preempting,
         rules retain out: pins are a loan and the queue is calling it in);
      2. offload_disk when the median wait is at least ``params.disk_after_s`` and disk has room
         and reloads faster than recompute;
      3. offload_host when host has room and reloads no slower than recompute; its copy deferred
         (``writeback_deferred``) when ``eviction_in_s`` (the pool's forecast of when a block
         unpinned now is evicted; 0, the default: eviction now), shortened by
         ``params.writeback_margin`` of itself, is past the wait's p90 (``defer_writeback``);
      4. offload_disk when disk has room and reloads no slower than recompute;
      5. drop otherwise.
    Unusable inputs never raise: a NaN/negative wait counts as unknown (no retain; offload if
    possible, since write-back costs nothing when the pool keeps the blocks), NaN pressure counts
    as 1, an unusable bandwidth or free-space figure turns that tier off, and unusable token or
    byte counts give a drop (vLLM's own behaviour). Every such fallback is named in ``fallbacks``
    and in ``rationale``.
    """
    try:
        return _decide(
            tokens=tokens,
            kv_bytes=kv_bytes,
            wait=wait,
            costs=costs,
            pressure=pressure,
            host_free_bytes=host_free_bytes,
            disk_free_bytes=disk_free_bytes,
            params=params,
            admission=admission,
            eviction_in_s=eviction_in_s,
        )
    except Exception as exc:  # the engine's hot path must never see an exception from here
        return _safe_drop(0, 0.0, [f"internal error {type(exc).__name__}: {exc}"], 1.0)


@dataclass
class _Numbers:
    """Every number one decision weighs (derived once, then the rules in ``_choose`` pick)."""

    notes: list[str]
    u: float
    m: float
    n_tokens: int
    estimate: WaitEstimate | None
    source: str
    host_room: bool
    disk_room: bool
    host_reload: float
    host_rt: float
    disk_reload: float
    disk_rt: float
    recompute: float
    t_star: float
    ref_reload: float
    ref_rt: float
    queue_blocked: bool = False
    queue_text: str = "queue not seen"
    eviction_in: float = 0.0
    copy_uses_compute: bool = False

    @property
    def p50(self) -> float:
        return self.estimate.p50 if self.estimate is not None else math.nan

    def build(
        self,
        action: Action,
        lease: float,
        prefetch: float | None,
        stall: float,
        reload: float,
        rt: float,
        why: str,
    ) -> Decision:
        est, p50 = self.estimate, self.p50
        wait_text = f"wait p50 {_fmt_s(p50)} ({self.source})" if est is not None else "wait unknown"
        numbers = (
            f"{wait_text}, T* {_fmt_s(self.t_star)}, reload {_fmt_s(reload)}, "
            f"round trip {_fmt_s(rt)}, recompute {_fmt_s(self.recompute)}, U {self.u:.2f}"
        )
        text = f"{action}: {why} [{numbers}]"
        if self.notes:
            text += " fallbacks: " + "; ".join(self.notes)
        ref = self.ref_reload
        return Decision(
            action=action,
            lease_s=lease,
            prefetch_at_s=prefetch,
            expected_resume_stall_s=stall,
            reload_s=reload,
            round_trip_s=rt,
            recompute_s=self.recompute,
            break_even_wait_s=self.t_star,
            hold_cost_byte_s=hold_cost(self.m, p50) if est is not None else math.nan,
            kv_bytes=self.m,
            tokens=self.n_tokens,
            rationale=text,
            wait_p10_s=est.p10 if est is not None else math.nan,
            wait_p50_s=p50,
            wait_p90_s=est.p90 if est is not None else math.nan,
            wait_source=self.source,
            pressure=self.u,
            recompute_over_reload=self.recompute / ref if ref > 0 and not math.isinf(ref) else _INF,
            fallbacks=tuple(self.notes),
            eviction_in_s=self.eviction_in,
        )

    def offload(
        self, action: Action, reload: float, rt: float, why: str, params: PolicyParams
    ) -> Decision:
        if self.estimate is None:
            at = 0.0
            stall = reload
        else:
            at = prefetch_at(self.estimate, reload, params.prefetch_margin_s)
            # Pessimistic: the device copy was evicted, so a resume at the median waits for
            # whatever of the reload has not finished by then.
            stall = max(0.0, min(reload, at + reload - self.p50))
        return self.build(action, 0.0, at, stall, reload, rt, why)


def _decide(
    *,
    tokens: int,
    kv_bytes: float,
    wait: WaitEstimate | float | None,
    costs: CostModel,
    pressure: float,
    host_free_bytes: float | None,
    disk_free_bytes: float | None,
    params: PolicyParams,
    admission: Admission | None = None,
    eviction_in_s: float = 0.0,
) -> Decision:
    notes: list[str] = []
    queue_blocked = admission is not None and admission.blocked
    queue_text = admission.describe() if admission is not None else "queue not seen"
    u = sanitize_fraction(pressure, "pressure", 1.0, notes)
    m = float(kv_bytes)
    s = float(tokens)
    if math.isnan(m) or math.isinf(m) or m < 0 or math.isnan(s) or math.isinf(s) or s < 0:
        notes.append(f"tokens {tokens} / kv_bytes {kv_bytes} unusable")
        return _safe_drop(0, 0.0, notes, u)
    estimate, source = sanitize_wait(wait, notes)

    host_ok = bandwidth_ok(costs.host_link_bytes_per_s, "host link", notes, required=True)
    disk_ok = bandwidth_ok(
        costs.disk_write_bytes_per_s, "disk write", notes, required=False
    ) and bandwidth_ok(costs.disk_read_bytes_per_s, "disk read", notes, required=False)
    host_link = costs.host_link_bytes_per_s if host_ok else None
    host_room = host_ok and has_room(host_free_bytes, m, "host", notes)
    disk_room = disk_ok and has_room(disk_free_bytes, m, "disk", notes)

    host_reload = reload_seconds(m, host_link or 0.0)
    host_rt = 2.0 * host_reload
    if disk_ok:
        assert costs.disk_read_bytes_per_s is not None and costs.disk_write_bytes_per_s is not None
        # Disk sits behind the host: out via host link then disk write, back via read then link.
        disk_reload = m / costs.disk_read_bytes_per_s + host_reload
        disk_rt = m / costs.disk_write_bytes_per_s + host_reload + disk_reload
    else:
        disk_reload = disk_rt = _INF
    recompute = costs.recompute_seconds(s)
    if math.isnan(recompute) or recompute < 0:
        notes.append(f"recompute time {recompute} unusable; taken as infinite")
        recompute = _INF

    # Break-even against every usable way of freeing the memory; dropping has no DRAM to pay,
    # so its break-even is the recompute time itself.
    t_host = break_even_wait(host_rt, u, params) if host_room else _INF
    t_disk = break_even_wait(disk_rt, u, params) if disk_room else _INF
    t_drop = recompute + max(params.stall_tolerance_s, 0.0)
    ref_host = host_room or not disk_room
    numbers = _Numbers(
        notes=notes,
        u=u,
        m=m,
        n_tokens=int(s),
        estimate=estimate,
        source=source,
        host_room=host_room,
        disk_room=disk_room,
        host_reload=host_reload,
        host_rt=host_rt,
        disk_reload=disk_reload,
        disk_rt=disk_rt,
        recompute=recompute,
        t_star=min(t_host, t_disk, t_drop),
        ref_reload=host_reload if ref_host else disk_reload,
        ref_rt=host_rt if ref_host else disk_rt,
        queue_blocked=queue_blocked,
        queue_text=queue_text,
        eviction_in=sanitize_forecast(eviction_in_s, notes),
        copy_uses_compute=costs.copy_uses_compute,
    )
    return _choose(numbers, params)


def _choose(n: _Numbers, params: PolicyParams) -> Decision:
    """The rules of ``decide``, in order, over the numbers already derived."""
    if n.m == 0:
        return n.build(Action.RETAIN, 0.0, None, 0.0, 0.0, 0.0, "nothing to move (0 bytes)")
    p50 = n.p50
    short_wait = n.estimate is not None and p50 < n.t_star
    if short_wait and not n.queue_blocked:
        lease = lease_seconds(n.t_star, p50, params)
        why = (
            f"median wait is below the break-even wait; pinned for a lease of {_fmt_s(lease)}; "
            f"the lease delays no waiting request ({n.queue_text})"
        )
        return n.build(Action.RETAIN, lease, None, 0.0, n.ref_reload, n.ref_rt, why)
    # A retain the queue called in: say so in whatever is decided instead.
    called_in = f"retain would delay waiting requests ({n.queue_text}); " if short_wait else ""
    long_wait = n.estimate is not None and p50 >= params.disk_after_s
    if long_wait and n.disk_room and n.disk_reload <= n.recompute:
        why = f"median wait is at least {_fmt_s(params.disk_after_s)}; disk holds it for free"
        return n.offload(Action.OFFLOAD_DISK, n.disk_reload, n.disk_rt, called_in + why, params)
    if n.host_room and n.host_reload <= n.recompute:
        return _offload_host(n, called_in, params)
    if n.disk_room and n.disk_reload <= n.recompute:
        why = "host tier unusable or full; write-back copy to disk"
        return n.offload(Action.OFFLOAD_DISK, n.disk_reload, n.disk_rt, called_in + why, params)
    why = called_in + (
        "recompute beats every reload"
        if (n.host_room or n.disk_room)
        else "no tier has room or a usable link"
    )
    return n.build(Action.DROP, 0.0, None, n.recompute, n.ref_reload, n.ref_rt, why)


def _offload_host(n: _Numbers, called_in: str, params: PolicyParams) -> Decision:
    """Rule 3: a host write-back, now or deferred until eviction is forecast."""
    p90 = n.estimate.p90 if n.estimate is not None else math.nan
    copy = f"a copy costs {_fmt_s(n.host_reload)} of the host link" + (
        " and of a core decoding wants (CPU)" if n.copy_uses_compute else ""
    )
    if not n.queue_blocked and defer_writeback(p90, n.eviction_in, params):
        why = (
            f"wait exceeds the break-even wait; the pool keeps the unpinned blocks past the wait "
            f"(eviction forecast in {_fmt_s(n.eviction_in)}, wait p90 {_fmt_s(p90)}): device "
            f"blocks unpinned into vLLM's cache, host copy deferred until eviction is forecast "
            f"({copy}, never read if the resume comes first)"
        )
        decision = n.offload(Action.OFFLOAD_HOST, n.host_reload, n.host_rt, called_in + why, params)
        return replace(decision, writeback_deferred=True, prefetch_at_s=None)
    why = (
        f"wait exceeds the break-even wait; write-back copy to host, device blocks unpinned "
        f"(eviction forecast in {_fmt_s(n.eviction_in)}: {copy})"
    )
    return n.offload(Action.OFFLOAD_HOST, n.host_reload, n.host_rt, called_in + why, params)
