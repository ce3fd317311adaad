"""The job table: every job in flight, from prepare to complete, and the ranks that report late.

Primitives:
  JobKind              STORE | LOAD | PROMOTE | COPY_DOWN | FETCH | UPLOAD (a StrEnum)
  PINS_DEVICE_BLOCKS   the kinds that hold pins on device blocks until they complete (STORE)
  WRITES_LOCAL_TIER    the kinds that write a local tier (a late rank may still land a copy)
  Job                  one job: kind, keys, tier, deadline, the ranks that reported, failure
  JobTable.prepare     register a job (the caller already reserved its slots in the index and
                       queues the wire job); arms its JOB timer
  JobTable.on_ranks    ranks reported a job: completes it once every rank did; a job no longer
                       in the table goes to the late-rank registry
  JobTable.complete    one completion handler per kind (``_HANDLERS``), then the common tail:
                       drop copies that did not become readable, register a timed-out job's
                       late ranks, tell the branch (``Transitions.on_job_done``)
  LateJob, JobTable.late   ONE late-rank registry for every kind that timed out while ranks
                       still worked on it: writes keep their slots and keys unwritable
                       (``poisoned``) and drop what a late rank lands; uploads keep their
                       copies pinned; each entry goes when its last rank reported

Prepare/complete pairs (what a completion undoes, per kind):
  STORE      index.begin_write + device pins (releasing)  ->  end_write, unpin
  LOAD       index.begin_read (at lookup)                 ->  end_read, the request's load state
  PROMOTE,
  COPY_DOWN  index.begin_write + begin_read               ->  end_write, end_read
  FETCH      index.begin_write                            ->  end_write (per key: a miss is not
                                                              a failure of the job)
  UPLOAD     index.begin_read                             ->  end_read (late: when every rank
                                                              reported)
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentkv.manager.jobs import DropOp
from agentkv.manager.state import Trajectory
from agentkv.manager.timers import TimerKind
from agentkv.tier import Tier

if TYPE_CHECKING:
    from agentkv.manager.core import TrajectoryManager

log = logging.getLogger("agentkv.manager")


class JobKind(enum.StrEnum):
    STORE = "store"  # device -> host or disk (a pause's offload)
    LOAD = "load"  # host or disk -> device blocks of a request
    PROMOTE = "promote"  # disk -> host (a prefetch or a resume)
    COPY_DOWN = "copy_down"  # host -> disk (a late disk decision, or host nearly full)
    FETCH = "fetch"  # shared remote -> host (a trajectory this replica never saw)
    UPLOAD = "upload"  # a confirmed host copy -> shared remote


PINS_DEVICE_BLOCKS = frozenset({JobKind.STORE})
WRITES_LOCAL_TIER = frozenset({JobKind.STORE, JobKind.PROMOTE, JobKind.COPY_DOWN, JobKind.FETCH})


@dataclass
class Job:
    kind: JobKind
    job_id: int
    keys: list[bytes]
    tier: Tier
    deadline: float
    block_ids: list[int] = field(default_factory=list)  # store: device blocks pinned for the copy
    trajectory: Trajectory | None = None
    branch: str | None = None
    req_id: str | None = None
    ranks: int = 0
    failed: bool = False
    started: float = 0.0
    missing: set[bytes] = field(default_factory=set)  # fetch: keys some rank could not get


@dataclass
class LateJob:
    kind: JobKind
    keys: list[bytes]
    tier: Tier
    ranks_left: int


class JobTable:
    def __init__(self, mgr: TrajectoryManager) -> None:
        self.m = mgr
        self.jobs: dict[int, Job] = {}
        self.late: dict[int, LateJob] = {}
        # Keys a late rank of a timed-out write may still publish (possibly from reused blocks):
        # never written anew until every rank reported.
        self.poisoned: Counter[bytes] = Counter()
        self._ids = itertools.count(1)
        self._handlers: dict[JobKind, Callable[[Job, bool, bool], list[bytes]]] = {
            JobKind.STORE: self._store_done,
            JobKind.LOAD: self._load_done,
            JobKind.PROMOTE: self._move_done,
            JobKind.COPY_DOWN: self._move_done,
            JobKind.FETCH: self._fetch_done,
            JobKind.UPLOAD: self._upload_done,
        }

    def next_id(self) -> int:
        """A job id for a wire job the table does not track (a fail-closed load)."""
        return next(self._ids)

    def prepare(self, kind: JobKind, keys: list[bytes], tier: Tier, **kw: object) -> Job:
        now = self.m.clock.now()
        job = Job(
            kind,
            self.next_id(),
            list(keys),
            tier,
            deadline=now + self.m.config.job_timeout_s,
            started=now,
            **kw,  # type: ignore[arg-type]
        )
        self.jobs[job.job_id] = job
        self.m.timers.add(job.deadline, TimerKind.JOB, job.job_id)
        return job

    def writes_timed_out(self) -> dict[int, tuple[list[bytes], Tier, int]]:
        """Timed-out writes a late rank may still land: job id -> (keys, tier, ranks left)."""
        return {
            j: (late.keys, late.tier, late.ranks_left)
            for j, late in self.late.items()
            if late.kind in WRITES_LOCAL_TIER
        }

    # ------------------------------------------------------------------ reports

    def on_ranks(self, job_id: int, ranks: int, now: float) -> None:
        job = self.jobs.get(job_id)
        if job is None:
            self._late_ranks(job_id, ranks)
            return
        job.ranks += ranks
        if job.ranks >= self.m.config.tp_size:
            self.complete(job, now)

    def time_out(self, job_id: int, now: float) -> None:
        job = self.jobs.get(job_id)
        if job is None:
            return
        log.warning(
            "agentkv: %s job %d not reported by every rank in %.1f s; failing it",
            job.kind,
            job.job_id,
            self.m.config.job_timeout_s,
        )
        self.m.counters["job_timeouts"] += 1
        self.complete(job, now, timed_out=True)

    def complete(self, job: Job, now: float, timed_out: bool = False) -> None:
        self.jobs.pop(job.job_id, None)
        ok = not job.failed and not timed_out
        # copies that did not become readable: partial on some ranks
        unwritten = self._handlers[job.kind](job, ok, timed_out)
        if unwritten:
            # Ranks that did write keep no copy the index does not know (a failed job, a drop
            # that overtook the write, a timeout).
            self.m.outbox.drops.append(DropOp(unwritten, job.tier))
        if timed_out:
            left = self.m.config.tp_size - job.ranks
            if job.kind is JobKind.UPLOAD:
                # A rank may still be reading the copies: they stay pinned (never dropped, so
                # never rewritten by an unconfirmed store) until every rank reported.
                self.late[job.job_id] = LateJob(job.kind, list(job.keys), job.tier, left)
            elif job.kind in WRITES_LOCAL_TIER:
                self.late[job.job_id] = LateJob(job.kind, list(job.keys), job.tier, left)
                self.poisoned.update(job.keys)
                self.m.index.hold_late(job.tier, len(job.keys))
        self.m.transitions.on_job_done(job, ok, timed_out, now)

    # ------------------------------------------------------------------ one handler per kind

    def _store_done(self, job: Job, ok: bool, timed_out: bool) -> list[bytes]:
        self.m.pins.unpin(job.block_ids)
        self.m.pins.releasing -= len(job.block_ids)
        if not ok:
            self.m.counters["store_failures" if not timed_out else "store_timeouts"] += 1
        return [k for k in job.keys if not self.m.index.end_write(k, job.tier, ok)]

    def _load_done(self, job: Job, ok: bool, timed_out: bool) -> list[bytes]:
        for key in job.keys:
            self.m.index.end_read(key)
        req = self.m.requests.get(job.req_id or "")
        if req is not None and req.load_job == job.job_id:
            req.load_state = "ok" if ok else "failed"
            if not ok:
                # vLLM recomputes from the first block that failed: only those before it
                # were served from the tier.
                served = 0
                if not timed_out:
                    for key in job.keys:
                        if key in self.m.bad_keys:
                            break
                        served += 1
                req.turn.tier_hit_tokens = served * self.m.config.block_size
                if not served:
                    req.turn.tier = None
        if not ok:
            self.m.counters["load_failures"] += 1
        return []

    def _move_done(self, job: Job, ok: bool, timed_out: bool) -> list[bytes]:
        unwritten = []
        for key in job.keys:
            if not self.m.index.end_write(key, job.tier, ok):
                unwritten.append(key)
            self.m.index.end_read(key)
        return unwritten

    def _fetch_done(self, job: Job, ok: bool, timed_out: bool) -> list[bytes]:
        unwritten = []
        got = 0
        until = self.m.clock.now() + self.m.config.remote_ttl_s
        for key in job.keys:
            if self.m.index.end_write(key, job.tier, ok and key not in job.missing):
                self.m.index.note_external(key, until)  # the read renewed its TTL
                got += 1
            else:  # a rank that did get it must not keep a copy the index does not list
                unwritten.append(key)
        self.m.counters["remote_fetched_blocks"] += got
        self.m.counters["remote_missed_blocks"] += len(job.keys) - got
        return unwritten

    def _upload_done(self, job: Job, ok: bool, timed_out: bool) -> list[bytes]:
        until = self.m.clock.now() + self.m.config.remote_ttl_s
        for key in job.keys:
            if ok:
                self.m.index.note_external(key, until)
            if not timed_out:  # timed out: unpinned when its last rank reported (late registry)
                self.m.index.end_read(key)
        self.m.counters["remote_uploaded_blocks" if ok else "remote_upload_failures"] += (
            len(job.keys) if ok else 1
        )
        return []

    # ------------------------------------------------------------------ late ranks

    def _late_ranks(self, job_id: int, ranks: int) -> None:
        """Ranks reported a job after it timed out. A write: what they landed is dropped again
        (the index does not list it), and its keys may be written anew once every rank
        reported. An upload: its copies are unpinned once every rank reported."""
        late = self.late.get(job_id)
        if late is None:
            return
        index = self.m.index
        if late.kind in WRITES_LOCAL_TIER:
            stray = []
            for key in late.keys:
                e = index.get(key)
                if e is None or not (e.has(late.tier) or late.tier in e.writing):
                    stray.append(key)
            if stray:
                self.m.outbox.drops.append(DropOp(stray, late.tier))
        late.ranks_left -= ranks
        if late.ranks_left > 0:
            return
        del self.late[job_id]
        if late.kind is JobKind.UPLOAD:
            for key in late.keys:
                index.end_read(key)
            return
        index.release_late(late.tier, len(late.keys))
        self.poisoned.subtract(late.keys)
        for key in late.keys:
            if self.poisoned[key] <= 0:
                del self.poisoned[key]
