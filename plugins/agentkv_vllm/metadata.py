"""What crosses between the scheduler-side and worker-side connectors each step.

Primitives:
  AgentKVStepMetadata    scheduler -> workers: the manager's StepPlan for one step
  AgentKVWorkerReport    workers -> scheduler: one rank's WorkerReport; ``aggregate`` merges ranks
                         (a job is complete when every TP rank counted it)

The payloads are the core's plain dataclasses (``agentkv.manager.jobs``); these wrappers only give
them the vLLM base classes. The multiprocessing executor pickles them between processes.

Most steps carry no agentkv job (plain traffic, or trajectories that are only decoding). Such a
step's metadata pickles to a reference to ``_empty_step`` instead of the dataclass tree, and the
worker binds nothing for it (``AgentKVConnector.bind_connector_metadata``): every step of every
request pays this, agentkv's or not (issue 26: a plain request must cost what it costs in vanilla).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from agentkv.manager.jobs import StepPlan, WorkerReport


@dataclass
class AgentKVStepMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)

    def __reduce__(self) -> tuple[object, ...]:
        if not self.plan:
            return (_empty_step, ())
        return (AgentKVStepMetadata, (self.plan,))


def _empty_step() -> AgentKVStepMetadata:
    return AgentKVStepMetadata(StepPlan())


@dataclass
class AgentKVWorkerReport(KVConnectorWorkerMetadata):
    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, AgentKVWorkerReport)
        return AgentKVWorkerReport(self.report.merge(other.report))
