"""A simulated engine for the TrajectoryManager: no vllm, no torch.

Primitives:
  chain_hashes(tokens, bs)   vLLM-style block hashes: chained content ids, so identical prefixes
                             give identical hashes (the hash *is* the content id of a full block)
  salt_root(salt)            the chain's root for a cache_salt (vLLM hashes it into block 0)
  key_of(hash)               the tier key of a block hash (blake2b of b"fp" + hash)
  SimPool                    the device block pool (ports.BlockPinner): reference counts, a prefix
                             cache by hash, a free queue (least recently freed first), the KV
                             content each TP rank holds in each block (a content id, or garbage)
  SimWorkers                 tp_size ranks executing StepPlans as the plugin's worker does, each
                             on a fake_store.FakeTierStore (the real store's results: no
                             overwrite of an existing copy, full tiers fail, damaged disk copies
                             are corrupt errors); jobs complete only when a test says so; a
                             silent rank never reports; async loads are cancelled at the
                             worker's own deadline
  FakeClock                  ports.Clock the test advances
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

Ground truth: block content is the hash of the tokens it holds (salt included); a tier copy
under key k is true iff ``key_of(content) == k``. ``SimEngine.violations`` collects every breach
the sim can see on its own (a load of a wrong copy, a finished request with wrong KV, a tier
written past capacity, a hole in a counted load, an upload of a wrong copy); the stateful test
adds the manager-side invariants.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agentkv.admission import Admission
from agentkv.manager import (
    LoadJob,
    MoveJob,
    RequestParams,
    StepPlan,
    StoreJob,
    TrajectoryManager,
    WorkerReport,
)
from agentkv.tiers.results import BlockStatus
from tests.unit.fake_store import FakeTierStore, Result

GARBAGE = b"garbage"
TierName = Literal["host", "disk"]


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    data = parent + b"".join(int(t).to_bytes(4, "little") for t in tokens)
    return hashlib.blake2b(data, digest_size=16).digest()


def chain_hashes(tokens: Sequence[int], bs: int, parent: bytes = b"root") -> list[bytes]:
    out: list[bytes] = []
    h = parent
    for i in range(len(tokens) // bs):
        h = block_hash(h, tokens[i * bs : (i + 1) * bs])
        out.append(h)
    return out


def salt_root(salt: str | None) -> bytes:
    """The parent of a request's first block hash: vLLM hashes cache_salt into the first
    block's extra keys, so the chain of every later block carries it too."""
    return b"root" if salt is None else b"root|salt=" + salt.encode()


def key_of(h: bytes) -> bytes:
    return hashlib.blake2b(b"fp" + h, digest_size=16).digest()


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# ====================================================================== device pool


class SimPool:
    """vLLM's BlockPool, reduced: ref counts, hash metadata, a free queue, per-rank content."""

    def __init__(self, num_blocks: int, tp_size: int = 1) -> None:
        self.n = num_blocks
        self.tp = tp_size
        self.ref = [0] * num_blocks
        self.pins = [0] * num_blocks  # references taken through the BlockPinner port
        self.hash: list[bytes | None] = [None] * num_blocks  # vLLM metadata (prefix cache)
        self.content: list[list[bytes | None]] = [[None] * num_blocks for _ in range(tp_size)]
        self.cached: dict[bytes, dict[int, None]] = {}
        self.free_q: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.grow_events = 0  # blocks that went from unreferenced to referenced
        self.usage_error: Exception | None = None  # raise once from usage() (fault injection)

    # ---------------------------------------------------------------- BlockPinner port
    def pin(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            self._ref(b)
            self.pins[b] += 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            assert self.pins[b] > 0, f"unpin of block {b} below zero"
            self.pins[b] -= 1
            self._unref(b)

    def holds(self, block_id: int, block_hash: bytes) -> bool:
        return self.hash[block_id] == block_hash

    def usage(self) -> float:
        if self.usage_error is not None:
            err, self.usage_error = self.usage_error, None
            raise err
        return (self.n - len(self.free_q)) / self.n

    def total_blocks(self) -> int:
        return self.n

    # ---------------------------------------------------------------- vLLM side
    def _ref(self, b: int) -> None:
        if self.ref[b] == 0:
            self.free_q.pop(b, None)
            self.grow_events += 1
        self.ref[b] += 1

    def _unref(self, b: int) -> None:
        assert self.ref[b] > 0, f"free of block {b} below zero"
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free_q[b] = None

    def free(self, blocks: Sequence[int]) -> None:
        """A request releases its blocks (tail first, as vLLM does)."""
        for b in reversed(blocks):
            self._unref(b)

    def computed_prefix(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        out: list[int] = []
        for h in hashes[:max_blocks]:
            blocks = self.cached.get(h)
            if not blocks:
                break
            out.append(next(iter(blocks)))
        return out

    def num_free(self) -> int:
        return len(self.free_q)

    def allocate(self, hit: Sequence[int], n_new: int) -> list[int] | None:
        """Touch the hit blocks, then take ``n_new`` blocks from the free queue's head (evicting
        their cached hash). None (and nothing changed) when the pool is short."""
        free_hit = sum(1 for b in hit if self.ref[b] == 0)
        if self.num_free() - free_hit < n_new:
            return None
        for b in hit:
            self._ref(b)
        new: list[int] = []
        for _ in range(n_new):
            b = next(iter(self.free_q))
            self._evict(b)
            self._ref(b)
            new.append(b)
        return new

    def _evict(self, b: int) -> None:
        h = self.hash[b]
        if h is not None:
            blocks = self.cached.get(h)
            if blocks is not None:
                blocks.pop(b, None)
                if not blocks:
                    del self.cached[h]
            self.hash[b] = None

    def cache(self, b: int, h: bytes) -> None:
        if self.hash[b] == h:
            return
        self._evict(b)
        self.hash[b] = h
        self.cached.setdefault(h, {})[b] = None

    def write(self, b: int, content: bytes | None, rank: int | None = None) -> None:
        for r in range(self.tp) if rank is None else (rank,):
            self.content[r][b] = content


# ====================================================================== workers


JobOutcome = Literal["ok", "io_error", "start_error"]


@dataclass
class Pending:
    rank: int
    kind: Literal["store", "load", "move"]
    job: Any
    snapshot: list[bytes | None] = field(default_factory=list)  # store: content at start
    started: float = 0.0  # async load: when the worker started it (its own deadline)


@dataclass
class LoadEvent:
    req_id: str
    job_id: int
    rank: int
    failed_blocks: list[int]


class SimWorkers:
    """tp_size ranks, each with its own store (fake_store.FakeTierStore: the real TieredStore's
    results, a store that never evicts), plus the shared remote tier. Each job runs as the plugin's
    worker (plugins/agentkv_vllm/worker_side.py) runs it: what it reports on success, on a
    block's I/O error (``io_error``: the key is reported bad) and on a job that failed to start
    (``start_error``); an async load past the worker's own deadline is cancelled and reported
    failed (``expire_loads``, the worker's poll)."""

    def __init__(self, pool: SimPool, tp_size: int, capacity: dict[str, int]) -> None:
        self.pool = pool
        self.tp = tp_size
        self.capacity = capacity
        self.stores = [FakeTierStore(capacity["host"], capacity["disk"]) for _ in range(tp_size)]
        # tiers[rank]["host" | "disk"] -> {key: content}: the stores' copies, read-only views
        self.tiers = self.stores
        # the shared remote tier, per rank (keys are rank-salted in the real system): filled by
        # the manager's upload jobs, read by its fetch jobs; a key it has keeps its copy
        self.remote: list[dict[bytes, bytes | None]] = [{} for _ in range(tp_size)]
        self.pending: list[Pending] = []
        self.silent: set[int] = set()
        self.reports: list[WorkerReport] = []
        self.load_events: list[LoadEvent] = []
        self.violations: list[str] = []
        # Whether an upload may publish ``content`` under ``key``: the key must be its content's
        # key under the generation the key was derived in. One generation: ``key_of``. A test
        # that switches generations sets its own (test_invalidation_stateful.py): a copy of an
        # older generation is still its key's KV, where ``key_of`` knows only the current one.
        self.published_truth: Callable[[bytes, bytes], bool] = lambda key, content: (
            key_of(content) == key
        )

    # ---------------------------------------------------------------- plans
    def deliver(self, plan: StepPlan, now: float = 0.0) -> None:
        """start_step on every rank: drops first, then stores, loads (layerwise ones run in this
        step's forward) and moves."""
        for rank in range(self.tp):
            for drop in plan.drops:
                self.stores[rank].drop(drop.keys, drop.tier)
        for rank in range(self.tp):
            for store in plan.stores:
                snap = [self.pool.content[rank][t.block_id] for t in store.blocks]
                self.pending.append(Pending(rank, "store", store, snap))
            for load in plan.loads:
                if load.layerwise:
                    # Copied during this step's forward, on every rank (a stuck rank would stall
                    # the forward itself); a silent rank just never reports it.
                    self._run(Pending(rank, "load", load), "ok", report=rank not in self.silent)
                else:
                    self.pending.append(Pending(rank, "load", load, started=now))
            for move in plan.moves:
                self.pending.append(Pending(rank, "move", move))

    def completable(self) -> list[Pending]:
        return [p for p in self.pending if p.rank not in self.silent]

    def complete(self, p: Pending, ok: bool | JobOutcome = True) -> None:
        """One rank finishes ``p``: ``ok`` (True / "ok"), a block I/O error (False / "io_error")
        or a job that failed to start ("start_error")."""
        outcome: JobOutcome = ok if isinstance(ok, str) else ("ok" if ok else "io_error")
        self.pending.remove(p)
        self._run(p, outcome, report=True)

    def expire_loads(self, now: float, timeout_s: float) -> None:
        """The worker's poll: an async load not done by its deadline is cancelled (nothing more
        is written into its blocks) and reported failed, on any rank (a rank whose transfers are
        stuck still polls; only the forward would stall a whole rank)."""
        for p in [p for p in self.pending if p.kind == "load"]:
            if now >= p.started + timeout_s:
                self.pending.remove(p)
                self._cancel_load(p)

    def _cancel_load(self, p: Pending) -> None:
        load: LoadJob = p.job
        self.reports.append(WorkerReport(jobs_done={load.job_id: 1}, jobs_failed={load.job_id}))
        self.load_events.append(
            LoadEvent(load.req_id, load.job_id, p.rank, [t.block_id for t in load.blocks])
        )

    def wake(self, rank: int, newest_first: bool = False) -> None:
        """A silent rank finishes its stores and moves late, in either order; its loads are
        cancelled (reported failed, nothing copied: the worker's deadline fence)."""
        self.silent.discard(rank)
        late = [p for p in self.pending if p.rank == rank]
        for p in reversed(late) if newest_first else late:
            self.pending.remove(p)
            if p.kind == "load":
                self._cancel_load(p)
            else:
                self._run(p, "ok", report=True)

    def damage(self, rank: int, key: bytes) -> bool:
        """Fault injection: rank's disk copy of ``key`` no longer verifies."""
        return self.stores[rank].damage(key)

    # ---------------------------------------------------------------- execution
    def _bad(self, rep: WorkerReport, key: bytes, r: Result) -> None:
        """worker_side._bad: the reason a rank could not serve or write ``key``."""
        if not key:
            return  # a fail-closed load: no tier was asked
        if r.corrupt:
            rep.bad_keys[key] = "corrupt"
        elif r.status is BlockStatus.MISS:
            rep.bad_keys.setdefault(key, "miss")
        else:
            rep.bad_keys.setdefault(key, "error")

    def _full(self, rank: int, what: str, results: Sequence[Result]) -> None:
        for r in results:
            if r.full:  # the manager reserves every slot it writes: a full tier is its bug
                self.violations.append(
                    f"rank {rank} {what}: {r.tier} full ({self.capacity[r.tier or 'host']}) "
                    f"writing {r.key.hex()[:8]}"
                )

    def _run(self, p: Pending, outcome: JobOutcome, report: bool) -> None:
        rank = p.rank
        rep = WorkerReport()
        if outcome == "start_error":
            rep.jobs_done[p.job.job_id] = 1
            rep.jobs_failed.add(p.job.job_id)
            if p.kind == "load":
                load: LoadJob = p.job
                failed = [t.block_id for t in load.blocks]
                self.load_events.append(LoadEvent(load.req_id, load.job_id, rank, failed))
        elif p.kind == "store":
            self._run_store(p, outcome == "ok", rep)
        elif p.kind == "load":
            self._run_load(p, outcome == "ok", rep)
        elif p.job.kind == "upload":
            self._run_upload(p, outcome == "ok", rep)
        elif p.job.kind == "fetch":
            self._run_fetch(p, outcome == "ok", rep)
        else:
            self._run_move(p, outcome == "ok", rep)
        if report:
            self.reports.append(rep)

    def _done(self, rep: WorkerReport, job_id: int, ok: bool) -> None:
        rep.jobs_done[job_id] = rep.jobs_done.get(job_id, 0) + 1
        if not ok:
            rep.jobs_failed.add(job_id)

    def _run_store(self, p: Pending, io_ok: bool, rep: WorkerReport) -> None:
        job: StoreJob = p.job
        store = self.stores[p.rank]
        keys = [t.key for t in job.blocks]
        if io_ok:
            # The copy reads the device blocks while the job runs: a block that changed since
            # the job started is copied as garbage (checksums cannot tell).
            contents = [
                now if now == before else GARBAGE
                for now, before in (
                    (self.pool.content[p.rank][t.block_id], snap)
                    for t, snap in zip(job.blocks, p.snapshot, strict=True)
                )
            ]
            results = store.store(keys, contents, job.tier)
            self._full(p.rank, f"store {job.job_id}", results)
        else:
            results = [Result(k, BlockStatus.ERROR, job.tier) for k in keys]
        for key, r in zip(keys, results, strict=True):
            if not r.ok:
                self._bad(rep, key, r)
        self._done(rep, job.job_id, all(r.ok for r in results))
        rep.transfers[("offload", job.tier, str(job.job_id))] = (len(job.blocks), 0.001)

    def _run_load(self, p: Pending, io_ok: bool, rep: WorkerReport) -> None:
        load: LoadJob = p.job
        rank = p.rank
        keys = [t.key for t in load.blocks]
        if io_ok:
            results = self.stores[rank].load(keys)
        else:
            results = [Result(k, BlockStatus.ERROR) for k in keys]
        failed: list[int] = []
        for t, r in zip(load.blocks, results, strict=True):
            if not r.ok:
                self._bad(rep, t.key, r)
                failed.append(t.block_id)
                continue
            if r.content is None or key_of(r.content) != t.key:
                self.violations.append(
                    f"load {load.job_id} rank {rank}: copy of {t.key.hex()[:8]} is not its "
                    f"true content ({r.content!r:.20})"
                )
            self.pool.write(t.block_id, r.content, rank)
        self._done(rep, load.job_id, not failed)
        rep.transfers[("reload", "host", str(load.job_id))] = (len(load.blocks), 0.001)
        self.load_events.append(LoadEvent(load.req_id, load.job_id, rank, failed))

    def _run_upload(self, p: Pending, remote_ok: bool, rep: WorkerReport) -> None:
        """A remote tier that is down fails the job; nothing local is lost or reported bad."""
        up: MoveJob = p.job
        if not remote_ok:
            self._done(rep, up.job_id, False)
            return
        results = self.stores[p.rank].copy_to_remote(up.keys, self.remote[p.rank])
        for key, r in zip(up.keys, results, strict=True):
            if r.ok and (
                r.content is None
                or r.content == GARBAGE
                or not self.published_truth(key, r.content)
            ):
                self.violations.append(
                    f"upload {up.job_id} rank {p.rank}: {key.hex()[:8]} would publish wrong KV "
                    f"to the shared remote tier ({r.content!r:.20})"
                )
        self._done(rep, up.job_id, all(r.ok for r in results))

    def _run_fetch(self, p: Pending, remote_ok: bool, rep: WorkerReport) -> None:
        """Best effort: keys the remote lacks (or a remote that is down, or no host room) are
        this rank's misses; the job itself reports done and ok."""
        fetch: MoveJob = p.job
        remote = self.remote[p.rank]
        missing: list[bytes] = []
        for key in fetch.keys:
            if not remote_ok or key not in remote:
                missing.append(key)
                continue
            results = self.stores[p.rank].store([key], [remote[key]], "host")
            self._full(p.rank, f"fetch {fetch.job_id}", results)
            if not results[0].ok:
                missing.append(key)
        if missing:
            rep.fetch_missing[fetch.job_id] = missing
        self._done(rep, fetch.job_id, True)

    def _run_move(self, p: Pending, io_ok: bool, rep: WorkerReport) -> None:
        move: MoveJob = p.job
        store = self.stores[p.rank]
        if not io_ok:
            results = [Result(k, BlockStatus.ERROR) for k in move.keys]
        elif move.kind == "promote":
            results = store.promote(move.keys)
        else:  # 'demote': copy_to_disk, the host copy stays until the manager drops it
            results = store.copy_to_disk(move.keys)
        self._full(p.rank, f"{move.kind} {move.job_id}", results)
        for key, r in zip(move.keys, results, strict=True):
            if not r.ok:
                self._bad(rep, key, r)
        self._done(rep, move.job_id, all(r.ok for r in results))

    def take_reports(self) -> WorkerReport | None:
        if not self.reports:
            return None
        out = WorkerReport()
        for rep in self.reports:
            out = out.merge(rep)
        self.reports = []
        return out


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
            RequestParams(traj_id, branch, tenant=salt, **kw),  # the salt is its namespace
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
        answer = self.mgr.on_lookup(req.req_id, req.params, req.prompt, hashes, num_computed)
        if answer.tokens is None:
            return False
        ext = answer.tokens
        if ext % bs or (ext and num_computed + ext > len(req.prompt) - 1):
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
        )
        self.blocked_needs, self.preempted = [], 0
        self.last_admission = admission
        self.mgr.set_admission(admission)
        errors = self.mgr.counters["internal_errors"]
        plan = self.mgr.take_step()
        if self.mgr.counters["internal_errors"] == errors:  # a glitched tick demotes nothing
            self._check_loan(admission)
        self._check_cover(plan)
        now = self.mgr.clock.now()
        self.workers.deliver(plan, now)
        self.workers.expire_loads(now, self.mgr.config.job_timeout_s)
        self._absorb_load_events()
        return plan

    def _check_loan(self, admission: Admission) -> None:
        """Pins are a loan: after a step whose queue was short of blocks, either the blocks on
        their way back cover the shortfall or nothing retained or held in grace is left."""
        if not admission.blocked:
            return
        pins = self.mgr.pins
        back = pins.releasing + pins.unpins_queued
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
        assert req.status == "RUNNING"
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.status = "WAITING"
        req.load_n = 0
        req.load_jobs = set()
        self.preempted += 1

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
        if job.kind != "store":
            continue
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
