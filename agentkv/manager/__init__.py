"""The one authority for agent trajectories and the KV blocks they hold (engine-agnostic).

Primitives (each in its own module):
    TrajectoryManager, ManagerConfig        the facade: engine hooks and control (core.py)
    RequestParams, LookupAnswer, LookupStatus   a request's lookup: HIT / MISS / PENDING
                                            (requests.py)
    BlockPinner, Clock, MonotonicClock      its ports (ports.py)
    StepPlan, StoreJob, LoadJob, MoveJob, MoveKind, TransferKind, DropOp, BlockTransfer,
    WorkerReport                            jobs and reports on the wire (jobs.py)
    JobKind                                 the job table's kinds (jobtable.py)
    TimerKind                               timers and leases (timers.py)
    PinOp                                   the pin ledger's queued ops (pins.py)
    ResidencyIndex                          tier residency (residency.py)
    BranchState, Branch, Trajectory, TurnStats, DemotedBy  trajectory state (state.py)
The other parts (transitions.py, pauses.py, ownership.py, views.py) are the facade's own;
core.py's docstring maps them.

Imports neither vllm nor torch: the vLLM plugin is a thin adapter over it, and tests drive it
with a simulated block pool and workers.
"""

from __future__ import annotations

from agentkv.manager.core import ManagerConfig, TrajectoryManager
from agentkv.manager.jobs import (
    BlockTransfer,
    DropOp,
    LoadJob,
    MoveJob,
    MoveKind,
    StepPlan,
    StoreJob,
    TransferKind,
    WorkerReport,
)
from agentkv.manager.jobtable import JobKind
from agentkv.manager.pins import PinOp
from agentkv.manager.ports import BlockPinner, Clock, MonotonicClock
from agentkv.manager.requests import LookupAnswer, LookupStatus, RequestParams
from agentkv.manager.residency import ResidencyIndex
from agentkv.manager.state import (
    PAUSED_STATES,
    Branch,
    BranchState,
    DemotedBy,
    Trajectory,
    TurnStats,
)
from agentkv.manager.timers import TimerKind

__all__ = [
    "PAUSED_STATES",
    "BlockPinner",
    "BlockTransfer",
    "Branch",
    "BranchState",
    "Clock",
    "DemotedBy",
    "DropOp",
    "JobKind",
    "LoadJob",
    "LookupAnswer",
    "LookupStatus",
    "ManagerConfig",
    "MonotonicClock",
    "MoveJob",
    "MoveKind",
    "PinOp",
    "RequestParams",
    "ResidencyIndex",
    "StepPlan",
    "StoreJob",
    "TimerKind",
    "Trajectory",
    "TrajectoryManager",
    "TransferKind",
    "TurnStats",
    "WorkerReport",
]
