"""A simulated engine for the TrajectoryManager: no vllm, no torch.

Primitives:
  chain_hashes, salt_root, key_of, SimPool, FakeClock
                             the device: content ids, tier keys, the paged pool (sim_pool.py;
                             re-exported here)
  SimWorkers                 the TP ranks executing StepPlans on fake stores (sim_workers.py;
                             re-exported here)
  SimEngine                  the request driver that mimics vLLM's scheduler around the manager:
                             lookup -> alloc -> (async load | layerwise load) -> compute -> finish,
                             abort (also while WAITING_FOR_REMOTE_KVS: blocks freed only when the
                             load reports), preemption, pressure spikes (non-agent requests). An
                             async load ends only when every rank reported it (as vLLM's output
                             aggregator): the manager's job timeout alone tells vLLM nothing.
                             Each step hands the manager its admission picture (requests and
                             spikes that could not allocate since the last step, their blocks,
                             the free count, preemptions) as the adapter does, and checks the
                             loan rule: a blocked queue gets its blocks back in that step.
  pinned_content_breaches    pinned blocks that do not hold their keys' true KV
  Rig, make_rig              a manager wired to all of the above on a FakeClock

Ground truth: block content is the hash of the tokens it holds (salt included); a tier copy
under key k is true iff ``key_of(content) == k``. ``SimEngine.violations`` collects every breach
the sim can see on its own (a load of a wrong copy, a finished request with wrong KV, a tier
written past capacity, a hole in a counted load, an upload of a wrong copy); the stateful test
adds the manager-side invariants.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentkv.admission import Admission
from agentkv.manager import LoadJob, RequestParams, StepPlan, TrajectoryManager
from tests.unit.sim_pool import GARBAGE, FakeClock, SimPool, chain_hashes, key_of, salt_root
from tests.unit.sim_workers import SimWorkers

# The device and worker parts are imported from here by the tests (one import site).
__all__ = [
    "GARBAGE",
    "FakeClock",
    "Rig",
    "SimEngine",
    "SimPool",
    "SimRequest",
    "SimWorkers",
    "chain_hashes",
    "key_of",
    "make_rig",
    "pinned_content_breaches",
    "salt_root",
]


# ====================================================================== requests


@dataclass
class SimRequest:
    req_id: str
    traj_id: str
    branch: str
    prompt: list[int]
    max_new: int
    params: RequestParams
    status: str = "WAITING"  # WAITING | WAITING_FOR_REMOTE_KVS | RUNNING | FINISHED
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    device_hit: int = 0
    load_from: int = 0  # first block of the counted external range
    load_n: int = 0  # counted external blocks
    load_jobs: set[int] = field(default_factory=set)  # jobs covering the counted blocks
    load_reports: dict[int, set[int]] = field(default_factory=dict)  # job -> ranks reported
    load_failed: set[int] = field(default_factory=set)  # block ids some rank failed
    load_async: bool = False
    layerwise: bool = False
    covered: bool = True  # every counted block has a LoadJob
    aborted_waiting: bool = False  # aborted in WAITING_FOR_REMOTE_KVS: free when the load ends
    salt: str | None = None  # vLLM's cache_salt (a tenant's isolation): part of every hash
    stats: dict[str, Any] | None = None  # what on_finish returned (the turn's stats)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class SimEngine:
    """The manager, the pool, the workers and a scheduler that drives requests like vLLM."""

    def __init__(self, mgr: TrajectoryManager, pool: SimPool, workers: SimWorkers) -> None:
        self.mgr = mgr
        self.pool = pool
        self.workers = workers
        self.bs = mgr.config.block_size
        self.requests: dict[str, SimRequest] = {}
        self.spikes: list[list[int]] = []
        self.violations = workers.violations
        self._seq = 0
        self._awaiting_cover: list[SimRequest] = []
        self.finished_contexts: dict[tuple[str, str], list[int]] = {}
        self.blocked_needs: list[int] = []  # blocks each failed allocation asked for, this step
        self.preempted = 0
        self._allocated_seen = 0
        self._hit_seen = 0
        self.last_admission: Admission | None = None

    # ---------------------------------------------------------------- helpers
    def hashes(self, tokens: Sequence[int], salt: str | None = None) -> list[bytes]:
        """vLLM's block hashes; ``salt`` (the request's cache_salt) enters the first block's
        hash, so the whole chain, every tier key and every block's content differ per salt."""
        return chain_hashes(tokens, self.bs, salt_root(salt))

    def new_request(
        self,
        traj_id: str,
        branch: str,
        prompt: list[int],
        max_new: int = 4,
        salt: str | None = None,
        **kw: Any,
    ) -> SimRequest:
        self._seq += 1
        rid = f"r{self._seq}"
        req = SimRequest(
            rid,
            traj_id,
            branch,
            list(prompt),
            max_new,
            # the salt is its namespace; arrived_at as the adapter stamps it (vLLM's
            # arrival_time): the request arrives now, however long it queues before its lookup
            RequestParams(traj_id, branch, tenant=salt, arrived_at=self.mgr.clock.now(), **kw),
        )
        req.salt = salt
        self.requests[rid] = req
        return req

    def issue_prefetches(self) -> list[SimRequest]:
        """What the adapter's timer pump does with the manager's device-prefetch work: each
        order becomes an internal request of its token ids (one new token, the order's
        cache_salt, its ticket in the params); each cancel aborts its request."""
        orders, cancels = self.mgr.take_prefetch_work()
        out = [
            self.new_request(
                o.trajectory_id,
                o.branch,
                o.token_ids,
                max_new=1,
                salt=o.cache_salt,
                prefetch=o.ticket,
            )
            for o in orders
        ]
        for ticket in cancels:
            for req in list(self.requests.values()):
                if req.params.prefetch == ticket and req.status != "FINISHED":
                    self.abort(req)
        return out

    def active(self, *status: str) -> list[SimRequest]:
        return [r for r in self.requests.values() if r.status in status]

    # ---------------------------------------------------------------- scheduling
    def schedule(self, req: SimRequest, adapter_error: bool = False) -> bool:
        """One scheduling attempt of a WAITING request: lookup, allocate, on_alloc (or, when
        the adapter's plan_load raised, ``fail_load`` if vLLM counted external tokens)."""
        assert req.status == "WAITING"
        bs = self.bs
        tokens = req.tokens  # a preempted request resumes with its output so far
        hashes = self.hashes(tokens, req.salt)
        hit = self.pool.computed_prefix(hashes, (len(tokens) - 1) // bs)
        num_computed = len(hit) * bs
        # Like the adapter: the prompt's token ids, the hashes of every full block.
        answer = self.mgr.on_lookup(
            req.req_id, req.params, req.prompt, hashes, num_computed, num_tokens=len(tokens)
        )
        if answer.tokens is None:
            return False
        ext = answer.tokens
        if ext % bs or (ext and num_computed + ext > len(tokens) - 1):
            self.violations.append(f"{req.req_id}: lookup counted {ext} tokens past {num_computed}")
        need = -(-len(tokens) // bs)
        new = self.pool.allocate(hit, need - len(hit))
        if new is None:
            self.blocked_needs.append(need - len(hit))
            return False
        req.blocks = list(hit) + new
        req.device_hit = num_computed
        req.load_from = num_computed // bs
        req.load_n = ext // bs
        req.load_jobs = set()
        req.load_reports = {}
        req.load_failed = set()
        req.load_async = bool(ext) and answer.load_async
        req.layerwise = bool(ext) and not answer.load_async
        if adapter_error:
            # connector.update_state_after_alloc: plan_load raised; fail_load only when vLLM
            # counted external tokens
            if ext > 0:
                self.mgr.fail_load(req.req_id, req.blocks, ext)
        else:
            self.mgr.on_alloc(req.req_id, req.blocks, ext)
        if ext:
            req.covered = False
            self._awaiting_cover.append(req)
        if req.load_async:
            req.status = "WAITING_FOR_REMOTE_KVS"
            req.num_computed = 0
        else:
            req.status = "RUNNING"
            req.num_computed = num_computed + ext
        return True

    # ---------------------------------------------------------------- engine step
    def step(self) -> StepPlan:
        """build_connector_meta: take the manager's plan, check it covers every counted load,
        ship it; layerwise loads run during this step's forward."""
        admission = Admission(
            waiting=len(self.blocked_needs),
            blocks_needed=sum(self.blocked_needs),
            free_blocks=self.pool.num_free(),
            preempted=self.preempted,
            filled_blocks=float(self.pool.allocated - self._allocated_seen),
            hit_blocks=float(self.pool.hit - self._hit_seen),
        )
        self._allocated_seen, self._hit_seen = self.pool.allocated, self.pool.hit
        self.blocked_needs, self.preempted = [], 0
        self.last_admission = admission
        if self.mgr.idle_step(admission):  # as the adapter does: plain steps skip take_step
            self._check_idle()
            return StepPlan()
        self.mgr.set_admission(admission)
        errors = self.mgr.counters["internal_errors"]
        pinned_before = self.mgr.pinned_blocks()
        plan = self.mgr.take_step()
        # Blocks the step unpinned at once (a demoted branch's blocks already on host) are
        # given back as surely as those whose copy runs before the forward.
        unpinned = max(0, pinned_before - self.mgr.pinned_blocks())
        if self.mgr.counters["internal_errors"] == errors:  # a glitched tick demotes nothing
            self._check_loan(admission, unpinned)
        self._check_cover(plan)
        now = self.mgr.clock.now()
        self.workers.deliver(plan, now)
        self.workers.expire_loads(now, self.mgr.config.job_timeout_s)
        self._absorb_load_events()
        return plan

    def _check_idle(self) -> None:
        """``idle_step`` answered True: a full step at this point must find nothing to do
        either (no job, no pin, no counter moves), so skipping it changed nothing."""
        counters, pinned = dict(self.mgr.counters), self.mgr.pinned_blocks()
        plan = self.mgr.take_step()
        self.mgr.steps -= 1  # the probe is not a step of the engine's
        assert not plan, f"idle_step skipped a step with work: {plan}"
        assert self.mgr.pinned_blocks() == pinned
        assert dict(self.mgr.counters) == counters

    def _check_loan(self, admission: Admission, unpinned: int = 0) -> None:
        """Pins are a loan: after a step whose queue was short of blocks, either the blocks
        given back (unpinned by the step, or on their way back) cover the shortfall or nothing
        retained or held in grace is left."""
        if not admission.blocked:
            return
        pins = self.mgr.pins
        back = pins.releasing + pins.unpins_queued + unpinned
        kept = len(self.mgr.leases) + len(self.mgr.held)
        if back < admission.shortfall and kept:
            self.violations.append(
                f"queue short {admission.shortfall} blocks, {back} on their way back, "
                f"{kept} branches still pinned"
            )

    def _check_cover(self, plan: StepPlan) -> None:
        by_req: dict[str, list[LoadJob]] = {}
        for load in plan.loads:
            by_req.setdefault(load.req_id, []).append(load)
        for req in self._awaiting_cover:
            want = set(req.blocks[req.load_from : req.load_from + req.load_n])
            got: set[int] = set()
            for load in by_req.get(req.req_id, []):
                got.update(t.block_id for t in load.blocks)
                req.load_jobs.add(load.job_id)
            if not want <= got:
                self.violations.append(
                    f"{req.req_id}: counted blocks {sorted(want - got)} have no LoadJob"
                )
            req.covered = True
        self._awaiting_cover = []

    def deliver_reports(self) -> None:
        """update_from_output: the workers' reports reach the manager; async loads that every
        rank reported become ready (or are failed), aborted ones free their blocks."""
        rep = self.workers.take_reports()
        if rep is not None:
            self.mgr.on_report(rep)
        self._absorb_load_events()
        self._settle_loads()

    def _absorb_load_events(self) -> None:
        for ev in self.workers.load_events:
            req = self.requests.get(ev.req_id)
            if req is None or ev.job_id not in req.load_jobs:
                continue
            req.load_reports.setdefault(ev.job_id, set()).add(ev.rank)
            req.load_failed.update(ev.failed_blocks)
            if req.layerwise and req.status == "RUNNING" and ev.failed_blocks:
                self._truncate(req)
        self.workers.load_events = []

    def _truncate(self, req: SimRequest) -> None:
        """vLLM recomputes from the first block whose load failed."""
        idx = [req.blocks.index(b) for b in req.load_failed if b in req.blocks]
        if idx:
            req.num_computed = min(req.num_computed, min(idx) * self.bs)

    def _load_done(self, req: SimRequest) -> bool:
        """vLLM: finished receiving once every rank reported the request's loads (the manager's
        own job timeout tells vLLM nothing; the worker's load deadline does, per rank)."""
        if not req.covered:
            return False
        return all(len(req.load_reports.get(job, ())) >= self.workers.tp for job in req.load_jobs)

    def _settle_loads(self) -> None:
        for req in list(self.requests.values()):
            if req.status != "WAITING_FOR_REMOTE_KVS" or not self._load_done(req):
                continue
            if req.aborted_waiting:
                self.pool.free(req.blocks)
                req.blocks = []
                req.status = "FINISHED"
                del self.requests[req.req_id]
                continue
            n_ok = req.load_n
            for i in range(req.load_from, req.load_from + req.load_n):
                if req.blocks[i] in req.load_failed:
                    n_ok = i - req.load_from
                    break
            req.num_computed = (req.load_from + n_ok) * self.bs
            hashes = self.hashes(req.tokens, req.salt)
            for i in range(req.load_from, req.load_from + n_ok):
                self.pool.cache(req.blocks[i], hashes[i])
            req.status = "RUNNING"

    # ---------------------------------------------------------------- compute / finish
    def compute(self, req: SimRequest, n_tokens: int | None = None) -> bool:
        """One forward of a RUNNING request: the rest of its prompt, else one decode token per
        call (appending tokens until max_new). Full computed blocks get their true content and
        enter the prefix cache. False when a new block could not be allocated."""
        assert req.status == "RUNNING"
        bs = self.bs
        target = len(req.tokens)
        if req.num_computed >= len(req.tokens):
            if len(req.output) >= req.max_new:
                return True
            seed = f"{req.req_id}:{len(req.output)}".encode()  # deterministic across processes
            token = (
                int.from_bytes(hashlib.blake2b(seed, digest_size=4).digest(), "little") % 50_000 + 1
            )
            if len(req.tokens) + 1 > len(req.blocks) * bs:
                new = self.pool.allocate([], 1)
                if new is None:
                    return False
                req.blocks += new
            req.output.append(token)
            target = len(req.tokens) - 1  # the new token's KV is computed next step
        if n_tokens is not None:
            target = min(target, req.num_computed + n_tokens)
        start = req.num_computed
        hashes = self.hashes(req.tokens, req.salt)
        for i in range(start // bs, min(target // bs, len(hashes))):
            self.pool.write(req.blocks[i], hashes[i])
            self.pool.cache(req.blocks[i], hashes[i])
        req.num_computed = max(req.num_computed, target)
        return True

    def can_compute(self, req: SimRequest) -> bool:
        """RUNNING, and a layerwise load (if any) went out with this step's plan."""
        return req.status == "RUNNING" and req.covered

    def can_finish(self, req: SimRequest) -> bool:
        return self.can_compute(req) and req.num_computed >= len(req.prompt)

    def finish(self, req: SimRequest) -> dict[str, Any] | None:
        """A normal finish: every computed full block must hold its true content."""
        assert self.can_finish(req)
        bs = self.bs
        tokens = req.tokens
        hashes = self.hashes(tokens, req.salt)
        for i in range(min(req.num_computed // bs, len(hashes))):
            b = req.blocks[i]
            for r in range(self.pool.tp):
                if self.pool.content[r][b] != hashes[i]:
                    self.violations.append(
                        f"{req.req_id} finished with wrong KV in block {i} (id {b}) rank {r}"
                    )
        stats = self.mgr.on_finish(
            req.req_id,
            req.blocks,
            computed_tokens=req.num_computed,
            token_ids=tokens,
            block_hashes=hashes,
            aborted=False,
        )
        if req.params.prefetch is not None:
            if stats is not None:
                self.violations.append(f"{req.req_id}: an internal prefetch counted as a turn")
        else:
            self.finished_contexts[(req.traj_id, req.branch)] = list(tokens)
        req.stats = stats
        self._release(req)
        return stats

    def abort(self, req: SimRequest) -> dict[str, Any] | None:
        tokens = req.tokens
        hashes = self.hashes(tokens, req.salt)
        computed = req.num_computed
        if req.status == "WAITING_FOR_REMOTE_KVS":
            computed = (req.load_from + req.load_n) * self.bs  # optimistic: the worst case
        stats = self.mgr.on_finish(
            req.req_id,
            req.blocks,
            computed_tokens=computed,
            token_ids=tokens,
            block_hashes=hashes,
            aborted=True,
        )
        if req.status == "WAITING_FOR_REMOTE_KVS":
            req.aborted_waiting = True  # vLLM frees its blocks when the load reports
            self._settle_loads()
            return stats
        self._release(req)
        return stats

    def _release(self, req: SimRequest) -> None:
        self.pool.free(req.blocks)
        req.blocks = []
        req.status = "FINISHED"
        self.requests.pop(req.req_id, None)
        if req in self._awaiting_cover:
            self._awaiting_cover.remove(req)

    def preempt(self, req: SimRequest) -> None:
        """vLLM's _preempt_request: the blocks go back to the pool, the request waits with its
        output so far. The adapter noted the blocks before (has_pending_block_frees) and hands
        them to ``on_preempt`` in this step's metadata, copied before the step's forward: so a
        save runs a step right away, before anything can write the freed blocks."""
        assert req.status == "RUNNING"
        saved = self.mgr.on_preempt(
            req.req_id,
            list(req.blocks),
            computed_tokens=req.num_computed,
            block_hashes=self.hashes(req.tokens, req.salt),
        )
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.status = "WAITING"
        req.load_n = 0
        req.load_jobs = set()
        self.preempted += 1
        if saved:
            self.step()

    # ---------------------------------------------------------------- pressure
    def spike(self, n: int) -> bool:
        new = self.pool.allocate([], n)
        if new is None:
            self.blocked_needs.append(n)  # a plain request the scheduler cannot admit
            return False
        for b in new:
            self.pool.write(b, GARBAGE)
        self.spikes.append(new)
        return True

    def release_spike(self) -> None:
        if self.spikes:
            self.pool.free(self.spikes.pop(0))


def pinned_content_breaches(
    mgr: TrajectoryManager,
    pool: SimPool,
    trajs: Sequence[Any],
    true_key: Callable[[bytes], Any] | None = None,
) -> list[str]:
    """Every device block the manager pins holds its key's true KV on every rank: a branch's
    pinned blocks hold its context's blocks (content == the block hash), a store job's pinned
    sources hold the KV of the keys it writes (key_of(content) == key; ``true_key`` replaces
    key_of where keys of several generations are legitimately in flight)."""
    true_key = true_key or key_of
    out: list[str] = []
    seen: set[int] = set()
    for traj in trajs:
        if id(traj) in seen:
            continue
        seen.add(id(traj))
        for name, branch in traj.branches.items():
            if len(branch.pinned) > len(branch.hashes):
                out.append(f"{traj.trajectory_id}/{name} pins more blocks than its context has")
            for i, (b, h) in enumerate(zip(branch.pinned, branch.hashes, strict=False)):
                for r in range(pool.tp):
                    if pool.content[r][b] != h:
                        out.append(
                            f"{traj.trajectory_id}/{name} pins block {i} (id {b}) rank {r} "
                            f"holding {pool.content[r][b]!r:.20}, not its KV"
                        )
    for job in mgr.jobs.values():
        if job.kind != "store" or not job.block_ids:
            continue  # no pins: a preemption save, copied before the step's forward
        for key, b in zip(job.keys, job.block_ids, strict=True):
            for r in range(pool.tp):
                c = pool.content[r][b]
                if c is None or true_key(c) != key:
                    out.append(
                        f"store job {job.job_id} pins block {b} rank {r} not holding {key.hex()[:8]}"
                    )
    return out


# ====================================================================== a ready-made rig


@dataclass
class Rig:
    """A manager wired to a SimPool, SimWorkers and a SimEngine on a FakeClock."""

    mgr: TrajectoryManager
    pool: SimPool
    workers: SimWorkers
    eng: SimEngine
    clock: FakeClock

    def settle(self, rounds: int = 4) -> None:
        """Ship the plan, every rank finishes every job, reports come back (a few times)."""
        for _ in range(rounds):
            self.eng.step()
            for p in self.workers.completable():
                self.workers.complete(p, True)
            self.eng.deliver_reports()

    def run(self, req: SimRequest, steps: int = 8, jobs: bool = True) -> SimRequest:
        """Engine iterations until ``req`` finished (jobs done each step unless ``jobs`` is
        False)."""
        for _ in range(steps):
            if req.status == "WAITING":
                self.eng.schedule(req)
            self.eng.step()
            if self.eng.can_compute(req) and not self.eng.compute(req):
                self.eng.preempt(req)
            if self.eng.can_finish(req) and len(req.output) >= req.max_new:
                self.eng.finish(req)
            if jobs:
                for p in self.workers.completable():
                    self.workers.complete(p, True)
            self.eng.deliver_reports()
            if req.status == "FINISHED":
                break
        return req

    def turn(
        self, traj: str, prompt: list[int], branch: str = "main", max_new: int = 0, **kw: Any
    ) -> SimRequest:
        return self.run(self.eng.new_request(traj, branch, prompt, max_new=max_new), **kw)

    def flush(self) -> None:
        """Other traffic takes every free block for a moment: unpinned device copies go."""
        if self.eng.spike(self.pool.num_free()):
            self.pool.free(self.eng.spikes.pop())

    def reset_prefix_cache(self) -> bool:
        """``POST /reset_prefix_cache`` (plain): vLLM's reset, run through the manager as the
        plugin's wrapped ``Scheduler.reset_prefix_cache`` runs it."""
        return bool(self.mgr.prefix_cache_reset(self.pool.reset_prefix_cache))

    def host_keys(self, rank: int = 0) -> set[bytes]:
        return set(self.workers.tiers[rank]["host"])

    def disk_keys(self, rank: int = 0) -> set[bytes]:
        return set(self.workers.tiers[rank]["disk"])


def make_rig(
    *,
    tp: int = 1,
    blocks: int = 40,
    host: int = 32,
    disk: int = 0,
    grace: float = 0.5,
    costs: Any = None,
    policy: Any = None,
    **config: Any,
) -> Rig:
    from agentkv.manager import ManagerConfig
    from agentkv.policy import CostModel, PolicyParams

    clock = FakeClock()
    pool = SimPool(blocks, tp)
    cfg = ManagerConfig(
        block_size=4,
        block_bytes=1 << 20,
        tp_size=tp,
        host_capacity_blocks=host,
        disk_capacity_blocks=disk,
        grace_s=grace,
        job_timeout_s=10.0,
        **config,
    )
    mgr = TrajectoryManager(
        cfg,
        pool,
        key_of=key_of,
        costs=costs
        or CostModel(
            host_link_bytes_per_s=1e8,
            disk_write_bytes_per_s=5e8,
            disk_read_bytes_per_s=5e8,
            prefill_tokens_per_s=100.0,
        ),
        policy=policy or PolicyParams(disk_after_s=100.0),
        clock=clock,
    )
    workers = SimWorkers(pool, tp, {"host": host, "disk": disk})
    return Rig(mgr, pool, workers, SimEngine(mgr, pool, workers), clock)
