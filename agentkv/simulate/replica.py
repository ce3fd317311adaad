"""One serving replica: a vLLM-like engine loop over a paged pool, with tiers and a KV policy.

Primitives:
  Request           one turn inside a replica: prompt, hits, prefill left, decode left, times
  Replica           a SimPy process running the engine in steps; ``submit`` queues a request,
                    ``finish_turn`` ends a turn (the grace period, then ``pause``: grace.py),
                    ``pause`` applies a policy's PausePlan (an offload_host copy possibly
                    deferred: writeback.py), ``close`` forgets a trajectory
  Replica.cached_tokens / outstanding / queued_prefill_s   what routers see

The engine follows vLLM's V1 scheduler at step granularity without simulating every step:
each step decodes one token of every running sequence and spends the rest of the token budget
(``max_batched_tokens``) on prefills, first come first served (chunked prefill; the request at
the head of the queue takes the whole remaining budget until it is done). A step costs the
fixed step overhead plus its tokens' FLOPs at the calibrated rate (attention included, so long
contexts cost more). Runs of identical steps (one long prefill chunked over many steps, or
decode-only stretches) are one timed segment; a request arriving mid-segment interrupts it,
and the engine replans at the end of the step in progress, exactly where vLLM would take the
new request into account. Requests are admitted FCFS when their blocks fit (a head that does
not fit blocks the queue, as in vLLM); agentkv pins are demoted first when they are in the way.
Tier hits are loaded before the request's prefill starts (loads queue on the tier's link; a
load that ends mid-step joins the next step), or, with ``EngineCosts.layerwise_overlap``, while
it runs (the first token waits for both).
A fork's branches share the trajectory's history blocks (forks.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import simpy

from agentkv.policy import Writeback
from agentkv.simulate.admission import _FILL, _HEAD, Admission, AdmissionMixin
from agentkv.simulate.costs import EngineCosts
from agentkv.simulate.forks import ForkMixin
from agentkv.simulate.grace import GRACE_S, GraceMixin
from agentkv.simulate.policies import KVPolicy, PauseContext, PausePlan
from agentkv.simulate.pool import Allocation, BlockPool
from agentkv.simulate.prefetch import PrefetchMixin
from agentkv.simulate.routers import RouteRequest
from agentkv.simulate.tiers import TierStore
from agentkv.simulate.writeback import WritebackMixin
from agentkv.tier import Tier

GIB = 2**30
NULL_BLOCKS = 1
"""Blocks vLLM's V1 block pool takes for itself (the null block) out of num_gpu_blocks."""


class Request:
    """One turn on one replica."""

    __slots__ = (
        "alloc",
        "cacheable_tokens",
        "cached_tokens",
        "computed",
        "decode_left",
        "done",
        "estimate_s",
        "finished_at",
        "first_token_at",
        "group",
        "output",
        "parent",
        "preempted",
        "prefix_blocks",
        "prompt",
        "ready_at",
        "rejected",
        "remaining",
        "reusable_tokens",
        "sent_at",
        "seq",
        "tid",
        "tier",
        "tier_hit_tokens",
        "total_blocks",
    )

    def __init__(
        self,
        tid: str,
        group: str,
        prompt: int,
        output: int,
        prefix_tokens: int,
        reusable_tokens: int,
        cacheable_tokens: int,
        block_tokens: int,
        sent_at: float,
        done: simpy.Event,
    ) -> None:
        self.tid = tid
        self.group = group
        self.prompt = prompt
        self.output = max(1, output)
        self.prefix_blocks = prefix_tokens // block_tokens
        self.reusable_tokens = reusable_tokens
        self.cacheable_tokens = cacheable_tokens
        # Blocks the request holds: its prompt and its output (vLLM allocates as it decodes).
        self.total_blocks = -(-(prompt + self.output) // block_tokens)
        self.sent_at = sent_at
        self.done = done
        self.remaining = prompt
        self.computed = 0
        self.cached_tokens = 0
        self.tier_hit_tokens = 0
        self.tier: str | None = None
        self.decode_left = self.output - 1
        self.first_token_at = -1.0
        self.finished_at = -1.0
        self.alloc: Allocation | None = None
        self.rejected = False
        self.estimate_s = 0.0
        self.ready_at = 0.0
        """When a layerwise tier load completes (its first token cannot come earlier)."""
        self.preempted = 0
        self.seq = 0
        """Admission order (vLLM preempts the most recently scheduled request first)."""
        self.parent: str | None = None
        """A fork's other branch: the trajectory whose history it shares (``tid`` is its own)."""

    def route_view(self) -> RouteRequest:
        return RouteRequest(
            self.tid,
            self.prompt,
            self.group,
            self.prefix_blocks,
            self.reusable_tokens,
        )


_DECODE = 0  # segment kinds (with _HEAD and _FILL)


class Replica(AdmissionMixin, PrefetchMixin, WritebackMixin, GraceMixin, ForkMixin):
    """One engine with its pool, tiers and policy (see the module docstring)."""

    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        costs: EngineCosts,
        num_blocks: int,
        policy: KVPolicy,
        host_capacity_gib: float | None,
        disk_capacity_gib: float | None,
        remote: TierStore | None = None,
        admission: Admission = Admission.WHOLE,
        writeback: Writeback = Writeback.FORECAST,
        grace_s: float = GRACE_S,
    ) -> None:
        self.env = env
        self.admission = admission
        self.admitted = 0
        self.preemptions = 0
        self._no_admit = False
        self.index = index
        self.costs = costs
        self.policy = policy
        self.bt = costs.block_tokens
        # vLLM's block pool keeps one block as its null block: num_gpu_blocks - 1 are usable.
        self.pool = BlockPool(max(1, num_blocks - NULL_BLOCKS))
        bb = costs.block_bytes()
        self.host: TierStore | None = None
        self.disk: TierStore | None = None
        if host_capacity_gib is not None and host_capacity_gib > 0:
            self.host = TierStore(
                Tier.HOST,
                host_capacity_gib * GIB,
                bb,
                costs.host_link_bytes_per_s,
                costs.host_link_bytes_per_s,
            )
        if disk_capacity_gib is not None and disk_capacity_gib > 0:
            self.disk = TierStore(
                Tier.DISK,
                disk_capacity_gib * GIB,
                bb,
                costs.disk_read_bytes_per_s,
                costs.disk_write_bytes_per_s,
            )
        self.remote = remote
        self.free: TierStore | None = None
        if policy.free_history:
            # The capacity-equal bound's store: unbounded, instant.
            self.free = TierStore(Tier.HOST, None, bb, float("inf"), float("inf"))  # zero-cost
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self.loading = 0
        self.fill_planned = 0
        """Requests at the head of ``prefilling`` the planned FILL step timed (a load that
        ends during the step appends one it did not: that one waits for the next step)."""
        self.pending_prefill_s = 0.0
        """Compute seconds of the prefill work queued here (waiting requests estimated as full
        prefills until admitted, then exactly what is left)."""
        self.lease_gen: dict[str, int] = {}
        self.returns_at: dict[str, float] = {}
        self.copy_blocks: dict[str, int] = {}
        self.prefix_of: dict[str, tuple[str, int]] = {}
        """Each trajectory's prefix group and shared-prefix blocks (its last finished turn's)."""
        self.demotions = 0
        self.decisions: dict[str, int] = {}
        self.steps = 0
        self.busy_s = 0.0
        self._wake: simpy.Event | None = None
        self._interruptible = False
        self._interrupted = False
        self.on_finish: Callable[[Request], None] | None = None
        self._prefetch_init()
        self._writeback_init(writeback)
        self._fork_init()
        self._grace_init(grace_s)
        self.proc = env.process(self._run())

    # -- what routers see ---------------------------------------------------------------------
    def outstanding(self) -> int:
        return len(self.waiting) + self.loading + len(self.prefilling) + len(self.decoding)

    def queued_prefill_s(self) -> float:
        return max(0.0, self.pending_prefill_s)

    def prefill_s(self, tokens: int, cached: int) -> float:
        return self.costs.prefill_s(tokens, cached)

    def _hits(
        self, tid: str, group: str, prefix_blocks: int, reusable_tokens: int, cap: int
    ) -> tuple[int, int, TierStore | None, int]:
        """(prefix hit, private hit, tier, tier blocks) for a prompt, blocks capped at ``cap``."""
        reusable = min(reusable_tokens // self.bt, cap)
        parent = self.fork_parent.get(tid)
        if parent is not None:
            return self._fork_hits(parent, group, prefix_blocks, reusable)
        pre, priv = self.pool.device_hit(
            tid, group, min(prefix_blocks, reusable), max(0, reusable - prefix_blocks)
        )
        dev = pre + priv
        best: TierStore | None = None
        best_n = 0
        for tier in (self.free, self.host, self.disk, self.remote):
            if tier is None:
                continue
            n = min(tier.blocks(tid), reusable) - dev
            if n > best_n:
                best, best_n = tier, n
        return pre, priv, best, best_n

    def cached_tokens(self, req: RouteRequest) -> tuple[int, int, int, int]:
        cap = max(0, (req.prompt_tokens - 1) // self.bt)
        pre, priv, tier, n = self._hits(
            req.trajectory_id, req.prefix_group, req.prefix_blocks, req.reusable_tokens, cap
        )
        out = [(pre + priv) * self.bt, 0, 0, 0]
        if tier is not None:
            slot = 1 if tier in (self.host, self.free) else 2 if tier is self.disk else 3
            out[slot] = n * self.bt
        return out[0], out[1], out[2], out[3]

    # -- requests -----------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        if req.total_blocks > self.pool.capacity:
            req.rejected = True
            req.finished_at = req.first_token_at = self.env.now
            req.done.succeed()
            return
        self._fork_submit(req)
        self._prefetch_on_submit(req.tid, req.group, req.prefix_blocks)
        self._grace_forget(req.tid)
        self.waiting.append(req)
        req.estimate_s = self.costs.prefill_s(req.prompt, 0)
        self.pending_prefill_s += req.estimate_s
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            if not self._wake.triggered:
                self._wake.succeed()
        elif self._interruptible and not self._interrupted:
            self._interrupted = True
            self.proc.interrupt()

    def _admit(self) -> None:
        pool = self.pool
        running = len(self.prefilling) + len(self.decoding) + self.loading
        self.head_need = 0
        while self.waiting and running < self.costs.max_num_seqs:
            r = self.waiting[0]
            if r.tid in pool.pins:
                self.lease_gen[r.tid] = self.lease_gen.get(r.tid, 0) + 1
                pool.take_pinned(r.tid)
            cap = max(0, (r.prompt - 1) // self.bt)
            pre, priv, tier, tier_n = self._hits(
                r.tid, r.group, r.prefix_blocks, r.reusable_tokens, cap
            )
            blocks = self._first_blocks(r, pre + priv + tier_n)
            fits = self._prompt_fits(r, pre, priv)
            alloc = (
                pool.admit(r.tid, r.group, blocks, r.prefix_blocks, pre, priv, tier_n)
                if fits
                else None
            )
            if alloc is None and pool.pins:
                need = blocks - pre - priv - pool.empty - pool.cached_free
                self._demote_for(max(1, need))
                pre, priv, tier, tier_n = self._hits(
                    r.tid, r.group, r.prefix_blocks, r.reusable_tokens, cap
                )
                blocks = self._first_blocks(r, pre + priv + tier_n)
                alloc = pool.admit(r.tid, r.group, blocks, r.prefix_blocks, pre, priv, tier_n)
            if alloc is None:
                self.head_need = blocks
                break
            self.waiting.popleft()
            running += 1
            self.admitted += 1
            r.seq = self.admitted
            r.alloc = alloc
            self._fork_admitted(r)
            # Scheduled: the manager sees the resume now (a deferred copy was due until then).
            self._writeback_resumed(r.tid, priv)
            hit = (pre + priv) * self.bt
            r.computed = hit + tier_n * self.bt
            if not r.preempted:
                r.cached_tokens = r.computed
            r.remaining = r.prompt - r.computed
            self.pending_prefill_s += self.costs.prefill_s(r.remaining, r.computed) - r.estimate_s
            if tier is not None and tier_n:
                r.tier = tier.name
                if not r.preempted:
                    r.tier_hit_tokens = tier_n * self.bt
                done_at = tier.load(r.tid, tier_n, self.env.now)
                if tier is self.disk and self.host is not None:
                    done_at += tier_n * tier.block_bytes / self.costs.host_link_bytes_per_s
                if self.costs.layerwise_overlap:
                    # Layer i+1 loads while layer i computes: the prefill starts now and the
                    # first token waits for the last layer's load.
                    r.ready_at = done_at
                    self.prefilling.append(r)
                else:
                    self.loading += 1
                    self._at(done_at - self.env.now, partial(self._loaded, r))
            else:
                self.prefilling.append(r)
            self._check_high_water()

    def _at(self, delay: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` after ``delay`` simulated seconds (a bare timeout, no process)."""
        ev = self.env.timeout(max(0.0, delay))
        ev.callbacks.append(lambda _ev: fn())

    def _loaded(self, r: Request) -> None:
        self.loading -= 1
        self.prefilling.append(r)
        self._poke()

    # -- the engine loop ----------------------------------------------------------------------
    def _plan(self) -> tuple[int, int, float] | None:
        """(kind, steps, seconds per step) of the next segment, None when idle."""
        c = self.costs
        dec = self.decoding
        dec_work = 0.0
        for d in dec:
            dec_work += c.decode_token_s(d.prompt + d.output - d.decode_left - 1)
        budget = c.max_batched_tokens - len(dec)
        if self.prefilling and budget > 0:
            head = self.prefilling[0]
            k = (head.remaining - 1) // budget
            if dec:
                k = min(k, min(d.decode_left for d in dec))
            if k >= 1:
                b = budget
                # k chunks of b tokens, the context growing by b each step.
                total = sum(
                    c.step_s(dec_work + c.prefill_s(b, head.computed + i * b)) for i in range(k)
                )
                return _HEAD, k, total / k
            work = dec_work
            left = budget
            self.fill_planned = 0
            for r in self.prefilling:
                n = min(r.remaining, left)
                work += c.prefill_s(n, r.computed)
                left -= n
                self.fill_planned += 1
                if left <= 0:
                    break
            return _FILL, 1, c.step_s(work)
        if dec:
            k = min(d.decode_left for d in dec)
            return _DECODE, k, c.step_s(dec_work)
        return None

    def _apply(self, kind: int, steps: int) -> None:
        now = self.env.now
        self.steps += steps
        # The budget the segment was planned with (decoders finishing now free it next step).
        budget = self.costs.max_batched_tokens - len(self.decoding)
        if self.decoding:
            still: list[Request] = []
            for d in self.decoding:
                d.decode_left -= steps
                if d.decode_left <= 0:
                    self._finish(d, now)
                else:
                    still.append(d)
            self.decoding = still
        c = self.costs
        if kind == _HEAD:
            head = self.prefilling[0]
            n = steps * max(1, budget)
            self.pending_prefill_s -= c.prefill_s(n, head.computed)
            head.remaining -= n
            head.computed += n
        elif kind == _FILL:
            left = budget
            keep: list[Request] = []
            late = self.prefilling[self.fill_planned :]
            for r in self.prefilling[: self.fill_planned]:
                n = min(r.remaining, left)
                left -= n
                self.pending_prefill_s -= c.prefill_s(n, r.computed)
                r.remaining -= n
                r.computed += n
                if r.remaining > 0:
                    keep.append(r)
                    continue
                if r.first_token_at < 0:
                    r.first_token_at = max(now, r.ready_at)
                if r.decode_left <= 0:
                    self._finish(r, max(now, r.first_token_at))
                else:
                    self.decoding.append(r)
            self.prefilling = keep + late

    def _run(self) -> Any:
        env = self.env
        while True:
            if self._no_admit:
                # vLLM schedules no waiting request in a step that preempted one (else the
                # victim would be readmitted at once and preempted again, forever).
                self._no_admit = False
            else:
                self._admit()
            plan = self._plan()
            if plan is None and self.waiting and not self._no_admit:
                self._admit()
                plan = self._plan()
            # The manager's tick: this step's fills feed the pool's trend, due write-backs go.
            if self._wb_on:
                self._observe_pool()
            if plan is None:
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue
            kind, k, per_step = plan
            if self.admission is Admission.CHUNK and not self._reserve(kind, k):
                continue
            start = env.now
            self._interruptible = True
            self._interrupted = False
            try:
                yield env.timeout(k * per_step)
                done = k
            except simpy.Interrupt:
                self._interruptible = False
                done = min(k, int((env.now - start) / per_step) + 1) if per_step > 0 else k
                end = start + done * per_step
                if end > env.now:
                    yield env.timeout(end - env.now)
            self._interruptible = False
            self.busy_s += done * per_step
            self._apply(kind, done)

    def _finish(self, r: Request, now: float) -> None:
        r.finished_at = now
        assert r.alloc is not None
        self._fork_finished(r)
        keep = r.cacheable_tokens // self.bt - r.prefix_blocks
        self.prefix_of[r.tid] = (r.group, r.prefix_blocks)
        self.pool.release(r.tid, r.group, r.alloc, keep)
        if self.on_finish is not None:
            self.on_finish(r)
        r.done.succeed()

    # -- pauses -------------------------------------------------------------------------------
    def pause(
        self, tid: str, tool: str | None, declared: float | None, tokens: int, blocks: int
    ) -> PausePlan:
        """Ask the policy what to do with a trajectory that just finished a turn, and do it."""
        pool = self.pool
        ctx = PauseContext(
            tid,
            tool,
            declared,
            tokens,
            self.costs.kv_bytes(tokens),
            pool.usage(),
            self.host.free_bytes() if self.host is not None else 0.0,
            self.disk.free_bytes() if self.disk is not None else 0.0,
            self._eviction_forecast(),
        )
        plan = self.policy.on_pause(ctx)
        self.copy_blocks[tid] = blocks
        if self.free is not None:
            self.free.store(tid, blocks, self.env.now)
        self.decisions[plan.decision] = self.decisions.get(plan.decision, 0) + 1
        now = self.env.now
        if plan.action == "retain":
            self._writeback_pinned(tid)
            if pool.pin(tid):
                self.returns_at[tid] = now + plan.predicted_wait_s
                gen = self.lease_gen.get(tid, 0) + 1
                self.lease_gen[tid] = gen
                self._at(plan.lease_s, partial(self._lease_end, tid, gen))
                self._check_high_water()
        elif plan.action == "offload_host" and self.host is not None:
            if plan.deferred:
                est = plan.estimate
                self._defer_writeback(tid, est.p90 if est is not None else math.nan)
            elif self.host.store(tid, blocks, now) is not None:
                self._arm_device_prefetch(tid, plan, blocks)
                if self.remote is not None:
                    self.remote.store(tid, blocks, now)
        elif plan.action == "offload_disk" and self.disk is not None:
            if (
                self.disk.store(tid, blocks, now) is not None
                and plan.prefetch_at_s is not None
                and not self._arm_device_prefetch(tid, plan, blocks)
            ):
                self._at(plan.prefetch_at_s, partial(self._prefetch, tid, blocks))
            if self.remote is not None:
                self.remote.store(tid, blocks, now)
        if tid not in pool.pins and tid not in self._wb_token:
            self._writeback_placed(tid)
        return plan

    def _prefetch(self, tid: str, blocks: int) -> None:
        if self.disk is None or self.host is None or self.disk.blocks(tid) < blocks:
            return
        if self.host.blocks(tid) >= blocks:
            return
        ready = self.disk.load(tid, blocks, self.env.now)
        if self.host.store(tid, blocks, ready) is not None:
            self.host.ready_at[tid] = max(self.host.ready_at.get(tid, ready), ready)

    def _lease_end(self, tid: str, gen: int) -> None:
        if self.lease_gen.get(tid) == gen and tid in self.pool.pins:
            self._demote(tid)
            self._poke()

    def _demote(self, tid: str) -> None:
        self._prefetch_on_demote(tid)
        blocks = self.copy_blocks.get(tid, self.pool.private.get(tid, 0))
        self.pool.unpin(tid)
        self._writeback_placed(tid)
        self._held.pop(tid, None)  # a grace pin given up: its pause still applies when it comes
        self.returns_at.pop(tid, None)
        self.demotions += 1
        if self.policy.expiry_action == "offload_host" and self.host is not None:
            self.host.store(tid, blocks, self.env.now)

    def _demote_for(self, excess: float) -> None:
        """Demote the policy's victims among the pinned trajectories to free ``excess`` blocks
        (the simulator counts demotions, not their reason: the manager's ``DemotedBy``)."""
        pins = [(t, self.returns_at.get(t, 0.0), n) for t, n in self.pool.pins.items()]
        for tid in self.policy.victims(pins, excess):
            self._demote(tid)

    def _check_high_water(self) -> None:
        hw = self.policy.high_water
        # Over high water the manager demotes retained branches; grace pins (HELD) end early
        # only for a queue short of blocks (the admission's demotions).
        if hw is None or len(self.pool.pins) <= len(self._held):
            return
        excess = self.pool.used - hw * self.pool.capacity
        if excess > 0:
            self._demote_for(excess)

    def close(self, tid: str) -> None:
        """The trajectory ended (agentkv's DELETE): pins go back to the LRU, tier copies go."""
        self.lease_gen[tid] = self.lease_gen.get(tid, 0) + 1
        self._prefetch_close(tid)
        self._writeback_cancel(tid)
        self._grace_forget(tid)
        self.pool.unpin(tid)
        self.returns_at.pop(tid, None)
        self.lease_gen.pop(tid, None)
        self.copy_blocks.pop(tid, None)
        self.prefix_of.pop(tid, None)
        for tier in (self.host, self.disk, self.free):
            if tier is not None:
                tier.remove(tid)
