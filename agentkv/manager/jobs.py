"""What the manager asks the workers to do, and what the workers answer.

Primitives:
  BlockTransfer   one block: its tier key and the engine block id it is copied from or into
  MoveKind        PROMOTE | DEMOTE | FETCH | UPLOAD (a StrEnum)
  TransferKind    OFFLOAD | RELOAD | PROMOTE | DEMOTE: what a reported transfer measured
  TransferRef     (kind, tier, ref): one reported transfer, the key of WorkerReport.transfers
  ReloadPhase     where a layer-by-layer reload step's time went on a worker (a StrEnum)
  KeyProblem      'miss' | 'corrupt' | 'error': why a rank could not serve or write a key
  StoreJob        device -> tier (Tier.HOST | Tier.DISK); the device blocks stay pinned until done
  LoadJob         tier -> device blocks the engine allocated for a request
  MoveJob         tier -> tier: 'promote' (disk -> host, a prefetch), 'demote' (host -> disk) or
                  'fetch' (the shared remote tier -> host: a trajectory this replica never saw)
                  or 'upload' (a confirmed local copy -> the shared remote tier)
  DropOp          forget keys in one tier or all tiers (synchronous on the worker, ordered
                  before the step's other jobs so their slots are free for this step's stores)
  KeepPlan        the disk blocks an engine's manager holds after its restart (restored from
                  the manifest): each worker keeps exactly those files of its folder, deletes
                  the rest (``TieredStore.prune_disk``), once, before any other job
  StepPlan        one engine step's jobs, in the order a worker must start them
  Rejection       BAD_TAG | CORRUPT: why a tier refused a value it holds (a StrEnum)
  WorkerReport    per step, per rank: jobs finished (ranks count), jobs failed, keys a rank could
                  not serve and why, values tiers rejected, transfer sizes and times; ``merge``
                  adds up ranks

Plain dataclasses of builtins: the multiprocessing executor pickles them between processes.
Every job has an id; a job is complete when every TP rank reported it, and failed when any did.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from agentkv.tier import Tier


class MoveKind(enum.StrEnum):
    PROMOTE = "promote"  # disk -> host (a prefetch or a resume)
    DEMOTE = "demote"  # host -> disk (a copy down: the host copy stays until dropped)
    FETCH = "fetch"  # shared remote tier -> host
    UPLOAD = "upload"  # a confirmed host copy -> shared remote tier


class TransferKind(enum.StrEnum):
    OFFLOAD = "offload"  # device -> tier (a store job)
    RELOAD = "reload"  # tier -> device (a load job)
    PROMOTE = "promote"
    DEMOTE = "demote"


class TransferRef(NamedTuple):
    """One reported transfer: what it measured, the tier on the far side of the device (or the
    tier written, for promote/demote), and the job or request it belongs to (``job-<id>``,
    ``req-<id>``, ``layerwise-<req>``). A tuple, so reports pickle as builtins."""

    kind: TransferKind
    tier: Tier
    ref: str


class ReloadPhase(enum.StrEnum):
    """One phase of a layer-by-layer reload step on a worker, in the order they happen
    (``agentkv_reload_phase_seconds``; the reported reload seconds are DISK + COPY + RELEASE).
    Why per phase: the reload's own time varies 2x between identical replays; these say which
    part moved (docs/tiers.md)."""

    BEFORE = "before"  # start_step up to the layerwise loads: the step's drops, stores, moves
    PREPARE = "prepare"  # keys, host pins (store lock), views, addresses, the batch's arrays
    HANDOFF = "handoff"  # to the copy's first line: the copier thread's wake-up (0 in start_step)
    DISK = "disk"  # blocks only disk held, read whole and checked first
    COPY = "copy"  # the host copies (the native kernel), wall time
    COPY_CPU = "copy_cpu"  # the copying thread's CPU time in DISK + COPY + RELEASE (the rest:
    # off the CPU, or waiting for the GIL or the store's lock)
    RELEASE = "release"  # the host pins released
    FORWARD = "forward"  # start_step returned to finish_step: the model's forward and vLLM's work
    FINISH = "finish"  # finish_step: waiting for the copier (thread path), its bookkeeping


# Why a rank could not serve or write a key (the worker fills it; a Literal, not an enum: the
# worker process builds it from its store's results).
KeyProblem = Literal["miss", "corrupt", "error"]


class Rejection(enum.StrEnum):
    """Why a tier refused to serve a value it holds (``WorkerReport.rejected``): never served,
    the block is recomputed, and the value is deleted. Counted so an operator sees a forged
    value or a wrong deployment secret (``agentkv_rejected_blocks``, ``/status`` counters)."""

    BAD_TAG = "bad_tag"  # remote: the HMAC tag does not match (forged, or another secret)
    CORRUPT = "corrupt"  # header, length or checksum damage (any tier with checksums)


# What the tiers can reject (the host arena holds no checksum; the remote tier adds the tag).
REJECTIONS: tuple[tuple[Tier, Rejection], ...] = (
    (Tier.REMOTE, Rejection.BAD_TAG),
    (Tier.REMOTE, Rejection.CORRUPT),
    (Tier.DISK, Rejection.CORRUPT),
)


def rejection_counter(tier: Tier, why: Rejection) -> str:
    """The /status counter of one (tier, reason): ``remote_bad_tag_blocks``, ..."""
    return f"{tier}_{why}_blocks"


@dataclass(frozen=True)
class BlockTransfer:
    key: bytes
    block_id: int


@dataclass
class StoreJob:
    job_id: int
    tier: Tier
    blocks: list[BlockTransfer]
    owner: str = ""
    # True: the device blocks are not pinned (a preempted request's, already back in vLLM's
    # pool and maybe reallocated this step): the worker copies them before this step's forward.
    before_forward: bool = False


@dataclass
class LoadJob:
    job_id: int
    req_id: str
    blocks: list[BlockTransfer]
    # True: copied layer by layer during this step's forward (vLLM scheduled the request already);
    # False: the request waits in WAITING_FOR_REMOTE_KVS until every rank reported it loaded.
    layerwise: bool = False


@dataclass
class MoveJob:
    job_id: int
    kind: MoveKind
    keys: list[bytes]


@dataclass
class DropOp:
    keys: list[bytes]
    tier: Tier | None = None  # None: every tier


@dataclass(frozen=True)
class KeepPlan:
    # The logical keys the manager indexes on disk after ``recovery.restore``: the workers start
    # before the scheduler (vLLM builds the executor, then the scheduler), so the plan travels
    # in the first step's metadata and a worker applies it once, before that step's jobs.
    keys: frozenset[bytes]


@dataclass
class StepPlan:
    drops: list[DropOp] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    moves: list[MoveJob] = field(default_factory=list)
    keep: KeepPlan | None = None  # the restart's disk plan: first step only

    def __bool__(self) -> bool:
        return bool(self.drops or self.stores or self.loads or self.moves or self.keep)


@dataclass
class WorkerReport:
    # job id -> number of ranks that finished it (ok or not)
    jobs_done: dict[int, int] = field(default_factory=dict)
    # jobs that failed on at least one rank
    jobs_failed: set[int] = field(default_factory=set)
    # keys a rank could not serve or write, with the reason (a corrupt file, a miss, an I/O error)
    bad_keys: dict[bytes, KeyProblem] = field(default_factory=dict)
    # fetch job id -> keys the remote tier did not have (or served corrupt) on this rank: a fetch
    # is best effort, so a miss is not a failure of the job, only of that key
    fetch_missing: dict[int, list[bytes]] = field(default_factory=dict)
    # rank -> pid of the worker process, sent once (shows the plugin loaded in every worker)
    hello: dict[int, int] = field(default_factory=dict)
    # what each transfer measured -> (bytes, seconds)
    transfers: dict[TransferRef, tuple[int, float]] = field(default_factory=dict)
    # layer-by-layer reload steps since the last report: phase -> seconds (summed over steps)
    reload_phases: dict[ReloadPhase, float] = field(default_factory=dict)
    # (tier, why) -> values that tier refused since the last report (bad tags, corrupt values;
    # fetches included, whose misses are not bad_keys): ranks add up
    rejected: dict[tuple[Tier, Rejection], int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(
            self.jobs_done
            or self.jobs_failed
            or self.bad_keys
            or self.hello
            or self.transfers
            or self.reload_phases
            or self.rejected
        )

    def merge(self, other: WorkerReport) -> WorkerReport:
        """A new report with both ranks' contents; neither input is changed."""
        out = WorkerReport(
            jobs_done=dict(self.jobs_done),
            jobs_failed=self.jobs_failed | other.jobs_failed,
            bad_keys={**self.bad_keys, **other.bad_keys},
            hello={**self.hello, **other.hello},
            transfers=dict(self.transfers),
            reload_phases=dict(self.reload_phases),
            fetch_missing={k: list(v) for k, v in self.fetch_missing.items()},
            rejected=dict(self.rejected),
        )
        for what, n in other.rejected.items():  # each rank's own blocks: counts add up
            out.rejected[what] = out.rejected.get(what, 0) + n
        for job, keys in other.fetch_missing.items():
            out.fetch_missing.setdefault(job, []).extend(keys)
        for job, n in other.jobs_done.items():
            out.jobs_done[job] = out.jobs_done.get(job, 0) + n
        # Ranks move their shards in parallel: bytes add up, the slowest rank sets the time.
        for ref, (nbytes, seconds) in other.transfers.items():
            b0, s0 = out.transfers.get(ref, (0, 0.0))
            out.transfers[ref] = (b0 + nbytes, max(s0, seconds))
        for phase, seconds in other.reload_phases.items():
            out.reload_phases[phase] = max(out.reload_phases.get(phase, 0.0), seconds)
        return out
