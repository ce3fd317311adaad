"""The one authority for agent trajectories and the KV blocks they hold (engine-agnostic).

Primitives (each in its own module):
    TrajectoryManager, ManagerConfig, RequestParams, LookupAnswer   the state machine (core.py)
    BlockPinner, Clock, MonotonicClock                              its ports (ports.py)
    StepPlan, StoreJob, LoadJob, MoveJob, DropOp, BlockTransfer,
    WorkerReport                                                    jobs and reports (jobs.py)
    ResidencyIndex                                                  tier residency (residency.py)
    BranchState, Branch, Trajectory, TurnStats                      trajectory state (state.py)

Imports neither vllm nor torch: the vLLM plugin is a thin adapter over it, and tests drive it
with a simulated block pool and workers.
"""

from __future__ import annotations

from agentkv.manager.core import LookupAnswer, ManagerConfig, RequestParams, TrajectoryManager
from agentkv.manager.jobs import (
    BlockTransfer,
    DropOp,
    LoadJob,
    MoveJob,
    StepPlan,
    StoreJob,
    WorkerReport,
)
from agentkv.manager.ports import BlockPinner, Clock, MonotonicClock
from agentkv.manager.residency import ResidencyIndex
from agentkv.manager.state import PAUSED_STATES, Branch, BranchState, Trajectory, TurnStats

__all__ = [
    "PAUSED_STATES",
    "BlockPinner",
    "BlockTransfer",
    "Branch",
    "BranchState",
    "Clock",
    "DropOp",
    "LoadJob",
    "LookupAnswer",
    "ManagerConfig",
    "MonotonicClock",
    "MoveJob",
    "RequestParams",
    "ResidencyIndex",
    "StepPlan",
    "StoreJob",
    "Trajectory",
    "TrajectoryManager",
    "TurnStats",
    "WorkerReport",
]
